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

Several processes run the same walk, each given a strategy
(:mod:`mergekit_ext.executor.strategy`): which tasks, batches and tensors are its own, how
a group's statistics meet and how the merged weights reach every process. One process's
strategy is the identity of all that; the walk has no branch of its own for ranks.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional

import torch
from mergekit.io import TensorWriter
from torch import nn
from tqdm.auto import tqdm

from mergekit_ext import finite
from mergekit_ext.console import phase
from mergekit_ext.distributed import DistributedContext
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
from mergekit_ext.executor.input_hooks import InputHooks
from mergekit_ext.executor.moe import (
    DOWN,
    GATE_UP,
    ExpertMergeResult,
    merge_experts,
)
from mergekit_ext.executor.plan import (
    BlockLayout,
    MergePlan,
    output_shard_bytes,
    safetensors_dtype,
)
from mergekit_ext.executor.refine import refine_block
from mergekit_ext.executor.strategy import GroupToMerge, walk_strategy
from mergekit_ext.merge_record import MergeRecord
from mergekit_ext.methods.layerwise import LinearGroup, TaskStatistics
from mergekit_ext.models import model_class
from mergekit_ext.models.checkpoint import HEAD_PREFIX, TAGALONG_FILES
from mergekit_ext.models.families import GroupSpec
from mergekit_ext.models.model_paths import TOKENIZER_FILES
from mergekit_ext.output import write_file

LOG = logging.getLogger(__name__)


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


@dataclass
class BlockTensors:
    """One block's tensors while the walk is at it: the base's and each expert's as loaded
    (an expert's: those this process loads), and the merged ones as they are made."""

    layout: BlockLayout
    base: dict[str, torch.Tensor]
    experts: list[dict[str, torch.Tensor]]
    merged: dict[str, torch.Tensor] = field(default_factory=dict)
    # the merged vectors a refinement trains (held unwritten until it is done)
    vectors: list[str] = field(default_factory=list)

    def params(self) -> dict[str, torch.Tensor]:
        """The block's tensors by local name: the merged ones so far, else the base's."""
        local = len(self.layout.prefix)
        return {
            name[local:]: self.merged.get(name, self.base[name]) for name in self.layout.tensors
        }


class SequentialExecutor:
    """Runs one :class:`~mergekit_ext.executor.plan.MergePlan` into an output folder.

    ``distributed``: this process's place among several; the walk is the same for every
    process, the differences are its :class:`~mergekit_ext.executor.strategy.WalkStrategy`.

    Public beside :meth:`run`, for a block's refinement (executor/refine.py's
    ``RefiningExecutor``) as for the walk itself: :attr:`held_states`, :attr:`low_params`,
    :meth:`kept_dtype`, :meth:`run_block`, :meth:`embed_batch`, :meth:`written_dtype`,
    :meth:`check_merged`, :meth:`write`, and the attributes set in ``__init__``.
    """

    def __init__(
        self,
        plan: MergePlan,
        out_dir: Optional[str],
        device: torch.device,
        distributed: Optional[DistributedContext] = None,
    ) -> None:
        self.plan = plan
        # this process's tasks, batches and tensors, and how merges meet across processes
        self.strategy = walk_strategy(plan, device, distributed)
        self.dist = self.strategy.dist  # (executor/refine.py reads the ranks from it)
        self.writes = self.strategy.writes
        self.out_dir = out_dir
        self.device = device
        self.method = plan.method
        self.parameters = plan.parameters
        self.request = plan.request
        self.base = plan.base
        self.experts = plan.experts
        self.family = plan.family
        self._build_skeleton()
        self.writer: Optional[TensorWriter] = self._open_writer() if self.writes else None
        # dtype of the block passes (docs/methods.md, "Compute dtype")
        self.compute = plan.compute or ComputeChoice(torch.float32, "float32", "as set")
        # the block parameters' compute-dtype casts, kept while a block runs (cleared after)
        self.low_params = LowPrecisionParams(self.compute.dtype)
        self.layer_diagnostics: list[dict[str, Any]] = []
        # a method that refines each block after its group merges (BlockRefinement)
        self.refinement = plan.method.block_refinement(plan.parameters)
        self.block_records: list[dict[str, Any]] = []
        # the tensors before the first block that the refinement trains with that block
        # (written after it), and the merged tensors before the blocks while it needs them
        self.pre_trained: list[str] = self._pre_trained()
        self.pre_block: dict[str, torch.Tensor] = {}
        self.not_merged: list[dict[str, Any]] = [
            {"tensor": name.removeprefix(HEAD_PREFIX), "reason": f"only in {', '.join(labels)}"}
            for name, labels in plan.expert_only.items()
        ]
        # the statistics at the groups' inputs, taken by hooks during the block passes
        self.hooks = InputHooks(self.request, device, self.base.shapes, self.compute.rounds_inputs)
        self.states: list[TaskState] = []
        # block index -> experts (of an experts module) that took the fallback merge
        self.experts_without_tokens: dict[int, dict[str, Any]] = {}

    def _build_skeleton(self) -> None:
        """Our own skeleton of the base class: its block list gets the call recorders, the
        real block modules are kept aside and run with functional_call."""
        plan = self.plan
        skeleton = skeleton_on_device(plan.base.config, self.device)
        path = plan.base.backbone_path
        self.backbone = skeleton.get_submodule(path) if path else skeleton
        block_list = self.backbone.get_submodule(plan.layers_path)
        self.blocks: list[nn.Module] = list(block_list)
        self.sink = CallSink(last=len(self.blocks) - 1)
        for i in range(len(self.blocks)):
            block_list[i] = BlockCallRecorder(i, self.sink, plan.family.wrap_block_output)
        signature = inspect.signature(self.backbone.forward).parameters
        self.extra_inputs: dict[str, Any] = {"use_cache": False} if "use_cache" in signature else {}

    def _open_writer(self) -> TensorWriter:
        assert self.out_dir is not None, "rank 0 writes the output"
        options = self.plan.options
        return TensorWriter(
            self.out_dir,
            max_shard_size=output_shard_bytes(options),
            safe_serialization=True,
            use_async=options.async_write,
            max_write_threads=options.write_threads,
        )

    # ---------------------------------------------------------------------------------
    # Entry point

    def run(self) -> MergeRecord:
        if not self.plan.options.safe_serialization:
            LOG.warning("the sequential executor always writes safetensors")
        with torch.no_grad():
            self._prepare_tasks()
            merged_pre = self._merge_pre_block()
            self._embed_tasks(merged_pre)
            # a refinement that trains the tensors before the first block with it keeps them
            # (written after that block's refinement); otherwise they are done with
            self.pre_block = merged_pre if self.pre_trained else {}
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
        self.strategy.collect_task_diagnostics(self.layer_diagnostics)
        if self.writer is not None:
            phase("writing the last checkpoint shard and the shard index")
            self.writer.finalize()
            self._write_support_files()
        return self._result()

    def _result(self) -> MergeRecord:
        """What the run returns: its typed record (the method's diagnostics section, the
        calibration, the executor's compute record, the strategy's distribution)."""
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
            distributed=self.strategy.record(),
        )

    # ---------------------------------------------------------------------------------
    # Tensors in and out

    def written_dtype(self, canonical: str) -> torch.dtype:
        """The dtype a floating tensor is written in: the merge's ``dtype``, else the base's."""
        return self.plan.out_dtype or safetensors_dtype(self.base.dtypes[canonical])

    def write(
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
            saved = tensor.to(self.written_dtype(canonical))
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

    def _merge_other(
        self,
        canonical: str,
        base: torch.Tensor,
        experts: Sequence[torch.Tensor],
        share: bool = True,
        write: bool = True,
    ) -> torch.Tensor:
        """The fallback merge of one tensor (by the writer, shared when ``share``), written
        (``write=False``: the value as written only, for a refinement that writes it later)."""
        name = self.plan.output_name(canonical)
        if not base.dtype.is_floating_point:
            return self.write(canonical, base)  # integer buffers (position ids): the base's
        merged: Optional[torch.Tensor] = None
        if self.writes:
            merged = self.method.merge_other(name, base, list(experts), self.parameters)
            self.check_merged(name, merged, base.shape)
        if share:
            merged = self.strategy.share(canonical, merged)
        assert merged is not None
        return self.write(canonical, merged, write=write)

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
    def check_merged(name: str, merged: Any, shape: torch.Size) -> None:
        """Refuse a method's result for ``name`` that is no tensor, not ``shape`` or not finite."""
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
        for k in self.strategy.owned:
            e = self.experts[k]
            assert e.data is not None, "calibration data is loaded by the plan"
            inputs, masks = [], []
            # this process's contiguous share of the batches (all of them unless W > K)
            start, stop = self.strategy.batches(k, len(e.data.batches))
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
            first, call = self.embed_batch(params, inputs)
            hidden.append(first)
            calls.append(call)
        return hidden, calls

    def embed_batch(
        self, params: dict[str, torch.Tensor], inputs: dict[str, Any]
    ) -> tuple[torch.Tensor, list[tuple[tuple[Any, ...], dict[str, Any]]]]:
        """One batch up to the first block: its input (float32; differentiable in ``params``
        when grad is on, for executor/refine.py) and every block's call."""
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
        first, calls = self.sink.hidden.to(torch.float32), list(self.sink.calls)
        self.sink.reset()
        return first, calls

    def _vectors(self, block: BlockLayout, base: dict[str, torch.Tensor]) -> list[str]:
        """The block's floating vectors (biases, norm weights) the refinement trains."""
        if self.refinement is None or not self.refinement.trains_vectors:
            return []
        return [
            n
            for n in block.others
            if base[n].dim() <= 1 and base[n].dtype.is_floating_point and base[n].numel()
        ]

    def _pre_trained(self) -> list[str]:
        """The tensors before the first block that the refinement trains with that block:
        the floating ones except the token embedding table (an LM's vocabulary-sized matrix:
        optimizer state of that size is more than a block's, and most rows see no token of
        the calibration data). A ViT's patch and position embeddings and CLS token, BERT's
        position and type embeddings and their LayerNorm; nothing for a Llama."""
        if self.refinement is None or not self.refinement.trains_pre_block:
            return []
        if not self.request.propagate or not self.plan.blocks:
            return []
        get = getattr(self.backbone, "get_input_embeddings", None)
        tokens = get() if callable(get) else None
        table = {
            f"{m}.weight" if m else "weight"
            for m, module in self.backbone.named_modules()
            if isinstance(module, nn.Embedding) and module is tokens
        }
        return [
            n
            for n in self.plan.pre_block
            if n not in table and safetensors_dtype(self.base.dtypes.get(n, "")).is_floating_point
        ]

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
            # a trained tensor is written after the first block's refinement
            write = name not in self.pre_trained
            merged[name] = self._merge_other(name, base, experts, write=write)
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
    # One block: load, statistics, merge the groups, propagate, write

    def _merge_block(self, block: BlockLayout, progress: Any = None) -> None:
        """Load the block; merge its non-linear tensors; the expert paths' statistics; its
        groups merged in forward order on the merged path; the refinement; each task's merged
        path on to the next block; then the block's tensors are dropped."""
        tensors = self._load_block(block)
        # the block's vectors a refinement trains with its linears: written after it
        tensors.vectors = self._vectors(block, tensors.base)
        # Non-linear tensors first: every later forward sees them merged ("norms included").
        for name in block.others:
            tensors.merged[name] = self._merge_other(
                name,
                widened(tensors.base[name]),
                [widened(w[name]) for w in tensors.experts if name in w],
                write=name not in tensors.vectors,
            )
        expert_stats: Optional[dict[str, list[TaskStatistics]]] = None
        if self.request.expert_path:
            _show(progress, block, len(self.plan.blocks), "expert paths")
            expert_stats = self._expert_path_statistics(block, tensors.experts)
        replay = LinearOutputCache(self.blocks[block.index], self.plan.memory.replay)
        try:
            self._merge_groups(tensors, expert_stats, replay, progress)
            if self.refinement is not None:
                _show(progress, block, len(self.plan.blocks), "refinement")
                # the replayed outputs are the start's; the refined linears change them
                replay.close()
                self.block_records.append(self._refine(tensors, progress))
            if self.request.propagate:
                self._propagate(tensors, replay)
        finally:
            replay.close()
            self.low_params.clear()
        del tensors
        self._release()

    def _load_block(self, block: BlockLayout) -> BlockTensors:
        """The block's tensors of the base and of each expert (those this process needs)."""
        cache: dict[tuple[str, str], torch.Tensor] = {}
        # the passes read these as loaded; the methods widened (kept_dtype)
        keep = self.kept_dtype(block)
        base = {name: self.base.load(name, self.device, cache, keep) for name in block.tensors}
        experts = [
            {
                name: e.source.load(name, self.device, cache, keep)
                for name in self.strategy.needed(block, k)
            }
            for k, e in enumerate(self.experts)
        ]
        self._check_inputs(base, experts, f"layer {block.index}")
        return BlockTensors(block, base, experts)

    def _refine(self, tensors: BlockTensors, progress: Any = None) -> dict[str, Any]:
        """The block's merged linears refined (:mod:`~mergekit_ext.executor.refine`), written."""
        assert self.refinement is not None
        num_blocks = len(self.plan.blocks)
        # the first block trains the tensors before it too (the refinement's choice)
        pre = self.pre_trained if tensors.layout is self.plan.blocks[0] else []
        record = refine_block(
            self,
            self.refinement,
            tensors.layout,
            tensors.base,
            tensors.experts,
            tensors.merged,
            vectors=tensors.vectors,
            pre_block=self.pre_block if pre else None,
            pre_trained=pre,
            show=lambda what: _show(progress, tensors.layout, num_blocks, what),
        )
        if pre:
            # the refined embeddings give the merged path's first inputs anew
            for state in self.states:
                if state.merged_hidden is not None:
                    state.merged_hidden = [
                        self.embed_batch(self.pre_block, inputs)[0] for inputs in state.inputs
                    ]
            self.pre_block = {}
        return record

    def _propagate(self, tensors: BlockTensors, replay: LinearOutputCache) -> None:
        """Each task's merged-path hidden states through the merged block, for the next."""
        block = tensors.layout
        local = len(block.prefix)
        params = {name[local:]: tensors.merged[name] for name in block.tensors}
        if self.refinement is None:
            replay.cover([m for g in block.groups[:-1] for m in g.modules])
        for t, state in enumerate(self.states):
            assert state.merged_hidden is not None
            outputs = []
            for b, hidden in enumerate(state.merged_hidden):
                replay.begin(t, b)
                outputs.append(
                    self.run_block(block.index, params, hidden, state.calls[b][block.index])
                )
            state.merged_hidden = outputs

    @property
    def held_states(self) -> list[TaskState]:
        """The states of the tasks whose statistics end in this process."""
        return [s for s in self.states if s.index in self.strategy.holds]

    # ---------------------------------------------------------------------------------
    # Passes and statistics

    def run_block(
        self,
        index: int,
        params: dict[str, torch.Tensor],
        hidden: torch.Tensor,
        call: tuple[tuple[Any, ...], dict[str, Any]],
    ) -> torch.Tensor:
        """Block ``index`` with its tensors ``params`` (local names) on ``hidden``, as
        recorded in ``call``; run in the compute dtype, float32 out."""
        if self.compute.low_precision:
            params = self.low_params(params)
        with compute_in(self.compute.dtype, self.device):
            out = run_block(self.blocks[index], params, hidden, call)
        return carried(out)

    def _expert_path_statistics(
        self, block: BlockLayout, expert_blocks: list[dict[str, torch.Tensor]]
    ) -> dict[str, list[TaskStatistics]]:
        """Each own task through its expert's own block, every group's input hooked at once."""
        stats: dict[str, list[Any]] = {g.label: [] for g in block.groups}
        module = self.blocks[block.index]
        for state in self.states:
            weights = expert_blocks[state.index]
            params = {name[len(block.prefix) :]: t for name, t in weights.items()}
            accumulators: Optional[dict[str, Any]] = {
                g.label: self.strategy.accumulator(
                    state.index, partial(self.hooks.accumulator, block, g, expert_path=True)
                )
                for g in block.groups
            }
            assert accumulators is not None
            handles = [
                self.hooks.hook(module, g, accumulators[g.label], params, stop=False)
                for g in block.groups
            ]
            try:
                assert state.expert_hidden is not None
                outputs = []
                for b, hidden in enumerate(state.expert_hidden):
                    self.hooks.mask = state.masks[b]
                    calls = state.expert_calls or state.calls
                    outputs.append(
                        self.run_block(block.index, params, hidden, calls[b][block.index])
                    )
                state.expert_hidden = outputs
            finally:
                for h in handles:
                    h.remove()
                self.hooks.mask = None
            accumulators = self.strategy.finished(state.index, accumulators)
            if accumulators is None:
                continue  # the task's statistics end in another process
            for g in block.groups:
                stats[g.label].append(accumulators[g.label].finalize())
                del accumulators[g.label]  # the running sums
        return stats

    def _merged_path_statistics(
        self,
        block: BlockLayout,
        group: GroupSpec,
        params: dict[str, torch.Tensor],
        replay: LinearOutputCache,
    ) -> list[TaskStatistics]:
        """The group's input on each task's merged path; the forward stops at the group."""
        module = self.blocks[block.index]
        stats = []
        for t, state in enumerate(self.states):
            accumulator = self.strategy.accumulator(
                state.index, partial(self.hooks.accumulator, block, group, expert_path=False)
            )
            handle = self.hooks.hook(module, group, accumulator, params, stop=True)
            try:
                assert state.merged_hidden is not None
                for b, hidden in enumerate(state.merged_hidden):
                    self.hooks.mask = state.masks[b]
                    replay.begin(t, b)
                    try:
                        self.run_block(block.index, params, hidden, state.calls[b][block.index])
                    except StopForward:
                        continue
                    raise ExecutionError(  # pragma: no cover - the group is in the block
                        f"block {block.index} ran without calling {group.modules[0]}"
                    )
            finally:
                handle.remove()
                self.hooks.mask = None
            finished = self.strategy.finished(state.index, {group.label: accumulator})
            if finished is None:
                continue  # the task's statistics end in another process
            stats.append(finished[group.label].finalize())
        return stats

    # ---------------------------------------------------------------------------------
    # Merging the groups

    def _merge_groups(
        self,
        tensors: BlockTensors,
        expert_stats: Optional[dict[str, list[TaskStatistics]]],
        replay: LinearOutputCache,
        progress: Any,
    ) -> None:
        """Merge the block's linear groups in forward order (into ``merged``, and written)."""
        block = tensors.layout
        for index, group in enumerate(block.groups):
            _show(progress, block, len(self.plan.blocks), group.label)
            merged_stats = None
            if self.request.propagate:
                replay.cover([m for g in block.groups[:index] for m in g.modules])
                merged_stats = self._merged_path_statistics(block, group, tensors.params(), replay)
            # each group's statistics are used once
            own = expert_stats.pop(group.label) if expert_stats is not None else None
            if group.experts:
                self._merge_experts_group(tensors, group, own, merged_stats)
            else:
                self._merge_linear_group(tensors, group, index, own, merged_stats)
            del own, merged_stats
            trim_heap()

    def _merge_linear_group(
        self,
        tensors: BlockTensors,
        group: GroupSpec,
        index: int,
        expert_stats: Optional[list[TaskStatistics]],
        merged_stats: Optional[list[TaskStatistics]],
    ) -> None:
        """One linear group (the ``index``-th of its block) merged, written and recorded."""
        block = tensors.layout
        linear_group, canonical, flip = self._linear_group(
            tensors, group, expert_stats, merged_stats
        )
        job = GroupToMerge(
            linear_group,
            canonical,
            flip,
            tensors.experts,
            partial(self._as_stored, linear_group, canonical, flip, tensors.base),
            turn=block.index + index,
            record=len(self.layer_diagnostics),
        )
        result, diagnostics = self.strategy.merge_group(job)
        for n_, c in zip(linear_group.weights, canonical):
            # with a refinement the block's linears are written after it
            tensors.merged[c] = self.write(
                c, result[n_], self.kept_dtype(block), write=self.refinement is None
            )
        record = {"layer": linear_group.name, "block": block.index, "group": group.label}
        record.update(diagnostics or {})
        self.layer_diagnostics.append(record)

    def _linear_group(
        self,
        tensors: BlockTensors,
        group: GroupSpec,
        expert_stats: Optional[list[TaskStatistics]],
        merged_stats: Optional[list[TaskStatistics]],
    ) -> tuple[LinearGroup, list[str], dict[str, bool]]:
        """The method's view of a group over the tasks held here; the weights' checkpoint
        names; which are Conv1D weights (``in x out``: they reach the method as ``out x
        in``, and go back as stored)."""
        block = tensors.layout
        canonical = [block.group_weight(m) for m in group.modules]
        names = [self.plan.output_name(c) for c in canonical]
        flip = {n_: m in group.transposed for n_, m in zip(names, group.modules)}
        held = self.held_states
        linear_group = LinearGroup(
            name=group_name(names, group.label),
            weights=names,
            base={
                n_: orient(widened(tensors.base[c]), flip[n_]) for n_, c in zip(names, canonical)
            },
            experts=[
                {
                    n_: orient(widened(tensors.experts[s.index][c]), flip[n_])
                    for n_, c in zip(names, canonical)
                }
                for s in held
            ],
            task_names=[s.name for s in held],
            expert_stats=expert_stats if expert_stats is not None else [],
            merged_stats=merged_stats,
            output_dtypes={n_: self.written_dtype(c) for n_, c in zip(names, canonical)},
            compute_dtype=self.compute.dtype,
        )
        return linear_group, canonical, flip

    def _as_stored(
        self,
        group: LinearGroup,
        canonical: Sequence[str],
        flip: dict[str, bool],
        base_block: dict[str, torch.Tensor],
        result: dict[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        """The method's ``out x in`` results as the checkpoint stores them (Conv1D: ``in x
        out``), each checked: every weight of the group came back, finite, of its shape."""
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
        for n_, c in zip(group.weights, canonical):
            self.check_merged(n_, out[n_], base_block[c].shape)
        return out

    def _merge_experts_group(
        self,
        tensors: BlockTensors,
        group: GroupSpec,
        expert_stats: Optional[list[Any]],
        merged_stats: Optional[list[Any]],
    ) -> None:
        """An experts module: each expert's ``gate_up`` and ``down`` solved with the statistics
        of the tokens routed to it; an expert some task routed no token to takes the fallback
        (counted per block in the diagnostics)."""
        block, base, experts = tensors.layout, tensors.base, tensors.experts
        gate_up, down = block.group_tensors(group)
        names = (self.plan.output_name(gate_up), self.plan.output_name(down))
        dtype = self.written_dtype(gate_up)
        tasks = list(range(len(self.experts)))

        def solve(parts: tuple[str, ...], path: Optional[list[Any]]) -> ExpertMergeResult:
            def run(own: list[Any], path: Optional[list[Any]]) -> ExpertMergeResult:
                return merge_experts(
                    self.method,
                    self.parameters,
                    {GATE_UP: base[gate_up], DOWN: base[down]},
                    [{GATE_UP: experts[k][gate_up], DOWN: experts[k][down]} for k in tasks],
                    [self.experts[k].task for k in tasks],
                    own,
                    lambda e: (f"{names[0]}.{e}", f"{names[1]}.{e}"),
                    path,
                    output_dtype=dtype,
                    compute_dtype=self.compute.dtype,
                    parts=parts,
                )

            own = expert_stats if expert_stats is not None else []
            return self.strategy.merge_experts(own, path, run, (gate_up, down))

        if merged_stats is None:
            result = solve((GATE_UP, DOWN), None)
        else:
            result = self._experts_on_the_merged_path(tensors, group, solve, merged_stats)
        for canonical, tensor in ((gate_up, result.gate_up), (down, result.down)):
            self.check_merged(self.plan.output_name(canonical), tensor, base[canonical].shape)
            tensors.merged[canonical] = self.write(canonical, tensor)
        self._record_experts(block, group, result)

    def _experts_on_the_merged_path(
        self,
        tensors: BlockTensors,
        group: GroupSpec,
        solve: Callable[[tuple[str, ...], Optional[list[Any]]], ExpertMergeResult],
        merged_stats: list[Any],
    ) -> ExpertMergeResult:
        """Chain of Merges: every expert's gate_up first; then down on the merged-path rows
        that the merged gate_up gives (the routing is the same: the router and the experts'
        input are merged already)."""
        block = tensors.layout
        gate_up, _ = block.group_tensors(group)
        first = solve((GATE_UP,), merged_stats)
        self.check_merged(
            self.plan.output_name(gate_up), first.gate_up, tensors.base[gate_up].shape
        )
        tensors.merged[gate_up] = self.write(gate_up, first.gate_up)
        replay = LinearOutputCache(self.blocks[block.index], 0)  # nothing recorded
        try:
            again = self._merged_path_statistics(block, group, tensors.params(), replay)
        finally:
            replay.close()
        second = solve((DOWN,), again)
        return ExpertMergeResult(
            first.gate_up,
            second.down,
            first.records + second.records,
            sorted(set(first.without_tokens) | set(second.without_tokens)),
        )

    def _record_experts(
        self, block: BlockLayout, group: GroupSpec, result: ExpertMergeResult
    ) -> None:
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

    def kept_dtype(self, block: BlockLayout) -> Optional[torch.dtype]:
        """The dtype the block's matrices are held in as stored (:func:`kept_dtype`)."""
        return kept_dtype(self.compute, any(g.experts for g in block.groups))

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
                written = self.write(name, base)
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


def _show(progress: Any, block: BlockLayout, num_blocks: int, what: str) -> None:
    """What the block's progress bar shows it doing."""
    if progress is not None:
        progress.set_postfix_str(f"block {block.index + 1}/{num_blocks}: {what}")
