"""mergekit's ``MergeConfiguration`` plus mergekit-ext's additions.

A mergekit-ext YAML is a mergekit YAML with two optional additions:

- ``calibration:`` at the top level (defaults for every model) and inside a model entry
  (that model's data), see :class:`~mergekit_ext.calibration.config.CalibrationSpec`;
- ``name:`` inside a model entry (the task's name; default: the folder name).

mergekit ignores unknown keys, so we parse them here and hand the rest to mergekit.
"""

from __future__ import annotations

import difflib
import hashlib
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

from mergekit.config import MergeConfiguration
from pydantic import ValidationError

from mergekit_ext.calibration.config import CalibrationSpec, rename_deprecated_fields
from mergekit_ext.errors import ConfigError, ConfigFileNotFoundError
from mergekit_ext.yaml_input import load_yaml

LOG = logging.getLogger(__name__)

_MODEL_EXTRA_KEYS = ("calibration", "name")
_MODEL_KEYS = sorted(["model", "parameters", *_MODEL_EXTRA_KEYS])

# A task name becomes a folder (SyMerge's ``tasks/<name>``): one plain path component.
_SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


def check_task_name(name: str, where: str) -> None:
    """Refuse a task name that is not one safe path component (letters, digits, ``-_.``)."""
    if _SAFE_NAME.match(name) and name not in (".", ".."):
        return
    raise ConfigError(
        f"{where}: task name {name!r} is not allowed: it names a folder of the output; use "
        "letters, digits, '-', '_' and '.' only (not '.' or '..', no '/')"
    )


@dataclass
class ExtModelEntry:
    """One entry of ``models:`` with the mergekit-ext additions."""

    model: str  # as written in the YAML (path, hub id, or base+lora)
    name: str
    calibration: Optional[CalibrationSpec]


@dataclass
class ExtMergeConfig:
    merge: MergeConfiguration
    source_text: str
    raw: dict[str, Any]
    models: list[ExtModelEntry]
    calibration_defaults: Optional[CalibrationSpec]
    base_dir: str  # folder of the YAML file; relative paths resolve against the CWD like mergekit
    path: Optional[str] = None  # the YAML file, when read from one

    @property
    def method(self) -> str:
        return self.merge.merge_method

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.source_text.encode("utf-8")).hexdigest()

    @property
    def parameters(self) -> dict[str, Any]:
        return dict(self.raw.get("parameters") or {})

    def calibration_for(self, entry: ExtModelEntry) -> Optional[CalibrationSpec]:
        if entry.calibration is not None:
            return entry.calibration.merged_with(self.calibration_defaults)
        if self.calibration_defaults is not None and self.calibration_defaults.has_data:
            return self.calibration_defaults
        return None

    def check_data_aware(self, method: str) -> None:
        """The inputs every data-aware method needs, checked in one place for every path
        (``mergekit-ext run``'s validation, the executor's plan, SyMerge): a base model, and
        calibration data for every expert."""
        base = str(self.merge.base_model) if self.merge.base_model else None
        if base is None:
            raise ConfigError(f"{method} needs base_model (the pretrained model the experts share)")
        missing = [
            e.model
            for e in self.models
            if e.model != base
            and (self.calibration_for(e) is None or not self.calibration_for(e).has_data)
        ]
        if missing:
            raise ConfigError(
                f"{method} needs calibration data: add a `calibration:` section (top level, "
                f"or per model: {{path: data.jsonl, field: text}}) for {', '.join(missing)}"
            )


def _task_name(model: str) -> str:
    """The default task name: the folder name, made one safe path component."""
    path = model.split("+")[-1].split("@")[0].rstrip("/")
    name = os.path.basename(os.path.abspath(path) if path in ("", ".", "..") else path)
    name = re.sub(r"[^A-Za-z0-9._-]", "_", name or "model")
    return name if name not in (".", "..") else "model"


def parse_config(
    source_text: str, config_path: str = "<string>", *, warn_unknown: bool = True
) -> ExtMergeConfig:
    """Parse and validate a YAML text; errors name the field and say what to do.

    ``warn_unknown=False``: no warning for unknown keys (``dtyp:``), for a config that was
    checked before (the copy a merge writes into its output folder, read for its card).
    """
    raw = load_yaml(source_text, config_path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{config_path}: expected a YAML mapping with merge_method and models")
    if "merge_method" not in raw:
        raise ConfigError(f"{config_path}: missing required field 'merge_method'")

    defaults = None
    if raw.get("calibration") is not None:
        defaults = _parse_calibration(raw["calibration"], f"{config_path}: calibration")

    if "models" in raw and not raw["models"] and not raw.get("slices"):
        raise ConfigError(
            f"{config_path}: the `models:` list is empty; list the models to merge "
            "(- model: ./expert-a, ...) and set base_model where the method needs one"
        )
    warn = _warn_unknown_keys if warn_unknown else _ignore_unknown_keys
    warn(raw, sorted([*MergeConfiguration.model_fields, "calibration"]), config_path)
    entries: list[ExtModelEntry] = []
    mk_raw = {k: v for k, v in raw.items() if k != "calibration"}
    if isinstance(raw.get("models"), list):
        clean_models = []
        for i, m in enumerate(raw["models"]):
            if not isinstance(m, dict) or "model" not in m:
                raise ConfigError(f"{config_path}: models[{i}] needs a 'model' field")
            model = str(m["model"])
            warn(m, _MODEL_KEYS, f"{config_path}: models[{i}] ({model})")
            cal = None
            if m.get("calibration") is not None:
                cal = _parse_calibration(
                    m["calibration"], f"{config_path}: models[{i}] ({model}).calibration"
                )
            name = _task_name(model) if m.get("name") is None else str(m["name"])
            check_task_name(name, f"{config_path}: models[{i}] ({model}).name")
            entries.append(ExtModelEntry(model=model, name=name, calibration=cal))
            clean_models.append({k: v for k, v in m.items() if k not in _MODEL_EXTRA_KEYS})
        mk_raw["models"] = clean_models
        names = [e.name for e in entries]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(
                f"{config_path}: duplicate task name(s) {dupes}; give each model entry a unique 'name:'"
            )
    _refuse_empty_parameters(raw, config_path)
    try:
        merge = MergeConfiguration.model_validate(mk_raw)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        raise ConfigError(f"{config_path}: field '{loc}': {first['msg']}") from e
    except Exception as e:  # mergekit's own validators raise RuntimeError
        raise ConfigError(f"{config_path}: {e}") from e
    _check_dtypes(merge, config_path)
    return ExtMergeConfig(
        merge=merge,
        source_text=source_text,
        raw=raw,
        models=entries,
        calibration_defaults=defaults,
        base_dir=os.path.dirname(os.path.abspath(config_path))
        if config_path != "<string>"
        else os.getcwd(),
        path=config_path if config_path != "<string>" else None,
    )


def _ignore_unknown_keys(mapping: dict[str, Any], known: list[str], where: str) -> None:
    pass


def _refuse_empty_parameters(raw: dict[str, Any], where: str) -> None:
    """``compute_dtype:`` with no value (null) failed in mergekit's ``ConditionalParameter``
    validator, whose message names its own internals."""
    found = [("parameters", raw.get("parameters"))]
    models = raw.get("models") if isinstance(raw.get("models"), list) else []
    found += [
        (f"models[{i}] ({m.get('model')}).parameters", m.get("parameters"))
        for i, m in enumerate(models)
        if isinstance(m, dict)
    ]
    for place, params in found:
        if not isinstance(params, dict):
            continue
        for key, value in params.items():
            if value is None:
                raise ConfigError(
                    f"{where}: {place}.{key} has no value (null); give it one, or remove "
                    "the line to use the default"
                )


def _check_dtypes(merge: MergeConfiguration, where: str) -> None:
    """``dtype: float33`` failed deep in mergekit (``Unimplemented dtype``), naming no field."""
    from mergekit.common import dtype_from_name

    for key in ("dtype", "out_dtype"):
        value = getattr(merge, key, None)
        try:
            dtype_from_name(value)
        except RuntimeError:
            raise ConfigError(
                f"{where}: {key}: {value!r} is not a dtype mergekit knows; use bfloat16, "
                "float16, float32 or float64"
            ) from None


def _warn_unknown_keys(mapping: dict[str, Any], known: list[str], where: str) -> None:
    """mergekit ignores keys it does not know: a typo (``dtyp:``) would merge with a default."""
    for key in mapping:
        if key in known:
            continue
        close = difflib.get_close_matches(str(key), known, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f"; known: {', '.join(known)}"
        LOG.warning("%s: unknown key '%s' is ignored%s", where, key, hint)


def load_config(config_path: str) -> ExtMergeConfig:
    """Read and parse the YAML at ``config_path``: a file, or a stream such as
    ``/dev/stdin`` or ``<(...)`` (read once; everything later uses the text read)."""
    if not os.path.exists(config_path) or os.path.isdir(config_path):
        raise ConfigFileNotFoundError(f"config file not found: {config_path}")
    with open(config_path, "rb") as fp:
        data = fp.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{config_path} is not a YAML text file (byte {e.start} is not UTF-8); give the "
            "merge config, a .yml file"
        ) from None
    return parse_config(text, config_path)


def _parse_calibration(value: Any, where: str) -> CalibrationSpec:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping such as {{path: data.jsonl, field: text}}")
    try:
        return CalibrationSpec.model_validate(rename_deprecated_fields(value, where))
    except ValueError as e:
        if not isinstance(e, ValidationError):
            raise ConfigError(f"{where}: {e}") from e
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"])
        if first["type"] == "extra_forbidden":
            allowed = sorted(CalibrationSpec.model_fields)
            close = difflib.get_close_matches(loc, allowed, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else f"; allowed: {', '.join(allowed)}"
            raise ConfigError(f"{where}: unknown field '{loc}'{hint}") from e
        raise ConfigError(f"{where}: field '{loc}': {first['msg']}") from e
