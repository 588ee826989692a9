"""Llama-style decoders: Llama, Mistral, Qwen2, Qwen3 (Qwen3's q_norm/k_norm are non-linear tensors).

Block ``model.layers.{i}``: ``[q_proj, k_proj, v_proj] -> o_proj -> [gate_proj, up_proj] -> down_proj``.
"""

from __future__ import annotations

from mergekit_ext.executor.families import GroupSpec, ModelFamily, register_family


@register_family
class LlamaFamily(ModelFamily):
    name = "llama"
    model_types = frozenset({"llama", "mistral", "qwen2", "qwen3"})
    modality = "text"
    causal_lm = True
    layers_paths = ("layers",)
    pre_block_modules = ("embed_tokens",)
    group_layouts = (
        (
            GroupSpec("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            GroupSpec("o_proj", ("self_attn.o_proj",)),
            GroupSpec("gate_up", ("mlp.gate_proj", "mlp.up_proj")),
            GroupSpec("down_proj", ("mlp.down_proj",)),
        ),
    )
