"""One merge from a parsed config to a finished output folder.

``cli.run`` → :func:`run_merge_config`: check ``OUT_DIR`` (never an input, the current or
home directory; ``--overwrite`` only of a mergekit-ext output) and ``--push-to-hub`` → lock
``OUT_DIR`` → validate everything (method, paths, shapes, parameters, calibration) → pick the executor by the type of the method's kind (``methods/kinds.py``:
mergekit's own planner for tensor-wise methods, our sequential executor for layer-wise
methods, the adaptation loop for SyMerge; :func:`_execute`), which writes the weights into a
temporary folder and returns the merge's :class:`~mergekit_ext.merge_record.MergeRecord` →
the output tokenizer, a check of every written tensor for NaN/Inf, and that the checkpoint
is complete and in the base's layout (``completeness``) → :func:`write`: the diagnostics
JSON, the model card (rendered from the config and the record in memory),
``mergekit_config.yml`` and the manifest → rename the folder into place.

Several processes (``torchrun``, :mod:`mergekit_ext.distributed`): every rank validates;
only rank 0 checks and locks ``OUT_DIR``, writes the temporary folder and renames it. The
ranks agree twice: after the checks (one failing rank fails all, before any weight is
read) and after rank 0's rename (the others exit 0 only once the output is in place). A
rank that fails during the merge itself exits at once; the others fail in their next
collective, and rank 0 removes its temporary folder.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import logging
import math
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from mergekit.options import MergeOptions

from mergekit_ext import checks, finite, merge_record
from mergekit_ext import distributed as dist_context
from mergekit_ext.config import ExtMergeConfig
from mergekit_ext.console import phase
from mergekit_ext.errors import ConfigError, PublishError
from mergekit_ext.methods.kinds import Adaptation, Layerwise
from mergekit_ext.methods.registry import method_kind
from mergekit_ext.models import completeness, mergekit_definitions, tokenization
from mergekit_ext.models.model_paths import (
    config_shapes,
    is_config_only,
    resolve_model_folder,
    safetensors_itemsize,
    with_cached_snapshots,
)
from mergekit_ext.output import (
    atomic_output_dir,
    check_replaceable,
    check_write_path,
    exclusive_output,
    resolve_output,
)
from mergekit_ext.preflight import Plan, World, preflight
from mergekit_ext.resources import ResourceMeter

LOG = logging.getLogger(__name__)


@dataclass
class RunOptions:
    """mergekit-ext's own options for ``run`` (mergekit's are in ``MergeOptions``)."""

    overwrite: bool = False
    allow_pickle: bool = False
    dry_run: bool = False
    # --dry-run --world-size W: plan for W processes without a launcher (default: WORLD_SIZE)
    plan_world_size: Optional[int] = None
    force: bool = False  # SyMerge: run even when the memory estimate exceeds the machine's
    task_layers_only: bool = False  # SyMerge: save task layers as PEFT adapters only
    push_to_hub: Optional[str] = None
    hub_private: bool = False
    hub_token: Optional[str] = None
    hub_timeout: Optional[float] = None  # --hub-timeout (default: hub.http.HUB_TIMEOUT_S)
    # the rest of `publish`'s options (cli_hub.py::publish_options)
    hub_make_private: bool = False
    hub_revision: Optional[str] = None
    hub_commit_message: Optional[str] = None
    hub_create_pr: bool = False
    hub_endpoint: Optional[str] = None  # --endpoint (default: HF_ENDPOINT, then huggingface.co)
    hub_keep_card: bool = False  # upload README.md as the run wrote it
    hub_replace_card: bool = False  # replace a card edited on the Hub
    hub_template_dir: Optional[str] = None  # your own templates for the uploaded card
    plugins: tuple[str, ...] = ()  # --plugin modules or .py files (the files are inputs too)
    # --eval: lm-eval tasks run on the merge before its card is written (issue #52)
    eval_tasks: tuple[str, ...] = ()
    eval_include_path: tuple[str, ...] = ()
    eval_limit: Optional[float] = None


class HubWing(Protocol):
    """What a merge asks of the hub wing (``mergekit_ext/hub/``): the model card and the upload.

    The runner sits below the hub (docs/architecture.md) and never imports it; the entry
    points (``cli.py``, ``api.py``) pass :class:`mergekit_ext.hub.actions.HubActions`.
    """

    def check_can_publish(self, run: RunOptions) -> None:
        """Refuse what ``publish`` would refuse (``--push-to-hub``), before anything merges."""

    def write_model_card(
        self,
        folder: str,
        name: str,
        repo_id: Optional[str],
        *,
        config: ExtMergeConfig,
        config_text: str,
        diagnostics: dict[str, Any],
    ) -> None:
        """Write README.md into ``folder`` (the merge's own temporary folder), rendered from
        ``config`` (as the user wrote it), ``config_text`` and ``diagnostics`` (the config
        copy and the diagnostics as written beside it)."""

    def publish(self, out_path: str, run: RunOptions) -> str:
        """Upload ``out_path`` to ``run.push_to_hub``; returns the line that says what
        happened (``published: REPO_URL (...)``, or that nothing changed)."""

    def publish_command(self, out_path: str, run: RunOptions) -> str:
        """The ``mergekit-ext publish`` command that repeats this upload, every option given."""


def _checked_destinations(
    cfg: ExtMergeConfig, out_path: str, options: MergeOptions, run: RunOptions
) -> str:
    """``OUT_DIR`` resolved (:func:`resolve_output`) and checked replaceable; the folders
    a merge writes besides it (``--lora-merge-cache``: a full-size merged copy of each
    model+LoRA; ``--transformers-cache``: downloads) follow the same rule: never an input,
    nor inside one."""
    plugins = [p for p in run.plugins if p.endswith(".py")]
    caches = [p for p in (options.lora_merge_cache, options.transformers_cache) if p]
    target = resolve_output(out_path, checks.local_input_paths(cfg, plugins + caches))
    for option, cache in (
        ("--lora-merge-cache", options.lora_merge_cache),
        ("--transformers-cache", options.transformers_cache),
    ):
        if not cache:
            continue
        check_write_path(
            cache,
            checks.local_input_paths(cfg, plugins),
            what=option,
            folder=True,
            advice="give a cache folder apart from every model, adapter and data file the "
            "merge reads, or leave the option out (the merge then keeps those copies in its "
            "own temporary folder)",
        )
    check_replaceable(target, run.overwrite, out_path)
    return target


def run_merge_config(
    cfg: ExtMergeConfig,
    out_path: str,
    options: MergeOptions,
    run: Optional[RunOptions] = None,
    *,
    hub: HubWing,
    show_plan: Callable[[str], None] = print,
    show_published: Callable[[str], None] = print,
) -> Optional[str]:
    """Merge ``cfg`` into ``out_path``; returns the output folder (None for a dry run, and
    on ranks other than 0 of a distributed merge). A dry run hands its plan to
    ``show_plan`` (printed by default). ``hub`` writes the card and publishes; the line
    that says what publishing did goes to ``show_published`` (the CLI shows it after
    "merged model written").

    mergekit sees our architecture definitions during this call only (issue #48): the MoE
    checkpoint layout when the base (else the first model) stores its experts one matrix
    each, and on return mergekit's own objects are as they were."""
    refs = cfg.merge.referenced_models()
    layout_model = cfg.merge.base_model or (refs[0] if refs else None)  # none: the checks say
    names = (
        mergekit_definitions.layout_tensor_names(str(layout_model), options.transformers_cache)
        if layout_model is not None
        else ()
    )
    with mergekit_definitions.our_architectures(names):
        return _run_merge_config(
            cfg,
            out_path,
            options,
            run,
            hub=hub,
            show_plan=show_plan,
            show_published=show_published,
        )


def _run_merge_config(
    cfg: ExtMergeConfig,
    out_path: str,
    options: MergeOptions,
    run: Optional[RunOptions],
    *,
    hub: HubWing,
    show_plan: Callable[[str], None],
    show_published: Callable[[str], None],
) -> Optional[str]:
    run = run or RunOptions()
    ctx = dist_context.current()
    if ctx.enabled and not run.dry_run:
        return _run_distributed(cfg, out_path, options, run, ctx, hub, show_published)
    target = _checked_destinations(cfg, out_path, options, run)
    if run.push_to_hub:
        hub.check_can_publish(run)
    _check_eval(run)
    kind = method_kind(cfg.method)
    # mergekit's executor writes the tokenizer of tensor-wise merges itself.
    out_tokenizer = (
        tokenization.plan_output_tokenizer(cfg.merge, options, cfg.method)
        if kind.data_aware
        else None
    )

    if run.dry_run:
        launched = dist_context.world_size_from_env()
        if launched > 1 and os.environ.get("RANK", "0") != "0":
            return None  # under a launcher, rank 0 prints the plan of every rank
        world = World.of_run(run.plan_world_size)
        from mergekit_ext.calibration.sources import in_memory

        with in_memory():  # a dry run writes nothing, not even datasets' Arrow cache
            plan = preflight(cfg, options, world, allow_pickle=run.allow_pickle, dry_run=True)
            with _plan_prints_its_warnings() as listed:
                described = _describe_plan(plan)
                listed.update(line.removeprefix("warning: ") for line in described.splitlines())
            show_plan(described)
        return None

    with exclusive_output(target, out_path):
        plan = preflight(cfg, options, allow_pickle=run.allow_pickle)
        with atomic_output_dir(target, overwrite=run.overwrite, shown=out_path) as tmp:
            with ResourceMeter() as meter:
                record = _execute(plan, tmp, run, out_path)
                _finish_weights(cfg, tmp, options, out_tokenizer)
            write(cfg, _measured(record, meter), tmp, target, options, run, hub)
    if run.push_to_hub:
        show_published(_publish(out_path, run, hub))
    return os.path.abspath(out_path)


def _run_distributed(
    cfg: ExtMergeConfig,
    out_path: str,
    options: MergeOptions,
    run: RunOptions,
    ctx: dist_context.DistributedContext,
    hub: HubWing,
    show_published: Callable[[str], None] = print,
) -> Optional[str]:
    """:func:`run_merge_config` on one of several ranks of a layerwise merge."""
    if not ctx.is_writer:
        try:
            plan = preflight(cfg, options, World(ctx.world_size), allow_pickle=run.allow_pickle)
        except Exception as e:
            ctx.agree(e, "the checks")
            raise
        ctx.agree(None, "the checks")
        _run_layerwise(plan, None, ctx)  # rank 0 writes the record
        ctx.agree(None, "writing the output")
        return None

    prologue = True  # the checks; afterwards, the merge and then writing the output
    merged = False
    try:
        target = _checked_destinations(cfg, out_path, options, run)
        if run.push_to_hub:
            hub.check_can_publish(run)
        _check_eval(run)
        out_tokenizer = tokenization.plan_output_tokenizer(cfg.merge, options, cfg.method)
        with exclusive_output(target, out_path):
            plan = preflight(cfg, options, World(ctx.world_size), allow_pickle=run.allow_pickle)
            with atomic_output_dir(target, overwrite=run.overwrite, shown=out_path) as tmp:
                prologue = False
                ctx.agree(None, "the checks")
                # rank 0's resources: its wall time covers the whole merge (every rank
                # walks the blocks together), its memory is its own
                with ResourceMeter() as meter:
                    record = _run_layerwise(plan, tmp, ctx)
                    merged = True
                    _finish_weights(cfg, tmp, options, out_tokenizer)
                write(cfg, _measured(record, meter), tmp, target, options, run, hub)
    except BaseException as e:
        if prologue:
            ctx.agree(e, "the checks")
        elif merged:  # the others wait for the output: tell them it failed
            ctx.agree(e, "writing the output")
        raise
    ctx.agree(None, "writing the output")
    if run.push_to_hub:
        show_published(_publish(out_path, run, hub))
    return os.path.abspath(out_path)


def _adapter_body_path(out_path: str) -> str:
    """How SyMerge's task adapters (``--task-layers-only``) name the merged body: relative
    to the working directory when ``OUT_DIR`` lies in it (loads from there, names no local
    folder above it), else ``OUT_DIR`` as given (the only value that loads; ``publish``
    uploads the repository id instead)."""
    absolute = os.path.abspath(out_path)
    cwd = os.getcwd()
    if absolute.startswith(cwd.rstrip(os.sep) + os.sep):
        return os.path.relpath(absolute, cwd)
    return out_path


def _input_models(cfg: ExtMergeConfig) -> list[tuple[str, str]]:
    """(label, folder) of every local input checkpoint, to trace a NaN back to its source."""
    found = []
    for ref in dict.fromkeys(str(m) for m in cfg.merge.referenced_models()):
        for path in checks.model_paths(ref):
            if os.path.isdir(path):
                found.append((path, path))
    return found


def _check_finite(cfg: ExtMergeConfig, tmp: str) -> None:
    """No NaN/Inf in any written tensor (``finite``)."""
    phase("checking every written tensor is finite")
    finite.check_output_finite(tmp, _input_models(cfg))


def _check_complete(cfg: ExtMergeConfig, tmp: str, options: MergeOptions) -> None:
    """Every tensor of the base's checkpoint layout written, nothing foreign (``completeness``)."""
    phase("checking the checkpoint is complete, in the base model's layout")
    ref = str(cfg.merge.base_model or cfg.merge.referenced_models()[0])
    completeness.check_output_complete(
        tmp,
        (ref, _donor_folder(cfg, options)),
        optional=lambda: completeness.mergekit_optional_names(
            with_cached_snapshots(cfg.merge), options
        ),
        truncated_vocabulary=options.unsafe_truncate_embeddings,
    )


def _finish_weights(
    cfg: ExtMergeConfig, tmp: str, options: MergeOptions, out_tokenizer: Optional[Any]
) -> None:
    """After the executor: the output tokenizer of a data-aware merge (mergekit's executor
    writes that of a tensor-wise one), then the checks of what was written."""
    if out_tokenizer is not None:
        phase("writing the output tokenizer")
        tokenization.write_output_tokenizer(
            out_tokenizer,
            _donor_folder(cfg, options),
            tmp,
            copy_tokenizer=options.copy_tokenizer,
            trust_remote_code=options.trust_remote_code,
        )
    _check_finite(cfg, tmp)
    _check_complete(cfg, tmp, options)


def _measured(record: merge_record.MergeRecord, meter: ResourceMeter) -> merge_record.MergeRecord:
    """``record`` with what the merge took (``meter`` wrapped the executor and the checks)."""
    assert meter.usage is not None
    record.resources = meter.usage.to_json()
    return record


def write(
    cfg: ExtMergeConfig,
    record: merge_record.MergeRecord,
    staging: str,
    target: str,
    options: MergeOptions,
    run: RunOptions,
    hub: HubWing,
) -> None:
    """The one writer of a merge's own files into ``staging`` (the temporary folder renamed
    to ``target`` afterwards), for one process and for rank 0 of several: the diagnostics,
    the ``--eval`` results, the model card, ``mergekit_config.yml`` and, last, the manifest,
    with no absolute local path.

    The card is rendered here from ``cfg``, the config copy and the diagnostics as they are
    written, never read back from the folder (so it shows what lies beside it, and is the
    card ``mergekit-ext card OUT`` renders later); the copy is redacted once, written once.
    """
    from mergekit_ext.merge_inputs import (
        dot_local_models,
        input_records,
        local_path_redactor,
        undot,
    )

    phase("writing mergekit_config.yml, the diagnostics and the model card")

    # Where each input came from is decided here, where the merge read it, never later.
    records = input_records(cfg)
    redact = local_path_redactor(cfg.raw)
    shortened = redact(cfg.source_text)
    local = {undot(redact(r["model"])) for r in records if r["source"] == "local"}
    local |= {undot(redact(r["lora"])) for r in records if r.get("lora_source") == "local"}
    # local folders as ./x: `m/x` would read as a Hub id to whoever reproduces the merge
    published = dot_local_models(shortened, local.__contains__)
    data = record.to_json(
        parameters=cfg.parameters,
        seed=options.random_seed,
        config_sha256=cfg.sha256,
        versions=_versions(),
        inputs=records,
        # whether the copy differs by more than the ./ of local folders (`card OUT` says so)
        config_paths_shortened=shortened != cfg.source_text,
        config_written_sha256=hashlib.sha256(published.encode("utf-8")).hexdigest(),
    )
    diagnostics = merge_record.diagnostics_text(data, redact=redact)
    merge_record.write_diagnostics(staging, diagnostics)
    if run.eval_tasks:
        _evaluate(staging, os.path.basename(target), run, options)
    if options.write_model_card:
        hub.write_model_card(
            staging,
            os.path.basename(target),
            run.push_to_hub,
            config=cfg,
            config_text=published,
            diagnostics=json.loads(diagnostics),  # as written: paths redacted
        )
    with open(os.path.join(staging, "mergekit_config.yml"), "w", encoding="utf-8") as fp:
        fp.write(published)
    # Last: every file in the fresh temporary folder is the merge's own. `publish` uploads
    # these (and what the user names), never a note or a secret that lands in OUT_DIR later.
    merge_record.write_manifest(staging, written_by="mergekit-ext run")


def _check_eval(run: RunOptions) -> None:
    if run.eval_tasks:
        from mergekit_ext.evaluate import check_lm_eval_tasks

        check_lm_eval_tasks(run.eval_tasks, run.eval_include_path)


def _evaluate(tmp: str, name: str, run: RunOptions, options: MergeOptions) -> None:
    """lm-eval on the merge before its card (the card shows the results). A failure here
    costs the evaluation, never the merge: it is written, and the warning says how to
    evaluate it later."""
    from mergekit_ext.evaluate import evaluate_into_folder

    phase(f"evaluating the merge with lm-eval: {', '.join(run.eval_tasks)}")
    try:
        evaluate_into_folder(
            tmp,
            name,
            run.eval_tasks,
            include_path=run.eval_include_path,
            limit=run.eval_limit,
            device=str(options.device) if options.device not in (None, "auto") else "cpu",
        )
    except Exception as e:  # noqa: BLE001 (any failure of lm-eval or the model: keep the merge)
        LOG.warning(
            "evaluating the merge failed (%s: %s); the merge is written without results — "
            "evaluate it later with `mergekit-ext eval OUT --tasks %s` and `mergekit-ext "
            "card OUT --eval eval_results.json`",
            type(e).__name__,
            e,
            ",".join(run.eval_tasks),
        )


def _publish(out_path: str, run: RunOptions, hub: HubWing) -> str:
    assert run.push_to_hub is not None
    phase(f"publishing to {run.push_to_hub}")
    try:
        return hub.publish(out_path, run)
    except PublishError as e:
        raise PublishError(
            f"the merge succeeded and is kept at {out_path}, but publishing failed: {e} "
            f"— publish it later with `{hub.publish_command(out_path, run)}`"
        ) from e


def _donor_folder(cfg: ExtMergeConfig, options: MergeOptions) -> str:
    """The folder of the model whose tokenizer the output takes (mergekit's donor)."""
    donor = str(cfg.merge.base_model or cfg.merge.referenced_models()[0])
    return resolve_model_folder(
        checks.model_paths(donor)[0], what=f"model {donor}", cache_dir=options.transformers_cache
    )


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("mergekit-ext", "mergekit", "torch", "transformers", "huggingface_hub"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "unknown"
    return out


def _mergekit_options(options: MergeOptions, **changes: Any) -> MergeOptions:
    return options.model_copy(update=changes)


def _missing_parameter(cfg: ExtMergeConfig, message: str) -> Optional[str]:
    """mergekit's ``Missing required parameter weight for MODEL.TENSOR`` (the model's path
    and the tensor glued by a dot) as a message naming each and where to add it."""
    import re

    match = re.fullmatch(r"Missing required parameter (\S+) for (.+)", message.strip())
    if match is None:
        return None
    name, location = match.groups()
    refs = sorted((str(m) for m in cfg.merge.referenced_models()), key=len, reverse=True)
    for ref in refs:
        for shown in dict.fromkeys((ref, os.path.abspath(ref))):
            if location.startswith(shown + "."):
                tensor = location[len(shown) + 1 :]
                return (
                    f"{cfg.method}: parameter {name!r} is missing for the model {ref} (first "
                    f"needed by the tensor {tensor}); give it under that model's parameters: "
                    f"(e.g. {name}: 1.0), or once for every model in the top-level parameters:"
                )
    return (
        f"{cfg.method}: parameter {name!r} is missing for {location}; give it under each "
        f"model's parameters: (e.g. {name}: 1.0), or once in the top-level parameters:"
    )


def _run_tensorwise(
    cfg: ExtMergeConfig, out_dir: str, options: MergeOptions
) -> merge_record.MergeRecord:
    """mergekit's own planner and executor; its card generator is replaced by ours.

    mergekit 0.1.5's card generator asks the Hub about short relative paths and crashes
    offline, so it is switched off here and the card is written by ``hub.card``. What the
    kernels record (ACE's, WUDI's per-tensor diagnostics) is collected for this merge only
    and becomes its record.
    """
    from mergekit.merge import run_merge

    changes: dict[str, Any] = {"write_model_card": False}
    donor = checks.model_paths(str(cfg.merge.base_model or cfg.merge.referenced_models()[0]))[0]
    if os.path.isdir(donor) and not any(
        os.path.exists(os.path.join(donor, f)) for f in ("tokenizer_config.json", "tokenizer.json")
    ):
        changes["copy_tokenizer"] = False  # vision models: nothing to copy, no spurious error
    lora_cache = None
    if options.lora_merge_cache is None and any(
        "+" in str(m) for m in cfg.merge.referenced_models()
    ):
        # mergekit merges each model+LoRA into a full-size copy first: inside the hidden
        # partial output (same disk as OUT_DIR, removed with it on failure), not in $TMPDIR
        lora_cache = os.path.join(out_dir, ".lora-merge-cache")
        changes["lora_merge_cache"] = lora_cache
        LOG.info("model+LoRA inputs: full-size merged copies go to %s (removed after)", lora_cache)
    try:
        with merge_record.collecting() as collector, _no_torch_dtype_notice():
            with _workers_share_context(options):
                run_merge(
                    with_cached_snapshots(cfg.merge),
                    out_dir,
                    options=_mergekit_options(options, **changes),
                    config_source=cfg.source_text,
                )
    except RuntimeError as e:
        missing = _missing_parameter(cfg, str(e))
        if missing is None:
            raise
        raise ConfigError(missing) from e
    finally:
        if lora_cache is not None:
            shutil.rmtree(lora_cache, ignore_errors=True)
    return merge_record.MergeRecord(cfg.method, sections=collector.sections)


@contextlib.contextmanager
def _workers_share_context(options: MergeOptions) -> Iterator[None]:
    """mergekit's ``--multi-gpu`` executor runs the kernels in a thread pool, and a new
    thread starts with empty context variables: for this call its device workers run in a
    copy of the caller's context, so what the kernels record reaches this merge's collector
    (mergekit's class is as it was on return)."""
    if not options.multi_gpu:
        yield
        return
    from mergekit.multigpu_executor import MultiGPUExecutor

    worker = MultiGPUExecutor._device_worker
    context = contextvars.copy_context()

    def in_context(self: Any, *args: Any, **kwargs: Any) -> Any:
        return context.copy().run(worker, self, *args, **kwargs)

    MultiGPUExecutor._device_worker = in_context  # type: ignore[method-assign]
    try:
        yield
    finally:
        MultiGPUExecutor._device_worker = worker  # type: ignore[method-assign]


class _TorchDtypeNotice(logging.Filter):
    """Drops transformers' "`torch_dtype` is deprecated" notice, nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "`torch_dtype` is deprecated" not in record.getMessage()


@contextlib.contextmanager
def _no_torch_dtype_notice() -> Iterator[None]:
    """mergekit 0.1.5 sets ``config.torch_dtype`` on the output config
    (``mergekit.merge._model_out_config``), and transformers >= 4.56 answers with a
    deprecation notice on every run that the user cannot act on; the attribute still
    works (it sets ``dtype``). Only that message of that logger is dropped, only here."""
    logger = logging.getLogger("transformers.configuration_utils")
    notice = _TorchDtypeNotice()
    logger.addFilter(notice)
    try:
        yield
    finally:
        logger.removeFilter(notice)


def _execute(plan: Plan, out_dir: str, run: RunOptions, out_path: str) -> merge_record.MergeRecord:
    """Run the merge preflight planned on the executor of its kind (the one place that
    chooses); every executor returns the merge's :class:`~mergekit_ext.merge_record.MergeRecord`."""
    cfg, options, kind = plan.cfg, plan.options, plan.kind
    if isinstance(kind, Layerwise):
        return _run_layerwise(plan, out_dir)
    if isinstance(kind, Adaptation):
        return kind.run(
            cfg,
            out_dir,
            cfg.parameters,
            device=options.device or "cpu",
            force=run.force,
            task_layers_only=run.task_layers_only,
            trust_remote_code=options.trust_remote_code,
            body_path=_adapter_body_path(out_path),
        )
    return _run_tensorwise(cfg, out_dir, options)


def _run_layerwise(
    plan: Plan,
    out_dir: Optional[str],
    ctx: Optional[dist_context.DistributedContext] = None,
) -> merge_record.MergeRecord:
    """The sequential (or model-output) executor on the plan preflight built, built once."""
    from mergekit_ext.executor import run_layerwise_merge

    kind = plan.kind
    assert isinstance(kind, Layerwise), f"{plan.cfg.method} is not a layer-wise method"
    return run_layerwise_merge(
        plan.cfg,
        out_dir,
        plan.options,
        kind.method,
        plan.cfg.parameters,
        device=plan.options.device or "cpu",
        distributed=ctx,
        plan=plan.layerwise(),
    )


def _describe_calibration(cfg: ExtMergeConfig, options: MergeOptions) -> list[str]:
    """Each task's calibration data as the merge will read it: counts, split, first sample."""
    from mergekit_ext.calibration.sources import load_calibration

    base = str(cfg.merge.base_model) if cfg.merge.base_model else None
    lines = ["calibration:"]
    for entry in cfg.models:
        spec = cfg.calibration_for(entry)
        if entry.model == base or spec is None or not spec.has_data:
            continue
        data = load_calibration(
            spec, entry.model, task=entry.name, trust_remote_code=options.trust_remote_code
        )
        lines += [
            f"  - {entry.name}: {data.source}: {data.num_samples} samples, "
            f"{data.num_tokens} tokens",
            f"    {data.preview_line()}",
        ]
    return lines


@contextlib.contextmanager
def _plan_prints_its_warnings() -> Iterator[set[str]]:
    """Hold back the planner's warnings while a dry run describes its plan; afterwards log
    those the plan did not list itself (the caller adds the plan's lines to the yielded
    set), so that each warning is printed once."""
    held: list[logging.LogRecord] = []
    listed: set[str] = set()

    def hold(record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            held.append(record)
            return False
        return True

    planner = logging.getLogger("mergekit_ext.executor.plan")
    planner.addFilter(hold)
    try:
        yield listed
    finally:
        planner.removeFilter(hold)
        for record in held:
            if record.getMessage() not in listed:
                planner.handle(record)


def _describe_plan(plan: Plan) -> str:
    """The ``--dry-run`` text of a merge that passed preflight."""
    cfg, options, kind = plan.cfg, plan.options, plan.kind
    if isinstance(kind, Layerwise):  # the sequential executor's own plan
        layerwise = plan.layerwise()
        if plan.world.size > 1:
            return layerwise.describe() + "\n" + layerwise.describe_ranks(plan.world.size)
        return layerwise.describe()
    lines = [
        f"method: {cfg.method} ({kind.name})",
        f"base_model: {cfg.merge.base_model}",
        "models:",
        *[f"  - {m}" for m in cfg.merge.referenced_models()],
    ]
    if kind.data_aware:
        lines += _describe_calibration(cfg, options)
    sizes = []
    for ref in cfg.merge.referenced_models():
        path = checks.model_paths(str(ref))[0]
        if is_config_only(path):  # no weights yet: the size save_pretrained would write
            shapes, dtypes = config_shapes(path)
            sizes.append(
                sum(math.prod(s) * safetensors_itemsize(dtypes[k]) for k, s in shapes.items())
            )
        elif os.path.isdir(path):
            sizes.append(
                sum(
                    os.path.getsize(os.path.join(path, f))
                    for f in os.listdir(path)
                    if f.endswith(".safetensors")
                )
            )
    if sizes:
        lines.append(
            f"largest input: {max(sizes) / 2**30:.2f} GiB; mergekit streams tensors, peak memory ≈ a few tensors per input"
        )
    return "\n".join(lines)
