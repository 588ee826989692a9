"""Wall time and peak memory of one merge, for the diagnostics, the card and ``run``'s last line.

Peak host memory is the resident set size's high-water mark. On Linux the kernel keeps it
per process (``VmHWM`` in ``/proc/self/status``) and lets a process reset it by writing
``5`` to ``/proc/self/clear_refs``, so the peak measured is the merge's own, not that of
whatever the process did before (a notebook that already loaded a model). Where that
reset is not available (macOS, restricted containers) the process's lifetime peak from
``getrusage`` is used and the record says so (``peak_rss_scope: "process"``).

On CUDA, ``torch.cuda.max_memory_allocated`` is reset at the start and read at the end, for
every visible device (summed: a merge that spreads over devices needs them all).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Any, Optional

LOG = logging.getLogger(__name__)

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _status_kb(*fields: str) -> Optional[tuple[int, ...]]:
    """Fields of ``/proc/self/status`` in bytes, read at one instant (None off Linux)."""
    found: dict[str, int] = {}
    try:
        with open(_STATUS, encoding="ascii") as fp:
            for line in fp:
                key = line.split(":", 1)[0]
                if key in fields:
                    found[key] = int(line.split()[1]) * 1024  # the kernel reports kB
    except (OSError, ValueError, IndexError):
        return None
    return tuple(found[f] for f in fields) if len(found) == len(fields) else None


def _vm_hwm_bytes() -> Optional[int]:
    """The resident set's high-water mark from ``/proc/self/status`` (None off Linux)."""
    values = _status_kb("VmHWM")
    return values[0] if values else None


# How far the high-water mark may sit above the resident set right after a reset that took:
# another thread may free memory between the reset and the read. A reset that did not take
# but is within this slack misstates the peak by no more than the slack.
_RESET_SLACK_BYTES = 16 * 2**20


def _reset_peak_rss() -> bool:
    """Reset ``VmHWM`` to the current RSS; False where the kernel does not do it.

    Some sandboxed kernels (seen on a CI runner) accept the write to ``clear_refs`` and
    keep the old high-water mark, so the reset is checked, not assumed: right after it
    the mark must equal the current resident set.
    """
    try:
        with open(_CLEAR_REFS, "w", encoding="ascii") as fp:
            fp.write("5")
    except OSError:
        return False
    values = _status_kb("VmHWM", "VmRSS")
    if values is None:
        return False
    hwm, rss = values
    if hwm > rss + _RESET_SLACK_BYTES:
        LOG.debug("clear_refs did not reset VmHWM (%d > %d): peak is the process's", hwm, rss)
        return False
    return True


def _rusage_peak_bytes() -> Optional[int]:
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # bytes vs kB


def _cuda_devices() -> list[int]:
    """CUDA devices already in use by this process (never initialises CUDA itself)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    return list(range(torch.cuda.device_count()))


@dataclass
class ResourceUsage:
    """What one merge took: seconds, peak host RSS and (on GPU) CUDA's peak allocation."""

    wall_time_s: float
    peak_rss_bytes: Optional[int]
    peak_rss_scope: str  # "merge" (reset at the start) | "process" (lifetime peak)
    cuda_max_allocated_bytes: Optional[int] = None

    def to_json(self) -> dict[str, Any]:
        return {
            "wall_time_s": round(self.wall_time_s, 3),
            "peak_rss_bytes": self.peak_rss_bytes,
            "peak_rss_scope": self.peak_rss_scope,
            "cuda_max_allocated_bytes": self.cuda_max_allocated_bytes,
        }


class ResourceMeter:
    """Measures the block it wraps::

    with ResourceMeter() as meter:
        merge()
    meter.usage  # ResourceUsage
    """

    def __init__(self) -> None:
        self.usage: Optional[ResourceUsage] = None
        self._start = 0.0
        self._scope = "process"

    def __enter__(self) -> ResourceMeter:
        self._scope = "merge" if _reset_peak_rss() else "process"
        torch = sys.modules.get("torch")
        for device in _cuda_devices():
            torch.cuda.reset_peak_memory_stats(device)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        wall = time.perf_counter() - self._start
        peak = _vm_hwm_bytes() if self._scope == "merge" else None
        if peak is None:
            peak, self._scope = _rusage_peak_bytes(), "process"
        # CUDA may have been initialised by the merge itself: read every device it now uses.
        torch = sys.modules.get("torch")
        devices = _cuda_devices()
        cuda = sum(int(torch.cuda.max_memory_allocated(d)) for d in devices) if devices else None
        self.usage = ResourceUsage(wall, peak, self._scope, cuda)


def format_duration(seconds: float) -> str:
    """``0.4 s``, ``12 s``, ``1 min 12 s``, ``2 h 03 min``."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    whole = int(round(seconds))
    if whole < 60:
        return f"{whole} s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def format_bytes(size: Optional[float]) -> str:
    """Decimal units (1000s, as the Hub and disk vendors count): ``123 kB``, ``3.40 GB``.

    The one byte formatter of every message, card and report (``run``'s summary,
    ``publish``): tqdm's ``format_sizeof``, with a space before the unit.
    """
    if size is None:
        return "unknown"
    if abs(size) < 1000:
        return f"{size:.0f} B"  # whole bytes (format_sizeof writes "5.00B")
    from tqdm import tqdm

    text = tqdm.format_sizeof(float(size), "B", 1000)
    number = text.rstrip("kMGTPEZYB")
    return f"{number} {text[len(number) :]}"


def summary_line(record: Optional[dict[str, Any]]) -> Optional[str]:
    """``merged in 1 min 12 s, peak memory 3.4 GB`` (+ CUDA) from a diagnostics record."""
    if not record or record.get("wall_time_s") is None:
        return None
    text = f"merged in {format_duration(float(record['wall_time_s']))}"
    text += f", peak memory {format_bytes(record.get('peak_rss_bytes'))}"
    if record.get("peak_rss_scope") == "process":
        text += " (whole process)"
    if record.get("cuda_max_allocated_bytes") is not None:
        text += f", CUDA max allocated {format_bytes(record['cuda_max_allocated_bytes'])}"
    return text


__all__ = [
    "ResourceMeter",
    "ResourceUsage",
    "format_bytes",
    "format_duration",
    "summary_line",
]
