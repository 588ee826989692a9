"""The strategies the sequential walk is given (issue #53): one process, or one rank of
several. What each process runs, loads and writes is decided here, without a process group;
the merges over real ranks are in ``test_distributed.py`` and ``test_distributed_ranks.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mergekit_ext.distributed import DistributedContext, DistributedError
from mergekit_ext.executor.plan import BlockLayout
from mergekit_ext.executor.strategy import (
    DeferredUpdates,
    GroupToMerge,
    LocalStrategy,
    RankStrategy,
    walk_strategy,
)
from mergekit_ext.methods.layerwise import LinearGroup
from mergekit_ext.models.families import GroupSpec

CPU = torch.device("cpu")
BLOCK = BlockLayout(
    index=0,
    prefix="layers.0.",
    groups=(
        GroupSpec("attn", ("attn.q", "attn.k")),
        GroupSpec("moe", ("mlp.experts",), experts=True),
    ),
    tensors=[
        "layers.0.norm.weight",
        "layers.0.attn.q.weight",
        "layers.0.attn.k.weight",
        "layers.0.mlp.experts.gate_up_proj",
        "layers.0.mlp.experts.down_proj",
    ],
)
OTHERS_AND_ROUTED = [
    "layers.0.norm.weight",
    "layers.0.mlp.experts.gate_up_proj",
    "layers.0.mlp.experts.down_proj",
]


def _plan(batches: list[int], reduction: object = None) -> SimpleNamespace:
    """What the strategies read of a plan: the tasks and their batches, the method."""
    calls: list[str] = []

    def merge_linear_group(group, parameters):
        calls.append(group.name)
        return {w: torch.ones(2, 2) for w in group.weights}, {"seen": group.task_names}

    method = SimpleNamespace(
        reduction=lambda parameters: reduction, merge_linear_group=merge_linear_group
    )
    experts = [
        SimpleNamespace(task=f"t{k}", data=SimpleNamespace(batches=[None] * n))
        for k, n in enumerate(batches)
    ]
    return SimpleNamespace(
        experts=experts, method=method, parameters={}, request=None, base=None, calls=calls
    )


def test_one_process_runs_every_task_and_batch_and_merges_with_the_method():
    plan = _plan([3, 5])
    strategy = walk_strategy(plan, CPU)
    assert isinstance(strategy, LocalStrategy)
    assert strategy.owned == strategy.holds == [0, 1] and strategy.writes
    assert strategy.batches(1, 5) == (0, 5)
    assert strategy.needed(BLOCK, 1) == BLOCK.tensors
    assert not strategy.shares(0)
    made = object()
    assert strategy.accumulator(0, lambda: made) is made
    mine = {"attn": made}
    assert strategy.finished(0, mine) is mine
    tensor = torch.zeros(2)
    assert strategy.share("layers.0.norm.weight", tensor) is tensor
    assert strategy.record() is None
    records = [{"layer": "x"}]
    strategy.collect_task_diagnostics(records)
    assert records == [{"layer": "x"}]

    group = LinearGroup(
        name="attn",
        weights=["q", "k"],
        base={},
        experts=[],
        task_names=["t0", "t1"],
        expert_stats=[],
    )
    job = GroupToMerge(
        group,
        ["layers.0.attn.q.weight", "layers.0.attn.k.weight"],
        {},
        [],
        stored=lambda result: {n: 2 * w for n, w in result.items()},
        turn=0,
        record=0,
    )
    weights, diagnostics = strategy.merge_group(job)
    assert plan.calls == ["attn"]  # the method's own merge, once
    assert torch.equal(weights["q"], torch.full((2, 2), 2.0))  # as the walk stores it
    assert diagnostics == {"seen": ["t0", "t1"]}


@pytest.mark.parametrize("gathers", [False, True])
def test_four_ranks_of_two_tasks_split_the_batches_and_load_only_their_tensors(gathers):
    """W = 4 > K = 2: task 0 on ranks 0 and 1, task 1 on ranks 2 and 3, each rank a
    contiguous share of the task's batches; the task's last rank holds its statistics; rank 0
    writes and loads what it merges for the other tasks (the non-linear tensors and the
    experts modules, and every tensor when the method gathers whole groups)."""
    plan = _plan([5, 4], reduction=None if gathers else object())
    ranks = [walk_strategy(plan, CPU, DistributedContext(4, r)) for r in range(4)]
    assert all(isinstance(s, RankStrategy) for s in ranks)
    assert [s.owned for s in ranks] == [[0], [0], [1], [1]]
    assert [s.holds for s in ranks] == [[], [0], [], [1]]
    assert [s.writes for s in ranks] == [True, False, False, False]
    assert [s.batches(s.owned[0], n) for s, n in zip(ranks, (5, 5, 4, 4))] == [
        (0, 2),
        (2, 5),
        (0, 2),
        (2, 4),
    ]
    assert all(s.shares(0) and s.shares(1) for s in ranks)
    # the first share accumulates; a later one records its updates until the sums arrive
    made = object()
    assert ranks[0].accumulator(0, lambda: made) is made
    assert isinstance(ranks[1].accumulator(0, lambda: made), DeferredUpdates)
    assert ranks[0].needed(BLOCK, 0) == BLOCK.tensors
    assert ranks[0].needed(BLOCK, 1) == (BLOCK.tensors if gathers else OTHERS_AND_ROUTED)
    assert ranks[1].needed(BLOCK, 1) == []
    assert ranks[2].needed(BLOCK, 1) == BLOCK.tensors
    assert ranks[0].record() == {
        "world_size": 4,
        "backend": None,
        "task_ranks": {"t0": 1, "t1": 3},
        "task_shares": {"t0": {0: [0, 2], 1: [2, 5]}, "t1": {2: [0, 2], 3: [2, 4]}},
    }


def test_two_ranks_of_three_tasks_hold_their_own_tasks():
    plan = _plan([2, 2, 2], reduction=object())
    ranks = [walk_strategy(plan, CPU, DistributedContext(2, r)) for r in range(2)]
    assert [s.owned for s in ranks] == [[0, 2], [1]]
    assert [s.holds for s in ranks] == [[0, 2], [1]]
    assert not any(s.shares(k) for s in ranks for k in range(3))
    assert ranks[1].batches(1, 2) == (0, 2)
    assert "task_shares" not in ranks[0].record()


def test_a_rank_without_a_batch_is_refused_and_one_batch_each_is_accepted():
    with pytest.raises(DistributedError, match="task t0 3 ranks but it has 2 calibration"):
        walk_strategy(_plan([2]), CPU, DistributedContext(3, 0))
    assert walk_strategy(_plan([3]), CPU, DistributedContext(3, 2)).batches(0, 3) == (2, 3)
