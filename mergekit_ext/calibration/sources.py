"""Calibration data: where a task's examples come from and how they become model inputs.

A :class:`~mergekit_ext.calibration.config.CalibrationSpec` names the data of one task:

- ``path``: a local file (``.jsonl``/``.json``/``.csv``/``.parquet``/``.txt``, read with
  ``datasets.load_dataset``; ``.safetensors`` with pre-tokenized ``input_ids`` [+
  ``attention_mask``] or preprocessed ``pixel_values``) or a folder (saved with
  ``datasets.save_to_disk``, or a folder of images searched recursively);
- ``dataset``: a Hugging Face Hub dataset (only online);
- ``source``: a custom source registered with :func:`register_source`.

Conventions (``docs/methods.md``, "Calibration conventions"): one sample is one text (or
image), tokenized with the tokenizer's defaults (special tokens included) and truncated to
``max_length``; ``pack: true`` instead cuts the concatenated token stream into windows of
``max_length`` and then ``samples`` counts windows. ``samples: N`` takes N samples after a
shuffle seeded by ``seed``; a source with fewer uses all of them with a warning, an empty
source is an error. Batches are right padded with an attention mask; statistics drop the
padded positions (:mod:`mergekit_ext.calibration.statistics`). Loading is deterministic:
the same spec, seed and tokenizer give identical batches and the same ``sha256``.

Held-out data (``mergekit-ext diagnose``): ``load_calibration(spec, ..., exclude=[specs the
merge used])`` leaves out every example that loading those specs reads (same source, same
shuffle, same tokenization), so the result holds only examples the merge never saw; when
none is left it raises :class:`NoUnusedCalibrationData`.
"""

from __future__ import annotations

import contextlib
import contextvars
import csv
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Optional, Protocol, TypeVar, Union

import torch
from tqdm.auto import tqdm

from mergekit_ext.calibration.chat import CHAT_COLUMNS, is_conversation, to_messages
from mergekit_ext.calibration.config import CalibrationSpec
from mergekit_ext.errors import CalibrationError, ModelInputError, plugin_exit_error

if TYPE_CHECKING:
    import PIL.Image

LOG = logging.getLogger(__name__)

Modality = Literal["text", "image"]

# file suffix -> datasets builder
DATASET_FORMATS = {
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".txt": "text",
}
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
TEXT_COLUMNS = ("text",)
IMAGE_COLUMNS = ("image", "img")

# model_type values of vision-only checkpoints (CLIP: its vision tower, the usual merge target)
IMAGE_MODEL_TYPES = frozenset(
    {
        "beit", "bit", "clip", "clip_vision_model", "convnext", "convnextv2", "cvt",
        "data2vec-vision", "deit", "dinov2", "dinov2_with_registers", "dinov3_vit",
        "efficientnet", "focalnet", "hiera", "levit", "mobilenet_v1", "mobilenet_v2",
        "mobilevit", "mobilevitv2", "poolformer", "pvt", "pvt_v2", "regnet", "resnet",
        "siglip", "siglip_vision_model", "siglip2", "siglip2_vision_model", "swin",
        "swinv2", "van", "vit", "vit_hybrid", "vit_mae", "vit_msn",
    }
)  # fmt: skip

_FETCH_CHUNK = 64


# ----------------------------------------------------------------------------------------
# The result


@dataclass
class CalibrationData:
    """One task's calibration batches, ready for forward passes.

    - ``batches``: text: ``input_ids`` and ``attention_mask`` (int64, right padded to the
      longest sample of the batch); image: ``pixel_values`` (float32, ``[B, C, H, W]``).
    - ``num_tokens``: text: the non-padding tokens; image: images x patches per image
      (``(H / patch_size) * (W / patch_size)`` from the model config, class token not
      counted; one per image for models without patches).
    - ``sha256``: hash of the sampled raw examples (texts, image bytes or token rows) and the
      tokenization/preprocessing settings, for the model card; never the data itself.
    """

    task: str
    modality: Modality
    batches: list[dict[str, torch.Tensor]]
    num_samples: int
    num_tokens: int
    sha256: str
    source: str
    # indices (in the source) of every example read, in reading order: what a merge that
    # loaded this data has seen (the last one may be cut, or skipped when empty)
    rows_read: tuple[int, ...] = ()
    # examples left out because a merge read them (``load_calibration(exclude=...)``)
    rows_excluded: int = 0
    split: str = ""  # which rows of the source were read, in words
    preview: str = ""  # the first sample as the model reads it (text: its tokens decoded)

    def preview_line(self, width: int = 160) -> str:
        """``split ...; first sample: '...'`` on one line, the sample cut to ``width``
        characters (``--dry-run``)."""
        sample = self.preview if len(self.preview) <= width else self.preview[:width] + "…"
        return f"split {self.split}; first sample: {sample!r}"

    def summary(self) -> dict[str, Any]:
        """The card/diagnostics entry: ``{"source", "samples", "tokens", "sha256", "modality"}``."""
        return {
            "source": self.source,
            "samples": self.num_samples,
            "tokens": self.num_tokens,
            "sha256": self.sha256,
            "modality": self.modality,
        }


# ----------------------------------------------------------------------------------------
# Custom sources


class CalibrationSource(Protocol):
    """A custom source: ``(spec) -> iterable of examples`` (finite).

    An example is a text (``str``), an image (``PIL.Image.Image`` or an image file path for
    vision models) or a ``dict`` whose ``spec.field`` (default ``text`` / ``image``) holds
    one. ``spec.options`` carries the YAML's free-form ``options:``.
    """

    def __call__(
        self, spec: CalibrationSpec
    ) -> Iterable[Union[str, PIL.Image.Image, dict[str, Any]]]: ...


_SOURCES: dict[str, CalibrationSource] = {}
_F = TypeVar("_F", bound=Callable[..., Any])


def register_source(name: str) -> Callable[[_F], _F]:
    """Decorator: register a custom source under ``name`` (``calibration: {source: name}``).

    Example::

        @register_source("my_prompts")
        def my_prompts(spec):
            yield from (f"Question {i}: ..." for i in range(spec.options.get("n", 100)))
    """
    if not isinstance(name, str) or not name:
        raise ValueError("register_source needs a non-empty name")

    def decorator(fn: _F) -> _F:
        if not callable(fn):
            raise TypeError(f"calibration source {name!r} must be callable: (spec) -> iterable")
        previous = _SOURCES.get(name)
        if previous is not None and previous is not fn:
            LOG.warning(
                "calibration source %r registered again; the new one replaces the old", name
            )
        _SOURCES[name] = fn
        return fn

    return decorator


def _qualname(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def get_source(name: str) -> CalibrationSource:
    """The registered source ``name``; an unknown name lists the registered ones."""
    try:
        return _SOURCES[name]
    except KeyError:
        known = ", ".join(sorted(_SOURCES)) or "none"
        raise CalibrationError(
            f"unknown calibration source {name!r}; registered sources: {known}. Register it with "
            f"@mergekit_ext.calibration.register_source({name!r}) in code that runs before the merge"
        ) from None


# ----------------------------------------------------------------------------------------
# Models: modality, tokenizer, image processor


def _model_folder(model_path: str) -> str:
    """The folder whose config/tokenizer/processor describe ``model_path``.

    mergekit's ``base+lora`` syntax and PEFT adapter folders resolve to the base model.
    """
    if "+" in model_path and not os.path.exists(model_path):
        model_path = model_path.split("+", 1)[0]
    adapter = os.path.join(model_path, "adapter_config.json")
    if not os.path.isfile(os.path.join(model_path, "config.json")) and os.path.isfile(adapter):
        with open(adapter, encoding="utf-8") as fp:
            base = json.load(fp).get("base_model_name_or_path")
        if base:
            return _model_folder(base)
    return model_path


def _model_config(model_path: str, trust_remote_code: bool = False) -> dict[str, Any]:
    folder = _model_folder(model_path)
    config_file = os.path.join(folder, "config.json")
    if os.path.isfile(config_file):
        with open(config_file, encoding="utf-8") as fp:
            return json.load(fp)
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code).to_dict()
    except Exception as e:
        raise ModelInputError(f"cannot read the config of model {model_path!r}: {e}") from e


def detect_modality(model_path: str) -> Modality:
    """``image`` for vision checkpoints (ViT, CLIP, DeiT, ... by ``model_type``), else ``text``.

    A whole CLIP model counts as ``image`` (its vision tower is what gets merged); pass
    ``modality="text"`` to :func:`load_calibration` for its text tower.
    """
    config = _model_config(model_path)
    model_type = str(config.get("model_type", "")).lower()
    if model_type in IMAGE_MODEL_TYPES:
        return "image"
    architectures = " ".join(config.get("architectures") or [])
    if "ImageClassification" in architectures or "VisionModel" in architectures:
        return "image"
    if "vocab_size" not in config and "num_channels" in config and "image_size" in config:
        return "image"
    return "text"


def _load_tokenizer(model_path: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    from mergekit_ext.model_paths import is_config_only

    folder = _model_folder(model_path)
    if is_config_only(folder) and not _has_tokenizer_files(folder):
        # A dry run of a folder with only config.json: name what to download, not the
        # tokenizer class's own error about a missing vocabulary file.
        raise CalibrationError(
            f"model {model_path!r} has no weights and no tokenizer (only config.json); the "
            "calibration text is tokenized with the model's tokenizer: download its tokenizer "
            'files too (`hf download ORG/NAME --include "*.json" "*.model" --local-dir '
            f"{folder}` fetches config and tokenizer, no weights), or give pre-tokenized "
            "calibration data (a .safetensors file of input_ids)"
        )
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise CalibrationError(
            f"cannot load the tokenizer of model {model_path!r} ({type(e).__name__}: {e}); "
            "save the tokenizer next to the weights"
        ) from e


def _has_tokenizer_files(folder: str) -> bool:
    names = ("tokenizer.json", "tokenizer.model", "vocab.txt", "vocab.json", "spiece.model")
    return any(os.path.isfile(os.path.join(folder, n)) for n in names)


def check_tokenizers_match(model_paths: Sequence[str]) -> None:
    """Raise a :class:`CalibrationError` naming two models whose vocabularies differ.

    Data-aware merging tokenizes every task once and runs the tokens through base, experts
    and the merged model, so all of them must share one vocabulary.
    """
    reference_path: Optional[str] = None
    reference_vocab: dict[str, int] = {}
    for path in dict.fromkeys(model_paths):
        vocab = _load_tokenizer(path).get_vocab()
        if reference_path is None:
            reference_path, reference_vocab = path, vocab
            continue
        if vocab == reference_vocab:
            continue
        example = next(
            (t for t in sorted(reference_vocab) if vocab.get(t) != reference_vocab[t]), None
        )
        if example is None:
            example = next(t for t in sorted(vocab) if t not in reference_vocab)
        detail = (
            f"token {example!r} is id {reference_vocab.get(example)} in {reference_path!r} "
            f"and id {vocab.get(example)} in {path!r}"
        )
        raise CalibrationError(
            f"the tokenizers of {reference_path!r} and {path!r} have different vocabularies "
            f"({len(reference_vocab)} vs {len(vocab)} tokens; {detail}); data-aware merging "
            "needs models that share one tokenizer"
        )


class _ImagePreprocessor:
    """The model's own image processor, or the explicit ``image_size/mean/std`` of the spec.

    With any explicit override: resize to ``image_size x image_size`` (bicubic), scale to
    [0, 1], normalize with ``image_mean/image_std``; values not given come from the model's
    image processor config (size: the model config's ``image_size``).
    """

    def __init__(self, spec: CalibrationSpec, model_path: str, task: str) -> None:
        self.processor: Any = None
        folder = _model_folder(model_path)
        try:
            from transformers import AutoImageProcessor

            self.processor = AutoImageProcessor.from_pretrained(folder)
        except Exception as e:
            processor_error: Optional[Exception] = e
        else:
            processor_error = None
        self.explicit = (
            spec.image_size is not None or spec.image_mean is not None or spec.image_std is not None
        )
        if not self.explicit:
            if self.processor is None:
                raise CalibrationError(
                    f"model {task}: cannot load the image processor of {model_path!r} "
                    f"({processor_error}); save it next to the weights or give image_size, "
                    "image_mean and image_std in the calibration section"
                )
            self.settings: dict[str, Any] = {"image_processor": _jsonable(self.processor.to_dict())}
            return
        config = _model_config(model_path)
        vision = config.get("vision_config") or {}
        size = spec.image_size or config.get("image_size") or vision.get("image_size")
        mean = spec.image_mean or getattr(self.processor, "image_mean", None)
        std = spec.image_std or getattr(self.processor, "image_std", None)
        if size is None or mean is None or std is None:
            raise CalibrationError(
                f"model {task}: explicit image preprocessing needs image_size, image_mean and "
                f"image_std (got {size}, {mean}, {std}) and {model_path!r} has no image processor "
                "to take the missing ones from"
            )
        if len(mean) != len(std) or len(mean) not in (1, 3):
            raise CalibrationError(
                f"model {task}: image_mean and image_std need 1 or 3 values each (got {mean}, {std})"
            )
        self.size, self.mean, self.std = (
            int(size),
            [float(v) for v in mean],
            [float(v) for v in std],
        )
        self.settings = {"image_size": self.size, "image_mean": self.mean, "image_std": self.std}

    def __call__(self, images: list[PIL.Image.Image]) -> torch.Tensor:
        if not self.explicit:
            return self.processor(images=images, return_tensors="pt")["pixel_values"].to(
                torch.float32
            )
        import numpy as np
        from PIL import Image

        mode = "L" if len(self.mean) == 1 else "RGB"
        mean = np.asarray(self.mean, dtype=np.float32)
        std = np.asarray(self.std, dtype=np.float32)
        arrays = []
        for image in images:
            resized = image.convert(mode).resize((self.size, self.size), Image.Resampling.BICUBIC)
            array = np.asarray(resized, dtype=np.float32).reshape(self.size, self.size, -1) / 255.0
            arrays.append(((array - mean) / std).transpose(2, 0, 1))
        return torch.from_numpy(np.stack(arrays)).to(torch.float32)


def _patches_per_image(model_path: str, height: int, width: int) -> int:
    config = _model_config(model_path)
    patch = config.get("patch_size") or (config.get("vision_config") or {}).get("patch_size")
    if isinstance(patch, (list, tuple)):
        return (height // int(patch[0])) * (width // int(patch[1]))
    return (height // int(patch)) * (width // int(patch)) if patch else 1


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
    from huggingface_hub import constants

    def is_true(value: Optional[str]) -> bool:
        return value is not None and value.strip().upper() in {"1", "ON", "YES", "TRUE"}

    return (
        bool(constants.HF_HUB_OFFLINE)
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
    raise CalibrationError(
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
                f"model {task}: cannot load calibration file {path!r} as {fmt}: {e}"
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


# ----------------------------------------------------------------------------------------
# Sampling


class NoUnusedCalibrationData(CalibrationError):
    """Every example of a source was read by the merge: nothing is held out."""


def _shuffled(
    rows: _Rows, seed: int, skip: frozenset[int] = frozenset()
) -> Iterator[tuple[int, Any]]:
    """``(index, row)`` in an order given by a permutation seeded with ``seed``, fetched
    lazily; the indices in ``skip`` are left out (the order of the others is unchanged)."""
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    if skip:
        order = [i for i in order if i not in skip]
    for start in range(0, len(order), _FETCH_CHUNK):
        chunk = order[start : start + _FETCH_CHUNK]
        yield from zip(chunk, rows.fetch(chunk))


def _warn_or_fail(
    task: str, source: str, found: int, wanted: int, what: str, excluded: int = 0
) -> None:
    if found == 0 and excluded:
        raise NoUnusedCalibrationData(
            f"model {task}: calibration data {source!r} has no {what} that the merge did not "
            f"read (it read {excluded}); nothing is held out"
        )
    if found == 0:
        raise CalibrationError(f"model {task}: calibration data {source!r} is empty (no {what})")
    if found < wanted:
        LOG.warning(
            "model %s: calibration data %r has only %d %s, fewer than the %d requested; using all %d",
            task, source, found, what, wanted, found,
        )  # fmt: skip


class _Hasher:
    """sha256 over settings and length-prefixed example bytes (unambiguous, order-sensitive)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self._hash = hashlib.sha256()
        self.add(json.dumps(settings, sort_keys=True, default=str).encode("utf-8"))

    def add(self, data: bytes) -> None:
        self._hash.update(len(data).to_bytes(8, "little"))
        self._hash.update(data)

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=str))


# ----------------------------------------------------------------------------------------
# Text


def _pad_batches(
    rows: list[list[int]], batch_size: int, pad_id: int
) -> list[dict[str, torch.Tensor]]:
    """Right-padded ``input_ids`` and ``attention_mask`` (int64), batch by batch, in order."""
    batches = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        width = max(len(r) for r in chunk)
        input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.int64)
        attention_mask = torch.zeros((len(chunk), width), dtype=torch.int64)
        for i, row in enumerate(chunk):
            input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
            attention_mask[i, : len(row)] = 1
        batches.append({"input_ids": input_ids, "attention_mask": attention_mask})
    return batches


def _pad_token_id(tokenizer: Any) -> int:
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate[0] if isinstance(candidate, list) else candidate)
    return 0


def _text_encoder(
    tokenizer: Any, spec: CalibrationSpec, task: str, model_path: str
) -> Callable[[Any], list[int]]:
    """``text or messages -> token ids``: tokenizer defaults (special tokens), truncation
    unless packing; with ``apply_chat_template`` the chat template renders the messages."""
    truncate = {} if spec.pack else {"truncation": True, "max_length": spec.max_length}
    if spec.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise CalibrationError(
            f"model {task}: `apply_chat_template: true` but the tokenizer of {model_path!r} has "
            "no chat template; set apply_chat_template: false or use a tokenizer with one"
        )

    def encode(item: Any) -> list[int]:
        if spec.apply_chat_template:
            rendered = tokenizer.apply_chat_template(item, tokenize=False)
            return list(
                tokenizer(rendered, add_special_tokens=False, verbose=False, **truncate)[
                    "input_ids"
                ]
            )
        return list(tokenizer(item, verbose=False, **truncate)["input_ids"])

    return encode


def _text_item(
    item: Any, spec: CalibrationSpec, task: str, source: str, index: int
) -> Optional[Any]:
    """What to encode: a text, or (``apply_chat_template``) its chat messages; None for an
    empty example (skipped); an error naming the row for anything else."""
    if item is None or (isinstance(item, str) and not item.strip()):
        return None
    where = f"model {task}: row {index} of calibration data {source!r}"
    if spec.apply_chat_template:
        return to_messages(item, where)
    if isinstance(item, str):
        return item
    if is_conversation(item):
        raise CalibrationError(
            f"{where} holds chat messages (a list), not a text: set `apply_chat_template: "
            "true` in its calibration section to render them with the tokenizer's chat template"
        )
    raise CalibrationError(
        f"{where} holds a {type(item).__name__} where a text was expected; point `field:` at "
        "a text column"
    )


def _text_samples(
    opened: _OpenedSource,
    spec: CalibrationSpec,
    task: str,
    encode: Callable[[Any], list[int]],
    hasher: _Hasher,
    skip: frozenset[int] = frozenset(),
    read: Optional[list[int]] = None,
) -> list[list[int]]:
    """Token rows: one per sample (truncated), or ``pack`` windows of ``max_length``.

    The examples at the indices in ``skip`` are left out; the index of every example read
    is appended to ``read``.
    """
    rows: list[list[int]] = []
    stream: list[int] = []
    skipped = 0
    progress = tqdm(
        total=spec.samples, desc=f"calibration {task}: tokenizing", disable=None, leave=False
    )
    for index, item in _shuffled(opened.rows, spec.seed, skip):
        if read is not None:
            read.append(index)
        if opened.form == "tokens":
            if not item:
                skipped += 1
                continue
            hasher.add(torch.tensor(item, dtype=torch.int64).numpy().tobytes())
            ids = item if spec.pack else item[: spec.max_length]
        else:
            text = _text_item(item, spec, task, opened.description, opened.offset + index)
            if text is None:
                skipped += 1
                continue
            hasher.add(json.dumps(item, ensure_ascii=False, sort_keys=True).encode("utf-8"))
            ids = encode(text)
            if not ids:
                skipped += 1
                continue
        if not spec.pack:
            rows.append(ids)
            progress.update(1)
        else:
            stream.extend(ids)
            while len(stream) >= spec.max_length and len(rows) < spec.samples:
                rows.append(stream[: spec.max_length])
                del stream[: spec.max_length]
                progress.update(1)
        if len(rows) >= spec.samples:
            break
    progress.close()
    if spec.pack and len(rows) < spec.samples and stream:
        rows.append(stream)  # the trailing partial window, only when short of windows
    if skipped:
        LOG.warning("model %s: skipped %d empty examples of %r", task, skipped, opened.description)
    _warn_or_fail(
        task,
        opened.description,
        len(rows),
        spec.samples,
        "windows" if spec.pack else "texts",
        len(skip),
    )
    return rows


# ----------------------------------------------------------------------------------------
# Images


def _resolve_path(item: Any, base_dir: str) -> Any:
    """An image path relative to the data file's folder (when it is not relative to the CWD)."""
    if isinstance(item, (str, os.PathLike)):
        path = os.fspath(item)
        if not os.path.isabs(path) and not os.path.exists(path) and base_dir:
            return os.path.join(base_dir, path)
        return path
    return item


def _to_image(item: Any, task: str, source: str) -> PIL.Image.Image:
    from PIL import Image

    if isinstance(item, dict) and (
        item.get("bytes") or item.get("path")
    ):  # datasets Image, undecoded
        if item.get("bytes"):
            import io

            return Image.open(io.BytesIO(item["bytes"])).convert("RGB")
        item = item["path"]
    if isinstance(item, Image.Image):
        return item.convert("RGB")
    if isinstance(item, (str, os.PathLike)):
        try:
            with Image.open(item) as image:
                return image.convert("RGB")
        except OSError as e:
            raise CalibrationError(
                f"model {task}: cannot open image {os.fspath(item)!r} from {source!r}: {e}"
            ) from e
    raise CalibrationError(
        f"model {task}: calibration data {source!r} holds a {type(item).__name__} where an image "
        "(PIL image or image path) was expected; point `field:` at an image column"
    )


def _image_bytes(item: Any, image: PIL.Image.Image) -> bytes:
    """The file's bytes for an image path, else the decoded pixels."""
    if isinstance(item, str) and os.path.isfile(item):
        with open(item, "rb") as fp:
            return fp.read()
    return f"{image.mode}:{image.size}".encode() + image.tobytes()


def _selected_images(
    opened: _OpenedSource, spec: CalibrationSpec, skip: frozenset[int], read: list[int]
) -> list[Any]:
    selected: list[Any] = []
    for index, item in _shuffled(opened.rows, spec.seed, skip):
        read.append(index)
        selected.append(item)
        if len(selected) >= spec.samples:
            break
    return selected


def _image_batches(
    opened: _OpenedSource,
    spec: CalibrationSpec,
    task: str,
    model_path: str,
    hasher: _Hasher,
    skip: frozenset[int] = frozenset(),
    read: Optional[list[int]] = None,
) -> tuple[list[dict[str, torch.Tensor]], int]:
    selected = _selected_images(opened, spec, skip, read if read is not None else [])
    _warn_or_fail(task, opened.description, len(selected), spec.samples, "images", len(skip))
    if opened.form == "pixels":
        for pixels in selected:
            hasher.add(pixels.numpy().tobytes())
        chunks = [
            selected[i : i + spec.batch_size] for i in range(0, len(selected), spec.batch_size)
        ]
        return [{"pixel_values": torch.stack(chunk)} for chunk in chunks], len(selected)
    preprocess = _ImagePreprocessor(spec, model_path, task)
    hasher.add(json.dumps(preprocess.settings, sort_keys=True, default=str).encode("utf-8"))
    batches = []
    for start in tqdm(
        range(0, len(selected), spec.batch_size),
        desc=f"calibration {task}: images",
        disable=None,
        leave=False,
    ):
        images = []
        for item in selected[start : start + spec.batch_size]:
            item = _resolve_path(item, opened.base_dir)
            image = _to_image(item, task, opened.description)
            hasher.add(_image_bytes(item, image))
            images.append(image)
        batches.append({"pixel_values": preprocess(images)})
    return batches, len(selected)


# ----------------------------------------------------------------------------------------
# Held-out data: what a merge did not read


def same_source(a: CalibrationSpec, b: CalibrationSpec) -> bool:
    """Both specs read the same examples (same file / dataset split / source and field), so
    that the row indices of one are the row indices of the other."""

    def identity(spec: CalibrationSpec) -> tuple[Any, ...]:
        if spec.source:
            return ("source", spec.source, _jsonable(spec.options), spec.field)
        # a slice (train[:100]) reads rows of its split, numbered as in the whole split
        if spec.dataset:
            return (
                "hub",
                spec.dataset,
                spec.subset,
                _split_name(spec.split) or "train",
                spec.field,
            )
        path = os.path.realpath(str(spec.path))
        # a split name only selects rows of a datasets folder; a file has one split
        split = _split_name(spec.split) if os.path.isdir(path) else None
        return ("path", path, split, spec.field)

    return a.has_data and b.has_data and identity(a) == identity(b)


def _rows_read_by(
    spec: CalibrationSpec,
    opened: _OpenedSource,
    task: str,
    modality: str,
    model_path: str,
    trust_remote_code: bool,
) -> list[int]:
    """The indices (in the whole split) that loading ``spec`` reads (no batches are built);
    ``opened``: the source ``spec`` names, opened for another spec of the same source."""
    if (spec.split or None) != (opened.split if opened.total is not None else None):
        opened = _open(spec, task=task, modality=modality)  # another slice of the split
    read: list[int] = []
    if modality == "image":
        _selected_images(opened, spec, frozenset(), read)
        return [opened.offset + i for i in read]
    if opened.form == "tokens":
        encode: Callable[[Any], list[int]] = list
    else:
        tokenizer = _load_tokenizer(model_path, trust_remote_code)
        encode = _text_encoder(tokenizer, spec, task, model_path)
    with contextlib.suppress(CalibrationError):  # an empty source reads nothing usable
        _text_samples(opened, spec, task, encode, _Hasher({}), read=read)
    return [opened.offset + i for i in read]


# ----------------------------------------------------------------------------------------
# Entry point


def _text_preview(row: list[int], tokenizer: Any) -> str:
    """The first sample as the model reads it: its tokens decoded (special tokens and the
    chat template's markup included, truncated to ``max_length``), or its token ids."""
    if tokenizer is None:
        return f"token ids {row[:32]}{' ...' if len(row) > 32 else ''}"
    return str(tokenizer.decode(row, skip_special_tokens=False))


def _image_preview(item: Any) -> str:
    if isinstance(item, torch.Tensor):
        return f"pixel_values {list(item.shape)}"
    if isinstance(item, dict):
        item = item.get("path") or "image bytes"
    if isinstance(item, (str, os.PathLike)):
        return os.fspath(item)
    size = getattr(item, "size", None)
    return f"{type(item).__name__} {size[0]}x{size[1]}" if size else type(item).__name__


def load_calibration(
    spec: CalibrationSpec,
    model_path: str,
    *,
    task: str,
    modality: Optional[str] = None,
    trust_remote_code: bool = False,
    exclude: Sequence[CalibrationSpec] = (),
) -> CalibrationData:
    """Load, sample, tokenize (or preprocess) and batch one task's calibration data.

    ``model_path``'s tokenizer (text) or image processor (images) is used; ``modality``
    defaults to :func:`detect_modality`. Deterministic for a fixed spec and seed.

    ``exclude``: the specs a merge loaded; every example that loading one of them reads
    (those of :func:`same_source`; others cannot overlap) is left out, so the result is
    held-out data. Raises :class:`NoUnusedCalibrationData` when nothing is left.
    """
    modality = modality or detect_modality(model_path)
    check_calibration(spec, task=task, modality=modality)
    opened = _open(spec, task=task, modality=modality)
    skip: set[int] = set()  # indices in the whole split
    for used in exclude:
        if same_source(spec, used):
            skip.update(_rows_read_by(used, opened, task, modality, model_path, trust_remote_code))
    start, stop = opened.offset, opened.offset + len(opened.rows)
    excluded = sorted(i for i in skip if start <= i < stop)
    skipped = frozenset(i - start for i in excluded)  # indices in the rows opened
    read: list[int] = []
    if modality == "image":
        if opened.form == "tokens":
            raise CalibrationError(
                f"model {task} is an image model but {opened.description!r} holds token ids"
            )
        settings: dict[str, Any] = {"modality": "image", "format": opened.form}
        if excluded:
            settings["excluded"] = excluded
        hasher = _Hasher(settings)
        batches, num_samples = _image_batches(opened, spec, task, model_path, hasher, skipped, read)
        height, width = batches[0]["pixel_values"].shape[-2:]
        num_tokens = num_samples * _patches_per_image(model_path, int(height), int(width))
        return CalibrationData(
            task,
            "image",
            batches,
            num_samples,
            num_tokens,
            hasher.hexdigest(),
            opened.description,
            tuple(opened.offset + i for i in read),
            len(skipped),
            split=describe_split(opened),
            preview=_image_preview(opened.rows.fetch(read[:1])[0]) if read else "",
        )

    if opened.form == "pixels":
        raise CalibrationError(
            f"model {task} is a text model but {opened.description!r} holds pixel_values"
        )
    settings = {
        "modality": "text",
        "max_length": spec.max_length,
        "pack": spec.pack,
    }
    encode: Callable[[Any], list[int]]
    if opened.form == "tokens":
        config = _model_config(model_path, trust_remote_code)
        encode, pad_id = (
            list,
            next(
                (
                    config[k]
                    for k in ("pad_token_id", "eos_token_id")
                    if isinstance(config.get(k), int)
                ),
                0,
            ),
        )
        settings["format"] = "token ids"
        vocab_size = config.get("vocab_size")
        tokenizer = None
    else:
        tokenizer = _load_tokenizer(model_path, trust_remote_code)
        encode = _text_encoder(tokenizer, spec, task, model_path)
        pad_id = _pad_token_id(tokenizer)
        vocab_size = None
        settings.update(
            # the flag's old name: the sha256 of an unchanged config stays the same
            chat_template=spec.apply_chat_template,
            tokenizer=type(tokenizer).__name__,
            vocab_size=len(tokenizer),
            template=getattr(tokenizer, "chat_template", None)
            if spec.apply_chat_template
            else None,
        )
    if excluded:
        settings["excluded"] = excluded
    hasher = _Hasher(settings)
    rows = _text_samples(opened, spec, task, encode, hasher, skipped, read)
    if vocab_size is not None:
        largest = max(max(row) for row in rows)
        smallest = min(min(row) for row in rows)
        if largest >= int(vocab_size) or smallest < 0:
            raise CalibrationError(
                f"model {task}: token ids in {opened.description!r} range over [{smallest}, {largest}] "
                f"but the vocabulary of {model_path!r} has {vocab_size} tokens; were they made with another tokenizer?"
            )
    batches = _pad_batches(rows, spec.batch_size, pad_id)
    num_tokens = sum(len(row) for row in rows)
    return CalibrationData(
        task,
        "text",
        batches,
        len(rows),
        num_tokens,
        hasher.hexdigest(),
        opened.description,
        tuple(opened.offset + i for i in read),
        len(skipped),
        split=describe_split(opened),
        preview=_text_preview(rows[0], tokenizer if opened.form != "tokens" else None),
    )
