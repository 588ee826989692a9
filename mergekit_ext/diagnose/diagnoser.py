"""``mergekit-ext diagnose``: how far merged models are from each expert, block by block.

For every task of a merge YAML (each entry of ``models:`` but the base model, with its
calibration data), the task's evaluation batches run through the expert and through each
merged model side by side, one block at a time, exactly as the sequential executor walks a
network (:mod:`mergekit_ext.executor.sequential`: the models' own transformers classes on
the meta device, the embeddings through the backbone's own ``forward``, each block through
``torch.func.functional_call`` with only that block's tensors). Per block it records the
relative error of the block output on the non-padding positions

    e_l = ‖H_merged,l − H_expert,l‖_F / ‖H_expert,l‖_F ,

and at the output, for models with a head:

- classifiers (sequence / image classification, token heads): argmax agreement with the
  expert and the mean ``KL(p_expert ‖ p_merged)`` over samples (positions for token heads);
- causal LMs: next-token top-1 agreement and the mean KL over every non-padding position,
  with the logits formed in chunks of the vocabulary (:func:`chunked_kl_top1`), so the
  memory is bounded whatever the vocabulary size.

Evaluation data (``docs/methods.md``, "Diagnose"): by default the examples of each task's
calibration source that the merge did not read (same shuffle and sampling as the merge,
:func:`mergekit_ext.calibration.sources.load_calibration` with ``exclude``), as many as the
task's ``samples``; ``heldout`` names other data (a file, a split, a calibration-style
mapping), with the same exclusion where it reads the merge's source. A task with no unused
example falls back to its calibration data, and the result says the numbers are on seen data.

Reference rows: the base model and each expert alone run the same way beside the merged
models (the floor and, on its own task, the ceiling). Each merged model gets a one-line
verdict from ``base_ratio`` = (the base model's mean KL to the experts) / (the merged
model's); see :func:`verdict`.

Where the merged folder lacks the expert's head (a body-only merge, e.g. a ``BertModel``
merged from ``BertForSequenceClassification`` experts, or a ``LlamaModel``), the expert's
own head runs on the merged body and the result says so (``head: "expert"`` and the tensor
names). Models without any head (``BertModel`` experts, CLIP vision towers) get the block
errors only.

Memory: one block's tensors at a time (the expert's, then each compared model's) plus one
task's hidden states on each path (the expert, every merged folder and every reference
model: ``references=False`` drops the last); never a whole model. Each task's expert runs once per
call, whatever the number of merged models. Everything that needs no weights
(config, models, family, shapes, calibration data, tokenizers) is checked by
:func:`plan_diagnosis` before the first weight is read.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch
from mergekit.common import ModelReference
from torch import nn
from tqdm.auto import tqdm

from mergekit_ext.calibration.config import CalibrationSpec
from mergekit_ext.calibration.sources import (
    CalibrationData,
    check_calibration,
    check_tokenizers_match,
)
from mergekit_ext.calibration.statistics import flatten_tokens
from mergekit_ext.config import ExtMergeConfig, ExtModelEntry
from mergekit_ext.diagnose.agreement import chunked_kl_top1, kl_and_agreement
from mergekit_ext.diagnose.heldout import (
    DataMode,
    evaluation_spec,
    load_evaluation_data,
    load_probe_data,
    parse_heldout,
)
from mergekit_ext.diagnose.probe import record_warnings
from mergekit_ext.diagnose.task import DiagnosisTask
from mergekit_ext.diagnose.verdict import compare_with_references, evaluated_on
from mergekit_ext.errors import (
    CalibrationError,
    ConfigError,
    ExecutionError,
    MergekitExtError,
    ModelInputError,
)
from mergekit_ext.executor.blocks import (
    BlockCall,
    BlockCallRecorder,
    CallSink,
    StopForward,
    run_block,
    skeleton_on_device,
    trim_heap,
)
from mergekit_ext.executor.plan import OpenedModels, Source, expert_entries
from mergekit_ext.methods.registry import ext_method_info
from mergekit_ext.models.checkpoint import (
    HEAD_PREFIX,
    canonical_name,
    has_tokenizer,
    module_key_of,
    open_model,
    resolve_model_folder,
)
from mergekit_ext.models.families import ModelFamily
from mergekit_ext.models.head_kind import head_kind

LOG = logging.getLogger(__name__)

ComparedOutput = Literal["next_token", "class", "none"]
Role = Literal["merge", "base", "expert"]

# ------------------------------------------------------------------------------------------
# The plan: everything checked before a weight loads


@dataclass
class MergedModel:
    """One model compared with the experts: a merged checkpoint or a reference."""

    label: str
    source: Source
    role: Role = "merge"
    task: Optional[str] = None  # an expert reference: its own task


@dataclass
class DiagnosisPlan:
    """The checked inputs of a diagnosis (see :func:`plan_diagnosis`)."""

    family: ModelFamily
    merged: list[MergedModel]
    tasks: list[DiagnosisTask]
    num_blocks: int
    references: list[MergedModel] = field(default_factory=list)  # the base, each expert
    with_references: bool = True  # False: the caller skipped them (no verdict on the base)
    # the base model is one of the merged models (SLERP's endpoint): a task, not the floor
    base_is_input: bool = False
    method: Optional[str] = None  # the config's merge_method
    reads_data: bool = True  # the method reads calibration data (else nothing is excluded)

    @property
    def compared(self) -> list[MergedModel]:
        return [*self.merged, *self.references]


def _compared_output(skeleton: nn.Module) -> ComparedOutput:
    """What diagnose compares of the expert's class: next-token logits (a causal LM), class
    logits (any other head) or nothing (a bare body); see ``models/head_kind.py``."""
    kind = head_kind(skeleton)
    if kind == "causal_lm":
        return "next_token"
    return "none" if kind == "none" else "class"


def _block_names(source: Source, layers_path: str, index: int) -> list[str]:
    prefix = f"{layers_path}.{index}."
    return [n for n in source.names() if n.startswith(prefix)]


def _num_blocks(source: Source, family: ModelFamily) -> tuple[str, int]:
    backbone = source.backbone
    path = family.layers_path(backbone)
    return path, len(backbone.get_submodule(path))


def _role_words(model: MergedModel) -> str:
    words = {"merge": "the merged model", "base": "the base model", "expert": "expert"}
    return f"{words[model.role]} {model.label}"


def _check_same_body(merged: MergedModel, task: DiagnosisTask, family: ModelFamily) -> None:
    """The expert's blocks and embeddings have the merged model's tensors, shapes included."""
    m, e = merged.source, task.source
    if e.family.name != m.family.name:
        raise ModelInputError(
            f"architecture mismatch: {_role_words(merged)} is a "
            f"{m.config.model_type!r} model ({m.family.name} family) but expert {task.label} "
            f"(task {task.name!r}) is {e.config.model_type!r} ({e.family.name} family); diagnose "
            "compares a merged model with experts of its own architecture"
        )
    if e.config.model_type != m.config.model_type:
        raise ModelInputError(
            f"architecture mismatch: {_role_words(merged)} is {m.config.model_type!r} "
            f"but expert {task.label} (task {task.name!r}) is {e.config.model_type!r}"
        )
    m_path, m_blocks = _num_blocks(m, family)
    e_path, e_blocks = _num_blocks(e, family)
    if m_blocks != e_blocks:
        raise ModelInputError(
            f"architecture mismatch: {_role_words(merged)} has {m_blocks} blocks but "
            f"expert {task.label} (task {task.name!r}) has {e_blocks}"
        )
    needed = [n for i in range(e_blocks) for n in _block_names(e, e_path, i)]
    needed += [n for n in e.names() if family.is_pre_block(n)]
    for i in range(m_blocks):
        extra = set(_block_names(m, m_path, i)) - set(_block_names(e, e_path, i))
        if extra:
            raise ModelInputError(
                f"architecture mismatch: block {i} of {_role_words(merged)} has "
                f"{sorted(extra)[0]}, which expert {task.label} (task {task.name!r}) lacks"
            )
    for name in needed:
        if not m.provides(name):
            raise ModelInputError(
                f"architecture mismatch: {_role_words(merged)} lacks "
                f"{e.checkpoint_key.get(name, name)} of expert {task.label} (task "
                f"{task.name!r}); diagnose runs every block and embedding of both models"
            )
        if tuple(m.shape(name)) != tuple(e.shape(name)):
            raise ModelInputError(
                f"architecture mismatch: tensor {e.checkpoint_key.get(name, name)} has shape "
                f"{list(e.shape(name))} in expert {task.label} (task {task.name!r}) but "
                f"{list(m.shape(name))} in {_role_words(merged)}"
            )


def _task_entries(
    cfg: ExtMergeConfig,
) -> tuple[list[tuple[ExtModelEntry, ModelReference]], bool]:
    """The tasks of a diagnosis and whether the base model is one of them.

    The base model is the floor a merge must beat, unless it is also one of the models merged
    (SLERP and NuSLERP interpolate between the base and the other model): then it is an
    endpoint of the merge, a task like the others, and no floor row is measured.
    """
    base = cfg.merge.base_model
    mk_models = cfg.merge.models or []
    if base is not None and len(mk_models) == len(cfg.models):
        is_base = [mk.model == base for mk in mk_models]
        if any(is_base) and not all(is_base):
            return list(zip(cfg.models, (mk.model for mk in mk_models))), True
    return expert_entries(cfg), False


def plan_diagnosis(
    cfg: ExtMergeConfig,
    merged_dirs: Sequence[str],
    *,
    cache_dir: Optional[str] = None,
    trust_remote_code: bool = False,
    load_data: bool = True,
    heldout: Sequence[str] = (),
    data: DataMode = "heldout",
    references: bool = True,
    probe: bool = True,
) -> DiagnosisPlan:
    """Check everything that needs no weights and load (tokenize) the evaluation data.

    ``heldout``: ``--heldout`` values (:func:`parse_heldout`); ``data="calibration"``
    measures on the calibration data the merge read instead of held-out data;
    ``references``: add the base model and each expert alone as reference rows;
    ``probe``: also measure every text model on the generic prose probe
    (:mod:`~mergekit_ext.diagnose.probe`).

    A task without calibration data (a data-free merge such as SLERP or TIES) is measured on
    its ``--heldout`` data, else on the probe alone (text models; a vision task needs
    ``--heldout``).

    Raises a one-line :class:`MergekitExtError` naming the model, task or tensor for a
    config without ``models:``, a missing model, an unsupported family, an architecture
    mismatch, missing or unreadable data and tokenizers that differ.
    """
    if data == "calibration" and heldout:
        raise ConfigError("--heldout and --calibration-data exclude each other; give one")
    heldout_fields = parse_heldout(heldout)
    if not merged_dirs:
        raise ConfigError("diagnose needs a merged model folder")
    no_list = ConfigError(
        "diagnose needs the experts as a `models:` list (a slices/modules config names no "
        "experts to compare with)"
    )
    if not cfg.models or cfg.raw.get("slices") or cfg.raw.get("modules"):
        raise no_list
    try:
        entries, base_is_input = _task_entries(cfg)
    except ConfigError:
        raise no_list from None
    if not entries:
        raise ConfigError(
            "the config lists no expert besides the base model; diagnose compares the merged "
            "model with each entry of `models:`"
        )
    method = str(cfg.merge.merge_method) if cfg.merge.merge_method else None
    info = ext_method_info(method) if method else None
    reads_data = info is not None and info.needs_calibration
    opened = OpenedModels(cache_dir)
    merged: list[MergedModel] = []
    for path in merged_dirs:
        folder = resolve_model_folder(path, what=f"merged model {path}", cache_dir=cache_dir)
        merged.append(
            MergedModel(path, open_model(path, folder, None, what=f"merged model {path}"))
        )
    family = merged[0].source.family
    for other in merged[1:]:
        if other.source.family.name != family.name:
            raise ModelInputError(
                f"merged models {merged[0].label} and {other.label} are of different families"
            )
    text = family.modality == "text"

    names = [entry.name for entry, _ in entries]
    unknown = [t for t in heldout_fields if t is not None and t not in names]
    if unknown:
        raise ConfigError(
            f"--heldout names task {unknown[0]!r}, which the config does not have; its tasks "
            f"are {', '.join(names)}"
        )
    tasks: list[DiagnosisTask] = []
    ref_models: list[MergedModel] = []
    for entry, ref in entries:
        spec = cfg.calibration_for(entry)
        has_data = spec is not None and spec.has_data
        fields = {**heldout_fields.get(None, {}), **heldout_fields.get(entry.name, {})}
        what = f"model {entry.model} (task {entry.name!r})"
        if not has_data and data == "calibration":
            raise CalibrationError(
                f"{what} has no calibration data, so --calibration-data has nothing to measure "
                "on: leave it out (diagnose then uses --heldout data or the generic probe)"
            )
        if not has_data and not fields and not text:
            raise CalibrationError(
                f"{what} has no calibration data and a {family.modality} model gets no generic "
                "probe: give evaluation data with --heldout PATH (or add `calibration: {path: "
                "DATA}` to its entry)"
            )
        source, data_path = opened.reference(ref, entry.model, None, what)
        task = DiagnosisTask(
            entry.name, entry.model, source, data_path, spec if has_data else CalibrationSpec()
        )
        for m in merged:
            _check_same_body(m, task, family)
        if has_data:
            assert spec is not None
            check_calibration(spec, task=entry.name, modality=family.modality)
        if data == "heldout" and fields:
            task.evaluation = evaluation_spec(task, heldout_fields)
            if not task.evaluation.has_data:
                raise ConfigError(
                    f"--heldout gives task {entry.name!r} no data"
                    + ("" if has_data else " (it has no calibration source to read again)")
                )
            check_calibration(task.evaluation, task=entry.name, modality=family.modality)
        tasks.append(task)
        if references:
            ref_models.append(MergedModel(entry.model, source, "expert", entry.name))
    if references and cfg.merge.base_model is not None and not base_is_input:
        base_label = str(cfg.merge.base_model)
        try:
            base_source, _ = opened.reference(
                cfg.merge.base_model, base_label, None, f"base model {base_label}"
            )
        except MergekitExtError as e:
            raise type(e)(
                f"{e} (diagnose measures the base model as a reference row; pass "
                "--no-references to skip it)"
            ) from e
        ref_models.insert(0, MergedModel(base_label, base_source, "base"))
    for r in ref_models:
        for task in tasks:
            if r.task != task.name:
                _check_same_body(r, task, family)

    if text:
        paths = [t.data_path for t in tasks] + [m.source.path for m in merged]
        paths = [p for p in dict.fromkeys(paths) if has_tokenizer(p)]
        if len(paths) > 1:
            check_tokenizers_match(paths)
    _, num_blocks = _num_blocks(merged[0].source, family)
    if load_data:
        # every spec the merge loaded: a held-out example is read by none of them (a
        # data-free method read nothing, so nothing is left out)
        merge_specs = (
            [s for e in cfg.models if (s := cfg.calibration_for(e)) is not None]
            if reads_data
            else []
        )
        for t in tasks:
            if t.calibration.has_data or t.evaluation is not None:
                load_evaluation_data(
                    t, merge_specs, data, family.modality, trust_remote_code, method, reads_data
                )
            if text and (probe or not t.data_info):
                load_probe_data(t, trust_remote_code, as_evaluation=not t.data_info)
    return DiagnosisPlan(
        family=family,
        merged=merged,
        tasks=tasks,
        num_blocks=num_blocks,
        references=ref_models,
        with_references=references,
        base_is_input=base_is_input,
        method=method,
        reads_data=reads_data,
    )


# ------------------------------------------------------------------------------------------
# Walking one model


class _Replay(nn.Module):
    """Stands in for block ``index`` in the output pass: the last one returns ``output``
    (shaped as the block returns its result: ``wrap``)."""

    def __init__(self, index: int, last: int, wrap: Callable[[torch.Tensor], Any]) -> None:
        super().__init__()
        self.index = index
        self.last = last
        self.wrap = wrap
        self.output: Optional[torch.Tensor] = None

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.index == self.last:
            assert self.output is not None
            return self.wrap(self.output)
        return self.wrap(hidden_states)


def _accepts_cache(module: nn.Module) -> bool:
    return "use_cache" in inspect.signature(module.forward).parameters


class _Walker:
    """One model's class (meta parameters) walked block by block with real tensors.

    Like the sequential executor: the block list holds call recorders while the embeddings
    run (they capture the masks and rotary embeddings transformers passes each block); the
    real block modules run through ``functional_call``. For the output, the recorders are
    swapped for :class:`_Replay` stand-ins and the whole model's ``forward`` runs from the
    embeddings with the last block's output injected, so the final norm, pooler and head
    are transformers' own.
    """

    def __init__(self, source: Source, family: ModelFamily, device: torch.device) -> None:
        self.source = source
        self.device = device
        self.skeleton = skeleton_on_device(source.config, device)
        self.backbone_path = source.backbone_path
        self.backbone = (
            self.skeleton.get_submodule(self.backbone_path) if self.backbone_path else self.skeleton
        )
        self.layers_path = family.layers_path(self.backbone)
        self.block_list = self.backbone.get_submodule(self.layers_path)
        self.blocks: list[nn.Module] = list(self.block_list)
        last = len(self.blocks) - 1
        self.sink = CallSink(last=last)
        wrap = family.wrap_block_output
        self.recorders = [BlockCallRecorder(i, self.sink, wrap) for i in range(len(self.blocks))]
        self.replays = [_Replay(i, last, wrap) for i in range(len(self.blocks))]
        self._install(self.recorders)
        self.backbone_extra = {"use_cache": False} if _accepts_cache(self.backbone) else {}
        self.model_extra = {"use_cache": False} if _accepts_cache(self.skeleton) else {}
        self.kind = _compared_output(self.skeleton)
        head = self.skeleton.get_output_embeddings() if self.kind == "next_token" else None
        self.head_name: Optional[str] = None
        if head is not None:
            self.head_name = next(k for k, mod in self.skeleton.named_modules() if mod is head)

    def _install(self, modules: Sequence[nn.Module]) -> None:
        for i, module in enumerate(modules):
            self.block_list[i] = module

    def block_tensors(self, index: int) -> list[str]:
        return _block_names(self.source, self.layers_path, index)

    def non_block_tensors(self) -> list[str]:
        prefix = self.layers_path + "."
        return [n for n in self.source.names() if not n.startswith(prefix)]

    def embed(
        self, params: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, list[tuple[tuple[Any, ...], dict[str, Any]]]]:
        """The first block's input and every block's call arguments for one batch."""
        self.sink.reset()
        try:
            torch.func.functional_call(
                self.backbone, params, args=(), kwargs={**inputs, **self.backbone_extra}
            )
        except StopForward:
            pass
        if self.sink.hidden is None or len(self.sink.calls) != len(self.blocks):
            raise ExecutionError(
                f"{type(self.backbone).__name__}.forward called {len(self.sink.calls)} of "
                f"{len(self.blocks)} blocks"
            )
        hidden, calls = self.sink.hidden.to(torch.float32), list(self.sink.calls)
        self.sink.reset()
        return hidden, calls

    def run_block(
        self,
        index: int,
        params: dict[str, torch.Tensor],
        hidden: torch.Tensor,
        call: BlockCall,
    ) -> torch.Tensor:
        """Block ``index`` of this model with its tensors ``params`` (:func:`run_block`)."""
        return run_block(self.blocks[index], params, hidden, call)

    def output(
        self,
        params: dict[str, torch.Tensor],
        inputs: dict[str, torch.Tensor],
        last_hidden: torch.Tensor,
    ) -> torch.Tensor:
        """The head's logits (``class``) or the LM head's input (``next_token``) for a batch."""
        self.replays[-1].output = last_hidden
        self._install(self.replays)
        captured: list[torch.Tensor] = []
        handle = None
        if self.head_name is not None:

            def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
                captured.append(args[0])
                raise StopForward

            handle = self.skeleton.get_submodule(self.head_name).register_forward_pre_hook(hook)
        try:
            out = torch.func.functional_call(
                self.skeleton, params, args=(), kwargs={**inputs, **self.model_extra}
            )
        except StopForward:
            return captured[0].to(torch.float32)
        finally:
            if handle is not None:
                handle.remove()
            self.replays[-1].output = None
            self._install(self.recorders)
        logits = getattr(out, "logits", None)
        if logits is None:
            raise ExecutionError(f"{type(self.skeleton).__name__} returned no logits")
        return logits.to(torch.float32)


# ------------------------------------------------------------------------------------------
# Running the diagnosis


@dataclass
class _Path:
    """One model's view of one task: its walker and where each output tensor comes from."""

    walker: _Walker  # embeddings and blocks: the model's own class
    body: Source  # embeddings and blocks
    tail_walker: _Walker  # the class whose forward runs the output (final norm, head)
    tail: dict[str, Source] = field(default_factory=dict)  # canonical -> source (output pass)
    head: Optional[tuple[Source, str, Optional[str]]] = None  # LM head: source, weight, bias
    from_expert: list[str] = field(default_factory=list)  # output tensors taken from the expert


class Diagnoser:
    """Runs a :class:`DiagnosisPlan`; :meth:`run` returns one result per merged model."""

    def __init__(self, plan: DiagnosisPlan, device: torch.device, progress: bool = True) -> None:
        self.plan = plan
        self.device = device
        self.progress = progress  # a tqdm bar on stderr, one step per block of each pass
        self.family = plan.family
        self._merged_walkers: dict[int, _Walker] = {}

    def _merged_walker(self, index: int) -> _Walker:
        if index not in self._merged_walkers:
            self._merged_walkers[index] = _Walker(
                self.plan.compared[index].source, self.family, self.device
            )
        return self._merged_walkers[index]

    def _merged_path(self, index: int, expert: _Walker) -> _Path:
        """The merged model for one task; the expert's class runs the output where needed.

        The merged model's own class runs its output when it is the expert's class and has
        every tensor of the expert's tail (final norm, pooler, head) with the same shape;
        otherwise the expert's class runs it with the merged model's tensors where it has
        them and the expert's own for the rest (its head), and the result says so.
        """
        merged = self.plan.compared[index].source
        walker = self._merged_walker(index)
        names = expert.non_block_tensors()
        own = [n for n in names if _same(merged, expert.source, n)]
        head = _lm_head(expert)
        head_own = head is None or _same(merged, expert.source, head[0])
        if type(walker.skeleton) is type(expert.skeleton) and len(own) == len(names) and head_own:
            path = _Path(walker, merged, walker, dict.fromkeys(walker.non_block_tensors(), merged))
        else:
            tail = {n: (merged if n in own else expert.source) for n in names}
            path = _Path(
                walker, merged, expert, tail, from_expert=[n for n in names if n not in own]
            )
        if head is not None:
            weight, bias = head
            source = merged if head_own else expert.source
            if not head_own and weight not in path.from_expert:
                path.from_expert.append(weight)
            path.head = (
                source,
                weight,
                bias if bias is not None and source.provides(bias) else None,
            )
        return path

    def _expert_path(self, expert: _Walker) -> _Path:
        tail = dict.fromkeys(expert.non_block_tensors(), expert.source)
        path = _Path(expert, expert.source, expert, tail)
        head = _lm_head(expert)
        if head is not None:
            weight, bias = head
            has_bias = bias is not None and expert.source.provides(bias)
            path.head = (expert.source, weight, bias if has_bias else None)
        return path

    def _tail_params(self, path: _Path, walker: _Walker) -> dict[str, torch.Tensor]:
        """The output pass's tensors by module key (an LM head is applied in chunks instead)."""
        skip = set(path.head[1:]) if path.head is not None else set()
        return {
            module_key_of(n, walker.backbone_path): source.load(n, self.device)
            for n, source in path.tail.items()
            if n not in skip
        }

    def _passes(self) -> list[tuple[DiagnosisTask, CalibrationData, bool]]:
        """(task, data, is the probe) for every pass; a task whose evaluation data is the
        probe runs once."""
        out = []
        for task in self.plan.tasks:
            assert task.data is not None, "plan_diagnosis loads the evaluation data"
            out.append((task, task.data, False))
            if task.probe is not None and task.probe is not task.data:
                out.append((task, task.probe, True))
        return out

    def run(self) -> list[dict[str, Any]]:
        """One result per merged model, each with the reference rows and its verdict."""
        compared = self.plan.compared
        rows: list[dict[str, Any]] = [{"tasks": {}} for _ in compared]
        probes: list[dict[str, Any]] = [{"tasks": {}} for _ in compared]
        passes = self._passes()
        # one block of one pass: the expert's and every compared model's (shared passes)
        progress = tqdm(
            total=len(passes) * self.plan.num_blocks,
            desc="diagnose",
            unit="block",
            disable=not self.progress,
        )
        with torch.no_grad(), progress:
            for task, data, is_probe in passes:
                progress.set_postfix_str(f"{task.name}{' (probe)' if is_probe else ''}")
                start = time.perf_counter()
                per_model = self._run_task(task, data, progress)
                seconds = time.perf_counter() - start
                LOG.info(
                    "task %s%s: %d model(s) compared with the expert in %.1fs",
                    task.name,
                    " (probe)" if is_probe else "",
                    len(per_model),
                    seconds,
                )
                for i, task_result in per_model.items():
                    task_result["seconds"] = round(seconds, 3)
                    (probes if is_probe else rows)[i]["tasks"][task.name] = task_result
                    if not is_probe and task.probe is data:  # the probe is its only data
                        probes[i]["tasks"][task.name] = task_result
        for row, probe in zip(rows, probes):
            row.update(summarize(row["tasks"]))
            if probe["tasks"]:
                probe.update(summarize(probe["tasks"]))
                row["probe"] = probe
        references: dict[str, Any] = {
            "base": None,
            "experts": {},
            "skipped": not self.plan.with_references,
            "base_is_input": self.plan.base_is_input,
        }
        for model, row in zip(compared, rows):
            if model.role == "base":
                references["base"] = {"model": model.label, **row}
            elif model.role == "expert":
                assert model.task is not None
                references["experts"][model.task] = {"model": model.label, **row}
        data_info = {t.name: dict(t.data_info) for t in self.plan.tasks}
        probe_info = {t.name: dict(t.probe_info) for t in self.plan.tasks if t.probe_info}
        results = []
        for model, row in zip(self.plan.merged, rows):
            result = {"merged": model.label, "family": self.family.name, **row}
            result["data"] = data_info
            result["probe_data"] = probe_info
            if self.family.modality != "text":
                result["probe_skipped"] = (
                    f"no generic probe for {self.family.modality} models: give off-distribution "
                    "data with --heldout"
                )
            result["evaluated_on"] = evaluated_on(data_info)
            result["method"] = self.plan.method
            result["references"] = references
            result["merge_warnings"] = record_warnings(model.source.path)
            result.update(compare_with_references(result))
            results.append(result)
        return results

    def _run_task(
        self, task: DiagnosisTask, data: CalibrationData, progress: Optional[Any] = None
    ) -> dict[int, dict[str, Any]]:
        """Results on one task's ``data`` by index in ``plan.compared``; the task's expert
        runs once."""
        device = self.device
        expert = _Walker(task.source, self.family, device)
        expert_path = self._expert_path(expert)
        compared = self.plan.compared
        # the task's own expert as a reference is the expert itself: no second pass
        own = [i for i, m in enumerate(compared) if m.role == "expert" and m.task == task.name]
        indices = [i for i in range(len(compared)) if i not in own]
        merged_paths = [self._merged_path(i, expert) for i in indices]
        paths = [expert_path, *merged_paths]

        inputs = [
            {k: v.to(device) for k, v in self.family.forward_inputs(b).items()}
            for b in data.batches
        ]
        masks = []
        for b in data.batches:
            mask = self.family.token_mask(b)
            masks.append(mask.to(device).bool() if mask is not None else None)

        # Embeddings (each model's own) and every block's call arguments.
        hidden: list[list[torch.Tensor]] = []
        calls: list[list[list[tuple[tuple[Any, ...], dict[str, Any]]]]] = []
        for path in paths:
            pre = {
                n: path.body.load(n, device)
                for n in path.walker.non_block_tensors()
                if self.family.is_pre_block(n)
            }
            pairs = [path.walker.embed(pre, x) for x in inputs]
            hidden.append([h for h, _ in pairs])
            calls.append([c for _, c in pairs])
            del pre, pairs
            path.body.release()

        errors: list[list[dict[str, Any]]] = [[] for _ in paths]
        for index in range(self.plan.num_blocks):
            for p, path in enumerate(paths):
                names = path.walker.block_tensors(index)
                local = len(path.walker.layers_path) + len(f".{index}.")
                params = {n[local:]: path.body.load(n, device) for n in names}
                hidden[p] = [
                    path.walker.run_block(index, params, h, c[index])
                    for h, c in zip(hidden[p], calls[p])
                ]
                del params
                path.body.release()
            for p in range(len(paths)):
                err = 0.0 if p == 0 else relative_error(hidden[0], hidden[p], masks)
                errors[p].append({"index": index, "relative_error": err})
            trim_heap()
            if progress is not None:
                progress.update(1)

        outputs = self._outputs(expert, paths, inputs, masks, hidden)
        results: dict[int, dict[str, Any]] = {}
        slots = [(i, p + 1) for p, i in enumerate(indices)] + [(i, 0) for i in own]
        for i, p in slots:
            path = paths[p]
            result: dict[str, Any] = {
                "model": task.label,
                "samples": data.num_samples,
                "tokens": data.num_tokens,
                "data": "probe" if data is task.probe else task.data_info.get("kind"),
                **outputs[p],
                "head": "expert" if path.from_expert else "merged",
                "expert_tensors_used": [n.removeprefix(HEAD_PREFIX) for n in path.from_expert],
                "blocks": errors[p],
            }
            if p == 0:
                result["itself"] = True  # the expert on its own task: the ceiling
            result["worst_block"] = max(
                errors[p], key=lambda r: _order_key(r["relative_error"]), default=None
            )
            results[i] = result
        return results

    def _outputs(
        self,
        expert: _Walker,
        paths: list[_Path],
        inputs: list[dict[str, torch.Tensor]],
        masks: list[Optional[torch.Tensor]],
        hidden: list[list[torch.Tensor]],
    ) -> list[dict[str, Any]]:
        """Output agreement of every path with ``paths[0]`` (the expert: itself included)."""
        kind = expert.kind
        if kind == "none":
            return [{"output": None, "agreement": None, "kl": None, "positions": 0} for _ in paths]
        tails = []
        for p, path in enumerate(paths):
            params = self._tail_params(path, path.tail_walker)
            outs = [path.tail_walker.output(params, x, h) for x, h in zip(inputs, hidden[p])]
            head = None
            if path.head is not None:
                source, weight, bias = path.head
                head = (
                    source.load(weight, self.device),
                    source.load(bias, self.device) if bias is not None else None,
                )
            tails.append((outs, head))
            del params
            path.body.release()
        results = []
        ref_outs, ref_head = tails[0]
        for outs, head in tails:
            kl_sum, agree_sum, count = 0.0, 0, 0
            for b, (ref, new) in enumerate(zip(ref_outs, outs)):
                mask = masks[b]
                if kind == "next_token":
                    assert ref_head is not None and head is not None
                    kl, agree = chunked_kl_top1(
                        flatten_tokens(ref, mask),
                        ref_head[0],
                        flatten_tokens(new, mask),
                        head[0],
                        ref_head[1],
                        head[1],
                    )
                else:
                    if ref.dim() == 3:  # a token head: one prediction per position
                        ref, new = flatten_tokens(ref, mask), flatten_tokens(new, mask)
                    kl, agree = kl_and_agreement(
                        ref.reshape(-1, ref.shape[-1]), new.reshape(-1, new.shape[-1])
                    )
                kl_sum += float(kl.sum())
                agree_sum += int(agree.sum())
                count += int(agree.numel())
            results.append(
                {
                    "output": kind,
                    "agreement": agree_sum / count if count else None,
                    "kl": kl_sum / count if count else None,
                    "positions": count,
                }
            )
        return results


def _order_key(value: float) -> float:
    """NaN sorts above everything: a NaN block is the worst."""
    return math.inf if math.isnan(value) else value


def _same(merged: Source, expert: Source, canonical: str) -> bool:
    """The merged model has this tensor of the expert, with the same shape."""
    return merged.provides(canonical) and tuple(merged.shape(canonical)) == tuple(
        expert.shape(canonical)
    )


def _lm_head(walker: _Walker) -> Optional[tuple[str, Optional[str]]]:
    """Canonical names of a causal LM's head weight and bias (None for other outputs)."""
    if walker.head_name is None:
        return None
    weight = canonical_name(walker.head_name + ".weight", walker.backbone_path)
    bias = canonical_name(walker.head_name + ".bias", walker.backbone_path)
    return weight, bias


def relative_error(
    reference: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    masks: Sequence[Optional[torch.Tensor]],
) -> float:
    """``‖X − R‖_F / ‖R‖_F`` over the non-padding positions of every batch, in float64.

    Args:
        reference: the expert's ``[B, T, D]`` hidden states per batch.
        values: the merged model's, same shapes.
        masks: ``[B, T]`` token masks per batch (None: every position).

    Returns:
        The relative error (0 when both are zero; inf when only the reference is zero).
    """
    diff = 0.0
    norm = 0.0
    for r, v, mask in zip(reference, values, masks):
        r_rows = flatten_tokens(r, mask).double()
        v_rows = flatten_tokens(v, mask).double()
        diff += float(((v_rows - r_rows) ** 2).sum())
        norm += float((r_rows**2).sum())
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return math.sqrt(diff / norm)


def summarize(tasks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Means over the tasks: agreement, KL and last-block error (None where not measured;
    a NaN task value makes the mean NaN, it is not skipped)."""

    def mean(values: list[Optional[float]]) -> Optional[float]:
        measured = [v for v in values if v is not None]
        return sum(measured) / len(measured) if measured else None

    return {
        "mean_agreement": mean([t["agreement"] for t in tasks.values()]),
        "mean_kl": mean([t["kl"] for t in tasks.values()]),
        "mean_last_block_error": mean(
            [t["blocks"][-1]["relative_error"] if t["blocks"] else None for t in tasks.values()]
        ),
    }


def diagnose(
    cfg: ExtMergeConfig,
    merged_dirs: Sequence[str] | str,
    *,
    device: str = "cpu",
    cache_dir: Optional[str] = None,
    trust_remote_code: bool = False,
    heldout: Sequence[str] = (),
    data: DataMode = "heldout",
    references: bool = True,
    probe: bool = True,
    progress: bool = True,
) -> list[dict[str, Any]] | dict[str, Any]:
    """Diagnose one merged folder (a dict) or several against the same experts (a list).

    Several merged folders share the experts' forward passes (each expert block runs once
    per task, then each compared model's block). ``heldout`` / ``data`` / ``references``:
    ``probe``: see :func:`plan_diagnosis`. ``progress``: a progress bar with the
    time left on stderr (one step per block of each task's pass).
    """
    from mergekit_ext.executor.sequential import resolve_device

    single = isinstance(merged_dirs, str)
    dirs = [merged_dirs] if single else list(merged_dirs)
    torch_device = resolve_device(device)
    start = time.perf_counter()
    plan = plan_diagnosis(
        cfg,
        dirs,
        cache_dir=cache_dir,
        trust_remote_code=trust_remote_code,
        heldout=heldout,
        data=data,
        references=references,
        probe=probe,
    )
    results = Diagnoser(plan, torch_device, progress=progress).run()
    seconds = round(time.perf_counter() - start, 3)
    for r in results:
        r["seconds"] = seconds
        r["config"] = os.path.basename(cfg.path) if cfg.path else None
    return results[0] if single else results
