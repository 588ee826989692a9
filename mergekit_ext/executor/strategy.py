"""How the sequential walk is spread over processes: a strategy the walk is given.

The walk (:class:`~mergekit_ext.executor.sequential.SequentialExecutor`) loads a block, runs
the passes, takes the statistics, merges the groups, propagates and writes: one sequence,
for one process or several. What depends on the processes it asks of its strategy:

- which tasks this process runs (``owned``), whose statistics end here (``holds``), which
  share of a task's batches it runs and which of a block's tensors it loads;
- whether it writes (``writes``) and how a merged tensor reaches every process (``share``);
- how a task's accumulators start and end when several processes share its batches;
- how a linear group and an experts module are merged from this process's tasks;
- the per-task diagnostics kept until the end, and the run's ``distributed`` record.

:class:`LocalStrategy` is one process: every task and batch, the method's own merge.

:class:`RankStrategy` is one rank of ``torch.distributed`` (:mod:`mergekit_ext.distributed`
joins the group, bounds every collective by its timeout and names the failed rank): rank r
runs only its own tasks ``{k : k mod W = r}`` (their embeddings, expert-path and merged-path
passes, statistics) and loads, per block, the base, its own experts and the merged block.
With more processes than tasks, a task's ranks each run a contiguous share of its batches;
each records its layer inputs and adds them to the task's accumulators when they arrive from
the rank with the previous share (:class:`DeferredUpdates`), so the sums are the one
process's, and the statistics end on the task's last rank. Rank 0 also loads the other
experts' non-linear tensors (for the fallback merges) and, for a method without a
:class:`~mergekit_ext.methods.layerwise.SumReduction`, their linear weights. Each group is
merged either from sums over the tasks, added in task order as they pass from rank to rank
(bit for bit the single process's sums) and solved on one of the ranks that hold statistics
(they take turns), or from every task's statistics gathered to rank 0 and merged with the
method's own single-process code; either way the solving rank broadcasts the merged weights,
so every rank carries its tasks' hidden states through the same merged group. A
mixture-of-experts experts module is always merged the second way (every task's routed
statistics gathered to rank 0). Only rank 0 writes; the per-task diagnostics are gathered to
it at the end.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from mergekit_ext.distributed import DistributedContext, check_shares
from mergekit_ext.executor.blocks import orient
from mergekit_ext.executor.compute import widened
from mergekit_ext.executor.moe import ExpertMergeResult, RoutedCall
from mergekit_ext.executor.plan import BlockLayout, MergePlan, safetensors_dtype
from mergekit_ext.methods.layerwise import LinearGroup, SumReduction, TaskStatistics

Weights = dict[str, torch.Tensor]
# every task's routed statistics (or merged-path ones) -> the experts module merged
ExpertsRun = Callable[[list[Any], Optional[list[Any]]], ExpertMergeResult]


@dataclass
class GroupToMerge:
    """One linear group as the walk hands it to :meth:`WalkStrategy.merge_group`."""

    group: LinearGroup  # the tasks whose statistics this process holds
    canonical: list[str]  # the checkpoint names of ``group.weights``
    flip: dict[str, bool]  # Conv1D weights (stored ``in x out``)
    expert_blocks: list[Weights]  # the block's tensors of every expert, as loaded here
    # the method's ``out x in`` result as the checkpoint stores it, checked
    stored: Callable[[Weights], Weights]
    turn: int  # block index + group index: which holder of statistics solves
    record: int  # the index the group's record takes in the layer diagnostics


class WalkStrategy(ABC):
    """What the walk asks about processes; one process and a rank answer differently."""

    def __init__(
        self, dist: DistributedContext, owned: list[int], holds: list[int], writes: bool
    ) -> None:
        self.dist = dist
        self.owned = owned  # tasks whose passes this process runs
        self.holds = holds  # tasks whose statistics end in this process
        self.writes = writes  # this process writes the output

    @abstractmethod
    def batches(self, task: int, num_batches: int) -> tuple[int, int]:
        """This process's contiguous share ``[start, stop)`` of the task's batches."""

    @abstractmethod
    def needed(self, block: BlockLayout, task: int) -> list[str]:
        """The tensors of expert ``task``'s block this process loads."""

    @abstractmethod
    def shares(self, task: int) -> bool:
        """Whether several processes share this task's batches."""

    @abstractmethod
    def accumulator(self, task: int, make: Callable[[], Any]) -> Any:
        """A new accumulator of the task's statistics here (``make`` builds a real one)."""

    @abstractmethod
    def finished(self, task: int, accumulators: dict[str, Any]) -> Optional[dict[str, Any]]:
        """The task's accumulators once its every batch is in; None where they end elsewhere."""

    @abstractmethod
    def share(self, canonical: str, merged: Optional[torch.Tensor], src: int = 0) -> torch.Tensor:
        """Process ``src``'s merged (floating) tensor ``canonical`` in every process."""

    @abstractmethod
    def merge_group(self, job: GroupToMerge) -> tuple[Weights, dict[str, Any]]:
        """The group's merged weights as stored (in every process) and its diagnostics."""

    @abstractmethod
    def merge_experts(
        self, own: list[Any], path: Optional[list[Any]], run: ExpertsRun, names: Sequence[str]
    ) -> ExpertMergeResult:
        """An experts module merged by ``run`` over every task's routed statistics (``own``
        and ``path``: this process's tasks'); ``names``: its ``gate_up`` and ``down``."""

    @abstractmethod
    def collect_task_diagnostics(self, layer_diagnostics: list[dict[str, Any]]) -> None:
        """Every process's per-task group records into the writer's ``layer_diagnostics``."""

    @abstractmethod
    def record(self) -> Optional[dict[str, Any]]:
        """The run's ``distributed`` diagnostics section (None for one process)."""

    def pass_sums(self, sums: Weights, src: int, dst: int) -> None:
        """Running sums from process ``src`` to ``dst`` (into ``sums``'s tensors there)."""
        if self.dist.rank == src:
            self.dist.send_tensors(sums, dst)
        elif self.dist.rank == dst:
            self.dist.recv_tensors(sums, src)


def walk_strategy(
    plan: MergePlan, device: torch.device, dist: Optional[DistributedContext] = None
) -> WalkStrategy:
    """The strategy of this process: one process, or one rank of several."""
    dist = dist or DistributedContext()
    dist.check_tasks(len(plan.experts))
    if dist.enabled:
        return RankStrategy(plan, device, dist)
    return LocalStrategy(plan, dist)


class LocalStrategy(WalkStrategy):
    """One process: every task, every batch; it writes; the method's own group merge."""

    def __init__(self, plan: MergePlan, dist: Optional[DistributedContext] = None) -> None:
        every = list(range(len(plan.experts)))
        super().__init__(dist or DistributedContext(), every, every, writes=True)
        self.method = plan.method
        self.parameters = plan.parameters

    def batches(self, task: int, num_batches: int) -> tuple[int, int]:
        return 0, num_batches

    def needed(self, block: BlockLayout, task: int) -> list[str]:
        return block.tensors

    def shares(self, task: int) -> bool:
        return False

    def accumulator(self, task: int, make: Callable[[], Any]) -> Any:
        return make()

    def finished(self, task: int, accumulators: dict[str, Any]) -> Optional[dict[str, Any]]:
        return accumulators

    def share(self, canonical: str, merged: Optional[torch.Tensor], src: int = 0) -> torch.Tensor:
        assert merged is not None
        return merged

    def merge_group(self, job: GroupToMerge) -> tuple[Weights, dict[str, Any]]:
        result, diagnostics = self.method.merge_linear_group(job.group, self.parameters)
        return job.stored(result), diagnostics

    def merge_experts(
        self, own: list[Any], path: Optional[list[Any]], run: ExpertsRun, names: Sequence[str]
    ) -> ExpertMergeResult:
        return run(own, path)

    def collect_task_diagnostics(self, layer_diagnostics: list[dict[str, Any]]) -> None:
        return  # every task's records were made here

    def record(self) -> Optional[dict[str, Any]]:
        return None


# -------------------------------------------------------------------------------------
# Several processes


class DeferredUpdates:
    """Records an accumulator's ``update`` calls, to replay them once the partial sums of
    the task's earlier batches arrive from the rank that ran them (a task whose batches
    several ranks share): the accumulator then sees exactly the single process's sequence
    of updates, so its float64 sums are the same bits."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def update(self, *args: Any) -> None:
        # own copies: the activations may be views of tensors the forward reuses
        self.calls.append(tuple(_copied(a) for a in args))

    def replay(self, accumulator: Any) -> None:
        for args in self.calls:
            accumulator.update(*args)
        self.calls = []


def _copied(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, RoutedCall):
        return RoutedCall(
            value.hidden.clone(), value.top_k_index.clone(), value.top_k_weights.clone()
        )
    return value


def _on(stats: TaskStatistics, device: Any) -> TaskStatistics:
    """``stats`` with its tensors on ``device`` (CPU to travel between ranks)."""

    def move(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return t.to(device) if t is not None else None

    return TaskStatistics(
        gram=move(stats.gram),
        mean=stats.mean.to(device),
        count=stats.count,
        gram_normalized=move(stats.gram_normalized),
        second_moment=move(stats.second_moment),
        rows=move(stats.rows),
        row_batches=stats.row_batches,
    )


def _routed_on(
    per_expert: Sequence[Optional[tuple[TaskStatistics, TaskStatistics]]], device: Any
) -> list[Optional[tuple[TaskStatistics, TaskStatistics]]]:
    """One task's routed statistics (per expert: gate_up and down inputs) on ``device``."""
    return [None if p is None else (_on(p[0], device), _on(p[1], device)) for p in per_expert]


class RankStrategy(WalkStrategy):
    """One rank of several (module docstring): its tasks, the reductions in task order,
    the gathers and broadcasts that give every rank the same merged weights."""

    def __init__(self, plan: MergePlan, device: torch.device, dist: DistributedContext) -> None:
        num_tasks = len(plan.experts)
        check_shares(
            dist.world_size,
            [(e.task, len(e.data.batches) if e.data else 1) for e in plan.experts],
        )
        super().__init__(dist, dist.owned(num_tasks), dist.holds(num_tasks), dist.is_writer)
        self.num_tasks = num_tasks
        self.device = device
        self.method = plan.method
        self.parameters = plan.parameters
        self.request = plan.request
        self.base = plan.base
        self.experts = plan.experts
        # the ranks that hold statistics, in rank order: they take turns at the solves
        self.holders = sorted({dist.owner(k, num_tasks) for k in range(num_tasks)})
        # no SumReduction: rank 0 merges every group itself
        self.gathers = plan.method.reduction(plan.parameters) is None
        # {index of a layer record: {task: diagnostics}} of this rank's tasks
        self.task_diagnostics: dict[int, dict[str, dict[str, Any]]] = {}

    # ---------------------------------------------------------------------------------
    # Tasks, batches and tensors

    def batches(self, task: int, num_batches: int) -> tuple[int, int]:
        return self.dist.share(task, self.num_tasks, num_batches)

    def needed(self, block: BlockLayout, task: int) -> list[str]:
        if task in self.owned:
            return block.tensors
        if not self.writes:
            return []
        # Rank 0 merges the non-linear tensors; gathering, every group itself; and the
        # experts modules (every task's routed statistics are gathered to it)
        if self.gathers:
            return block.tensors
        routed = [t for g in block.groups if g.experts for t in block.group_tensors(g)]
        return [*block.others, *routed]

    def shares(self, task: int) -> bool:
        return len(self.dist.ranks_of(task, self.num_tasks)) > 1

    def _waits(self, task: int) -> bool:
        """Whether this rank's updates for ``task`` wait for the accumulators of the task's
        earlier batches (a shared task, and not this rank's first share)."""
        ranks = self.dist.ranks_of(task, self.num_tasks)
        return len(ranks) > 1 and ranks.index(self.dist.rank) > 0

    def accumulator(self, task: int, make: Callable[[], Any]) -> Any:
        return DeferredUpdates() if self._waits(task) else make()

    def finished(self, task: int, accumulators: dict[str, Any]) -> Optional[dict[str, Any]]:
        if not self.shares(task):
            return accumulators
        return self._chain(task, accumulators)

    def _chain(self, task: int, mine: dict[str, Any]) -> Optional[dict[str, Any]]:
        """A shared task's accumulators through its ranks in batch order.

        The rank with the first share accumulates its batches as one process does (``mine``
        are the accumulators); each later rank has recorded its updates (``mine``:
        :class:`DeferredUpdates`), adds them to the accumulators it receives and passes them
        on: the float64 sums see the updates of one process in its order (docs/methods.md,
        "More processes than tasks"). Returns them on the task's last rank (which holds the
        task's statistics), None on the others.
        """
        ranks = self.dist.ranks_of(task, self.num_tasks)
        position = ranks.index(self.dist.rank)
        if position == 0:
            accumulators = mine
        else:
            accumulators = self.dist.recv_object(ranks[position - 1], self.device)
            for label, updates in mine.items():
                updates.replay(accumulators[label])
        if position + 1 < len(ranks):
            self.dist.send_object(accumulators, ranks[position + 1])
            return None
        return accumulators

    def share(self, canonical: str, merged: Optional[torch.Tensor], src: int = 0) -> torch.Tensor:
        shape = self.base.shapes[canonical]
        wide = safetensors_dtype(self.base.dtypes[canonical]) == torch.float64
        dtype = torch.float64 if wide else torch.float32
        return self.dist.broadcast_tensor(merged, shape, dtype, self.device, src=src)

    # ---------------------------------------------------------------------------------
    # Linear groups

    def merge_group(self, job: GroupToMerge) -> tuple[Weights, dict[str, Any]]:
        """One group over several ranks; ``job.group`` holds this rank's tasks.

        With the method's reduction, the sums reach the solving rank, which solves and
        broadcasts; gathered, rank 0 merges the whole group. Returns the merged weights (on
        every rank) and, on rank 0, the group's diagnostics; the per-task ones of the
        reduction stay with the task's rank until :meth:`collect_task_diagnostics`.
        """
        local = job.group
        reduction, weights_along = self._reduction(local)
        solver = self.holders[job.turn % len(self.holders)] if reduction is not None else 0
        result: Optional[Weights] = None
        diagnostics: dict[str, Any] = {}
        if reduction is not None:
            reduction, solver, result, diagnostics = self._reduce(reduction, local, solver)
            weights_along = weights_along or reduction is None
        if reduction is None:
            result, diagnostics = self._gathered(job, weights_along)
        if self.dist.rank == solver:
            assert result is not None
            result = job.stored(result)
        shared = {
            n_: self.share(c, result[n_] if result is not None else None, src=solver)
            for n_, c in zip(local.weights, job.canonical)
        }
        if solver != 0:
            diagnostics = self.dist.broadcast_object(diagnostics, src=solver)
            if not self.writes:
                diagnostics = {}
        if reduction is not None and self.holds:
            oriented = {n_: orient(w, job.flip.get(n_, False)) for n_, w in shared.items()}
            tasks = reduction.task_diagnostics(local, oriented)
            if tasks:
                self.task_diagnostics[job.record] = tasks
        return shared, diagnostics

    def _reduction(self, local: LinearGroup) -> tuple[Optional[SumReduction], bool]:
        """The method's reduction, unless the ranks' votes say the whole group must meet on
        rank 0 (e.g. a span solve on every task's rows); and whether rank 0, holding only
        its own experts' linear weights, needs the others' too."""
        reduction = self.method.reduction(self.parameters)
        if reduction is None:
            return None, False
        # rank 0 decides from every rank's vote and all ranks follow; a rank that holds no
        # task's statistics (W > K) does not vote
        votes = self.dist.gather_objects(reduction.gather_vote(local) if self.holds else None)
        if self.dist.broadcast_object(
            reduction.needs_gather([v for v in votes if v is not None])
            if votes is not None
            else None
        ):
            return None, True
        return reduction, False

    def _reduce(
        self, reduction: SumReduction, local: LinearGroup, solver: int
    ) -> tuple[Optional[SumReduction], int, Optional[Weights], dict[str, Any]]:
        """The reduction's rounds of sums in task order and its solve on rank ``solver``.

        Returns the reduction (None when the first round's sums decided that the group must
        be gathered after all), the solving rank, and there the result and diagnostics.
        """
        solves = self.dist.rank == solver
        totals = self._sums_in_task_order(reduction, local, solver)
        for _ in range(reduction.rounds - 1):
            shared = self.dist.broadcast_object(
                reduction.next_round(totals, local) if solves else None,  # type: ignore[arg-type]
                src=solver,
            )
            if isinstance(shared, dict) and shared.get("gather"):
                # the first round's sums decided that the whole group must meet on one rank
                # after all (a span solve once the ridge is known): rank 0 merges it
                return None, 0, None, {}
            start = reduction.start_round(shared, local) if self.holds else None
            totals = self._sums_in_task_order(reduction, local, solver, start)
        if not solves:
            return reduction, solver, None, {}
        assert totals is not None
        result, diagnostics = reduction.solve(totals, local)
        return reduction, solver, result, diagnostics

    def _sums_in_task_order(
        self,
        reduction: SumReduction,
        local: LinearGroup,
        solver: int = 0,
        start: Optional[Weights] = None,
    ) -> Optional[Weights]:
        """Add every task's terms in task order: the sums travel from the rank of task k to
        that of task k+1 (then to rank ``solver``), so the floating-point additions are those
        of one process; returns the totals on rank ``solver`` (None elsewhere). ``start``:
        a later round's accumulators (:meth:`SumReduction.start_round`), else
        :meth:`SumReduction.prepare`'s."""
        if not self.holds:
            return None  # W > K: this rank's share of the statistics went on to another
        sums = reduction.prepare(local) if start is None else start
        position = {k: i for i, k in enumerate(self.holds)}
        holder = self.dist.owner(0, self.num_tasks)
        for k in range(self.num_tasks):
            owner = self.dist.owner(k, self.num_tasks)
            if owner != holder:
                self.pass_sums(sums, holder, owner)
                holder = owner
            if owner == self.dist.rank:
                reduction.add_task(sums, position[k])
        if holder != solver:
            self.pass_sums(sums, holder, solver)
        return sums if self.dist.rank == solver else None

    def _gathered(
        self, job: GroupToMerge, weights_along: bool
    ) -> tuple[Optional[Weights], dict[str, Any]]:
        """Every rank's statistics (and, ``weights_along``, its experts' linear weights) on
        rank 0, which merges the whole group with the method's single-process code."""
        local = job.group
        payload = (
            list(self.holds),
            [_on(st, "cpu") for st in local.expert_stats or []],
            [_on(st, "cpu") for st in local.merged_stats] if local.merged_stats else None,
            [{n_: w.cpu() for n_, w in e.items()} for e in local.experts]
            if weights_along
            else None,
        )
        gathered = self.dist.gather_objects(payload)
        if not self.writes:
            return None, {}
        assert gathered is not None
        return self.method.merge_linear_group(self._whole_group(job, gathered), self.parameters)

    def _whole_group(self, job: GroupToMerge, gathered: list[Any]) -> LinearGroup:
        """The group of every task on rank 0, from the statistics each rank gathered to it."""
        local = job.group
        expert_stats: list[Optional[TaskStatistics]] = [None] * self.num_tasks
        merged_stats: list[Optional[TaskStatistics]] = [None] * self.num_tasks
        experts = [
            {
                n_: orient(widened(w[c]), job.flip.get(n_, False))
                for n_, c in zip(local.weights, job.canonical)
                if c in w
            }
            for w in job.expert_blocks
        ]
        for indices, own_expert, own_merged, own_weights in gathered:
            for position, k in enumerate(indices):
                if own_weights is not None:
                    experts[k] = {n_: w.to(self.device) for n_, w in own_weights[position].items()}
                if own_expert:
                    expert_stats[k] = _on(own_expert[position], self.device)
                if own_merged is not None:
                    merged_stats[k] = _on(own_merged[position], self.device)
        return LinearGroup(
            name=local.name,
            weights=local.weights,
            base=local.base,
            experts=experts,
            task_names=[e.task for e in self.experts],
            # (rank 0 may hold no task's statistics itself: W > K)
            expert_stats=expert_stats if self.request.expert_path else [],  # type: ignore[arg-type]
            merged_stats=merged_stats if local.merged_stats is not None else None,  # type: ignore[arg-type]
            output_dtypes=local.output_dtypes,
            compute_dtype=local.compute_dtype,
        )

    # ---------------------------------------------------------------------------------
    # Experts modules

    def merge_experts(
        self, own: list[Any], path: Optional[list[Any]], run: ExpertsRun, names: Sequence[str]
    ) -> ExpertMergeResult:
        """Every task's routed statistics go to rank 0, which runs the one-process merge on
        them (the same bits) and shares the result."""
        gathered = self.dist.gather_objects(
            (
                list(self.holds),
                [_routed_on(x, "cpu") for x in own],
                [_routed_on(x, "cpu") for x in path] if path is not None else None,
            )
        )
        result: Optional[ExpertMergeResult] = None
        if self.writes:
            assert gathered is not None
            every: list[Any] = [None] * self.num_tasks
            every_path: list[Any] = [None] * self.num_tasks
            for indices, stats, paths in gathered:
                for position, k in enumerate(indices):
                    if stats:
                        every[k] = _routed_on(stats[position], self.device)
                    if paths is not None:
                        every_path[k] = _routed_on(paths[position], self.device)
            result = run(
                every if self.request.expert_path else [],
                every_path if path is not None else None,
            )
        gate_up, down = (
            self.share(name, getattr(result, key) if result else None)
            for key, name in zip(("gate_up", "down"), names)
        )
        records, without = self.dist.broadcast_object(
            (result.records, result.without_tokens) if result is not None else None
        )
        return ExpertMergeResult(gate_up, down, records, without)

    # ---------------------------------------------------------------------------------
    # The end of the run

    def collect_task_diagnostics(self, layer_diagnostics: list[dict[str, Any]]) -> None:
        gathered = self.dist.gather_objects(self.task_diagnostics)
        if gathered is None:
            return
        order = {e.task: k for k, e in enumerate(self.experts)}
        for index, record in enumerate(layer_diagnostics):
            tasks: dict[str, Any] = dict(record.get("tasks") or {})
            for part in gathered:
                tasks.update(part.get(index, {}))
            if tasks:
                record["tasks"] = dict(sorted(tasks.items(), key=lambda kv: order.get(kv[0], 0)))

    def record(self) -> Optional[dict[str, Any]]:
        section: dict[str, Any] = {
            "world_size": self.dist.world_size,
            "backend": self.dist.backend,
            # the rank that holds each task's statistics
            "task_ranks": {
                e.task: self.dist.owner(k, self.num_tasks) for k, e in enumerate(self.experts)
            },
        }
        if self.dist.world_size > self.num_tasks:
            # ranks sharing a task: each one's [first, stop) of the task's batches
            section["task_shares"] = {
                e.task: {
                    r: list(
                        DistributedContext(self.dist.world_size, r).share(
                            k, self.num_tasks, len(e.data.batches) if e.data else 1
                        )
                    )
                    for r in self.dist.ranks_of(k, self.num_tasks)
                }
                for k, e in enumerate(self.experts)
            }
        return section
