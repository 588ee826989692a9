"""SyMerge's orchestration: inputs, memory check, models, adaptation, saving.

The method's declaration (:mod:`mergekit_ext.adaptation.symerge`) registers the method and
:mod:`~mergekit_ext.adaptation.parameters` declares its parameters; this module does the work they describe (``docs/methods.md``,
section SyMerge). Every function takes the already validated ``SyMergeParameters``.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.func import functional_call

from mergekit_ext.adaptation import export, memory
from mergekit_ext.adaptation.parameters import SyMergeParameters
from mergekit_ext.adaptation.problem import (
    SyMergeProblem,
    build_problem,
    forward_keys,
    free_parameters,
    model_inputs,
)
from mergekit_ext.adaptation.structure import frozen_modules, resolve_task_layer
from mergekit_ext.adaptation.trainer import (
    AdaptationLog,
    AdaptationSettings,
    TaskData,
    adapt,
    evaluate,
    num_samples,
    split_heldout,
    stack_batches,
    teacher_outputs,
)
from mergekit_ext.config import ExtMergeConfig, ExtModelEntry
from mergekit_ext.errors import CalibrationError, ConfigError, ModelInputError
from mergekit_ext.merge_record import MergeRecord
from mergekit_ext.models import model_class, model_paths
from mergekit_ext.models.checkpoint import ResolvedReference, resolve_reference
from mergekit_ext.models.head_kind import is_causal_lm, is_causal_lm_class, observed_head_kind

LOG = logging.getLogger(__name__)

# Adam lr of a causal LM's task layer (its last block) when ``task_layer_lr`` is not given:
# at the λ lr of 1e-2 the LM suite's last blocks diverged (−66% of the experts' gain kept
# after 10 epochs); at 1e-4 it kept 81.7%. Other task layers keep ``lr`` (measured there).
BLOCK_TASK_LAYER_LR = 1e-4


# ---------------------------------------------------------------------------- inputs


def _experts(cfg: ExtMergeConfig) -> tuple[str, list[ExtModelEntry]]:
    cfg.check_data_aware("symerge")
    base = str(cfg.merge.base_model)
    experts = [
        e
        for e in cfg.models
        if e.model != base and os.path.abspath(e.model) != os.path.abspath(base)
    ]
    if not experts:
        raise ConfigError("symerge needs at least one expert besides base_model under models:")
    return base, experts


def _local_path(ref: str) -> str:
    """The local folder of the full checkpoint ``ref`` names (the base model)."""
    paths = model_paths.model_paths(ref)
    if len(paths) != 1 or (
        os.path.isdir(paths[0]) and os.path.exists(os.path.join(paths[0], "adapter_config.json"))
    ):
        raise ModelInputError(
            f"symerge: base_model {ref!r} must be a full checkpoint, not a LoRA adapter"
        )
    path = paths[0]
    if os.path.isdir(path):
        return path
    from mergekit_ext.models.model_paths import resolve_model_folder

    return resolve_model_folder(path, what=f"model {ref}")


def _expert_input(ref: str, base_path: str) -> ResolvedReference:
    """An expert as local folders: a full checkpoint, or a LoRA adapter on ``base_path``.

    A LoRA expert's task vector is its update ``s · B A`` itself, kept as the factors; that
    holds only against the base the adapter was trained on, so the adapter's base must be the
    YAML's ``base_model``.
    """
    from mergekit.common import ModelReference

    resolved = resolve_reference(ModelReference.parse(ref), f"symerge: model {ref}")
    if resolved.adapter is not None and os.path.realpath(resolved.folder) != os.path.realpath(
        base_path
    ):
        raise ModelInputError(
            f"symerge: expert {ref!r} is a LoRA adapter on {resolved.label!r}, not on base_model "
            f"{base_path!r}; its task vector would not be its low-rank update: merge the adapter "
            "into its base first (peft's merge_and_unload) and give that folder"
        )
    return resolved


def _open_adapters(inputs: Sequence[ResolvedReference], base_path: str) -> list[Any]:
    """Each LoRA expert's adapter indexed against the base (None for a full checkpoint)."""
    if all(r.adapter is None for r in inputs):
        return [None] * len(inputs)
    from mergekit_ext.models.checkpoint import open_model
    from mergekit_ext.models.lora import open_lora_expert

    base = open_model(base_path, base_path, None, what="symerge: base_model")
    return [
        None
        if r.adapter is None
        else open_lora_expert(r.adapter, r.adapter, base, what=f"symerge: expert {r.adapter}")
        for r in inputs
    ]


def _lora_updates(
    source: Any, base_tensors: Mapping[str, torch.Tensor], device: str
) -> dict[str, Any]:
    """A LoRA expert's changes by the base model's parameter names: each adapted weight's
    factors (:class:`LowRankUpdate`) and each tensor the adapter saves whole
    (``modules_to_save``, e.g. a classifier) as that tensor."""
    from mergekit_ext.models.checkpoint import module_key_of

    updates: dict[str, Any] = {}
    for canonical in sorted({*source.deltas, *source.replacements}):
        name = module_key_of(canonical, source.base.backbone_path)
        if name not in base_tensors:
            raise ModelInputError(
                f"symerge: adapter {source.adapter_path} changes {name}, which the base model's "
                "class does not hold as its own parameter (it is tied to another); merge the "
                "adapter into its base first (peft's merge_and_unload) and give that folder"
            )
        if canonical in source.replacements:
            updates[name] = source.load(canonical, device)
        else:
            updates[name] = source.factors(source.deltas[canonical], device)
    return updates


def _apply(base: torch.Tensor, update: Any) -> torch.Tensor:
    """The expert's tensor: the base's (unchanged), a whole replacement, or base + s·B A."""
    if update is None:
        return base
    if isinstance(update, torch.Tensor):
        return update
    return base + update.dense()


def _model_class(path: str, config: Mapping[str, Any], trust_remote_code: bool) -> type:
    import transformers

    arch = (config.get("architectures") or [None])[0]
    if arch is None:
        raise ModelInputError(
            f"{path}/config.json names no architectures; cannot pick a model class"
        )
    cls = getattr(transformers, arch, None)
    if cls is not None:
        return cls
    reference = next(
        (ref for ref in (config.get("auto_map") or {}).values() if str(ref).endswith("." + arch)),
        None,
    )
    if reference is None or not trust_remote_code:
        raise ModelInputError(
            f"{path}: architecture {arch} is not part of transformers"
            + ("; it needs trust_remote_code (--trust-remote-code)" if reference else "")
        )
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    return get_class_from_dynamic_module(reference, path)


def _modality(cls: type) -> str:
    name = getattr(cls, "main_input_name", "input_ids")
    if name == "pixel_values":
        return "image"
    if name == "input_ids":
        return "text"
    raise ModelInputError(
        f"symerge: {cls.__name__} reads {name!r}; only text and image models are supported"
    )


def _load(cls: type, path: str, device: str) -> nn.Module:
    model = cls.from_pretrained(path, dtype=torch.float32)
    return model.to(device).eval()


def untie_like(model: nn.Module, base_tied: Mapping[str, str]) -> None:
    """Give ``model`` its own copy of each weight it ties but the base keeps separate.

    An expert that ties ``lm_head`` to its embeddings runs with its embeddings as head; as
    a separate tensor (a copy of them) that head is a task vector against the base's own
    ``lm_head`` like any other. The base ties nothing the experts keep separate
    (:func:`mergekit_ext.models.model_class.check_tied_weights` refuses that before loading).
    """
    untied = False
    for target, source in model_class.tied_weights(model).items():
        if target in base_tied:
            continue
        untied = True
        parent, _, leaf = target.rpartition(".")
        module = model.get_submodule(parent) if parent else model
        shared = model.get_parameter(source)
        setattr(module, leaf, nn.Parameter(shared.detach().clone(), requires_grad=False))
        LOG.info(
            "%s: %s untied from %s (the base keeps it separate)",
            type(model).__name__,
            target,
            source,
        )
    if untied:  # and saved task checkpoints keep it separate
        model.config.tie_word_embeddings = False


def _meta_model(cls: type, path: str) -> nn.Module:
    """The model's structure without weights (to validate ``task_layer`` before loading)."""
    config = cls.config_class.from_pretrained(path)
    with torch.device("meta"):
        return cls(config)


def _dtype(config: Mapping[str, Any]) -> torch.dtype:
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def _num_outputs(
    config: Mapping[str, Any], seq_len: int, causal_lm: bool, top_k: Optional[int]
) -> int:
    """float32-sized numbers cached per sample for the teacher's outputs."""
    if causal_lm:
        vocab = int(config.get("vocab_size") or 32000)
        if top_k is None:
            return seq_len * vocab
        # top-k log-probabilities (float32) and token ids (int64, two floats' worth), the rest
        return seq_len * (3 * min(top_k, vocab) + 1)
    labels = config.get("id2label")
    if labels:
        return len(labels)
    return seq_len * int(config.get("hidden_size") or 768)


# ---------------------------------------------------------------------------- entry point


@dataclass
class SyMergeSession:
    """Everything a SyMerge run holds between preparing, adapting and saving."""

    parameters: SyMergeParameters
    problem: SyMergeProblem
    data: list[TaskData]
    base_path: str
    base_config: dict[str, Any]
    expert_paths: list[str]  # where each task's tokenizer/processor files are copied from
    expert_configs: list[dict[str, Any]]
    calibration: dict[str, dict[str, Any]]
    estimate: memory.AdaptationMemory
    teacher_cached: bool
    device: str
    timing: dict[str, float] = field(default_factory=dict)
    # The YAML's ``out_dtype`` (else ``dtype``): the dtype written; None keeps each model's own.
    out_dtype: Optional[torch.dtype] = None
    micro_batch_size: Optional[int] = None  # causal LMs; see resolved_micro_batch_size


def prepare_symerge(
    cfg: ExtMergeConfig,
    parameters: SyMergeParameters,
    *,
    device: str = "cpu",
    force: bool = False,
    trust_remote_code: bool = False,
) -> SyMergeSession:
    """Validate, estimate memory, load the data and the models, cache the teachers' outputs."""
    from mergekit_ext.calibration.sources import check_calibration, load_calibration

    started = time.perf_counter()
    p = parameters
    base_ref, entries = _experts(cfg)
    names = [e.name for e in entries]
    base_path = _local_path(base_ref)
    inputs = [_expert_input(e.model, base_path) for e in entries]
    # LoRA experts: indexed against the base now (their deltas are checked before loading)
    adapters = _open_adapters(inputs, base_path)
    expert_paths = [r.folder for r in inputs]  # config and class (a LoRA expert's: its base's)
    processing_paths = [r.processing_folder for r in inputs]
    base_config = model_paths.read_config_json(base_path)
    expert_configs = [model_paths.read_config_json(path) for path in expert_paths]
    base_cls = _model_class(base_path, base_config, trust_remote_code)
    expert_classes = [
        _model_class(path, c, trust_remote_code) for path, c in zip(expert_paths, expert_configs)
    ]
    modality = _modality(base_cls)

    # Everything that needs no weights: dtype, data, task layers, memory.
    out_dtype = _written_dtype(cfg)
    specs = []
    for entry in entries:
        spec = cfg.calibration_for(entry)
        assert spec is not None and spec.has_data  # ExtMergeConfig.check_data_aware
        check_calibration(spec, task=entry.name, modality=modality)
        specs.append(spec)
    for cls, path, name in zip(expert_classes, expert_paths, names):
        resolve_task_layer(_meta_model(cls, path), p.task_layer, name)
    estimate, cache_teacher, micro_batch_size = _check_memory(
        p, base_path, base_config, expert_paths, adapters, expert_configs, expert_classes, specs,
        modality=modality, device=device, force=force,
    )  # fmt: skip

    # The data, then the models one expert at a time: its teacher outputs, then its tensors.
    pad_id = int(base_config.get("pad_token_id") or 0)
    calibration, data = {}, []
    for k, (spec, entry, path) in enumerate(zip(specs, entries, processing_paths)):
        loaded = load_calibration(
            spec, path, task=entry.name, modality=modality, trust_remote_code=trust_remote_code
        )
        calibration[entry.name] = loaded.summary()
        batches = stack_batches(loaded.batches, pad_id)
        n = num_samples(batches)
        if n < 2:
            raise CalibrationError(
                f"symerge: task {entry.name} has {n} adaptation sample(s); give it at least 2"
            )
        generator = torch.Generator().manual_seed(p.seed + 1000 + k)
        adapt_index, heldout_index = split_heldout(n, p.heldout_fraction, generator)
        data.append(TaskData(entry.name, batches, adapt_index, heldout_index))
    data_loaded = time.perf_counter()
    # θ_0 of the adaptation: the base (task arithmetic) or a data-aware body merged first,
    # before any model is loaded here (the executor streams one block at a time)
    body_tensors = merge_body(cfg, p, base_cls, device) if p.body != "task_arithmetic" else None

    base = _load(base_cls, base_path, device)
    base_tied = model_class.tied_weights(base)
    # the base's own tensors; the skeleton left behind saves the result
    base_own: Optional[dict[str, torch.Tensor]] = free_parameters(base)
    skeletons, expert_tensors, kinds = [], [], []
    for k, cls in enumerate(expert_classes):
        if adapters[k] is None:
            expert = _load(cls, expert_paths[k], device)
            untie_like(expert, base_tied)
            run_params: Optional[dict[str, torch.Tensor]] = None
        else:  # the base's skeleton, run with θ_base + s·B A while its teacher outputs are taken
            assert base_own is not None
            expert = copy.deepcopy(base)
            updates = _lora_updates(adapters[k], base_own, device)
            run_params = {n: _apply(base_own[n], updates.get(n)) for n in base_own}

        def forward(
            batch: Mapping[str, torch.Tensor],
            expert: nn.Module = expert,
            params: Optional[dict[str, torch.Tensor]] = run_params,
            accepts: Optional[frozenset[str]] = forward_keys(expert),
        ) -> Any:
            kwargs = model_inputs(expert, batch, accepts)
            if params is None:
                return expert(**kwargs)
            return functional_call(expert, params, args=(), kwargs=kwargs)

        if cache_teacher:
            causal = is_causal_lm(expert)
            data[k].teacher = teacher_outputs(
                forward,
                data[k].inputs,
                p.batch_size,
                device,
                top_k=p.teacher_top_k if causal else None,
                vocab_size=int(expert_configs[k].get("vocab_size") or 0),
            )
            probe = data[k].teacher[:1]
        else:
            first = {key: v[:1] for key, v in data[k].inputs.items()}
            probe = teacher_outputs(forward, first, 1, device)
        kinds.append(observed_head_kind(expert, probe))
        if run_params is None:
            expert_tensors.append(free_parameters(expert))
        elif body_tensors is None:  # relative to θ_0 = the base: factors, None where unchanged
            expert_tensors.append({n: updates.get(n) for n in base_own})
        else:  # relative to a merged body: the expert's own tensors
            expert_tensors.append(run_params)
        del run_params, forward
        skeletons.append(expert)
    if body_tensors is not None:
        base_own = None  # the body's merge is θ_0
    problem = build_problem(
        base,
        skeletons,
        expert_tensors,
        names,
        task_layer=p.task_layer,
        init_lambda=resolved_init_lambda(p),
        expert_labels=[e.model for e in entries],
        base_tensors=body_tensors if body_tensors is not None else base_own,
    )
    for task, found in zip(problem.tasks, kinds):
        task.head_kind = found
    timing = {
        "load_data_s": data_loaded - started,
        "load_models_and_teacher_s": time.perf_counter() - data_loaded,
    }
    session = SyMergeSession(
        p, problem, data, base_path, base_config, processing_paths, expert_configs,
        calibration, estimate, cache_teacher, device, timing, out_dtype, micro_batch_size,
    )  # fmt: skip
    return session


def _written_dtype(cfg: ExtMergeConfig) -> Optional[torch.dtype]:
    """``out_dtype`` or else ``dtype`` of the YAML, as mergekit reads them (None: not set).

    Adaptation itself always runs in float32; this is only the dtype the checkpoints are
    saved in.
    """
    from mergekit.common import dtype_from_name

    name = cfg.merge.out_dtype or cfg.merge.dtype
    if not name:
        return None
    try:
        dtype = dtype_from_name(name)
    except Exception as e:  # noqa: BLE001 - mergekit raises RuntimeError for unknown names
        raise ConfigError(f"symerge: dtype {name!r}: {e}") from e
    if not dtype.is_floating_point:
        raise ConfigError(f"symerge: dtype {name!r} is not a floating-point type")
    return dtype


def _check_memory(
    p: SyMergeParameters,
    base_path: str,
    base_config: Mapping[str, Any],
    expert_paths: Sequence[str],
    adapters: Sequence[Any],
    expert_configs: Sequence[Mapping[str, Any]],
    expert_classes: Sequence[type],
    specs: Sequence[Any],
    *,
    modality: str,
    device: str,
    force: bool,
) -> tuple[memory.AdaptationMemory, bool, Optional[int]]:
    """Estimate from the headers; cache the teacher outputs unless only per-batch fits.

    Also returns the causal LMs' micro-batch size (:func:`resolved_micro_batch_size`).
    """
    causal = [is_causal_lm_class(cls) for cls in expert_classes]
    seq_len = max(memory.tokens_per_sample(base_config, modality, s.max_length) for s in specs)
    cache_bytes = memory.FLOAT32 * sum(
        s.samples * _num_outputs(c, seq_len, lm, p.teacher_top_k)
        for s, c, lm in zip(specs, expert_configs, causal)
    )
    micro = resolved_micro_batch_size(p, base_config, seq_len) if any(causal) else None
    base_parameters = memory.checkpoint_parameter_count(base_path)
    common = dict(
        base_parameters=base_parameters,
        expert_parameters=[memory.checkpoint_parameter_count(path) for path in expert_paths],
        task_vector_floats=[
            base_parameters if source is None else memory.adapter_floats(source)
            for source in adapters
        ],
        changed_parameters=memory.changed_parameters(base_parameters, adapters),
        config=base_config,
        seq_len=seq_len,
        batch_size=micro or p.batch_size,
        causal_lm=any(causal),
        logit_rows=p.logit_chunk_tokens if p.teacher_top_k is not None else None,
    )
    available = memory.available_memory_bytes(device)
    estimate = memory.estimate_adaptation_memory(**common, teacher_cache_bytes=cache_bytes)
    cache_teacher = True
    if estimate.total > available:
        per_batch = memory.estimate_adaptation_memory(**common, teacher_cache_bytes=None)
        if per_batch.total < estimate.total:
            estimate, cache_teacher = per_batch, False
    memory.check_memory(estimate, available, force=force, device=device)
    return estimate, cache_teacher, micro


def adapt_session(session: SyMergeSession, *, progress: bool = True) -> dict[str, Any]:
    """Measure task arithmetic, adapt, measure again; returns the diagnostics section."""
    p, problem, data = session.parameters, session.problem, session.data
    started = time.perf_counter()
    settings = AdaptationSettings(
        epochs=p.epochs,
        lr=p.lr,
        task_layer_lr=resolved_task_layer_lr(p, problem),
        batch_size=p.batch_size,
        clamp=p.clamp,
        target=p.target,
        confidence_top_p=p.confidence_top_p,
        seed=p.seed,
        teacher_top_k=p.teacher_top_k,
        logit_chunk_tokens=p.logit_chunk_tokens,
        micro_batch_size=session.micro_batch_size,
    )
    measure = dict(batch_size=p.batch_size, device=session.device, settings=settings)
    before = evaluate(problem, data, "heldout", **measure)
    log = adapt(problem, data, settings, device=session.device, progress=progress)
    after = evaluate(problem, data, "heldout", **measure)
    for task in problem.tasks:
        metric = "accuracy" if task.head_kind != "dense" else "l1"
        LOG.info(
            "symerge %s: held-out %s vs its expert: task arithmetic %s -> adapted %s",
            task.name,
            metric,
            before[task.name][metric],
            after[task.name][metric],
        )
    session.timing["adapt_s"] = log.seconds
    session.timing["evaluate_s"] = time.perf_counter() - started - log.seconds
    return _diagnostics(session, log, before, after)


def task_layers_are_lm_blocks(problem: Any) -> bool:
    """True when some task is a causal LM whose task layer lies inside the body (a block)."""
    return any(
        t.head_kind == "causal_lm"
        and (
            not t.roles.prefix
            or any(m.startswith(t.roles.prefix) for m in t.roles.task_layer_modules)
        )
        for t in problem.tasks
    )


# A causal LM's training activations per micro-batch stay under this (memory.activation_bytes).
# The step is the same whatever the micro-batch; at 1 GiB (8 samples of 64 tokens on the LM
# suite) activations were a third of a 3.4 GB peak once LoRA task vectors were kept as factors.
MICRO_BATCH_ACTIVATIONS_BYTES = 384 * 2**20


def resolved_micro_batch_size(p: SyMergeParameters, config: Mapping[str, Any], seq_len: int) -> int:
    """``micro_batch_size``, or for causal LMs the largest that keeps one micro-batch's
    activations under ``MICRO_BATCH_ACTIVATIONS_BYTES`` (at least 1, at most the batch)."""
    if p.micro_batch_size is not None:
        return min(p.micro_batch_size, p.batch_size)
    rows = p.logit_chunk_tokens if p.teacher_top_k is not None else None
    size = p.batch_size
    while size > 1 and (
        memory.activation_bytes(config, seq_len, size, True, rows) > MICRO_BATCH_ACTIVATIONS_BYTES
    ):
        size = (size + 1) // 2
    return size


def resolved_init_lambda(p: SyMergeParameters) -> float:
    """``init_lambda``, or its default for the body: 0.3 for task arithmetic, else 0 (so that
    epoch 0 is exactly the body's merge)."""
    if p.init_lambda is not None:
        return p.init_lambda
    return 0.3 if p.body == "task_arithmetic" else 0.0


def merge_body(
    cfg: ExtMergeConfig, p: SyMergeParameters, base_cls: type, device: str
) -> dict[str, torch.Tensor]:
    """The data-aware merge SyMerge adapts around (``body``), as the base class's tensors.

    Runs ``p.body`` (RegMean or Chain of Merges) with ``p.body_parameters`` on the same YAML
    and calibration data through the sequential executor, into a temporary folder that is
    removed afterwards, and loads it with the base model's class (so names are the ones the
    base's skeleton uses, whatever the checkpoint layout).
    """
    import tempfile

    from mergekit.options import MergeOptions

    from mergekit_ext.executor import run_layerwise_merge
    from mergekit_ext.methods.kinds import Layerwise
    from mergekit_ext.methods.registry import method_kind

    kind = method_kind(p.body)
    assert isinstance(kind, Layerwise), f"body {p.body} is not a layer-wise method"
    LOG.info("symerge: merging the body with %s first", p.body)
    with tempfile.TemporaryDirectory(prefix="symerge-body-") as folder:
        run_layerwise_merge(
            cfg, folder, MergeOptions(), kind.method, dict(p.body_parameters), device=device
        )
        return free_parameters(_load(base_cls, folder, device))


def resolved_task_layer_lr(p: SyMergeParameters, problem: Any) -> float:
    """``task_layer_lr`` if given; else BLOCK_TASK_LAYER_LR for a causal LM's block, else ``lr``."""
    if p.task_layer_lr is not None:
        return p.task_layer_lr
    return BLOCK_TASK_LAYER_LR if task_layers_are_lm_blocks(problem) else p.lr


def save_symerge(
    session: SyMergeSession,
    out_dir: str,
    *,
    task_layers_only: bool = False,
    body_path: Optional[str] = None,
) -> None:
    """Write the merged body into ``out_dir`` and each task into ``out_dir/tasks/<name>``.

    ``body_path``: how the task adapters (``task_layers_only``) name the merged body, i.e.
    where ``out_dir`` ends up (default ``out_dir``).
    """
    started = time.perf_counter()
    problem = session.problem
    written = session.out_dtype
    export.save_checkpoint(
        problem.base,
        problem.base_checkpoint_tensors(),
        out_dir,
        written or _dtype(session.base_config),
    )
    export.copy_processing_files(session.base_path, out_dir)
    for k, (task, path, config) in enumerate(
        zip(problem.tasks, session.expert_paths, session.expert_configs)
    ):
        task_dir = os.path.join(out_dir, "tasks", task.name)
        # Names are checked with the config; this guards callers that build tasks themselves.
        if os.path.dirname(os.path.normpath(task_dir)) != os.path.normpath(
            os.path.join(out_dir, "tasks")
        ):
            raise ConfigError(f"symerge: task name {task.name!r} is not one folder name")
        tensors = problem.task_checkpoint_tensors(k)
        if task_layers_only:
            modules = task.roles.task_layer_modules + frozen_modules(task.roles)
            export.save_peft_adapter(
                task.module,
                tensors,
                modules,
                task_dir,
                written or _dtype(config),
                body_path or out_dir,
            )
        else:
            export.save_checkpoint(task.module, tensors, task_dir, written or _dtype(config))
            export.copy_processing_files(path, task_dir)
    session.timing["save_s"] = time.perf_counter() - started


def run_symerge(
    cfg: ExtMergeConfig,
    out_dir: str,
    parameters: SyMergeParameters,
    *,
    device: str = "cpu",
    force: bool = False,
    task_layers_only: bool = False,
    trust_remote_code: bool = False,
    body_path: Optional[str] = None,
) -> MergeRecord:
    """Run SyMerge for ``cfg`` and write the outputs into ``out_dir`` (which may exist).

    Returns the merge's record: the diagnostics section (see :func:`_diagnostics`) under
    the config's method, and the calibration summary of each task.
    """
    started = time.perf_counter()
    session = prepare_symerge(
        cfg, parameters, device=device, force=force, trust_remote_code=trust_remote_code
    )
    section = adapt_session(session)
    save_symerge(session, out_dir, task_layers_only=task_layers_only, body_path=body_path)
    session.timing["total_s"] = time.perf_counter() - started
    section["timing"] = dict(session.timing)
    return MergeRecord(cfg.method, sections={cfg.method: section}, calibration=session.calibration)


def _nan_to_none(values: Sequence[float]) -> list[Optional[float]]:
    return [None if math.isnan(v) else v for v in values]


def _diagnostics(
    session: SyMergeSession,
    log: AdaptationLog,
    before: Mapping[str, Mapping[str, Optional[float]]],
    after: Mapping[str, Mapping[str, Optional[float]]],
) -> dict[str, Any]:
    """The ``symerge`` section of the diagnostics JSON.

    ``lambda`` is the K x P matrix (row k: task ``tasks[k]``, column p: tensor
    ``lambda_tensors[p]``); ``heldout_accuracy`` the share of held-back samples (positions
    for per-token outputs) on which the adapted model's argmax equals its expert's;
    ``task_arithmetic_heldout_accuracy`` the same at the starting point (λ = init_lambda,
    the experts' own task layers). Dense outputs report ``heldout_l1`` instead.
    """
    problem = session.problem
    tasks = [t.name for t in problem.tasks]
    section: dict[str, Any] = {
        "tasks": tasks,
        "lambda_tensors": list(problem.shared_keys),
        "lambda": problem.lambdas.detach().T.cpu().tolist(),
        "loss": list(log.loss),
        "loss_task": list(log.loss_task),
        "agreement": {t: _nan_to_none(v) for t, v in log.agreement.items()},
        "heldout_accuracy": {t: after[t]["accuracy"] for t in tasks},
        "task_arithmetic_heldout_accuracy": {t: before[t]["accuracy"] for t in tasks},
        # the starting point: task arithmetic at init_lambda, or the data-aware body's merge
        "body": session.parameters.body,
        "start_heldout_accuracy": {t: before[t]["accuracy"] for t in tasks},
        "task_layers": {t.name: list(t.roles.task_layer_modules) for t in problem.tasks},
        "output_kinds": {t.name: t.head_kind for t in problem.tasks},
        "samples": {
            d.name: {"adaptation": len(d.adapt_index), "heldout": len(d.heldout_index)}
            for d in session.data
        },
        "settings": {
            **session.parameters.model_dump(),
            "task_layer_lr": resolved_task_layer_lr(session.parameters, problem),
            "init_lambda": resolved_init_lambda(session.parameters),
            "micro_batch_size": session.micro_batch_size,
        },
        "teacher_cached": session.teacher_cached,
        "memory_estimate_bytes": dict(session.estimate.parts),
    }
    if any(t.head_kind == "dense" for t in problem.tasks):
        section["heldout_l1"] = {t: after[t]["l1"] for t in tasks}
        section["task_arithmetic_heldout_l1"] = {t: before[t]["l1"] for t in tasks}
    return section
