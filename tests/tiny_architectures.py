"""Tiny random checkpoints (hidden 64, 2 layers) of the transformers model types the
community merges, built from transformers' own config classes.

``ARCHITECTURES[model_type]`` gives the config factory, the model class saved (the one Hub
checkpoints of that type usually hold) and the modality. :func:`build` saves one with the
tiny word-level tokenizer (text) or an image processor (images).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import transformers

from mergekit_ext import testing

HIDDEN = 64
LAYERS = 2
VOCAB = testing.VOCAB_SIZE


def _decoder(cls_name: str, **extra: Any) -> Callable[[], transformers.PretrainedConfig]:
    def make() -> transformers.PretrainedConfig:
        kw: dict[str, Any] = dict(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            pad_token_id=0,
            bos_token_id=4,
            eos_token_id=5,
        )
        kw.update(extra)
        return getattr(transformers, cls_name)(**kw)

    return make


def _encoder(cls_name: str, **extra: Any) -> Callable[[], transformers.PretrainedConfig]:
    def make() -> transformers.PretrainedConfig:
        kw: dict[str, Any] = dict(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=2 * HIDDEN,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            max_position_embeddings=68,
            num_labels=3,
            pad_token_id=0,
        )
        kw.update(extra)
        return getattr(transformers, cls_name)(**kw)

    return make


def _vision(**extra: Any) -> dict[str, Any]:
    kw = dict(
        image_size=16,
        patch_size=4,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
    )
    kw.update(extra)
    return kw


def _text_tower(**extra: Any) -> dict[str, Any]:
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        max_position_embeddings=32,
        pad_token_id=0,
        bos_token_id=4,
        eos_token_id=5,
    )
    kw.update(extra)
    return kw


def _gpt2() -> transformers.PretrainedConfig:
    return transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_inner=2 * HIDDEN, n_layer=LAYERS, n_head=4, n_positions=64,
        bos_token_id=4, eos_token_id=5, pad_token_id=0,
    )  # fmt: skip


def _t5() -> transformers.PretrainedConfig:
    return transformers.T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=16, d_ff=2 * HIDDEN, num_layers=LAYERS,
        num_heads=4, pad_token_id=0, eos_token_id=5, decoder_start_token_id=0,
    )  # fmt: skip


@dataclass(frozen=True)
class Architecture:
    config: Callable[[], transformers.PretrainedConfig]
    model_class: str
    modality: str  # "text" | "image"
    tokenizer: str = "llama"  # the tiny tokenizer's style ("llama" | "bert")
    title: str = ""  # the table's row name when not the key (a variant of a model type)


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(_decoder("LlamaConfig"), "LlamaForCausalLM", "text"),
    "mistral": Architecture(_decoder("MistralConfig"), "MistralForCausalLM", "text"),
    "qwen2": Architecture(_decoder("Qwen2Config"), "Qwen2ForCausalLM", "text"),
    "qwen3": Architecture(_decoder("Qwen3Config", head_dim=16), "Qwen3ForCausalLM", "text"),
    "gemma": Architecture(_decoder("GemmaConfig", head_dim=16), "GemmaForCausalLM", "text"),
    "gemma2": Architecture(
        _decoder("Gemma2Config", head_dim=16, query_pre_attn_scalar=16, sliding_window=4),
        "Gemma2ForCausalLM",
        "text",
    ),
    "gemma3_text": Architecture(
        _decoder("Gemma3TextConfig", head_dim=16, sliding_window=4),
        "Gemma3ForCausalLM",
        "text",
    ),
    "phi": Architecture(_decoder("PhiConfig"), "PhiForCausalLM", "text"),
    "phi3": Architecture(_decoder("Phi3Config"), "Phi3ForCausalLM", "text"),
    "olmo2": Architecture(_decoder("Olmo2Config"), "Olmo2ForCausalLM", "text"),
    "granite": Architecture(_decoder("GraniteConfig"), "GraniteForCausalLM", "text"),
    "starcoder2": Architecture(_decoder("Starcoder2Config"), "Starcoder2ForCausalLM", "text"),
    "stablelm": Architecture(_decoder("StableLmConfig"), "StableLmForCausalLM", "text"),
    "cohere": Architecture(_decoder("CohereConfig"), "CohereForCausalLM", "text"),
    "gpt2": Architecture(_gpt2, "GPT2LMHeadModel", "text"),
    "gpt_neox": Architecture(
        _decoder("GPTNeoXConfig", num_key_value_heads=None), "GPTNeoXForCausalLM", "text"
    ),
    "falcon": Architecture(
        _decoder("FalconConfig", num_key_value_heads=None, new_decoder_architecture=False),
        "FalconForCausalLM",
        "text",
    ),
    "bert": Architecture(_encoder("BertConfig"), "BertForSequenceClassification", "text", "bert"),
    "roberta": Architecture(
        _encoder("RobertaConfig"), "RobertaForSequenceClassification", "text", "bert"
    ),
    "deberta-v2": Architecture(
        _encoder(
            "DebertaV2Config",
            relative_attention=True,
            pos_att_type=["p2c", "c2p"],
            position_buckets=8,
            max_relative_positions=16,
            norm_rel_ebd="layer_norm",
            share_att_key=True,  # as DeBERTa-v3 checkpoints
        ),
        "DebertaV2ForSequenceClassification",
        "text",
        "bert",
        title="deberta-v2 (DeBERTa-v3's relative attention)",
    ),
    "deberta-v2-absolute": Architecture(
        _encoder("DebertaV2Config", relative_attention=False, position_biased_input=True),
        "DebertaV2ForSequenceClassification",
        "text",
        "bert",
        title="deberta-v2 (no relative attention)",
    ),
    "vit": Architecture(
        lambda: transformers.ViTConfig(num_labels=3, **_vision()),
        "ViTForImageClassification",
        "image",
    ),
    "clip": Architecture(
        lambda: transformers.CLIPConfig(
            text_config=_text_tower(projection_dim=16),
            vision_config=_vision(projection_dim=16),
            projection_dim=16,
        ),
        "CLIPModel",
        "image",
    ),
    "siglip": Architecture(
        lambda: transformers.SiglipConfig(text_config=_text_tower(), vision_config=_vision()),
        "SiglipModel",
        "image",
    ),
    "t5": Architecture(_t5, "T5ForConditionalGeneration", "text"),
    # mixture-of-experts (each routed expert solved on the tokens routed to it)
    "mixtral": Architecture(
        _decoder("MixtralConfig", num_local_experts=4, num_experts_per_tok=2),
        "MixtralForCausalLM",
        "text",
    ),
    "qwen2_moe": Architecture(
        _decoder(
            "Qwen2MoeConfig",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
        ),
        "Qwen2MoeForCausalLM",
        "text",
    ),
    "qwen3_moe": Architecture(
        _decoder(
            "Qwen3MoeConfig",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            head_dim=16,
        ),
        "Qwen3MoeForCausalLM",
        "text",
    ),
    "deepseek_v3": Architecture(
        _decoder(
            "DeepseekV3Config",
            # as in DeepSeek-V3 itself: MLA repeats no key/value head (with 2 the attention
            # of transformers 5 fails on a batch of several samples)
            num_key_value_heads=4,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
        ),
        "DeepseekV3ForCausalLM",
        "text",
    ),
}


def build(model_type: str, path: str, seed: int = 0) -> str:
    """Save a tiny random ``model_type`` checkpoint (with tokenizer / processor) into ``path``."""
    arch = ARCHITECTURES[model_type]
    torch.manual_seed(seed)
    model = getattr(transformers, arch.model_class)(arch.config())
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if arch.modality == "text":
        testing._tokenizer(arch.tokenizer).save_pretrained(path)
    else:
        transformers.CLIPImageProcessor(
            size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}
        ).save_pretrained(path)
    return path


def outputs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's logits (or image features for a two-tower model) on one batch."""
    if "pixel_values" in batch:
        if hasattr(model, "get_image_features"):
            out = model.get_image_features(pixel_values=batch["pixel_values"])
            return out if isinstance(out, torch.Tensor) else out.pooler_output
        return model(pixel_values=batch["pixel_values"]).logits
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


# ------------------------------------------------------------------------------------------
# The coverage table (tests/test_architecture_coverage.py checks every cell)

METHODS = ("regmean", "chain_of_merges", "qp_projection")

# model type -> None (merged by every method in METHODS) or the refusal (a regex of the
# planning error, raised before any weight loads).
EXPECTED: dict[str, str | None] = {
    **{
        t: None
        for t in (
            "llama",
            "mistral",
            "qwen2",
            "qwen3",
            "gemma",
            "gemma2",
            "gemma3_text",
            "phi",
            "phi3",
            "olmo2",
            "granite",
            "starcoder2",
            "stablelm",
            "cohere",
            "gpt2",
            "gpt_neox",
            "falcon",
            "bert",
            "roberta",
            "deberta-v2",
            "deberta-v2-absolute",
            "vit",
            "clip",
            "siglip",
            "mixtral",
            "qwen2_moe",
            "qwen3_moe",
            "deepseek_v3",
        )
    },  # fmt: skip
    "t5": r"is an encoder-decoder model",
}

# QP's ``objective: model_output``, checked on one type per structural feature (standard
# decoder, soft-capped/sliding attention, parallel block with a head bias, fused
# projections, Conv1D, fused query_key_value, encoders, a relative-position table, images,
# two towers, routed experts) to keep the test near 20 s; every supported type passed it once.
MODEL_OUTPUT_TYPES = [
    "llama", "gemma2", "phi", "phi3", "gpt2", "gpt_neox", "falcon", "bert",
    "deberta-v2", "deberta-v2-absolute", "vit", "clip", "mixtral",
]  # fmt: skip
# model type -> the refusal (a regex) of the model-output objective, raised while planning
MODEL_OUTPUT_REFUSED = {
    **{t: "mixture-of-experts" for t in ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")},
    "deberta-v2": r"query_proj.*relative position table",
}

_WHY = {
    "t5": "refused: encoder-decoder; the decoder's cross-attention reads the merged "
    "encoder's output, which the one-stack block walk does not carry",
}


def coverage_markdown() -> str:
    """docs/coverage.md: the model types × data-aware methods table of :data:`EXPECTED`."""
    lines = [
        "# Data-aware merging: model coverage",
        "",
        "<!-- generated by `python tests/tiny_architectures.py` from the table that "
        "tests/test_architecture_coverage.py checks; do not edit -->",
        "",
        "Tiny random checkpoints (hidden 64, 2 layers) of each model type, a base and two "
        "experts, merged through `mergekit-ext run` with calibration data. ✓: the merge "
        "loads with transformers and gives finite outputs (RegMean also equals a "
        "whole-model closed-form reference for gemma2, phi3, gpt2, bert, deberta-v2 "
        "(relative attention) and, per routed "
        "expert, mixtral). Refused: the "
        "plan stops before any weight loads, saying why; `ties`, `ace` (tensor-wise) and "
        "`symerge` are the alternatives it names. Blocks and linear groups are discovered "
        'from the model itself (docs/methods.md, "Model structure").',
        "",
        "| model type | class | "
        + " | ".join(f"`{m}`" for m in METHODS)
        + " | `diagnose` | `qp_projection` `objective: model_output` |",
        "|---|---|" + "---|" * (len(METHODS) + 2),
    ]
    for model_type, refusal in EXPECTED.items():
        arch = ARCHITECTURES[model_type]
        cell = "✓" if refusal is None else "refused"
        if refusal is not None or model_type in MODEL_OUTPUT_REFUSED:
            output = "refused"
        else:
            output = "✓" if model_type in MODEL_OUTPUT_TYPES else "(✓)"
        row = f"| {arch.title or model_type} | {arch.model_class} | "
        lines.append(
            row + " | ".join([cell] * len(METHODS)) + f" | {cell if refusal is None else '—'}"
            f" | {output} |"
        )
    lines += ["", "Refusals:", ""]
    lines += [f"- **{t}**: {why}." for t, why in _WHY.items()]
    lines += [
        "- **`objective: model_output`**: mixture-of-experts experts modules (the fit perturbs "
        "one linear module's output; the experts are one 3-D tensor per block) and DeBERTa-v3's "
        "`query_proj`/`key_proj` (their table output is shared by the batch's samples, the fit "
        "needs each sample's Jacobian); docs/methods.md says what lifting each costs.",
        "",
        "`qp_projection` in the method columns is checked with its default `objective: "
        "layer_output`. `diagnose` runs on a RegMean merge of each supported type (every block "
        "compared with each expert). `objective: model_output`: ✓ checked by the test on one "
        "type per structure; (✓) passed when the test covered every supported type, not in "
        "the per-commit subset; refused while planning, saying why.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    target = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "docs")
    with open(os.path.join(target, "coverage.md"), "w", encoding="utf-8") as fp:
        fp.write(coverage_markdown())
    print(os.path.normpath(os.path.join(target, "coverage.md")))
