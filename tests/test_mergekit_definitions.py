"""Whole-model merges through mergekit for every supported architecture.

For tiny Llama, BERT (two classes), ViT (two classes), CLIP vision (two classes) and a whole
CLIPModel, a merge with ``task_arithmetic``, ``ace`` and ``ties`` through
``mergekit.merge.run_merge`` must write every tensor of the base checkpoint, each the merge of
its inputs (checked against an independent computation), and the output must load into its
transformers class and give finite outputs.
"""

from __future__ import annotations

import glob
import json
import os
import shutil

import pytest
import torch
import transformers
from mergekit.architecture import arch_info_for_config
from mergekit.architecture import json_definitions as mk_json
from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions
from safetensors.torch import load_file, save_file

import mergekit_ext  # noqa: F401  (registers the methods)
from mergekit_ext import merge_record
from mergekit_ext.methods.ace import ace_merge_simple, ace_merge_tensor
from mergekit_ext.models.mergekit_definitions import (
    layout_tensor_names,
    our_architectures,
    our_definitions,
)

SETS = [
    "tiny_llama_set",
    "tiny_bert_set",
    "tiny_bert_classifier_set",
    "tiny_vit_set",
    "tiny_vit_model_set",
    "tiny_clip_vision_set",
    "tiny_clip_vision_projection_set",
    "tiny_clip_set",
]
# Classes that mergekit-ext itself defines or repairs (the others come from mergekit as is).
OWN_DEFINITIONS = {
    "BertModel",
    "ViTModel",
    "ViTForImageClassification",
    "CLIPVisionModel",
    "CLIPVisionModelWithProjection",
    "CLIPModel",
    # checkpoint layout (per-expert tensors; mergekit names transformers 5's fused ones)
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "DeepseekV3ForCausalLM",
}
TASK_WEIGHTS = (0.6, 0.3, 1.2)


def load_tensors(folder: str) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        tensors.update(load_file(path))
    assert tensors, f"no safetensors in {folder}"
    return tensors


def merge(tiny, method: str, out: str, parameters=None, model_parameters=None) -> str:
    config = MergeConfiguration.model_validate(
        {
            "merge_method": method,
            "base_model": tiny.base,
            "models": [
                {"model": expert, **({"parameters": p} if p else {})}
                for expert, p in zip(tiny.experts, model_parameters or [None] * 3)
            ],
            "parameters": parameters or {},
            "dtype": "float32",
        }
    )
    # mergekit's own run_merge, given our definitions as mergekit-ext's runs give them
    with our_architectures(layout_tensor_names(tiny.base)):
        run_merge(
            config,
            out,
            MergeOptions(write_model_card=False, copy_tokenizer=False, quiet=True, random_seed=0),
        )
    return out


def is_ace_linear(name: str, tensor: torch.Tensor) -> bool:
    """docs/methods.md § ACE: 2-D linear maps get the covariance merge; embedding tables and the
    vocabulary head (lookup tables whose input axis is the vocabulary) get the mean."""
    return tensor.ndim == 2 and "embed" not in name and "lm_head" not in name


def _model_inputs(architecture: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(6, 128, (2, 7), generator=gen)
    pixels = torch.randn(2, 3, 16, 16, generator=gen)
    if architecture.startswith(("Llama", "Bert")):
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if architecture == "CLIPModel":
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}
    return {"pixel_values": pixels}


def _float_leaves(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() else []
    if hasattr(value, "to_tuple"):
        value = value.to_tuple()
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _float_leaves(v)]
    return []


def assert_loads_and_runs(out: str, architecture: str) -> None:
    """The output loads into its transformers class with no missing/unexpected keys and runs."""
    with open(os.path.join(out, "config.json"), encoding="utf-8") as fp:
        assert json.load(fp)["architectures"] == [architecture]
    cls = getattr(transformers, architecture)
    model, info = cls.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"], info
    assert not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    with torch.no_grad():
        outputs = model.eval()(**_model_inputs(architecture))
    leaves = _float_leaves(outputs)
    assert leaves and all(torch.isfinite(t).all() for t in leaves)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The tiny matrices here gain nothing from intra-op threads; on a busy shared CPU two
    OpenMP threads made each tiny ACE solve ~15x slower (measured: 1 ms vs 15 ms CPU)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(params=SETS)
def tiny(request):
    return request.getfixturevalue(request.param)


def test_task_arithmetic_is_exact_for_every_tensor(tiny, tmp_path) -> None:
    out = merge(
        tiny,
        "task_arithmetic",
        str(tmp_path / "out"),
        model_parameters=[{"weight": w} for w in TASK_WEIGHTS],
    )
    base = load_tensors(tiny.base)
    experts = [load_tensors(e) for e in tiny.experts]
    merged = load_tensors(out)
    assert set(merged) == set(base)
    for name, w0 in base.items():
        # W = W_0 + Σ_k λ_k (W_k − W_0), in float64.
        expected = w0.double() + sum(
            lam * (e[name].double() - w0.double()) for lam, e in zip(TASK_WEIGHTS, experts)
        )
        assert merged[name].shape == w0.shape, name
        torch.testing.assert_close(
            merged[name].double(), expected, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )
        assert not torch.equal(merged[name], w0), f"{name} was copied from the base"
    assert_loads_and_runs(out, tiny.architecture)


def check_ace_merge(tiny, out: str, normalize: str) -> None:
    """Merge with ACE and compare every output tensor with the pure functions of ace.py."""
    params = {"eps": 0.01, "k_frac": 0.3, "gamma_threshold": 0.3, "normalize": normalize}
    with merge_record.collecting() as recorder:
        merge(tiny, "ace", out, parameters=params)
    base = load_tensors(tiny.base)
    experts = [load_tensors(e) for e in tiny.experts]
    merged = load_tensors(out)
    assert set(merged) == set(base)
    linear = {name for name, t in base.items() if is_ace_linear(name, t)}
    assert linear, "no linear weight found"
    for name, w0 in base.items():
        inputs = [e[name] for e in experts]
        simple = ace_merge_simple(w0, inputs, name=name)
        if name in linear:
            expected, _ = ace_merge_tensor(w0, inputs, name=name, **params)
            # The covariance merge really ran (it differs from the plain mean of task vectors).
            assert not torch.allclose(expected, simple, rtol=1e-4, atol=1e-6), name
        else:
            expected = simple
        torch.testing.assert_close(
            merged[name], expected, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}"
        )
    # The adapter recorded diagnostics for exactly the linear weights.
    recorded = recorder.sections["ace"]["tensors"]
    assert set(recorded) == linear
    for record in recorded.values():
        assert record["normalized"] is (normalize == "always" or record["gamma"] > 0.3)
    assert_loads_and_runs(out, tiny.architecture)


def test_ace_normalized_matches_the_pure_functions(tiny, tmp_path) -> None:
    check_ace_merge(tiny, str(tmp_path / "out"), "always")


@pytest.mark.parametrize(
    "fixture", ["tiny_llama_set", "tiny_bert_set", "tiny_vit_set", "tiny_clip_set"]
)
def test_ace_auto_matches_the_pure_functions(request, fixture: str, tmp_path) -> None:
    check_ace_merge(request.getfixturevalue(fixture), str(tmp_path / "out"), "auto")


def test_ties_merges_every_tensor(tiny, tmp_path) -> None:
    out = merge(
        tiny,
        "ties",
        str(tmp_path / "out"),
        model_parameters=[{"weight": 1.0, "density": 0.5}] * 3,
    )
    base = load_tensors(tiny.base)
    experts = [load_tensors(e) for e in tiny.experts]
    merged = load_tensors(out)
    assert set(merged) == set(base)
    differing = [n for n in base if any(not torch.equal(e[n], base[n]) for e in experts)]
    assert len(differing) == len(base)  # make_experts moves every tensor
    for name in differing:
        assert merged[name].shape == base[name].shape
        assert torch.isfinite(merged[name]).all(), name
        assert not torch.equal(merged[name], base[name]), f"{name} was copied from the base"
    assert_loads_and_runs(out, tiny.architecture)


def test_definitions_name_every_checkpoint_tensor(tiny) -> None:
    config = transformers.AutoConfig.from_pretrained(tiny.base)
    with our_architectures(layout_tensor_names(tiny.base)) as ours:
        arch = arch_info_for_config(config)
        assert arch is not None, f"mergekit has no definition for {tiny.architecture}"
        if tiny.architecture in OWN_DEFINITIONS:
            assert arch is ours[tiny.architecture]
    names = {w.name for w in arch.all_weights(config)}
    required = {w.name for w in arch.all_weights(config) if not w.optional}
    checkpoint = set(load_tensors(tiny.base))
    assert required <= checkpoint
    assert checkpoint <= names


def test_definitions_apply_inside_and_restore_mergekit_exactly() -> None:
    before = dict(mk_json.NAME_TO_ARCH)  # name -> the list object itself
    contents = {name: list(c) for name, c in before.items()}
    per_expert = {"model.layers.0.block_sparse_moe.experts.0.w1.weight"}
    assert set(our_definitions(per_expert)) == OWN_DEFINITIONS
    assert mk_json.NAME_TO_ARCH == before  # computing them changed nothing
    with our_architectures(per_expert) as ours:
        assert set(ours) == OWN_DEFINITIONS
        for name in OWN_DEFINITIONS:
            assert mk_json.NAME_TO_ARCH[name][0] is ours[name]
        # mergekit's own candidates stay behind ours (BertModel's is replaced by its repair)
        for name in OWN_DEFINITIONS & set(contents) - {"BertModel"}:
            behind = mk_json.NAME_TO_ARCH[name][1:]
            assert len(behind) == len(contents[name])
            assert all(a is b for a, b in zip(behind, contents[name])), name
        with pytest.raises(KeyError):
            with our_architectures(()):
                raise KeyError("inside a nested run")
        assert mk_json.NAME_TO_ARCH["MixtralForCausalLM"][0] is ours["MixtralForCausalLM"]
    assert set(mk_json.NAME_TO_ARCH) == set(before)
    for name, candidates in before.items():
        assert mk_json.NAME_TO_ARCH[name] is candidates, name
        assert candidates == contents[name], name
    # mergekit's BertModel had aliases on its optional position_ids, which crashes its planner.
    bert = ours["BertModel"]
    module = bert.modules["default"].architecture.definition
    weights = module.pre_weights + module.layer_templates.weights + module.post_weights
    assert not [w.name for w in weights if w.optional and w.aliases]
    assert any(w.aliases for w in weights)  # the other aliases are kept
    mergekit_bert = mk_json.NAME_TO_ARCH["BertModel"][0].modules["default"].architecture
    d = mergekit_bert.definition
    assert any(w.optional and w.aliases for w in d.pre_weights + d.layer_templates.weights)


def test_fused_or_unknown_checkpoints_keep_mergekits_moe_definitions() -> None:
    fused = {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"}
    for names in (fused, set()):
        table = our_definitions(names)
        assert "MixtralForCausalLM" not in table and "Qwen3MoeForCausalLM" not in table
        assert "ViTModel" in table  # the definitions mergekit lacks apply whatever the layout


def test_llava_checkpoint_layout_applies_to_its_saved_names_only() -> None:
    """transformers 5 saves LLaVA as ``language_model.model.``: our layout applies; a LLaVA
    saved under the in-memory names (``model.language_model.``, what mergekit writes) keeps
    mergekit's inferred definition, and a per-expert MoE checkpoint does not touch LLaVA."""
    saved = {"language_model.model.embed_tokens.weight", "vision_tower.embeddings.class_embedding"}
    in_memory = {"model.language_model.embed_tokens.weight", "lm_head.weight"}
    table = our_definitions(saved)
    assert "LlavaForConditionalGeneration" in table and "MixtralForCausalLM" not in table
    assert "LlavaForConditionalGeneration" not in our_definitions(in_memory)
    per_expert = {"model.layers.0.block_sparse_moe.experts.0.w1.weight"}
    assert "LlavaForConditionalGeneration" not in our_definitions(per_expert)


def test_transformers4_clip_vision_layout_merges_through_aliases(
    tiny_clip_vision_set, tmp_path
) -> None:
    # transformers 4 saved CLIPVisionModel tensors under "vision_model."; transformers 5 does not.
    class Prefixed:
        base = str(tmp_path / "base")
        experts = tuple(str(tmp_path / f"expert{i}") for i in range(3))

    for src, dst in zip(tiny_clip_vision_set.models, (Prefixed.base, *Prefixed.experts)):
        os.makedirs(dst)
        shutil.copy(os.path.join(src, "config.json"), dst)
        tensors = {f"vision_model.{k}": v for k, v in load_tensors(src).items()}
        save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    out = merge(
        Prefixed,
        "task_arithmetic",
        str(tmp_path / "out"),
        model_parameters=[{"weight": w} for w in TASK_WEIGHTS],
    )
    base = load_tensors(tiny_clip_vision_set.base)
    experts = [load_tensors(e) for e in tiny_clip_vision_set.experts]
    merged = load_tensors(out)
    assert set(merged) == set(base)  # written in the transformers-5 layout
    for name, w0 in base.items():
        expected = w0 + sum(lam * (e[name] - w0) for lam, e in zip(TASK_WEIGHTS, experts))
        torch.testing.assert_close(merged[name], expected, rtol=1e-5, atol=1e-6)
    assert_loads_and_runs(out, "CLIPVisionModel")


@pytest.mark.parametrize("fixture", ["tiny_vit_set", "tiny_clip_set"])
def test_vision_outputs_carry_the_image_processor(request, fixture: str, tmp_path) -> None:
    tiny = request.getfixturevalue(fixture)
    out = merge(tiny, "ace", str(tmp_path / "out"))
    processor = transformers.AutoImageProcessor.from_pretrained(out)
    reference = transformers.AutoImageProcessor.from_pretrained(tiny.base)
    assert processor.to_dict() == reference.to_dict()
