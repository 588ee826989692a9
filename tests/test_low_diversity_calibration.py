"""Issue #27: a least-squares merge on low-diversity calibration data must not silently write a
broken model, and its diagnostics must describe the weights as written.

A tiny random Llama (hidden 64, 2 blocks); two experts = base + a random rank-4 update on every
block linear; each task's calibration = 60 texts of one template over a handful of words, so
every group has more calibration tokens than inputs but the tokens span few directions.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file

from mergekit_ext import merge_record
from mergekit_ext.api import run_merge
from mergekit_ext.calibration.statistics import TaskStatistics
from mergekit_ext.config import load_config
from mergekit_ext.diagnose import diagnose
from mergekit_ext.errors import TensorError
from mergekit_ext.methods.guard import NORM_RATIO_WARN
from mergekit_ext.methods.layerwise import LinearGroup
from mergekit_ext.methods.least_squares import (
    AUTO_RIDGE,
    LeastSquaresSettings,
    merge_group_least_squares,
    regmean_solve,
)
from mergekit_ext.runner import RunOptions
from mergekit_ext.testing import SPECIAL, VOCAB_SIZE, WORDS, _save, _tokenizer

HIDDEN = 64
# chats per task for the span test: under 64 tokens each task, over 64 both (tested)
SPAN_SAMPLES = 5
FEW_WORDS = ["good", "bad", "team", "game", "rain", "sun"]
TEMPLATE = "this is the news . the team was "


def _tiny_llama(path: str) -> str:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=4,
        eos_token_id=5,
    )
    return _save(transformers.LlamaForCausalLM(config), path, [_tokenizer("llama")])


def _low_rank_expert(base: str, path: str, seed: int) -> str:
    model = transformers.LlamaForCausalLM.from_pretrained(base)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".layers." in name and p.ndim == 2:
                update = torch.randn(p.shape[0], 4, generator=gen) @ torch.randn(
                    4, p.shape[1], generator=gen
                )
                p.add_(update * (0.05 * p.norm() / update.norm()))
    return _save(model, path, [_tokenizer("llama")])


@pytest.fixture(scope="module")
def low_diversity(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("low_diversity")
    base = _tiny_llama(str(root / "base"))
    experts = [_low_rank_expert(base, str(root / f"expert{i}"), 10 + i) for i in range(2)]
    data = [_write_chat(str(root / f"chat{i}.jsonl"), seed=i, texts=60) for i in range(2)]
    return {"root": root, "base": base, "experts": experts, "data": data}


def _write_chat(path: str, seed: int, texts: int) -> str:
    """``texts`` texts of the one template; the first n are the same for every ``texts``."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as fp:
        for _ in range(texts):
            words = " ".join(rng.choice(FEW_WORDS) for _ in range(3))
            fp.write(json.dumps({"text": TEMPLATE + words}) + "\n")
    return path


@pytest.fixture(scope="module")
def low_diversity_bf16(low_diversity: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The same base and experts saved in bfloat16, as a bf16 chat model ships, and each
    task's chat data with 12 more texts than the merge reads: diagnose's held-out examples."""
    root = tmp_path_factory.mktemp("low_diversity_bf16")
    s = low_diversity
    saved = {}
    for name, folder in [
        ("base", s["base"]),
        *((f"expert{i}", e) for i, e in enumerate(s["experts"])),
    ]:
        model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
        saved[name] = _save(model.to(torch.bfloat16), str(root / name), [_tokenizer("llama")])
    data = [_write_chat(str(root / f"chat{i}.jsonl"), seed=i, texts=72) for i in range(2)]
    experts = [saved["expert0"], saved["expert1"]]
    return {"root": root, "base": saved["base"], "experts": experts, "data": data}


def _config(s: dict, method: str = "chain_of_merges", **parameters) -> dict:
    return {
        "merge_method": method,
        "base_model": s["base"],
        "parameters": parameters,
        "models": [
            {"model": e, "name": f"task{i}", "calibration": {"path": d, "samples": 60}}
            for i, (e, d) in enumerate(zip(s["experts"], s["data"]))
        ],
    }


def _block_linears(folder: str) -> dict[str, torch.Tensor]:
    weights = load_file(os.path.join(folder, "model.safetensors"))
    return {k: v for k, v in weights.items() if ".layers." in k and v.ndim == 2}


def _max_norm_ratio(folder: str, experts: list[str]) -> float:
    merged = _block_linears(folder)
    expert_weights = [_block_linears(e) for e in experts]
    return max(
        float(w.double().norm()) / max(float(e[k].double().norm()) for e in expert_weights)
        for k, w in merged.items()
    )


def _held_out_agreement(folder: str, experts: list[str]) -> float:
    """Top-1 next-token agreement with each expert (mean) on random text over the whole
    word vocabulary (not the calibration's template)."""
    gen = torch.Generator().manual_seed(123)
    ids = torch.randint(len(SPECIAL), len(SPECIAL) + len(WORDS), (16, 24), generator=gen)
    with torch.no_grad():
        model = transformers.LlamaForCausalLM.from_pretrained(folder).eval()
        top = model(input_ids=ids).logits.argmax(-1)
        agreements = []
        for e in experts:
            reference = transformers.LlamaForCausalLM.from_pretrained(e).eval()
            agreements.append(
                float((reference(input_ids=ids).logits.argmax(-1) == top).double().mean())
            )
    return sum(agreements) / len(agreements)


def test_old_rule_explodes_and_auto_stays_bounded(low_diversity, tmp_path):
    s = low_diversity
    # More tokens than inputs in every group: the old ridge: auto resolved to exactly 0
    tokens = sum(len(open(d).read().split()) for d in s["data"])
    assert tokens > 2 * HIDDEN
    old = tmp_path / "old"
    run_merge(_config(s, ridge=0.0, max_norm_ratio=math.inf), old)
    assert _max_norm_ratio(str(old), s["experts"]) > 20.0  # the solve left the experts' range

    new = tmp_path / "new"
    run_merge(_config(s), new)
    assert _max_norm_ratio(str(new), s["experts"]) < 1.2
    base_agreement = _held_out_agreement(s["base"], s["experts"])
    assert _held_out_agreement(str(new), s["experts"]) >= base_agreement - 0.03
    assert _held_out_agreement(str(old), s["experts"]) < base_agreement - 0.1

    # The diagnostics say what auto chose and why, per group
    layers = merge_record.load(str(new))["sections"]["chain_of_merges"]["layers"]
    for layer in layers:
        assert layer["ridge_setting"] == "auto"
        assert layer["ridge"] == AUTO_RIDGE
        assert layer["ridge_reason"].startswith("auto: ")
        assert "singular" in layer["ridge_reason"] or "above" in layer["ridge_reason"]
        assert layer["guard"] == "ok" and layer["max_norm_ratio"] < 1.2


def test_bfloat16_passes_on_a_chat_template_stay_bounded(low_diversity, tmp_path):
    """The same low-diversity data with bfloat16 passes and bf16 output (as a bf16 Llama on
    fast-bf16 hardware runs under compute_dtype: auto): ridge: auto still regularises every
    group, the merge stays in the experts' range and agrees with them off the template."""
    s = low_diversity
    out = tmp_path / "bf16_passes"
    config = _config(s, compute_dtype="bfloat16")
    config["dtype"] = "bfloat16"
    run_merge(config, out)
    assert _max_norm_ratio(str(out), s["experts"]) < 1.2
    base_agreement = _held_out_agreement(s["base"], s["experts"])
    assert _held_out_agreement(str(out), s["experts"]) >= base_agreement - 0.03
    with open(os.path.join(out, "mergekit_ext_diagnostics.json"), encoding="utf-8") as fp:
        assert json.load(fp)["executor"]["compute_dtype"] == "bfloat16"
    for layer in merge_record.load(str(out))["sections"]["chain_of_merges"]["layers"]:
        assert layer["ridge"] == AUTO_RIDGE and layer["guard"] == "ok"


def test_bfloat16_checkpoints_on_a_chat_template_stay_bounded_and_diagnose_tells(
    low_diversity_bf16, tmp_path
):
    """bfloat16 checkpoints merged with bfloat16 passes take the statistics of the inputs
    rounded to bfloat16 (``ComputeChoice.rounds_inputs``): on the chat template ridge: auto
    still keeps every group in the experts' range, and ``diagnose`` on held-out texts rates
    that merge above the base model and the unregularised one as do-not-publish."""
    s = low_diversity_bf16
    good, broken = tmp_path / "auto", tmp_path / "ridge0"
    configs = {}
    for out, parameters in [(good, {}), (broken, {"ridge": 0.0, "max_norm_ratio": math.inf})]:
        config = _config(s, compute_dtype="bfloat16", **parameters)
        config["dtype"] = "bfloat16"
        run_merge(config, out)
        configs[out] = config
    with open(os.path.join(good, "mergekit_ext_diagnostics.json"), encoding="utf-8") as fp:
        record = json.load(fp)["executor"]
    assert record["compute_dtype"] == "bfloat16" and record["rounds_inputs"] is True
    card = open(os.path.join(good, "README.md"), encoding="utf-8").read()
    assert "the calibration statistics describe the inputs rounded to bfloat16" in card

    assert _max_norm_ratio(str(good), s["experts"]) < 1.2
    for layer in merge_record.load(str(good))["sections"]["chain_of_merges"]["layers"]:
        assert layer["ridge"] == AUTO_RIDGE and layer["guard"] == "ok"
    base_agreement = _held_out_agreement(s["base"], s["experts"])
    assert _held_out_agreement(str(good), s["experts"]) >= base_agreement - 0.03
    # the unregularised solve still leaves the range, and its record says by how much
    worst = max(
        merge_record.load(str(broken))["sections"]["chain_of_merges"]["layers"],
        key=lambda layer: layer["max_norm_ratio"],
    )
    assert worst["max_norm_ratio"] > 20.0 and worst["guard"] == "allowed"
    assert worst["max_norm_ratio"] == pytest.approx(
        _max_norm_ratio(str(broken), s["experts"]), rel=1e-6
    )

    config_file = tmp_path / "merge.yaml"
    config_file.write_text(yaml.safe_dump(configs[good]), encoding="utf-8")
    rated = diagnose(load_config(str(config_file)), [str(good), str(broken)])
    assert rated[0]["base_ratio"] > 1.0 and rated[0]["verdict"].startswith("keeps ")
    assert rated[1]["base_ratio"] < 1.0 and rated[1]["verdict"].endswith("do not publish")


def test_regmean_auto_also_regularises(low_diversity, tmp_path):
    s = low_diversity
    out = tmp_path / "regmean"
    run_merge(_config(s, method="regmean"), out)
    assert _max_norm_ratio(str(out), s["experts"]) < NORM_RATIO_WARN
    old = tmp_path / "old"
    run_merge(_config(s, method="regmean", ridge=0.0, max_norm_ratio=math.inf), old)
    assert _max_norm_ratio(str(old), s["experts"]) > 10.0
    # Each expert's own inputs (no propagation): the fit still extrapolates between the
    # experts' Grams, so RegMean stays below the base here (docs/methods.md, "ridge: auto"),
    # but far above the old rule's broken merge
    assert (
        _held_out_agreement(str(out), s["experts"])
        > _held_out_agreement(str(old), s["experts"]) + 0.2
    )


def test_hard_limit_stops_before_writing_and_names_the_layer(low_diversity, tmp_path):
    s = low_diversity
    out = tmp_path / "merged"
    with pytest.raises(TensorError) as info:
        run_merge(_config(s, ridge=0.0), out)
    message = str(info.value)
    assert "model.layers.0." in message and "max_norm_ratio = 10" in message
    assert "calibration data" in message and "ridge" in message
    assert "reduce_non_diagonal" in message and "nothing was written" in message
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no .merged.partial-* folder either


def test_override_writes_and_warns(low_diversity, tmp_path, caplog):
    s = low_diversity
    out = tmp_path / "merged"
    with caplog.at_level(logging.WARNING, logger="mergekit_ext.methods.guard"):
        run_merge(_config(s, ridge=0.0, max_norm_ratio=math.inf), out)
    assert out.is_dir()
    warned = [
        r.getMessage() for r in caplog.records if "outside the experts' range" in r.getMessage()
    ]
    assert warned and "reduce_non_diagonal" in warned[0] and "model.layers." in warned[0]
    layers = merge_record.load(str(out))["sections"]["chain_of_merges"]["layers"]
    assert any(layer["guard"] == "allowed" for layer in layers)
    worst = max(layers, key=lambda layer: layer["max_norm_ratio"])
    assert worst["max_norm_ratio"] == pytest.approx(
        _max_norm_ratio(str(out), s["experts"]), rel=1e-6
    )
    assert worst["ridge"] == 0.0 and worst["ridge_reason"] == "as set"


def test_well_conditioned_group_keeps_the_exact_solution():
    """Full rank, well conditioned: auto adds nothing, the solution is the unregularised one."""
    gen = torch.Generator().manual_seed(0)
    n_in, out = 16, 8
    weights = [torch.randn(out, n_in, generator=gen) for _ in range(2)]
    rows = [torch.randn(200, n_in, generator=gen, dtype=torch.float64) for _ in range(2)]
    grams = [r.T @ r / r.shape[0] for r in rows]
    auto = regmean_solve(weights, grams, 1.0, ridge="auto", tokens=400)
    exact = regmean_solve(weights, grams, 1.0, ridge=0.0, tokens=400)
    assert auto.ridge == 0.0 and "exact solution" in auto.ridge_reason
    assert torch.equal(auto.merged_weight, exact.merged_weight)
    # a rank-deficient system with as many tokens: auto regularises it
    flat = [r[:, :4] @ torch.randn(4, n_in, generator=gen, dtype=torch.float64) for r in rows]
    deficient = regmean_solve(
        weights, [r.T @ r / r.shape[0] for r in flat], 1.0, ridge="auto", tokens=400
    )
    assert deficient.ridge == AUTO_RIDGE
    assert deficient.condition_number_unregularized is not None
    assert not deficient.condition_number_unregularized <= 1e6


def _group(weights, rows, dtype):
    names = ["l.q.weight", "l.k.weight"]
    split = [w.split([6, 4]) for w in weights]
    stats = []
    for r in rows:
        st = TaskStatistics(
            count=r.shape[0], mean=r.mean(0).double(), gram=(r.T @ r / r.shape[0]).double()
        )
        stats.append(st)
    return LinearGroup(
        name="l.qk",
        weights=names,
        base={n: s for n, s in zip(names, split[0])},
        experts=[dict(zip(names, s)) for s in split],
        task_names=["a", "b"],
        expert_stats=stats,
        output_dtypes={n: dtype for n in names},
    )


def test_bf16_error_is_measured_on_the_written_weights():
    """Nearly equal experts: the float solution's error is tiny, bf16's rounding dominates."""
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(10, 12, generator=gen)
    weights = [base + 1e-4 * torch.randn(10, 12, generator=gen) for _ in range(2)]
    rows = [torch.randn(80, 12, generator=gen) for _ in range(2)]
    settings = LeastSquaresSettings(
        method="regmean",
        reduce_non_diagonal=1.0,
        ridge="auto",
        solver="pinv",
        use_merged_path=False,
        use_normalized_gram=False,
    )
    merged, record = merge_group_least_squares(_group(weights, rows, torch.bfloat16), settings)
    _, unrounded = merge_group_least_squares(_group(weights, rows, torch.float32), settings)
    written = torch.cat([merged["l.q.weight"], merged["l.k.weight"]]).to(torch.bfloat16)
    for k, task in enumerate(["a", "b"]):
        x = rows[k].double()
        diff = written.double() - weights[k].double()
        expected = float((diff @ x.T).norm() / (weights[k].double() @ x.T).norm())
        got = record["tasks"][task]["relative_output_error"]
        assert got == pytest.approx(expected, rel=1e-5)
        # the float32 solution's own error is far smaller: the record is not that one
        assert unrounded["tasks"][task]["relative_output_error"] < 0.5 * got
        assert unrounded["tasks"][task]["relative_output_error"] > 0.0  # never clamped to 0
    # the guard's norm ratio is of the written weights too
    expert_norm = max(float(w[:6].double().norm()) for w in weights)
    assert record["norm_ratio"]["l.q.weight"] == pytest.approx(
        float(written[:6].double().norm()) / expert_norm, rel=1e-12
    )


def test_bf16_merge_records_the_written_error(low_diversity, tmp_path):
    """End to end: the recorded error of block 0's qkv (RegMean, expert path) equals the one
    measured in float64 on the written bf16 weights and the expert's own inputs."""
    s = low_diversity
    out = tmp_path / "bf16"
    config = _config(s, method="regmean")
    config["dtype"] = "bfloat16"
    run_merge(config, out, run_options=RunOptions())
    written = load_file(os.path.join(out, "model.safetensors"))
    assert written["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    record = merge_record.load(str(out))["sections"]["regmean"]["layers"][0]
    assert record["layer"].startswith("model.layers.0.self_attn")
    names = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    merged = torch.cat([written[n] for n in names]).double()
    tokenizer = transformers.AutoTokenizer.from_pretrained(s["base"])
    for k, (expert, data) in enumerate(zip(s["experts"], s["data"])):
        model = transformers.LlamaForCausalLM.from_pretrained(expert).eval()
        inputs: list[torch.Tensor] = []
        hook = model.model.layers[0].self_attn.q_proj.register_forward_hook(
            lambda _m, args, _o, into=inputs: into.append(args[0].detach())
        )
        texts = [json.loads(line)["text"] for line in open(data, encoding="utf-8")]
        with torch.no_grad():
            for text in texts:
                model(**tokenizer(text, return_tensors="pt"))
        hook.remove()
        x = torch.cat([i.reshape(-1, HIDDEN) for i in inputs]).double()
        expert_weight = torch.cat(
            [getattr(model.model.layers[0].self_attn, f"{p}_proj").weight.detach() for p in "qkv"]
        ).double()
        expected = float(((merged - expert_weight) @ x.T).norm() / (expert_weight @ x.T).norm())
        got = record["tasks"][f"task{k}"]["relative_output_error"]
        assert got == pytest.approx(expected, rel=1e-3)


def test_qp_layer_objective_has_the_same_guard(low_diversity, tmp_path):
    s = low_diversity
    out = tmp_path / "qp"
    run_merge(_config(s, method="qp_projection"), out)
    layers = merge_record.load(str(out))["sections"]["qp_projection"]["layers"]
    assert all(layer["guard"] == "ok" for layer in layers)
    worst = max(layers, key=lambda layer: layer["max_norm_ratio"])
    assert worst["max_norm_ratio"] == pytest.approx(
        _max_norm_ratio(str(out), s["experts"]), rel=1e-6
    )
    # task arithmetic's sum of both updates is a little above either expert's norm: a
    # limit below it stops the merge, naming the linear, and leaves nothing
    assert worst["max_norm_ratio"] > 1.0
    stopped = tmp_path / "stopped"
    with pytest.raises(TensorError, match=r"qp_projection: the merged model\.layers\.\d\."):
        run_merge(_config(s, method="qp_projection", max_norm_ratio=1.0), stopped)
    assert not stopped.exists()


def test_card_section_leads_with_the_worst_layer_and_keeps_inf_and_nan():
    from mergekit_ext.hub.card.render import _environment
    from mergekit_ext.methods.card_sections.least_squares import summarize_layerwise

    def layer(name, error, cond, ratio):
        return {
            "layer": name,
            "condition_number": cond,
            "ridge": 0.0,
            "max_norm_ratio": ratio,
            "guard": "warned" if ratio > NORM_RATIO_WARN else "ok",
            "tasks": {"a": {"weight": 1.0, "relative_output_error": error}},
        }

    # as read back from the JSON: inf and NaN are strings
    section = {
        "layers": [
            layer("m.0.qkv", 0.1, 10.0, 1.0),
            layer("m.0.o_proj", "inf", "inf", 3.5),
            layer("m.1.qkv", "nan", 20.0, 1.0),
        ]
    }
    summary = summarize_layerwise(section)
    assert summary["worst"]["layer"] == "m.1.qkv" and math.isnan(summary["worst"]["error"])
    assert summary["condition_number"]["max"] == math.inf and summary["singular"] == 1
    assert math.isnan(summary["tasks"][0]["error"]["max"])
    assert summary["out_of_range"] == [{"layer": "m.0.o_proj", "norm_ratio": 3.5}]
    template = _environment(None).get_template("sections/least_squares.md.j2")
    text = template.render(s={"summary": summary})
    assert text.lstrip().startswith("**Worst layer:** `m.1.qkv`, relative output error NaN")
    assert "max ∞ (1 singular)" in text and "`m.0.o_proj` (3.5×)" in text
    assert summary["kept_in_range"] == [] and "raised the ridge" not in text
    # a group whose solution auto brought back into range is named with where it started
    section["layers"][0].update(norm_ratio_before_ridge=11.6, ridge=6.64e-4)
    summary = summarize_layerwise(section)
    assert summary["kept_in_range"] == [{"layer": "m.0.qkv", "before": 11.6, "ridge": 6.64e-4}]
    text = template.render(s={"summary": summary})
    assert "raised the ridge of 1 group(s)" in text and "`m.0.qkv` (11.6× → ridge" in text
    # without the NaN layer the inf one is the worst
    summary = summarize_layerwise({"layers": section["layers"][:2]})
    assert summary["worst"]["layer"] == "m.0.o_proj" and summary["worst"]["error"] == math.inf


def test_few_chats_per_task_solve_in_the_span_and_stay_bounded(low_diversity, tmp_path):
    """A few chats per task: each task has fewer tokens than a group's inputs, both together
    more, and the template makes the system ill-conditioned, so auto adds its ridge and the
    solve finishes in the tokens' span (docs/methods.md, "As many tokens as inputs, or
    more"). The merge stays in the experts' range, keeps their held-out agreement, and the
    record says which solve and why."""
    s = low_diversity
    config = _config(s)
    for model in config["models"]:
        model["calibration"]["samples"] = SPAN_SAMPLES
    out = tmp_path / "merged"
    run_merge(config, out)
    layers = merge_record.load(str(out))["sections"]["chain_of_merges"]["layers"]
    late = [
        r
        for r in layers
        if r["solver"].startswith("cholesky in the span") and r["tokens"] >= r["input_width"]
    ]
    assert late, [(r["solver"], r["tokens"], r["input_width"]) for r in layers]
    for layer in late:
        assert layer["ridge"] == AUTO_RIDGE and layer["ridge_reason"].startswith("auto: ")
        assert float(layer["condition_number_unregularized"]) > 1e6  # "inf": singular
        assert layer["guard"] == "ok"
    assert _max_norm_ratio(str(out), s["experts"]) < 1.2
    base_agreement = _held_out_agreement(s["base"], s["experts"])
    assert _held_out_agreement(str(out), s["experts"]) >= base_agreement - 0.03
