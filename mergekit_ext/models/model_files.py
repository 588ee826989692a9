"""The files of one model folder, checked before any weight is read.

A corrupt or hostile input (a ``config.json`` that is not JSON, a truncated safetensors
file, a header length of 2^62, a shard index naming ``../other.safetensors``) fails here
with the file and what is wrong, instead of a ``JSONDecodeError``, ``SafetensorError`` or
``MemoryError`` from deep inside a loader, or a tensor read silently from elsewhere.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Any

from mergekit_ext.errors import ModelInputError, ModelNotFoundError

LOG = logging.getLogger(__name__)

# Shard indexes: transformers' and mergekit's loaders read tensors from the files these name.
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")

# safetensors refuses headers above 100 MB (``safetensors::tensor::MAX_HEADER_SIZE``).
MAX_SAFETENSORS_HEADER = 100_000_000


def read_json_file(path: str, what: str) -> Any:
    """A JSON file, or an error naming ``what`` (the model), the file and the fault."""
    try:
        with open(path, encoding="utf-8") as fp:
            return json.load(fp)
    except json.JSONDecodeError as e:
        raise ModelInputError(
            f"{what}: {path} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
            "the file is corrupt or truncated: download or save it again"
        ) from None
    except UnicodeDecodeError as e:
        raise ModelInputError(
            f"{what}: {path} is not UTF-8 text ({e.reason} at byte {e.start}); the file is "
            "corrupt: download or save it again"
        ) from None
    except OSError as e:
        raise ModelInputError(f"{what}: cannot read {path} ({e.strerror or e})") from None


def read_json_object(path: str, what: str) -> dict[str, Any]:
    """A JSON file that must hold an object (``config.json``, an index)."""
    value = read_json_file(path, what)
    if not isinstance(value, dict):
        raise ModelInputError(
            f"{what}: {path} holds a JSON {type(value).__name__}, not an object; the file is "
            "corrupt: download or save it again"
        )
    return value


def safetensors_header(path: str, what: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{tensor: (shape, dtype)}`` of a safetensors file, read by ``safetensors`` itself
    after the cheap checks a corrupt file fails (size, header length against the size)."""
    from safetensors import SafetensorError, safe_open

    size = os.path.getsize(path)
    if size < 8:
        raise ModelInputError(
            f"{what}: {path} is truncated ({size} bytes; a safetensors file starts with an "
            "8-byte header length): download or save it again"
        )
    with open(path, "rb") as fp:
        length = int.from_bytes(fp.read(8), "little")
    if length > size - 8:
        raise ModelInputError(
            f"{what}: {path} is not a valid safetensors file: its header length is {length} "
            f"bytes but the file has only {size}; the file is corrupt or truncated: download "
            "or save it again"
        )
    if length > MAX_SAFETENSORS_HEADER:
        raise ModelInputError(
            f"{what}: {path} has a safetensors header of {length} bytes (safetensors reads at "
            f"most {MAX_SAFETENSORS_HEADER}); the file is corrupt: download or save it again"
        )
    try:
        with safe_open(path, framework="pt") as f:
            out = {}
            for key in f.keys():
                sl = f.get_slice(key)
                out[key] = (tuple(sl.get_shape()), sl.get_dtype())
            return out
    except SafetensorError as e:
        raise ModelInputError(
            f"{what}: {path} is not a valid safetensors file ({' '.join(str(e).split())}); "
            "the file is corrupt or truncated: download or save it again"
        ) from None


def check_index(
    folder: str, index_file: str, what: str, require_shards: bool = True
) -> dict[str, str]:
    """A shard index's ``weight_map``, every entry a file inside ``folder``.

    An entry such as ``../other.safetensors`` or ``/abs/path`` would make every loader read
    tensors from outside the model folder without a word: refused, naming the entry.
    Symlinked shards (the Hugging Face cache) are fine: only the name is judged. With
    ``require_shards`` every shard it names must exist (a folder without any weights is
    planned from its config, see :func:`~mergekit_ext.models.model_paths.is_config_only`).
    """
    path = os.path.join(folder, index_file)
    index = read_json_object(path, what)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ModelInputError(
            f"{what}: {path} has no valid `weight_map` (tensor name -> shard file); the index "
            "is corrupt: download or save it again"
        )
    for tensor, shard in weight_map.items():
        normal = os.path.normpath(shard)
        if os.path.isabs(shard) or normal == ".." or normal.startswith(".." + os.sep):
            raise ModelInputError(
                f"{what}: {path} maps tensor {tensor} to {shard!r}, outside the model folder "
                f"{folder}; an index may only name files in its own folder: fix or replace it"
            )
    for shard in sorted(set(weight_map.values())) if require_shards else ():
        if not os.path.isfile(os.path.join(folder, shard)):
            raise ModelNotFoundError(
                f"{what}: {path} names shard {shard!r}, which is not in {folder}; download the "
                "missing shard"
            )
    return weight_map


def check_model_files(folder: str, what: str) -> None:
    """Every file of ``folder`` a merge reads parses: ``config.json`` / ``adapter_config.json``,
    the shard indexes (entries inside the folder), the safetensors headers."""
    for name in ("config.json", "adapter_config.json"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            read_json_object(path, what)
    shards = sorted(glob.glob(os.path.join(glob.escape(folder), "*.safetensors")))
    pickles = glob.glob(os.path.join(glob.escape(folder), "*.bin"))
    for name in INDEX_FILES:
        if os.path.isfile(os.path.join(folder, name)):
            check_index(folder, name, what, require_shards=bool(shards or pickles))
    for path in shards:
        safetensors_header(path, what)
