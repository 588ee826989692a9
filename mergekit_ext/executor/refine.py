"""A block's refinement after its group merges (:class:`~mergekit_ext.methods.layerwise.BlockRefinement`).

The sequential executor merges a block's linear groups (Chain of Merges' closed form, say),
holds their weights unwritten, and hands the method a
:class:`~mergekit_ext.methods.layerwise.BlockToRefine` whose callbacks run the block on each
task's merged-path inputs. The targets (the refinement's ``target`` attribute): with
``"expert_path"`` each expert block's output on the expert's own path (the features the
expert computes; the executor's expert pass of the block already holds them, ProDistill's
"dual inputs": the block also corrects the drift of the merged blocks below it), with
``"merged_path"`` (the default) each expert block applied to the task's merged-path inputs
(the same inputs the merged block sees: the block's own error alone). The loss of task k
on one calibration batch is ``‖f(X) − Y_k‖² / ‖Y_k‖²`` over its non-padding tokens (``Y_k``
the target; with the refinement's ``token_weight: equal`` the mean over those tokens of
``‖f(x_t) − y_t‖² / ‖y_t‖²``), and the gradient of ``Σ_k ω_k L_k`` (``ω_k = 1/K``) reaches the method with
the tasks' terms added in task order: the sum passes from the rank of task k to that of
task k+1, as the executor's reductions pass their sums, and the last holder broadcasts it,
so W processes compute the bits of one (docs/methods.md, "Block-wise distillation").

Besides the block's linears the refinement may train the block's vectors (biases, norms;
``trains_vectors``) and, in the first block, the tensors before it (the embeddings but an
LM's token table; ``trains_pre_block``): the block's input is then recomputed from them in
every forward, and their gradients pass in task order with the linears'.

Memory: the targets (on the merged path one more copy of this rank's hidden states; the
expert path's are the ones held anyway), the gradient sums (one copy of the block's
linears) and one batch's autograd graph, beside the (K + 2) blocks the executor holds
anyway; the method holds its optimizer state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional, Protocol

import torch

from mergekit_ext.console import phase
from mergekit_ext.distributed import DistributedContext
from mergekit_ext.errors import ExecutionError
from mergekit_ext.executor.blocks import TaskState, run_block
from mergekit_ext.executor.compute import LowPrecisionParams, carried, compute_in, widened
from mergekit_ext.executor.plan import BlockLayout
from mergekit_ext.executor.strategy import WalkStrategy
from mergekit_ext.methods.layerwise import BlockRefinement, BlockToRefine
from mergekit_ext.wide_sums import frobenius64


class RefiningExecutor(Protocol):
    """What a block's refinement uses of the sequential executor (``SequentialExecutor``
    satisfies it): its public members for the block runs, dtypes, writer and process ranks,
    the same ones its own walk calls, so that a refined block is run, rounded, checked and
    written as a merged one. Declared here, not imported, so that the refinement and the
    walk that calls it do not import each other (tests/test_architecture_rules.py)."""

    dist: DistributedContext
    strategy: WalkStrategy  # this process's tasks (``.shares``) and the passes of sums
    plan: Any  # the MergePlan (``.blocks``: the block layouts in forward order)
    experts: Sequence[Any]  # the tasks' expert models, in task order (``.task``: the name)
    method: Any  # the LayerwiseMethod (``.name``)
    base: Any  # the base model's tensors (``.shapes``)
    blocks: Sequence[Any]  # transformers' own modules of the blocks
    compute: Any  # the executor's compute dtype record (``.dtype``, ``.low_precision``)
    device: torch.device
    low_params: LowPrecisionParams  # the block parameters' cached compute-dtype casts

    @property
    def held_states(self) -> Sequence[TaskState]:
        """The states of the tasks whose statistics end in this process."""

    def kept_dtype(self, block: BlockLayout) -> Optional[torch.dtype]:
        """The dtype the block's matrices are held in as stored (None: float32)."""

    def run_block(
        self, index: int, params: dict[str, torch.Tensor], hidden: torch.Tensor, call: Any
    ) -> torch.Tensor:
        """Block ``index`` with tensors ``params`` in the compute dtype; float32 out."""

    def embed_batch(
        self, params: dict[str, torch.Tensor], inputs: dict[str, Any]
    ) -> tuple[torch.Tensor, Any]:
        """One batch up to the first block: its input and every block's call."""

    def written_dtype(self, canonical: str) -> torch.dtype:
        """The dtype a floating tensor is written in."""

    def check_merged(self, name: str, merged: Any, shape: torch.Size) -> None:
        """Refuses a merged tensor that is no tensor, of another shape, or not finite."""

    def write(
        self,
        canonical: str,
        tensor: torch.Tensor,
        keep: Optional[torch.dtype] = None,
        write: bool = True,
    ) -> torch.Tensor:
        """Write a merged tensor; returns it as the saved model holds it."""


def _real_tokens(mask: Optional[torch.Tensor], per_token: torch.Tensor) -> Optional[torch.Tensor]:
    """``mask`` where it marks ``per_token``'s (``[B, T]``) non-padding tokens, else None
    (inputs without a padding mask, pixel batches: every position counts)."""
    return mask if mask is not None and mask.shape == per_token.shape else None


def _squared_error(
    diff: torch.Tensor, mask: Optional[torch.Tensor], scale: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``Σ_t s_t ‖row_t‖²`` over the non-padding tokens of ``diff`` (``[B, T, H]``);
    ``scale`` (``[B, T]``): ``s_t``, 1 where not given."""
    per_token = diff.pow(2).sum(-1)
    if scale is not None:
        per_token = per_token * scale
    real = _real_tokens(mask, per_token)
    return (per_token[real] if real is not None else per_token).sum()


#: A target token's energy below this fraction of the batch's mean per-token energy counts
#: as this fraction (``token_weight: equal``): a near-zero row (none seen in the suites' models)
#: would otherwise weigh without bound.
_MIN_TOKEN_ENERGY = 1e-6


def _token_scale(target: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """``1 / ‖y_t‖²`` per token of ``target`` (``[B, T, H]``), the padding's excluded from
    the mean that bounds it: each token's error relative to its own target."""
    energy = target.detach().float().pow(2).sum(-1)
    real = _real_tokens(mask, energy)
    floor = (energy[real] if real is not None else energy).mean().clamp_min(1e-30)
    floor = floor * _MIN_TOKEN_ENERGY
    return 1.0 / energy.clamp_min(floor)


def _token_count(target: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """The non-padding tokens of ``target`` (``[B, T, H]``), as a float32 scalar."""
    real = _real_tokens(mask, target[..., 0])
    if real is not None:
        return real.sum().to(torch.float32)
    return torch.tensor(float(target.shape[0] * target.shape[1]))


class BlockDistillation:
    """The callbacks of one block's :class:`BlockToRefine`, run by ``executor``."""

    def __init__(
        self,
        executor: RefiningExecutor,
        block: BlockLayout,
        base_block: dict[str, torch.Tensor],
        expert_blocks: list[dict[str, torch.Tensor]],
        merged: dict[str, torch.Tensor],
        target: str = "merged_path",
        token_weight: str = "energy",
        vectors: Sequence[str] = (),
        pre_block: Optional[dict[str, torch.Tensor]] = None,
        pre_trained: Sequence[str] = (),
        show: Optional[Callable[[str], None]] = None,
    ) -> None:
        ex = self.ex = executor
        self.show = show
        self.shown_at = -float("inf")
        if any(ex.strategy.shares(k) for k in range(len(ex.experts))):
            raise ExecutionError(
                f"{ex.method.name} refines each block with gradients summed task by task: run it "
                f"with at most as many processes as tasks ({len(ex.experts)}), not "
                f"{ex.dist.world_size}"
            )
        self.block = block
        self.local = len(block.prefix)
        linears = [t for g in block.groups if not g.experts for t in block.group_tensors(g)]
        # the block's biases and norm weights, when the refinement trains them too
        self.linears = linears + [n for n in vectors if n not in linears]
        # the first block may train the tensors before it (embeddings) with it: its inputs
        # are then recomputed from them in every forward, and the gradient reaches them
        self.pre_block = pre_block or {}
        self.pre = [n for n in pre_trained if n in self.pre_block]
        self.names = self.linears + self.pre
        self.keep = ex.kept_dtype(block)
        self.merged = merged
        self.base_block = base_block
        self.num_tasks = len(ex.experts)
        self.weight = 1.0 / self.num_tasks  # ω_k: each task counts once (CoM's uniform ω)
        self.held = {s.index: s for s in ex.held_states}
        self.target = target
        self.targets: dict[int, list[torch.Tensor]] = {}
        # per batch, the error's denominator: ‖Y_k‖² (energy) or the token count (equal,
        # each token's error scaled by 1/‖y_t‖², self.scales)
        self.energies: dict[int, list[torch.Tensor]] = {}
        self.scales: dict[int, list[Optional[torch.Tensor]]] = {}
        for k, state in self.held.items():
            if target == "expert_path":
                # expert k's block output on its own path: the executor's expert pass of
                # this block has just computed it (the next block's expert-path inputs)
                if state.expert_hidden is None:
                    raise ExecutionError(
                        f"{ex.method.name}: distill_target: expert_path needs the expert "
                        f"path's hidden states of task {state.name}, which this merge did not "
                        "compute (set distill_target: merged_path)"
                    )
                outs = list(state.expert_hidden)
            else:  # expert k's block on task k's merged-path inputs
                params = {n[self.local :]: t for n, t in expert_blocks[k].items()}
                assert state.merged_hidden is not None
                outs = [
                    ex.run_block(block.index, params, hidden, state.calls[b][block.index])
                    for b, hidden in enumerate(state.merged_hidden)
                ]
            self.targets[k] = outs
            if token_weight == "equal":
                self.scales[k] = [_token_scale(y, state.masks[b]) for b, y in enumerate(outs)]
                self.energies[k] = [_token_count(y, state.masks[b]) for b, y in enumerate(outs)]
            else:
                self.scales[k] = [None] * len(outs)
                self.energies[k] = [_squared_error(y, state.masks[b]) for b, y in enumerate(outs)]
        # max_k ‖W_k‖_F per linear over every task (the max of the ranks' maxima: exact)
        # the trained tensors before the block: the base's, each held expert's (small)
        self.pre_base = {n: ex.base.load(n, ex.device) for n in self.pre}
        pre_experts = {
            k: {n: ex.experts[k].source.load(n, ex.device) for n in self.pre} for k in self.held
        }
        own = {
            n: max(
                (
                    frobenius64(widened((pre_experts if n in self.pre else expert_blocks)[k][n]))
                    for k in self.held
                ),
                default=0.0,
            )
            for n in self.names
        }
        del pre_experts
        parts = ex.dist.gather_objects(own)
        norms = {n: max(p[n] for p in parts) for n in self.names} if parts is not None else None
        self.expert_norms: dict[str, float] = ex.dist.broadcast_object(norms)

    # ---------------------------------------------------------------------------------

    def request(self, name: str) -> BlockToRefine:
        start = {n: widened(self.merged[n]).float() for n in self.linears}
        base = {n: widened(self.base_block[n]).float() for n in self.linears}
        start.update({n: widened(self.pre_block[n]).float() for n in self.pre})
        base.update({n: widened(self.pre_base[n]).float() for n in self.pre})
        return BlockToRefine(
            name=name,
            start=start,
            base=base,
            expert_norms=self.expert_norms,
            task_names=[e.task for e in self.ex.experts],
            gradient=self.gradient,
            errors=self.errors,
            batches=max((len(t) for t in self.targets.values()), default=1),
            first=self.block is self.ex.plan.blocks[0],
            progress=self.progress if self.show is not None else None,
        )

    def progress(self, done: int, steps: int, loss: float) -> None:
        """The step count and loss on the block's progress bar: an 8B block's steps take
        hours on a CPU. At most one update a second (a redraw is a line in a log file),
        and the last step's."""
        now = time.monotonic()
        if self.show is not None and (now - self.shown_at >= 1.0 or done == steps):
            self.shown_at = now
            self.show(f"refinement step {done}/{steps}, loss {loss:.3g}")

    def _params(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The block's tensors by local name: ``weights`` for the trained linears (cast to
        the compute dtype inside the graph: float32 master weights), the rest as merged."""
        ex = self.ex
        weights = {n: w for n, w in weights.items() if n not in self.pre_block}
        fixed = {n[self.local :]: self.merged[n] for n in self.block.tensors if n not in weights}
        if ex.compute.low_precision:
            fixed = ex.low_params(fixed)
            trained = {
                n[self.local :]: w.to(ex.compute.dtype) if w.dim() >= 2 else w
                for n, w in weights.items()
            }
        else:
            trained = {n[self.local :]: w for n, w in weights.items()}
        return {**fixed, **trained}

    def _forward(
        self, params: dict[str, torch.Tensor], k: int, b: int, weights: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """The block's output on task k's batch b; with trained tensors before the block its
        input is recomputed from them (``weights``: float32, the embeddings' own pass)."""
        state = self.held[k]
        assert state.merged_hidden is not None
        hidden = state.merged_hidden[b]
        if self.pre:
            pre = {**self.pre_block, **{n: weights[n] for n in self.pre}}
            hidden = self.ex.embed_batch(pre, state.inputs[b])[0]
        with compute_in(self.ex.compute.dtype, self.ex.device):
            out = run_block(
                self.ex.blocks[self.block.index],
                params,
                hidden,
                state.calls[b][self.block.index],
            )
        return carried(out)

    def _task_gradient(
        self, k: int, weights: Mapping[str, torch.Tensor], step: int
    ) -> tuple[dict[str, torch.Tensor], float]:
        b = step % len(self.targets[k])
        leaves = {n: weights[n].detach().requires_grad_(True) for n in self.names}
        with torch.enable_grad():
            out = self._forward(self._params(leaves), k, b, leaves)
            error = _squared_error(
                out - self.targets[k][b], self.held[k].masks[b], self.scales[k][b]
            )
            loss = error / self.energies[k][b].clamp_min(1e-30)
            # allow_unused: a tensor before the block that this input does not reach (a
            # token-type table of one type) gets a zero gradient
            grads = torch.autograd.grad(
                loss * self.weight, [leaves[n] for n in self.names], allow_unused=True
            )
        return {
            n: g if g is not None else torch.zeros_like(leaves[n])
            for n, g in zip(self.names, grads)
        }, float(loss.detach())

    def gradient(
        self, weights: Mapping[str, torch.Tensor], step: int
    ) -> tuple[dict[str, torch.Tensor], list[float]]:
        """``Σ_k ω_k ∇ L_k`` on every rank, the tasks added in task order; the losses ``L_k``."""
        ex = self.ex
        sums = {n: torch.zeros_like(weights[n], dtype=torch.float32) for n in self.names}
        losses: dict[int, float] = {}
        holder = ex.dist.owner(0, self.num_tasks)
        for k in range(self.num_tasks):
            owner = ex.dist.owner(k, self.num_tasks)
            if owner != holder:
                ex.strategy.pass_sums(sums, holder, owner)
                holder = owner
            if owner == ex.dist.rank:
                grads, losses[k] = self._task_gradient(k, weights, step)
                for n in self.names:
                    sums[n].add_(grads[n])
                del grads  # not alive beside the next task's
        if ex.dist.enabled:
            sums = {
                n: ex.dist.broadcast_tensor(
                    sums[n] if ex.dist.rank == holder else None,
                    sums[n].shape,
                    torch.float32,
                    ex.device,
                    src=holder,
                )
                for n in self.names
            }
        return sums, [v for _, v in sorted(self._everyones(losses).items())]

    def _everyones(self, mine: dict[int, float]) -> dict[int, float]:
        """Every rank's ``{task: value}`` on every rank."""
        parts = self.ex.dist.gather_objects(mine)
        merged = None
        if parts is not None:
            merged = {k: v for p in parts for k, v in p.items()}
        return self.ex.dist.broadcast_object(merged)

    def as_written(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` rounded as the output file holds it, float32."""
        return weight.to(self.ex.written_dtype(name)).to(torch.float32)

    def errors(self, weights: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """Each task's relative block-output error over all its calibration batches."""
        written = {n: self.as_written(n, weights[n]) for n in self.names}
        params = self._params(written)
        mine: dict[int, float] = {}
        for k in self.held:
            error = torch.zeros((), dtype=torch.float64)
            energy = torch.zeros((), dtype=torch.float64)
            for b, target in enumerate(self.targets[k]):
                out = self._forward(params, k, b, written)
                error += (
                    _squared_error(out - target, self.held[k].masks[b], self.scales[k][b])
                    .double()
                    .cpu()
                )
                energy += self.energies[k][b].double().cpu()
            mine[k] = float((error / energy.clamp_min(1e-300)).sqrt())
        every = self._everyones(mine)
        return {self.ex.experts[k].task: every[k] for k in sorted(every)}

    def close(self) -> None:
        self.targets.clear()
        self.energies.clear()
        self.scales.clear()


def refine_block(
    executor: RefiningExecutor,
    refinement: BlockRefinement,
    block: BlockLayout,
    base_block: dict[str, torch.Tensor],
    expert_blocks: list[dict[str, torch.Tensor]],
    merged: dict[str, torch.Tensor],
    vectors: Sequence[str] = (),
    pre_block: Optional[dict[str, torch.Tensor]] = None,
    pre_trained: Sequence[str] = (),
    show: Optional[Callable[[str], None]] = None,
) -> dict[str, Any]:
    """Refine ``block``'s held linears in ``merged`` and write them; the block's record.
    ``pre_trained``: the tensors of ``pre_block`` (the merged tensors before the first
    block, held unwritten) trained with this block; refined and written into ``pre_block``.
    ``show``: puts a short status (the step count) on the block's progress bar."""
    ex = executor
    distill = BlockDistillation(
        ex,
        block,
        base_block,
        expert_blocks,
        merged,
        refinement.target,
        refinement.token_weight,
        vectors,
        pre_block,
        pre_trained,
        show,
    )
    name = block.prefix.rstrip(".") or f"block {block.index}"
    start = {n: distill.pre_block[n].clone() for n in distill.pre}
    try:
        result, diagnostics = refinement.refine(distill.request(name))
    finally:
        distill.close()
    if distill.pre:
        # the embeddings trained with the block: how far each moved from its fallback merge
        diagnostics["pre_block"] = {
            n: {
                "change": frobenius64(widened(result[n]).float() - start[n])
                / max(frobenius64(start[n]), 1e-30)
            }
            for n in distill.pre
        }
    for n in distill.names:
        if n not in result:
            raise ExecutionError(f"{ex.method.name} returned no refined weight for {n}")
        ex.check_merged(n, result[n], ex.base.shapes[n])
        if n in distill.pre:
            distill.pre_block[n] = ex.write(n, result[n])  # as the embeddings were merged
        elif n in vectors:
            merged[n] = ex.write(n, result[n])  # as the block's other tensors were merged
        else:
            merged[n] = ex.write(n, result[n], distill.keep)
    ex.low_params.clear()  # the refined weights replace the start's cast copies
    before, after = diagnostics.get("error_before"), diagnostics.get("error_after")
    if isinstance(before, float) and isinstance(after, float):
        # one line per block: where the remaining loss sits, without opening the record
        phase(
            f"{name}: block output error {before:.4g} -> {after:.4g} "
            f"({diagnostics.get('kept', 'refined')})"
        )
    return {"block": block.index, "layer": name, **diagnostics}
