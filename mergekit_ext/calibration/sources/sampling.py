"""Sampling: the seeded shuffle, the warning (or error) when a source runs short, and the hash
of what was read."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from mergekit_ext.errors import CalibrationError
from mergekit_ext.merge_record import jsonable

if TYPE_CHECKING:
    pass

from mergekit_ext.calibration.sources.base import (
    _FETCH_CHUNK,
)
from mergekit_ext.calibration.sources.files import (
    _Rows,
)

LOG = logging.getLogger(__name__)

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
    """Plain, key-sorted JSON values (other objects as ``str``), NaN/inf by the project's rule
    (:func:`mergekit_ext.merge_record.jsonable`)."""
    return jsonable(json.loads(json.dumps(value, sort_keys=True, default=str)))
