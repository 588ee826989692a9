"""Float64 reductions of GB-sized tensors, one chunk of rows at a time.

Sums of squares and dot products of LLM-width weights (traces, output errors, Frobenius
norms) need float64 whatever the tensor's dtype: a float32 accumulation of an 8B
``gate_up`` weight's squares is off by ~1 % (measured). Widening the whole tensor first
costs a GB-sized float64 copy and its page faults, ``torch.linalg.vector_norm(...,
dtype=torch.float64)`` runs ~16x slower on this CPU (1.30 s for a 28672 x 4096 float32
weight, torch 2.13, two threads), and neither it nor a BLAS dot gives the same bits on one
thread and two; hence this hand-written loop.
"""

from __future__ import annotations

import math

import torch

# Out-rows per chunk: about this many entries in each temporary (16 MB in float64), which
# the allocator hands back chunk after chunk, instead of out x in ones that each cost their
# page faults anew (GBs at LLM widths).
_CHUNK_ENTRIES = 1 << 21


def row_chunks(n_out: int, n_in: int) -> list[slice]:
    """Slices of a weight's output rows, each about :data:`_CHUNK_ENTRIES` entries.

    Args:
        n_out: the number of rows.
        n_in: the entries per row.

    Returns:
        Consecutive slices covering ``range(n_out)``.
    """
    step = max(1, _CHUNK_ENTRIES // max(n_in, 1))
    return [slice(a, min(a + step, n_out)) for a in range(0, n_out, step)]


def dot64(a: torch.Tensor, b: torch.Tensor) -> float:
    """``Σ a ⊙ b`` in float64, one chunk of rows at a time, in an order fixed by the shape.

    Each chunk is widened into one reused float64 buffer (no whole-size float64 copy) and
    multiplied in place, then summed by :func:`_sum64`. Not a BLAS dot: its order depends on
    the thread count (torch 2.13 on this CPU: one thread and two differ in the last bits),
    and one process and several (one thread each) must record the same numbers. The order
    is the tensors' logical (row-major) one, not their memory layout: a transposed view and
    its contiguous copy (what a distributed run receives) give the same bits.

    Args:
        a: any float tensor.
        b: a tensor of ``a``'s shape (``a`` itself for a sum of squares).

    Returns:
        The sum, a Python float.
    """
    rows = int(a.shape[0]) if a.ndim >= 2 else 1
    a2, b2 = a.reshape(rows, -1), b.reshape(rows, -1)
    cols = int(a2.shape[1])
    parts = row_chunks(rows, cols)
    size = max((p.stop - p.start) * cols for p in parts) if parts else 0
    left = torch.empty(size, dtype=torch.float64, device=a.device)
    right = None if b is a else torch.empty(size, dtype=torch.float64, device=a.device)
    total = 0.0
    for part in parts:
        n = (part.stop - part.start) * cols
        x = left[:n]
        x.view(-1, cols).copy_(a2[part])
        if right is None:
            x.square_()
        else:
            x.mul_(right[:n].view(-1, cols).copy_(b2[part]).view(-1))
        total += _sum64(x)
    return total


# Entries per row of :func:`_sum64`'s two-level sum.
_ROW = 1024


def _sum64(x: torch.Tensor) -> float:
    """The sum of a 1-D float64 tensor in an order that does not depend on the thread count.

    A whole-tensor ``sum()`` splits its work by thread (four thread counts, four different
    last bits, measured), while a sum along rows runs each row on one thread: so fixed-width
    rows first, then their sums and the remainder (each far below the size at which torch
    splits a reduction).
    """
    full = x.numel() // _ROW * _ROW
    head = float(x[:full].view(-1, _ROW).sum(dim=1).sum()) if full else 0.0
    return head + float(x[full:].sum())


def frobenius64(w: torch.Tensor) -> float:
    """``‖w‖_F`` from a float64 sum of squares (:func:`dot64`).

    Args:
        w: any float tensor.

    Returns:
        The norm, a Python float.
    """
    return math.sqrt(dot64(w, w))


# Entries per chunk of :func:`add_widened`'s widened copy (2 MB in float64: it stays in
# cache between the copy and the addition).
_ADD_CHUNK_ENTRIES = 1 << 18


def add_widened(total: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    """``total += part`` for a wider ``total`` (a float64 sum of float32 products), in place.

    The same bits as ``total.add_(part)`` (each entry is widened exactly, then added once),
    one chunk of rows at a time through a small reused buffer of ``total``'s dtype: torch's
    mixed-dtype ``add_`` casts inside its inner loop and runs ~5x slower on this CPU
    (3584 x 3584 float32 into float64, one thread: 0.12 s against 0.02 s, measured; the
    statistics add one such product per chunk of tokens, task and group).

    Args:
        total: the running sum, 2-D (a block of a larger one too).
        part: a tensor of ``total``'s shape.

    Returns:
        ``total``.
    """
    if part.dtype == total.dtype or total.ndim != 2:
        return total.add_(part)
    rows, cols = int(total.shape[0]), int(total.shape[1])
    step = max(1, _ADD_CHUNK_ENTRIES // max(cols, 1))
    buffer = torch.empty(min(step, rows) * cols, dtype=total.dtype, device=total.device)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        wide = buffer[: (stop - start) * cols].view(stop - start, cols)
        total[start:stop].add_(wide.copy_(part[start:stop]))
    return total
