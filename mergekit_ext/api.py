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
from mergekit_ext.runner import (
    RunOptions,
    check_merge_options,
    merge_option_problem,
    run_merge_config,
)

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
