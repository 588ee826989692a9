"""A roofline for the merges: the FLOPs of each phase, by GEMM class, against this process's
measured GEMM rates (issue #47, item 4).

A :class:`Roofline` is a ``TorchDispatchMode``: every ``aten`` matrix product and LAPACK
factorisation / solve that runs while it is active is counted (FLOPs, with the convention
``2·m·n·k`` for a GEMM) under the innermost open phase and its GEMM class (``float64``,
``float32``, ``bf16``: a bfloat16 GEMM or a float32 one in oneDNN's bf16 fpmath mode, which
:func:`mergekit_ext.bf16_products.float32_product` uses; LAPACK calls count as ``float64``
or ``float32`` by their dtype). The wall time of each phase is exclusive (a nested phase
pauses its parent). :meth:`Roofline.measure_rates` times one GEMM per class, in this
process, with its threads; each counted FLOP is charged ``flops / rate`` of the rates last
measured, so a probe that measures right before each phase gets a floor from the machine
as it was then (the machine is shared: its rate moves). ``time / floor`` then says how far
each phase is from running at the GEMM rate; elementwise work, copies and memory traffic
count as no FLOPs, so they show up in the gap.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

#: the GEMM classes, each timed by :meth:`Roofline.measure_rates`
CLASSES = ("float64", "float32", "bf16")
#: the measured GEMM: ``m x k`` times ``k x n`` (an 8B group's shapes are larger; this one
#: takes ~0.1-0.3 s per class on one core at float64 and keeps the measurement short)
RATE_SHAPE = (1024, 2048, 2048)


def _gemm_class(dtype: torch.dtype) -> str:
    if dtype == torch.float64:
        return "float64"
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    if torch.backends.mkldnn.matmul.fp32_precision == "bf16":
        return "bf16"  # oneDNN's bf16 fpmath mode: the bfloat16 units where the CPU has them
    return "float32"


def _flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    """FLOPs of one aten call (0 for what is not a product or a factorisation)."""
    packet = getattr(func, "overloadpacket", None)
    if packet in (aten.mm, aten.addmm):
        a, b = (args[0], args[1]) if packet is aten.mm else (args[1], args[2])
        (m, k), (_, n) = a.shape, b.shape
        return 2.0 * m * n * k
    if packet in (aten.bmm, aten.baddbmm):
        a, b = (args[0], args[1]) if packet is aten.bmm else (args[1], args[2])
        (batch, m, k), (_, _, n) = a.shape, b.shape
        return 2.0 * batch * m * n * k
    if packet in (
        aten._scaled_dot_product_flash_attention_for_cpu,
        aten._scaled_dot_product_attention_math,
    ):
        q, key = args[0], args[1]
        *batch, s, d = q.shape
        heads = 1
        for b in batch:
            heads *= b
        return 4.0 * heads * s * key.shape[-2] * d
    if packet is aten.linalg_cholesky_ex:
        n = args[0].shape[-1]
        return n**3 / 3.0
    if packet is aten.linalg_solve_triangular:
        a, b = args[0], args[1]
        n = a.shape[-1]
        rhs = b.numel() // n
        return float(n * n * rhs)
    if packet is aten.cholesky_solve:
        b, factor = args[0], args[1]
        n = factor.shape[-1]
        return 2.0 * n * n * (b.numel() // n)
    if packet in (aten._linalg_eigh, aten.linalg_eigh):
        n = args[0].shape[-1]
        vectors = bool(args[2]) if len(args) > 2 else bool(kwargs.get("compute_v", True))
        return (9.0 if vectors else 4.0 / 3.0) * n**3
    if packet is aten.linalg_eigvalsh:
        n = args[0].shape[-1]
        return 4.0 / 3.0 * n**3
    if packet is aten.linalg_lu_factor_ex:
        n = args[0].shape[-1]
        return 2.0 / 3.0 * n**3
    return 0.0


def _dtype_of(args: tuple[Any, ...]) -> torch.dtype:
    for a in args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a.dtype
    return torch.float32


@dataclass
class PhaseRecord:
    seconds: float = 0.0
    floor_s: float = 0.0
    flops: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    entries: int = 0


class Roofline(TorchDispatchMode):
    """Counts FLOPs per phase and GEMM class, times phases, charges each FLOP at the rate last
    measured (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.phases: dict[str, PhaseRecord] = defaultdict(PhaseRecord)
        self._stack: list[str] = ["other"]
        self._since = time.perf_counter()
        self.rates: dict[str, float] = {}
        self.rate_samples: list[dict[str, float]] = []
        self._paused = False

    # -- counting -----------------------------------------------------------------------
    def __enter__(self) -> Roofline:
        # Under any Python dispatch mode, ATen's eigvalsh computes the eigenvectors too (it
        # takes the mode for a tensor subclass that may need gradients): ~10x the time for a
        # 1024 x 1024 matrix, measured. So it runs with the mode off, counted here.
        self._eigvalsh = torch.linalg.eigvalsh
        original = self._eigvalsh

        def eigvalsh(matrix: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            with torch.utils._python_dispatch._disable_current_modes():
                values = original(matrix, *args, **kwargs)
            if not self._paused:
                self._count(4.0 / 3.0 * matrix.shape[-1] ** 3, matrix.dtype)
            return values

        torch.linalg.eigvalsh = eigvalsh
        return super().__enter__()  # type: ignore[return-value]

    def __exit__(self, *exc: Any) -> None:
        torch.linalg.eigvalsh = self._eigvalsh
        super().__exit__(*exc)

    def _count(self, flops: float, dtype: torch.dtype) -> None:
        kind = _gemm_class(dtype)
        record = self.phases[self._stack[-1]]
        record.flops[kind] += flops
        rate = self.rates.get(kind)
        if rate:
            record.floor_s += flops / rate

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._paused:
            return out
        flops = _flops(func, args, kwargs)
        if flops:
            self._count(flops, _dtype_of(args))
        return out

    # -- phases ---------------------------------------------------------------------------
    def _charge(self) -> None:
        now = time.perf_counter()
        self.phases[self._stack[-1]].seconds += now - self._since
        self._since = now

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time and count what runs inside under ``name`` (exclusive of nested phases)."""
        self._charge()
        self._stack.append(name)
        self.phases[name].entries += 1
        try:
            yield
        finally:
            self._charge()
            self._stack.pop()

    # -- rates ----------------------------------------------------------------------------
    def measure_rates(self, repeats: int = 2) -> dict[str, float]:
        """FLOP/s of one :data:`RATE_SHAPE` GEMM per class, best of ``repeats``, now and with
        this process's threads; not counted and not charged to any phase."""
        from mergekit_ext.bf16_products import bfloat16_fpmath

        self._charge()
        self._paused = True
        try:
            m, k, n = RATE_SHAPE
            generator = torch.Generator().manual_seed(0)
            a = torch.randn(m, k, generator=generator).bfloat16().float()
            b = torch.randn(k, n, generator=generator).bfloat16().float()
            rates = {}
            for kind in CLASSES:
                x, y = (a.double(), b.double()) if kind == "float64" else (a, b)
                best = float("inf")
                for _ in range(repeats):
                    start = time.perf_counter()
                    if kind == "bf16":
                        # what float32_product runs: float32 GEMM in the bf16 fpmath mode
                        with bfloat16_fpmath():
                            torch.mm(x, y)
                    else:
                        torch.mm(x, y)
                    best = min(best, time.perf_counter() - start)
                rates[kind] = 2.0 * m * n * k / best
        finally:
            self._paused = False
            self._since = time.perf_counter()  # the measurement belongs to no phase
        self.rates = rates
        self.rate_samples.append(dict(rates))
        return rates

    # -- report ---------------------------------------------------------------------------
    def record(self) -> dict[str, Any]:
        self._charge()
        return {
            "phases": {
                name: {
                    "seconds": r.seconds,
                    "floor_s": r.floor_s,
                    "flops": dict(r.flops),
                    "entries": r.entries,
                }
                for name, r in self.phases.items()
            },
            "rate_samples": self.rate_samples,
        }


def table(record: dict[str, Any], blocks: int, title: str = "") -> str:
    """A markdown table of one run's phases, per block: GFLOP by class, floor, time, ratio."""
    samples = record["rate_samples"]
    lines = []
    if title:
        lines.append(title)
    if samples:
        lo = {k: min(s[k] for s in samples) / 1e9 for k in CLASSES}
        hi = {k: max(s[k] for s in samples) / 1e9 for k in CLASSES}
        lines.append(
            f"measured GEMM rates ({len(samples)} samples, GFLOP/s min-max): "
            + ", ".join(f"{k} {lo[k]:.0f}-{hi[k]:.0f}" for k in CLASSES)
        )
    lines += [
        "",
        "| phase | GFLOP f64 / block | GFLOP f32 / block | GFLOP bf16 / block | floor s / block "
        "| time s / block | time / floor |",
        "|---|---|---|---|---|---|---|",
    ]
    total_floor = total_time = 0.0
    for name, r in sorted(record["phases"].items(), key=lambda kv: -kv[1]["seconds"]):
        f = r["flops"]
        floor, seconds = r["floor_s"] / blocks, r["seconds"] / blocks
        total_floor += floor
        total_time += seconds
        ratio = f"{seconds / floor:.2f}" if floor > 0 else "no FLOPs"
        lines.append(
            f"| {name} | {f.get('float64', 0) / 1e9 / blocks:.0f} "
            f"| {f.get('float32', 0) / 1e9 / blocks:.0f} | {f.get('bf16', 0) / 1e9 / blocks:.0f} "
            f"| {floor:.2f} | {seconds:.2f} | {ratio} |"
        )
    lines.append(
        f"| **all** | | | | {total_floor:.2f} | {total_time:.2f} | {total_time / total_floor:.2f} |"
        if total_floor
        else ""
    )
    return "\n".join(lines)
