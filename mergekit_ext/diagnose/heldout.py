"""Which data ``mergekit-ext diagnose`` measures on: held-out examples, ``--heldout``, or seen.

By default the examples of each task's calibration source that the merge did not read;
``--heldout`` names other data; a task with no unused example falls back to its calibration
data and says so (``docs/methods.md``, "Diagnose").
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, Literal, Optional

from pydantic import ValidationError

from mergekit_ext.calibration.config import CalibrationSpec
from mergekit_ext.calibration.sources import (
    CalibrationData,
    NoUnusedCalibrationData,
    load_calibration,
    same_source,
)
from mergekit_ext.diagnose.probe import PROBE_NAME, diversity_warnings, load_probe
from mergekit_ext.diagnose.task import DiagnosisTask
from mergekit_ext.errors import CalibrationError, ConfigError, ConfigFileNotFoundError
from mergekit_ext.yaml_input import load_yaml

LOG = logging.getLogger(__name__)

DataMode = Literal["heldout", "calibration"]


def parse_heldout(values: Sequence[str]) -> dict[Optional[str], dict[str, Any]]:
    """``--heldout`` values as calibration-style mappings by task (``None``: every task).

    Each value is one of

    - ``PATH``: a data file or folder, read like ``calibration: {path: PATH}``;
    - ``TASK=PATH``: the same, for one task;
    - ``FILE.yml`` / ``FILE.yaml`` or an inline mapping ``{split: validation, samples: 64}``:
      ``calibration:`` fields for every task, and per task under ``tasks: {NAME: {...}}``.

    Unset fields come from the task's calibration (``max_length``, ``field``, ...; the data
    fields only when the mapping names no data, e.g. ``{split: validation}``).
    """
    out: dict[Optional[str], dict[str, Any]] = {}

    def add(task: Optional[str], mapping: Any, where: str) -> None:
        if not isinstance(mapping, dict):
            raise ConfigError(f"--heldout {where}: expected a mapping of calibration fields")
        try:
            CalibrationSpec.model_validate(mapping)
        except ValidationError as e:
            first = e.errors()[0]
            loc = ".".join(str(x) for x in first["loc"])
            if first["type"] == "extra_forbidden":
                hint = (
                    f"; per-task fields go under `tasks:` (tasks: {{{loc}: {{path: ...}}}})"
                    if task is None and isinstance(mapping.get(loc), dict)
                    else f"; the fields are those of calibration: ({', '.join(sorted(CalibrationSpec.model_fields))})"
                )
                raise ConfigError(f"--heldout {where}: unknown field '{loc}'{hint}") from None
            raise ConfigError(
                f"--heldout {where}: {loc} = {first.get('input')!r}: {first['msg'].lower()}"
            ) from None
        except ValueError as e:
            raise ConfigError(f"--heldout {where}: {e}") from None
        out.setdefault(task, {}).update(mapping)

    for value in values:
        text = value.strip()
        if text.startswith("{") or text.lower().endswith((".yml", ".yaml")):
            if text.startswith("{"):
                mapping = load_yaml(text, f"--heldout {value}")
            else:
                if not os.path.isfile(text):
                    raise ConfigFileNotFoundError(f"--heldout {value}: no such file")
                with open(text, encoding="utf-8") as fp:
                    mapping = load_yaml(fp.read(), text) or {}
            if not isinstance(mapping, dict):
                raise ConfigError(f"--heldout {value}: expected a mapping of calibration fields")
            per_task = mapping.pop("tasks", None) or {}
            if mapping:
                add(None, mapping, value)
            if not isinstance(per_task, dict):
                raise ConfigError(f"--heldout {value}: `tasks:` must map task names to fields")
            for task, fields in per_task.items():
                add(str(task), fields, f"{value} (task {task})")
        elif "=" in text and not os.path.exists(text):
            task, path = text.split("=", 1)
            add(task.strip(), {"path": path.strip()}, value)
        else:
            add(None, {"path": text}, value)
    return out


def evaluation_spec(
    task: DiagnosisTask, heldout: dict[Optional[str], dict[str, Any]]
) -> CalibrationSpec:
    """The task's ``--heldout`` mapping over its calibration (or the calibration itself)."""
    fields = {**heldout.get(None, {}), **heldout.get(task.name, {})}
    if not fields:
        return task.calibration
    return CalibrationSpec.model_validate(fields).merged_with(task.calibration)


def load_evaluation_data(
    task: DiagnosisTask,
    merge_specs: Sequence[CalibrationSpec],
    mode: DataMode,
    modality: str,
    trust_remote_code: bool,
    method: Optional[str] = None,
    reads_data: bool = True,
) -> None:
    """Load the task's evaluation data and describe it in ``task.data_info``.

    ``reads_data``: the merge method reads calibration data; a data-free method (``method``,
    e.g. SLERP) read nothing, so nothing is left out and the note says so.
    """

    def load(spec: CalibrationSpec, exclude: Sequence[CalibrationSpec]) -> CalibrationData:
        return load_calibration(
            spec,
            task.data_path,
            task=task.name,
            modality=modality,
            trust_remote_code=trust_remote_code,
            exclude=exclude,
        )

    given = task.evaluation is not None
    spec = task.evaluation or task.calibration
    fallback: Optional[str] = None
    if mode == "calibration":
        data = load(task.calibration, ())
    else:
        try:
            data = load(spec, merge_specs)
        except NoUnusedCalibrationData as e:
            fallback = str(e)
            data = load(task.calibration, ())
    if not data.batches:
        raise CalibrationError(f"model {task.label} (task {task.name!r}): no evaluation batches")
    heldout = (mode == "heldout" and fallback is None) or not reads_data
    amount = f"{data.num_samples} samples, {data.num_tokens} tokens of {data.source}"
    if data.split:
        amount += f" ({data.split})"
    data_free = f"the merge read no data: {method or 'its method'} is data-free"
    if not reads_data:
        note = f"{'--heldout data' if given else 'data'}: {amount} ({data_free})"
    elif heldout and given:
        note = f"held-out data (--heldout): {amount}"
        if data.rows_excluded:
            note += f", leaving out the {data.rows_excluded} examples the merge read"
    elif heldout:
        note = f"held-out data: {amount} that the merge did not read (it read {data.rows_excluded})"
    elif fallback is not None:
        note = (
            f"SEEN DATA: no example of {spec.describe()} is left that the merge did not read, "
            f"so this task is measured on its calibration data ({amount}); its numbers flatter "
            "the merge. Give held-out data with --heldout"
        )
        LOG.warning("task %s: %s", task.name, note)
    else:
        note = (
            f"calibration data (--calibration-data): {amount}, all read by the merge; "
            "the numbers flatter the merge"
        )
    warnings: list[str] = []
    # the diversity of what the merge fitted: the evaluation rows stand for it when they come
    # from the calibration's own source (the default, or --heldout '{samples: ...}')
    if reads_data and modality == "text" and (not given or same_source(spec, task.calibration)):
        warnings = diversity_warnings(data, f"task {task.name}'s calibration source")
        for w in warnings:
            LOG.info("%s", w)  # printed with the data lines of the report
    task.data = data
    task.data_info = {
        "kind": "held-out" if heldout else "calibration",
        "heldout": heldout,
        "source": data.source,
        "split": data.split,
        "samples": data.num_samples,
        "tokens": data.num_tokens,
        "sha256": data.sha256,
        "excluded_examples": data.rows_excluded,
        "note": note,
        "warnings": warnings,
    }


def load_probe_data(task: DiagnosisTask, trust_remote_code: bool, as_evaluation: bool) -> None:
    """The generic prose probe for a text task (:mod:`~mergekit_ext.diagnose.probe`).

    ``as_evaluation``: the task has no data of its own (a data-free merge without
    ``--heldout``): the probe is its evaluation data too, and is run once.
    """
    batch_size = task.calibration.batch_size if task.calibration.has_data else 8
    data = load_probe(task.name, task.data_path, batch_size, trust_remote_code)
    info = {
        "kind": "probe",
        "heldout": True,
        "source": PROBE_NAME,
        "split": data.split,
        "samples": data.num_samples,
        "tokens": data.num_tokens,
        "sha256": data.sha256,
        "excluded_examples": 0,
        "note": f"probe: {data.num_samples} samples, {data.num_tokens} tokens of {PROBE_NAME}",
        "warnings": [],
    }
    task.probe, task.probe_info = data, info
    if as_evaluation:
        task.data = data
        task.data_info = {
            **info,
            "note": info["note"] + " (the task has no data of its own; --heldout gives some)",
        }
