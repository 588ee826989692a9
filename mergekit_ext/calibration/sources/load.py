"""The entry point: :func:`load_calibration`."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch

from mergekit_ext.calibration.config import CalibrationSpec
from mergekit_ext.errors import CalibrationError

if TYPE_CHECKING:
    pass

from mergekit_ext.calibration.sources.base import (
    CalibrationData,
)
from mergekit_ext.calibration.sources.files import (
    _open,
    check_calibration,
    describe_split,
)
from mergekit_ext.calibration.sources.heldout import (
    _rows_read_by,
    same_source,
)
from mergekit_ext.calibration.sources.images import (
    _image_batches,
)
from mergekit_ext.calibration.sources.models import (
    _load_tokenizer,
    _model_config,
    _patches_per_image,
    detect_modality,
)
from mergekit_ext.calibration.sources.sampling import (
    _Hasher,
)
from mergekit_ext.calibration.sources.text import (
    _pad_batches,
    _pad_token_id,
    _text_encoder,
    _text_samples,
)

LOG = logging.getLogger(__name__)

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
