"""The diagnostics written next to every merge as ``mergekit_ext_diagnostics.json``.

Schema (``schema_version`` 1), stable and read by the model card::

    {
      "schema_version": 1,
      "mergekit_ext_version": "0.1.0",
      "method": "ace",                      # the merge_method of the config
      "parameters": {...},                   # the config's global parameters
      "seed": 0 | null,
      "config_sha256": "...",                # hash of the YAML text
      "config_written_sha256": "...",        # hash of the copy in the folder (paths shortened)
      "versions": {"mergekit": "0.1.5", ...},
      "inputs": [                            # where each input came from, decided at merge time
        {"role": "base" | "model", "model": "<path or Hub id>", "revision": str | null,
         "source": "local" | "hub", "commit": "<cached Hub commit>" | null,
         "lora": str | null, "lora_source": "local" | "hub" | null,
         "license": {"license": "apache-2.0", "license_name": ..., "license_link": ...,
                     "origin": "README.md"} | null}
      ],
      "resources": {                         # what the merge took (mergekit_ext/resources.py)
        "wall_time_s": 72.4,
        "peak_rss_bytes": 3400000000,
        "peak_rss_scope": "merge" | "process",   # reset at the start (Linux) | lifetime peak
        "cuda_max_allocated_bytes": int | null   # on GPU, summed over devices
      },
      "calibration": {                       # data-aware methods only
        "<model>": {"source": ..., "samples": N, "tokens": T, "sha256": "..."}
      },
      "sections": {
        "ace": {"tensors": {"<tensor name>": {"gamma": float, "normalized": bool,
                                               "condition_number": float,
                                               "top5_energy_share": float}}},
        "chain_of_merges": {"layers": [{"layer": "...", "tasks": {...}, ...}]},
        "regmean": {"layers": [...]},
        "qp_projection": {"layers": [...]},
        "symerge": {"loss": [...], "agreement": {...}, "lambda": [[...]], ...}
      }
    }

Every executor returns a :class:`MergeRecord`; the runner's writer turns it into this file
(:meth:`MergeRecord.to_json`, :func:`diagnostics_text`). A tensor-wise kernel, which runs
inside mergekit's task graph, records into its section through :func:`record_item`, into
the :class:`DiagnosticsCollector` the tensor-wise executor opened with :func:`collecting`.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import math
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

from mergekit_ext.output import write_file

SCHEMA_VERSION = 1
FILENAME = "mergekit_ext_diagnostics.json"
#: The list of the files a merge wrote into its output folder, written last by the runner
#: (:func:`write_manifest`): what ``publish`` uploads, and, uploaded with it, what a later
#: ``publish`` to the same repository may delete (nothing the user added by hand).
MANIFEST_FILENAME = "mergekit_ext_manifest.json"
#: Evaluation results kept beside the card (``run --eval``, ``card --eval``), so that ``card``
#: and ``publish`` render the same table and model-index again without --eval (issue #52).
EVAL_FILENAME = "mergekit_ext_eval.json"


def jsonable(value: Any) -> Any:
    """Convert tensors, numpy values and non-finite floats into plain JSON values.

    The project's one JSON sanitiser (diagnostics, ``diagnose`` results, calibration settings).
    JSON has no NaN or infinity: they become the strings ``"nan"``, ``"inf"`` and ``"-inf"``
    (``plots.as_float`` reads them back), so a measured NaN is not confused with a value
    that was not measured (``null``).

    Args:
        value: a number, tensor, numpy value, or nested dict/list/tuple of them.

    Returns:
        The same structure with plain Python values, dict keys as strings, non-finite
        floats as strings.
    """
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


_jsonable = jsonable  # the name earlier code and tests use


def _map_strings(value: Any, fn: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, dict):
        return {fn(str(k)): _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_map_strings(v, fn) for v in value]
    return value


@dataclass
class MergeRecord:
    """What one executor reports about one merge: the typed result of every executor
    (tensor-wise through mergekit, the sequential and model-output executors, SyMerge).

    The writer (``runner.write``) adds what it knows itself (parameters, seed, config hashes,
    inputs) and turns it into :data:`FILENAME` with :meth:`to_json`; the card reads that.
    A new field: a typed attribute here, filled by the executor that measures it, and its
    name among the optional fields of :meth:`to_json` (docs/architecture.md, "A new record
    field").
    """

    method: str  # the config's merge_method
    #: diagnostics by section name: the method's own (per tensor, layer or group; under
    #: ``method``) and any a tensor-wise kernel recorded (:func:`record_item`)
    sections: dict[str, dict[str, Any]] = field(default_factory=dict)
    calibration: Optional[dict[str, Any]] = None  # per task: source, samples, tokens, sha256
    executor: Optional[dict[str, Any]] = None  # the sequential executor's compute dtype
    distributed: Optional[dict[str, Any]] = None  # world size, backend, task ranks
    resources: Optional[dict[str, Any]] = None  # ``ResourceUsage.to_json()``, set by the runner

    @property
    def diagnostics(self) -> dict[str, Any]:
        """The method's own section (empty when it recorded nothing)."""
        return self.sections.get(self.method, {})

    def to_json(self, **header: Any) -> dict[str, Any]:
        """The content of :data:`FILENAME`: the schema's header, ``header`` (the writer's
        fields), the optional fields that were measured, and the sections."""
        data: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "mergekit_ext_version": _version(),
            "method": self.method,
            **header,
            "sections": {name: s for name, s in self.sections.items() if s},
        }
        for name in ("calibration", "executor", "distributed", "resources"):
            value = getattr(self, name)
            if value:  # not measured by this executor: absent, as the schema says
                data[name] = value
        return jsonable(data)

    def write(
        self, out_dir: str, redact: Optional[Callable[[str], str]] = None, **header: Any
    ) -> str:
        """Write :data:`FILENAME` into ``out_dir`` (:meth:`to_json` with ``header``, then
        :func:`diagnostics_text`); returns the path."""
        return write_diagnostics(out_dir, diagnostics_text(self.to_json(**header), redact))


def diagnostics_text(data: dict[str, Any], redact: Optional[Callable[[str], str]] = None) -> str:
    """The text of :data:`FILENAME` for ``data``; ``redact`` rewrites every string (to drop
    local paths)."""
    data = _map_strings(data, redact) if redact is not None else data
    return json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"


def write_diagnostics(out_dir: str, text: str) -> str:
    """Write :func:`diagnostics_text`'s text into ``out_dir``; returns the path."""
    return write_file(os.path.join(out_dir, FILENAME), text)


class DiagnosticsCollector:
    """The sections a tensor-wise kernel records during one merge; thread-safe.

    mergekit runs the kernels inside its own task graph, where no record can be handed to
    them: the tensor-wise executor opens one with :func:`collecting` and turns it into its
    :class:`MergeRecord` afterwards.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sections: dict[str, dict[str, Any]] = {}

    def record(self, section: str, key: str, value: Any) -> None:
        """Set ``sections[section][key] = value``."""
        with self._lock:
            self.sections.setdefault(section, {})[key] = _jsonable(value)

    def record_item(self, section: str, collection: str, key: str, value: Any) -> None:
        """Set ``sections[section][collection][key] = value`` (for per-tensor records)."""
        with self._lock:
            sec = self.sections.setdefault(section, {})
            sec.setdefault(collection, {})[key] = _jsonable(value)

    def append(self, section: str, collection: str, value: Any) -> None:
        """Append to ``sections[section][collection]`` (for per-layer records)."""
        with self._lock:
            sec = self.sections.setdefault(section, {})
            sec.setdefault(collection, []).append(_jsonable(value))


# The collector of the merge running in this context, None outside :func:`collecting`
# (recording is then a no-op). A new thread starts with empty context variables: whoever
# runs kernels in threads hands them its context (the runner does for mergekit's
# --multi-gpu workers).
_COLLECTOR: contextvars.ContextVar[Optional[DiagnosticsCollector]] = contextvars.ContextVar(
    "mergekit_ext_diagnostics_collector", default=None
)


def active() -> Optional[DiagnosticsCollector]:
    """The collector of the merge in progress in this context, or None."""
    return _COLLECTOR.get()


@contextlib.contextmanager
def collecting(
    collector: Optional[DiagnosticsCollector] = None,
) -> Iterator[DiagnosticsCollector]:
    """Collect what the kernels called in this context record (a fresh collector unless
    one is given); the previous one, if any, is active again afterwards."""
    collector = collector if collector is not None else DiagnosticsCollector()
    token = _COLLECTOR.set(collector)
    try:
        yield collector
    finally:
        _COLLECTOR.reset(token)


def record_item(section: str, collection: str, key: str, value: Any) -> None:
    """Record into the active collector; a no-op when none is active (library use)."""
    collector = _COLLECTOR.get()
    if collector is not None:
        collector.record_item(section, collection, key, value)


def append(section: str, collection: str, value: Any) -> None:
    collector = _COLLECTOR.get()
    if collector is not None:
        collector.append(section, collection, value)


def record(section: str, key: str, value: Any) -> None:
    collector = _COLLECTOR.get()
    if collector is not None:
        collector.record(section, key, value)


def load(out_dir: str) -> dict[str, Any]:
    """Read the diagnostics of a finished merge (empty dict when absent)."""
    path = os.path.join(out_dir, FILENAME)
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as fp:
        return json.load(fp)


def manifest_files(folder: str) -> list[str]:
    """The regular files under ``folder`` as POSIX paths relative to it, sorted; symbolic
    links (to files or folders) are never listed nor followed."""
    found = []
    for root, dirs, files in os.walk(folder, followlinks=False):
        dirs[:] = sorted(d for d in dirs if not os.path.islink(os.path.join(root, d)))
        for name in files:
            path = os.path.join(root, name)
            if os.path.isfile(path) and not os.path.islink(path):
                found.append(os.path.relpath(path, folder).replace(os.sep, "/"))
    return sorted(p for p in found if p != MANIFEST_FILENAME)


def write_manifest(folder: str, files: Optional[list[str]] = None, **header: Any) -> str:
    """Write :data:`MANIFEST_FILENAME` listing ``files`` (default: every regular file in
    ``folder``, which the runner calls on its fresh temporary folder once everything is
    written: all of them are the merge's)."""
    listed = sorted(set(manifest_files(folder) if files is None else files))
    data = {"schema_version": SCHEMA_VERSION, **header, "files": listed}
    path = os.path.join(folder, MANIFEST_FILENAME)
    with open(path, "w", encoding="utf-8") as fp:
        fp.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def parse_manifest(text: str) -> Optional[dict[str, Any]]:
    """A manifest's content, or None when the text is not one (then nothing is trusted)."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("files"), list):
        return None
    if not all(isinstance(p, str) for p in data["files"]):
        return None
    return data


def load_manifest(folder: str) -> Optional[dict[str, Any]]:
    """The manifest of an output folder, or None (older versions wrote none; unreadable)."""
    path = os.path.join(folder, MANIFEST_FILENAME)
    if not os.path.isfile(path) or os.path.islink(path):
        return None
    try:
        with open(path, encoding="utf-8") as fp:
            return parse_manifest(fp.read())
    except (OSError, UnicodeDecodeError):
        return None


def _version() -> str:
    from mergekit_ext._version import __version__

    return __version__
