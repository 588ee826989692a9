"""Where a model reference lives on disk: a local folder, or a Hub id resolved the way
transformers and mergekit resolve it (the Hugging Face cache first, a download when online,
a clear error when offline and not cached).
"""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Any, Optional

from mergekit_ext.errors import ModelInputError

LOG = logging.getLogger(__name__)

# What the executors read from a model repository: configs, safetensors weights, tokenizer
# and processor files, chat templates. Pickled weights are never downloaded.
DOWNLOAD_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")

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
    """A model folder's ``config.json``."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as fp:
        return json.load(fp)


def tensor_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a safetensors checkpoint, from the file headers only."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with open(file, "rb") as fp:
            n = int.from_bytes(fp.read(8), "little")
            header = json.loads(fp.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                shapes[name] = tuple(info["shape"])
    return shapes


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` is set (as huggingface_hub reads it)."""
    from huggingface_hub import constants

    return constants.is_offline_mode()


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
        raise ModelInputError(
            f"{what}: model path not found: {name!r}; give a local folder (relative paths "
            "resolve against the current directory) or a Hub id such as org/name"
        )
    if hub_offline():
        from huggingface_hub import constants

        raise ModelInputError(
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
