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
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Optional, Protocol, TypeVar, Union

import torch
from tqdm.auto import tqdm

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


@dataclass
class _OpenedSource:
    rows: _Rows
    form: Literal["raw", "tokens", "pixels"]  # raw examples, token id rows, pixel tensors
    base_dir: str  # relative image paths resolve against it
    description: str


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
            return spec.field
        raise CalibrationError(
            f"model {task}: field {spec.field!r} not found in {where}; available columns: "
            f"{', '.join(columns) or '(none)'}. Set `field:` to one of them"
        )
    for name in IMAGE_COLUMNS if modality == "image" else TEXT_COLUMNS:
        if name in columns:
            return name
    if len(columns) == 1:
        return columns[0]
    raise CalibrationError(
        f"model {task}: {where} has no {'image' if modality == 'image' else 'text'} column and "
        f"several columns ({', '.join(columns)}); set `field:` to one of them"
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
        get_source(spec.source)
        return
    if spec.dataset:
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
                dataset = _choose_split(load_from_disk(path), spec.split, repr(path), task)
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
    """Open the (already checked) source as fetchable rows."""
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
        from datasets import load_dataset

        split = spec.split or "train"
        try:
            dataset = load_dataset(spec.dataset, spec.subset, split=split)
        except Exception as e:
            raise CalibrationError(
                f"model {task}: cannot load Hub dataset {spec.dataset!r} "
                f"(subset {spec.subset!r}, split {split!r}): {type(e).__name__}: {e}"
            ) from e
        where = f"Hub dataset {spec.dataset!r}"
        field = _resolve_field(dataset.column_names, spec, modality, where, task)
        description = "/".join(x for x in (spec.dataset, spec.subset) if x) + f" [{split}]"
        return _OpenedSource(_DatasetRows(dataset, field), "raw", os.getcwd(), f"hub:{description}")
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
            dataset = _choose_split(load_from_disk(path), spec.split, repr(path), task)
    else:
        from datasets import load_dataset

        try:
            with _datasets_local_only():
                dataset = load_dataset(fmt, data_files=path, split="train")
        except Exception as e:
            raise CalibrationError(
                f"model {task}: cannot load calibration file {path!r} as {fmt}: {e}"
            ) from e
    field = _resolve_field(dataset.column_names, spec, modality, repr(path), task)
    return _OpenedSource(_DatasetRows(dataset, field), "raw", base_dir, path)


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


def _shuffled(rows: _Rows, seed: int) -> Iterator[Any]:
    """The rows in an order given by a permutation seeded with ``seed``, fetched lazily."""
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    for start in range(0, len(order), _FETCH_CHUNK):
        yield from rows.fetch(order[start : start + _FETCH_CHUNK])


def _warn_or_fail(task: str, source: str, found: int, wanted: int, what: str) -> None:
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
    """``text -> token ids``: tokenizer defaults (special tokens), truncation unless packing."""
    truncate = {} if spec.pack else {"truncation": True, "max_length": spec.max_length}
    if spec.chat_template and not getattr(tokenizer, "chat_template", None):
        raise CalibrationError(
            f"model {task}: `chat_template: true` but the tokenizer of {model_path!r} has no chat "
            "template; set chat_template: false or use a tokenizer with one"
        )

    def encode(text: Any) -> list[int]:
        if spec.chat_template:
            messages = text if isinstance(text, list) else [{"role": "user", "content": text}]
            rendered = tokenizer.apply_chat_template(messages, tokenize=False)
            return list(
                tokenizer(rendered, add_special_tokens=False, verbose=False, **truncate)[
                    "input_ids"
                ]
            )
        return list(tokenizer(text, verbose=False, **truncate)["input_ids"])

    return encode


def _is_text(item: Any, spec: CalibrationSpec, task: str, source: str) -> bool:
    """True for a usable text; False for an empty one (skipped); error for anything else."""
    if item is None or (isinstance(item, str) and not item.strip()):
        return False
    if isinstance(item, str) or (spec.chat_template and isinstance(item, list)):
        return True
    raise CalibrationError(
        f"model {task}: calibration data {source!r} holds a {type(item).__name__} where a text "
        "was expected; point `field:` at a text column"
    )


def _text_samples(
    opened: _OpenedSource,
    spec: CalibrationSpec,
    task: str,
    encode: Callable[[Any], list[int]],
    hasher: _Hasher,
) -> list[list[int]]:
    """Token rows: one per sample (truncated), or ``pack`` windows of ``max_length``."""
    rows: list[list[int]] = []
    stream: list[int] = []
    skipped = 0
    progress = tqdm(
        total=spec.samples, desc=f"calibration {task}: tokenizing", disable=None, leave=False
    )
    for item in _shuffled(opened.rows, spec.seed):
        if opened.form == "tokens":
            if not item:
                skipped += 1
                continue
            hasher.add(torch.tensor(item, dtype=torch.int64).numpy().tobytes())
            ids = item if spec.pack else item[: spec.max_length]
        else:
            if not _is_text(item, spec, task, opened.description):
                skipped += 1
                continue
            hasher.add(json.dumps(item, ensure_ascii=False, sort_keys=True).encode("utf-8"))
            ids = encode(item)
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
        task, opened.description, len(rows), spec.samples, "windows" if spec.pack else "texts"
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


def _image_batches(
    opened: _OpenedSource, spec: CalibrationSpec, task: str, model_path: str, hasher: _Hasher
) -> tuple[list[dict[str, torch.Tensor]], int]:
    selected: list[Any] = []
    for item in _shuffled(opened.rows, spec.seed):
        selected.append(item)
        if len(selected) >= spec.samples:
            break
    _warn_or_fail(task, opened.description, len(selected), spec.samples, "images")
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
# Entry point


def load_calibration(
    spec: CalibrationSpec,
    model_path: str,
    *,
    task: str,
    modality: Optional[str] = None,
    trust_remote_code: bool = False,
) -> CalibrationData:
    """Load, sample, tokenize (or preprocess) and batch one task's calibration data.

    ``model_path``'s tokenizer (text) or image processor (images) is used; ``modality``
    defaults to :func:`detect_modality`. Deterministic for a fixed spec and seed.
    """
    modality = modality or detect_modality(model_path)
    check_calibration(spec, task=task, modality=modality)
    opened = _open(spec, task=task, modality=modality)
    if modality == "image":
        if opened.form == "tokens":
            raise CalibrationError(
                f"model {task} is an image model but {opened.description!r} holds token ids"
            )
        hasher = _Hasher({"modality": "image", "format": opened.form})
        batches, num_samples = _image_batches(opened, spec, task, model_path, hasher)
        height, width = batches[0]["pixel_values"].shape[-2:]
        num_tokens = num_samples * _patches_per_image(model_path, int(height), int(width))
        return CalibrationData(
            task, "image", batches, num_samples, num_tokens, hasher.hexdigest(), opened.description
        )

    if opened.form == "pixels":
        raise CalibrationError(
            f"model {task} is a text model but {opened.description!r} holds pixel_values"
        )
    settings: dict[str, Any] = {
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
    else:
        tokenizer = _load_tokenizer(model_path, trust_remote_code)
        encode = _text_encoder(tokenizer, spec, task, model_path)
        pad_id = _pad_token_id(tokenizer)
        vocab_size = None
        settings.update(
            chat_template=spec.chat_template,
            tokenizer=type(tokenizer).__name__,
            vocab_size=len(tokenizer),
            template=getattr(tokenizer, "chat_template", None) if spec.chat_template else None,
        )
    hasher = _Hasher(settings)
    rows = _text_samples(opened, spec, task, encode, hasher)
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
        task, "text", batches, len(rows), num_tokens, hasher.hexdigest(), opened.description
    )
