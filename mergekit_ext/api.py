"""The public Python API: one call merges a YAML config with any method, ours or mergekit's.

mergekit's ``mergekit.merge.run_merge`` takes a ``MergeConfiguration``, which drops
mergekit-ext's additions (``calibration:``, ``name:``) and can only run tensor-wise methods.
:func:`run_merge` takes the same YAML as ``mergekit-ext run`` and runs it exactly as the
command does (the same checks, executors, atomic output folder, diagnostics and card)::

    import mergekit_ext

    result = mergekit_ext.run_merge("chain_of_merges.yml", "./merged", {"random_seed": 0})
    result.path, result.diagnostics        # the output folder, the diagnostics JSON
    mergekit_ext.run_merge("chain_of_merges.yml", "./merged", run_options={"dry_run": True}).plan
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Union

import pydantic
import yaml
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions

from mergekit_ext.config import ExtMergeConfig, load_config, parse_config
from mergekit_ext.errors import ConfigError, MergekitExtError
from mergekit_ext.hub.actions import HubActions
from mergekit_ext.preflight import check_merge_options, merge_option_problem
from mergekit_ext.runner import RunOptions, run_merge_config

ConfigLike = Union[str, "os.PathLike[str]", Mapping[str, Any], ExtMergeConfig, MergeConfiguration]


_MODEL_OBJECT_HINT = (
    "pass folders or Hub ids; save in-memory models with save_pretrained first "
    "(model.save_pretrained('./expert-a'), then model: ./expert-a)"
)


def _is_model_object(value: Any) -> bool:
    """A transformers/PEFT model or a torch module (what users have in memory)."""
    import torch

    return isinstance(value, torch.nn.Module) or callable(getattr(value, "save_pretrained", None))


def _refuse_model_objects(value: Any, where: str) -> None:
    """Every value of a config mapping must be YAML data; a model object says what to do."""
    if _is_model_object(value):
        raise ConfigError(f"run_merge: {where} is a {type(value).__name__}; {_MODEL_OBJECT_HINT}")
    if isinstance(value, Mapping):
        for key, item in value.items():
            _refuse_model_objects(item, f"{where}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _refuse_model_objects(item, f"{where}[{i}]")


def as_config(config: ConfigLike) -> ExtMergeConfig:
    """An :class:`ExtMergeConfig` from a YAML file path, a parsed YAML mapping or a config object.

    Args:
        config: the path of a YAML file; a mapping as ``yaml.safe_load`` returns it; an
            :class:`ExtMergeConfig`; or mergekit's ``MergeConfiguration`` (which holds no
            calibration data: a data-aware method then asks for it).

    Returns:
        The parsed config.
    """
    if isinstance(config, ExtMergeConfig):
        return config
    if _is_model_object(config):
        raise ConfigError(f"run_merge: config is a {type(config).__name__}; {_MODEL_OBJECT_HINT}")
    if isinstance(config, MergeConfiguration):
        return parse_config(config.to_yaml(), "<MergeConfiguration>")
    if isinstance(config, Mapping):
        _refuse_model_objects(config, "config")
        return parse_config(yaml.safe_dump(dict(config), sort_keys=False), "<mapping>")
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if "\n" in path:
            raise ConfigError(
                "run_merge takes the path of a YAML file; for YAML text use "
                "mergekit_ext.parse_config(text)"
            )
        return load_config(path)
    raise ConfigError(
        f"run_merge: config must be a YAML path, a mapping, an ExtMergeConfig or a "
        f"MergeConfiguration, not {type(config).__name__}"
    )


@dataclass(frozen=True, eq=False)
class MergeResult:
    """What :func:`run_merge` did.

    - ``path``: the absolute output folder (None for a dry run, which writes nothing);
    - ``diagnostics``: the merge's diagnostics (``merge_diagnostics.json``; empty when none);
    - ``plan``: the ``--dry-run`` text (None after a merge).

    Where a path was returned before, the result still works as one: ``os.fspath(result)``,
    ``str(result)`` and ``result == "/abs/out"`` use ``path``.
    """

    path: Optional[str]
    diagnostics: dict[str, Any] = field(default_factory=dict)
    plan: Optional[str] = None

    @property
    def dry_run(self) -> bool:
        return self.path is None

    def __fspath__(self) -> str:
        if self.path is None:
            raise TypeError("a dry run writes nothing, so it has no output path; see .plan")
        return self.path

    def __str__(self) -> str:
        return self.path if self.path is not None else (self.plan or "")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MergeResult):
            return (self.path, self.plan) == (other.path, other.plan)
        if isinstance(other, (str, os.PathLike)) and self.path is not None:
            return self.path == os.fspath(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.path, self.plan))


def _checked_keys(values: Mapping[str, Any], known: list[str], what: str) -> None:
    for key in values:
        if key in known:
            continue
        if what == "options" and key in _RUN_OPTION_KEYS:
            raise ConfigError(
                f"run_merge: {key!r} is one of mergekit-ext's own options: pass it as "
                f"run_options={{{key!r}: ...}} (or mergekit_ext.RunOptions({key}=...))"
            )
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; known: {', '.join(known)}"
        raise ConfigError(f"run_merge: unknown {what} key {key!r}{hint}")


_RUN_OPTION_KEYS = sorted(f.name for f in fields(RunOptions))


def _merge_options(options: Optional[Union[MergeOptions, Mapping[str, Any]]]) -> MergeOptions:
    if options is None:
        return MergeOptions()
    if isinstance(options, MergeOptions):
        return options
    if not isinstance(options, Mapping):
        raise ConfigError(
            f"run_merge: options must be mergekit's MergeOptions or a mapping of its fields, "
            f"not {type(options).__name__}"
        )
    _checked_keys(options, sorted(MergeOptions.model_fields), "options")
    for name, value in options.items():  # before pydantic, whose text names no option
        problem = merge_option_problem(name, value)
        if problem is not None:
            raise ConfigError(f"run_merge: options[{name!r}] {problem}")
    try:
        return MergeOptions.model_validate(dict(options))
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        name = ".".join(str(p) for p in first["loc"])
        raise ConfigError(
            f"run_merge: options[{name!r}] = {first.get('input')!r}: {first['msg']}"
        ) from None


def _checked_run_options(run: RunOptions) -> RunOptions:
    """A dataclass takes any value: ``overwrite='yes please'`` would count as True."""
    for f in fields(RunOptions):
        value = getattr(run, f.name)
        if f.type in (bool, "bool") and not isinstance(value, bool):
            raise ConfigError(
                f"run_merge: run_options[{f.name!r}] must be True or False, not {value!r}"
            )
    return run


def _run_options(run_options: Optional[Union[RunOptions, Mapping[str, Any]]]) -> RunOptions:
    if run_options is None:
        return RunOptions()
    if isinstance(run_options, RunOptions):
        return _checked_run_options(run_options)
    if not isinstance(run_options, Mapping):
        raise ConfigError(
            f"run_merge: run_options must be mergekit_ext.RunOptions or a mapping of its "
            f"fields, not {type(run_options).__name__}"
        )
    _checked_keys(run_options, _RUN_OPTION_KEYS, "run_options")
    return _checked_run_options(RunOptions(**dict(run_options)))


# The command line's flags in messages, as a Python caller writes them.
_API_SPELLING = (
    ("rerun with --overwrite", "rerun with run_options={'overwrite': True}"),
    ("pass --overwrite", "pass run_options={'overwrite': True}"),
    ("--overwrite refused", "overwrite=True refused"),
)


def _in_python_terms(error: MergekitExtError) -> None:
    message = str(error)
    for flag, python in _API_SPELLING:
        message = message.replace(flag, python)
    if message != str(error):
        error.args = (message,)


def run_merge(
    config: ConfigLike,
    out_path: Union[str, os.PathLike[str]],
    options: Optional[Union[MergeOptions, Mapping[str, Any]]] = None,
    run_options: Optional[Union[RunOptions, Mapping[str, Any]]] = None,
) -> MergeResult:
    """Merge ``config`` into ``out_path``, as ``mergekit-ext run CONFIG OUT`` does.

    Args:
        config: see :func:`as_config`; calibration data and task names included. Models
            are folders or Hub ids, never model objects (save those with
            ``save_pretrained`` first).
        out_path: the output folder; it must not exist unless ``run_options.overwrite``.
        options: mergekit's options (``MergeOptions`` or a mapping of its fields:
            ``device``, ``random_seed``, ``out_shard_size``, ``allow_crimes`` ...); an
            unknown key is an error naming the nearest valid one.
        run_options: mergekit-ext's own options (``RunOptions`` or a mapping of its fields:
            overwrite, dry_run, allow_pickle, SyMerge's force / task_layers_only,
            push_to_hub ...).

    Returns:
        A :class:`MergeResult`: the absolute output folder and the diagnostics, or for a
        dry run the plan (printed by ``mergekit-ext run --dry-run``; not printed here).

    Raises:
        MergekitExtError: bad input (the message says what to do); nothing is written.
    """
    if not isinstance(out_path, (str, os.PathLike)):
        raise ConfigError(
            f"run_merge: out_path must be the output folder (a str or path), not "
            f"{type(out_path).__name__}"
        )
    merge_options = _merge_options(options)
    check_merge_options(merge_options, lambda name: f"run_merge: options[{name!r}]")
    run = _run_options(run_options)
    cfg = as_config(config)
    plans: list[str] = []
    try:
        path = run_merge_config(
            cfg, os.fspath(out_path), merge_options, run, hub=HubActions(), show_plan=plans.append
        )
    except MergekitExtError as e:
        _in_python_terms(e)
        raise
    if run.dry_run:
        return MergeResult(path=None, plan="\n".join(plans) or None)
    if path is None:  # a rank other than 0 of a distributed merge: rank 0 writes
        return MergeResult(path=None)
    from mergekit_ext import merge_record

    return MergeResult(path=path, diagnostics=merge_record.load(path))


# ------------------------------------------------------------------------------------------
# diagnose, card, publish: what the commands of the same names run (they print; these return)


def _check_diagnose_outputs(
    cfg: ExtMergeConfig,
    merged_dirs: list[str],
    outputs: list[tuple[str, str]],
    heldout: Optional[list[str]] = None,
) -> None:
    """``--json`` / ``--plots`` may not be nor lie inside an input: the config's models,
    tokenizer source, data and config, the held-out data, and the merged folders themselves
    (their own records)."""
    from mergekit_ext.checks import local_input_paths
    from mergekit_ext.output import check_write_path

    inputs = [*local_input_paths(cfg), *merged_dirs]
    inputs += [h.split("=", 1)[-1] for h in heldout or [] if not h.lstrip().startswith("{")]
    for option, out in outputs:
        check_write_path(
            out,
            inputs,
            what=option,
            folder=option == "--plots",
            advice="write it outside every model, data file and config the diagnosis reads "
            "(`mergekit-ext card MERGED_DIR --diagnose CONFIG` keeps a diagnosis with the merge)",
        )


def write_diagnosis_json(result: Union[dict[str, Any], list[dict[str, Any]]], path: str) -> None:
    """Write a diagnosis as JSON (``inf``/``nan`` as strings)."""
    import json

    from mergekit_ext.diagnose import jsonable
    from mergekit_ext.output import write_file

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_file(path, json.dumps(jsonable(result), indent=2) + "\n")


def diagnose_merge(
    merged: Union[str, os.PathLike[str], list[Union[str, os.PathLike[str]]]],
    config: ConfigLike,
    *,
    heldout: Union[str, list[str], tuple[str, ...]] = (),
    calibration_data: bool = False,
    references: bool = True,
    probe: bool = True,
    device: str = "cpu",
    trust_remote_code: bool = False,
    json_path: Optional[str] = None,
    plots_dir: Optional[str] = None,
    progress: bool = True,
) -> Union[dict[str, Any], list[dict[str, Any]]]:
    """Compare merged folders with each expert of ``config``, as ``mergekit-ext diagnose``
    (``mergekit_ext.diagnose`` is the subpackage, hence this name).

    Args:
        merged: one merged folder (the result is a dict) or several (a list of dicts,
            sharing the experts' passes).
        config: the merge YAML (see :func:`as_config`).
        heldout: ``--heldout`` values (a path, ``TASK=PATH``, a YAML file or an inline
            mapping); ``calibration_data``: measure on what the merge read instead.
        references: the base model and each expert alone as reference rows (the verdict).
        probe: also measure on the generic prose probe (text models).
        json_path / plots_dir: also write the JSON / the per-block plot there (never into
            an input).
        progress: a progress bar on stderr.

    Returns:
        The diagnosis (``docs/methods.md``, "Diagnose"; ``verdict`` in words).
    """
    from mergekit_ext.diagnose import diagnose as run_diagnosis
    from mergekit_ext.diagnose import plot_block_errors

    cfg = as_config(config)
    single = isinstance(merged, (str, os.PathLike))
    dirs = [os.fspath(merged)] if single else [os.fspath(m) for m in merged]  # type: ignore[union-attr]
    values = [heldout] if isinstance(heldout, str) else list(heldout)
    plot_file = os.path.join(plots_dir, "diagnose_block_errors.png") if plots_dir else None
    outputs = [("--json", json_path), ("--plots", plots_dir), ("--plots", plot_file)]
    _check_diagnose_outputs(cfg, dirs, [(o, p) for o, p in outputs if p], values)
    results = run_diagnosis(
        cfg,
        dirs,
        device=device,
        trust_remote_code=trust_remote_code,
        heldout=values,
        data="calibration" if calibration_data else "heldout",
        references=references,
        probe=probe,
        progress=progress,
    )
    assert isinstance(results, list)
    if json_path:
        write_diagnosis_json(results[0] if len(results) == 1 else results, json_path)
    if plots_dir:
        plot_block_errors(results, plots_dir, "diagnose_block_errors.png")
    return results[0] if single else results


@dataclass(frozen=True)
class CardResult:
    """What :func:`write_card` did: the card's path, where a hand-edited card it replaced
    was kept (None), and the diagnosis it shows (None without ``diagnose_config``)."""

    path: str
    backup: Optional[str] = None
    diagnosis: Optional[dict[str, Any]] = None


def _check_card_outputs(
    out_dir: str, given: list[Optional[str]], diagnose_config: Optional[str]
) -> None:
    """What ``card`` writes (README.md, images/, the diagnosis) may not be nor lie inside
    a file it reads: ``--eval``, ``--template-dir``, and every input of ``--diagnose``."""
    from mergekit_ext.hub.card import DIAGNOSE_FILENAME, EVAL_FILENAME, README_FILENAME
    from mergekit_ext.output import check_file_destination, check_write_path

    for name in (README_FILENAME, DIAGNOSE_FILENAME, EVAL_FILENAME):  # written new, never a link
        check_file_destination(os.path.join(out_dir, name))
    inputs = [p for p in given if p]
    if diagnose_config:
        from mergekit_ext.checks import local_input_paths

        inputs += local_input_paths(load_config(diagnose_config))
    for name in ("", README_FILENAME, "images", DIAGNOSE_FILENAME, EVAL_FILENAME):
        check_write_path(
            os.path.join(out_dir, name) if name else out_dir,
            inputs,
            what="the model card",
            advice="the card is written into OUT_DIR (README.md, images/): keep --eval, "
            "--template-dir and the models and data of --diagnose outside it",
        )


def _card_diagnosis(out_dir: str, config_path: str, device: str) -> dict[str, Any]:
    """Diagnose ``out_dir`` for its card (no local path in it); saved next to it."""
    import json

    from mergekit_ext.diagnose import jsonable
    from mergekit_ext.hub.card import DIAGNOSE_FILENAME, display_path
    from mergekit_ext.output import write_file

    result = diagnose_merge(out_dir, config_path, device=device)
    assert isinstance(result, dict)
    result["config"] = os.path.basename(config_path)
    result["merged"] = os.path.basename(os.path.abspath(out_dir))

    def shown(label: str) -> str:
        return "+".join(display_path(p) for p in str(label).split("+"))

    refs = result.get("references") or {}
    rows = [
        result,
        *([refs["base"]] if refs.get("base") else []),
        *refs.get("experts", {}).values(),
    ]
    for row in rows:
        if row is not result:
            row["model"] = shown(row["model"])
        for part in (row["tasks"], (row.get("probe") or {}).get("tasks") or {}):
            for task in part.values():
                task["model"] = shown(task["model"])
    for data in (result.get("data") or {}).values():
        local = str(data["source"])
        data["source"] = display_path(local)
        data["note"] = data["note"].replace(local, data["source"])
    write_file(
        os.path.join(out_dir, DIAGNOSE_FILENAME), json.dumps(jsonable(result), indent=2) + "\n"
    )
    return result


def write_card(
    out_dir: Union[str, os.PathLike[str]],
    *,
    eval_results: Optional[Union[str, list[dict[str, Any]], dict[str, Any]]] = None,
    name: Optional[str] = None,
    repo_id: Optional[str] = None,
    template_dir: Optional[str] = None,
    diagnose_config: Optional[str] = None,
    device: str = "cpu",
    force: bool = False,
) -> CardResult:
    """Rebuild ``README.md`` (and ``images/``) of a finished merge, as ``mergekit-ext card``.

    Args:
        out_dir: the merged folder.
        eval_results: an evaluation results JSON file (`mergekit-ext eval`'s, lm-eval's own
            results JSON, or our list), or its parsed content; kept in OUT_DIR as
            ``mergekit_ext_eval.json`` so that the next ``card`` and ``publish`` show it too.
        name / repo_id / template_dir: the card's title, the repo id of its loading snippet,
            your own templates.
        diagnose_config: a merge YAML: diagnose the folder against its experts and add the
            section (the diagnosis is saved as ``mergekit_ext_diagnose.json``).
        force: replace a README.md edited by hand (kept as ``README.md.bak``).

    Raises:
        CardError: a README.md edited by hand without ``force`` (checked before the diagnosis).
    """
    from mergekit_ext.hub.card import keep_edited_card, load_eval_results, write_model_card
    from mergekit_ext.hub.card.tools import card_source

    out = os.fspath(out_dir)
    eval_path = eval_results if isinstance(eval_results, str) else None
    source = card_source(out)
    if diagnose_config and source in ("moe", "lora"):  # refused before the (slow) diagnosis
        tool = "mergekit-moe" if source == "moe" else "mergekit-extract-lora"
        raise ConfigError(
            f"--diagnose compares a merge with its experts; {out} is the output of {tool}, "
            "whose card has no diagnosis section: drop --diagnose"
        )
    _check_card_outputs(out, [eval_path, template_dir], diagnose_config)
    if not force:  # refused before the (slow) diagnosis
        keep_edited_card(out, force=False)
    results = load_eval_results(eval_path) if eval_path else eval_results
    diagnosis = _card_diagnosis(out, diagnose_config, device) if diagnose_config else None
    backup = keep_edited_card(out, force=force)
    path = write_model_card(
        out,
        eval_results=results,  # type: ignore[arg-type]
        name=name,
        repo_id=repo_id,
        template_dir=template_dir,
        diagnose=diagnosis,
        force=True,  # checked (and kept) just above
    )
    return CardResult(path, backup, diagnosis)


def publish(out_dir: Union[str, os.PathLike[str]], repo_id: str, **options: Any) -> str:
    """Upload a finished merge to the Hub in one commit, as ``mergekit-ext publish``;
    returns the commit (or pull request) URL, or with ``dry_run=True`` what would be
    uploaded. ``options``: those of ``mergekit_ext.hub.publish.publish_folder``
    (``private``, ``revision``, ``token``, ``dry_run``, ``timeout``, ...)."""
    from mergekit_ext.hub.publish import publish_folder

    return publish_folder(os.fspath(out_dir), repo_id, **options)
