"""Distributed execution: W processes (gloo on CPU, 127.0.0.1) give the one-process merge.

Each multi-process test launches real processes of ``python -m mergekit_ext run`` with the
``torch.distributed`` environment (one through the real ``torchrun``), on a free port of
127.0.0.1 picked here, and compares with a single-process merge of the same config.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from mergekit_ext.cli import main
from mergekit_ext.distributed import DistributedContext
from mergekit_ext.methods.chain_of_merges import ChainOfMergesMethod
from mergekit_ext.methods.layerwise import LinearGroup, TaskStatistics
from mergekit_ext.methods.least_squares import (
    regmean_add_task,
    regmean_solve,
    regmean_zero_sums,
    solve_regmean_sums,
)
from mergekit_ext.methods.regmean import RegMeanMethod
from mergekit_ext.testing import WORDS, make_experts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
LAUNCH_TIMEOUT_S = 120  # a whole two-process merge of a tiny model, generously
COLLECTIVE_TIMEOUT_S = 30  # --distributed-timeout: short, a hang fails the test quickly


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see conftest.py


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(
        PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        OMP_NUM_THREADS="1",
        MASTER_ADDR="127.0.0.1",
        **extra,
    )
    return env


def _launch(world: int, args: list[str], cwd: str) -> list[tuple[int, str]]:
    """``world`` processes of ``mergekit-ext run ARGS`` as torchrun would start them."""
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = _env(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_PORT=port)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "mergekit_ext", "run", *args],
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a rank did not exit within {LAUNCH_TIMEOUT_S} s: it hangs")
        results.append((p.returncode, out + err))
    return results


def _torchrun(world: int, args: list[str], cwd: str) -> tuple[int, str]:
    assert os.path.isfile(TORCHRUN), f"torchrun not found next to {sys.executable}"
    port = str(_free_port())
    command = [
        TORCHRUN,
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(world),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
        "-m",
        "mergekit_ext",
        "run",
        *args,
    ]
    done = subprocess.run(
        command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )
    return done.returncode, done.stdout + done.stderr


def _accelerate(world: int, args: list[str], cwd: str) -> tuple[int, str]:
    """``accelerate launch --multi_gpu`` (on CPU it starts the processes through torchrun)."""
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    assert os.path.isfile(accelerate), f"accelerate not found next to {sys.executable}"
    command = [
        accelerate,
        "launch",
        "--multi_gpu",
        "--num_processes",
        str(world),
        "--num_machines",
        "1",
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(_free_port()),
        "-m",
        "mergekit_ext",
        "run",
        *args,
    ]
    done = subprocess.run(
        command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )
    return done.returncode, done.stdout + done.stderr


def _texts(path: str, seed: int) -> str:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as fp:
        for _ in range(8):
            words = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
            fp.write(json.dumps({"text": " ".join(words)}) + "\n")
    return path


def _write_config(
    folder: str, method: str, base: str, experts: list[str], parameters: dict[str, Any]
) -> str:
    models = [
        {
            "model": e,
            "name": f"task{k}",
            "calibration": {"path": _texts(os.path.join(folder, f"t{k}.jsonl"), k)},
        }
        for k, e in enumerate(experts)
    ]
    config = {
        "merge_method": method,
        "base_model": base,
        "models": models,
        "calibration": {"samples": 8, "max_length": 16, "batch_size": 3, "field": "text"},
        "parameters": parameters,
    }
    path = os.path.join(folder, "config.yml")
    with open(path, "w", encoding="utf-8") as fp:
        yaml.safe_dump(config, fp)
    return path


def _single_process(config: str, out: str) -> None:
    result = CliRunner().invoke(main, ["run", config, out], catch_exceptions=False)
    assert result.exit_code == 0, result.output


def _leftovers(folder: str) -> list[str]:
    """Partial folders, old outputs and lock files a merge may leave beside its output."""
    return [n for n in os.listdir(folder) if n.startswith(".")]


CASES = {
    # RegMean across ranks: regmean-K2-accelerate (its reduction is CoM's without the chain)
    "com-K3-torchrun": ("chain_of_merges", {}, 3, "tiny_llama_set"),
    "com-normalize-correlation-K3": (
        "chain_of_merges",
        {"normalize": True, "task_weighting": "correlation"},
        3,
        "tiny_llama_set",
    ),
    "com-ridge-K2": ("chain_of_merges", {"ridge": 0.01, "solver": "solve"}, 2, "tiny_llama_set"),
    "qp-K3": ("qp_projection", {}, 3, "tiny_llama_set"),
    "qp-K2": ("qp_projection", {"basis": "diagonal"}, 2, "tiny_llama_set"),
    "regmean-K2-accelerate": ("regmean", {}, 2, "tiny_llama_set"),
    "com-bert-K3": ("chain_of_merges", {}, 3, "tiny_bert_set"),
    # discovered structure: GPT-2's Conv1D weights (transposed) through the reduction and
    # through the gathered path
    "com-gpt2-K3": ("chain_of_merges", {}, 3, "tiny_gpt2_set"),
    "qp-gpt2-K2": ("qp_projection", {}, 2, "tiny_gpt2_set"),
}


@pytest.fixture(scope="module")
def tiny_gpt2_set(tmp_path_factory):
    """GPT2LMHeadModel (Conv1D linears), hidden 64, 2 layers, three experts."""
    import tiny_architectures
    from conftest import TinySet

    root = tmp_path_factory.mktemp("gpt2")
    base = tiny_architectures.build("gpt2", str(root / "base"))
    experts = make_experts(base, [str(root / f"expert{i}") for i in range(3)])
    return TinySet("gpt2", "GPT2LMHeadModel", base, tuple(experts))


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_equal_one_process(request, case, tmp_path):
    method, parameters, k, set_name = CASES[case]
    tiny = request.getfixturevalue(set_name)
    experts = list(tiny.experts[:k])
    config = _write_config(str(tmp_path), method, tiny.base, experts, parameters)
    reference = str(tmp_path / "one" / "merged")
    _single_process(config, reference)

    out_parent = tmp_path / "two"
    out_parent.mkdir()
    out = str(out_parent / "merged")
    args = [config, out, "--distributed-timeout", str(COLLECTIVE_TIMEOUT_S)]
    if case.endswith(("torchrun", "accelerate")):
        launch = _torchrun if case.endswith("torchrun") else _accelerate
        rc, output = launch(2, args, str(tmp_path))
        assert rc == 0, output
        assert output.count("merged model written to") == 1, output  # rank 0 only
    else:
        results = _launch(2, args, str(tmp_path))
        assert [rc for rc, _ in results] == [0, 0], results
        assert "merged model written to" in results[0][1]
        assert "merged model written to" not in results[1][1]  # rank 1 writes nothing
    # Exactly one output folder, nothing left beside it.
    assert os.listdir(out_parent) == ["merged"], os.listdir(out_parent)

    one = load_file(os.path.join(reference, "model.safetensors"))
    two = load_file(os.path.join(out, "model.safetensors"))
    assert set(one) == set(two)
    for name in one:
        scale = float(one[name].double().abs().max()) or 1.0
        error = float((one[name].double() - two[name].double()).abs().max()) / scale
        assert error <= 1e-5, f"{name}: max relative error {error:.3g}"
        # Sums added in task order, one thread per process: the very same bits.
        assert torch.equal(one[name], two[name]), f"{name}: max relative error {error:.3g}"

    diag_one = json.load(open(os.path.join(reference, "mergekit_ext_diagnostics.json")))
    diag_two = json.load(open(os.path.join(out, "mergekit_ext_diagnostics.json")))
    assert "distributed" not in diag_one
    owners = {f"task{i}": i % 2 for i in range(k)}
    assert diag_two.pop("distributed") == {
        "world_size": 2,
        "backend": "gloo",
        "task_ranks": owners,
    }
    # Every record, per-task ones gathered from both ranks included, is the one process's.
    assert diag_two["sections"] == diag_one["sections"]
    layers = diag_two["sections"][method]["layers"]
    if method != "qp_projection":
        assert all(list(r["tasks"]) == [f"task{i}" for i in range(k)] for r in layers)
    card = open(os.path.join(out, "README.md"), encoding="utf-8").read()
    assert "2 processes" in card and "task1: rank 1" in card
    # one writer for one process and several: rank 0 records what the merge took too
    assert diag_two["resources"]["wall_time_s"] > 0
    assert set(diag_two["resources"]) == set(diag_one["resources"])
    assert "**Merge time and memory:**" in card


def _poisoned_expert(source: str, folder: str, tensor: str) -> str:
    shutil.copytree(source, folder)
    path = os.path.join(folder, "model.safetensors")
    state = load_file(path)
    state[tensor] = state[tensor].clone()
    state[tensor][0, 0] = float("nan")
    save_file(state, path, metadata={"format": "pt"})
    return folder


def test_a_failing_rank_fails_every_rank_and_leaves_nothing(tiny_llama_set, tmp_path):
    """Rank 1 finds a NaN in its own expert in block 1: both ranks exit non-zero, promptly."""
    experts = list(tiny_llama_set.experts)
    experts[1] = _poisoned_expert(
        experts[1], str(tmp_path / "bad"), "model.layers.1.self_attn.q_proj.weight"
    )
    config = _write_config(str(tmp_path), "chain_of_merges", tiny_llama_set.base, experts, {})
    out_parent = tmp_path / "outputs"
    out_parent.mkdir()
    start = time.monotonic()
    results = _launch(
        2,
        [config, str(out_parent / "merged"), "--distributed-timeout", str(COLLECTIVE_TIMEOUT_S)],
        str(tmp_path),
    )
    elapsed = time.monotonic() - start
    (rc0, out0), (rc1, out1) = results
    assert rc0 != 0 and rc1 != 0, results
    assert "rank 1/2" in out1 and "layers.1.self_attn.q_proj.weight" in out1, out1
    assert "contains NaN" in out1
    assert "rank 0/2" in out0 and "another rank" in out0, out0[-2000:]
    # Rank 0 did not wait for the collective timeout: the peer's exit ended its wait.
    assert elapsed < LAUNCH_TIMEOUT_S
    assert os.listdir(out_parent) == [], os.listdir(out_parent)


def test_a_check_failing_on_rank_0_fails_every_rank_before_the_merge(tiny_llama_set, tmp_path):
    config = _write_config(
        str(tmp_path), "regmean", tiny_llama_set.base, list(tiny_llama_set.experts), {}
    )
    existing = tmp_path / "merged"
    existing.mkdir()
    (existing / "mine.txt").write_text("keep me")
    results = _launch(
        2,
        [config, str(existing), "--distributed-timeout", str(COLLECTIVE_TIMEOUT_S)],
        str(tmp_path),
    )
    (rc0, out0), (rc1, out1) = results
    assert rc0 == 1 and rc1 == 1, results
    assert "already exists" in out0
    assert "rank 1/2: rank 0 failed the checks" in out1 and "already exists" in out1
    assert os.listdir(existing) == ["mine.txt"]
    assert _leftovers(str(tmp_path)) == []


@pytest.mark.parametrize("method", ["symerge", "ties"])
def test_single_process_methods_refuse_several_processes(
    method, tiny_llama_set, tmp_path, monkeypatch
):
    config = {
        "merge_method": method,
        "base_model": tiny_llama_set.base,
        "models": [{"model": e} for e in tiny_llama_set.experts],
        "parameters": {"density": 0.5, "weight": 1.0} if method == "ties" else {},
    }
    path = tmp_path / "c.yml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    result = CliRunner().invoke(main, ["run", str(path), str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "runs in a single process" in result.output and "rank 1/2" in result.output
    assert not (tmp_path / "out").exists()


def test_tasks_of_each_rank():
    # more processes than tasks share the tasks' batches: test_distributed_ranks.py
    DistributedContext(world_size=3, rank=0).check_tasks(2)
    assert DistributedContext(world_size=2, rank=1).owned(5) == [1, 3]
    assert DistributedContext().owned(3) == [0, 1, 2]


@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="NCCL across ranks needs two CUDA devices"
)
def test_two_ranks_on_cuda_with_nccl(tiny_llama_set, tmp_path):
    config = _write_config(
        str(tmp_path), "chain_of_merges", tiny_llama_set.base, list(tiny_llama_set.experts), {}
    )
    reference = str(tmp_path / "one")
    result = CliRunner().invoke(main, ["run", config, reference, "--device", "cuda"])
    assert result.exit_code == 0, result.output
    out = str(tmp_path / "two")
    rc, output = _torchrun(2, [config, out, "--device", "cuda"], str(tmp_path))
    assert rc == 0, output
    assert (
        json.load(open(os.path.join(out, "mergekit_ext_diagnostics.json")))["distributed"][
            "backend"
        ]
        == "nccl"
    )
    one = load_file(os.path.join(reference, "model.safetensors"))
    two = load_file(os.path.join(out, "model.safetensors"))
    for name in one:
        torch.testing.assert_close(two[name], one[name], rtol=1e-5, atol=1e-6, msg=name)


# ------------------------------------------------------------------------------------------
# The reduction itself, in one process: partial sums over disjoint task sets


def _stats(x: torch.Tensor) -> TaskStatistics:
    x = x.double()
    unit = x / x.norm(dim=1, keepdim=True)
    return TaskStatistics(
        gram=x.T @ x / x.shape[0],
        mean=x.mean(0),
        count=x.shape[0],
        gram_normalized=unit.T @ unit / x.shape[0],
    )


def _group(indices: list[int], weights, expert_stats, merged_stats) -> LinearGroup:
    return LinearGroup(
        name="layers.0.qkv",
        weights=["q", "k"],
        base={name: torch.zeros_like(w) for name, w in weights[0].items()},
        experts=[weights[i] for i in indices],
        task_names=[f"task{i}" for i in indices],
        expert_stats=[expert_stats[i] for i in indices],
        merged_stats=[merged_stats[i] for i in indices],
    )


def _row_stats(x: torch.Tensor) -> TaskStatistics:
    """A task that kept its input rows instead of the Gram (fewer tokens than inputs)."""
    x = x.double()
    unit = x / x.norm(dim=1, keepdim=True)
    return TaskStatistics(
        gram=None,
        mean=x.mean(0),
        count=x.shape[0],
        gram_normalized=unit.T @ unit / x.shape[0],
        second_moment=x.square().mean(0),
        rows=x,
        row_batches=(x.shape[0],),
    )


def _three_tasks(
    seed: int, q_rows: int, k_rows: int, kept_rows: bool = True
) -> tuple[list[dict[str, torch.Tensor]], list[TaskStatistics], list[TaskStatistics]]:
    """Three tasks' ``q``/``k`` weights (6 inputs) and their statistics on both paths: 4
    tokens each with their rows kept (12 in all, more than the inputs), else 40 with Grams."""
    gen = torch.Generator().manual_seed(seed)
    weights = [
        {"q": torch.randn(q_rows, 6, generator=gen), "k": torch.randn(k_rows, 6, generator=gen)}
        for _ in range(3)
    ]
    tokens, stats = (4, _row_stats) if kept_rows else (40, _stats)
    expert = [stats(torch.randn(tokens, 6, generator=gen) * (1 + i)) for i in range(3)]
    merged_path = [stats(torch.randn(tokens, 6, generator=gen) + i) for i in range(3)]
    return weights, expert, merged_path


def _reduce_like_two_ranks(method, parameters, weights, expert, merged_path):
    """The executor's protocol for K = 3 on W = 2 in one process: votes, sums passed in task
    order, the solve on rank 1, every rank's task diagnostics; None when the group is
    gathered instead."""
    parts = [[0, 2], [1]]  # what ranks 0 and 1 own for K = 3, W = 2
    reductions = [method.reduction(parameters) for _ in parts]
    locals_ = [_group(p, weights, expert, merged_path) for p in parts]
    votes = [r.gather_vote(g) for r, g in zip(reductions, locals_)]
    if reductions[0].needs_gather(votes):
        return None
    zeros = [r.prepare(g) for r, g in zip(reductions, locals_)]
    assert {k: v.shape for k, v in zeros[0].items()} == {k: v.shape for k, v in zeros[1].items()}
    sums = zeros[0]  # the accumulators travel 0 -> 1 -> 0 -> 1 (the solver) in task order
    for round_ in range(reductions[0].rounds):
        if round_ > 0:  # the solver's decision reaches every rank, which starts the round
            shared = reductions[1].next_round(sums, locals_[1])
            if shared.get("gather"):  # the first round's sums call for the whole group
                return None
            starts = [r.start_round(shared, g) for r, g in zip(reductions, locals_)]
            sums = starts[0]
        for k in range(3):
            rank = k % 2
            reductions[rank].add_task(sums, parts[rank].index(k))
    merged, diag = reductions[1].solve(sums, locals_[1])
    tasks: dict[str, Any] = {}
    for r, g in zip(reductions, locals_):
        tasks.update(r.task_diagnostics(g, merged))
    return merged, {**diag, "tasks": tasks}


REDUCTION_CASES = [
    (RegMeanMethod(), {}),
    (RegMeanMethod(), {"reduce_non_diagonal": 0.8, "ridge": 0.1}),
    (ChainOfMergesMethod(), {}),
    (ChainOfMergesMethod(), {"normalize": True, "task_weighting": "correlation"}),
    (ChainOfMergesMethod(), {"ridge": 0.5, "solver": "solve", "task_weighting": "correlation"}),
]


@pytest.mark.parametrize("method, parameters", REDUCTION_CASES)
@pytest.mark.parametrize("kept_rows", [False, True])
def test_sum_reduction_over_task_subsets_equals_the_whole_merge(method, parameters, kept_rows):
    k = 3
    # kept rows: 4 tokens per task for 6 inputs, 12 in all: each task keeps its rows, and the
    # dense solve (every task's Gram formed from its rows) is reduced to sums all the same
    weights, expert, merged_path = _three_tasks(0, 3, 2, kept_rows)
    whole = _group(list(range(k)), weights, expert, merged_path)
    expected, expected_diag = method.merge_linear_group(whole, parameters)
    reduced = _reduce_like_two_ranks(method, parameters, weights, expert, merged_path)
    assert reduced is not None, "a dense group must not be gathered"
    merged, diag = reduced
    for name in expected:  # the same additions in the same order: the same bits
        assert torch.equal(merged[name], expected[name]), name
    assert diag == expected_diag


@pytest.mark.parametrize("method", [RegMeanMethod(), ChainOfMergesMethod()])
def test_two_round_reduction_with_row_terms_equals_the_whole_merge(monkeypatch, method):
    """More outputs than tokens, every task's rows kept, α = 1 and no ridge: the solver
    decides from the system's sums and each rank adds its tasks' row terms (the dense
    solve task by task); the same bits as one process."""
    from mergekit_ext.methods.least_squares import solve

    calls: list = []
    original = solve.row_term

    def counting(weight, rows, cholesky):
        calls.append(tuple(weight.shape))
        return original(weight, rows, cholesky)

    # one process and the reduction both form their terms through solve.task_row_term
    monkeypatch.setattr(solve, "row_term", counting)
    weights, expert, merged_path = _three_tasks(4, 12, 9)
    parameters = {"ridge": 0.0}
    expected, expected_diag = method.merge_linear_group(
        _group([0, 1, 2], weights, expert, merged_path), parameters
    )
    assert calls == [(21, 6)] * 3  # 21 outputs > 12 tokens: one process takes the row terms
    reduced = _reduce_like_two_ranks(method, parameters, weights, expert, merged_path)
    assert reduced is not None and calls == [(21, 6)] * 6  # and so do the two ranks
    assert all(torch.equal(reduced[0][n], expected[n]) for n in expected)
    assert reduced[1] == expected_diag


def _weak_three_tasks(
    q_rows: int, k_rows: int, kept_rows: bool
) -> tuple[list[dict[str, torch.Tensor]], list[TaskStatistics], list[TaskStatistics]]:
    """:func:`_three_tasks` whose last input is weak (~1e-2) and correlated with input 0 by
    a slope that differs per task: the exact solution (condition number ~1e3, so ``auto``
    first solves exactly) leaves the experts' range and the range rule raises the ridge."""
    gen = torch.Generator().manual_seed(9)
    weights = [
        {"q": torch.randn(q_rows, 6, generator=gen), "k": torch.randn(k_rows, 6, generator=gen)}
        for _ in range(3)
    ]
    tokens, stats = (4, _row_stats) if kept_rows else (40, _stats)

    def inputs(k: int) -> torch.Tensor:
        x = torch.randn(tokens, 6, generator=gen, dtype=torch.float64)
        x[:, -1] = 0.01 * (x[:, -1] + (k - 1) * 2.0 * x[:, 0])
        return x

    expert = [stats(inputs(k)) for k in range(3)]
    merged_path = [stats(inputs(k)) for k in range(3)]
    return weights, expert, merged_path


@pytest.mark.parametrize("method", [RegMeanMethod(), ChainOfMergesMethod()])
@pytest.mark.parametrize(
    "parameters, kept_rows, shape",
    [
        ({}, False, (3, 2)),  # α = 1: two rounds, the numerator's
        ({}, True, (12, 9)),  # α = 1, 21 outputs > 12 tokens: two rounds, the row terms
        ({"reduce_non_diagonal": 0.9}, False, (3, 2)),  # one round
    ],
)
def test_auto_range_rule_over_two_ranks_equals_one_process(method, parameters, kept_rows, shape):
    """``ridge: auto`` raising the ridge of an out-of-range group decides on the solving
    rank from the reduced sums exactly as one process does: the same ridge, the same bytes."""
    weights, expert, merged_path = _weak_three_tasks(*shape, kept_rows)
    expected, expected_diag = method.merge_linear_group(
        _group([0, 1, 2], weights, expert, merged_path), parameters
    )
    assert expected_diag["norm_ratio_before_ridge"] > 1.5 >= expected_diag["max_norm_ratio"]
    assert expected_diag["ridge"] > 0.0 and expected_diag["guard"] == "ok"
    reduced = _reduce_like_two_ranks(method, parameters, weights, expert, merged_path)
    assert reduced is not None, "a dense group must not be gathered"
    for name in expected:
        assert torch.equal(reduced[0][name], expected[name]), name
    assert reduced[1] == expected_diag


@pytest.mark.parametrize("method, parameters", REDUCTION_CASES)
def test_a_span_group_is_gathered_and_a_dense_one_is_not(method, parameters):
    """Rows kept and fewer tokens in all than inputs (with a ridge): the span solve needs every
    task's rows on one rank, so the vote gathers; with as many tokens as inputs it does not."""
    gen = torch.Generator().manual_seed(2)
    weights = [
        {"q": torch.randn(3, 16, generator=gen), "k": torch.randn(2, 16, generator=gen)}
        for _ in range(3)
    ]
    for per_task, gathered in [(5, True), (6, False)]:  # 15 < 16 <= 18 tokens in all
        expert = [_row_stats(torch.randn(per_task, 16, generator=gen)) for _ in range(3)]
        merged_path = [_row_stats(torch.randn(per_task, 16, generator=gen)) for _ in range(3)]
        reduced = _reduce_like_two_ranks(method, parameters, weights, expert, merged_path)
        assert (reduced is None) == gathered, (per_task, parameters)  # every case has a ridge
        if reduced is not None:
            expected, expected_diag = method.merge_linear_group(
                _group([0, 1, 2], weights, expert, merged_path), parameters
            )
            assert all(torch.equal(reduced[0][n], expected[n]) for n in expected)
            assert reduced[1] == expected_diag


def test_regmean_sums_added_in_order_equal_regmean_solve():
    """The pure functions: zero sums, add each task, solve = regmean_solve, bit for bit."""
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(5, 6, generator=gen) for _ in range(3)]
    grams = [_stats(torch.randn(30, 6, generator=gen)).gram for _ in range(3)]
    omegas = [0.5, 2.0, 1.25]
    for alpha, ridge, solver in [(1.0, 0.0, "pinv"), (0.7, 0.3, "solve"), (0.9, 0.0, "solve")]:
        expected = regmean_solve(
            weights, grams, alpha, task_weights=omegas, ridge=ridge, solver=solver
        )
        sums = regmean_zero_sums((5, 6), with_weighted_experts=ridge > 0)
        for w, g, omega in zip(weights, grams, omegas):
            regmean_add_task(sums, w, g, alpha, omega)
        got = solve_regmean_sums(sums, ridge=ridge, solver=solver)
        assert torch.equal(got.merged_weight, expected.merged_weight)
        assert got.condition_number == expected.condition_number
        assert got.solver == expected.solver


# ------------------------------------------------------------------------------------------
# The per-rank plan (--dry-run) and float32 statistics


def test_dry_run_prints_the_plan_of_every_rank(tiny_llama_set, tmp_path, monkeypatch):
    config = _write_config(
        str(tmp_path), "chain_of_merges", tiny_llama_set.base, list(tiny_llama_set.experts), {}
    )
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    result = CliRunner().invoke(main, ["run", config, str(tmp_path / "out"), "--dry-run"])
    assert result.exit_code == 0, result.output
    text = result.output
    assert "processes: 2" in text and "pass from rank to rank in task order" in text
    assert "rank 0 (tasks task0, task2): peak ≈" in text
    assert "rank 1 (tasks task1): peak ≈" in text
    assert text.count("reduction buffers") == 2 and "replay cache" in text
    assert not (tmp_path / "out").exists()
    monkeypatch.setenv("RANK", "1")  # under a launcher only rank 0 prints
    quiet = CliRunner().invoke(main, ["run", config, str(tmp_path / "out"), "--dry-run"])
    assert quiet.exit_code == 0 and "peak" not in quiet.output


def test_rank_memory_estimates_split_the_tasks(tiny_llama_set, tmp_path):
    from mergekit.options import MergeOptions

    from mergekit_ext.config import load_config
    from mergekit_ext.executor import plan_layerwise_merge
    from mergekit_ext.executor.plan import estimate_memory

    experts = list(tiny_llama_set.experts)
    config = _write_config(str(tmp_path), "chain_of_merges", tiny_llama_set.base, experts, {})
    cfg = load_config(config)
    method = ChainOfMergesMethod()
    plan = plan_layerwise_merge(cfg, MergeOptions(quiet=True), method, cfg.parameters)
    one = estimate_memory(plan)
    assert one == plan.memory and one.reduction == 0
    rank0, rank1 = estimate_memory(plan, 2, 0), estimate_memory(plan, 2, 1)
    # rank 0 holds tasks 0 and 2, rank 1 task 1. The tiny tasks have fewer tokens than the
    # widest inputs, so each keeps its rows (their count differs by task): the ranks' shares
    # are smaller than one process's, rank 0's the larger.
    assert rank1.statistics < rank0.statistics < one.statistics
    assert rank0.activations + rank1.activations == one.activations
    assert rank1.block_weights < rank0.block_weights < one.block_weights
    assert rank0.reduction >= rank1.reduction > 0 and rank1.writer_buffer == 0
    # the groups' solves take turns over the ranks: each rank holds its own tasks' products
    # (rank 1 one task, rank 0 two, one process three) beside the solve's buffers
    assert 0 < rank1.solver < rank0.solver < one.solver
    float32 = plan_layerwise_merge(
        cfg, MergeOptions(quiet=True), method, {**cfg.parameters, "statistics_dtype": "float32"}
    )
    assert float32.request.statistics_dtype == torch.float32
    # float32 statistics are Grams of one size per task (no rows kept): they split 2 : 1
    one32 = estimate_memory(float32)
    r0, r1 = estimate_memory(float32, 2, 0), estimate_memory(float32, 2, 1)
    assert r0.statistics == 2 * r1.statistics and r0.statistics + r1.statistics == one32.statistics
    assert one32.statistics < one.statistics


def test_float32_statistics_merge_close_to_float64(tiny_llama_set, tmp_path):
    from mergekit.options import MergeOptions

    from mergekit_ext.config import load_config
    from mergekit_ext.executor import run_layerwise_merge

    config = _write_config(
        str(tmp_path), "regmean", tiny_llama_set.base, list(tiny_llama_set.experts), {}
    )
    cfg = load_config(config)
    seen: list[torch.dtype] = []

    class Recording(RegMeanMethod):
        def merge_linear_group(self, group, parameters):
            seen.append(group.expert_stats[0].gram.dtype)
            return super().merge_linear_group(group, parameters)

    outputs = {}
    for dtype in ("float64", "float32"):
        out = str(tmp_path / dtype)
        params = {**cfg.parameters, "statistics_dtype": dtype}
        run_layerwise_merge(cfg, out, MergeOptions(quiet=True), Recording(), params)
        outputs[dtype] = load_file(os.path.join(out, "model.safetensors"))
    assert set(seen) == {torch.float64, torch.float32}
    for name, tensor in outputs["float64"].items():
        torch.testing.assert_close(outputs["float32"][name], tensor, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize(
    "parameters, gathered",
    [
        ({"ridge": 0.1}, True),  # after the system's round: the ridge makes the span pay
        ({"ridge": 0.1, "reduce_non_diagonal": 0.9}, True),  # one round: gathered at the vote
        ({"ridge": "auto"}, False),  # a well-conditioned system: no ridge, row terms
        ({"ridge": 0.0}, False),
    ],
)
def test_rows_beyond_the_inputs_gather_where_the_span_solve_pays(parameters, gathered):
    """More tokens than inputs (12 for 6), each task's rows kept, wide outputs: with a ridge
    the span solve pays, so the group meets on one rank, which decides as one process does
    (two rounds find out from the system's sums, one round at the vote); without a ridge
    the sums are reduced, with the bytes of one process."""
    weights, expert, merged_path = _three_tasks(3, 300, 2)
    method = RegMeanMethod()
    whole, diag = method.merge_linear_group(
        _group([0, 1, 2], weights, expert, merged_path), parameters
    )
    reduced = _reduce_like_two_ranks(method, parameters, weights, expert, merged_path)
    assert (reduced is None) == gathered
    if gathered:  # one process took the span solve
        assert diag["solver"] == "cholesky in the span of 12 tokens"
    if reduced is not None:
        assert all(torch.equal(reduced[0][n], whole[n]) for n in whole)


def test_two_ranks_gather_after_the_first_round_where_a_ridge_makes_the_span_pay(
    tiny_llama_set, tmp_path
):
    """Each task's tokens under the 32-wide groups' inputs, more than 32 together, a ridge:
    the system's round finds that the span solve pays, the group meets on rank 0 after it,
    and W = 2 writes the bytes and records of W = 1."""
    experts = list(tiny_llama_set.experts[:2])
    config = _write_config(str(tmp_path), "regmean", tiny_llama_set.base, experts, {"ridge": 0.1})
    with open(config, encoding="utf-8") as fp:
        data = yaml.safe_load(fp)
    data["calibration"].update(samples=3, max_length=10)
    with open(config, "w", encoding="utf-8") as fp:
        yaml.safe_dump(data, fp)
    reference = str(tmp_path / "one" / "merged")
    _single_process(config, reference)
    diag_one = json.load(open(os.path.join(reference, "mergekit_ext_diagnostics.json")))
    late = [
        r
        for r in diag_one["sections"]["regmean"]["layers"]
        if r["solver"].startswith("cholesky in the span") and r["tokens"] >= r["input_width"]
    ]
    assert late, "no group took the span solve with at least as many tokens as inputs"

    out = str(tmp_path / "two" / "merged")
    results = _launch(
        2, [config, out, "--distributed-timeout", str(COLLECTIVE_TIMEOUT_S)], str(tmp_path)
    )
    assert [rc for rc, _ in results] == [0, 0], results
    one = load_file(os.path.join(reference, "model.safetensors"))
    two = load_file(os.path.join(out, "model.safetensors"))
    assert all(torch.equal(one[name], two[name]) for name in one)
    diag_two = json.load(open(os.path.join(out, "mergekit_ext_diagnostics.json")))
    assert diag_two["sections"] == diag_one["sections"]
