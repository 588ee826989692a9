"""The plan of a layerwise merge: every check that needs no weights, and the memory estimate.

:func:`build_plan` resolves the models (full checkpoints and PEFT LoRA adapters), finds the
family, the blocks and their linear groups, checks shapes, calibration data and tokenizers,
loads (tokenizes) the calibration data and estimates peak memory. It reads config files,
safetensors headers and calibration data only, never a weight; a model folder with only a
``config.json`` takes its shapes from its class (``model_paths.config_shapes``), so a dry
run can plan a merge before the weights are downloaded.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from mergekit.common import ModelReference, dtype_from_name
from mergekit.options import MergeOptions

from mergekit_ext.calibration.config import CalibrationSpec
from mergekit_ext.calibration.sources import (
    CalibrationData,
    check_calibration,
    check_tokenizers_match,
    load_calibration,
)
from mergekit_ext.calibration.statistics import gram_chunk_rows
from mergekit_ext.config import ExtMergeConfig, ExtModelEntry
from mergekit_ext.distributed import batch_share, task_ranks
from mergekit_ext.errors import (
    CalibrationError,
    ConfigError,
    ExecutionError,
    ModelInputError,
    ModelNotFoundError,
)
from mergekit_ext.executor.compute import ComputeChoice, kept_dtype, resolve_compute_dtype
from mergekit_ext.executor.model_output_checks import (
    check_model_output_supported,
    estimate_model_output_memory,
)
from mergekit_ext.methods.layerwise import (
    GroupToSize,
    LayerwiseMethod,
    StatisticsRequest,
)
from mergekit_ext.models.checkpoint import (
    HEAD_PREFIX,
    ModelSource,
    has_tokenizer,
    open_model,
    resolve_reference,
)
from mergekit_ext.models.families import GroupSpec, ModelFamily
from mergekit_ext.models.lora import LoraModelSource, open_lora_expert

LOG = logging.getLogger(__name__)

Source = Union[ModelSource, LoraModelSource]

# mergekit's TensorWriter holds a shard in memory until it is full; the executor writes
# shards of at most this size (or the smaller --out-shard-size) so that merged tensors reach
# the disk as the merge goes instead of the whole merged model waiting in memory.
STREAMING_SHARD_BYTES = 500_000_000
# Budget of the merged path's replayed linear outputs: REPLAY_HIDDEN_MULTIPLE times the
# merged-path hidden states of all tasks, at least REPLAY_MIN_BYTES.
REPLAY_HIDDEN_MULTIPLE = 4
REPLAY_MIN_BYTES = 256_000_000


def output_shard_bytes(options: MergeOptions) -> int:
    """The shard size the executor writes: ``--out-shard-size`` capped for streaming."""
    requested = int(options.out_shard_size or 0)
    if requested <= 0:
        return STREAMING_SHARD_BYTES
    return min(requested, STREAMING_SHARD_BYTES)


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def safetensors_dtype(name: str) -> torch.dtype:
    return _SAFETENSORS_DTYPES.get(name, torch.float32)


@dataclass
class Expert:
    """One task: its model, its calibration spec and (once loaded) its data."""

    task: str
    label: str
    source: Source
    data_path: str  # folder with the tokenizer / image processor
    calibration: CalibrationSpec
    data: Optional[CalibrationData] = None


EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")  # an experts module's fused weights


@dataclass
class BlockLayout:
    """Canonical tensor names of one block, split into linear groups and the rest."""

    index: int
    prefix: str  # canonical prefix, e.g. "layers.3."
    groups: tuple[GroupSpec, ...]
    tensors: list[str]  # every canonical name of the block (base model)

    def group_weight(self, module: str) -> str:
        return f"{self.prefix}{module}.weight"

    def group_tensors(self, group: GroupSpec) -> list[str]:
        """The canonical weights a group merges: one per linear, or an experts module's
        fused ``gate_up_proj`` and ``down_proj``."""
        if group.experts:
            return [f"{self.prefix}{m}.{w}" for m in group.modules for w in EXPERT_WEIGHTS]
        return [self.group_weight(m) for m in group.modules]

    def linear_shape(
        self, group: GroupSpec, module: str, shapes: Mapping[str, tuple[int, ...]]
    ) -> tuple[int, int]:
        """``(out, in)`` of one linear of ``group`` (a ``Conv1D`` stores ``in x out``); for
        an experts module, every expert's ``gate_up`` rows by the hidden width."""
        if group.experts:
            experts, rows, cols = shapes[f"{self.prefix}{module}.{EXPERT_WEIGHTS[0]}"]
            return (int(experts) * int(rows), int(cols))
        shape = shapes[self.group_weight(module)]
        rows, cols = int(shape[0]), int(shape[1])
        return (cols, rows) if module in group.transposed else (rows, cols)

    def group_width(self, group: GroupSpec, shapes: Mapping[str, tuple[int, ...]]) -> int:
        """The input width of a group (its linears read the same input)."""
        return self.linear_shape(group, group.modules[0], shapes)[1]

    @property
    def group_weights(self) -> set[str]:
        return {t for g in self.groups for t in self.group_tensors(g)}

    @property
    def others(self) -> list[str]:
        linear = self.group_weights
        return [t for t in self.tensors if t not in linear]


@dataclass
class MemoryEstimate:
    """Peak memory of the merge, in bytes, by component."""

    block_weights: int  # (K + 2) blocks as held: base, K experts, merged (float32 or kept)
    statistics: int  # input Grams of one block (float64)
    solver: int  # the method's float64 working copies for the widest group (estimate)
    activations: int  # hidden states of every task's calibration data, per path
    non_block: int  # largest non-block tensor phase (embeddings, heads)
    writer_buffer: int  # merged tensors held until a shard is flushed
    model_bytes: int  # one input model on disk
    replay: int = 0  # budget for replayed linear outputs on the merged path (propagate)
    reduction: int = 0  # several processes: the sums passed between ranks, or gathered statistics
    kept_matrices: int = 0  # of block_weights: one block's matrices held as stored (16-bit)
    # a block refinement (BlockRefinement, after the group merges, when their statistics and
    # the replay cache are gone): one block's linears' optimizer state and gradient sums,
    # the targets (the merged-path hidden states again) and one batch's autograd graph
    refinement: int = 0

    @property
    def peak(self) -> int:
        return (
            max(
                self.block_weights
                + max(
                    self.statistics + self.solver + self.replay + self.reduction, self.refinement
                ),
                self.non_block,
            )
            + self.activations
            + self.writer_buffer
        )


def _gb(n: int) -> str:
    """Bytes for people: GB above 0.1 GB, MB below."""
    return f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


@dataclass
class MergePlan:
    """Everything the executor needs, validated; :meth:`describe` is the ``--dry-run`` text."""

    cfg: ExtMergeConfig
    options: MergeOptions
    method: LayerwiseMethod
    parameters: Any  # the method's typed parameters (method.parameters_model), parsed once
    request: StatisticsRequest
    family: ModelFamily
    base: Source
    experts: list[Expert]
    layers_path: str
    blocks: list[BlockLayout]
    pre_block: list[str]
    post_block: list[str]
    expert_only: dict[str, list[str]]  # canonical -> labels of experts that have it
    out_dtype: Optional[torch.dtype]
    hidden_size: int
    memory: MemoryEstimate = field(default=None)  # type: ignore[assignment]
    rank_warnings: list[str] = field(default_factory=list)  # groups with tokens < inputs
    compute: Optional[ComputeChoice] = None  # dtype of the block passes (compute_dtype)

    @property
    def task_names(self) -> list[str]:
        return [e.task for e in self.experts]

    def output_name(self, canonical: str) -> str:
        return self.base.checkpoint_key[canonical]

    @property
    def weightless(self) -> list[str]:
        """Labels of the inputs planned from a ``config.json`` alone (no weights to merge)."""
        sources = [(self.base.label, self.base), *((e.label, e.source) for e in self.experts)]
        return list(dict.fromkeys(label for label, s in sources if s.weightless))

    def check_weights(self) -> None:
        """Refuse to merge a plan whose inputs have no weights (only a dry run plans them)."""
        if self.weightless:
            raise ModelNotFoundError(
                f"{', '.join(self.weightless)}: no weights (only config.json); download the "
                "*.safetensors files to merge, or plan the merge with --dry-run"
            )

    def describe(self) -> str:
        m = self.memory
        groups = self.blocks[0].groups if self.blocks else ()
        base_note = " (config.json only: no weights)" if self.base.weightless else ""
        lines = [
            f"method: {self.method.name} (layerwise, sequential executor)",
            f"family: {self.family.name} ({self.base.config.model_type}, "
            f"{(self.base.config.architectures or ['?'])[0]})",
            f"base_model: {self.base.label}{base_note}",
            f"blocks: {len(self.blocks)} ({self.layers_path}.{{i}}), "
            f"{len(groups)} linear groups per block in forward order:",
        ]
        for g in groups:
            reads = f" (each forward reads: {', '.join(g.reads)})" if g.reads else ""
            lines.append(f"  - {g.label}: {', '.join(g.modules)}{reads}")
        lines.append(
            f"statistics: expert path {'yes' if self.request.expert_path else 'no'}, "
            f"merged path (propagate) {'yes' if self.request.propagate else 'no'}, "
            f"normalized Gram {'yes' if self.request.normalized_gram else 'no'}"
        )
        lines.append(f"tasks ({len(self.experts)}):")
        for e in self.experts:
            kind = "LoRA adapter" if isinstance(e.source, LoraModelSource) else "full checkpoint"
            if e.source.weightless:
                kind += ", config.json only: no weights"
            summary = e.data.summary() if e.data is not None else {}
            lines.append(
                f"  - {e.task}: {e.label} ({kind}); calibration {summary.get('source', e.calibration.describe())}: "
                f"{summary.get('samples', '?')} samples, {summary.get('tokens', '?')} tokens"
            )
            if e.data is not None:
                lines.append(f"    {e.data.preview_line()}")
        lines.append(
            f"non-block tensors: {len(self.pre_block)} before the blocks, {len(self.post_block)} after"
            f" (fallback merge); expert-only tensors not merged: {len(self.expert_only)}"
        )
        if self.base.unloaded:
            lines.append(
                f"tensors {type(self.base.skeleton).__name__} does not load (copied from the "
                f"base model): {', '.join(self.base.unloaded)}"
            )
        if self.compute is not None and self.request.model_output is None:
            lines.append(self.compute.describe())
        lines.append(
            f"output dtype: {str(self.out_dtype).replace('torch.', '') if self.out_dtype else 'as the base model'}"
        )
        lines += [f"warning: {w}" for w in self.rank_warnings]
        if self.weightless:
            lines.append(
                f"shapes from config.json (no weights) for {len(self.weightless)} model(s): "
                "dry run only; download the *.safetensors files to merge"
            )
        if self.request.model_output is not None:
            out = self.request.model_output
            lines += [
                f"objective: model output (whole model in memory, one linear at a time; "
                f"{out.sketch_rows or 'every'} output projections per sample, tokens "
                f"{out.tokens})",
                "memory estimate (whole-model path): "
                + estimate_model_output_memory(self).describe(),
            ]
            return "\n".join(lines)
        lines += [
            f"memory estimate: peak ≈ {m.peak} bytes ({_gb(m.peak)}) on top of the Python "
            f"process itself (torch, transformers: ~0.4 GB); one model ≈ {_gb(m.model_bytes)}",
            f"  block weights ({len(self.experts) + 2} blocks, "
            + (
                f"matrices in {self.compute.name} as stored, widened to float32 one group at a time"
                if m.kept_matrices and self.compute is not None
                else "float32"
                + (
                    f", and cast to {self.compute.name} for the passes"
                    if self.compute is not None and self.compute.low_precision
                    else ""
                )
            )
            + f"): {_gb(m.block_weights)}",
            f"  input statistics of one block "
            f"({str(self.request.statistics_dtype).replace('torch.', '')}): {_gb(m.statistics)}",
            f"  method's solve for the widest group (float64, estimate): {_gb(m.solver)}",
            f"  calibration hidden states: {_gb(m.activations)}",
            f"  replayed linear outputs on the merged path (budget): {_gb(m.replay)}",
            *(
                [
                    "  block refinement (after the group merges, instead of their statistics: "
                    "optimizer state, targets, one batch's autograd graph): "
                    f"{_gb(m.refinement)}"
                ]
                if m.refinement
                else []
            ),
            f"  largest non-block phase: {_gb(m.non_block)}",
            f"  output shard buffer: {_gb(m.writer_buffer)} (shards of at most "
            f"{_gb(output_shard_bytes(self.options))})",
        ]
        return "\n".join(lines)

    def describe_ranks(self, world_size: int) -> str:
        """The per-rank memory plan of a merge on ``world_size`` processes (``--dry-run``)."""
        gathers = self.method.reduction(self.parameters) is None
        k_all = len(self.experts)
        layout = task_ranks(world_size, k_all)
        if world_size > k_all:
            return self._describe_shares(world_size, layout, gathers)
        lines = [
            f"processes: {world_size}; rank r owns the tasks k mod {world_size} = r; "
            + (
                "every task's statistics are gathered to rank 0, which merges each group"
                if gathers
                else "the sums of each group pass from rank to rank in task order; the groups' "
                "solves take turns over the ranks (a span solve on every task's rows: rank 0)"
            )
        ]
        for rank in range(world_size):
            m = estimate_memory(self, world_size, rank)
            own = [e.task for k, e in enumerate(self.experts) if k % world_size == rank]
            lines += [
                f"  rank {rank} (tasks {', '.join(own) or 'none'}): peak ≈ {_gb(m.peak)}",
                f"    block weights {_gb(m.block_weights)}, statistics {_gb(m.statistics)}, "
                f"replay cache {_gb(m.replay)}, reduction buffers {_gb(m.reduction)}, "
                + (f"block refinement {_gb(m.refinement)}, " if m.refinement else "")
                + f"solve {_gb(m.solver)}, hidden states {_gb(m.activations)}, "
                f"non-block phase {_gb(m.non_block)}, shard buffer {_gb(m.writer_buffer)}",
            ]
        return "\n".join(lines)

    def _describe_shares(self, world_size: int, layout: list[list[int]], gathers: bool) -> str:
        """W > K: each task's batches split over a contiguous group of ranks."""
        lines = [
            f"processes: {world_size} for {len(self.experts)} tasks; each task's batches are "
            "split in contiguous shares over a group of ranks, whose partial sums pass from "
            "rank to rank in batch order (the one process's sums) to the task's last rank; "
            + (
                "every task's statistics are then gathered to rank 0, which merges each group"
                if gathers
                else "the sums of each group then pass in task order between those ranks, "
                "which take turns at the solves"
            )
        ]
        for rank in range(world_size):
            m = estimate_memory(self, world_size, rank)
            k = next(i for i, ranks in enumerate(layout) if rank in ranks)
            data = self.experts[k].data
            batches = len(data.batches) if data is not None else 0
            start, stop = batch_share(layout[k].index(rank), len(layout[k]), batches)
            holds = ", holds its statistics" if layout[k][-1] == rank else ""
            lines += [
                f"  rank {rank} ({self.experts[k].task} batches {start}-{stop - 1} of "
                f"{batches}{holds}): peak ≈ {_gb(m.peak)}",
                f"    block weights {_gb(m.block_weights)}, statistics {_gb(m.statistics)}, "
                f"replay cache {_gb(m.replay)}, reduction buffers {_gb(m.reduction)}, "
                + (f"block refinement {_gb(m.refinement)}, " if m.refinement else "")
                + f"solve {_gb(m.solver)}, hidden states {_gb(m.activations)}, "
                f"non-block phase {_gb(m.non_block)}, shard buffer {_gb(m.writer_buffer)}",
            ]
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# Resolution of the models


class OpenedModels:
    """Opened checkpoints by folder, so LoRA experts on the same base share one index."""

    def __init__(self, cache_dir: Optional[str]) -> None:
        self.cache_dir = cache_dir
        self.full: dict[str, ModelSource] = {}

    def full_model(
        self, label: str, folder: str, family: Optional[ModelFamily], what: str
    ) -> ModelSource:
        key = os.path.realpath(folder)
        if key not in self.full:
            self.full[key] = open_model(label, folder, family, what=what)
        return self.full[key]

    def reference(
        self, ref: ModelReference, label: str, family: Optional[ModelFamily], what: str
    ) -> tuple[Source, str]:
        """The source for a mergekit reference and the folder holding its tokenizer/processor."""
        resolved = resolve_reference(ref, what, self.cache_dir)
        if resolved.adapter is None:
            return self.full_model(label, resolved.folder, family, what), resolved.folder
        base = self.full_model(resolved.label, resolved.folder, family, what)
        source = open_lora_expert(label, resolved.adapter, base, what=what)
        return source, resolved.processing_folder


def expert_entries(cfg: ExtMergeConfig) -> list[tuple[ExtModelEntry, ModelReference]]:
    mk_models = cfg.merge.models or []
    if len(mk_models) != len(cfg.models):
        raise ConfigError(
            "the layerwise executor needs a `models:` list (slices/modules are not supported)"
        )
    base = cfg.merge.base_model
    out = []
    for entry, mk in zip(cfg.models, mk_models):
        if base is not None and mk.model == base:
            LOG.info("%s is the base model; it is not an expert of the merge", entry.model)
            continue
        out.append((entry, mk.model))
    return out


def _calibration_spec(cfg: ExtMergeConfig, entry: ExtModelEntry) -> CalibrationSpec:
    spec = cfg.calibration_for(entry)
    assert spec is not None and spec.has_data  # ExtMergeConfig.check_data_aware
    return spec


# ------------------------------------------------------------------------------------------
# The plan


def build_plan(
    cfg: ExtMergeConfig,
    options: MergeOptions,
    method: LayerwiseMethod,
    parameters: dict[str, Any],
    *,
    load_data: bool = True,
) -> MergePlan:
    """Validate the merge and plan it (see the module docstring)."""
    if not isinstance(method, LayerwiseMethod):
        raise ExecutionError(
            f"{getattr(method, 'name', method)!r} is not a layerwise method; the sequential "
            "executor runs LayerwiseMethod implementations"
        )
    cfg.check_data_aware(method.name)
    parameters = method.parse(parameters)
    request = method.statistics_request(parameters)
    cache_dir = options.transformers_cache
    opened = OpenedModels(cache_dir)

    base_label = str(cfg.merge.base_model)
    base, base_data_path = opened.reference(
        cfg.merge.base_model, base_label, None, f"base model {base_label}"
    )
    family = base.family
    if request.model_output is not None:
        check_model_output_supported(family, method.name, request.model_output)
    entries = expert_entries(cfg)
    if not entries:
        raise ConfigError(f"{method.name} needs at least one expert model besides the base model")

    experts: list[Expert] = []
    for entry, ref in entries:
        what = f"model {entry.model}"
        spec = _calibration_spec(cfg, entry)
        source, data_path = opened.reference(ref, entry.model, family, what)
        check_calibration(spec, task=entry.name, modality=family.modality)
        experts.append(Expert(entry.name, entry.model, source, data_path, spec))

    if family.modality == "text":
        _check_vocabularies([base_data_path, *(e.data_path for e in experts)])

    # Blocks and groups, from the base model's own class.
    backbone = base.backbone
    layers_path = family.layers_path(backbone)
    layers = backbone.get_submodule(layers_path)
    groups = family.groups(layers[0])
    names = base.names()
    blocks: list[BlockLayout] = []
    in_blocks: set[str] = set()
    for i, layer in enumerate(layers):
        prefix = f"{layers_path}.{i}."
        tensors = [n for n in names if n.startswith(prefix)]
        expected = {prefix + p for p, _ in layer.named_parameters()}
        missing = sorted(expected - set(tensors))
        if missing:
            raise ModelInputError(
                f"base model {base.label}: block {i} lacks tensor(s) {missing[:3]} that "
                f"{type(layer).__name__} needs"
            )
        blocks.append(BlockLayout(i, prefix, family.groups(layer), tensors))
        in_blocks.update(tensors)
    pre_block = [n for n in names if n not in in_blocks and family.is_pre_block(n)]
    post_block = [n for n in names if n not in in_blocks and n not in pre_block]
    if any(n.startswith(HEAD_PREFIX + "text_model.") for n in post_block):
        LOG.warning(
            "%s: the text tower of this CLIP model is merged with the fallback (%s); only the "
            "vision tower is merged with calibration data",
            base.label,
            getattr(parameters, "fallback", "mean"),
        )

    expert_only = _check_expert_shapes(base, experts, in_blocks | set(pre_block))

    out_dtype_name = cfg.merge.out_dtype or cfg.merge.dtype
    try:
        out_dtype = dtype_from_name(out_dtype_name) if out_dtype_name else None
    except RuntimeError as e:
        raise ConfigError(f"dtype {out_dtype_name!r}: {e}") from e

    hidden = blocks[0].group_width(groups[0], base.shapes) if blocks else 0

    plan = MergePlan(
        cfg=cfg,
        options=options,
        method=method,
        parameters=parameters,
        request=request,
        family=family,
        base=base,
        experts=experts,
        layers_path=layers_path,
        blocks=blocks,
        pre_block=pre_block,
        post_block=post_block,
        expert_only=expert_only,
        out_dtype=out_dtype,
        hidden_size=hidden,
    )
    plan.compute = resolve_compute_dtype(
        request.compute_dtype, _linear_dtypes(plan), _device_type(options.device)
    )
    if load_data:
        for e in experts:
            e.data = load_calibration(
                e.calibration,
                e.data_path,
                task=e.task,
                modality=family.modality,
                trust_remote_code=options.trust_remote_code,
            )
            if not e.data.batches:
                raise CalibrationError(f"model {e.label} (task {e.task!r}): no calibration batches")
    plan.rank_warnings = method_warnings(plan)
    for warning in plan.rank_warnings:
        LOG.warning("%s", warning)
    plan.memory = estimate_memory(plan)
    return plan


def _check_vocabularies(folders: list[str]) -> None:
    """Every model that ships a tokenizer must share one vocabulary (models without one can
    only use pre-tokenized calibration data, which load_calibration checks)."""
    paths = [p for p in folders if has_tokenizer(p)]
    if len(paths) > 1:
        check_tokenizers_match(paths)


def _check_expert_shapes(
    base: Source, experts: list[Expert], needed: set[str]
) -> dict[str, list[str]]:
    """Refuse an expert that lacks, or has another shape of, a base tensor the forward pass
    needs (``needed``: the blocks and the embeddings); heads may differ. Returns the tensors
    only some experts have (canonical name -> their labels), which are not merged."""
    names = base.names()
    # Shapes: every backbone tensor of the base must exist with the same shape in each
    # expert where the forward pass needs it (blocks, embeddings); heads may differ. Tensors
    # a class does not load (old buffers) are no part of any source's names.
    expert_only: dict[str, list[str]] = {}
    for e in experts:
        for name in names:
            shape = base.shapes[name]
            if not e.source.provides(name):
                if name in needed:
                    raise ModelInputError(
                        f"tensor {base.checkpoint_key[name]} of the base model is missing from "
                        f"{e.label}, whose class {type(e.source.skeleton).__name__} loads it; "
                        "the data-aware merge runs every block and embedding of each expert: "
                        "give the expert's complete checkpoint"
                    )
                continue
            other = tuple(e.source.shape(name))
            if other != tuple(shape) and not name.startswith(HEAD_PREFIX):
                raise ModelInputError(
                    f"shape mismatch for tensor {base.checkpoint_key[name]}: {list(shape)} in the base "
                    f"model {base.label} but {list(other)} in {e.label}; the experts must share "
                    "the base model's architecture"
                )
        for name in e.source.names():
            if not base.has(name):
                expert_only.setdefault(name, []).append(e.label)
    for name, labels in expert_only.items():
        LOG.warning(
            "tensor %s exists only in %s: not merged",
            name.removeprefix(HEAD_PREFIX),
            ", ".join(labels),
        )
    return expert_only


def _device_type(device: Optional[str]) -> str:
    """``cpu`` or ``cuda`` from ``--device`` (``auto``: CUDA when available)."""
    name = (device or "cpu").strip()
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if name.startswith("cuda") else "cpu"


def _linear_dtypes(plan: MergePlan) -> set[torch.dtype]:
    """The stored dtypes of the block linears of the base and of every expert."""
    names = {b.group_weight(m) for b in plan.blocks for g in b.groups for m in g.modules}
    stored = set()
    for source in (plan.base, *(e.source for e in plan.experts)):
        dtypes = getattr(source, "dtypes", None) or {}
        stored |= {safetensors_dtype(dtypes[n]) for n in names if n in dtypes}
    return stored


def calibration_tokens(plan: MergePlan) -> Optional[int]:
    """Calibration tokens (or patches) of all tasks together; None before the data is loaded."""
    if any(e.data is None for e in plan.experts):
        return None
    return sum(int(e.data.num_tokens) for e in plan.experts)  # type: ignore[union-attr]


def method_warnings(plan: MergePlan) -> list[str]:
    """What the method warns about this merge's data (:meth:`LayerwiseMethod.plan_warnings`,
    for the first block's groups: a least-squares method, one line per group whose summed
    Gram is rank-deficient by count)."""
    if not plan.blocks:
        return []
    block = plan.blocks[0]
    return plan.method.plan_warnings(
        plan.parameters, [_group_to_size(plan, block, g) for g in block.groups]
    )


def _group_to_size(
    plan: MergePlan, block: BlockLayout, group: GroupSpec, several: bool = False
) -> GroupToSize:
    """What the method sees of a group when the plan asks it (shapes and token counts)."""
    request = plan.request
    tokens = calibration_tokens(plan)
    return GroupToSize(
        label=group.label,
        width=block.group_width(group, plan.base.shapes),
        out=sum(block.linear_shape(group, m, plan.base.shapes)[0] for m in group.modules),
        task_tokens=(
            None if tokens is None else tuple(int(e.data.num_tokens) for e in plan.experts)  # type: ignore[union-attr]
        ),
        keep_rows=request.keep_rows,
        rows_kept=request.keep_rows and request.statistics_dtype == torch.float64,
        normalized_gram=request.normalized_gram,
        low_precision=plan.compute is not None and plan.compute.low_precision,
        several=several,
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def estimate_memory(plan: MergePlan, world_size: int = 1, rank: int = 0) -> MemoryEstimate:
    """Bytes held at the peak of the merge (float32 weights, statistics in their dtype).

    With ``world_size`` > 1, those of process ``rank``, which holds its own tasks
    ``k mod world_size = rank`` (rank 0 also the other experts' tensors it merges); with
    more processes than tasks, its share of one task's batches, the partial sums passing
    through it and, on the task's last rank, the task's statistics.
    """
    base = plan.base
    k_all = len(plan.experts)
    layout = task_ranks(world_size, k_all)
    runs = [i for i in range(k_all) if rank in layout[i]]  # passes run here
    own = [i for i in range(k_all) if layout[i][-1] == rank]  # statistics end here
    k = len(own)
    k_run = len(runs)
    shares = {
        i: batch_share(
            layout[i].index(rank),
            len(layout[i]),
            len(plan.experts[i].data.batches) if plan.experts[i].data is not None else 0,
        )
        for i in runs
    }
    shared = world_size > k_all
    # a shared task: this rank's rows until the partial sums arrive (every group's on the
    # expert path, one group's on the merged path)
    expert_deferred = merged_deferred = 0
    several = world_size > 1
    gathers = several and plan.method.reduction(plan.parameters) is None
    # A block's matrices stored in the compute dtype of a low-precision pass are held in it
    # (executor.compute.kept_dtype), the rest in float32 and, for the passes, also cast.
    # From the base's dtypes: `auto` takes bfloat16 only where every checkpoint stores it.

    def keep_of(b: BlockLayout) -> Optional[torch.dtype]:
        if plan.compute is None:
            return None
        return kept_dtype(plan.compute, any(g.experts for g in b.groups))

    def held(b: BlockLayout) -> tuple[int, int, int]:
        """Bytes of one model's block as held, of its kept matrices, of the passes' casts."""
        keep = keep_of(b)
        total = kept = cast = 0
        for t in b.tensors:
            n, matrix, stored = _numel(base.shapes[t]), len(base.shapes[t]) >= 2, base.dtypes.get(t)
            if keep is not None and matrix and stored and safetensors_dtype(stored) == keep:
                kept += n * keep.itemsize
            else:
                total += n * 4
                cast += n * 2 if matrix else 0
        return total + kept, kept, cast

    sizes = [held(b) for b in plan.blocks]
    block_bytes, kept_bytes, cast_bytes = (max((h[i] for h in sizes), default=0) for i in range(3))
    # what rank 0 loads of another rank's expert: norms and biases, and experts modules
    others_bytes = max(
        (
            sum(
                _numel(base.shapes[t])
                for t in [
                    *b.others,
                    *(t for g in b.groups if g.experts for t in b.group_tensors(g)),
                ]
            )
            * 4
            for b in plan.blocks
        ),
        default=0,
    )
    request = plan.request
    itemsize = request.statistics_dtype.itemsize
    paths = int(request.expert_path) + int(request.propagate)
    method, parameters = plan.method, plan.parameters  # the solve's part is the method's
    grams_per_task = 0  # expert path: every group's statistics at once
    group_peak = (0, 0)  # (merged-path statistics, solve) of the group where their sum peaks
    largest_gram = 0  # several processes, gathered: one group's statistics of one task
    largest_sums = 0  # several processes: numerator + system of the widest group (float64)
    gathered_span = 0  # several processes, rank 0: the other tasks' rows and weights of a group
    # one block of each distinct layout (DeepSeek-V3: dense blocks, then MoE blocks)
    layouts: dict[Any, BlockLayout] = {}
    for b in plan.blocks:
        key = (
            b.groups,
            tuple(base.shapes[t] for g in b.groups for t in b.group_tensors(g)),
        )
        layouts.setdefault(key, b)
    for b in layouts.values():
        block_grams = 0  # expert path, one task: every group's statistics of this block
        for g in b.groups:
            if g.experts:
                # per expert and task: the gate_up input Gram (H x H) and the down input
                # Gram (I x I), routed statistics (never rows, no normalized Gram)
                experts_n, rows, width = (int(d) for d in base.shapes[b.group_tensors(g)[0]])
                inner = rows // 2
                per_task = experts_n * (width * width + inner * inner) * itemsize
                block_grams += per_task
                largest_gram = max(largest_gram, per_task)
                linears = ((width, 2 * inner), (inner, width))  # (in, out) of each expert's
                largest_sums = max(largest_sums, *((o * w + w * w + w + 1) * 8 for w, o in linears))
                merged_stats = k_run * per_task if request.propagate else 0
                sizes = [GroupToSize(g.label, w, o, several=several) for w, o in linears]
                if several and gathers:
                    solve = (
                        max(method.solve_bytes(parameters, s, k_all, gathered=True) for s in sizes)
                        if rank == 0
                        else 0
                    )
                else:
                    solve = max(method.solve_bytes(parameters, s, k) for s in sizes)
                if merged_stats + solve > sum(group_peak):
                    group_peak = (merged_stats, solve)
                continue
            size = _group_to_size(plan, b, g, several)
            width, out = size.width, size.out
            largest_sums = max(largest_sums, (out * width + width * width + width + 1) * 8)
            gram = width * width * itemsize
            normalized = gram if request.normalized_gram else 0
            largest_gram = max(largest_gram, gram + normalized)
            # A task with fewer tokens than the group's inputs keeps its rows (float32)
            # instead of the Gram (ActivationStatistics(keep_rows=True)); the span solve
            # applies when all tasks together have fewer.
            # the accumulators of the tasks run here (a shared task's pass through this rank)
            per_task = [
                int(plan.experts[i].data.num_tokens)
                for i in runs
                if plan.experts[i].data is not None
            ]
            if shared:  # the ranks after a task's first share record their inputs
                for i in (i for i in runs if layout[i].index(rank) > 0):
                    data = plan.experts[i].data
                    if data is not None and data.batches:
                        start, stop = shares[i]
                        part = int(data.num_tokens) * (stop - start) // len(data.batches)
                        rows = part * width * 4
                        expert_deferred += rows if request.expert_path else 0
                        merged_deferred = max(merged_deferred, rows if request.propagate else 0)
            keeps = size.rows_kept
            # an accumulator holding a Gram also holds the float32 rows of a chunk not yet
            # added (calibration.statistics.gram_chunk_rows: at most an eighth of the Gram)
            pending = gram_chunk_rows(width) * width * 4
            if keeps and per_task:
                raw = sum(n * width * 4 if n < width else gram + pending for n in per_task)
            else:
                raw = k_run * (gram + pending)
            # whether the method solves in the tokens' span: several processes then gather
            # the group on rank 0 (every task's rows and linear weights)
            span = method.solve_in_span(parameters, size)
            merged_stats = raw + k_run * normalized if request.propagate else 0
            if request.propagate:  # the expert path is a reference: no normalized Gram
                limit = request.reference_gram_max_dim
                block_grams += gram + pending if limit is None or width <= limit else width * 16
            else:
                block_grams += (raw // k_run if k_run else 0) + normalized
            # tasks run here that hand their rows, not a Gram (the method may form it)
            row_tasks = sum(1 for n in per_task if n < width) if keeps else 0
            # kept matrices: the group's base and expert weights widened to float32 for it
            widen = out * width * 4 if keep_of(b) is not None else 0
            if several and (gathers or span.now or span.after_gather):
                # gathered: rank 0 merges the whole group (a span group: every task's rows
                # and linear weights)
                solve = (
                    method.solve_bytes(parameters, size, k_all, span=span, gathered=True)
                    + (k_all + 1) * widen
                    if rank == 0
                    else 0
                )
                if (span.now or span.after_gather) and rank == 0:
                    others = [
                        int(e.data.num_tokens)
                        for i, e in enumerate(plan.experts)
                        if i not in own and e.data is not None
                    ]
                    gathered_span = max(
                        gathered_span, sum(n * width * 4 + out * width * 4 for n in others)
                    )
            else:
                # one process, or the reduction: each rank holds its own tasks' products, and
                # the groups' solves take turns over the ranks (any rank solves any group)
                solve = (
                    (
                        method.solve_bytes(parameters, size, k, span=span, row_tasks=row_tasks)
                        + (k + 1) * widen
                    )
                    if k
                    else 0
                )
            if merged_stats + solve > sum(group_peak):
                group_peak = (merged_stats, solve)
        grams_per_task = max(grams_per_task, block_grams)
    statistics = (k_run * grams_per_task if request.expert_path else 0) + group_peak[0]
    statistics += max(expert_deferred, merged_deferred)
    activations = 0
    largest_batch = 0  # positions of this rank's largest calibration batch
    for i in runs:
        e = plan.experts[i]
        if e.data is None:
            continue
        start, stop = shares[i]
        for batch in e.data.batches[start:stop]:
            if "input_ids" in batch:
                positions = int(batch["input_ids"].numel())
            else:
                pv = batch["pixel_values"]
                positions = int(pv.shape[0]) * (
                    int(e.data.num_tokens / max(e.data.num_samples, 1)) + 1
                )
            activations += positions * plan.hidden_size * 4 * max(paths, 1)
            largest_batch = max(largest_batch, positions)
    non_block_names = plan.pre_block + plan.post_block
    largest = max((_numel(base.shapes[n]) for n in non_block_names), default=0) * 4
    pre_bytes = sum(_numel(base.shapes[n]) for n in plan.pre_block) * 4
    # Rank 0 merges the non-block tensors from every expert; the others hold their own.
    loaded = k_all if rank == 0 else k_run
    non_block = (loaded + 2) * largest + 2 * pre_bytes
    # The checkpoint pages each load maps stay resident until the shards are released after
    # the tensor: the base's and each loaded expert's, in the stored dtype (a 128k-vocabulary
    # Llama-3-8B head: 1.05 GB per model; without them the estimate was 3.0 GB under the
    # measured peak of a one-block Llama-3-8B-shaped merge).
    largest_stored = max(
        (
            _numel(base.shapes[n]) * safetensors_dtype(base.dtypes[n]).itemsize
            for n in non_block_names
            if n in base.dtypes
        ),
        default=0,
    )
    non_block += (loaded + 1) * largest_stored
    model_bytes = 0
    out_bytes = 0
    for name, shape in base.shapes.items():
        size = _numel(shape)
        model_bytes += size * safetensors_dtype(base.dtypes[name]).itemsize
        out_dtype = plan.out_dtype or safetensors_dtype(base.dtypes[name])
        out_bytes += size * out_dtype.itemsize
    writer = min(out_bytes, output_shard_bytes(plan.options)) if rank == 0 else 0
    # Replayed linear outputs (executor.blocks.LinearOutputCache): up to four times the merged
    # path's hidden states (a Llama block's q, k, v and o outputs), at least 256 MB.
    replay = 0
    if request.propagate:
        merged_hidden = activations // paths
        replay = max(REPLAY_MIN_BYTES, REPLAY_HIDDEN_MULTIPLE * merged_hidden)
    refinement = 0
    refine = plan.method.block_refinement(plan.parameters)
    if refine is not None and k_run:
        # the refined linears of each block (experts modules are not refined), as stored
        linears = [
            [plan.base.shapes[t] for g in b.groups if not g.experts for t in b.group_tensors(g)]
            for b in plan.blocks
        ]
        refinement = refine.memory_bytes(linears, activations // max(paths, 1), largest_batch)
    block_weights = (k_run + 2) * block_bytes
    if plan.compute is not None and plan.compute.low_precision:
        # each float32 block matrix a pass reads is also held cast to the compute dtype
        block_weights += (k_run + 2) * cast_bytes
    reduction = 0
    if several:
        if rank == 0:
            # gathering: every expert's block and the other ranks' statistics of one group
            block_weights += (k_all - k_run) * (block_bytes if gathers else others_bytes)
        if gathers:  # rank 0 receives the other ranks' statistics of one group
            reduction = (k_all - k) * largest_gram if rank == 0 else 0
        else:  # every rank holds the sums passed along (or rank 0 a gathered span group)
            reduction = max(largest_sums, gathered_span) if k else 0
    return MemoryEstimate(
        block_weights=block_weights,
        statistics=statistics,
        solver=group_peak[1],
        activations=activations,
        non_block=non_block,
        writer_buffer=writer,
        model_bytes=model_bytes,
        replay=replay,
        kept_matrices=kept_bytes,
        reduction=reduction,
        refinement=refinement,
    )
