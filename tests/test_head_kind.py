"""The one home of "what does this model output" (models/head_kind.py) and its consumers:
SyMerge's losses (the kind confirmed on a forward pass), diagnose (next-token / class / none)
and the families' ``causal_lm`` flag agree on tiny models of several architectures."""

from __future__ import annotations

import random
from typing import Any, Optional

import pytest
import tiny_architectures
import tiny_models
import torch
import transformers

from mergekit_ext.adaptation.parameters import SyMergeParameters
from mergekit_ext.adaptation.run import adapt_session, prepare_symerge
from mergekit_ext.adaptation.trainer import output_tensor
from mergekit_ext.config import parse_config
from mergekit_ext.diagnose.diagnoser import _compared_output
from mergekit_ext.models.head_kind import (
    head_kind,
    is_causal_lm,
    is_causal_lm_class,
    observed_head_kind,
)

# (model type, class, config changes, output kind, what diagnose compares)
CASES: list[tuple[str, Optional[str], dict[str, Any], str, str]] = [
    ("llama", None, {}, "causal_lm", "next_token"),
    ("gpt2", None, {}, "causal_lm", "next_token"),  # …LMHeadModel, not …ForCausalLM
    ("llama", "LlamaModel", {}, "none", "none"),
    ("bert", None, {}, "classification", "class"),
    ("bert", "BertForTokenClassification", {}, "token_classification", "class"),
    ("bert", None, {"num_labels": 1}, "dense", "class"),  # regression: not one softmax
    ("bert", None, {"problem_type": "multi_label_classification"}, "dense", "class"),
    ("bert", "BertModel", {}, "none", "none"),
    ("vit", None, {}, "classification", "class"),
    ("clip", None, {}, "none", "none"),  # two towers, embeddings out
]


def _model(model_type: str, cls_name: Optional[str], changes: dict[str, Any]) -> torch.nn.Module:
    arch = tiny_architectures.ARCHITECTURES[model_type]
    config = arch.config()
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    return getattr(transformers, cls_name or arch.model_class)(config).eval()


def _inputs(model_type: str) -> dict[str, torch.Tensor]:
    if tiny_architectures.ARCHITECTURES[model_type].modality == "image":
        return {"pixel_values": torch.randn(2, 3, 16, 16)}
    ids = torch.tensor([[4, 7, 9, 11, 13], [4, 8, 10, 12, 14]])
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize(
    "model_type,cls_name,changes,kind,compared",
    CASES,
    ids=[f"{c[0]}-{c[1] or 'default'}-{c[3]}" for c in CASES],
)
def test_head_kind_of_tiny_architectures(model_type, cls_name, changes, kind, compared):
    model = _model(model_type, cls_name, changes)
    assert head_kind(model) == kind
    assert is_causal_lm(model) == (kind == "causal_lm") == is_causal_lm_class(type(model))
    assert _compared_output(model) == compared
    if model_type == "clip":  # needs text and images at once; its kind comes from the class
        return
    with torch.no_grad():
        output = output_tensor(model(**_inputs(model_type)))
    # SyMerge learns a bare body's hidden states (and single-output heads) as dense features
    assert observed_head_kind(model, output) == ("dense" if kind == "none" else kind)


def test_a_head_whose_output_does_not_fit_its_name_is_learned_as_dense():
    model = _model("bert", "BertForTokenClassification", {})
    assert head_kind(model) == "token_classification"
    per_sample = torch.zeros(2, 3)  # (B, C) where a token head gives (B, T, C)
    assert observed_head_kind(model, per_sample) == "dense"
    assert observed_head_kind(model, torch.zeros(2, 5, 3)) == "token_classification"


def test_a_causal_lm_class_without_a_linear_vocabulary_projection_is_not_a_causal_lm():
    model = _model("llama", None, {})
    model.lm_head = torch.nn.Identity()
    assert is_causal_lm_class(type(model))
    assert not is_causal_lm(model)
    assert head_kind(model) == "dense"


def test_symerge_treats_gpt2_as_a_causal_lm(tmp_path):
    """GPT-2's class is ``GPT2LMHeadModel``: SyMerge learns its next-token distributions (KL)
    in its last block, as for Llama, not its vocabulary logits as dense outputs in ``lm_head``."""
    paths = [tiny_architectures.build("gpt2", str(tmp_path / f"m{i}"), seed=i) for i in range(3)]
    data = tmp_path / "text.txt"
    rng = random.Random(1)
    data.write_text(
        "".join(" ".join(rng.choice(tiny_models.WORDS) for _ in range(6)) + "\n" for _ in range(16))
    )
    models = "".join(f"  - model: {p}\n" for p in paths[1:])
    text = (
        f"merge_method: symerge\nbase_model: {paths[0]}\n"
        f"calibration: {{path: {data}, samples: 16, max_length: 10}}\nmodels:\n{models}"
    )
    session = prepare_symerge(parse_config(text), SyMergeParameters(epochs=2, batch_size=8))
    section = adapt_session(session, progress=False)
    assert set(section["output_kinds"].values()) == {"causal_lm"}
    assert all(layers == ["transformer.h.1"] for layers in section["task_layers"].values())
