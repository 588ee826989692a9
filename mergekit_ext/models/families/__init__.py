"""How the sequential executor walks a model: its backbone, blocks and linear groups.

A family says, for one model, where the transformer *backbone* sits inside the model class
(``LlamaForCausalLM.model``, ``CLIPVisionModelWithProjection.vision_model``, or the class
itself for a headless ``BertModel``), which modules run before the first block
(embeddings), where the blocks are, and the *linear groups* of each block in forward order
(linear layers that read the same input tensor). Everything else (norms, biases, the final
norm, pooler, heads) is merged with the method's fallback.

The structure is **discovered from the model itself** (:mod:`.discovery`, docs/methods.md
"Model structure"): the block list is the largest ``ModuleList`` of identical blocks in the
backbone, and one forward pass of the model's own class on a few dummy tokens (no weights:
parameters are stride-0 zeros, linear layers return zeros) records which modules run
before the first block and, per block, which linear-like layers (``nn.Linear``, GPT-2's
``Conv1D``, fused projections such as ``qkv_proj``) read the same input tensor, in the
order the block calls them. A family *file* exists only for what that cannot tell (each
says why); today :mod:`.clip`: which tower of a two-tower model the calibration data runs
through.

The executor never re-implements a forward pass: it builds the backbone with the model's
own transformers class (parameters on the meta device), runs the embeddings through the
backbone's own ``forward`` and captures the exact arguments (attention masks, rotary
position embeddings) transformers passes to each block. So masks, rotary embeddings and
attention are exactly transformers'.

Module paths here are the *module* names of the transformers class in use (transformers 5
renames some checkpoint keys at load time, e.g. ViT's ``attention.attention.query`` is the
module ``attention.q_proj``); the executor maps them back to checkpoint names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Optional

import torch
from torch import nn

from mergekit_ext.errors import ModelInputError

Modality = Literal["text", "image"]


@dataclass(frozen=True)
class GroupSpec:
    """One linear group of a block: a short label and the linears' module paths in the block.

    ``transposed``: the modules of the group whose weight is stored ``in x out`` (GPT-2's
    ``Conv1D``, ``y = x W + b``); the executor hands every weight to the methods as
    ``out x in`` and writes it back as stored.

    ``experts``: the group is one mixture-of-experts experts module (transformers 5's fused
    ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I]); each expert's two matrices are
    merged as linear groups of their own with the statistics of the tokens routed to it
    (:mod:`mergekit_ext.executor.moe`).

    ``reads``: when the group's linears run more than once in one forward of the block, what
    each call reads, in call order: ``"tokens"`` (one row per token of the block's input) or
    ``"table"`` (a tensor the backbone computes before the blocks and hands every block, such
    as DeBERTa's relative position embeddings: all of its rows, once per call); empty for
    the usual one call on the tokens (docs/methods.md, "Relative position tables").
    """

    label: str
    modules: tuple[str, ...]
    transposed: frozenset[str] = frozenset()
    experts: bool = False
    reads: tuple[str, ...] = ()


class ModelFamily:
    """Describes one model's structure to the executor.

    Declarations (class attributes) are optional: what is not declared is discovered from
    the model by :meth:`discover` (:mod:`.discovery`). A subclass registered with
    :func:`register_family` declares only what discovery cannot know.
    """

    name: str = ""
    model_types: frozenset[str] = frozenset()
    modality: Optional[Modality] = None
    # Paths of the block list inside the backbone; the first that exists is used.
    layers_paths: tuple[str, ...] = ()
    # Modules of the backbone whose tensors the embeddings pass needs (they run before the
    # first block).
    pre_block_modules: tuple[str, ...] = ()
    # Alternative group layouts; the first whose modules all exist in the block is used
    # (empty: discovered).
    group_layouts: tuple[tuple[GroupSpec, ...], ...] = ()
    # Classes whose instance is the backbone (searched in the model when set); otherwise the
    # model's ``base_model``.
    backbone_class_names: ClassVar[tuple[str, ...]] = ()
    # A causal language model: its output is next-token distributions over the vocabulary
    # (the model-output objective fits the per-token KL to each expert).
    causal_lm: bool = False
    # What a block returns: 0 a tensor, n a tuple of n whose first item is the hidden states
    # (the executor's block stand-ins return the same shape of result).
    block_returns: int = 0
    # The blocks hold mixture-of-experts experts modules (their checkpoint stores each expert
    # apart; the class holds them fused).
    fused_experts: bool = False
    # Discovered linear groups by block signature (see :func:`.discovery.block_signature`).
    _discovered_groups: Optional[dict[Any, tuple[GroupSpec, ...]]] = None

    @property
    def table_readers(self) -> tuple[str, ...]:
        """The discovered linears that also read a table handed to every block (DeBERTa-v3's
        ``query_proj``/``key_proj``; ``GroupSpec.reads``), block-relative paths."""
        groups = (self._discovered_groups or {}).values()
        return tuple(sorted({m for gs in groups for g in gs if g.reads for m in g.modules}))

    def discover(self, model: nn.Module, config: Any) -> ModelFamily:
        """Fill in, from ``model`` (the class built on the meta device), what is not declared."""
        from mergekit_ext.models.families.discovery import discover_structure

        discover_structure(self, model, config)
        return self

    def backbone_path(self, model: nn.Module) -> str:
        """Dotted path of the backbone module in ``model`` (``""`` for the model itself)."""
        if self.backbone_class_names:
            for path, module in model.named_modules():
                if type(module).__name__ in self.backbone_class_names:
                    return path
            raise ModelInputError(
                f"{type(model).__name__}: no {' / '.join(self.backbone_class_names)} module "
                f"inside; the {self.name} family cannot find the backbone"
            )
        base = getattr(model, "base_model", model)
        for path, module in model.named_modules():
            if module is base:
                return path
        return ""

    def layers_path(self, backbone: nn.Module) -> str:
        for path in self.layers_paths:
            try:
                module = backbone.get_submodule(path)
            except AttributeError:
                continue
            if isinstance(module, nn.ModuleList):
                return path
        raise ModelInputError(
            f"{type(backbone).__name__} has none of the block lists {list(self.layers_paths)} "
            f"expected by the {self.name} family; this transformers version lays it out differently"
        )

    def groups(self, block: nn.Module) -> tuple[GroupSpec, ...]:
        if self._discovered_groups is not None and not self.group_layouts:
            from mergekit_ext.models.families.discovery import block_signature

            found = self._discovered_groups.get(block_signature(block))
            if found is None:
                raise ModelInputError(
                    f"{type(block).__name__}: a block that the structure of the {self.name} "
                    "model was not discovered from (another configuration of the class?)"
                )
            return found
        names = {name for name, _ in block.named_modules()}
        for layout in self.group_layouts:
            if all(m in names for g in layout for m in g.modules):
                for g in layout:
                    for m in g.modules:
                        if not isinstance(block.get_submodule(m), nn.Linear):
                            raise ModelInputError(
                                f"{type(block).__name__}.{m} is a {type(block.get_submodule(m)).__name__}, "
                                "not a torch.nn.Linear; declare it in the group's `transposed` "
                                "if it is a Conv1D"
                            )
                return layout
        raise ModelInputError(
            f"{type(block).__name__} has none of the linear layouts of the {self.name} family "
            f"({[[m for g in layout for m in g.modules] for layout in self.group_layouts]})"
        )

    def structure(self) -> tuple[Any, ...]:
        """What the executor walks: two families with equal structures walk a model alike."""
        groups = (
            tuple(sorted(self._discovered_groups.values(), key=repr))
            if self._discovered_groups is not None
            else self.group_layouts
        )
        return (
            self.backbone_class_names,
            self.layers_paths,
            self.pre_block_modules,
            self.modality,
            self.block_returns,
            groups,
        )

    def is_pre_block(self, name: str) -> bool:
        """Whether the backbone tensor ``name`` belongs to a module that runs before the blocks."""
        return any(name == m or name.startswith(m + ".") for m in self.pre_block_modules)

    def wrap_block_output(self, hidden: torch.Tensor) -> Any:
        """``hidden`` as the block itself returns its result (a tensor or a tuple)."""
        if self.block_returns:
            return (hidden, *([None] * (self.block_returns - 1)))
        return hidden

    def forward_inputs(self, batch: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Keyword arguments of the backbone's ``forward`` for one calibration batch."""
        if self.modality == "image":
            if "pixel_values" not in batch:
                raise ModelInputError(f"the {self.name} family needs pixel_values batches")
            return {"pixel_values": batch["pixel_values"]}
        if "input_ids" not in batch:
            raise ModelInputError(f"the {self.name} family needs input_ids batches")
        inputs = {"input_ids": batch["input_ids"]}
        if batch.get("attention_mask") is not None:
            inputs["attention_mask"] = batch["attention_mask"]
        return inputs

    def token_mask(self, batch: Mapping[str, torch.Tensor]) -> Optional[torch.Tensor]:
        """``[B, T]`` mask of the positions that enter statistics (None: every position)."""
        if self.modality == "text" and batch.get("attention_mask") is not None:
            return batch["attention_mask"]
        return None


_FAMILIES: dict[str, type[ModelFamily]] = {}


def register_family(cls: type[ModelFamily]) -> type[ModelFamily]:
    """Register a family declaration for the ``model_types`` it lists."""
    _FAMILIES[cls.name] = cls
    return cls


def families() -> dict[str, type[ModelFamily]]:
    """The registered declarations (model types whose structure discovery alone cannot find)."""
    _load_builtin()
    return dict(_FAMILIES)


def family_names() -> str:
    return "; ".join(
        f"{name} ({', '.join(sorted(cls.model_types))})" for name, cls in sorted(families().items())
    )


def family_for(model_type: str, architecture: str = "") -> ModelFamily:
    """The declaration for a ``config.json`` ``model_type``: a registered family's, or an
    empty one named after the model type (everything is then discovered, :meth:`discover`)."""
    for cls in families().values():
        if model_type in cls.model_types:
            return cls()
    family = ModelFamily()
    family.name = model_type
    family.model_types = frozenset({model_type})
    return family


def discover_family(model: nn.Module, config: Any) -> ModelFamily:
    """The family of ``model`` (built on the meta device from ``config``): its model type's
    declaration, with everything not declared discovered from the model."""
    arch = (getattr(config, "architectures", None) or [""])[0]
    return family_for(config.model_type, arch).discover(model, config)


def _load_builtin() -> None:
    from mergekit_ext.models.families import clip  # noqa: F401


__all__ = [
    "GroupSpec",
    "ModelFamily",
    "discover_family",
    "family_for",
    "family_names",
    "families",
    "register_family",
]
