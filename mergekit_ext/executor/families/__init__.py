"""Model families the sequential executor can walk block by block.

A family is one small adapter class that says, for every architecture it covers, where the
transformer *backbone* sits inside the model class (``LlamaForCausalLM.model``,
``CLIPVisionModelWithProjection.vision_model``, or the class itself for a headless
``BertModel``), which modules run before the first block (embeddings), where the blocks
are, and the *linear groups* of one block in forward order (linears that read the same
input). Everything else (norms, biases, the final norm, pooler, heads) is merged with the
method's fallback.

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
    """One linear group of a block: a short label and the linears' module paths in the block."""

    label: str
    modules: tuple[str, ...]


class ModelFamily:
    """Describes one family of architectures to the executor (subclass per family)."""

    name: ClassVar[str]
    model_types: ClassVar[frozenset[str]]
    modality: ClassVar[Modality]
    # Paths of the block list inside the backbone; the first that exists is used.
    layers_paths: ClassVar[tuple[str, ...]]
    # Modules of the backbone that run before the first block.
    pre_block_modules: ClassVar[tuple[str, ...]]
    # Alternative group layouts (module names differ between transformers versions); the
    # first whose modules all exist in the block is used.
    group_layouts: ClassVar[tuple[tuple[GroupSpec, ...], ...]]
    # Classes whose instance is the backbone (searched in the model when set); otherwise the
    # model's ``base_model``.
    backbone_class_names: ClassVar[tuple[str, ...]] = ()
    # A causal language model: its output is next-token distributions over the vocabulary
    # (the model-output objective fits the per-token KL to each expert).
    causal_lm: ClassVar[bool] = False

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
        names = {name for name, _ in block.named_modules()}
        for layout in self.group_layouts:
            if all(m in names for g in layout for m in g.modules):
                for g in layout:
                    for m in g.modules:
                        if not isinstance(block.get_submodule(m), nn.Linear):
                            raise ModelInputError(
                                f"{type(block).__name__}.{m} is a {type(block.get_submodule(m)).__name__}, "
                                "not a torch.nn.Linear; the executor merges nn.Linear weights only"
                            )
                return layout
        raise ModelInputError(
            f"{type(block).__name__} has none of the linear layouts of the {self.name} family "
            f"({[[m for g in layout for m in g.modules] for layout in self.group_layouts]})"
        )

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
    _FAMILIES[cls.name] = cls
    return cls


def families() -> dict[str, type[ModelFamily]]:
    _load_builtin()
    return dict(_FAMILIES)


def family_names() -> str:
    return "; ".join(
        f"{name} ({', '.join(sorted(cls.model_types))})" for name, cls in sorted(families().items())
    )


def family_for(model_type: str, architecture: str = "") -> ModelFamily:
    """The family of a ``config.json`` ``model_type``; a clear error lists the supported ones."""
    for cls in families().values():
        if model_type in cls.model_types:
            return cls()
    raise ModelInputError(
        f"the sequential executor does not support model_type {model_type!r}"
        f"{f' ({architecture})' if architecture else ''}; supported families: {family_names()}. "
        "Use a tensor-wise method (e.g. ties, ace) for other architectures"
    )


def _load_builtin() -> None:
    from mergekit_ext.executor.families import bert, clip, llama, vit  # noqa: F401


__all__ = [
    "GroupSpec",
    "ModelFamily",
    "family_for",
    "family_names",
    "families",
    "register_family",
]
