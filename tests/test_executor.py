"""The sequential layer-by-layer executor against an independent whole-model reference.

The reference in this file loads whole models with transformers, hooks every linear layer
and performs the same sequential merge group by group with full forward passes of the
partially merged model. The executor streams one block at a time; its output must match.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np
import pytest
import tiny_models
import torch
import transformers
import yaml
from mergekit.options import MergeOptions
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mergekit_ext.calibration.sources import load_calibration
from mergekit_ext.config import ExtMergeConfig, parse_config
from mergekit_ext.errors import CalibrationError, ConfigError, MergekitExtError, ModelInputError
from mergekit_ext.executor import plan_layerwise_merge, run_layerwise_merge
from mergekit_ext.executor.sequential import resolve_device
from mergekit_ext.methods.kinds import Layerwise
from mergekit_ext.methods.layerwise import (
    LayerwiseMethod,
    LinearGroup,
    StatisticsRequest,
    TaskStatistics,
)
from mergekit_ext.models.checkpoint import ModelSource

RIDGE = 1e-3


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see conftest.py


# ------------------------------------------------------------------------------------------
# A small least-squares method (RegMean-like) used by both executor and reference


def least_squares_merge(
    weights: Sequence[torch.Tensor], grams: Sequence[torch.Tensor]
) -> torch.Tensor:
    """``W = (Σ_k W_k G_k)(Σ_k G_k + ridge · mean(diag) · I)⁻¹`` in float64."""
    system = sum(g.double() for g in grams)
    system = system + RIDGE * torch.diagonal(system).mean() * torch.eye(
        system.shape[0], dtype=torch.float64
    )
    rhs = sum(w.double() @ g.double() for w, g in zip(weights, grams))
    return torch.linalg.solve(system, rhs.T).T.float()


class GramLeastSquares(LayerwiseMethod):
    """Merges each group from expert-path Grams (``propagate=False``) or merged-path Grams."""

    def __init__(self, propagate: bool, record: bool = True) -> None:
        self.name = "test_propagate" if propagate else "test_expert_path"
        self.propagate = propagate
        self.record = record  # keep every LinearGroup seen (holds its weights alive)
        self.seen: dict[str, LinearGroup] = {}

    def statistics_request(self, parameters):
        # float64 products: the whole-model reference forms its Grams in float64
        return StatisticsRequest(
            propagate=self.propagate, expert_path=True, product_dtype=torch.float64
        )

    def merge_linear_group(self, group: LinearGroup, parameters):
        if self.record:
            self.seen[group.name] = group
        stats = group.merged_stats if self.propagate else group.expert_stats
        rows = [group.experts[0][w].shape[0] for w in group.weights]
        stacked = [torch.cat([e[w] for w in group.weights]) for e in group.experts]
        merged = least_squares_merge(stacked, [s.gram for s in stats])
        parts = torch.split(merged, rows)
        return dict(zip(group.weights, parts)), {"tokens": [s.count for s in stats]}


# ------------------------------------------------------------------------------------------
# The whole-model reference


def _groups_llama(i: int) -> list[list[str]]:
    p = f"model.layers.{i}."
    return [
        [p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"],
        [p + "self_attn.o_proj"],
        [p + "mlp.gate_proj", p + "mlp.up_proj"],
        [p + "mlp.down_proj"],
    ]


def _groups_bert(i: int) -> list[list[str]]:
    p = f"encoder.layer.{i}."
    return [
        [p + "attention.self.query", p + "attention.self.key", p + "attention.self.value"],
        [p + "attention.output.dense"],
        [p + "intermediate.dense"],
        [p + "output.dense"],
    ]


def _groups_vit(i: int) -> list[list[str]]:
    p = f"vit.layers.{i}."  # transformers 5 module names of vit.encoder.layer.{i}
    return [
        [p + "attention.q_proj", p + "attention.k_proj", p + "attention.v_proj"],
        [p + "attention.o_proj"],
        [p + "mlp.fc1"],
        [p + "mlp.fc2"],
    ]


def _groups_clip(i: int) -> list[list[str]]:
    p = f"encoder.layers.{i}."
    return [
        [p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"],
        [p + "self_attn.out_proj"],
        [p + "mlp.fc1"],
        [p + "mlp.fc2"],
    ]


def _load(cls, path: str) -> torch.nn.Module:
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def _forward(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    if "pixel_values" in batch:
        return model(pixel_values=batch["pixel_values"])
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])


def _input_grams(
    model: torch.nn.Module, modules: Sequence[str], batches: Sequence[dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """``(1/N) Σ x xᵀ`` of each module's input over the non-padding positions, float64."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    mask: list[Optional[torch.Tensor]] = [None]

    def hook(name):
        def fn(module, args):
            x = args[0].double()
            rows = x[mask[0].bool()] if mask[0] is not None else x.reshape(-1, x.shape[-1])
            sums[name] = sums.get(name, 0) + rows.T @ rows
            counts[name] = counts.get(name, 0) + rows.shape[0]

        return fn

    handles = [model.get_submodule(m).register_forward_pre_hook(hook(m)) for m in modules]
    try:
        with torch.no_grad():
            for batch in batches:
                mask[0] = batch.get("attention_mask")
                _forward(model, batch)
    finally:
        for h in handles:
            h.remove()
    return {m: sums[m] / counts[m] for m in modules}


def reference_merge(
    cls,
    base: str,
    experts: Sequence[str],
    batches: Sequence[Sequence[dict[str, torch.Tensor]]],
    groups: Callable[[int], list[list[str]]],
    num_blocks: int,
    propagate: bool,
) -> dict[str, torch.Tensor]:
    """Whole models, every linear hooked, the same sequential merge with full forwards."""
    merged = _load(cls, base)
    expert_models = [_load(cls, p) for p in experts]
    expert_states = [m.state_dict() for m in expert_models]
    all_groups = [g for i in range(num_blocks) for g in groups(i)]
    linear = {m + ".weight" for g in all_groups for m in g}
    with torch.no_grad():
        for name, tensor in merged.state_dict().items():
            if name not in linear and tensor.is_floating_point():
                tensor.copy_(torch.stack([s[name] for s in expert_states]).mean(0))
        expert_grams = [
            _input_grams(m, [g[0] for g in all_groups], b) for m, b in zip(expert_models, batches)
        ]
        for g in all_groups:
            if propagate:
                grams = [_input_grams(merged, [g[0]], b)[g[0]] for b in batches]
            else:
                grams = [eg[g[0]] for eg in expert_grams]
            stacked = [torch.cat([s[m + ".weight"] for m in g]) for s in expert_states]
            result = least_squares_merge(stacked, grams)
            rows = [expert_states[0][m + ".weight"].shape[0] for m in g]
            for m, part in zip(g, torch.split(result, rows)):
                merged.get_submodule(m).weight.copy_(part)
    return merged.state_dict()


# ------------------------------------------------------------------------------------------
# Calibration data and configs


def _write_texts(path: str, seed: int, n: int = 6) -> str:
    import tiny_models

    rng = np.random.RandomState(seed)
    with open(path, "w", encoding="utf-8") as fp:
        for _ in range(n):
            words = rng.choice(tiny_models.WORDS, size=rng.randint(2, 12))
            fp.write(json.dumps({"text": " ".join(words)}) + "\n")
    return path


def _write_images(folder: str, seed: int, n: int = 6) -> str:
    os.makedirs(folder, exist_ok=True)
    rng = np.random.RandomState(seed)
    for i in range(n):
        pixels = (rng.rand(20, 20, 3) * 255).astype("uint8")
        Image.fromarray(pixels).save(os.path.join(folder, f"{i}.png"))
    return folder


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("executor_data")
    for k in range(3):
        _write_texts(str(root / f"text{k}.jsonl"), seed=k)
        _write_images(str(root / f"images{k}"), seed=k)
    return str(root)


def _config(
    method: str,
    base: str,
    experts: Sequence[str],
    data: Optional[Sequence[Optional[str]]],
    **extra: Any,
) -> ExtMergeConfig:
    models = []
    for i, e in enumerate(experts):
        entry: dict[str, Any] = {"model": e, "name": f"task{i}"}
        if data is not None and data[i] is not None:
            entry["calibration"] = {"path": data[i], "samples": 6, "batch_size": 3}
        models.append(entry)
    return parse_config(
        yaml.safe_dump({"merge_method": method, "base_model": base, "models": models, **extra})
    )


def _data(data_dir: str, modality: str, k: int) -> str:
    return os.path.join(data_dir, f"text{k}.jsonl" if modality == "text" else f"images{k}")


def _task_batches(cfg: ExtMergeConfig, modality: str) -> list[list[dict[str, torch.Tensor]]]:
    """Exactly the batches the executor gets (same loader, same spec)."""
    out = []
    for entry in cfg.models:
        data = load_calibration(
            cfg.calibration_for(entry), entry.model, task=entry.name, modality=modality
        )
        out.append(data.batches)
    return out


OPTIONS = MergeOptions(quiet=True)


def _run(cfg: ExtMergeConfig, out: str, method: LayerwiseMethod, **kw) -> dict:
    return run_layerwise_merge(cfg, out, OPTIONS, method, cfg.parameters, **kw)


def _tiny_qwen3(root: str, tokenizer_from: str) -> tuple[str, list[str]]:
    """A tiny Qwen3 (q_norm/k_norm, tied embeddings) with three experts."""
    import tiny_models

    base = os.path.join(root, "base")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=tiny_models.VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    transformers.Qwen3ForCausalLM(config).save_pretrained(base)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_from, f), os.path.join(base, f))
    experts = tiny_models.make_experts(base, [os.path.join(root, f"e{i}") for i in range(3)])
    return base, list(experts)


@pytest.fixture(scope="module")
def qwen3_set(tmp_path_factory, tiny_llama_set):
    return _tiny_qwen3(str(tmp_path_factory.mktemp("qwen3")), tiny_llama_set.base)


# ------------------------------------------------------------------------------------------
# Streaming equals the whole-model reference


FAMILIES = {
    "llama": ("tiny_llama_set", transformers.LlamaForCausalLM, _groups_llama, "text"),
    "qwen3": ("qwen3_set", transformers.Qwen3ForCausalLM, _groups_llama, "text"),
    "bert": ("tiny_bert_set", transformers.BertModel, _groups_bert, "text"),
    "vit": ("tiny_vit_set", transformers.ViTForImageClassification, _groups_vit, "image"),
    "clip_vision": ("tiny_clip_vision_set", transformers.CLIPVisionModel, _groups_clip, "image"),
}


def _model_set(request, fixture: str) -> tuple[str, list[str]]:
    value = request.getfixturevalue(fixture)
    if isinstance(value, tuple):
        return value[0], list(value[1])
    return value.base, list(value.experts)


@pytest.mark.parametrize("propagate", [False, True], ids=["expert_path", "propagate"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_streaming_matches_whole_model_reference(request, family, propagate, data_dir, tmp_path):
    fixture, cls, groups, modality = FAMILIES[family]
    base, experts = _model_set(request, fixture)
    data = [_data(data_dir, modality, k) for k in range(len(experts))]
    cfg = _config("regmean", base, experts, data)
    method = GramLeastSquares(propagate)
    out = str(tmp_path / "out")
    result = _run(cfg, out, method)

    # The output loads with transformers, has every tensor of the base, and runs.
    produced = _load(cls, out)
    with safe_open(os.path.join(base, "model.safetensors"), "pt") as f:
        base_keys = set(f.keys())
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert set(f.keys()) == base_keys
    batches = _task_batches(cfg, modality)
    with torch.no_grad():
        output = _forward(produced, batches[0][0])
    first = output.logits if hasattr(output, "logits") else output.last_hidden_state
    assert torch.isfinite(first).all()

    expected = reference_merge(cls, base, experts, batches, groups, 2, propagate)
    got = produced.state_dict()
    assert set(got) == set(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=2e-5, msg=name)

    # One diagnostics record per group, in forward order, with the method's own fields.
    layers = result.diagnostics["layers"]
    assert [r["group"] for r in layers] == [g for _ in range(2) for g in _labels(family)]
    assert [r["block"] for r in layers] == [0] * 4 + [1] * 4
    if modality == "text":  # statistics count the non-padding tokens of each task
        tokens = [sum(int(b["attention_mask"].sum()) for b in task) for task in batches]
        assert all(r["tokens"] == tokens for r in layers)
    assert set(result.calibration) == {"task0", "task1", "task2"}


def _labels(family: str) -> list[str]:
    return {
        "llama": ["qkv", "o_proj", "gate_up", "down_proj"],
        "qwen3": ["qkv", "o_proj", "gate_up", "down_proj"],
        "bert": ["qkv", "attention_output", "intermediate", "output"],
        # discovered labels: a lone linear is named by its module (transformers 5's ViT
        # modules are attention.o_proj, mlp.fc1, mlp.fc2)
        "vit": ["qkv", "o_proj", "fc1", "fc2"],
        "clip_vision": ["qkv", "out_proj", "fc1", "fc2"],
    }[family]


def test_propagate_gram_comes_from_the_merged_block(tiny_llama_set, data_dir, tmp_path):
    """Block 2's first Gram = the input of layers.1.q_proj in a forward of the MERGED model."""
    experts = list(tiny_llama_set.experts)
    cfg = _config(
        "regmean", tiny_llama_set.base, experts, [_data(data_dir, "text", k) for k in range(3)]
    )
    method = GramLeastSquares(propagate=True)
    out = str(tmp_path / "out")
    _run(cfg, out, method)
    group = method.seen["model.layers.1.self_attn.qkv"]
    assert (
        group.merged_stats is not None
        and group.weights[0] == "model.layers.1.self_attn.q_proj.weight"
    )

    merged_model = _load(transformers.LlamaForCausalLM, out)
    base_model = _load(transformers.LlamaForCausalLM, tiny_llama_set.base)
    batches = _task_batches(cfg, "text")
    for k, task_batches in enumerate(batches):
        expected = _input_grams(merged_model, ["model.layers.1.self_attn.q_proj"], task_batches)
        stats: TaskStatistics = group.merged_stats[k]
        torch.testing.assert_close(
            stats.gram, expected["model.layers.1.self_attn.q_proj"], rtol=1e-5, atol=1e-7
        )
        n_tokens = sum(int(b["attention_mask"].sum()) for b in task_batches)
        assert stats.count == n_tokens  # padding excluded
        # ... and not the expert's own path, nor the base model's
        assert not torch.allclose(stats.gram, group.expert_stats[k].gram, rtol=1e-3, atol=1e-5)
        on_base = _input_grams(base_model, ["model.layers.1.self_attn.q_proj"], task_batches)
        assert not torch.allclose(
            stats.gram, on_base["model.layers.1.self_attn.q_proj"], rtol=1e-3, atol=1e-5
        )
    # Expert-path statistics: the expert's own whole-model forward.
    expert_model = _load(transformers.LlamaForCausalLM, experts[2])
    own = _input_grams(expert_model, ["model.layers.1.mlp.down_proj"], batches[2])
    torch.testing.assert_close(
        method.seen["model.layers.1.mlp.down_proj"].expert_stats[2].gram,
        own["model.layers.1.mlp.down_proj"],
        rtol=1e-5,
        atol=1e-7,
    )


# ------------------------------------------------------------------------------------------
# Memory: never more than the allowed number of blocks


def test_never_holds_more_than_k_plus_two_blocks(tiny_llama_set, data_dir, tmp_path, monkeypatch):
    experts = list(tiny_llama_set.experts)
    k = len(experts)
    cfg = _config(
        "regmean", tiny_llama_set.base, experts, [_data(data_dir, "text", i) for i in range(k)]
    )
    live: list[tuple[weakref.ref, str]] = []
    peaks = {"block": 0, "blocks_at_once": 0, "other": 0}
    original = ModelSource.load

    def counting_load(self, canonical, device="cpu", cache=None, keep=None):
        tensor = original(self, canonical, device, cache, keep)
        if not any(ref() is tensor for ref, _ in live):
            live.append((weakref.ref(tensor), canonical))
        live[:] = [(ref, name) for ref, name in live if ref() is not None]
        in_blocks = [name for _, name in live if name.startswith("layers.")]
        peaks["block"] = max(peaks["block"], len(in_blocks))
        peaks["blocks_at_once"] = max(
            peaks["blocks_at_once"], len({n.split(".")[1] for n in in_blocks})
        )
        peaks["other"] = max(peaks["other"], len(live) - len(in_blocks))
        return tensor

    monkeypatch.setattr(ModelSource, "load", counting_load)
    method = GramLeastSquares(propagate=True, record=False)
    _run(cfg, str(tmp_path / "out"), method)
    with safe_open(os.path.join(tiny_llama_set.base, "model.safetensors"), "pt") as f:
        per_block = sum(1 for key in f.keys() if key.startswith("model.layers.0."))
    assert per_block == 9
    # base + K experts loaded (the merged block is produced, not loaded): K + 2 blocks in all
    assert peaks["block"] == (k + 1) * per_block
    assert peaks["blocks_at_once"] == 1
    # non-block tensors (embeddings, head): one tensor of each model at a time
    assert peaks["other"] <= k + 1


# ------------------------------------------------------------------------------------------
# LoRA experts


def test_lora_experts_equal_premerged_checkpoints_llama(tiny_llama_set, data_dir, tmp_path):
    base = tiny_llama_set.base
    adapters, full = tiny_models.make_lora_experts(
        base,
        str(tmp_path),
        transformers.LlamaForCausalLM,
        ["q_proj", "v_proj", "down_proj", "embed_tokens"],
        rank_pattern={"down_proj": 2},
        alpha_pattern={"v_proj": 16},
    )
    data = [_data(data_dir, "text", k) for k in range(2)]
    method = GramLeastSquares(propagate=True)
    outputs = {}
    for label, experts in {
        "plus": [f"{base}+{a}" for a in adapters],
        "folder": adapters,
        "full": full,
    }.items():
        cfg = _config("regmean", base, experts, data)
        _run(cfg, str(tmp_path / label), method)
        outputs[label] = load_file(str(tmp_path / label / "model.safetensors"))
    assert set(outputs["plus"]) == set(outputs["full"])
    for label in ("plus", "folder"):
        for name, tensor in outputs["full"].items():
            torch.testing.assert_close(outputs[label][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    # the adapters changed the experts: the merge differs from merging the base with itself
    base_weights = load_file(os.path.join(base, "model.safetensors"))
    assert not torch.allclose(
        outputs["plus"]["model.layers.1.mlp.down_proj.weight"],
        base_weights["model.layers.1.mlp.down_proj.weight"],
    )


def test_lora_experts_equal_premerged_checkpoints_vit(tiny_vit_set, data_dir, tmp_path):
    """ViT: adapters name transformers-5 modules (q_proj), checkpoints the legacy keys."""
    base = tiny_vit_set.base
    adapters, full = tiny_models.make_lora_experts(
        base,
        str(tmp_path),
        transformers.ViTForImageClassification,
        ["q_proj", "v_proj", "fc1"],
        modules_to_save=["classifier"],
    )
    data = [_data(data_dir, "image", k) for k in range(2)]
    method = GramLeastSquares(propagate=True)
    outputs = {}
    for label, experts in {"folder": adapters, "full": full}.items():
        cfg = _config("regmean", base, experts, data)
        _run(cfg, str(tmp_path / label), method)
        outputs[label] = load_file(str(tmp_path / label / "model.safetensors"))
    assert "vit.encoder.layer.0.attention.attention.query.weight" in outputs["folder"]
    for name, tensor in outputs["full"].items():
        torch.testing.assert_close(outputs["folder"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


# ------------------------------------------------------------------------------------------
# Heads: headless base vs experts with heads


def test_headless_base_with_classifier_experts(
    tiny_bert_set, tiny_bert_classifier_set, data_dir, tmp_path
):
    """Base BertModel (``encoder.layer``) + BertForSequenceClassification experts (``bert.``)."""
    experts = list(tiny_bert_classifier_set.experts)
    # Same backbone: rebuild the classifier experts' backbones from the headless base's
    # experts so that the shapes agree and only the names/heads differ.
    fixed = []
    for i, (cls_expert, plain_expert) in enumerate(zip(experts, tiny_bert_set.experts)):
        weights = load_file(os.path.join(cls_expert, "model.safetensors"))
        plain = load_file(os.path.join(plain_expert, "model.safetensors"))
        for name, tensor in plain.items():
            weights["bert." + name] = tensor
        path = str(tmp_path / f"cls{i}")
        shutil.copytree(cls_expert, path)
        save_file(weights, os.path.join(path, "model.safetensors"))
        fixed.append(path)
    data = [_data(data_dir, "text", k) for k in range(3)]
    method = GramLeastSquares(propagate=False)
    result = _run(_config("regmean", tiny_bert_set.base, fixed, data), str(tmp_path / "a"), method)
    reference = _run(
        _config("regmean", tiny_bert_set.base, list(tiny_bert_set.experts), data),
        str(tmp_path / "b"),
        method,
    )
    a = load_file(str(tmp_path / "a" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert set(a) == set(b)  # the base's names; no classifier
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=name)
    assert {r["tensor"] for r in result.diagnostics["not_merged"]} == {
        "classifier.weight",
        "classifier.bias",
    }
    assert reference.diagnostics["not_merged"] == []


def test_head_with_another_shape_is_not_merged(tiny_vit_set, data_dir, tmp_path):
    """An expert whose classifier has 5 labels (base: 3): its head is left out and logged."""
    odd = str(tmp_path / "odd")
    shutil.copytree(tiny_vit_set.experts[2], odd)
    weights = load_file(os.path.join(odd, "model.safetensors"))
    weights["classifier.weight"] = torch.randn(5, weights["classifier.weight"].shape[1])
    weights["classifier.bias"] = torch.randn(5)
    save_file(weights, os.path.join(odd, "model.safetensors"))
    experts = [tiny_vit_set.experts[0], tiny_vit_set.experts[1], odd]
    data = [_data(data_dir, "image", k) for k in range(3)]
    result = _run(
        _config("regmean", tiny_vit_set.base, experts, data),
        str(tmp_path / "out"),
        GramLeastSquares(False),
    )
    reasons = {r["tensor"]: r["reason"] for r in result.diagnostics["not_merged"]}
    assert set(reasons) == {"classifier.weight", "classifier.bias"}
    assert odd in reasons["classifier.weight"]
    merged = load_file(str(tmp_path / "out" / "model.safetensors"))
    two = [load_file(os.path.join(e, "model.safetensors")) for e in experts[:2]]
    torch.testing.assert_close(
        merged["classifier.weight"], (two[0]["classifier.weight"] + two[1]["classifier.weight"]) / 2
    )


def test_whole_clip_model_merges_vision_tower_with_data(tiny_clip_set, data_dir, tmp_path):
    data = [_data(data_dir, "image", k) for k in range(3)]
    cfg = _config("regmean", tiny_clip_set.base, list(tiny_clip_set.experts), data)
    result = _run(cfg, str(tmp_path / "out"), GramLeastSquares(propagate=True))
    assert result.diagnostics["layers"][0]["layer"] == "vision_model.encoder.layers.0.self_attn.qkv"
    merged = load_file(str(tmp_path / "out" / "model.safetensors"))
    experts = [load_file(os.path.join(e, "model.safetensors")) for e in tiny_clip_set.experts]
    name = "text_model.encoder.layers.0.self_attn.q_proj.weight"  # text tower: fallback (mean)
    torch.testing.assert_close(merged[name], torch.stack([e[name] for e in experts]).mean(0))
    model = transformers.CLIPModel.from_pretrained(str(tmp_path / "out"))
    assert isinstance(model, transformers.CLIPModel)


# ------------------------------------------------------------------------------------------
# The registered methods run on the executor


@pytest.mark.parametrize("method_name", ["regmean", "chain_of_merges", "qp_projection"])
def test_registered_methods_run(method_name, tiny_llama_set, data_dir, tmp_path):
    """Every registered layer-wise method runs on the executor: it merges every linear group
    (the result differs from the base and from each expert), writes a loadable model with
    finite logits, and reports one diagnostics record per group."""
    from mergekit_ext.methods.registry import ext_method_info

    info = ext_method_info(method_name)
    assert info is not None and isinstance(info.kind, Layerwise), f"{method_name} is not registered"
    cfg = _config(
        method_name,
        tiny_llama_set.base,
        list(tiny_llama_set.experts),
        [_data(data_dir, "text", k) for k in range(3)],
    )
    result = run_layerwise_merge(
        cfg, str(tmp_path / "out"), OPTIONS, info.implementation, cfg.parameters
    )
    assert len(result.diagnostics["layers"]) == 8  # 2 blocks x 4 groups
    merged = load_file(str(tmp_path / "out" / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    for source in tiny_llama_set.models:
        other = load_file(os.path.join(source, "model.safetensors"))[name]
        assert not torch.equal(merged[name], other), f"{method_name} copied {source}"
    model = _load(transformers.LlamaForCausalLM, str(tmp_path / "out"))
    batch = _task_batches(cfg, "text")[0][0]
    with torch.no_grad():
        assert torch.isfinite(_forward(model, batch).logits).all()


@pytest.mark.parametrize("propagate", [False, True], ids=["expert_path", "propagate"])
def test_every_block_linear_runs_once_per_path_task_and_batch(
    propagate, tiny_llama_set, data_dir, tmp_path, monkeypatch
):
    """The merged path replays the outputs of already merged linears instead of re-running
    them in each group's pass: 7 linears x blocks x batches per path, nothing more."""
    runs: list[int] = []
    original = torch.nn.Linear.forward

    def counting(self, x):
        runs.append(1)
        return original(self, x)

    monkeypatch.setattr(torch.nn.Linear, "forward", counting)
    cfg = _config(
        "regmean",
        tiny_llama_set.base,
        list(tiny_llama_set.experts),
        [_data(data_dir, "text", k) for k in range(3)],
    )
    batches = sum(len(b) for b in _task_batches(cfg, "text"))
    _run(cfg, str(tmp_path / "out"), GramLeastSquares(propagate, record=False))
    paths = 2 if propagate else 1  # the expert path always, the merged path with propagate
    assert len(runs) == 7 * 2 * batches * paths
    if not propagate:
        return
    # No replay budget: every pass recomputes, and the merge is the same to the byte.
    from mergekit_ext.executor import plan as plan_module

    monkeypatch.setattr(plan_module, "REPLAY_MIN_BYTES", 0)
    monkeypatch.setattr(plan_module, "REPLAY_HIDDEN_MULTIPLE", 0)
    runs.clear()
    _run(cfg, str(tmp_path / "recomputed"), GramLeastSquares(propagate, record=False))
    assert len(runs) > 7 * 2 * batches * paths
    for name in ("model.safetensors",):
        with (
            open(tmp_path / "out" / name, "rb") as a,
            open(tmp_path / "recomputed" / name, "rb") as b,
        ):
            assert a.read() == b.read()


def test_com_reference_path_keeps_moments_only_above_the_width_limit(
    tiny_llama_set, data_dir, tmp_path, monkeypatch
):
    """CoM's expert path is a W2 reference: wide groups get moments, not Grams, and W2 is
    diagonal there; narrow groups keep full Grams and a full-covariance W2."""
    from mergekit_ext.methods import chain_of_merges, least_squares

    seen: dict[str, LinearGroup] = {}
    merge = chain_of_merges.ChainOfMergesMethod.merge_linear_group

    def spy(self, group, parameters):
        seen[group.name] = group
        return merge(self, group, parameters)

    hidden = 32  # the tiny Llama: hidden 32 (q/k/v, gate/up inputs), wider o and down inputs
    monkeypatch.setattr(chain_of_merges, "FULL_COVARIANCE_W2_MAX_DIM", hidden)
    monkeypatch.setattr(least_squares.measures, "FULL_COVARIANCE_W2_MAX_DIM", hidden)
    monkeypatch.setattr(chain_of_merges.ChainOfMergesMethod, "merge_linear_group", spy)
    cfg = _config(
        "chain_of_merges",
        tiny_llama_set.base,
        list(tiny_llama_set.experts),
        [_data(data_dir, "text", k) for k in range(3)],
    )
    method = chain_of_merges.ChainOfMergesMethod()
    assert method.statistics_request({}).reference_gram_max_dim == hidden
    result = run_layerwise_merge(cfg, str(tmp_path / "out"), OPTIONS, method, {})
    kinds = {r["layer"]: r["covariate_shift_covariance"] for r in result.diagnostics["layers"]}
    widths = set()
    for name, group in seen.items():
        width = group.experts[0][group.weights[0]].shape[1]
        widths.add(width)
        for ref, merged in zip(group.expert_stats, group.merged_stats):
            # the merge's own path has the Gram, or its rows while a task has fewer tokens
            # than the group has inputs (the span solve, issue #18)
            assert (merged.gram is None) == (merged.count < width)
            assert (merged.rows is not None) == (merged.count < width)
            assert (ref.gram is None) == (width > hidden)
            assert ref.second_moment.shape == (width,)
            assert ref.count == merged.count > 0
        assert kinds[name] == ("full" if width <= hidden else "diagonal")
        for task in result.diagnostics["layers"][0]["tasks"].values():
            assert task["covariate_shift_w2"] is not None
    assert min(widths) <= hidden < max(widths)  # both kinds were exercised


# ------------------------------------------------------------------------------------------
# Plan, dry run and bad inputs


def test_plan_describes_the_merge_and_estimates_memory(tiny_llama_set, data_dir):
    cfg = _config(
        "regmean",
        tiny_llama_set.base,
        list(tiny_llama_set.experts),
        [_data(data_dir, "text", k) for k in range(3)],
    )
    plan = plan_layerwise_merge(cfg, OPTIONS, GramLeastSquares(propagate=True), {})
    text = plan.describe()
    for expected in (
        "family: llama",
        "blocks: 2",
        "qkv: self_attn.q_proj, self_attn.k_proj, self_attn.v_proj",
        "task0",
        "task2",
        "memory estimate: peak ≈",
    ):
        assert expected in text
    with safe_open(os.path.join(tiny_llama_set.base, "model.safetensors"), "pt") as f:
        block = sum(
            math.prod(f.get_slice(k).get_shape())
            for k in f.keys()
            if k.startswith("model.layers.0.")
        )
    assert plan.memory.block_weights == (3 + 2) * block * 4
    assert f"{plan.memory.peak} bytes" in text
    total_tokens = sum(e.data.num_tokens for e in plan.experts)
    assert total_tokens > 0 and plan.memory.activations >= total_tokens * 32 * 4 * 2


def test_missing_calibration_names_the_model(tiny_llama_set, data_dir):
    experts = list(tiny_llama_set.experts)
    cfg = _config(
        "regmean",
        tiny_llama_set.base,
        experts,
        [_data(data_dir, "text", 0), None, _data(data_dir, "text", 2)],
    )
    with pytest.raises(ConfigError, match=f"needs calibration data.*for {experts[1]}$"):
        plan_layerwise_merge(cfg, OPTIONS, GramLeastSquares(True), {})


def test_tokenizer_mismatch_between_experts(tiny_llama_set, data_dir, tmp_path):
    import tiny_models
    from tokenizers import Tokenizer, models, pre_tokenizers

    other = str(tmp_path / "other")
    shutil.copytree(tiny_llama_set.experts[1], other)
    words = list(reversed(tiny_models.SPECIAL + tiny_models.WORDS))
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]"
    ).save_pretrained(other)
    experts = [tiny_llama_set.experts[0], other]
    cfg = _config(
        "regmean", tiny_llama_set.base, experts, [_data(data_dir, "text", k) for k in range(2)]
    )
    with pytest.raises(CalibrationError, match="different vocabularies"):
        plan_layerwise_merge(cfg, OPTIONS, GramLeastSquares(True), {})


def test_missing_model_path(tiny_llama_set, data_dir, tmp_path):
    missing = str(tmp_path / "nowhere")
    cfg = _config(
        "regmean",
        tiny_llama_set.base,
        [tiny_llama_set.experts[0], missing],
        [_data(data_dir, "text", k) for k in range(2)],
    )
    with pytest.raises(ModelInputError, match="model path not found: .*nowhere"):
        plan_layerwise_merge(cfg, OPTIONS, GramLeastSquares(True), {})


def test_shape_mismatch_names_the_tensor(tiny_llama_set, data_dir, tmp_path):
    bad = str(tmp_path / "bad")
    shutil.copytree(tiny_llama_set.experts[0], bad)
    weights = load_file(os.path.join(bad, "model.safetensors"))
    weights["model.layers.1.mlp.down_proj.weight"] = weights["model.layers.1.mlp.down_proj.weight"][
        :, :60
    ].contiguous()
    save_file(weights, os.path.join(bad, "model.safetensors"))
    cfg = _config(
        "regmean",
        tiny_llama_set.base,
        [tiny_llama_set.experts[1], bad],
        [_data(data_dir, "text", k) for k in range(2)],
    )
    with pytest.raises(
        ModelInputError,
        match=r"shape mismatch for tensor model\.layers\.1\.mlp\.down_proj\.weight: \[32, 64\].*\[32, 60\]",
    ):
        plan_layerwise_merge(cfg, OPTIONS, GramLeastSquares(True), {})


def test_encoder_decoder_is_refused_before_weights_load(tmp_path, data_dir, tiny_llama_set):
    """T5 (encoder-decoder) is refused while planning, naming why and what works instead."""
    path = str(tmp_path / "t5")
    transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            vocab_size=128, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2
        )
    ).save_pretrained(path)
    cfg = _config("regmean", path, [tiny_llama_set.experts[0]], [_data(data_dir, "text", 0)])
    with pytest.raises(
        ModelInputError,
        match=r"t5 \(T5ForConditionalGeneration\) is an encoder-decoder model.*ties, ace\) or symerge",
    ):
        plan_layerwise_merge(cfg, OPTIONS, GramLeastSquares(True), {})


def test_architecture_mismatch_between_base_and_expert(tiny_llama_set, tiny_bert_set, data_dir):
    cfg = _config(
        "regmean", tiny_llama_set.base, [tiny_bert_set.experts[0]], [_data(data_dir, "text", 0)]
    )
    with pytest.raises(
        ModelInputError,
        match=r"is a .bert. model \(bert family\) but the base model is of the llama family",
    ):
        plan_layerwise_merge(cfg, OPTIONS, GramLeastSquares(True), {})


def test_base_model_is_required(tiny_llama_set, data_dir):
    cfg = parse_config(
        yaml.safe_dump(
            {
                "merge_method": "regmean",
                "models": [
                    {"model": e, "calibration": {"path": _data(data_dir, "text", 0)}}
                    for e in tiny_llama_set.experts
                ],
            }
        )
    )
    with pytest.raises(ConfigError, match="needs base_model"):
        plan_layerwise_merge(cfg, OPTIONS, GramLeastSquares(True), {})


def test_device_resolution():
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(MergekitExtError, match="CUDA is not available"):
            resolve_device("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu(tiny_llama_set, data_dir, tmp_path):
    cfg = _config(
        "regmean",
        tiny_llama_set.base,
        list(tiny_llama_set.experts),
        [_data(data_dir, "text", k) for k in range(3)],
    )
    _run(cfg, str(tmp_path / "cpu"), GramLeastSquares(propagate=True), device="cpu")
    _run(cfg, str(tmp_path / "cuda"), GramLeastSquares(propagate=True), device="cuda")
    cpu = load_file(str(tmp_path / "cpu" / "model.safetensors"))
    gpu = load_file(str(tmp_path / "cuda" / "model.safetensors"))
    for name in cpu:
        torch.testing.assert_close(gpu[name], cpu[name], rtol=1e-4, atol=1e-5, msg=name)


def test_sharded_output_loads_and_equals_single_shard(tiny_llama_set, data_dir, tmp_path):
    cfg = _config(
        "regmean",
        tiny_llama_set.base,
        list(tiny_llama_set.experts),
        [_data(data_dir, "text", k) for k in range(3)],
    )
    method = GramLeastSquares(propagate=True)
    run_layerwise_merge(cfg, str(tmp_path / "one"), OPTIONS, method, {})
    small = MergeOptions(quiet=True, out_shard_size=20_000)
    run_layerwise_merge(cfg, str(tmp_path / "many"), small, method, {})
    shards = sorted(f for f in os.listdir(tmp_path / "many") if f.endswith(".safetensors"))
    assert len(shards) > 2 and os.path.isfile(tmp_path / "many" / "model.safetensors.index.json")
    one = _load(transformers.LlamaForCausalLM, str(tmp_path / "one")).state_dict()
    many = _load(transformers.LlamaForCausalLM, str(tmp_path / "many")).state_dict()
    for name in one:
        torch.testing.assert_close(many[name], one[name], rtol=0, atol=0, msg=name)
