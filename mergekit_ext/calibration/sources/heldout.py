"""Held-out data: what a merge did not read (:func:`same_source`, the rows a merge read)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mergekit_ext.calibration.config import CalibrationSpec
from mergekit_ext.errors import CalibrationError

if TYPE_CHECKING:
    pass

from mergekit_ext.calibration.sources.files import (
    _open,
    _OpenedSource,
    _split_name,
)
from mergekit_ext.calibration.sources.images import (
    _selected_images,
)
from mergekit_ext.calibration.sources.models import (
    _load_tokenizer,
)
from mergekit_ext.calibration.sources.sampling import (
    _Hasher,
    _jsonable,
)
from mergekit_ext.calibration.sources.text import (
    _text_encoder,
    _text_samples,
)

LOG = logging.getLogger(__name__)

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
