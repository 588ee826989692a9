"""Safe output folders: a merge never destroys what it did not create.

- :func:`resolve_output` turns ``OUT_DIR`` into the folder actually written (a symbolic
  link's target) and refuses locations that would put inputs at risk: an input itself, a
  folder holding or inside an input, the current or home directory, a filesystem root.
- :func:`exclusive_output` holds a lock file beside ``OUT_DIR`` (``.NAME.lock``, via
  ``filelock``) from validation to the final rename, so two merges never race for one
  folder; the lock file records the holder's pid for the second merge's message. It also
  removes the ``.NAME.partial-PID-*`` folders of merges that were killed.
- :func:`atomic_output_dir` writes into ``.NAME.partial-PID-*`` beside ``OUT_DIR`` and
  renames it into place only when everything succeeded. ``--overwrite`` replaces only a
  folder mergekit-ext wrote itself (it holds :data:`MARKER_FILE`) or an empty one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator

from filelock import FileLock, Timeout

from mergekit_ext.errors import MergekitExtError

LOG = logging.getLogger(__name__)

# Every output of mergekit-ext holds its diagnostics file: the proof that a folder is ours.
MARKER_FILE = "mergekit_ext_diagnostics.json"


class OutputError(MergekitExtError):
    """``OUT_DIR`` cannot be written safely."""


def _contains(outer: str, inner: str) -> bool:
    """``inner`` is ``outer`` or lies inside it (both absolute, normalized)."""
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


def resolve_output(out_path: str, inputs: Iterable[str] = ()) -> str:
    """The absolute folder a merge into ``out_path`` writes; refuses unsafe locations.

    Args:
        out_path: ``OUT_DIR`` as given. A symbolic link is followed: the merge goes into
            its target (the link itself stays).
        inputs: every local path the merge reads (models, adapters, calibration data, the
            config file, plugin files); ``OUT_DIR`` may not be, contain or lie inside one.

    Returns:
        The absolute, symlink-free path of the output folder.
    """
    if os.path.islink(out_path) and not os.path.exists(out_path):
        raise OutputError(
            f"output path {out_path} is a symbolic link to {os.readlink(out_path)}, which does "
            "not exist; remove the link or give the folder itself as OUT_DIR"
        )
    target = os.path.realpath(out_path)
    if os.path.lexists(target) and not os.path.isdir(target):
        raise OutputError(f"output path {out_path} exists and is not a folder")
    for what, path in (("the current directory", os.getcwd()), ("your home directory", "~")):
        place = os.path.realpath(os.path.expanduser(path))
        if _contains(target, place):
            raise OutputError(
                f"refusing to write the merge to {out_path}: it is or contains {what} "
                f"({place}); give a new folder such as ./merged"
            )
    if os.path.dirname(target) == target:
        raise OutputError(f"refusing to write the merge to the filesystem root {target}")
    for path in dict.fromkeys(inputs):
        real = os.path.realpath(path)
        if _contains(target, real) or _contains(real, target):
            relation = (
                "is"
                if real == target
                else ("contains" if _contains(target, real) else "lies inside")
            )
            raise OutputError(
                f"refusing to write the merge to {out_path}: it {relation} the input {path}; "
                "choose an output folder apart from every model, adapter, calibration file "
                "and config the merge reads"
            )
    return target


def check_replaceable(target: str, overwrite: bool, shown: str) -> None:
    """Refuse an existing ``target`` unless ``overwrite`` and it is a mergekit-ext output.

    Args:
        target: the resolved output folder.
        overwrite: the user passed ``--overwrite``.
        shown: ``OUT_DIR`` as the user wrote it, for the messages.
    """
    if not os.path.lexists(target):
        return
    if not os.path.isdir(target):
        raise OutputError(f"output path {shown} exists and is not a folder")
    if not overwrite:
        raise OutputError(f"output folder {shown} already exists; pass --overwrite to replace it")
    if os.path.isfile(os.path.join(target, MARKER_FILE)) or not os.listdir(target):
        return
    raise OutputError(
        f"--overwrite refused: {shown} was not written by mergekit-ext (it has no {MARKER_FILE}), "
        "so replacing it could destroy your files; choose another OUT_DIR, or move or remove "
        "that folder yourself"
    )


def _lock_path(target: str) -> str:
    return os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.lock")


def _record_owner(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


def _lock_owner(lock_path: str) -> str:
    try:
        with open(lock_path, encoding="utf-8") as fp:
            pid = fp.read().strip()
    except OSError:
        pid = ""
    return f"pid {pid}" if pid.isdigit() else "another process"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, owned by another user
    return True


_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old)-(?P<pid>\d+)-[^/]*$")


def remove_stale_partials(target: str) -> list[str]:
    """Remove ``.NAME.partial-PID-*`` folders beside ``target`` whose owner is dead.

    Called with the output lock held, so no live merge into ``target`` can own one. A
    leftover ``.NAME.old-PID-*`` (a previous output, moved aside by a merge killed during
    the final rename) is removed only when ``target`` exists again; otherwise it is named
    in a warning, since it is the only copy of that output.

    Returns:
        The removed folders.
    """
    parent, name = os.path.split(target)
    removed = []
    for entry in sorted(os.listdir(parent)):
        if not entry.startswith(f".{name}.") or not os.path.isdir(os.path.join(parent, entry)):
            continue
        path = os.path.join(parent, entry)
        match = _LEFTOVER.match(entry)
        if match is None or match.group("name") != name:
            if entry.startswith((f".{name}.partial-", f".{name}.old-")):
                LOG.warning("%s was left by an older mergekit-ext; remove it by hand", path)
            continue
        pid = int(match.group("pid"))
        if _pid_alive(pid) and pid != os.getpid():
            LOG.warning("%s belongs to the running process %d; left in place", path, pid)
            continue
        if match.group("kind") == "old" and not os.path.lexists(target):
            LOG.warning(
                "%s holds the previous %s, moved aside by a merge (pid %d) killed during its "
                "final rename; rename it back to %s to keep it",
                path,
                name,
                pid,
                target,
            )
            continue
        shutil.rmtree(path, ignore_errors=True)
        LOG.warning("removed %s, left by a killed merge (pid %d)", path, pid)
        removed.append(path)
    return removed


@contextlib.contextmanager
def exclusive_output(target: str, shown: str) -> Iterator[None]:
    """Hold the lock ``.NAME.lock`` beside ``target``; fail at once when another merge has it.

    Args:
        target: the resolved output folder.
        shown: ``OUT_DIR`` as the user wrote it, for the message.
    """
    parent = os.path.dirname(target)
    created = []  # parent folders made here, removed again if the merge leaves them empty
    missing = parent
    while not os.path.exists(missing):
        created.append(missing)
        missing = os.path.dirname(missing)
    os.makedirs(parent, exist_ok=True)
    path = _lock_path(target)
    lock = FileLock(path, timeout=0, on_acquired=_record_owner)
    try:
        lock.acquire()
    except Timeout:
        raise OutputError(
            f"another mergekit-ext merge ({_lock_owner(path)}) is writing {shown} right now; "
            "wait for it to finish or choose another OUT_DIR"
        ) from None
    try:
        remove_stale_partials(target)
        yield
    finally:
        # Unlinked while still held: filelock re-opens when a waiter finds a dead inode.
        with contextlib.suppress(OSError):
            os.unlink(path)
        lock.release()
        for folder in created:
            try:
                os.rmdir(folder)
            except OSError:
                break


def _apply_umask(path: str) -> None:
    """``mkdtemp`` makes 0700 folders; outputs get the user's usual permissions."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)


@contextlib.contextmanager
def atomic_output_dir(target: str, overwrite: bool = False, shown: str = "") -> Iterator[str]:
    """Yield a temporary folder beside ``target``; rename it to ``target`` on success.

    On any exception (KeyboardInterrupt and SIGTERM included) the temporary folder is
    removed and ``target`` is left untouched. Whether ``target`` may be replaced is checked
    again at the end: a folder that appeared meanwhile is replaced only with ``overwrite``
    and only when it is a mergekit-ext output.

    Args:
        target: the resolved output folder (see :func:`resolve_output`).
        overwrite: replace an existing mergekit-ext output.
        shown: ``OUT_DIR`` as the user wrote it, for the messages.

    Yields:
        The temporary folder, named ``.NAME.partial-PID-*`` so a later run can tell
        whether its owner still runs.
    """
    shown = shown or target
    check_replaceable(target, overwrite, shown)
    parent, name = os.path.split(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.partial-{os.getpid()}-", dir=parent)
    try:
        _apply_umask(tmp)
        yield tmp
        if os.path.lexists(target) and not overwrite:
            raise OutputError(
                f"{shown} appeared while the merge ran; it was left as it is and the merge "
                "was discarded: rerun with --overwrite to replace it, or choose another OUT_DIR"
            )
        check_replaceable(target, overwrite, shown)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if os.path.lexists(target):
        old = tempfile.mkdtemp(prefix=f".{name}.old-{os.getpid()}-", dir=parent)
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
