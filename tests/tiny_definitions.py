"""Tiny random checkpoints of every class mergekit 0.1.5 ships a definition for, and LLaVA.

The classes are read from mergekit's own ``_data/architectures/*.json`` (their
``architectures`` lists), so a class mergekit adds is covered without editing this file.
Each config is the class's default config with every size field shrunk (hidden 32, 2
layers, vocabulary 64, 16-pixel images); fields derived from the layer count
(``layer_types``) are dropped so that the config class derives them again.

:data:`NOT_BUILT` lists the classes that are not built, with why (remote code: transformers
has no class of that name).
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import torch
import transformers
from mergekit.architecture import json_definitions

DEFINITIONS = os.path.join(
    os.path.dirname(json_definitions.__file__), "..", "_data", "architectures"
)

# the size fields of transformers' configs, as small as the classes allow
TINY: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, vocab_size=64, max_position_embeddings=64,
    n_embd=32, n_layer=2, n_head=4, n_inner=64, n_positions=64,
    d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4, num_decoder_layers=2,
    dim=32, hidden_dim=64, n_layers=2, n_heads=4,
    encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
    encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16, max_target_positions=32,
    num_mel_bins=8, image_size=16, patch_size=4, depth=2, embed_dim=32, out_hidden_size=32,
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=16, shared_expert_intermediate_size=32, first_k_dense_replace=1,
    n_group=1, topk_group=1, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4,
    v_head_dim=8, state_size=4, time_step_rank=4, conv_kernel=2, mamba_d_state=4,
    mamba_n_heads=4, mamba_d_head=16, projection_dim=16, sliding_window=8,
    vision_output_dim=32, projector_input_dim=32, projector_output_dim=32, ffn_hidden_size=64,
    query_pre_attn_scalar=8, type_vocab_size=2, intermediate_size_mlp=64,
    pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=0,
    start_token_id=3, image_token_index=60, image_token_id=60, video_token_id=61,
    vision_start_token_id=62, vision_end_token_id=63, boi_token_index=58, eoi_token_index=59,
)  # fmt: skip
# derived from the layer count or naming the class: the config class sets them again
DROP = {"layer_types", "full_attn_idxs", "layers_block_type", "no_rope_layers", "moe_layers"}
DROP |= {"transformers_version", "architectures"}

NOT_BUILT: dict[str, str] = {}  # class name -> why (filled by :func:`classes`)


def classes() -> list[str]:
    """Every class named in mergekit's definitions that transformers has, then LLaVA
    (mergekit infers its layout; its own test suite merges a tiny one)."""
    names: list[str] = []
    for path in sorted(glob.glob(os.path.join(DEFINITIONS, "*.json"))):
        with open(path, encoding="utf-8") as fp:
            for name in json.load(fp).get("architectures") or []:
                if getattr(transformers, name, None) is None:
                    NOT_BUILT[name] = (
                        f"remote code ({os.path.basename(path)}): transformers has no {name}"
                    )
                elif name not in names:
                    names.append(name)
    return names + ["LlavaForConditionalGeneration"]


def _shrink(fields: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if key in DROP:
            continue
        if isinstance(value, dict) and "model_type" in value:  # a sub-config
            out[key] = _shrink(value)
        elif key in TINY and value is not None and not isinstance(value, (list, dict)):
            out[key] = TINY[key]
        else:
            out[key] = value
    return out


def tiny_config(name: str) -> transformers.PretrainedConfig:
    """The default config of class ``name`` (its tying included), every size field shrunk."""
    cls = getattr(transformers, name).config_class
    return cls.from_dict(_shrink(cls().to_dict()))


def build(name: str, path: str, seed: int) -> str:
    """Save a tiny random checkpoint of class ``name`` into ``path`` (``save_pretrained``)."""
    torch.manual_seed(seed)
    model = getattr(transformers, name)(tiny_config(name))
    model.save_pretrained(path)
    return path
