"""More ranks than tasks, two "nodes" on one machine, and MoE / non-Llama families over
several processes: every merge gives the bytes of the one-process merge (issue #31 item 4,
issue #30 item 6).

Ranks are real processes of ``python -m mergekit_ext run`` (gloo, 127.0.0.1, a free port,
every collective bounded by ``--distributed-timeout``), as in ``test_distributed.py``.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess

import pytest
import test_distributed
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from test_distributed import (
    COLLECTIVE_TIMEOUT_S,
    TORCHRUN,
    _env,
    _free_port,
    _launch,
    _single_process,
    _write_config,
)

from mergekit_ext.cli import main
from mergekit_ext.distributed import (
    DistributedContext,
    DistributedError,
    batch_share,
    check_shares,
    task_ranks,
)
from mergekit_ext.testing import make_experts

LAUNCH_TIMEOUT_S = 240  # four processes of a tiny merge on a small shared machine


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see conftest.py


@pytest.fixture(autouse=True)
def _longer_launches(monkeypatch):
    monkeypatch.setattr(test_distributed, "LAUNCH_TIMEOUT_S", LAUNCH_TIMEOUT_S)


def _same_bytes(reference: str, out: str) -> None:
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(reference, "*.safetensors")))
    assert files and files == sorted(
        os.path.basename(p) for p in glob.glob(os.path.join(out, "*.safetensors"))
    )
    for file_name in files:
        one = load_file(os.path.join(reference, file_name))
        many = load_file(os.path.join(out, file_name))
        assert set(one) == set(many)
        for name in one:
            assert torch.equal(one[name], many[name]), name


def _diagnostics(folder: str) -> dict:
    with open(os.path.join(folder, "mergekit_ext_diagnostics.json"), encoding="utf-8") as fp:
        return json.load(fp)


# ------------------------------------------------------------------------------------------
# The layout of tasks over ranks


def test_task_ranks_and_batch_shares():
    assert task_ranks(2, 3) == [[0], [1], [0]]  # W ≤ K: k mod W, as before
    assert task_ranks(4, 2) == [[0, 1], [2, 3]]
    assert task_ranks(5, 2) == [[0, 1, 2], [3, 4]]
    assert [batch_share(i, 2, 3) for i in range(2)] == [(0, 1), (1, 3)]
    assert [batch_share(i, 3, 3) for i in range(3)] == [(0, 1), (1, 2), (2, 3)]
    # the statistics end on the rank with the task's last batches
    four = [DistributedContext(world_size=4, rank=r) for r in range(4)]
    assert [c.owned(2) for c in four] == [[0], [0], [1], [1]]
    assert [c.holds(2) for c in four] == [[], [0], [], [1]]
    assert DistributedContext(world_size=2, rank=1).owned(5) == [1, 3]
    assert DistributedContext(world_size=2, rank=1).holds(5) == [1, 3]
    assert DistributedContext().owned(3) == [0, 1, 2]


def test_a_rank_without_a_batch_is_refused():
    check_shares(4, [("a", 2), ("b", 3)])
    with pytest.raises(DistributedError, match="task a 3 ranks but it has 2 calibration batches"):
        check_shares(5, [("a", 2), ("b", 3)])


# ------------------------------------------------------------------------------------------
# W > K: several ranks share one task's batches


@pytest.mark.parametrize(
    ("method", "world"),
    # RegMean's statistics reduce as CoM's (without the chain): com-W4 covers it
    [("chain_of_merges", 4), ("chain_of_merges", 3), ("qp_projection", 4)],
    ids=["com-W4", "com-W3", "qp-W4"],
)
def test_more_ranks_than_tasks_equal_one_process(tiny_llama_set, tmp_path, method, world):
    experts = list(tiny_llama_set.experts[:2])
    config = _write_config(str(tmp_path), method, tiny_llama_set.base, experts, {})
    reference = str(tmp_path / "one")
    _single_process(config, reference)
    out = str(tmp_path / "many")
    results = _launch(
        world, [config, out, "--distributed-timeout", str(COLLECTIVE_TIMEOUT_S)], str(tmp_path)
    )
    assert [rc for rc, _ in results] == [0] * world, results
    _same_bytes(reference, out)
    one, many = _diagnostics(reference), _diagnostics(out)
    shares = many["distributed"].pop("task_shares")
    # 8 samples in batches of 3: three batches per task, split contiguously over its ranks
    if world == 4:
        assert shares == {
            "task0": {"0": [0, 1], "1": [1, 3]},
            "task1": {"2": [0, 1], "3": [1, 3]},
        }
        assert many["distributed"]["task_ranks"] == {"task0": 1, "task1": 3}
    else:
        assert shares == {"task0": {"0": [0, 1], "1": [1, 3]}, "task1": {"2": [0, 3]}}
    # every record, the per-task ones included, is the one process's
    assert many["sections"] == one["sections"]


def test_two_nodes_on_one_machine(tiny_llama_set, tmp_path):
    """``torchrun --nnodes 2 --node-rank 0/1 --nproc-per-node 2``: two launchers (the two
    "nodes"), four ranks for two tasks."""
    assert os.path.isfile(TORCHRUN)
    experts = list(tiny_llama_set.experts[:2])
    config = _write_config(str(tmp_path), "chain_of_merges", tiny_llama_set.base, experts, {})
    reference = str(tmp_path / "one")
    _single_process(config, reference)
    out = str(tmp_path / "nodes")
    port = str(_free_port())
    nodes = [
        subprocess.Popen(
            [
                TORCHRUN,
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "2",
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                "-m",
                "mergekit_ext",
                "run",
                config,
                out,
                "--distributed-timeout",
                str(COLLECTIVE_TIMEOUT_S),
            ],
            cwd=str(tmp_path),
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = []
    try:
        for p in nodes:
            outputs.append(p.communicate(timeout=LAUNCH_TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for p in nodes:
            p.kill()
        pytest.fail(f"a node did not exit within {LAUNCH_TIMEOUT_S} s")
    assert [p.returncode for p in nodes] == [0, 0], outputs
    assert "merged model written to" in outputs[0] and "merged model written to" not in outputs[1]
    _same_bytes(reference, out)
    assert _diagnostics(out)["distributed"]["world_size"] == 4


def test_dry_run_shows_the_shares_of_each_rank(tiny_llama_set, tmp_path):
    experts = list(tiny_llama_set.experts[:2])
    config = _write_config(str(tmp_path), "chain_of_merges", tiny_llama_set.base, experts, {})
    result = CliRunner().invoke(
        main, ["run", config, str(tmp_path / "out"), "--dry-run", "--world-size", "4"]
    )
    assert result.exit_code == 0, result.output
    text = result.output
    assert "processes: 4 for 2 tasks" in text
    assert "rank 0 (task0 batches 0-0 of 3): peak ≈" in text
    assert "rank 1 (task0 batches 1-2 of 3, holds its statistics): peak ≈" in text
    assert "rank 3 (task1 batches 1-2 of 3, holds its statistics): peak ≈" in text
    refused = CliRunner().invoke(
        main, ["run", config, str(tmp_path / "out"), "--dry-run", "--world-size", "7"]
    )
    assert refused.exit_code == 1 and "calibration batches" in refused.output
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------
# Mixture-of-experts and a non-Llama dense family over two ranks (issue #30 item 6)


@pytest.fixture(scope="module")
def family_sets(tmp_path_factory):
    import tiny_architectures

    sets = {}
    for model_type in ("mixtral", "phi3"):
        root = tmp_path_factory.mktemp(model_type)
        base = tiny_architectures.build(model_type, str(root / "base"))
        sets[model_type] = (base, make_experts(base, [str(root / f"e{i}") for i in range(2)]))
    return sets


@pytest.mark.parametrize(
    ("model_type", "method", "world"),
    [
        ("mixtral", "regmean", 2),
        ("mixtral", "chain_of_merges", 2),
        ("phi3", "regmean", 2),
        ("phi3", "chain_of_merges", 2),
        # routed statistics through the ranks that share a task
        ("mixtral", "chain_of_merges", 4),
    ],
    ids=["mixtral-regmean", "mixtral-com", "phi3-regmean", "phi3-com", "mixtral-com-W4"],
)
def test_several_ranks_equal_one_process_on_other_families(
    family_sets, tmp_path, model_type, method, world
):
    base, experts = family_sets[model_type]
    config = _write_config(str(tmp_path), method, base, list(experts), {})
    reference = str(tmp_path / "one")
    _single_process(config, reference)
    out = str(tmp_path / "many")
    results = _launch(
        world, [config, out, "--distributed-timeout", str(COLLECTIVE_TIMEOUT_S)], str(tmp_path)
    )
    assert [rc for rc, _ in results] == [0] * world, results
    _same_bytes(reference, out)
    one, many = _diagnostics(reference), _diagnostics(out)
    assert many["sections"] == one["sections"]
    if model_type == "mixtral":
        layers = one["sections"][method]["layers"]
        assert any("expert" in r for r in layers)  # the routed experts were solved


# ------------------------------------------------------------------------------------------
# Why the accumulator travels (one process, no launch)


def test_a_travelling_accumulator_gives_the_running_sum_and_partial_sums_do_not():
    """Three batches; the first on one "rank", the others recorded on a second and added once
    the accumulator arrives (through torch.save / torch.load, as send_object does): the same
    bits as one running sum. Adding the second rank's own partial sum instead does not (float64
    products round)."""
    import io

    from mergekit_ext.calibration.statistics import ActivationStatistics
    from mergekit_ext.executor.strategy import DeferredUpdates

    gen = torch.Generator().manual_seed(3)
    batches = [torch.randn(n, 16, generator=gen, dtype=torch.float64) for n in (5, 7, 4)]

    def new() -> ActivationStatistics:
        return ActivationStatistics(16, normalized_gram=True, product_dtype=torch.float64)

    one = new()
    for b in batches:
        one.update(b)
    expected = one.finalize()

    first = new()
    first.update(batches[0])
    later = DeferredUpdates()
    for b in batches[1:]:
        later.update(b)
    buffer = io.BytesIO()
    torch.save(first, buffer)
    arrived = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    later.replay(arrived)
    travelled = arrived.finalize()
    assert torch.equal(travelled.gram, expected.gram)
    assert torch.equal(travelled.gram_normalized, expected.gram_normalized)
    assert torch.equal(travelled.mean, expected.mean) and travelled.count == expected.count

    # partial sums per rank, added afterwards: another association, other bits
    rest = sum((b.T @ b for b in batches[2:]), batches[1].T @ batches[1])
    partial = (batches[0].T @ batches[0] + rest) / 16
    partial = (partial + partial.T) * 0.5
    assert not torch.equal(partial, expected.gram)
