"""Architectures described by the tensors their checkpoints hold, for mergekit's planner.

transformers 5 holds the routed experts of Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 as
fused 3-D tensors (``mlp.experts.gate_up_proj`` [E, 2I, H]) but ``save_pretrained`` writes
them per expert (``block_sparse_moe.experts.0.w1.weight`` [I, H]), as the Hub's checkpoints
do. mergekit 0.1.5 names the fused in-memory tensors (its JSON definitions of Mixtral and
Qwen3-MoE) or infers the layout from the in-memory ``state_dict`` (Qwen2-MoE, DeepSeek-V3),
so a tensor-wise merge wrote the fused layout, merged the fused tensors as one 3-D block
(ACE fell back to a plain mean), and for DeepSeek-V3 wrote no routed expert at all.

:class:`CheckpointLayoutModule` lists, for a model's config, exactly the tensors
``save_pretrained`` of its class writes (:func:`mergekit_ext.models.model_class.saved_state_dict`,
on the meta device): mergekit then reads each per-expert matrix under its checkpoint name,
merges it as the matrix it is, and writes it under that name. The module's metadata comes
from the class too: the input/output embeddings' vocabulary axis, and the class's tied
weights (``lm_head.weight`` → ``model.embed_tokens.weight``) as optional with ``tied_names``,
as mergekit's own JSON definitions mark them. See docs/methods.md, "Output completeness".

LLaVA is the other case: transformers 5 renames its checkpoint's ``language_model.model.``
tensors to ``model.language_model.`` on load and back on save, and mergekit 0.1.5 infers the
layout from the in-memory names, so it read and wrote the vision tower and projector only
(the output's language model was random on load). transformers only *renames* LLaVA's
tensors, so its layout here names each weight as mergekit does (the in-memory name, which
transformers loads too) with the checkpoint's name as alias: mergekit reads every tensor
and writes what mergekit writes plus the language model (:data:`IN_MEMORY_NAMES`). Its
config (``LlavaConfig``) has no ``num_hidden_layers``: the layer count is the layout's own
(``max(layer index) + 1``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import ClassVar, Optional

import torch
import transformers
from mergekit.architecture.auto import infer_vocabulary_axes
from mergekit.architecture.base import (
    ModelArchitecture,
    ModuleArchitecture,
    ModuleDefinition,
    WeightInfo,
)
from pydantic import BaseModel
from transformers import PretrainedConfig

from mergekit_ext.models import model_class

LOG = logging.getLogger(__name__)

# Class name -> model_type of the classes whose in-memory layout (transformers 5) differs
# from their checkpoint's; add a class here when transformers fuses its weights on load.
CHECKPOINT_LAYOUT_CLASSES: dict[str, str] = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "LlavaForConditionalGeneration": "llava",
}

# A checkpoint name that only the layout ``save_pretrained`` writes holds, per class: the
# checkpoint layout applies when the checkpoint that sets the output's layout has one; a
# checkpoint saved in the in-memory layout (``mlp.experts.gate_up_proj``,
# ``model.language_model.``, as mergekit itself writes) gets mergekit's own definition.
_PER_EXPERT = re.compile(r"\.experts\.\d+\.")  # block_sparse_moe.experts.0.w1.weight
CHECKPOINT_NAMES: dict[str, re.Pattern[str]] = {
    "MixtralForCausalLM": _PER_EXPERT,
    "Qwen2MoeForCausalLM": _PER_EXPERT,
    "Qwen3MoeForCausalLM": _PER_EXPERT,
    "DeepseekV3ForCausalLM": _PER_EXPERT,
    "LlavaForConditionalGeneration": re.compile(r"^language_model\.model\."),
}


# Classes whose checkpoint names transformers only renames on load (no fused tensor): their
# layout writes the in-memory names, as mergekit's inferred definition and output do, read
# from the checkpoint's names through aliases; mergekit's own tests check its names.
IN_MEMORY_NAMES = frozenset({"LlavaForConditionalGeneration"})


def in_checkpoint_layout(architecture: str, checkpoint_names: Iterable[str]) -> bool:
    """Whether ``checkpoint_names`` (a checkpoint of ``architecture``) are in the layout
    ``save_pretrained`` writes, where it differs from the in-memory one mergekit names."""
    pattern = CHECKPOINT_NAMES.get(architecture)
    return pattern is not None and any(pattern.search(n) for n in checkpoint_names)


_LAYER_INDEX = re.compile(
    r"\.(\d+)\."
)  # the first index in a name is the layer's (mergekit's rule)


@dataclass
class _Layout:
    pre: list[WeightInfo] = field(default_factory=list)
    layers: dict[int, list[WeightInfo]] = field(default_factory=dict)
    post: list[WeightInfo] = field(default_factory=list)


_CACHE: dict[tuple[str, str], _Layout] = {}
_CACHE_SIZE = 16


def _weight_info(
    name: str, vocab_axes: dict[str, int], tied: dict[str, str], alias: Optional[str] = None
) -> WeightInfo:
    if alias is not None:
        # mergekit 0.1.5's planner cannot take aliases on an optional weight (list + tuple),
        # so an untied head is required, read through its alias; a tied one is not saved
        return WeightInfo(name=name, vocabulary_axis=vocab_axes.get(name), aliases=(alias,))
    if name in tied:
        return WeightInfo(
            name=name,
            vocabulary_axis=vocab_axes.get(name),
            optional=True,
            tied_names=(tied[name],),
        )
    return WeightInfo(name=name, vocabulary_axis=vocab_axes.get(name))


def checkpoint_layout(architecture: str, config: PretrainedConfig) -> _Layout:
    """The checkpoint tensors of ``architecture`` for ``config``, split as mergekit wants them.

    Args:
        architecture: a transformers class name (``MixtralForCausalLM``).
        config: the model's config (a merge's output config for ``slices:``).

    Returns:
        The weights before the first layer, per layer index, and after the last layer, in
        the order of the class's ``state_dict``.
    """
    key = (architecture, config.to_json_string())
    if key in _CACHE:
        return _CACHE[key]
    cls = getattr(transformers, architecture)
    with torch.device("meta"):
        model = cls(config)
    memory_order = {name: i for i, name in enumerate(model.state_dict())}
    vocab_axes = infer_vocabulary_axes(model)
    declared = getattr(cls, "_tied_weights_keys", None)
    tied = dict(declared) if isinstance(declared, dict) else {}
    saved = model_class.saved_state_dict(model)
    aliases: dict[str, str] = {}
    if architecture in IN_MEMORY_NAMES:
        memory_names = model_class.rename_to_module_keys(model, saved)  # checkpoint -> memory
        tie = getattr(config.get_text_config(), "tie_word_embeddings", False)
        aliases = {m: c for c, m in memory_names.items() if m != c and not (tie and m in tied)}
        saved = {memory_names.get(n, n): t for n, t in saved.items()}
    first_layer = min(
        (memory_order[n] for n in memory_order if _LAYER_INDEX.search(n)), default=None
    )
    layout = _Layout()
    names = sorted(saved, key=lambda n: memory_order.get(n, len(memory_order)))
    for name in names:
        info = _weight_info(name, vocab_axes, tied, aliases.get(name))
        if match := _LAYER_INDEX.search(name):
            layout.layers.setdefault(int(match.group(1)), []).append(info)
        elif first_layer is not None and memory_order.get(name, len(memory_order)) < first_layer:
            layout.pre.append(info)
        else:
            layout.post.append(info)
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.clear()
    _CACHE[key] = layout
    return layout


class CheckpointLayoutModule(ModuleArchitecture, BaseModel, frozen=True):
    """mergekit module architecture: the tensors ``save_pretrained`` of ``architecture`` writes."""

    NUM_LAYERS_KEY: ClassVar[str] = "num_hidden_layers"
    architecture: str

    def name(self) -> str:
        return f"{self.architecture} (checkpoint layout)"

    def pre_weights(self, config: PretrainedConfig) -> list[WeightInfo]:
        return list(checkpoint_layout(self.architecture, config).pre)

    def post_weights(self, config: PretrainedConfig) -> list[WeightInfo]:
        return list(checkpoint_layout(self.architecture, config).post)

    def num_layers_config_key(self) -> str:
        return self.NUM_LAYERS_KEY

    def num_layers(self, config: PretrainedConfig) -> int:
        if getattr(config, self.NUM_LAYERS_KEY, None) is None:
            # a composite config (LlavaConfig: text and vision sub-configs) has no count of
            # its own; the layout's layers are the union of the sub-models' at each index
            layers = checkpoint_layout(self.architecture, config).layers
            return max(layers, default=-1) + 1
        return super().num_layers(config)

    def layer_weights(self, index: int, config: PretrainedConfig) -> Optional[list[WeightInfo]]:
        layers = checkpoint_layout(self.architecture, config).layers
        has_count = getattr(config, self.NUM_LAYERS_KEY, None) is not None
        if index not in layers and has_count and index >= self.num_layers(config):
            # ``slices:`` may ask past the config's layers: describe a deeper model
            deeper = config.__class__.from_dict(
                {**config.to_dict(), self.NUM_LAYERS_KEY: index + 1}
            )
            layers = checkpoint_layout(self.architecture, deeper).layers
        return list(layers.get(index, []))


def checkpoint_layout_architectures(
    checkpoint_names: Optional[Iterable[str]] = None,
) -> list[ModelArchitecture]:
    """One mergekit :class:`ModelArchitecture` per class of :data:`CHECKPOINT_LAYOUT_CLASSES`
    that this transformers version has.

    Args:
        checkpoint_names: when given, only the classes whose checkpoint layout these names
            are in (:func:`in_checkpoint_layout`).
    """
    names = None if checkpoint_names is None else frozenset(checkpoint_names)
    out = []
    for name, model_type in CHECKPOINT_LAYOUT_CLASSES.items():
        if names is not None and not in_checkpoint_layout(name, names):
            continue
        if getattr(transformers, name, None) is None:
            LOG.debug("transformers has no %s; its checkpoint layout is not registered", name)
            continue
        module = CheckpointLayoutModule(architecture=name)
        out.append(
            ModelArchitecture(
                modules={"default": ModuleDefinition(architecture=module)},
                architectures=[name],
                model_type=model_type,
            )
        )
    return out
