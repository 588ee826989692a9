"""Safe output folders and files: a command never destroys what it did not create.

- :func:`check_write_path` is the one rule for every path any command writes (``OUT_DIR``
  of ``run``, ``diagnose --json/--plots``, the card, ``publish``'s staging folder): never
  an input, nor inside one (model and adapter folders, the tokenizer source, calibration
  data, the config, plugin files; for ``diagnose`` the merged folder too).
- :func:`write_file` is the one way a command writes a file into an existing folder: a new
  file under a temporary name, renamed over the old one; a destination that is a symbolic
  link, a folder or a file with other hard links is refused (:func:`check_file_destination`).
- :func:`resolve_output` turns ``OUT_DIR`` into the folder actually written (a symbolic
  link's target) and refuses locations that would put inputs at risk: an input itself, a
  folder holding or inside an input, the current or home directory, a filesystem root, a
  path longer than the file system allows.
- :func:`exclusive_output` holds a lock file beside ``OUT_DIR`` (``.NAME.lock``, via
  ``filelock``) from validation to the final rename, so two merges never race for one
  folder; the lock file records the holder's pid for the second merge's message. It also
  removes the ``.NAME.partial-PID-*`` folders of merges that were killed.
- :func:`atomic_output_dir` writes into ``.NAME.partial-PID-*`` beside ``OUT_DIR`` and
  renames it into place only when everything succeeded. ``--overwrite`` replaces only a
  folder mergekit-ext wrote itself (it holds :data:`MARKER_FILE`). An existing empty
  folder (a mount point such as a container volume included) is written in place: the
  partial folder is made inside it and its entries are moved up at the end.

``NAME`` in these hidden names is the folder's name, or for a name too long to leave room
for the suffixes within ``NAME_MAX`` a prefix of it plus a hash (:func:`leftover_stem`).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import shutil
import signal
import stat
import tempfile
from collections.abc import Iterable, Iterator

from filelock import FileLock, Timeout

from mergekit_ext.errors import MergekitExtError

LOG = logging.getLogger(__name__)

# Every output of mergekit-ext holds its diagnostics file: the proof that a folder is ours.
MARKER_FILE = "mergekit_ext_diagnostics.json"

# Longest NAME kept as it is in ``.NAME.partial-PID-XXXXXXXX`` (26 bytes of suffix at most).
_STEM_MAX = 200
# Room kept below PATH_MAX for what a merge writes inside OUT_DIR (tasks/NAME/FILE, ...).
_PATH_ROOM = 320


class OutputError(MergekitExtError, OSError):
    """``OUT_DIR`` cannot be written safely."""


def _contains(outer: str, inner: str) -> bool:
    """``inner`` is ``outer`` or lies inside it (both absolute, normalized)."""
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


def check_write_path(
    path: str,
    inputs: Iterable[str],
    *,
    shown: str = "",
    what: str = "the output",
    folder: bool = False,
    advice: str = "write it elsewhere, apart from every input",
) -> str:
    """The one rule for every path a command writes: never an input, nor inside one.

    Args:
        path: the file or folder about to be written (a symbolic link is followed: its
            target is what gets written).
        inputs: every local path the command reads; model inputs are folders, so a file
            *inside* one (``EXPERT/config.json``) is refused as well as the folder itself.
        shown: ``path`` as the user wrote it, for the message.
        what: what is written, e.g. ``"the merge"`` or ``"--json"``.
        folder: ``path`` is a folder whose whole content the command owns (``OUT_DIR``): it
            may not contain an input either.
        advice: the end of the message, what to do instead.

    Returns:
        The absolute, symlink-free path.
    """
    shown = shown or path
    if not folder and os.path.lexists(path) and not os.path.isdir(path):
        check_file_destination(path, shown)  # a file: never written through a link
    target = os.path.realpath(path)
    for given in dict.fromkeys(inputs):
        real = os.path.realpath(given)
        if _contains(real, target):
            relation = "is" if real == target else "lies inside"
        elif folder and _contains(target, real):
            relation = "contains"
        else:
            continue
        raise OutputError(
            f"refusing to write {what} to {shown}: it {relation} the input {given}; {advice}"
        )
    return target


def check_file_destination(path: str, shown: str = "") -> None:
    """Refuse a file destination that writing would reach *through*: a symbolic link (its
    target, maybe a model's ``config.json``, would change), a file with other hard links
    (the same file under another name would change), or a folder.

    :func:`write_file` checks it again as it writes; commands call it before their work too,
    so a slow diagnosis never ends in this refusal.
    """
    shown = shown or path
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise OutputError(
            f"refusing to write {shown}: it is a symbolic link (to {os.readlink(path)}), and "
            "writing through it would change the file it points to; remove the link or "
            "choose another path"
        )
    if stat.S_ISDIR(st.st_mode):
        raise OutputError(
            f"refusing to write {shown}: it is a folder, where a file is written; move or "
            "rename that folder, or choose another path"
        )
    if st.st_nlink > 1:
        raise OutputError(
            f"refusing to write {shown}: it has {st.st_nlink} hard links, so it is the same "
            "file as another name (a model's config.json, say) and writing it would change "
            "that one too; remove it or choose another path"
        )


def write_file(path: str, data: str | bytes, shown: str = "") -> str:
    """Write ``data`` (text as UTF-8) as the file ``path``: the one way every command writes
    a file into a folder that already exists (``diagnose --json``, the card, its images).

    The file is always created new, under a temporary name beside ``path``, and renamed over
    it: an existing ``path`` is replaced, never opened, so nothing is written through a link
    (:func:`check_file_destination` refuses links and folders, naming them), and a reader
    never sees half a file. The new file gets the permissions of the user's umask.

    Returns:
        ``path``.
    """
    check_file_destination(path, shown)
    parent, name = os.path.split(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{name[:200]}.", suffix=".tmp", dir=parent)
    try:
        with os.fdopen(fd, "wb") as fp:
            fp.write(raw)
        os.chmod(tmp, 0o666 & ~current_umask())
        check_file_destination(path, shown)  # again: a link may have appeared meanwhile
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def _limits(path: str) -> tuple[int, int]:
    """(NAME_MAX, PATH_MAX) of the file system that would hold ``path``."""
    existing = path
    while not os.path.isdir(existing):
        existing = os.path.dirname(existing)
    try:
        return os.pathconf(existing, "PC_NAME_MAX"), os.pathconf(existing, "PC_PATH_MAX")
    except (OSError, ValueError, AttributeError):  # no pathconf (Windows): the usual limits
        return 255, 4096


def check_path_length(target: str, shown: str) -> None:
    """Refuse, before anything is created, a path the file system cannot hold."""
    name_max, path_max = _limits(target)
    for part in target.split(os.sep):
        size = len(os.fsencode(part))
        if size > name_max:
            short = part if len(part) <= 40 else part[:37] + "..."
            raise OutputError(
                f"output path {shown}: the name {short!r} is {size} bytes, more than the "
                f"{name_max} the file system allows for one name; choose a shorter name"
            )
    size = len(os.fsencode(target))
    if size + _PATH_ROOM > path_max:
        raise OutputError(
            f"output path {shown} is {size} bytes long; with the files a merge writes inside "
            f"it, it would pass the file system's limit of {path_max} bytes per path: choose "
            f"a path shorter than {path_max - _PATH_ROOM} bytes"
        )


def resolve_output(out_path: str, inputs: Iterable[str] = ()) -> str:
    """The absolute folder a merge into ``out_path`` writes; refuses unsafe locations.

    Args:
        out_path: ``OUT_DIR`` as given. A symbolic link is followed: the merge goes into
            its target (the link itself stays).
        inputs: every local path the merge reads (models, adapters, the tokenizer source,
            calibration data, the config file, plugin files); ``OUT_DIR`` may not be,
            contain or lie inside one (:func:`check_write_path`).

    Returns:
        The absolute, symlink-free path of the output folder.
    """
    if os.path.islink(out_path) and not os.path.exists(out_path):
        raise OutputError(
            f"output path {out_path} is a symbolic link to {os.readlink(out_path)}, which does "
            "not exist; remove the link or give the folder itself as OUT_DIR"
        )
    target = os.path.realpath(out_path)
    check_path_length(target, out_path)
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
    return check_write_path(
        out_path,
        inputs,
        what="the merge",
        folder=True,
        advice="choose an output folder apart from every model, adapter, tokenizer source, "
        "calibration file and config the merge reads",
    )


def leftover_stem(name: str) -> str:
    """``NAME`` as the lock and partial folders beside ``NAME`` spell it.

    ``.NAME.partial-PID-XXXXXXXX`` must fit in NAME_MAX (255 bytes) for every legal
    ``NAME``: a name longer than :data:`_STEM_MAX` bytes is cut and a hash of the whole
    name appended, so two long names that share a prefix never share a lock.
    """
    raw = os.fsencode(name)
    if len(raw) <= _STEM_MAX:
        return name
    digest = hashlib.sha256(raw).hexdigest()[:16]
    return raw[: _STEM_MAX - 17].decode("utf-8", "ignore") + "~" + digest


_LEFTOVER = re.compile(r"^\.(?P<name>.+)\.(?P<kind>partial|old)-(?P<pid>\d+)-[^/]*$")


def _own_leftover(entry: str, target: str, kind: str = "partial") -> bool:
    match = _LEFTOVER.match(entry)
    return (
        match is not None
        and match.group("kind") == kind
        and match.group("name") == leftover_stem(os.path.basename(target))
    )


def _user_entries(target: str) -> list[str]:
    """What ``target`` holds, less the partial folders of merges into it (in-place writes)."""
    return [e for e in os.listdir(target) if not _own_leftover(e, target)]


def check_replaceable(target: str, overwrite: bool, shown: str) -> None:
    """Refuse an existing ``target`` unless it is empty, or ``overwrite`` and a mergekit-ext
    output that is not a mount point.

    Args:
        target: the resolved output folder.
        overwrite: the user passed ``--overwrite``.
        shown: ``OUT_DIR`` as the user wrote it, for the messages.
    """
    if not os.path.lexists(target):
        return
    if not os.path.isdir(target):
        raise OutputError(f"output path {shown} exists and is not a folder")
    entries = _user_entries(target)
    if not entries:
        return  # written in place (see atomic_output_dir)
    ours = os.path.isfile(os.path.join(target, MARKER_FILE))
    if not overwrite and not ours:  # both at once: --overwrite would be refused next
        raise OutputError(
            f"output folder {shown} already exists and was not written by mergekit-ext (it "
            f"has no {MARKER_FILE}), so --overwrite would not replace it either: choose "
            "another OUT_DIR, or move or remove that folder yourself"
        )
    if not overwrite:
        raise OutputError(f"output folder {shown} already exists; pass --overwrite to replace it")
    if not ours:
        raise OutputError(
            f"--overwrite refused: {shown} was not written by mergekit-ext (it has no "
            f"{MARKER_FILE}), so replacing it could destroy your files; choose another "
            "OUT_DIR, or move or remove that folder yourself"
        )
    if is_mount_point(target):
        raise OutputError(
            f"--overwrite refused: {shown} is a mount point holding an earlier merge, and a "
            "mount point cannot be replaced as a whole; empty it first (an empty folder is "
            f"written in place), or write into a folder inside it such as {_inside(shown)}"
        )


def _mount_points() -> set[str]:
    """Every mount point of this process (Linux's ``/proc/self/mountinfo``), bind mounts
    included, which ``os.path.ismount`` misses when they share the parent's file system."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as fp:
            lines = fp.read().splitlines()
    except OSError:
        return set()
    points = set()
    for line in lines:
        fields = line.split()
        if len(fields) > 4:  # octal escapes: \040 for a space, \011 tab, \012 newline, \134
            points.add(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4]))
    return points


def is_mount_point(path: str) -> bool:
    """``path`` is a mount point (a container volume, a bind mount): it cannot be renamed."""
    return os.path.ismount(path) or os.path.realpath(path) in _mount_points()


def _inside(shown: str) -> str:
    return os.path.join(shown.rstrip(os.sep) or os.sep, "merged")


def _lock_path(target: str) -> str:
    return os.path.join(os.path.dirname(target), f".{leftover_stem(os.path.basename(target))}.lock")


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


def _remove_tree(path: str) -> bool:
    """Remove the folder ``path`` (never a symbolic link's target); True when it is gone."""
    if os.path.islink(path):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.lexists(path)


def remove_stale_partials(target: str) -> list[str]:
    """Remove the ``.NAME.partial-PID-*`` folders of killed merges into ``target``.

    They lie beside ``target`` (or inside it, for a merge written in place). Called with
    the output lock held, so no live merge into ``target`` can own one. Never removed, and
    named in a warning at every run until the user acts:

    - ``.NAME.old-PID-*``: a previous output, moved aside by a merge killed during its
      final rename; it may be the only copy of that output;
    - a symbolic link (or anything not a folder) with such a name: mergekit-ext only makes
      folders, so it is not ours, and a link is never followed;
    - a partial folder that cannot be removed (permissions).

    Returns:
        The removed folders.
    """
    parent, name = os.path.split(target)
    stem = leftover_stem(name)
    places = [parent]
    if os.path.isdir(target) and not os.path.islink(target):
        places.append(target)
    removed = []
    for place in places:
        for entry in sorted(os.listdir(place)):
            if not entry.startswith(f".{stem}."):
                continue
            path = os.path.join(place, entry)
            match = _LEFTOVER.match(entry)
            if match is None or match.group("name") != stem:
                if entry.startswith((f".{stem}.partial-", f".{stem}.old-")):
                    LOG.warning("%s was left by an older mergekit-ext; remove it by hand", path)
                continue
            if os.path.islink(path) or not os.path.isdir(path):
                LOG.warning(
                    "%s is named like a folder a merge leaves, but is %s; mergekit-ext never "
                    "follows nor removes it: remove it yourself (rm %s) if you do not need it",
                    path,
                    "a symbolic link" if os.path.islink(path) else "not a folder",
                    path,
                )
                continue
            pid = int(match.group("pid"))
            if _pid_alive(pid) and pid != os.getpid():
                LOG.warning("%s belongs to the running process %d; left in place", path, pid)
                continue
            if match.group("kind") == "old":
                if os.path.lexists(target):
                    hint = (
                        f"it holds the output that {target} replaced (--overwrite) and that "
                        "merge was killed before deleting it: delete it if you do not need it"
                    )
                else:
                    hint = f"it is the only copy of it: rename it back to {target} to keep it"
                LOG.warning(
                    "%s holds a previous %s, moved aside by a merge (pid %d) killed during its "
                    "final rename; it is never removed automatically: %s",
                    path,
                    name,
                    pid,
                    hint,
                )
                continue
            if not _remove_tree(path):
                LOG.warning(
                    "%s, left by a killed merge (pid %d), could not be removed; remove it yourself",
                    path,
                    pid,
                )
                continue
            LOG.warning("removed %s, left by a killed merge (pid %d)", path, pid)
            removed.append(path)
    return removed


def _check_lock_file(path: str) -> None:
    """A lock file that is not a plain file is not ours: never followed nor removed."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISREG(st.st_mode):
        return
    kind = (
        f"a symbolic link (to {os.readlink(path)})"
        if stat.S_ISLNK(st.st_mode)
        else "a folder"
        if stat.S_ISDIR(st.st_mode)
        else "not a plain file"
    )
    raise OutputError(
        f"the lock file {path} is {kind}; mergekit-ext makes it as a plain file and never "
        "follows nor removes anything else: move or remove it yourself, then rerun"
    )


@contextlib.contextmanager
def exclusive_output(target: str, shown: str) -> Iterator[None]:
    """Hold the lock ``.NAME.lock`` beside ``target``; fail at once when another merge has it.

    Parent folders made for it are removed again if nothing else was put in them (also
    when making them or taking the lock failed).

    Args:
        target: the resolved output folder.
        shown: ``OUT_DIR`` as the user wrote it, for the message.
    """
    parent = os.path.dirname(target)
    check_path_length(target, shown)
    created = []  # parent folders made here, removed again if the merge leaves them empty
    missing = parent
    while not os.path.exists(missing):
        created.append(missing)
        missing = os.path.dirname(missing)
    lock = None
    path = _lock_path(target)
    try:
        _check_lock_file(path)
        try:
            os.makedirs(parent, exist_ok=True)
            lock = FileLock(path, timeout=0, on_acquired=_record_owner)
            lock.acquire()
        except Timeout:
            lock = None
            raise OutputError(
                f"another mergekit-ext merge ({_lock_owner(path)}) is writing {shown} right "
                "now; wait for it to finish or choose another OUT_DIR"
            ) from None
        except OSError as e:
            lock = None
            raise OutputError(
                f"cannot write beside {shown} ({e.strerror or e}): a "
                "merge puts its lock file and temporary folder next to OUT_DIR, so the "
                f"folder that holds it ({parent}) must be writable; choose an OUT_DIR in a "
                "folder you can write to"
            ) from e
        remove_stale_partials(target)
        yield
    finally:
        if lock is not None:
            # Unlinked while still held: filelock re-opens when a waiter finds a dead inode.
            with contextlib.suppress(OSError):
                os.unlink(path)
            lock.release()
        for folder in created:
            try:
                os.rmdir(folder)
            except OSError:
                if os.path.exists(folder):
                    break


def current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def apply_umask(path: str) -> None:
    """Give ``path`` and everything below it the permissions the user's umask asks for.

    ``mkdtemp`` makes 0700 folders and safetensors writes through a 0600 temporary file, so
    a file's mode says nothing of the umask; folders get ``0777 & ~umask``, files
    ``0666 & ~umask`` (plus the execute bits they already had, filtered the same way).
    Symbolic links are never followed.
    """
    umask = current_umask()

    def fix(p: str, folder: bool) -> None:
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            return
        mode = 0o777 if folder else 0o666 | (st.st_mode & 0o111)
        os.chmod(p, mode & ~umask)

    fix(path, os.path.isdir(path) and not os.path.islink(path))
    if not os.path.isdir(path) or os.path.islink(path):
        return
    for folder, dirs, files in os.walk(path):
        for name in dirs:
            fix(os.path.join(folder, name), True)
        for name in files:
            fix(os.path.join(folder, name), False)


def _discard(tmp: str) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_output_dir(target: str, overwrite: bool = False, shown: str = "") -> Iterator[str]:
    """Yield a temporary folder; it becomes ``target`` only when everything succeeded.

    Beside ``target`` (``.NAME.partial-PID-*``), renamed to ``target`` at the end. When
    ``target`` is an existing empty folder (a mount point such as a container's volume
    cannot be renamed, nor renamed onto), the temporary folder is made inside it instead
    and its entries are moved up at the end; the folder itself, its owner and mode stay.

    On any exception (KeyboardInterrupt, SIGTERM and SIGHUP included) and when the final
    rename fails, the temporary folder is removed and ``target`` is left as it was: the
    merge is never left behind as a hidden folder. Whether ``target`` may be replaced is
    checked again at the end: a folder (or files in an empty one) that appeared meanwhile
    is replaced only with ``overwrite`` and only when it is a mergekit-ext output.
    Every file written gets the permissions of the user's umask (:func:`apply_umask`).

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
    in_place = os.path.isdir(target) and not _user_entries(target)
    os.makedirs(parent, exist_ok=True)
    prefix = f".{leftover_stem(name)}.partial-{os.getpid()}-"
    tmp = tempfile.mkdtemp(prefix=prefix, dir=target if in_place else parent)
    try:
        apply_umask(tmp)
        yield tmp
        if in_place:
            if not os.path.isdir(target) or _user_entries(target):
                raise OutputError(
                    f"files appeared in {shown} while the merge ran; they were left as they "
                    "are and the merge was discarded: move them away and rerun, or choose "
                    "another OUT_DIR"
                )
        else:
            if os.path.lexists(target) and not overwrite:
                raise OutputError(
                    f"{shown} appeared while the merge ran; it was left as it is and the merge "
                    "was discarded: rerun with --overwrite to replace it, or choose another "
                    "OUT_DIR"
                )
            check_replaceable(target, overwrite, shown)
        apply_umask(tmp)
    except BaseException:
        _discard(tmp)
        raise
    if in_place:
        _move_into(tmp, target, shown)
    else:
        _rename_into(tmp, target, shown)
    LOG.info("wrote %s", target)


def _move_into(tmp: str, target: str, shown: str) -> None:
    """Move the entries of ``tmp`` (inside ``target``) up into ``target``; all or none.

    The diagnostics file, the proof that the folder is a finished merge, comes last.
    """
    names = sorted(os.listdir(tmp), key=lambda n: (n == MARKER_FILE, n))
    moved: list[str] = []
    placed = False
    try:
        for entry in names[:-1]:
            os.rename(os.path.join(tmp, entry), os.path.join(target, entry))
            moved.append(entry)
        with _signals_held():  # the last one (the marker) completes the output
            for entry in names[-1:]:
                os.rename(os.path.join(tmp, entry), os.path.join(target, entry))
                moved.append(entry)
            placed = True
            _PLACED.append(target)
    except BaseException as e:
        if placed:  # a signal just after the last move: the output is complete
            with contextlib.suppress(OSError):
                os.rmdir(tmp)
            raise
        for entry in reversed(moved):
            with contextlib.suppress(OSError):
                os.rename(os.path.join(target, entry), os.path.join(tmp, entry))
        _discard(tmp)
        if isinstance(e, OSError):
            raise OutputError(
                f"could not move the finished merge into {shown} ({e.strerror or e}); "
                f"{shown} was left empty and the merge was discarded"
            ) from e
        raise
    os.rmdir(tmp)  # complete: a signal from here on leaves the output in place


# Outputs this process has put in place: a signal that ends the command after the final
# rename is reported as such (the output is complete), not as "no output was written".
_PLACED: list[str] = []
_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


def placed_outputs() -> list[str]:
    """The output folders this process renamed into place (oldest first)."""
    return list(_PLACED)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP wait (they are delivered after) while the final rename and
    its record happen together: a signal never falls between the two."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


_CANNOT_RENAME = (errno.EBUSY, errno.EXDEV, errno.EPERM, errno.EACCES, errno.ENOTEMPTY)


def _rename_into(tmp: str, target: str, shown: str) -> None:
    """Rename ``tmp`` to ``target`` (the earlier output moved aside first, then removed)."""
    parent, name = os.path.split(target)
    old = None
    placed = False
    try:
        if os.path.lexists(target):
            old = tempfile.mkdtemp(prefix=f".{leftover_stem(name)}.old-{os.getpid()}-", dir=parent)
            os.rmdir(old)
            os.rename(target, old)
        with _signals_held():
            os.rename(tmp, target)
            placed = True
            _PLACED.append(target)
    except BaseException as e:
        if placed:  # a signal just after the rename: the output is complete
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            raise
        if old is not None and os.path.lexists(old) and not os.path.lexists(target):
            os.rename(old, target)
        _discard(tmp)
        if isinstance(e, OSError) and e.errno in _CANNOT_RENAME:
            raise OutputError(
                f"the finished merge could not be renamed to {shown} ({e.strerror}): "
                f"{shown} cannot be replaced as a whole (a mount point or another file "
                f"system?); it was left as it was and the merge was discarded. Empty it (an "
                f"empty folder is written in place) or write into a folder inside it such as "
                f"{_inside(shown)}"
            ) from e
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
