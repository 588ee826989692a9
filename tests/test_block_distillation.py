"""Block-wise distillation on Chain of Merges (issue #51): real merges of tiny models.

The method starts each block from CoM's solution and trains the block's linears, on the
task's merged-path inputs, toward each expert's block output on the expert's own path (the
default) or on the same inputs; these tests run it through ``mergekit-ext run`` and check
what it promises: a lower block error than CoM's start (on the calibration data and on
held-out texts of the same tasks), merged features closer to the experts' own with the
expert-path target, the cosine step size, the same bytes twice and on two processes, the
bfloat16 path on float32 master weights, clear errors for bad values.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
from collections.abc import Callable

import pytest
import torch
import transformers
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file
from test_data_aware_cli import _calibration
from test_distributed import (
    COLLECTIVE_TIMEOUT_S,
    _launch,
    _single_process,
    _write_config,
)

from mergekit_ext.cli import main
from mergekit_ext.errors import ConfigError, TensorError
from mergekit_ext.methods import block_distillation as bd
from mergekit_ext.methods.layerwise import BlockToRefine
from mergekit_ext.methods.registry import ext_method_info
from mergekit_ext.testing import WORDS

METHOD = "block_distillation"
FEW = {"distill_steps": 12, "distill_lr": 0.01}  # short: enough to move every tiny block
# the block's own error: what ``_block_errors`` measures on held-out texts
OWN = {**FEW, "distill_target": "merged_path"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see conftest.py


def _merge(tmp_path, tiny, k: int, method: str, parameters: dict, name: str) -> str:
    folder = tmp_path / name
    folder.mkdir()
    config = _write_config(str(folder), method, tiny.base, list(tiny.experts[:k]), parameters)
    out = str(folder / "merged")
    _single_process(config, out)
    return out


def _diagnostics(out: str, method: str) -> dict:
    with open(os.path.join(out, "mergekit_ext_diagnostics.json"), encoding="utf-8") as fp:
        return json.load(fp)["sections"][method]


def _held_out_texts(seed: int) -> list[str]:
    # other seeds than the calibration files' (0, 1, 2): texts the merge never saw
    rng = random.Random(100 + seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 12))) for _ in range(6)]


def _block_errors(
    merged_dir: str,
    expert_dirs: list[str],
    arch: str,
    texts: Callable[[int], list[str]] = lambda k: _held_out_texts(k),
    equal: bool = False,
    max_length: int | None = None,
) -> list[float]:
    """Per task and block: ‖f(X) − f_k(X)‖ / ‖f_k(X)‖ on task k's ``texts`` (held-out by
    default), X the merged model's own block inputs (its merged path), f_k expert k's block
    on the same call; ``equal``: the square root of the mean over tokens of
    ‖f(x_t) − f_k(x_t)‖² / ‖f_k(x_t)‖² instead (distill_token_weight: equal)."""
    cls = getattr(transformers, arch)
    merged = cls.from_pretrained(merged_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(merged_dir)
    blocks = _layers(merged)
    errors = []
    for k, expert_dir in enumerate(expert_dirs):
        expert_blocks = _layers(cls.from_pretrained(expert_dir).eval())
        calls: list = []

        def record(module, args, kwargs, output, calls=calls):
            calls.append((args, kwargs, output[0] if isinstance(output, tuple) else output))

        handles = [b.register_forward_hook(record, with_kwargs=True) for b in blocks]
        with torch.no_grad():
            truncate = {"truncation": True, "max_length": max_length} if max_length else {}
            batch = tokenizer(texts(k), return_tensors="pt", padding=True, **truncate)
            # no cache: the recorded calls are replayed through the experts' blocks
            merged(**batch, **({"use_cache": False} if "Llama" in arch else {}))
            for h in handles:
                h.remove()
            mask = batch["attention_mask"].bool()
            for i, (args, kwargs, out) in enumerate(calls):
                target = expert_blocks[i](*args, **kwargs)
                target = target[0] if isinstance(target, tuple) else target
                diff, energy = (out - target).pow(2).sum(-1)[mask], target.pow(2).sum(-1)[mask]
                if equal:
                    errors.append(float((diff / energy).mean().sqrt()))
                else:
                    errors.append(float((diff.sum() / energy.sum()).sqrt()))
    return errors


def _layers(model) -> list:
    for path in ("model.layers", "encoder.layer", "bert.encoder.layer"):
        try:
            return list(model.get_submodule(path))
        except AttributeError:
            continue
    raise AssertionError(f"no block list in {type(model).__name__}")


@pytest.mark.parametrize("set_name", ["tiny_llama_set", "tiny_bert_set"])
def test_distillation_lowers_the_block_error_below_com(request, set_name, tmp_path):
    tiny = request.getfixturevalue(set_name)
    com = _merge(tmp_path, tiny, 3, "chain_of_merges", {}, "com")
    out = _merge(tmp_path, tiny, 3, METHOD, OWN, "distill")

    # on the calibration data: the executor's own measurement, per block and task
    blocks = _diagnostics(out, METHOD)["blocks"]
    # the first block takes distill_first_block_factor times the steps
    factor = bd.BlockDistillationParameters().distill_first_block_factor
    assert [b["steps"] for b in blocks] == [FEW["distill_steps"] * factor, FEW["distill_steps"]]
    for b in blocks:
        assert b["kept"] == "refined", b
        # the objective is the tasks' mean: one task may give a little for the others
        tasks = b["tasks"].values()
        assert sum(r["error_after"] for r in tasks) < sum(r["error_before"] for r in tasks), b
        assert b["error_after"] < b["error_before"]
        assert b["guard"] == "ok"
    card = open(os.path.join(out, "README.md"), encoding="utf-8").read()
    assert "**Block-wise distillation:**" in card and f"took {FEW['distill_steps']}" in card
    # the first block's start is exactly CoM's: the same inputs, the same solve
    com_layers = _diagnostics(com, "chain_of_merges")["layers"]
    assert _diagnostics(out, METHOD)["layers"][0]["tasks"] == com_layers[0]["tasks"]

    # on held-out texts of the same tasks, measured here with transformers' own models
    experts = list(tiny.experts[:3])
    before = _block_errors(com, experts, tiny.architecture)
    after = _block_errors(out, experts, tiny.architecture)
    assert sum(after) < sum(before), (before, after)
    # the written weights differ from CoM's where it trained, and only the block linears
    a, b = (
        load_file(os.path.join(com, "model.safetensors")),
        load_file(os.path.join(out, "model.safetensors")),
    )
    changed = {n for n in a if not torch.equal(a[n], b[n])}
    # the blocks' linear weights only (the merged-path target trains no embeddings;
    # distill_vectors is off by default)
    assert changed and all(n.endswith(".weight") and "norm" not in n.lower() for n in changed)
    assert not any("embed" in n for n in changed), changed


@pytest.mark.parametrize("token_weight", ["energy", "equal"])
def test_the_block_error_weighs_tokens_as_asked(tiny_llama_set, tmp_path, token_weight):
    """The error each block reports (distill_min_gain's measure, the diagnostics) is the
    one ``distill_token_weight`` names, recomputed here with transformers' own blocks on
    the calibration texts: energy, the error's share of the targets' energy over all
    tokens; equal, each token's relative error, averaged over the tokens."""
    params = {"distill_steps": 0, "distill_target": "merged_path"}
    out = _merge(
        tmp_path, tiny_llama_set, 2, METHOD, {**params, "distill_token_weight": token_weight}, "m"
    )
    blocks = _diagnostics(out, METHOD)["blocks"]
    assert [b["token_weight"] for b in blocks] == [token_weight] * len(blocks)

    def calibration(k: int) -> list[str]:
        path = tmp_path / "m" / f"t{k}.jsonl"
        return [json.loads(line)["text"] for line in path.read_text().splitlines()]

    experts = list(tiny_llama_set.experts[:2])
    both = {
        equal: _block_errors(
            out, experts, tiny_llama_set.architecture, calibration, equal, max_length=16
        )
        for equal in (False, True)
    }
    mine, other = both[token_weight == "equal"], both[token_weight != "equal"]
    reported = [b["tasks"][f"task{k}"]["error_before"] for k in range(2) for b in blocks]
    assert reported == pytest.approx(mine, rel=1e-4)
    # the two measures differ on these models: the recomputation tells them apart
    assert reported != pytest.approx(other, rel=1e-2)
    card = " ".join(open(os.path.join(out, "README.md"), encoding="utf-8").read().split())
    assert ("each token's own, averaged" in card) == (token_weight == "equal"), card


def test_equal_token_weight_is_each_tokens_relative_error():
    """``distill_token_weight: equal`` on a batch whose first token holds almost all of
    the target's energy (an LLM's attention sink): its error no longer decides the loss."""
    from mergekit_ext.executor import refine

    gen = torch.Generator().manual_seed(0)
    target = torch.randn(2, 5, 8, generator=gen)
    target[:, 0] *= 100.0  # the sink: 10^4 times the other tokens' energy
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False  # padding: never counted
    diff = 0.1 * torch.randn(2, 5, 8, generator=gen)
    diff[:, 0] *= 10.0
    relative = [
        float(diff[b, t].pow(2).sum() / target[b, t].pow(2).sum())
        for b in range(2)
        for t in range(5)
        if mask[b, t]
    ]
    scale = refine._token_scale(target, mask)
    equal = refine._squared_error(diff, mask, scale) / refine._token_count(target, mask)
    assert float(equal) == pytest.approx(sum(relative) / len(relative), rel=1e-5)
    energy = refine._squared_error(diff, mask) / refine._squared_error(target, mask)
    # energy: the sink's relative error (about 10^-4 of its energy) and little else
    sink = float(diff[:, 0].pow(2).sum() / target[:, 0].pow(2).sum())
    assert float(energy) == pytest.approx(sink, rel=0.05)
    assert float(equal) > 10 * float(energy)
    # a zero target row weighs as a floor of the batch's mean energy, never infinitely
    target[0, 2] = 0.0
    assert torch.isfinite(refine._token_scale(target, mask)).all()


def _feature_errors(merged_dir: str, expert_dirs: list[str], arch: str) -> list[float]:
    """Per task: ‖h − h_k‖ / ‖h_k‖ of the last hidden states on held-out texts, h the
    merged model's, h_k expert k's (each on its own path: what the task's head reads)."""
    cls = getattr(transformers, arch)
    tokenizer = transformers.AutoTokenizer.from_pretrained(merged_dir)
    merged = cls.from_pretrained(merged_dir).eval()
    errors = []
    for k, expert_dir in enumerate(expert_dirs):
        expert = cls.from_pretrained(expert_dir).eval()
        batch = tokenizer(_held_out_texts(k), return_tensors="pt", padding=True)
        mask = batch["attention_mask"].bool()
        with torch.no_grad():
            h, h_k = (
                m(**batch, output_hidden_states=True).hidden_states[-1] for m in (merged, expert)
            )
        diff = (h - h_k).pow(2).sum(-1)[mask].sum()
        errors.append(float((diff / h_k.pow(2).sum(-1)[mask].sum()).sqrt()))
    return errors


@pytest.mark.parametrize("set_name", ["tiny_llama_set", "tiny_bert_set"])
def test_expert_path_target_brings_the_features_closer_to_the_experts(request, set_name, tmp_path):
    """ProDistill's dual inputs: each block's target is the expert's own feature, so the
    drift of the merged blocks below is corrected too; the merged model's last hidden
    states on held-out texts end closer to each expert's own than CoM's and than those
    of the merged-path target (which fits each block's own error only, and need not bring
    the last features closer than CoM's)."""
    tiny = request.getfixturevalue(set_name)
    experts = list(tiny.experts[:3])
    com = _merge(tmp_path, tiny, 3, "chain_of_merges", {}, "com")
    own = _merge(tmp_path, tiny, 3, METHOD, OWN, "own")
    dual = _merge(tmp_path, tiny, 3, METHOD, FEW, "dual")
    blocks = _diagnostics(dual, METHOD)["blocks"]
    assert [b["target"] for b in blocks] == ["expert_path"] * 2
    assert all(b["kept"] == "refined" for b in blocks), blocks
    # above the first block the expert-path target also holds the drift below: a larger
    # start error than the block's own on the same weights (CoM's)
    own_blocks = _diagnostics(own, METHOD)["blocks"]
    assert blocks[1]["error_before"] > own_blocks[1]["error_before"], (blocks, own_blocks)
    errors = {
        name: sum(_feature_errors(m, experts, tiny.architecture))
        for name, m in (("com", com), ("own", own), ("dual", dual))
    }
    assert errors["dual"] < min(errors["own"], errors["com"]), errors
    card = open(os.path.join(dual, "README.md"), encoding="utf-8").read()
    assert "own path (the expert's features" in " ".join(card.split()), card


def test_cosine_schedule_decays_the_step_size_to_zero(tiny_llama_set, tmp_path, monkeypatch):
    seen: list[list[float]] = []
    step = torch.optim.Adam.step

    def spy(self, *args, **kwargs):
        seen.append([g["lr"] for g in self.param_groups])
        return step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", spy)
    one = {**FEW, "distill_first_block_factor": 1}  # every block the same number of steps
    _merge(tmp_path, tiny_llama_set, 2, METHOD, {**one, "distill_schedule": "cosine"}, "cos")
    steps = FEW["distill_steps"]
    assert len(seen) == 2 * steps  # two blocks
    for block in (seen[:steps], seen[steps:]):
        first, last = block[0], block[-1]
        # the first step at distill_lr × RMS(W_CoM − W_0), then falling to ~0
        assert all(a > 0 for a in first)
        assert all(b < 0.02 * a for a, b in zip(first, last))
        assert all(x >= y for s, t in zip(block, block[1:]) for x, y in zip(s, t))
    seen.clear()
    _merge(tmp_path, tiny_llama_set, 2, METHOD, one, "constant")  # the default
    assert seen and all(s == seen[0] for s in seen[:steps])


def test_same_bytes_twice_and_zero_steps_is_com(tiny_llama_set, tmp_path):
    params = {**FEW, "distill_train": "lowrank", "distill_rank": 2, "seed": 3}
    one = _merge(tmp_path, tiny_llama_set, 2, METHOD, params, "one")
    two = _merge(tmp_path, tiny_llama_set, 2, METHOD, params, "two")
    a = load_file(os.path.join(one, "model.safetensors"))
    b = load_file(os.path.join(two, "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)
    assert all(r["kept"] == "refined" for r in _diagnostics(one, METHOD)["blocks"])

    zero = _merge(tmp_path, tiny_llama_set, 2, METHOD, {"distill_steps": 0}, "zero")
    com = _merge(tmp_path, tiny_llama_set, 2, "chain_of_merges", {}, "com")
    a = load_file(os.path.join(zero, "model.safetensors"))
    b = load_file(os.path.join(com, "model.safetensors"))
    assert all(torch.equal(a[n], b[n]) for n in a)

    # steps that lower the error by less than distill_min_gain are dropped: CoM's bytes
    small = _merge(tmp_path, tiny_llama_set, 2, METHOD, {**params, "distill_min_gain": 0.99}, "mg")
    blocks = _diagnostics(small, METHOD)["blocks"]
    assert all(r["kept"] == "start" for r in blocks), blocks
    assert all(r["error_after"] == r["error_before"] > r["error_refined"] for r in blocks), blocks
    a = load_file(os.path.join(small, "model.safetensors"))
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_checkpoints_keep_the_lowest_measured_error(tiny_llama_set, tmp_path, monkeypatch):
    one = {**FEW, "distill_first_block_factor": 1, "distill_min_gain": 0}  # 12 steps a block
    plain = _merge(tmp_path, tiny_llama_set, 2, METHOD, one, "plain")
    # every step measured: on the tiny models the error falls at every step, so the last
    # step's weights stay the result and the measurements change nothing of the steps
    every = {**one, "distill_checkpoints": 11}
    measured = _merge(tmp_path, tiny_llama_set, 2, METHOD, every, "measured")
    a = load_file(os.path.join(plain, "model.safetensors"))
    b = load_file(os.path.join(measured, "model.safetensors"))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert [x["best_step"] for x in _diagnostics(measured, METHOD)["blocks"]] == [12, 12]

    # the first block's error after step 5 reported lowest: its weights after step 5 are
    # the result, the bytes of a merge that stops there
    refine = bd.BlockDistillation.refine
    seen: list[int] = []

    def spy(self, block):
        errors = block.errors

        def low_after_five(weights):
            seen.append(1)
            out = errors(weights)
            # calls: the start's, steps 1-11 (the sixth call: after step 5), the end's
            return {t: e * 0.01 for t, e in out.items()} if len(seen) == 6 else out

        return refine(self, dataclasses.replace(block, errors=low_after_five))

    monkeypatch.setattr(bd.BlockDistillation, "refine", spy)
    fifth = _merge(tmp_path, tiny_llama_set, 2, METHOD, every, "fifth")
    monkeypatch.setattr(bd.BlockDistillation, "refine", refine)
    blocks = _diagnostics(fifth, METHOD)["blocks"]
    assert (blocks[0]["best_step"], blocks[0]["kept"], blocks[0]["steps"]) == (5, "refined", 12)
    five = _merge(tmp_path, tiny_llama_set, 2, METHOD, {**one, "distill_steps": 5}, "five")
    c = load_file(os.path.join(fifth, "model.safetensors"))
    d = load_file(os.path.join(five, "model.safetensors"))
    layer0 = [n for n in c if ".layers.0." in n]
    assert layer0 and all(torch.equal(c[n], d[n]) for n in layer0)
    assert not all(torch.equal(c[n], a[n]) for n in layer0)
    card = " ".join(open(os.path.join(fifth, "README.md"), encoding="utf-8").read().split())
    assert "In 1 kept blocks the result is the lowest-error weights measured" in card, card
    card = " ".join(open(os.path.join(measured, "README.md"), encoding="utf-8").read().split())
    assert "the result is the lowest-error" not in card


@pytest.mark.parametrize("set_name", ["tiny_llama_set", "tiny_bert_set"])
def test_two_processes_write_the_bytes_of_one(request, set_name, tmp_path):
    # a few steps: every step passes the gradient sums between the ranks (BERT: the
    # embeddings' too, trained with the first block)
    tiny = request.getfixturevalue(set_name)
    steps = {**FEW, "distill_steps": 4, "distill_checkpoints": 2}  # the errors measured too
    config = _write_config(str(tmp_path), METHOD, tiny.base, list(tiny.experts[:3]), steps)
    reference = str(tmp_path / "one" / "merged")
    _single_process(config, reference)
    (tmp_path / "two").mkdir()
    out = str(tmp_path / "two" / "merged")
    results = _launch(
        2, [config, out, "--distributed-timeout", str(COLLECTIVE_TIMEOUT_S)], str(tmp_path)
    )
    assert [rc for rc, _ in results] == [0, 0], results
    one = load_file(os.path.join(reference, "model.safetensors"))
    two = load_file(os.path.join(out, "model.safetensors"))
    assert set(one) == set(two)
    for name in one:
        assert torch.equal(one[name], two[name]), name
    blocks = _diagnostics(reference, METHOD)["blocks"]
    assert _diagnostics(out, METHOD)["blocks"] == blocks
    assert ("pre_block" in blocks[0]) == (set_name == "tiny_bert_set"), blocks[0]


def test_bf16_compute_trains_float32_master_weights(tiny_llama_set, tmp_path, monkeypatch):
    seen: list = []
    refine = bd.BlockDistillation.refine

    def spy(self, block):
        weights = dict(block.start)
        grads, _ = block.gradient(weights, 0)
        seen.append(({w.dtype for w in weights.values()}, {g.dtype for g in grads.values()}))
        return refine(self, block)

    monkeypatch.setattr(bd.BlockDistillation, "refine", spy)
    out = _merge(tmp_path, tiny_llama_set, 2, METHOD, {**FEW, "compute_dtype": "bfloat16"}, "bf16")
    assert seen and all(s == ({torch.float32}, {torch.float32}) for s in seen)
    diag = json.load(open(os.path.join(out, "mergekit_ext_diagnostics.json"), encoding="utf-8"))
    assert diag["executor"]["compute_dtype"] == "bfloat16"
    blocks = diag["sections"][METHOD]["blocks"]
    assert all(b["error_after"] < b["error_before"] for b in blocks), blocks


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"distill_steps": -1}, "distill_steps"),
        ({"distill_lr": 0}, "distill_lr"),
        ({"distill_lr": "fast"}, "distill_lr"),
        ({"distill_train": "everything"}, "distill_train"),
        ({"distill_rank": 0}, "distill_rank"),
        ({"propagate": False}, "propagate"),
        ({"distill_target": "expert"}, "distill_target"),
        ({"distill_schedule": "linear"}, "distill_schedule"),
        ({"distill_min_gain": -0.1}, "distill_min_gain"),
        ({"distill_min_gain": 1.0}, "distill_min_gain"),
        ({"distill_max_norm_ratio": 0.5}, "distill_max_norm_ratio"),
        ({"distill_max_norm_ratio": "wide"}, "distill_max_norm_ratio"),
        ({"distill_embeddings": "some"}, "distill_embeddings"),
        ({"distill_embeddings": 2}, "distill_embeddings"),
        ({"distill_vectors": "norms"}, "distill_vectors"),
        ({"distill_checkpoints": -1}, "distill_checkpoints"),
        ({"distill_first_block_factor": 0}, "distill_first_block_factor"),
        ({"distill_first_block_factor": 101}, "distill_first_block_factor"),
        ({"distill_first_block_factor": 1.5}, "distill_first_block_factor"),
    ],
)
def test_bad_values_name_the_field(bad, field):
    info = ext_method_info(METHOD)
    with pytest.raises(ConfigError, match=field):
        info.parse_parameters(bad)


def test_good_values_are_accepted_and_listed():
    info = ext_method_info(METHOD)
    p = info.parse_parameters(
        {
            "distill_steps": 0,
            "distill_lr": 1.0,
            "distill_train": "lowrank",
            "distill_rank": 4,
            "distill_target": "merged_path",
            "distill_schedule": "cosine",
            "distill_embeddings": False,
            "distill_vectors": True,
            "distill_first_block_factor": 1,
            "distill_max_norm_ratio": float("inf"),
        }
    )
    assert (p.distill_steps, p.distill_train, p.propagate) == (0, "lowrank", True)
    assert (p.distill_target, p.distill_schedule) == ("merged_path", "cosine")
    default = info.parse_parameters({})
    assert (default.distill_target, default.distill_schedule) == ("expert_path", "constant")
    assert default.distill_embeddings and not p.distill_embeddings
    assert not default.distill_vectors and default.distill_first_block_factor == 3
    assert default.distill_min_gain == 0.02
    assert default.distill_max_norm_ratio == 2.0 and p.distill_max_norm_ratio == float("inf")
    result = CliRunner().invoke(main, ["methods", "--json"])
    assert result.exit_code == 0, result.output
    listed = {m["name"]: m for m in json.loads(result.output)}
    names = {q["name"] for q in listed[METHOD]["parameters"]}
    assert {
        "distill_steps",
        "distill_lr",
        "distill_train",
        "distill_rank",
        "seed",
        "distill_target",
        "distill_schedule",
        "distill_embeddings",
        "distill_vectors",
        "distill_first_block_factor",
        "distill_min_gain",
        "distill_max_norm_ratio",
        "distill_checkpoints",
    } <= names
    assert listed[METHOD]["needs_calibration"]


def test_dry_run_estimates_the_refinement(tiny_llama_set, tmp_path):
    def dry_run(method: str, name: str) -> str:
        folder = tmp_path / name
        folder.mkdir()
        config = _write_config(
            str(folder), method, tiny_llama_set.base, list(tiny_llama_set.experts[:2]), {}
        )
        result = CliRunner().invoke(main, ["run", config, str(folder / "out"), "--dry-run"])
        assert result.exit_code == 0, result.output
        assert not os.path.exists(folder / "out")
        return result.output

    ours, com = dry_run(METHOD, "distill"), dry_run("chain_of_merges", "com")
    line = next(x for x in ours.splitlines() if "block refinement" in x)
    assert "optimizer state" in line and not line.rstrip().endswith(" 0.00 MB"), line
    assert "block refinement" not in com


def test_more_processes_than_tasks_is_refused_before_loading(tiny_llama_set, tmp_path):
    """Each task's gradient is summed on the rank that holds it: W > K is refused at plan
    time (``--dry-run --world-size``), naming both numbers; W = K plans, and so does
    chain_of_merges at W > K (its ranks share tasks)."""

    def dry_run(method: str, world: int) -> tuple[int, str]:
        folder = tmp_path / f"{method}-{world}"
        folder.mkdir()
        config = _write_config(
            str(folder), method, tiny_llama_set.base, list(tiny_llama_set.experts[:2]), {}
        )
        args = ["run", config, str(folder / "out"), "--dry-run", "--world-size", str(world)]
        result = CliRunner().invoke(main, args)
        return result.exit_code, result.output

    code, out = dry_run(METHOD, 3)
    assert code != 0 and "at most as many processes as tasks (2), not 3" in out, out
    assert dry_run(METHOD, 2)[0] == 0
    assert dry_run("chain_of_merges", 3)[0] == 0


def _merge_any(tmp_path, tiny, method: str, parameters: dict, name: str) -> str:
    """A K = 3 merge of any tiny set (pixel tensors for a ViT, texts otherwise)."""
    folder = tmp_path / name
    folder.mkdir()
    config = {
        "merge_method": method,
        "base_model": tiny.base,
        "models": [
            {"model": e, "name": f"task{k}", "calibration": _calibration(folder, tiny, k)}
            for k, e in enumerate(tiny.experts[:3])
        ],
        "calibration": {"samples": 8, "max_length": 16, "batch_size": 4},
        "parameters": parameters,
    }
    (folder / "c.yml").write_text(yaml.safe_dump(config))
    out = str(folder / "merged")
    _single_process(str(folder / "c.yml"), out)
    return out


# the tensors before the first block each family trains with it (never a token table)
EMBEDDINGS = {
    "tiny_vit_set": {
        "embeddings.cls_token",
        "embeddings.position_embeddings",
        "embeddings.patch_embeddings.projection.weight",
        "embeddings.patch_embeddings.projection.bias",
    },
    "tiny_bert_set": {
        "embeddings.position_embeddings.weight",
        "embeddings.token_type_embeddings.weight",
        "embeddings.LayerNorm.weight",
        "embeddings.LayerNorm.bias",
    },
    "tiny_llama_set": set(),
}


@pytest.mark.parametrize("set_name", sorted(EMBEDDINGS))
def test_embeddings_trained_with_the_first_block_lower_its_error(request, set_name, tmp_path):
    """``distill_embeddings`` (the default): the tensors before the first block are trained
    with it against its expert-path targets; they change, and the first block ends with a
    lower error than with the embeddings as merged. An LM's token table is never trained
    (a Llama has nothing else before its first block: the bytes of ``false``)."""
    tiny = request.getfixturevalue(set_name)
    on = _merge_any(tmp_path, tiny, METHOD, FEW, "on")
    off = _merge_any(tmp_path, tiny, METHOD, {**FEW, "distill_embeddings": False}, "off")
    a, b = (load_file(os.path.join(m, "model.safetensors")) for m in (on, off))
    changed = {n for n in a if not torch.equal(a[n], b[n])}
    first_on, first_off = (_diagnostics(m, METHOD)["blocks"][0] for m in (on, off))
    expected = EMBEDDINGS[set_name]
    if not expected:
        assert not changed and "pre_block" not in first_on
        return
    trained = {n.removeprefix("vit.").removeprefix("bert.") for n in first_on["pre_block"]}
    assert trained == expected, first_on["pre_block"]
    assert all(r["change"] > 0 for r in first_on["pre_block"].values())
    assert {n.removeprefix("vit.").removeprefix("bert.") for n in changed} >= expected
    assert "pre_block" not in first_off and first_on["kept"] == "refined"
    # the same start (CoM's block on the merged embeddings), a lower end
    assert first_on["error_before"] == first_off["error_before"]
    assert first_on["error_after"] < first_off["error_after"], (first_on, first_off)


@pytest.mark.parametrize("set_name", ["tiny_llama_set", "tiny_vit_set"])
def test_block_vectors_are_trained_with_the_linears(request, set_name, tmp_path):
    """``distill_vectors: true``: each block's biases and norm weights are trained with its
    linears (written after the steps); without it (the default) only the linears' weights
    change from CoM's, and the blocks end with a higher calibration error."""
    tiny = request.getfixturevalue(set_name)
    params = {**FEW, "distill_embeddings": False}
    com = _merge_any(tmp_path, tiny, "chain_of_merges", {}, "com")
    on = _merge_any(tmp_path, tiny, METHOD, {**params, "distill_vectors": True}, "on")
    off = _merge_any(tmp_path, tiny, METHOD, params, "off")
    a, b, c = (load_file(os.path.join(m, "model.safetensors")) for m in (com, on, off))
    linears_only = {n for n in a if not torch.equal(a[n], c[n])}
    assert linears_only and all(c[n].dim() == 2 for n in linears_only), linears_only
    vectors = {n for n in a if not torch.equal(a[n], b[n]) and b[n].dim() == 1}
    assert any("norm" in n for n in vectors) and any(n.endswith(".bias") for n in vectors) == (
        set_name == "tiny_vit_set"  # a Llama's linears have no biases
    ), vectors
    assert not any("embed" in n for n in vectors)
    errors = [sum(b["error_after"] for b in _diagnostics(m, METHOD)["blocks"]) for m in (on, off)]
    assert errors[0] < errors[1], errors


def _outward_block(train: str) -> tuple[BlockToRefine, dict[str, float]]:
    """A block whose loss falls as its weights grow: ``Σ_n −⟨W_n, D_n⟩`` for a fixed
    direction ``D_n``, the error ``1 / (1 + Σ ⟨W_n, D_n⟩⁺)``; the steps push every weight
    out of the experts' range. One linear starts inside (0.5x), one beyond it (1.8x: a solve
    with an explicit ridge); the reference norm of each is 1."""
    generator = torch.Generator().manual_seed(0)
    start, base, directions = {}, {}, {}
    for n, shape, scale in (("a.weight", (6, 4), 0.5), ("b.weight", (5, 3), 1.8)):
        w = torch.randn(shape, generator=generator)
        start[n] = w * (scale / float(w.norm()))
        base[n] = start[n] * 0.5  # CoM moved it: the step size is a fraction of that move
        directions[n] = torch.randn(shape, generator=generator)

    def gradient(weights, step):
        return {n: -directions[n].clone() for n in weights}, [0.0]

    def errors(weights):
        gain = sum(float((weights[n] * directions[n]).sum()) for n in weights)
        return {"task": 1.0 / (1.0 + max(gain, 0.0))}

    block = BlockToRefine(
        name="layers.0",
        start=start,
        base=base,
        expert_norms={n: 1.0 for n in start},
        task_names=["task"],
        gradient=gradient,
        errors=errors,
    )
    return block, {n: float(w.norm()) for n, w in start.items()}


@pytest.mark.parametrize("train", ["weights", "lowrank"])
def test_the_steps_keep_every_tensor_within_the_norm_limit(train):
    """Steps that would take the weights out of the experts' range stop at the limit:
    ``distill_max_norm_ratio`` x the largest expert's norm, or the start's norm where the
    start is further out; ``.inf`` lets them go, until the result guard stops the merge
    (issue #51: 2-3x on the tiny example, warned on every block)."""
    block, start_norms = _outward_block(train)
    common = {
        "distill_steps": 40,
        "distill_lr": 0.5,
        "distill_train": train,
        "distill_rank": 2,
        "distill_max_norm_ratio": 1.5,
    }
    info = ext_method_info(METHOD)
    limited = bd.BlockDistillation(info.parse_parameters(common), METHOD)
    result, record = limited.refine(block)
    assert record["kept"] == "refined"
    norms = {n: float(w.double().norm()) for n, w in result.items()}
    assert 1.497 < norms["a.weight"] <= 1.5  # 1.5 x its expert's norm, a hair inside
    assert norms["b.weight"] == pytest.approx(start_norms["b.weight"], rel=1e-5)  # not further
    assert set(record["norm_limited"]) == {"a.weight", "b.weight"}
    assert record["guard"] == "ok" and record["max_norm_ratio"] < 1.8 + 1e-5

    free = bd.BlockDistillation(
        info.parse_parameters({**common, "distill_max_norm_ratio": float("inf")}), METHOD
    )
    with pytest.raises(TensorError, match="above max_norm_ratio = 10"):  # the guard's stop
        free.refine(block)


def test_the_progress_bar_counts_each_blocks_steps(tiny_llama_set, tmp_path):
    """An 8B block's steps take hours on a CPU: the block's bar shows the step count and
    the loss (at most once a second, and after the last step)."""
    folder = tmp_path / "progress"
    folder.mkdir()
    params = {**FEW, "distill_steps": 3}
    config = _write_config(
        str(folder), METHOD, tiny_llama_set.base, list(tiny_llama_set.experts[:2]), params
    )
    result = CliRunner().invoke(main, ["run", config, str(folder / "merged")])
    assert result.exit_code == 0, result.output
    # the first block takes distill_first_block_factor (3) times the steps
    assert re.search(r"block 1/\d+: refinement step 9/9, loss \d", result.output), result.output
    assert re.search(r"block 2/\d+: refinement step 3/3, loss \d", result.output), result.output


def test_a_merge_held_at_its_norm_limit_says_so(tiny_llama_set, tmp_path):
    """Through the CLI: every written linear within the limit, the record names the tensors
    it held back, and the card says so."""
    params = {"distill_steps": 12, "distill_lr": 0.05, "distill_max_norm_ratio": 1.0}
    out = _merge(tmp_path, tiny_llama_set, 2, METHOD, params, "limited")
    section = _diagnostics(out, METHOD)
    blocks = section["blocks"]
    assert any(b["norm_limited"] for b in blocks if b["kept"] == "refined"), blocks
    # CoM's ratios (the start); where one is above the limit the steps keep it there
    start = {n: r for g in section["layers"] for n, r in g["norm_ratio"].items()}
    for b in blocks:
        for n, r in b["norm_ratio"].items():
            assert r <= max(1.0, start[f"model.{n}"]) * (1 + 1e-6), (n, r, start[f"model.{n}"])
    with open(os.path.join(out, "README.md"), encoding="utf-8") as fp:
        assert "shortened to stay within\n`distill_max_norm_ratio`" in fp.read()
