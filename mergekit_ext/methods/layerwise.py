"""The narrow interface between the sequential executor and a data-aware method.

The executor (``mergekit_ext.executor``) walks the network block by block. Inside a block
it visits *linear groups* in forward order: the linears that read the same input (for a
Llama block ``[q,k,v] -> o -> [gate,up] -> down``). For each group it hands the method a
:class:`LinearGroup` (the group's weights per model, float32, PyTorch ``out x in``) and
the per-task :class:`TaskStatistics` of the group's input; the method returns the merged
weights. Every other tensor (biases, norms, embeddings, heads) goes through
:meth:`LayerwiseMethod.merge_other`.

A method never loads files, runs models or writes output.

A method may instead fit each linear weight to the *model's output*
(``StatisticsRequest.model_output``): the executor then runs the whole model and
hands the method, per linear and calibration batch, the linear's inputs, the output's
vector-Jacobian products with respect to the linear's output and the sketched output error
(:class:`ModelOutputFit`); the method still only does tensor arithmetic.

Before anything loads, the plan (``executor/plan.py``) sizes the merge: the executor's own
memory (blocks, statistics, hidden states) it counts itself; what the method's solve holds,
whether it solves in the tokens' span, and what it warns about the data, it asks the method
(:meth:`LayerwiseMethod.solve_bytes`, :meth:`LayerwiseMethod.solve_in_span`,
:meth:`LayerwiseMethod.plan_warnings`, :meth:`BlockRefinement.memory_bytes`), which sees
only :class:`GroupToSize`: shapes and token counts, no weight.

Several processes (``torchrun``): each holds the statistics and expert weights of its own
tasks only. A method whose merge depends on the tasks through sums returns a
:class:`SumReduction` from :meth:`LayerwiseMethod.reduction`; otherwise (the default) the
executor gathers every task's statistics to rank 0, which merges with
:meth:`LayerwiseMethod.merge_linear_group` exactly as a single process does.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from mergekit_ext.calibration.statistics import TaskStatistics
from mergekit_ext.methods.parameters import MethodParameters

__all__ = [
    "BlockRefinement",
    "BlockToRefine",
    "GroupToSize",
    "LayerwiseMethod",
    "LinearGroup",
    "ModelOutputFit",
    "ModelOutputRequest",
    "SpanSolve",
    "StatisticsRequest",
    "TaskStatistics",
    "dense_solve_bytes",
    "fallback_merge",
]


@dataclass
class LinearGroup:
    """One group of linear layers that share an input, with everything a method may use.

    - ``name``: a readable id, e.g. ``model.layers.3.self_attn.qkv``
    - ``weights``: tensor names of the group's linear weights (full checkpoint names)
    - ``base``: ``{weight name: W_0}``; ``experts``: one ``{weight name: W_k}`` per task
    - ``task_names``: one per expert, in the config's order
    - ``expert_stats``: per task, the statistics of this group's input in the expert's OWN
      unmerged forward pass (RegMean's statistics)
    - ``merged_stats``: per task, the statistics of this group's input when the task's data
      runs through the already merged layers before it (CoM/QP ``propagate``); None when
      the method did not ask for propagation
    - ``output_dtypes``: ``{weight name: dtype}`` each merged weight is written in (the
      merge's ``dtype``, else the base's); None: as the method returns it. Diagnostics that
      describe the shipped model measure the merged weights cast to it.
    - ``compute_dtype``: the dtype the executor's forward passes ran in (``compute_dtype``
      resolved); statistics from a bfloat16 pass carry its rounding, which the least-squares
      solve and diagnostics use to multiply in lower precision (docs/methods.md, "Compute dtype")
    All weights are float32 ``out x in`` (HF Conv1D weights are transposed by the executor).
    """

    name: str
    weights: Sequence[str]
    base: Mapping[str, torch.Tensor]
    experts: Sequence[Mapping[str, torch.Tensor]]
    task_names: Sequence[str]
    expert_stats: Sequence[TaskStatistics]
    merged_stats: Optional[Sequence[TaskStatistics]] = None
    output_dtypes: Optional[Mapping[str, torch.dtype]] = None
    compute_dtype: torch.dtype = torch.float32

    def as_written(self, weight_name: str, merged: torch.Tensor) -> torch.Tensor:
        """``merged`` rounded as the output file will hold it (in its own dtype after)."""
        dtype = (self.output_dtypes or {}).get(weight_name)
        if dtype is None or dtype == merged.dtype or not merged.dtype.is_floating_point:
            return merged
        return merged.to(dtype).to(merged.dtype)


@dataclass(frozen=True)
class StatisticsRequest:
    """What a method asks the executor to compute for each group.

    - ``propagate``: statistics along the merged path (``merged_stats``)
    - ``expert_path``: statistics along each expert's own path (``expert_stats``)
    - ``normalized_gram``: also the Gram of unit-norm inputs, on the path the merge uses
      (the merged path with ``propagate``, else the expert path)
    - ``reference_gram_max_dim``: with ``propagate``, the expert path is only a reference
      (a diagnostic); above this input width its statistics keep only the mean and the
      per-feature second moment (``gram=None``). None: full Grams at every width.
    - ``keep_rows``: on the path the merge uses, also keep the input rows while a task has
      fewer tokens than the group has inputs (``TaskStatistics.rows``; at most half the
      float64 Gram's memory)
    - ``product_dtype``: dtype of each batch's ``xᵀx`` before it is added to the float64
      sum; None: float32 for float32 (or narrower) activations, the fast default (see
      :class:`~mergekit_ext.calibration.statistics.ActivationStatistics`); ``torch.float64``
      for float64 products throughout.
    - ``statistics_dtype``: dtype of the running sums (and of the statistics handed to the
      method): float64 (default) or float32 (half the memory of each Gram).
    - ``compute_dtype``: the method's ``compute_dtype`` setting (``auto`` | ``float32`` |
      ``bfloat16`` | ``float16``) for the block forward passes; the plan resolves ``auto``
      (:mod:`mergekit_ext.executor.compute`). Default ``float32``: what a method that does
      not declare the parameter always had.
    - ``model_output``: the method fits each linear to the model's output instead
      (:class:`ModelOutputRequest`): the executor runs the whole-model path and calls
      :meth:`LayerwiseMethod.model_output_fit` per linear; no statistics are computed.
    """

    propagate: bool
    expert_path: bool = True
    normalized_gram: bool = False
    reference_gram_max_dim: Optional[int] = None
    product_dtype: Optional[torch.dtype] = None
    keep_rows: bool = False
    statistics_dtype: torch.dtype = torch.float64
    compute_dtype: str = "float32"
    model_output: Optional[ModelOutputRequest] = None


@dataclass(frozen=True)
class ModelOutputRequest:
    """A method that fits each linear to the model's output asks the executor for it.

    - ``sketch_rows``: random projections of each sample's output (Gaussian rows of variance
      ``1/sketch_rows``, an independent sketch per sample and linear); 0: every output
      coordinate (exact, one vector-Jacobian product per coordinate). Causal LMs: next
      tokens sampled from the model per position (the sampled-Fisher sketch of the per-token
      KL); 0 is refused there (it would be one product per vocabulary entry)
    - ``tokens``: ``first``: the output is the first position of the backbone's last hidden
      state (ViT's and BERT's CLS, what their classification heads read); ``all``: every
      unmasked position. Causal LMs: always every position's next-token distribution
    - ``seed``: the sketches' seed
    """

    sketch_rows: int
    tokens: str = "first"
    seed: int = 0


@dataclass(frozen=True)
class GroupToSize:
    """One linear group as the plan sizes its solve, before any weight is loaded.

    - ``label``: the group's label in a block (``mlp.down_proj``)
    - ``width``: its inputs (the Gram is ``width x width``); ``out``: its linears' outputs
      together (an experts module: one expert's linear)
    - ``task_tokens``: every task's calibration tokens (or patches), in task order; None
      before the data is loaded (a plan made with ``load_data=False``)
    - ``keep_rows``: the method's ``StatisticsRequest.keep_rows``; ``rows_kept``: and the
      sums are float64, so a task with fewer tokens than inputs does hand the method its
      rows instead of its Gram
    - ``normalized_gram``: the method asked for the Gram of unit-norm inputs too
    - ``low_precision``: the block passes ran in bfloat16 / float16
    - ``several``: several processes run the merge
    """

    label: str
    width: int
    out: int
    task_tokens: Optional[tuple[int, ...]] = None
    keep_rows: bool = False
    rows_kept: bool = False
    normalized_gram: bool = False
    low_precision: bool = False
    several: bool = False

    @property
    def tokens(self) -> Optional[int]:
        """All tasks' tokens together (None before the data is loaded)."""
        return None if self.task_tokens is None else sum(self.task_tokens)


@dataclass(frozen=True)
class SpanSolve:
    """Whether a method solves a group in the span of the tasks' token rows, not on Grams.

    - ``now``: from the rows, decided before any sum (every task's rows meet where it runs)
    - ``after_gather``: several processes, where only the summed system decides it (its
      ridge): every task's rows and Grams meet on rank 0, which may then take the span
    """

    now: bool = False
    after_gather: bool = False


def dense_solve_bytes(width: int, out: int, tasks: int) -> int:
    """Working memory of a dense solve on one group's input Grams (float64), the default of
    :meth:`LayerwiseMethod.solve_bytes`: the ``tasks`` stacked expert weights (float32), four
    ``out x in`` float64 matrices at once (a summed numerator, a weighted sum of the experts,
    the buffer each task's terms are widened in, then the solution), the summed system, its
    symmetrised copy and its factor plus one more ``in x in`` (float64), and two ``out x in``
    float32 products formed one task at a time."""
    weights = tasks * out * width * 4
    return weights + 4 * out * width * 8 + 4 * width * width * 8 + 2 * out * width * 4


class ModelOutputFit(ABC):
    """One linear weight's model-output fit, fed batch by batch by the executor.

    The executor runs the model merged so far (the weights not yet merged at the base)
    with the linear's output ``z`` (``[B, T, m]``) replaced by ``z + ε``; for sketch row p,
    ``output_grads[p] = ∂(s_p · f)/∂ε`` at ε = 0 (``[P, B, T, m]``), and ``residual[b, p] =
    s_p · (f(x_b) − f_t(x_b))``, the sketched error against task t's expert.
    """

    @abstractmethod
    def add_batch(
        self,
        inputs: torch.Tensor,
        output_grads: torch.Tensor,
        residual: torch.Tensor,
        sample_weight: float,
        error_grad: Optional[torch.Tensor] = None,
    ) -> None:
        """Add one batch of one task: ``inputs`` ``[B, T, in]`` (the linear's input),
        ``output_grads`` ``[P, B, T, m]``, ``residual`` ``[B, P]``, every sample weighted
        ``sample_weight`` (``1/N_t``: each task counts once).

        ``error_grad`` (``[B, T, m]``, causal LMs): ``∂/∂ε`` of the output error itself (the
        per-token KL), the exact gradient, which then gives the objective's linear term
        ``A_jᵀ b_j`` instead of its sketch."""

    @abstractmethod
    def solve(self) -> tuple[torch.Tensor, dict[str, Any]]:
        """The merged weight (``out x in``) and its diagnostics."""


class SumReduction(ABC):
    """One linear group's merge split over processes that own disjoint sets of tasks.

    For a merge that depends on the tasks only through sums over them (RegMean and CoM:
    ``Σ_k ω_k W_k G̃_k`` and ``Σ_k ω_k G̃_k``), the executor runs, per group:

    1. :meth:`prepare` on every rank, with the :class:`LinearGroup` of that rank's tasks
       (its experts' weights and statistics only): the per-task work (checks, products),
       in parallel; it returns the zero accumulators;
    2. :meth:`add_task` for k = 0, 1, …, K−1 on the rank of task k, the accumulators passed
       from rank to rank in task order (``torch.distributed`` send/recv), so the
       floating-point additions are exactly those of one process adding the tasks in order;
    3. :meth:`solve` on one rank with the totals (the groups take turns over the ranks, so
       the solves run in parallel with the other ranks' passes): the merged weights
       (broadcast to every rank) and the group's task-independent diagnostics;
    4. :meth:`task_diagnostics` on every rank for its own tasks, with the merged weights.

    A reduction with ``rounds = 2`` adds its tasks twice: after the first totals reach rank
    ``solver``, :meth:`next_round` there returns what every rank needs for the second
    (broadcast), :meth:`start_round` on every rank computes its tasks' second terms and
    returns new accumulators, which :meth:`add_task` fills in task order as before; the
    second totals go to :meth:`solve`. (The least-squares merge decides its ridge and
    factors its system from the first, then adds either the numerator or terms that
    already carry the solve: docs/methods.md, "The dense solve, task by task".)

    An object serves one group (:meth:`LayerwiseMethod.reduction` makes a new one per
    group), so it keeps what :meth:`prepare` computed for the later calls.
    """

    rounds: int = 1

    @abstractmethod
    def prepare(self, group: LinearGroup) -> dict[str, torch.Tensor]:
        """Check ``group``'s tasks and precompute their terms; returns ``{name: zeros}``,
        the same names, shapes and dtypes on every rank."""

    @abstractmethod
    def add_task(self, sums: dict[str, torch.Tensor], position: int) -> None:
        """Add the term of ``group.task_names[position]`` to ``sums``, in place."""

    @abstractmethod
    def solve(
        self, sums: Mapping[str, torch.Tensor], group: LinearGroup
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``({weight name: merged weight}, group diagnostics)`` from the totals.

        ``group`` is the solving rank's own part (names, shapes, dtypes, its tasks'
        statistics; every rank owns at least one task).
        """

    def next_round(self, totals: Mapping[str, torch.Tensor], group: LinearGroup) -> Any:
        """On rank ``solver``, with the totals of a round before the last: what every rank
        needs for the next (picklable, CPU tensors), passed to :meth:`start_round`. A dict
        with ``"gather": True`` ends the reduction instead: the executor then gathers the
        group to rank 0 as :meth:`needs_gather` would have."""
        raise NotImplementedError(f"{type(self).__name__} reduces in one round")

    def start_round(self, shared: Any, group: LinearGroup) -> dict[str, torch.Tensor]:
        """On every rank that holds tasks: start the next round from :meth:`next_round`'s
        result; returns its zero accumulators (the same on every rank)."""
        raise NotImplementedError(f"{type(self).__name__} reduces in one round")

    def gather_vote(self, group: LinearGroup) -> Any:
        """What this rank's part of ``group`` says about reducing it to sums (any picklable
        value; every rank's goes to :meth:`needs_gather`); False by default."""
        return False

    def needs_gather(self, votes: Sequence[Any]) -> bool:
        """From every rank's :meth:`gather_vote` (rank order): True when the group cannot be
        reduced to sums, and the executor then gathers every task's statistics to rank 0 and
        calls :meth:`LayerwiseMethod.merge_linear_group` there; by default when any vote is
        true."""
        return any(votes)

    def task_diagnostics(
        self, group: LinearGroup, merged: Mapping[str, torch.Tensor]
    ) -> dict[str, dict[str, Any]]:
        """``{task name: diagnostics}`` for ``group``'s tasks (the executor puts them under
        the group record's ``"tasks"``); none by default."""
        return {}


@dataclass
class BlockToRefine:
    """One block after its groups were merged, for a method that then refines the block.

    - ``name``: the block's readable id (e.g. ``model.layers.3``)
    - ``start``: ``{weight name: merged weight}`` of the block's linears as the group merges
      left them (float32, as the checkpoint stores them: an HF ``Conv1D`` weight is
      ``in x out``), the starting point of the refinement
    - ``base``: ``{weight name: W_0}`` in the same layout
    - ``expert_norms``: ``{weight name: max_k ‖W_k‖_F}`` over every task (the result guard's
      reference, the same on every process)
    - ``task_names``: every task, in the config's order
    - ``gradient(weights, step)``: ``(Σ_k ω_k ∇_W L_k, [L_k])``: the gradient, with respect to
      each weight, of the ω-weighted block-output loss of step ``step``'s calibration batches
      at ``weights``, the tasks' terms added in task order (the same bits on every process)
    - ``errors(weights)``: ``{task: ‖f(X_k) − f_k(X_k)‖ / ‖f_k(X_k)‖}`` over all of each task's
      calibration batches, the weights rounded as written (``f``: the block with ``weights``,
      ``f_k``: expert k's block, ``X_k``: task k's merged-path inputs)
    - ``batches``: the largest number of calibration batches of a task
    - ``first``: whether this is the model's first block (its inputs come from the
      embeddings, which it may train with it: see :attr:`BlockRefinement.trains_pre_block`)
    - ``progress(done, steps, loss)``: reports the refinement's progress to the user (None:
      nobody watches), after each of its steps
    The executor runs the block; the method only does tensor arithmetic with these.
    """

    name: str
    start: Mapping[str, torch.Tensor]
    base: Mapping[str, torch.Tensor]
    expert_norms: Mapping[str, float]
    task_names: Sequence[str]
    gradient: Callable[[Mapping[str, torch.Tensor], int], tuple[dict[str, torch.Tensor], list]]
    errors: Callable[[Mapping[str, torch.Tensor]], dict[str, float]]
    batches: int = 1
    first: bool = False
    progress: Optional[Callable[[int, int, float], None]] = None


class BlockRefinement(ABC):
    """A block-level step after the group merges (:meth:`LayerwiseMethod.block_refinement`).

    The executor merges a block's groups as usual, then, before writing its linears and
    carrying the hidden states on, gathers each task's targets (:attr:`target`) and calls
    :meth:`refine`, whose weights it writes and carries forward instead. Every process calls
    :meth:`refine` with the same arguments and must return the same weights (no randomness
    beyond ``seed``).
    """

    #: Each task's target: ``"merged_path"``, expert k's block applied to task k's
    #: merged-path inputs (the block's own error); ``"expert_path"``, expert k's block output
    #: on its own path (the expert's features: the block also corrects the drift below it).
    target: str = "merged_path"

    #: How the block-output error weighs a batch's tokens: ``"energy"``,
    #: ``‖f(X) − Y‖² / ‖Y‖²`` over them (each token by its share of ``‖Y‖²``); ``"equal"``,
    #: the mean over tokens of ``‖f(x_t) − y_t‖² / ‖y_t‖²`` (each token once: in an LLM
    #: the first position, the attention sink, holds most of ``‖Y‖²`` from the middle
    #: blocks on, and under ``"energy"`` most of the loss).
    token_weight: str = "energy"

    #: Whether the first block's refinement also trains the tensors before it (the
    #: executor's choice of which: the embeddings but an LM's token table); they then come
    #: in ``start``/``base``/``expert_norms``/``gradient`` beside the block's linears.
    trains_pre_block: bool = False

    #: Whether each block's refinement also trains the block's vectors (biases, norm
    #: weights; merged by the fallback otherwise), beside its linears.
    trains_vectors: bool = False

    @abstractmethod
    def refine(self, block: BlockToRefine) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """``({weight name: refined weight}, diagnostics of the block)``."""

    def memory_bytes(
        self,
        blocks: Sequence[Sequence[tuple[int, ...]]],
        merged_hidden: int,
        batch_positions: int,
    ) -> int:
        """Peak bytes of one block's refinement on top of the blocks the executor holds, for
        the plan's estimate: ``blocks`` lists each block's refined linear weights' shapes (as
        stored), ``merged_hidden`` the bytes of this process's merged-path hidden states (the
        targets take as many), ``batch_positions`` the positions of its largest batch.
        None known by default (0); a refinement that holds state overrides it."""
        return 0


class LayerwiseMethod(ABC):
    """A data-aware merge method run by the sequential executor.

    ``parameters_model`` is the method's one parameter declaration; the planner parses the
    YAML into it once and every call below receives that typed object (a plain mapping is
    parsed on the spot, for direct calls).
    """

    name: str
    parameters_model: type[MethodParameters] = MethodParameters

    def parse(self, parameters: Any) -> Any:
        """``parameters`` as this method's typed model (``ConfigError`` naming a bad field)."""
        return self.parameters_model.parse(parameters, self.name)

    @abstractmethod
    def statistics_request(self, parameters: Any) -> StatisticsRequest: ...

    @abstractmethod
    def merge_linear_group(
        self, group: LinearGroup, parameters: Any
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Return ``({weight name: merged weight}, diagnostics for this group)``."""

    def reduction(self, parameters: Any) -> Optional[SumReduction]:
        """How several processes share a group's merge: a new :class:`SumReduction` per
        group, or None (the default) to gather every task's statistics and weights to rank
        0 and call :meth:`merge_linear_group` there, which any method supports unchanged."""
        return None

    def block_refinement(self, parameters: Any) -> Optional[BlockRefinement]:
        """A step after each block's group merges (:class:`BlockRefinement`); None (the
        default): the merged groups are the result."""
        return None

    # -- what the plan asks before anything loads (sizes and warnings; no weight is read)

    def solve_in_span(self, parameters: Any, group: GroupToSize) -> SpanSolve:
        """Whether ``group`` is solved in its tokens' span (:class:`SpanSolve`): the plan
        then sizes the rows, and several processes gather the group to rank 0. No by
        default (a solve on the Grams)."""
        return SpanSolve()

    def solve_bytes(
        self,
        parameters: Any,
        group: GroupToSize,
        tasks: int,
        *,
        span: SpanSolve = SpanSolve(),
        gathered: bool = False,
        row_tasks: int = 0,
    ) -> int:
        """Peak working bytes of merging ``group`` from ``tasks`` tasks' terms on one process
        (the method's own copies, the stacked expert weights included; the statistics and
        blocks the executor holds are counted by the plan): ``span`` as
        :meth:`solve_in_span` answered, ``gathered`` when rank 0 merges every task's
        statistics (several processes, no reduction), ``row_tasks`` of ``tasks`` handed
        their rows instead of a Gram. The default is :func:`dense_solve_bytes`, a dense solve
        on the Grams; a method whose solve holds other buffers overrides it."""
        return dense_solve_bytes(group.width, group.out, tasks)

    def plan_warnings(self, parameters: Any, groups: Sequence[GroupToSize]) -> list[str]:
        """What the plan warns about the merge of one block's ``groups`` with this data (the
        plan logs them and a dry run lists them); none by default."""
        return []

    def model_output_fit(
        self,
        name: str,
        base: torch.Tensor,
        experts: Sequence[torch.Tensor],
        task_names: Sequence[str],
        parameters: Any,
    ) -> ModelOutputFit:
        """The fit of linear weight ``name`` to the model's output (only called when
        :meth:`statistics_request` asks for ``model_output``)."""
        raise NotImplementedError(f"{self.name} does not fit linears to the model's output")

    def merge_other(
        self,
        name: str,
        base: Optional[torch.Tensor],
        experts: Sequence[torch.Tensor],
        parameters: Any,
    ) -> torch.Tensor:
        """Merge a tensor that is not an input-hooked linear weight (the fallback merge)."""
        how = getattr(self.parse(parameters), "fallback", "mean")
        return fallback_merge(name, base, experts, how)


def fallback_merge(
    name: str, base: Optional[torch.Tensor], experts: Sequence[torch.Tensor], how: str
) -> torch.Tensor:
    """``mean`` of experts (default), ``base`` (keep W_0) or ``task_arithmetic`` (W_0 + sum Δ)."""
    stacked = torch.stack([e.to(torch.float32) for e in experts])
    if how == "mean":
        return stacked.mean(0)
    if base is None:
        raise ValueError(f"fallback {how!r} for tensor {name} needs a base model")
    if how == "base":
        return base.to(torch.float32).clone()
    if how == "task_arithmetic":
        return base.to(torch.float32) + (stacked - base.to(torch.float32)).sum(0)
    raise ValueError(
        f"unknown fallback {how!r} for tensor {name}: use mean, base or task_arithmetic"
    )
