"""Where a model reference lives on disk: a local folder, or a Hub id resolved the way
transformers and mergekit resolve it (the Hugging Face cache first, a download when online,
a clear error when offline and not cached).
"""

from __future__ import annotations

import functools
import glob
import logging
import os
import re
from typing import Any, Optional

from mergekit_ext.errors import ModelInputError, ModelNotFoundError
from mergekit_ext.models.model_files import read_json_object, safetensors_header
from mergekit_ext.offline import hub_offline

LOG = logging.getLogger(__name__)

# What the executors read from a model repository: configs, safetensors weights, tokenizer
# and processor files, chat templates. Pickled weights are never downloaded.
DOWNLOAD_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")

# Pickled weights (``torch.load`` runs their code): accepted only with --allow-pickle.
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")

# The files that hold a tokenizer's vocabulary, in the order they describe it best: whether a
# folder has a tokenizer (with its tokenizer_config.json), and which file the inputs'
# tokenizers are compared by (checks.warn_tokenizers_differ: the first found).
VOCABULARY_FILES = ("tokenizer.json", "vocab.txt", "tokenizer.model", "vocab.json")

# Tokenizer files a merge copies from its donor model (mergekit's list, plus vocabularies of
# WordPiece/BPE tokenizers); replaced as a whole when the tokenizer is rewritten.
TOKENIZER_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer.model",
    "added_tokens.json",
    "merges.txt",
    "vocab.txt",
    "vocab.json",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
)


def model_paths(ref: str) -> list[str]:
    """The folders a model reference points to: ``base+lora`` gives two."""
    return [p.split("@")[0] for p in ref.split("+")]


def read_config_json(path: str) -> dict[str, Any]:
    """A model folder's ``config.json`` (an error naming the file when it is not JSON)."""
    return read_json_object(os.path.join(path, "config.json"), f"model {path}")


def has_weights(path: str) -> bool:
    """Whether a model folder holds weight files (safetensors or pickles)."""
    return any(
        glob.glob(os.path.join(glob.escape(path), pat))
        for pat in ("*.safetensors", *PICKLE_PATTERNS)
    )


def is_config_only(path: str) -> bool:
    """A model folder with a ``config.json`` and no weights (PEFT adapters excluded).

    Such a folder (``hf download ORG/NAME --include "*.json"``: config, tokenizer, the
    safetensors index, but no shard) can be planned with ``--dry-run`` and never merged.
    """
    return (
        os.path.isfile(os.path.join(path, "config.json"))
        and not os.path.isfile(os.path.join(path, "adapter_config.json"))
        and not has_weights(path)
    )


def checkpoint_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Checkpoint keys and shapes of a model folder: its safetensors headers, or, for a
    folder with only a ``config.json`` (:func:`is_config_only`), :func:`config_shapes`."""
    if is_config_only(path):
        return config_shapes(path)[0]
    return tensor_shapes(path)


def config_shapes(path: str) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """What ``save_pretrained`` would write for the model of ``path/config.json``, without
    weights: ``({checkpoint key: shape}, {checkpoint key: safetensors dtype name})``.

    The class named by ``config.architectures`` (never remote code) is built on the meta
    device, and its ``state_dict()`` goes through ``save_pretrained``'s own steps: keys to
    ignore on save, tied weights (a tied ``lm_head`` is not written), and transformers'
    reverted load-time renaming. Non-persistent buffers are no part of a ``state_dict``.
    Floating tensors take the config's ``dtype``/``torch_dtype`` (float32 when absent), but
    for modules the class keeps in float32 (``_keep_in_fp32_modules``).
    """
    config_file = os.path.join(path, "config.json")
    stat = os.stat(config_file)
    shapes, dtypes = _config_shapes(os.path.realpath(config_file), stat.st_mtime_ns, stat.st_size)
    return dict(shapes), dict(dtypes)


_SAFETENSORS_NAMES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}
_ITEMSIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2}
_ITEMSIZES.update(I8=1, U8=1, BOOL=1)


def safetensors_itemsize(name: str) -> int:
    """Bytes per element of a safetensors dtype name (``"BF16"`` → 2)."""
    return _ITEMSIZES.get(name, 4)


# A dry run reads one config several times (compatibility, tying, the plan); a 70B model
# takes a fraction of a second to build on the meta device each time.
@functools.lru_cache(maxsize=16)
def _config_shapes(
    config_file: str, mtime_ns: int, size: int
) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    import torch
    import transformers

    from mergekit_ext.models import model_class

    path = os.path.dirname(config_file)
    try:
        config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - an unknown model_type, a malformed file
        raise ModelInputError(
            f"model {path!r} has no weights and its config.json cannot be read by "
            f"transformers ({type(e).__name__}: {' '.join(str(e).split())}); its shapes are "
            "unknown without the weights"
        ) from None
    architectures = getattr(config, "architectures", None) or []
    if architectures and model_class.model_class(config) is None:
        # AutoModel would drop the head the checkpoint has: the shapes would be wrong.
        raise ModelInputError(
            f"model {path!r} has no weights, and transformers has no class for its "
            f"architectures ({', '.join(architectures)}); its shapes come from that class: "
            "download the *.safetensors files, or use a transformers version that has it"
        )
    dtype = _config_dtype(read_config_json(path), path)
    try:
        model = model_class.meta_model(config)
    except Exception as e:  # noqa: BLE001 - whatever the class raises for this config
        raise ModelInputError(
            f"model {path!r} has no weights and its transformers class cannot be built from "
            f"its config.json ({type(e).__name__}: {' '.join(str(e).split())})"
        ) from None
    try:  # the checkpoint format (e.g. Mixtral's per-expert tensors), as save_pretrained writes
        state = model_class.saved_state_dict(model)
    except Exception as e:  # noqa: BLE001 - a conversion that needs real tensors
        raise ModelInputError(
            f"model {path!r} has no weights, and transformers cannot derive its checkpoint "
            f"names on the meta device ({type(e).__name__}: {' '.join(str(e).split())}); "
            "download the *.safetensors files"
        ) from None
    keep_fp32 = list(model._get_dtype_plan(dtype)) if hasattr(model, "_get_dtype_plan") else []
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for key, tensor in state.items():
        shapes[key] = tuple(tensor.shape)
        if not tensor.dtype.is_floating_point:
            stored = tensor.dtype
        elif any(re.search(rf"(^|\.){re.escape(m)}(\.|$)", key) for m in keep_fp32):
            stored = torch.float32
        else:
            stored = dtype
        dtypes[key] = _SAFETENSORS_NAMES.get(str(stored).removeprefix("torch."), "F32")
    return shapes, dtypes


def _config_dtype(config: dict[str, Any], path: str) -> Any:
    """The dtype a config declares for its weights (``dtype``, older ``torch_dtype``)."""
    import torch

    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    name = str(name).removeprefix("torch.")
    dtype = getattr(torch, name, None) if name != "auto" else torch.float32
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ModelInputError(
            f"model {path!r}: config.json declares dtype {name!r}, not a floating dtype; "
            "write float32, float16 or bfloat16"
        )
    return dtype


def tensor_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a safetensors checkpoint, from the file headers only."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(glob.glob(os.path.join(glob.escape(path), "*.safetensors"))):
        for name, (shape, _) in safetensors_header(file, f"model {path}").items():
            shapes[name] = shape
    return shapes


def cached_snapshot(
    repo_id: str, *, revision: Optional[str] = None, cache_dir: Optional[str] = None
) -> Optional[str]:
    """The folder of ``repo_id`` in the Hugging Face cache, or None when it is not cached."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(
            repo_id, revision=revision, cache_dir=cache_dir, local_files_only=True
        )
    except Exception:  # noqa: BLE001 - any failure means "not usable from the cache"
        return None


def split_revision(path: str) -> tuple[str, Optional[str]]:
    """``org/name@rev`` → (``org/name``, ``rev``); a path that exists is kept whole."""
    if "@" in path and not os.path.exists(path):
        name, revision = path.split("@", 1)
        return name, revision or None
    return path, None


def resolve_model_folder(
    path: str, *, what: str, cache_dir: Optional[str] = None, revision: Optional[str] = None
) -> str:
    """A local folder for ``path``: a folder, or a Hub id from the cache or downloaded.

    Args:
        path: a local folder or a Hub repository id (``org/name``, optionally ``@revision``).
        what: how errors name the model (``"base model org/name"``).
        cache_dir: the Hugging Face cache to use (default: ``HF_HUB_CACHE``).
        revision: a branch, tag or commit of a Hub repository.

    Returns:
        The folder holding the model's files.
    """
    if os.path.isdir(path):
        return path
    name, at = split_revision(path)
    revision = revision or at
    if os.path.isdir(name):
        return name
    folder = cached_snapshot(name, revision=revision, cache_dir=cache_dir)
    if folder is not None:
        return folder
    if not _is_repo_id(name):
        raise ModelNotFoundError(
            f"{what}: model path not found: {name!r}; give a local folder (relative paths "
            "resolve against the current directory) or a Hub id such as org/name"
        )
    if hub_offline():
        from huggingface_hub import constants

        raise ModelNotFoundError(
            f"{what}: {name!r} is not a local folder nor in the Hugging Face cache "
            f"({cache_dir or constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE is set: download it "
            f"first (`hf download {name}`), or unset HF_HUB_OFFLINE"
        )
    from huggingface_hub import snapshot_download

    LOG.info("downloading %s from the Hugging Face Hub", name)
    try:
        return snapshot_download(
            name,
            revision=revision,
            cache_dir=cache_dir,
            allow_patterns=list(DOWNLOAD_PATTERNS),
        )
    except Exception as e:  # noqa: BLE001 - one message for every Hub failure
        raise ModelInputError(
            f"{what}: cannot download {name!r} from the Hugging Face Hub "
            f"({type(e).__name__}: {' '.join(str(e).split())}); check the id, your network "
            "and your token (`hf auth login`)"
        ) from None


def _is_repo_id(name: str) -> bool:
    if name.startswith((".", "/", "~")):
        return False
    parts = name.split("/")
    return 1 <= len(parts) <= 2 and all(parts)


def with_cached_snapshots(config: Any) -> Any:
    """``config`` (mergekit's ``MergeConfiguration``) with every Hub id that is in the
    Hugging Face cache replaced by its snapshot folder, when the Hub is offline.

    mergekit resolves a Hub id by asking the Hub for the repository's files
    (``list_repo_tree``), which fails offline even when the model is cached; a folder is
    read as it is. Online, Hub ids are left to mergekit (it also fetches missing files).
    Every occurrence of one reference (models, base model, slices, tokenizer sources) is
    replaced by the same folder, so per-model parameters still find their model.
    """
    from mergekit.common import ModelPath, ModelReference
    from pydantic import BaseModel

    if not hub_offline():
        return config

    def folder(path: ModelPath) -> ModelPath:
        if os.path.exists(path.path) or not _is_repo_id(path.path):
            return path
        snapshot = cached_snapshot(path.path, revision=path.revision)
        return path if snapshot is None else ModelPath(path=snapshot)

    def swap(value: Any) -> Any:
        if isinstance(value, ModelReference):
            lora = folder(value.lora) if value.lora is not None else None
            return value.model_copy(update={"model": folder(value.model), "lora": lora})
        if isinstance(value, BaseModel):
            changes = {}
            for name, item in value:
                new = swap(item)
                if new is not item:
                    changes[name] = new
            return value.model_copy(update=changes) if changes else value
        if isinstance(value, list):
            items = [swap(v) for v in value]
            return items if any(a is not b for a, b in zip(items, value)) else value
        if isinstance(value, dict):
            swapped = {k: swap(v) for k, v in value.items()}
            return swapped if any(swapped[k] is not value[k] for k in value) else value
        return value

    return swap(config)
