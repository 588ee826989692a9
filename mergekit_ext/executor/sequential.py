"""The sequential layer-by-layer executor of data-aware merges (RegMean, Chain of Merges, QP).

mergekit merges one tensor at a time and never runs a model. Data-aware methods need the
inputs each linear layer sees on each task's calibration data, and Chain of Merges / QP
need them along the *merged* network ("propagate", CoM arXiv 2508.21421 §3; QP's
multi-layer scheme): the inputs of layer l for task k come from task k's data run through
the already merged layers before l. This executor streams the model:

1. non-block tensors before the blocks (embeddings) are merged with the method's fallback;
   each task's batches run through the embeddings (merged ones for the merged path, the
   expert's own for the expert path). The backbone's own ``forward`` runs with stand-ins
   for the blocks, which record the exact arguments transformers passes to each block
   (attention masks, rotary position embeddings);
2. for each block: load only that block's tensors of the base and of every expert (LoRA
   adapters applied on the fly), merge its non-linear tensors (norms, biases) first, run
   each task's expert-path hidden states through the expert's own block with input hooks
   on every linear group (RegMean's statistics), then merge the groups in forward order:
   the input of group g on the merged path is captured by a forward pre-hook while the
   block runs with its non-linear tensors and every group before g already merged (the
   forward stops right there). After the last group the merged block carries each task's
   merged-path hidden states to the next block. Merged tensors are written as produced;
   the block's tensors are dropped;
3. non-block tensors after the blocks (final norm, pooler, heads) take the fallback merge.

Each block runs as the model's own transformers module (built on the meta device) through
``torch.func.functional_call`` with the block's real tensors, so attention, rotary
embeddings and masks are exactly transformers'. Peak memory ≈ (K + 2) blocks in float32
(base, K experts, merged) + one block's input Grams + the calibration hidden states + the
writer's shard buffer; never K whole models. No extra whole-model passes: each sample's
hidden state is kept at the current block and only that block runs.

Statistics exclude padding (the batch's attention mask) and accumulate in float64 on the
chosen device (:class:`~mergekit_ext.calibration.statistics.ActivationStatistics`).

Several processes (:mod:`mergekit_ext.distributed`): rank r runs only its own tasks
``{k : k mod W = r}`` (their embeddings, expert-path and merged-path passes, statistics)
and loads, per block, the base, its own experts and the merged block. With more processes
than tasks, a task's ranks each run a contiguous share of its batches; each records its
layer inputs and adds them to the task's accumulators when they arrive from the rank with
the previous share (:class:`_DeferredUpdates`), so the sums are the one process's, and the
statistics end on the task's last rank. Rank 0 also loads the
other experts' non-linear tensors (for the fallback merges) and, for a method without a
:class:`~mergekit_ext.methods.layerwise.SumReduction`, their linear weights. Each group is
merged either from sums over the tasks, added in task order as they pass from rank to
rank (bit for bit the single process's sums) and solved on rank 0, or from every task's
statistics gathered to rank 0 and merged with the method's own single-process code;
either way rank 0 broadcasts the merged weights, so every rank carries its tasks' hidden
states through the same merged group. A mixture-of-experts experts module is always merged
the second way (every task's routed statistics gathered to rank 0). Only rank 0 writes;
the per-task diagnostics are gathered to it at the end.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import shutil
from collections.abc import Sequence
from typing import Any, Optional

import torch
from mergekit.io import TensorWriter
from torch import nn
from tqdm.auto import tqdm

from mergekit_ext import finite
from mergekit_ext.calibration.statistics import (
    ActivationStatistics,
    flatten_tokens,
    multiplied_input,
)
from mergekit_ext.console import phase
from mergekit_ext.distributed import DistributedContext, check_shares
from mergekit_ext.errors import ExecutionError, TensorError
from mergekit_ext.executor.blocks import (
    BlockCallRecorder,
    CallSink,
    LinearOutputCache,
    StopForward,
    TaskState,
    group_name,
    orient,
    run_block,
    same_calls,
    skeleton_on_device,
    trim_heap,
)
from mergekit_ext.executor.compute import (
    ComputeChoice,
    LowPrecisionParams,
    carried,
    compute_in,
    kept_dtype,
    widened,
)
from mergekit_ext.executor.moe import (
    DOWN,
    GATE_UP,
    ExpertMergeResult,
    RoutedCall,
    RoutedExpertStatistics,
    merge_experts,
    routed_call,
)
from mergekit_ext.executor.plan import (
    EXPERT_WEIGHTS,
    BlockLayout,
    MergePlan,
    output_shard_bytes,
    safetensors_dtype,
)
from mergekit_ext.executor.refine import refine_block
from mergekit_ext.merge_record import MergeRecord
from mergekit_ext.methods.layerwise import LinearGroup, SumReduction, TaskStatistics
from mergekit_ext.models import model_class
from mergekit_ext.models.checkpoint import HEAD_PREFIX, TAGALONG_FILES
from mergekit_ext.models.families import GroupSpec
from mergekit_ext.models.model_paths import TOKENIZER_FILES
from mergekit_ext.output import write_file

LOG = logging.getLogger(__name__)


class _DeferredUpdates:
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


def resolve_device(device: Optional[str]) -> torch.device:
    """``cpu`` | ``cuda[:n]`` | ``auto`` (CUDA when available)."""
    name = (device or "cpu").strip()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ExecutionError(
            f"device {name!r} requested but CUDA is not available; use --device cpu (or auto)"
        )
    try:
        return torch.device(name)
    except RuntimeError as e:
        raise ExecutionError(f"unknown device {name!r}: use cpu, cuda or auto") from e


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


class SequentialExecutor:
    """Runs one :class:`~mergekit_ext.executor.plan.MergePlan` into an output folder."""

    def __init__(
        self,
        plan: MergePlan,
        out_dir: Optional[str],
        device: torch.device,
        distributed: Optional[DistributedContext] = None,
    ) -> None:
        self.plan = plan
        self.dist = distributed or DistributedContext()
        num_tasks = len(plan.experts)
        self.dist.check_tasks(num_tasks)
        if self.dist.enabled:
            check_shares(
                self.dist.world_size,
                [(e.task, len(e.data.batches) if e.data else 1) for e in plan.experts],
            )
        self.owned = self.dist.owned(num_tasks)  # tasks whose passes this rank runs
        self.holds = self.dist.holds(num_tasks)  # tasks whose statistics end on this rank
        # the ranks that hold statistics, in rank order: they take turns at the solves
        self.holders = sorted({self.dist.owner(k, num_tasks) for k in range(num_tasks)})
        self.writes = self.dist.is_writer
        # Several processes and no SumReduction: rank 0 merges every group itself.
        self._gathers = self.dist.enabled and plan.method.reduction(plan.parameters) is None
        self.out_dir = out_dir
        self.device = device
        self.method = plan.method
        self.parameters = plan.parameters
        self.request = plan.request
        self.base = plan.base
        self.experts = plan.experts
        self.family = plan.family

        # Our own skeleton of the base class: its block list gets the call recorders, the
        # real block modules are kept aside and run with functional_call.
        skeleton = skeleton_on_device(plan.base.config, device)
        path = plan.base.backbone_path
        self.backbone = skeleton.get_submodule(path) if path else skeleton
        block_list = self.backbone.get_submodule(plan.layers_path)
        self.blocks: list[nn.Module] = list(block_list)
        self.sink = CallSink(last=len(self.blocks) - 1)
        for i in range(len(self.blocks)):
            block_list[i] = BlockCallRecorder(i, self.sink, plan.family.wrap_block_output)
        signature = inspect.signature(self.backbone.forward).parameters
        self.extra_inputs: dict[str, Any] = {"use_cache": False} if "use_cache" in signature else {}

        self.writer: Optional[TensorWriter] = None
        if self.writes:
            assert out_dir is not None, "rank 0 writes the output"
            self.writer = TensorWriter(
                out_dir,
                max_shard_size=output_shard_bytes(plan.options),
                safe_serialization=True,
                use_async=plan.options.async_write,
                max_write_threads=plan.options.write_threads,
            )
        # dtype of the block passes (docs/methods.md, "Compute dtype")
        self.compute = plan.compute or ComputeChoice(torch.float32, "float32", "as set")
        self._low_params = LowPrecisionParams(self.compute.dtype)
        self.layer_diagnostics: list[dict[str, Any]] = []
        # a method that refines each block after its group merges (BlockRefinement)
        self.refinement = plan.method.block_refinement(plan.parameters)
        self.block_records: list[dict[str, Any]] = []
        # Several processes: {index of a layer record: {task: diagnostics}} of own tasks.
        self.task_diagnostics: dict[int, dict[str, dict[str, Any]]] = {}
        self.not_merged: list[dict[str, Any]] = [
            {"tensor": name.removeprefix(HEAD_PREFIX), "reason": f"only in {', '.join(labels)}"}
            for name, labels in plan.expert_only.items()
        ]
        self._mask: Optional[torch.Tensor] = None
        self.states: list[TaskState] = []
        # block index -> experts (of an experts module) that took the fallback merge
        self.experts_without_tokens: dict[int, dict[str, Any]] = {}

    # ---------------------------------------------------------------------------------
    # Entry point

    def run(self) -> MergeRecord:
        if not self.plan.options.safe_serialization:
            LOG.warning("the sequential executor always writes safetensors")
        with torch.no_grad():
            self._prepare_tasks()
            merged_pre = self._merge_pre_block()
            self._embed_tasks(merged_pre)
            del merged_pre
            progress = tqdm(
                self.plan.blocks,
                desc=f"{self.method.name}",
                unit="block",
                disable=self.plan.options.quiet,
            )
            for block in progress:
                self._merge_block(block, progress)
            if self.writes:
                self._merge_post_block()
                self._copy_unloaded()
        self._collect_task_diagnostics()
        if self.writer is not None:
            phase("writing the last checkpoint shard and the shard index")
            self.writer.finalize()
            self._write_support_files()
        method = self.plan.cfg.method
        section: dict[str, Any] = {
            "layers": self.layer_diagnostics,
            "not_merged": self.not_merged,
            **({"blocks": self.block_records} if self.refinement is not None else {}),
            **(
                {"moe": {"experts_without_tokens": self.experts_without_tokens}}
                if any(g.experts for b in self.plan.blocks for g in b.groups)
                else {}
            ),
        }
        return MergeRecord(
            method,
            sections={method: section},
            calibration={e.task: e.data.summary() for e in self.experts if e.data is not None},
            executor=self.compute.record(),
            distributed=self._distributed_record(),
        )

    def _distributed_record(self) -> Optional[dict[str, Any]]:
        """Several processes: the world, the backend and the rank that holds each task's
        statistics (with each sharing rank's batches when there are more ranks than tasks);
        None in one process."""
        if not self.dist.enabled:
            return None
        num_tasks = len(self.experts)
        record: dict[str, Any] = {
            "world_size": self.dist.world_size,
            "backend": self.dist.backend,
            "task_ranks": {
                e.task: self.dist.owner(k, num_tasks) for k, e in enumerate(self.experts)
            },
        }
        if self.dist.world_size > num_tasks:
            # ranks sharing a task: each one's [first, stop) of the task's batches
            record["task_shares"] = {
                e.task: {
                    r: list(
                        DistributedContext(self.dist.world_size, r).share(
                            k, num_tasks, len(e.data.batches) if e.data else 1
                        )
                    )
                    for r in self.dist.ranks_of(k, num_tasks)
                }
                for k, e in enumerate(self.experts)
            }
        return record

    def _collect_task_diagnostics(self) -> None:
        """Several processes: every rank's per-task group records into rank 0's records."""
        if not self.dist.enabled:
            return
        gathered = self.dist.gather_objects(self.task_diagnostics)
        if gathered is None:
            return
        order = {e.task: k for k, e in enumerate(self.experts)}
        for index, record in enumerate(self.layer_diagnostics):
            tasks: dict[str, Any] = dict(record.get("tasks") or {})
            for part in gathered:
                tasks.update(part.get(index, {}))
            if tasks:
                record["tasks"] = dict(sorted(tasks.items(), key=lambda kv: order.get(kv[0], 0)))

    # ---------------------------------------------------------------------------------
    # Tensors in and out

    def _written_dtype(self, canonical: str) -> torch.dtype:
        """The dtype a floating tensor is written in: the merge's ``dtype``, else the base's."""
        return self.plan.out_dtype or safetensors_dtype(self.base.dtypes[canonical])

    def _write(
        self,
        canonical: str,
        tensor: torch.Tensor,
        keep: Optional[torch.dtype] = None,
        write: bool = True,
    ) -> torch.Tensor:
        """Write a merged tensor; returns it as the saved model holds it (float32 on device;
        a matrix saved in ``keep`` in that dtype, as :func:`kept_dtype` holds the inputs).

        Ranks other than 0 write nothing and get the same value; ``write=False``: the value
        only (a block's linears held for its refinement, written after it).
        """
        if tensor.dtype.is_floating_point:
            saved = tensor.to(self._written_dtype(canonical))
        else:
            saved = tensor
        kept = keep is not None and saved.dtype == keep and saved.dim() >= 2
        if self.writer is None or not write:
            if saved.dtype.is_floating_point and not kept:
                return saved.to(device=self.device, dtype=torch.float32)
            return saved.to(self.device)
        stored = saved.detach().to("cpu")
        if not stored.is_contiguous() or (
            stored.untyped_storage().nbytes() != stored.numel() * stored.element_size()
        ):
            stored = stored.clone()  # a view of a larger tensor (e.g. a split q/k/v group)
        if canonical in self.base.fused:
            # fused in memory (MoE experts): written as the base checkpoint's pieces
            module_key = self.base.checkpoint_key[canonical]
            for key, piece in model_class.saved_pieces(
                self.base.skeleton, module_key, stored
            ).items():
                self.writer.save_tensor(key, piece.clone())
        else:
            self.writer.save_tensor(self.plan.output_name(canonical), stored)
        if saved.dtype.is_floating_point and not kept:
            return saved.to(device=self.device, dtype=torch.float32)
        return saved.to(self.device)

    def _share(self, canonical: str, merged: Optional[torch.Tensor], src: int = 0) -> torch.Tensor:
        """Rank ``src``'s merged (floating) tensor on every rank; itself for one process."""
        if not self.dist.enabled:
            assert merged is not None
            return merged
        shape = self.base.shapes[canonical]
        wide = safetensors_dtype(self.base.dtypes[canonical]) == torch.float64
        dtype = torch.float64 if wide else torch.float32
        return self.dist.broadcast_tensor(merged, shape, dtype, self.device, src=src)

    def _merge_other(
        self,
        canonical: str,
        base: torch.Tensor,
        experts: Sequence[torch.Tensor],
        share: bool = True,
    ) -> torch.Tensor:
        """The fallback merge of one tensor (on rank 0, broadcast when ``share``), written."""
        name = self.plan.output_name(canonical)
        if not base.dtype.is_floating_point:
            return self._write(canonical, base)  # integer buffers (position ids): the base's
        merged: Optional[torch.Tensor] = None
        if self.writes:
            merged = self.method.merge_other(name, base, list(experts), self.parameters)
            self._check_merged(name, merged, base.shape)
        if share:
            merged = self._share(canonical, merged)
        assert merged is not None
        return self._write(canonical, merged)

    def _check_inputs(
        self,
        base: dict[str, torch.Tensor],
        experts: Sequence[dict[str, torch.Tensor]],
        where: str,
    ) -> None:
        """NaN/Inf in an input fails here, naming it, not later as a non-finite statistic."""
        finite.check_loaded_finite(base, model=self.base.label, task="base", where=where)
        for e, tensors in zip(self.experts, experts):
            finite.check_loaded_finite(tensors, model=e.label, task=e.task, where=where)

    @staticmethod
    def _check_merged(name: str, merged: Any, shape: torch.Size) -> None:
        if not isinstance(merged, torch.Tensor):
            raise TensorError(f"the merge of {name} returned {type(merged).__name__}, not a tensor")
        if tuple(merged.shape) != tuple(shape):
            raise TensorError(
                f"the merge of {name} returned shape {list(merged.shape)}, expected {list(shape)}"
            )
        if not finite.is_finite(merged):
            raise TensorError(f"the merge of {name} contains NaN or Inf values")

    # ---------------------------------------------------------------------------------
    # Calibration data and embeddings

    def _prepare_tasks(self) -> None:
        self.states = []
        for k in self.owned:
            e = self.experts[k]
            assert e.data is not None, "calibration data is loaded by the plan"
            inputs, masks = [], []
            # this rank's contiguous share of the batches (all of them unless W > K)
            start, stop = self.dist.share(k, len(self.experts), len(e.data.batches))
            for batch in e.data.batches[start:stop]:
                inputs.append(
                    {k: v.to(self.device) for k, v in self.family.forward_inputs(batch).items()}
                )
                mask = self.family.token_mask(batch)
                masks.append(mask.to(self.device).bool() if mask is not None else None)
            self.states.append(TaskState(e.task, k, inputs, masks))

    def _embed(
        self, params: dict[str, torch.Tensor], state: TaskState
    ) -> tuple[list[torch.Tensor], list[list[tuple[tuple[Any, ...], dict[str, Any]]]]]:
        """Run the backbone up to its first block; the block inputs and every block's call."""
        hidden, calls = [], []
        for inputs in state.inputs:
            self.sink.reset()
            try:
                torch.func.functional_call(
                    self.backbone, params, args=(), kwargs={**inputs, **self.extra_inputs}
                )
            except StopForward:
                pass
            else:  # pragma: no cover - every supported backbone calls its blocks
                raise ExecutionError(
                    f"{type(self.backbone).__name__}.forward returned without calling its last block"
                )
            if self.sink.hidden is None or len(self.sink.calls) != len(self.blocks):
                raise ExecutionError(
                    f"{type(self.backbone).__name__}.forward called {len(self.sink.calls)} of "
                    f"{len(self.blocks)} blocks"
                )
            hidden.append(self.sink.hidden.to(torch.float32))
            calls.append(list(self.sink.calls))
        self.sink.reset()
        return hidden, calls

    def _merge_pre_block(self) -> dict[str, torch.Tensor]:
        """Merge the tensors before the first block, one at a time; returns the merged ones."""
        merged: dict[str, torch.Tensor] = {}
        for name in self.plan.pre_block:
            base = self.base.load(name, self.device)
            # Only rank 0 merges; the others receive the merged tensor.
            experts = (
                [e.source.load(name, self.device) for e in self.experts] if self.writes else []
            )
            self._check_inputs({name: base}, [{name: w} for w in experts], "the embeddings")
            merged[name] = self._merge_other(name, base, experts)
            del base, experts
            self._release()
        return merged

    def _embed_tasks(self, merged_pre: dict[str, torch.Tensor]) -> None:
        for state in self.states:
            e = self.experts[state.index]
            if self.request.propagate:
                state.merged_hidden, state.calls = self._embed(merged_pre, state)
            if self.request.expert_path:
                own = {name: e.source.load(name, self.device) for name in self.plan.pre_block}
                state.expert_hidden, calls = self._embed(own, state)
                if not state.calls:
                    state.calls = calls
                elif not same_calls(state.calls, calls):
                    state.expert_calls = calls
                del own, calls
                e.source.release()
            if not state.calls:  # neither path asked for: the block arguments are still needed
                _, state.calls = self._embed(merged_pre, state)

    # ---------------------------------------------------------------------------------
    # One block

    def _run_block(
        self,
        index: int,
        params: dict[str, torch.Tensor],
        hidden: torch.Tensor,
        call: tuple[tuple[Any, ...], dict[str, Any]],
    ) -> torch.Tensor:
        if self.compute.low_precision:
            params = self._low_params(params)
        with compute_in(self.compute.dtype, self.device):
            out = run_block(self.blocks[index], params, hidden, call)
        return carried(out)

    def _input_hook(
        self, accumulator: ActivationStatistics, stop: bool, reads: tuple[str, ...] = ()
    ):
        """A pre-hook adding the module's input rows: the non-padding tokens, or for a
        ``"table"`` call (``GroupSpec.reads``) every row of the table, once per call
        (docs/methods.md, "Relative position tables"). ``stop``: end the forward after the
        module's last call of the pass."""
        calls = [0]

        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            kind = reads[calls[0] % len(reads)] if reads else "tokens"
            calls[0] += 1
            x = multiplied_input(module, args[0]) if self.compute.rounds_inputs else args[0]
            if kind == "table":
                accumulator.update(x.reshape(-1, x.shape[-1]))
            else:
                accumulator.update(flatten_tokens(x, self._mask))
            if stop and (not reads or calls[0] % len(reads) == 0):
                raise StopForward

        return hook

    def _routed_accumulator(self, block: BlockLayout, group: GroupSpec) -> RoutedExpertStatistics:
        """Per-expert statistics of one task at an experts module (docs/methods.md,
        "Mixture-of-experts blocks")."""
        gate_up = self.base.shapes[f"{block.prefix}{group.modules[0]}.{GATE_UP}"]
        return RoutedExpertStatistics(
            int(gate_up[0]),
            int(gate_up[2]),
            int(gate_up[1]) // 2,
            dtype=self.request.statistics_dtype,
            device=self.device,
        )

    def _experts_hook(
        self,
        accumulator: RoutedExpertStatistics,
        group: GroupSpec,
        params: dict[str, torch.Tensor],
        stop: bool,
    ):
        """A pre-hook on the experts module: the routing the block's own router chose, and
        each expert's rows through its own weights (``params``: the block's tensors)."""
        own = {w: params[f"{group.modules[0]}.{w}"] for w in EXPERT_WEIGHTS}

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            accumulator.update(module, own, routed_call(args, kwargs), self._mask)
            if stop:
                raise StopForward

        return hook

    def _group_width(self, block: BlockLayout, group: GroupSpec) -> int:
        return block.group_width(group, self.base.shapes)

    def _new_accumulator(self, width: int, *, expert_path: bool) -> ActivationStatistics:
        """An accumulator for one group and task on the merged or the expert path.

        The normalized Gram only on the path the merge uses; with ``propagate`` the expert
        path is a reference, and above ``reference_gram_max_dim`` it keeps moments only.
        """
        request = self.request
        reference = expert_path and request.propagate
        full_gram = not (
            reference
            and request.reference_gram_max_dim is not None
            and width > request.reference_gram_max_dim
        )
        return ActivationStatistics(
            width,
            normalized_gram=request.normalized_gram and not reference,
            full_gram=full_gram,
            dtype=request.statistics_dtype,
            product_dtype=request.product_dtype,
            device=self.device,
            keep_rows=request.keep_rows and not reference,
        )

    def _expert_path_statistics(
        self, block: BlockLayout, expert_blocks: list[dict[str, torch.Tensor]]
    ) -> dict[str, list[TaskStatistics]]:
        """Each own task through its expert's own block, every group's input hooked at once."""
        stats: dict[str, list[Any]] = {g.label: [] for g in block.groups}
        module = self.blocks[block.index]
        for state in self.states:
            weights = expert_blocks[state.index]
            params = {name[len(block.prefix) :]: t for name, t in weights.items()}

            def make() -> dict[str, Any]:
                return {
                    g.label: self._new_accumulator(self._group_width(block, g), expert_path=True)
                    if not g.experts
                    else self._routed_accumulator(block, g)
                    for g in block.groups
                }

            shared = self._shares(state.index)
            accumulators: Optional[dict[str, Any]] = (
                {g.label: _DeferredUpdates() for g in block.groups}
                if self._waits(state.index)
                else make()
            )
            assert accumulators is not None
            handles = [
                module.get_submodule(g.modules[0]).register_forward_pre_hook(
                    self._input_hook(accumulators[g.label], stop=False, reads=g.reads)
                    if not g.experts
                    else self._experts_hook(accumulators[g.label], g, params, stop=False),
                    with_kwargs=g.experts,
                )
                for g in block.groups
            ]
            try:
                assert state.expert_hidden is not None
                outputs = []
                for b, hidden in enumerate(state.expert_hidden):
                    self._mask = state.masks[b]
                    calls = state.expert_calls or state.calls
                    outputs.append(
                        self._run_block(block.index, params, hidden, calls[b][block.index])
                    )
                state.expert_hidden = outputs
            finally:
                for h in handles:
                    h.remove()
                self._mask = None
            if shared:
                accumulators = self._chain(state.index, accumulators)
                if accumulators is None:
                    continue  # the task's statistics end on a later rank
            for g in block.groups:
                stats[g.label].append(accumulators[g.label].finalize())
                del accumulators[g.label]  # the running sums
        return stats

    def _shares(self, task: int) -> bool:
        """Whether several ranks share this task's batches (W > K)."""
        return len(self.dist.ranks_of(task, len(self.experts))) > 1

    def _waits(self, task: int) -> bool:
        """Whether this rank's updates for ``task`` wait for the accumulators of the task's
        earlier batches (a shared task, and not this rank's first share)."""
        ranks = self.dist.ranks_of(task, len(self.experts))
        return len(ranks) > 1 and ranks.index(self.dist.rank) > 0

    def _chain(self, task: int, mine: dict[str, Any]) -> Optional[dict[str, Any]]:
        """A shared task's accumulators through its ranks in batch order.

        The rank with the first share accumulates its batches as one process does (``mine``
        are the accumulators); each later rank has recorded its updates (``mine``:
        :class:`_DeferredUpdates`), adds them to the accumulators it receives and passes them
        on: the float64 sums see the updates of one process in its order (docs/methods.md,
        "More processes than tasks"). Returns them on the task's last rank (which holds the
        task's statistics), None on the others.
        """
        ranks = self.dist.ranks_of(task, len(self.experts))
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

    @property
    def _held_states(self) -> list[TaskState]:
        """The states of the tasks whose statistics end on this rank."""
        return [s for s in self.states if s.index in self.holds]

    def _merged_path_statistics(
        self,
        block: BlockLayout,
        group: GroupSpec,
        params: dict[str, torch.Tensor],
        replay: LinearOutputCache,
    ) -> list[TaskStatistics]:
        """The group's input on each task's merged path; the forward stops at the group."""
        module = self.blocks[block.index].get_submodule(group.modules[0])
        stats = []
        for t, state in enumerate(self.states):

            def make() -> dict[str, Any]:
                if group.experts:
                    return {group.label: self._routed_accumulator(block, group)}
                width = self._group_width(block, group)
                return {group.label: self._new_accumulator(width, expert_path=False)}

            shared = self._shares(state.index)
            accumulator: Any = (
                _DeferredUpdates() if self._waits(state.index) else make()[group.label]
            )
            if group.experts:
                hook = self._experts_hook(accumulator, group, params, stop=True)
                handle = module.register_forward_pre_hook(hook, with_kwargs=True)
            else:
                handle = module.register_forward_pre_hook(
                    self._input_hook(accumulator, stop=True, reads=group.reads)
                )
            try:
                assert state.merged_hidden is not None
                for b, hidden in enumerate(state.merged_hidden):
                    self._mask = state.masks[b]
                    replay.begin(t, b)
                    try:
                        self._run_block(block.index, params, hidden, state.calls[b][block.index])
                    except StopForward:
                        continue
                    raise ExecutionError(  # pragma: no cover - the group is in the block
                        f"block {block.index} ran without calling {group.modules[0]}"
                    )
            finally:
                handle.remove()
                self._mask = None
            if shared:
                chained = self._chain(state.index, {group.label: accumulator})
                if chained is None:
                    continue  # the task's statistics end on a later rank
                accumulator = chained[group.label]
            stats.append(accumulator.finalize())
        return stats

    def _merge_block(self, block: BlockLayout, progress: Any = None) -> None:
        n = len(self.plan.blocks)
        cache: dict[tuple[str, str], torch.Tensor] = {}
        # the passes read these as loaded; the methods widened (kept_dtype)
        keep = self._kept_dtype(block)
        base_block = {
            name: self.base.load(name, self.device, cache, keep) for name in block.tensors
        }
        expert_blocks = [
            {name: e.source.load(name, self.device, cache, keep) for name in self._needed(block, k)}
            for k, e in enumerate(self.experts)
        ]
        self._check_inputs(base_block, expert_blocks, f"layer {block.index}")
        local = len(block.prefix)

        # Non-linear tensors first: every later forward sees them merged ("norms included").
        merged: dict[str, torch.Tensor] = {}
        for name in block.others:
            merged[name] = self._merge_other(
                name,
                widened(base_block[name]),
                [widened(w[name]) for w in expert_blocks if name in w],
            )

        expert_stats: Optional[dict[str, list[TaskStatistics]]] = None
        if self.request.expert_path:
            if progress is not None:
                progress.set_postfix_str(f"block {block.index + 1}/{n}: expert paths")
            expert_stats = self._expert_path_statistics(block, expert_blocks)

        replay = LinearOutputCache(self.blocks[block.index], self.plan.memory.replay)
        try:
            self._merge_groups(
                block, base_block, expert_blocks, merged, expert_stats, replay, progress
            )
            if self.refinement is not None:
                if progress is not None:
                    progress.set_postfix_str(f"block {block.index + 1}/{n}: refinement")
                # the replayed outputs are the start's; the refined linears change them
                replay.close()
                self.block_records.append(
                    refine_block(self, self.refinement, block, base_block, expert_blocks, merged)
                )
            if self.request.propagate:
                params = {name[local:]: merged[name] for name in block.tensors}
                if self.refinement is None:
                    replay.cover([m for g in block.groups[:-1] for m in g.modules])
                for t, state in enumerate(self.states):
                    assert state.merged_hidden is not None
                    outputs = []
                    for b, hidden in enumerate(state.merged_hidden):
                        replay.begin(t, b)
                        outputs.append(
                            self._run_block(
                                block.index, params, hidden, state.calls[b][block.index]
                            )
                        )
                    state.merged_hidden = outputs
        finally:
            replay.close()
            self._low_params.clear()
        del base_block, expert_blocks, merged, cache
        self._release()

    def _merge_groups(
        self,
        block: BlockLayout,
        base_block: dict[str, torch.Tensor],
        expert_blocks: list[dict[str, torch.Tensor]],
        merged: dict[str, torch.Tensor],
        expert_stats: Optional[dict[str, list[TaskStatistics]]],
        replay: LinearOutputCache,
        progress: Any,
    ) -> None:
        """Merge the block's linear groups in forward order (into ``merged``, and written)."""
        n = len(self.plan.blocks)
        local = len(block.prefix)
        for index, group in enumerate(block.groups):
            if progress is not None:
                progress.set_postfix_str(f"block {block.index + 1}/{n}: {group.label}")
            merged_stats = None
            if self.request.propagate:
                params = {
                    name[local:]: merged.get(name, base_block[name]) for name in block.tensors
                }
                replay.cover([m for g in block.groups[:index] for m in g.modules])
                merged_stats = self._merged_path_statistics(block, group, params, replay)
                del params
            if group.experts:
                self._merge_experts_group(
                    block,
                    group,
                    base_block,
                    expert_blocks,
                    merged,
                    expert_stats[group.label] if expert_stats is not None else None,
                    merged_stats,
                )
                if expert_stats is not None:
                    del expert_stats[group.label]
                continue
            canonical = [block.group_weight(m) for m in group.modules]
            names = [self.plan.output_name(c) for c in canonical]
            # Conv1D weights (in x out) reach the method as out x in, and go back as stored.
            flip = {n_: m in group.transposed for n_, m in zip(names, group.modules)}
            linear_group = LinearGroup(
                name=group_name(names, group.label),
                weights=names,
                base={
                    n_: orient(widened(base_block[c]), flip[n_]) for n_, c in zip(names, canonical)
                },
                experts=[
                    {
                        n_: orient(widened(expert_blocks[s.index][c]), flip[n_])
                        for n_, c in zip(names, canonical)
                    }
                    for s in self._held_states
                ],
                task_names=[s.name for s in self._held_states],
                expert_stats=expert_stats[group.label] if expert_stats is not None else [],
                merged_stats=merged_stats,
                output_dtypes={n_: self._written_dtype(c) for n_, c in zip(names, canonical)},
                compute_dtype=self.compute.dtype,
            )
            if self.dist.enabled:
                result, group_diagnostics = self._merge_group_distributed(
                    linear_group,
                    canonical,
                    base_block,
                    expert_blocks,
                    flip,
                    # the groups take turns over the ranks that hold statistics, so that over
                    # W blocks each rank solves each group of the block once (W ≤ K)
                    solver=self.holders[(block.index + index) % len(self.holders)],
                )
            else:
                result, group_diagnostics = self.method.merge_linear_group(
                    linear_group, self.parameters
                )
                result = self._as_stored(linear_group, result, flip)
                self._check_result(linear_group, result, canonical, base_block)
            for n_, c in zip(names, canonical):
                # with a refinement the block's linears are written after it
                merged[c] = self._write(
                    c, result[n_], self._kept_dtype(block), write=self.refinement is None
                )
            record = {"layer": linear_group.name, "block": block.index, "group": group.label}
            record.update(group_diagnostics or {})
            self.layer_diagnostics.append(record)
            del linear_group, result, merged_stats
            if expert_stats is not None:
                del expert_stats[group.label]  # each group's statistics are used once
            trim_heap()

    def _merge_experts_group(
        self,
        block: BlockLayout,
        group: GroupSpec,
        base_block: dict[str, torch.Tensor],
        expert_blocks: list[dict[str, torch.Tensor]],
        merged: dict[str, torch.Tensor],
        expert_stats: Optional[list[Any]],
        merged_stats: Optional[list[Any]],
    ) -> None:
        """An experts module: each expert's ``gate_up`` and ``down`` solved with the statistics
        of the tokens routed to it; an expert some task routed no token to takes the fallback
        (counted per block in the diagnostics)."""
        gate_up, down = block.group_tensors(group)
        names = (self.plan.output_name(gate_up), self.plan.output_name(down))
        dtype = self._written_dtype(gate_up)

        def solve(parts: tuple[str, ...], path: Optional[list[Any]]) -> Any:
            tasks = list(range(len(self.experts)))
            own: list[Any] = expert_stats if expert_stats is not None else []
            if self.dist.enabled:
                # Several processes: every task's routed statistics go to rank 0, which runs
                # the one-process merge on them (the same bits) and shares the result.
                gathered = self.dist.gather_objects(
                    (
                        [s.index for s in self._held_states],
                        [_routed_on(x, "cpu") for x in own],
                        [_routed_on(x, "cpu") for x in path] if path is not None else None,
                    )
                )
                result: Optional[ExpertMergeResult] = None
                if self.writes:
                    assert gathered is not None
                    every: list[Any] = [None] * len(tasks)
                    every_path: list[Any] = [None] * len(tasks)
                    for indices, stats, paths in gathered:
                        for position, k in enumerate(indices):
                            if stats:
                                every[k] = _routed_on(stats[position], self.device)
                            if paths is not None:
                                every_path[k] = _routed_on(paths[position], self.device)
                    result = run(
                        tasks,
                        every if self.request.expert_path else [],
                        every_path if path is not None else None,
                        parts,
                    )
                shared = {
                    key: self._share(name, getattr(result, key) if result else None)
                    for key, name in (("gate_up", gate_up), ("down", down))
                }
                records, without = self.dist.broadcast_object(
                    (result.records, result.without_tokens) if result is not None else None
                )
                return ExpertMergeResult(shared["gate_up"], shared["down"], records, without)
            return run(tasks, own, path, parts)

        def run(
            tasks: list[int], own: list[Any], path: Optional[list[Any]], parts: tuple[str, ...]
        ) -> ExpertMergeResult:
            return merge_experts(
                self.method,
                self.parameters,
                {GATE_UP: base_block[gate_up], DOWN: base_block[down]},
                [{GATE_UP: expert_blocks[k][gate_up], DOWN: expert_blocks[k][down]} for k in tasks],
                [self.experts[k].task for k in tasks],
                own,
                lambda e: (f"{names[0]}.{e}", f"{names[1]}.{e}"),
                path,
                output_dtype=dtype,
                compute_dtype=self.compute.dtype,
                parts=parts,
            )

        if merged_stats is None:
            result = solve((GATE_UP, DOWN), None)
        else:
            # Chain of Merges: every expert's gate_up first; then down on the merged-path
            # rows that the merged gate_up gives (the routing is the same: the router and
            # the experts' input are merged already)
            first = solve((GATE_UP,), merged_stats)
            self._check_merged(names[0], first.gate_up, base_block[gate_up].shape)
            merged[gate_up] = self._write(gate_up, first.gate_up)
            local = len(block.prefix)
            params = {name[local:]: merged.get(name, base_block[name]) for name in block.tensors}
            replay = LinearOutputCache(self.blocks[block.index], 0)  # nothing recorded
            try:
                again = self._merged_path_statistics(block, group, params, replay)
            finally:
                replay.close()
            second = solve((DOWN,), again)
            result = ExpertMergeResult(
                first.gate_up,
                second.down,
                first.records + second.records,
                sorted(set(first.without_tokens) | set(second.without_tokens)),
            )
        for canonical, tensor in ((gate_up, result.gate_up), (down, result.down)):
            self._check_merged(
                self.plan.output_name(canonical), tensor, base_block[canonical].shape
            )
            merged[canonical] = self._write(canonical, tensor)
        for record in result.records:
            self.layer_diagnostics.append({"block": block.index, "group": group.label, **record})
        if result.without_tokens:
            LOG.warning(
                "block %d: experts %s of %s received no calibration token in some task; they "
                "take the %s fallback merge (more calibration data routes tokens to them)",
                block.index,
                result.without_tokens,
                group.modules[0],
                self.method.name,
            )
        self.experts_without_tokens[block.index] = {
            "module": group.modules[0],
            "count": len(result.without_tokens),
            "experts": result.without_tokens,
        }
        trim_heap()

    def _as_stored(
        self, group: LinearGroup, result: dict[str, torch.Tensor], flip: dict[str, bool]
    ) -> dict[str, torch.Tensor]:
        """The method's ``out x in`` results as the checkpoint stores them (Conv1D: ``in x
        out``); checks that every weight of the group came back."""
        missing = [n_ for n_ in group.weights if n_ not in result]
        if missing:
            raise TensorError(
                f"{self.method.name} returned no merged weight for {missing[0]} "
                f"(linear group {group.name})"
            )
        out = dict(result)
        for n_ in group.weights:
            if flip.get(n_) and isinstance(out[n_], torch.Tensor):
                out[n_] = out[n_].t()
        return out

    def _check_result(
        self,
        group: LinearGroup,
        result: dict[str, torch.Tensor],
        canonical: Sequence[str],
        base_block: dict[str, torch.Tensor],
    ) -> None:
        missing = [n_ for n_ in group.weights if n_ not in result]
        if missing:
            raise TensorError(
                f"{self.method.name} returned no merged weight for {missing[0]} "
                f"(linear group {group.name})"
            )
        for n_, c in zip(group.weights, canonical):
            self._check_merged(n_, result[n_], base_block[c].shape)

    def _kept_dtype(self, block: BlockLayout) -> Optional[torch.dtype]:
        return kept_dtype(self.compute, any(g.experts for g in block.groups))

    def _needed(self, block: BlockLayout, k: int) -> list[str]:
        """The tensors of expert ``k``'s block this rank loads."""
        if not self.dist.enabled or k in self.owned:
            return block.tensors
        if not self.writes:
            return []
        # Rank 0 merges the non-linear tensors; gathering, every group itself; and the
        # experts modules (every task's routed statistics are gathered to it)
        if self._gathers:
            return block.tensors
        routed = [t for g in block.groups if g.experts for t in block.group_tensors(g)]
        return [*block.others, *routed]

    def _merge_group_distributed(
        self,
        local: LinearGroup,
        canonical: Sequence[str],
        base_block: dict[str, torch.Tensor],
        expert_blocks: list[dict[str, torch.Tensor]],
        flip: dict[str, bool],
        solver: int = 0,
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """One group over several ranks; ``local`` holds this rank's tasks.

        With the method's reduction, the sums reach rank ``solver``, which solves and
        broadcasts; gathered, rank 0 merges the whole group. Returns the merged weights (on
        every rank) and, on rank 0, the group's diagnostics; the per-task ones of the
        reduction stay with the task's rank until :meth:`_collect_task_diagnostics`.
        """
        reduction = self.method.reduction(self.parameters)
        weights_along = False
        if reduction is not None:
            # The reduction may need the whole group on one rank (e.g. a span solve on every
            # task's rows): rank 0 decides from every rank's vote and all ranks follow.
            # a rank that holds no task's statistics (W > K) does not vote
            votes = self.dist.gather_objects(reduction.gather_vote(local) if self.holds else None)
            if self.dist.broadcast_object(
                reduction.needs_gather([v for v in votes if v is not None])
                if votes is not None
                else None
            ):
                reduction = None
                # rank 0 holds only its own experts' linear weights here: they travel too
                weights_along = True
        if reduction is None:
            solver = 0
        solves = self.dist.rank == solver
        result: Optional[dict[str, torch.Tensor]] = None
        diagnostics: dict[str, Any] = {}
        if reduction is not None:
            totals = self._sums_in_task_order(reduction, local, solver)
            for _ in range(reduction.rounds - 1):
                shared = self.dist.broadcast_object(
                    reduction.next_round(totals, local) if solves else None,  # type: ignore[arg-type]
                    src=solver,
                )
                if isinstance(shared, dict) and shared.get("gather"):
                    # the first round's sums decided that the whole group must meet on one
                    # rank after all (a span solve once the ridge is known): rank 0 merges it
                    reduction, weights_along, solver = None, True, 0
                    solves = self.dist.rank == solver
                    break
                start = reduction.start_round(shared, local) if self.holds else None
                totals = self._sums_in_task_order(reduction, local, solver, start)
            if reduction is not None and solves:
                assert totals is not None
                result, diagnostics = reduction.solve(totals, local)
        if reduction is None:
            payload = (
                [s.index for s in self._held_states],
                [_on(st, "cpu") for st in local.expert_stats or []],
                [_on(st, "cpu") for st in local.merged_stats] if local.merged_stats else None,
                [{n_: w.cpu() for n_, w in e.items()} for e in local.experts]
                if weights_along
                else None,
            )
            gathered = self.dist.gather_objects(payload)
            if self.writes:
                assert gathered is not None
                result, diagnostics = self.method.merge_linear_group(
                    self._whole_group(local, canonical, expert_blocks, gathered, flip),
                    self.parameters,
                )
        if solves:
            assert result is not None
            result = self._as_stored(local, result, flip)
            self._check_result(local, result, canonical, base_block)
        shared = {
            n_: self._share(c, result[n_] if result is not None else None, src=solver)
            for n_, c in zip(local.weights, canonical)
        }
        if solver != 0:
            diagnostics = self.dist.broadcast_object(diagnostics, src=solver)
            if not self.writes:
                diagnostics = {}
        if reduction is not None and self.holds:
            oriented = {n_: orient(w, flip.get(n_, False)) for n_, w in shared.items()}
            tasks = reduction.task_diagnostics(local, oriented)
            if tasks:
                self.task_diagnostics[len(self.layer_diagnostics)] = tasks
        return shared, diagnostics

    def _sums_in_task_order(
        self,
        reduction: SumReduction,
        local: LinearGroup,
        solver: int = 0,
        start: Optional[dict[str, torch.Tensor]] = None,
    ) -> Optional[dict[str, torch.Tensor]]:
        """Add every task's terms in task order: the sums travel from the rank of task k to
        that of task k+1 (then to rank ``solver``), so the floating-point additions are those
        of one process; returns the totals on rank ``solver`` (None elsewhere). ``start``:
        a later round's accumulators (:meth:`SumReduction.start_round`), else
        :meth:`SumReduction.prepare`'s."""
        if not self.holds:
            return None  # W > K: this rank's share of the statistics went on to another
        sums = reduction.prepare(local) if start is None else start
        position = {k: i for i, k in enumerate(self.holds)}
        num_tasks = len(self.experts)
        holder = self.dist.owner(0, num_tasks)
        for k in range(num_tasks):
            owner = self.dist.owner(k, num_tasks)
            if owner != holder:
                self._pass(sums, holder, owner)
                holder = owner
            if owner == self.dist.rank:
                reduction.add_task(sums, position[k])
        if holder != solver:
            self._pass(sums, holder, solver)
        return sums if self.dist.rank == solver else None

    def _pass(self, sums: dict[str, torch.Tensor], src: int, dst: int) -> None:
        if self.dist.rank == src:
            self.dist.send_tensors(sums, dst)
        elif self.dist.rank == dst:
            self.dist.recv_tensors(sums, src)

    def _whole_group(
        self,
        local: LinearGroup,
        canonical: Sequence[str],
        expert_blocks: list[dict[str, torch.Tensor]],
        gathered: list[Any],
        flip: dict[str, bool],
    ) -> LinearGroup:
        """The group of every task on rank 0, from the statistics each rank gathered to it."""
        k_all = len(self.experts)
        expert_stats: list[Optional[TaskStatistics]] = [None] * k_all
        merged_stats: list[Optional[TaskStatistics]] = [None] * k_all
        experts = [
            {
                n_: orient(widened(w[c]), flip.get(n_, False))
                for n_, c in zip(local.weights, canonical)
                if c in w
            }
            for w in expert_blocks
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

    def _release(self) -> None:
        """Close the open checkpoint shards (their mapped pages count as resident memory)."""
        self.base.release()
        for e in self.experts:
            e.source.release()
        trim_heap()

    # ---------------------------------------------------------------------------------
    # After the blocks

    def _merge_post_block(
        self, heads: Optional[dict[str, torch.Tensor]] = None
    ) -> dict[str, torch.Tensor]:
        """Final norm, pooler and heads, one tensor at a time, over the experts that share it;
        returns the merged tensors of the backbone (as written, float32), not the heads,
        which go to ``heads`` when it is given."""
        backbone: dict[str, torch.Tensor] = {}
        for name in self.plan.post_block:
            shown = self.plan.output_name(name)
            base = self.base.load(name, self.device)
            contributing, skipped, absent = [], [], []
            for e in self.experts:
                if not e.source.provides(name):
                    absent.append(e.label)
                    continue
                if tuple(e.source.shape(name)) != tuple(base.shape):
                    skipped.append(e.label)
                    continue
                contributing.append(e.source.load(name, self.device))
                finite.check_loaded_finite(
                    {shown: contributing[-1]}, model=e.label, task=e.task, where="the final layers"
                )
            finite.check_loaded_finite(
                {shown: base}, model=self.base.label, task="base", where="the final layers"
            )
            if absent:
                # A head or pooler an expert does not have: merged over the experts that do.
                LOG.info("%s: not in %s; merged without them", shown, ", ".join(absent))
            if skipped:
                self.not_merged.append(
                    {
                        "tensor": shown,
                        "reason": f"shape differs from the base model in {', '.join(skipped)}",
                    }
                )
                LOG.warning(
                    "%s: shape differs in %s; merged without them", shown, ", ".join(skipped)
                )
            if not contributing:
                LOG.warning("%s: no expert has it with the base's shape; kept from the base", shown)
                written = self._write(name, base)
            else:
                written = self._merge_other(name, base, contributing, share=False)  # rank 0 only
            if not name.startswith(HEAD_PREFIX):
                backbone[name] = written
            elif heads is not None:
                heads[name] = written
            del base, contributing, written
            self._release()
        return backbone

    def _copy_unloaded(self) -> None:
        """The base's tensors that its class does not load (old buffers), unchanged.

        They take no part in the merge (the experts may lack them: transformers 5 does not
        save them); copying keeps the output's tensors those of the base model.
        """
        for key in self.base.unloaded:
            self.writer.save_tensor(key, self.base.read_checkpoint_key(key).contiguous())
        self._release()

    def _write_support_files(self) -> None:
        """config.json (the base's, with the output dtype) and tokenizer/processor files."""
        base_folder = self.base.path
        with open(os.path.join(base_folder, "config.json"), encoding="utf-8") as fp:
            config = json.load(fp)
        if self.plan.out_dtype is not None:
            name = str(self.plan.out_dtype).replace("torch.", "")
            key = "torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"
            config[key] = name
        text = json.dumps(config, indent=2, sort_keys=True) + "\n"
        write_file(os.path.join(self.out_dir, "config.json"), text)
        files = list(TAGALONG_FILES)
        if self.plan.options.copy_tokenizer:
            files += list(TOKENIZER_FILES)
        for file_name in files:
            source = os.path.join(base_folder, file_name)
            if os.path.isfile(source):
                shutil.copy(source, os.path.join(self.out_dir, file_name))
