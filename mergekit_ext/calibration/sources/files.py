"""Opening a source: local files (JSONL/CSV/Parquet/text/safetensors/image folders), Hub datasets,
custom sources and splits, as rows that can be fetched by index; the up-front checks."""

from __future__ import annotations

import contextlib
import contextvars
import csv
import errno
import json
import logging
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Optional, Protocol

import torch
from tqdm.auto import tqdm

from mergekit_ext.calibration.chat import CHAT_COLUMNS
from mergekit_ext.calibration.config import CalibrationSpec
from mergekit_ext.errors import (
    CalibrationError,
    CalibrationFileNotFoundError,
    MergekitExtError,
    PluginError,
    plugin_exit_error,
)

if TYPE_CHECKING:
    pass

from mergekit_ext.calibration.sources.base import (
    DATASET_FORMATS,
    IMAGE_COLUMNS,
    IMAGE_EXTENSIONS,
    TEXT_COLUMNS,
    _qualname,
    get_source,
)
from mergekit_ext.offline import hub_offline

LOG = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------
# Opening a source: rows that can be fetched by index


class _Rows(Protocol):
    def __len__(self) -> int: ...

    def fetch(self, indices: list[int]) -> list[Any]: ...


class _ListRows:
    def __init__(self, items: Sequence[Any]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def fetch(self, indices: list[int]) -> list[Any]:
        return [self.items[i] for i in indices]


class _DatasetRows:
    def __init__(self, dataset: Any, field: str) -> None:
        self.dataset = dataset.select_columns([field])
        self.field = field

    def __len__(self) -> int:
        return len(self.dataset)

    def fetch(self, indices: list[int]) -> list[Any]:
        return list(self.dataset[indices][self.field])


class _SlicedRows:
    """Rows ``start .. stop-1`` of ``rows`` (a ``split: train[a:b]`` slice)."""

    def __init__(self, rows: _Rows, start: int, stop: int) -> None:
        self.rows, self.start, self.stop = rows, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def fetch(self, indices: list[int]) -> list[Any]:
        return self.rows.fetch([self.start + i for i in indices])


@dataclass
class _OpenedSource:
    rows: _Rows
    form: Literal["raw", "tokens", "pixels"]  # raw examples, token id rows, pixel tensors
    base_dir: str  # relative image paths resolve against it
    description: str
    split: Optional[str] = None  # the split read (a datasets split name), None: the whole source
    # a sliced split: row i of ``rows`` is row ``offset + i`` of the whole split (row indices
    # reported and excluded are the whole split's, so that slices of one source compare)
    offset: int = 0
    total: Optional[int] = None  # rows of the whole split, when sliced


def _split_name(split: Optional[str]) -> Optional[str]:
    """``train[:100]`` -> ``train``; None stays None."""
    return split.split("[", 1)[0].strip() if split else None


def _check_split(split: Optional[str], task: str, one_split: Optional[str] = None) -> None:
    """A split name, or one split with datasets' slicing (``train[:100]``, ``train[10:20]``,
    ``train[:10%]``); ``one_split``: the only name the source has (a data file's ``train``)."""
    if not split:
        return
    from datasets import ReadInstruction

    syntax = (
        "write a split name (train) or one split with datasets' slicing: train[:100], "
        "train[100:200], train[:10%]"
    )
    if "+" in split:
        raise CalibrationError(f"model {task}: split {split!r} joins splits; {syntax}")
    try:
        ReadInstruction.from_spec(split)
    except (ValueError, AssertionError) as e:
        raise CalibrationError(
            f"model {task}: split {split!r} is not valid ({e}); {syntax}"
        ) from None
    name = _split_name(split)
    if one_split is not None and name != one_split:
        raise CalibrationError(
            f"model {task}: split {split!r}: this calibration source has one split, "
            f"{one_split!r}; take a part of it with {one_split}[:N], {one_split}[a:b] or "
            f"{one_split}[:P%]"
        )


def _sliced(opened: _OpenedSource, split: Optional[str], task: str) -> _OpenedSource:
    """``opened`` restricted to the slice of ``split`` (as ``datasets`` slices a split)."""
    if not split or "[" not in split:
        return opened
    from datasets import ReadInstruction

    total = len(opened.rows)
    (absolute,) = ReadInstruction.from_spec(split).to_absolute({_split_name(split): total})
    start, stop = int(absolute.from_), int(absolute.to)
    if stop <= start:
        raise CalibrationError(
            f"model {task}: split {split!r} selects no rows of {opened.description!r} "
            f"({total} rows)"
        )
    opened.rows = _SlicedRows(opened.rows, start, stop)
    opened.split, opened.offset, opened.total = split, start, total
    return opened


def describe_split(opened: _OpenedSource) -> str:
    """Which rows were read, in words (``--dry-run``)."""
    n = len(opened.rows)
    if opened.total is not None:
        return f"{opened.split}: rows {opened.offset}-{opened.offset + n - 1} of {opened.total}"
    return f"{opened.split}: all {n} rows" if opened.split else f"all {n} rows"


_IN_MEMORY: contextvars.ContextVar[bool] = contextvars.ContextVar("in_memory", default=False)


@contextlib.contextmanager
def in_memory() -> Iterator[None]:
    """While active, data files and Hub datasets are read into memory through a temporary
    cache that is removed afterwards: nothing is written under ``$HF_HOME`` (``--dry-run``).
    Otherwise ``datasets`` keeps an Arrow copy of each file in its cache, for the next run."""
    token = _IN_MEMORY.set(True)
    try:
        yield
    finally:
        _IN_MEMORY.reset(token)


def _load_dataset(*args: Any, **kwargs: Any) -> Any:
    """``datasets.load_dataset``, in memory under :func:`in_memory`."""
    from datasets import load_dataset

    if not _IN_MEMORY.get():
        return load_dataset(*args, **kwargs)
    with tempfile.TemporaryDirectory(prefix="mergekit-ext-calibration-") as cache:
        return load_dataset(*args, cache_dir=cache, keep_in_memory=True, **kwargs)


def _hub_offline() -> bool:
    """Offline for datasets: the Hub's answer (:func:`~mergekit_ext.offline.hub_offline`),
    and also ``datasets``' own switch and a variable set after huggingface_hub was imported,
    both of which ``datasets`` reads at call time."""

    def is_true(value: Optional[str]) -> bool:
        return value is not None and value.strip().upper() in {"1", "ON", "YES", "TRUE"}

    return (
        hub_offline()
        or is_true(os.environ.get("HF_HUB_OFFLINE"))
        or is_true(os.environ.get("HF_DATASETS_OFFLINE"))
    )


def _path_format(spec: CalibrationSpec, task: str) -> str:
    """``json|csv|parquet|text`` (datasets builders), ``safetensors``, ``disk`` or ``images``."""
    path = spec.path or ""
    if os.path.isfile(path):
        suffix = os.path.splitext(path)[1].lower()
        if suffix in DATASET_FORMATS:
            return DATASET_FORMATS[suffix]
        if suffix == ".safetensors":
            return "safetensors"
        raise CalibrationError(
            f"model {task}: calibration file {path!r} has an unknown format {suffix or '(none)'}; "
            f"use one of {', '.join([*DATASET_FORMATS, '.safetensors'])}, a datasets.save_to_disk "
            "folder or a folder of images"
        )
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "dataset_dict.json")) or os.path.isfile(
            os.path.join(path, "state.json")
        ):
            return "disk"
        if _image_files(path):
            return "images"
        raise CalibrationError(
            f"model {task}: calibration folder {path!r} is neither a dataset saved with "
            f"datasets.save_to_disk nor a folder of images ({', '.join(IMAGE_EXTENSIONS)})"
        )
    raise CalibrationFileNotFoundError(
        f"model {task}: calibration path {path!r} not found (relative paths resolve against "
        f"the working directory {os.getcwd()!r})"
    )


def _image_files(folder: str) -> list[str]:
    """Image files under ``folder``, recursively, sorted by their relative path."""
    found = []
    for root, dirs, files in os.walk(folder):
        dirs.sort()
        for name in files:
            if name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith("."):
                found.append(os.path.relpath(os.path.join(root, name), folder))
    return [
        os.path.join(folder, rel) for rel in sorted(found, key=lambda p: p.replace(os.sep, "/"))
    ]


def _peek_file(path: str, fmt: str, task: str) -> tuple[list[str], bool]:
    """``(columns, non-empty)`` of a data file without loading it all."""
    try:
        if fmt == "text":
            with open(path, encoding="utf-8") as fp:
                return ["text"], any(line.strip() for line in fp)
        if fmt == "csv":
            with open(path, encoding="utf-8", newline="") as fp:
                reader = csv.reader(fp)
                header = next(reader, None)
                return (header or []), header is not None and next(reader, None) is not None
        if fmt == "parquet":
            import pyarrow.parquet as pq

            parquet = pq.ParquetFile(path)
            return list(parquet.schema_arrow.names), parquet.metadata.num_rows > 0
        # json / jsonl: JSON lines, or one JSON array of objects
        with open(path, encoding="utf-8") as fp:
            line = next((line for line in fp if line.strip()), None)
            if line is None:
                return [], False
            if line.lstrip().startswith("["):
                fp.seek(0)
                records = json.load(fp)
                first = records[0] if records else {}
            else:
                first = json.loads(line)
                records = [first]
        if not isinstance(first, dict):
            raise ValueError(
                f'expected JSON objects such as {{"text": ...}}, got {type(first).__name__}'
            )
        return list(first), bool(records)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CalibrationError(
            f"model {task}: cannot read calibration file {path!r} as {fmt}: {e}"
        ) from e


def _choose_split(dataset: Any, split: Optional[str], where: str, task: str) -> Any:
    """A ``Dataset`` from a ``Dataset`` or ``DatasetDict`` (``split`` or the only/``train`` one)."""
    from datasets import DatasetDict

    if not isinstance(dataset, DatasetDict):
        return dataset
    names = list(dataset)
    chosen = split or ("train" if "train" in names else (names[0] if len(names) == 1 else None))
    if chosen not in names:
        raise CalibrationError(
            f"model {task}: {where} has splits {names}; set `split:` to one of them"
            + (f" (got {split!r})" if split else "")
        )
    return dataset[chosen]


def _resolve_field(
    columns: Sequence[str], spec: CalibrationSpec, modality: str, where: str, task: str
) -> str:
    columns = list(columns)
    if spec.field is not None:
        if spec.field in columns:
            _unflagged_chat(spec.field, spec, modality, where, task)
            return spec.field
        raise CalibrationError(
            f"model {task}: field {spec.field!r} not found in {where}; available columns: "
            f"{', '.join(columns) or '(none)'}. Set `field:` to one of them"
        )
    chat = modality == "text" and spec.apply_chat_template
    if modality == "image":
        candidates: Sequence[str] = IMAGE_COLUMNS
    else:
        candidates = (*CHAT_COLUMNS, *TEXT_COLUMNS) if chat else TEXT_COLUMNS
    for name in candidates:
        if name in columns:
            return name
    if len(columns) == 1:
        _unflagged_chat(columns[0], spec, modality, where, task)
        return columns[0]
    for name in CHAT_COLUMNS:
        if name in columns:
            _unflagged_chat(name, spec, modality, where, task)
    raise CalibrationError(
        f"model {task}: {where} has no {'image' if modality == 'image' else 'text'} column and "
        f"several columns ({', '.join(columns)}); set `field:` to one of them"
    )


def _unflagged_chat(
    column: str, spec: CalibrationSpec, modality: str, where: str, task: str
) -> None:
    """Refuse a conversation column (``messages``, ``conversations``) read without the chat
    flag: its messages would otherwise reach the tokenizer as a list."""
    if column in CHAT_COLUMNS and modality == "text" and not spec.apply_chat_template:
        raise CalibrationError(
            f"model {task}: {where} has a {column!r} column of chat messages: set "
            "`apply_chat_template: true` in its calibration section to render them with the "
            "tokenizer's chat template (or set `field:` to a text column)"
        )


def _safetensors_keys(path: str, modality: str, task: str) -> dict[str, list[int]]:
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            shapes = {key: list(f.get_slice(key).get_shape()) for key in f.keys()}
    except Exception as e:
        raise CalibrationError(f"model {task}: cannot read {path!r} as safetensors: {e}") from e
    key = "input_ids" if modality == "text" else "pixel_values"
    want = (
        "[N, T] input_ids (+ attention_mask)" if modality == "text" else "[N, C, H, W] pixel_values"
    )
    if key not in shapes:
        raise CalibrationError(
            f"model {task} is a {modality} model but {path!r} has no {key!r} tensor "
            f"(tensors: {', '.join(shapes) or 'none'}); expected {want}"
        )
    if len(shapes[key]) != (2 if modality == "text" else 4):
        raise CalibrationError(
            f"model {task}: {key!r} in {path!r} has shape {shapes[key]}; expected {want}"
        )
    if (
        "attention_mask" in shapes
        and modality == "text"
        and shapes["attention_mask"] != shapes[key]
    ):
        raise CalibrationError(
            f"model {task}: attention_mask {shapes['attention_mask']} and input_ids {shapes[key]} "
            f"in {path!r} differ in shape"
        )
    if shapes[key][0] == 0:
        raise CalibrationError(
            f"model {task}: calibration file {path!r} is empty ({key} has no rows)"
        )
    return shapes


def check_calibration(spec: CalibrationSpec, *, task: str, modality: str) -> None:
    """Validate a task's calibration spec cheaply, before any weights load.

    Checks that exactly one data source is named, that a file/folder exists and has a known
    format, that the field is present (listing the columns if not), that the data is not
    empty, that a custom source is registered and that a Hub dataset is reachable (never
    when offline: a clear error instead).
    """
    if modality not in ("text", "image"):
        raise CalibrationError(f"model {task}: unknown modality {modality!r}; use text or image")
    named = [key for key in ("path", "dataset", "source") if getattr(spec, key)]
    if not named:
        raise CalibrationError(
            f"model {task}: no calibration data; set `path:` (a local file or folder), "
            "`dataset:` (a Hub dataset) or `source:` (a registered source) in its calibration section"
        )
    if len(named) > 1:
        raise CalibrationError(
            f"model {task}: calibration names {' and '.join(named)}; give exactly one of path, dataset, source"
        )
    if spec.source:
        _check_split(spec.split, task, one_split="train")
        get_source(spec.source)
        return
    if spec.dataset:
        _check_split(spec.split, task)
        if _hub_offline():
            raise CalibrationError(
                f"model {task}: calibration dataset {spec.dataset!r} is on the Hugging Face Hub, "
                "but the Hub is offline (HF_HUB_OFFLINE=1). Save it locally "
                "(datasets.load_dataset(...).save_to_disk(folder)) and use `path: folder`"
            )
        from huggingface_hub import HfApi

        try:
            HfApi().dataset_info(spec.dataset, timeout=10)
        except Exception as e:
            raise CalibrationError(
                f"model {task}: cannot reach Hub dataset {spec.dataset!r} ({type(e).__name__}: {e}); "
                "check the name and the network, or save it locally and use `path:`"
            ) from e
        return
    path = str(spec.path)
    fmt = _path_format(spec, task)
    _check_split(spec.split, task, one_split=None if fmt == "disk" else "train")
    if fmt == "safetensors":
        _safetensors_keys(path, modality, task)
    elif fmt == "images":
        if modality != "image":
            raise CalibrationError(
                f"model {task} is a text model but {path!r} is a folder of images"
            )
    elif fmt == "disk":
        from datasets import load_from_disk

        try:
            with _datasets_local_only():
                dataset = _choose_split(
                    load_from_disk(path), _split_name(spec.split), repr(path), task
                )
        except CalibrationError:
            raise
        except Exception as e:
            raise CalibrationError(f"model {task}: cannot load dataset folder {path!r}: {e}") from e
        _resolve_field(dataset.column_names, spec, modality, repr(path), task)
        if len(dataset) == 0:
            raise CalibrationError(f"model {task}: calibration dataset {path!r} is empty")
    else:
        columns, non_empty = _peek_file(path, fmt, task)
        if not non_empty:
            raise CalibrationError(f"model {task}: calibration file {path!r} is empty")
        _resolve_field(columns, spec, modality, repr(path), task)


@contextlib.contextmanager
def _datasets_local_only() -> Iterator[None]:
    """``datasets`` offline while it reads a local file: no download-count ping to the Hub
    (a HEAD request with a 3 s timeout that ``load_dataset("json", ...)`` sends otherwise)."""
    from datasets import config

    saved = config.HF_HUB_OFFLINE, config.HF_UPDATE_DOWNLOAD_COUNTS
    config.HF_HUB_OFFLINE, config.HF_UPDATE_DOWNLOAD_COUNTS = True, False
    try:
        yield
    finally:
        config.HF_HUB_OFFLINE, config.HF_UPDATE_DOWNLOAD_COUNTS = saved


def _raised_at(error: BaseException) -> str:
    """`` (at FILE:LINE)``: the innermost frame of ``error``'s traceback."""
    tb, where = error.__traceback__, ""
    while tb is not None:
        where = f" (at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno})"
        tb = tb.tb_next
    return where


def _first_bad_json_line(path: str) -> Optional[str]:
    """``line N: ...`` of the first line of a JSON-lines file that is not a JSON object."""
    with open(path, encoding="utf-8", errors="replace") as fp:
        for number, line in enumerate(fp, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as e:
                return f"line {number} is not valid JSON ({e}; a truncated line?)"
            if not isinstance(value, dict):
                return f"line {number} is a {type(value).__name__}, not a JSON object"
    return None


def _load_failure(error: Exception, path: str, fmt: str) -> str:
    """What went wrong, for ``datasets``' own "An error occurred while generating the
    dataset": the file's line, or the cache folder it could not write."""
    cause: Optional[BaseException] = error
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            from datasets import config

            return (
                f"the datasets library keeps a cache of every file it reads, and its cache "
                f"folder cannot be written ({cause.strerror}: {cause.filename or config.HF_DATASETS_CACHE}); "
                "set HF_DATASETS_CACHE (or HF_HOME) to a writable folder"
            )
        cause = cause.__cause__ or cause.__context__
    if fmt == "json" and os.path.isfile(path) and not path.endswith(".json"):
        bad = _first_bad_json_line(path)
        if bad is not None:
            return f"{bad}; fix or remove that line"
    return f"{type(error).__name__}: {error}"


def _open(spec: CalibrationSpec, *, task: str, modality: str) -> _OpenedSource:
    """Open the (already checked) source as fetchable rows, sliced as ``split`` says."""
    return _sliced(_open_whole(spec, task=task, modality=modality), spec.split, task)


def _open_whole(spec: CalibrationSpec, *, task: str, modality: str) -> _OpenedSource:
    """The whole source (the whole split named by ``split``) as fetchable rows."""
    if spec.source:
        fn = get_source(spec.source)
        try:
            items = list(
                tqdm(
                    fn(spec),
                    desc=f"calibration {task}: source {spec.source}",
                    disable=None,
                    leave=False,
                )
            )
        except SystemExit as e:
            raise plugin_exit_error(
                e, f"model {task}: calibration source {spec.source!r} ({_qualname(fn)})"
            ) from None
        except MergekitExtError:
            raise
        except Exception as e:  # user code: say whose, with its own words
            raise PluginError(
                f"model {task}: calibration source {spec.source!r} ({_qualname(fn)}) failed: "
                f"{type(e).__name__}: {e}{_raised_at(e)}; fix that source (run with -v for "
                "the traceback)"
            ) from e
        if items and all(isinstance(item, dict) for item in items):
            columns = sorted({key for item in items for key in item})
            field = _resolve_field(columns, spec, modality, f"source {spec.source!r}", task)
            missing = [i for i, item in enumerate(items) if field not in item]
            if missing:
                raise CalibrationError(
                    f"model {task}: item {missing[0]} of source {spec.source!r} has no {field!r} key"
                )
            items = [item[field] for item in items]
        return _OpenedSource(_ListRows(items), "raw", os.getcwd(), f"source:{spec.source}")
    if spec.dataset:
        split = _split_name(spec.split) or "train"
        try:
            dataset = _load_dataset(spec.dataset, spec.subset, split=split)
        except Exception as e:
            raise CalibrationError(
                f"model {task}: cannot load Hub dataset {spec.dataset!r} "
                f"(subset {spec.subset!r}, split {split!r}): {type(e).__name__}: {e}"
            ) from e
        where = f"Hub dataset {spec.dataset!r}"
        field = _resolve_field(dataset.column_names, spec, modality, where, task)
        description = "/".join(x for x in (spec.dataset, spec.subset) if x) + f" [{split}]"
        return _OpenedSource(
            _DatasetRows(dataset, field), "raw", os.getcwd(), f"hub:{description}", split
        )
    path = str(spec.path)
    fmt = _path_format(spec, task)
    base_dir = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
    if fmt == "images":
        return _OpenedSource(_ListRows(_image_files(path)), "raw", base_dir, path)
    if fmt == "safetensors":
        return _open_safetensors(path, spec, modality, task)
    if fmt == "disk":
        from datasets import load_from_disk

        with _datasets_local_only():
            loaded = load_from_disk(path)
            dataset = _choose_split(loaded, _split_name(spec.split), repr(path), task)
        split = _chosen_split(loaded, dataset)
    else:
        try:
            with _datasets_local_only():
                dataset = _load_dataset(fmt, data_files=path, split="train")
        except Exception as e:
            raise CalibrationError(
                f"model {task}: cannot load calibration file {path!r} as {fmt}: "
                f"{_load_failure(e, path, fmt)}"
            ) from e
        split = "train" if spec.split else None
    field = _resolve_field(dataset.column_names, spec, modality, repr(path), task)
    return _OpenedSource(_DatasetRows(dataset, field), "raw", base_dir, path, split)


def _chosen_split(loaded: Any, dataset: Any) -> Optional[str]:
    """The name of ``dataset`` in the ``DatasetDict`` it came from (None: a plain Dataset)."""
    from datasets import DatasetDict

    if not isinstance(loaded, DatasetDict):
        return None
    return next((name for name, d in loaded.items() if d is dataset), None)


def _open_safetensors(path: str, spec: CalibrationSpec, modality: str, task: str) -> _OpenedSource:
    from safetensors.torch import load_file

    _safetensors_keys(path, modality, task)
    tensors = load_file(path)
    if modality == "image":
        pixels = tensors["pixel_values"]
        if not pixels.dtype.is_floating_point:
            raise CalibrationError(f"model {task}: pixel_values in {path!r} must be floating point")
        return _OpenedSource(_ListRows(list(pixels.to(torch.float32))), "pixels", "", path)
    input_ids = tensors["input_ids"]
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise CalibrationError(
            f"model {task}: input_ids in {path!r} must be integers, got {input_ids.dtype}"
        )
    mask = tensors.get("attention_mask")
    if mask is None:
        mask = torch.ones_like(input_ids)
    elif not bool(((mask == 0) | (mask == 1)).all()):
        raise CalibrationError(f"model {task}: attention_mask in {path!r} must hold only 0 and 1")
    # keep the real tokens of each row, in order: left- or right-padded rows become right padded
    rows = [ids[m.bool()].to(torch.int64).tolist() for ids, m in zip(input_ids, mask)]
    return _OpenedSource(_ListRows(rows), "tokens", "", path)
