"""Atomic output folders: a merge is written to a temporary folder beside ``OUT_DIR`` and
renamed into place only when everything succeeded, so a failed merge leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator

from mergekit_ext.errors import MergekitExtError

LOG = logging.getLogger(__name__)


def check_output_dir(out_path: str, overwrite: bool) -> None:
    """Refuse an existing ``out_path`` unless ``overwrite`` (before any work is done)."""
    if os.path.lexists(out_path):
        if not overwrite:
            raise MergekitExtError(
                f"output folder {out_path} already exists; pass --overwrite to replace it"
            )
        if not os.path.isdir(out_path):
            raise MergekitExtError(f"output path {out_path} exists and is not a folder")


@contextlib.contextmanager
def atomic_output_dir(out_path: str, overwrite: bool = False) -> Iterator[str]:
    """Yield a temporary folder beside ``out_path``; rename it to ``out_path`` on success.

    On any exception the temporary folder is removed and ``out_path`` is left untouched.
    With ``overwrite`` an existing folder is replaced only after the new one is complete.
    """
    check_output_dir(out_path, overwrite)
    target = os.path.abspath(out_path)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.partial-", dir=parent)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if os.path.lexists(target):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.old-", dir=parent)
        os.rmdir(old)
        os.rename(target, old)
    try:
        os.rename(tmp, target)
    except BaseException:
        if old is not None:
            os.rename(old, target)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    LOG.info("wrote %s", target)
