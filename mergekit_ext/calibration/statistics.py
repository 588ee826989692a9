"""Activation statistics of linear-layer inputs: hooks and accumulators.

RegMean (Jin et al., ICLR 2023, Eq. 4) and Chain of Merges (arXiv 2508.21421) merge a
linear layer from the Gram matrix of its inputs on each task's data,
``G_k = (1/N_k) sum_x x x^T`` over the N_k non-padding tokens (or patches) of task k; CoM's
``normalize`` forms the same mean over unit-norm inputs ``x / ||x||``. This module computes
those means in float64 (or float32) whatever the model's dtype:

- :func:`flatten_tokens` drops padded positions (``[B, T, D] -> [N, D]``);
- :class:`ActivationStatistics` accumulates sums and returns a
  :class:`~mergekit_ext.methods.layerwise.TaskStatistics` of means;
- :class:`LinearInputCapture` hooks named ``nn.Linear`` / HF ``Conv1D`` modules of any
  model and feeds their inputs, unpadded, to one accumulator each.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Optional

import torch
from torch import nn

from mergekit_ext.bf16_products import float32_product, holds_bfloat16
from mergekit_ext.errors import CalibrationError, ModelInputError, TensorError
from mergekit_ext.finite import is_finite
from mergekit_ext.wide_sums import add_widened

LOG = logging.getLogger(__name__)

# The Gram sum adds one ``dim x dim`` product per chunk of rows, and each float64 addition
# reads and writes the whole sum: with small batches that traffic, not the product, is the
# cost (125-token batches at 4096 inputs: the additions took 1.8x the bfloat16 products that
# fed them, measured in the 8B-width probe, benchmarks/results/llm_width_idle_bf16.md). So
# the rows of consecutive batches are multiplied together until at least this many are
# pending (or a quarter of the width, below, if fewer); each product's float32 sums then run
# over fewer than that many plus one batch.
GRAM_CHUNK_MIN_ROWS = 2048


def gram_chunk_rows(dim: int) -> int:
    """The rows a ``dim``-wide Gram sum joins before each product: :data:`GRAM_CHUNK_MIN_ROWS`,
    but at most ``dim / 4``, so that the pending float32 rows never take more than an eighth
    of the float64 sum's bytes (and a product of that many rows still costs about as much as
    the float64 addition it saves)."""
    return max(1, min(GRAM_CHUNK_MIN_ROWS, dim // 4))


def symmetrized(matrix: torch.Tensor) -> torch.Tensor:
    """``(M + Mᵀ) / 2``, the same bits as that expression (addition commutes).

    A contiguous copy of the transpose first: an elementwise add that reads one operand
    transposed runs at a third of memory speed (4096 x 4096 float64, two threads: 0.10 s
    against 0.15 s, measured), and the statistics symmetrise one such sum per task and group.
    """
    return matrix.T.contiguous().add_(matrix).mul_(0.5)


def gram_chunks(batch_sizes: Sequence[int], min_rows: int) -> list[int]:
    """The rows of each product the Gram sum adds, for batches of ``batch_sizes`` rows.

    Args:
        batch_sizes: the rows of each update, in order.
        min_rows: consecutive batches are joined until at least this many rows
            (:func:`gram_chunk_rows` of the width).

    Returns:
        Rows per product, in order (the last one takes what is left); they sum to the rows.
    """
    chunks, pending = [], 0
    for size in batch_sizes:
        pending += int(size)
        if pending >= min_rows:
            chunks.append(pending)
            pending = 0
    if pending:
        chunks.append(pending)
    return chunks


@dataclass
class TaskStatistics:
    """Statistics of the inputs a linear group sees on one task's calibration data.

    All are means over the task's (non-padding) tokens or patches, accumulated in float64:

    - ``gram``: ``(1/N) sum_x x x^T`` (in x in); None when only moments were requested
      (``StatisticsRequest.reference_gram_max_dim``)
    - ``gram_normalized``: the same over ``x / ||x||`` (CoM's ``normalize``); None when
      not requested
    - ``mean``: ``(1/N) sum_x x`` (in,)
    - ``count``: N, the number of tokens
    - ``second_moment``: ``(1/N) sum_x x ⊙ x`` (in,), the diagonal of ``gram``; derived
      from ``gram`` when not given
    - ``rows``: the inputs themselves (``N x in``, float32 or float64), kept only when asked
      (``StatisticsRequest.keep_rows``) and N < in, INSTEAD of ``gram`` (then None): the Gram
      ``rowsᵀ rows / N`` has rank at most N, the least-squares merge solves in the rows' span
      and :meth:`gram_from_rows` forms the Gram where something needs it; None otherwise
    """

    gram: Optional[torch.Tensor]
    mean: torch.Tensor
    count: int
    gram_normalized: Optional[torch.Tensor] = None
    second_moment: Optional[torch.Tensor] = None
    rows: Optional[torch.Tensor] = None
    row_batches: Optional[tuple[int, ...]] = None  # sizes of the batches ``rows`` came in

    def __post_init__(self) -> None:
        if self.second_moment is None:
            if self.gram is None:
                raise ValueError("TaskStatistics needs a gram or a second_moment")
            self.second_moment = torch.diagonal(self.gram).clone()

    def gram_from_rows(self) -> Optional[torch.Tensor]:
        """``gram``, or ``rowsᵀ rows / N`` (float64) when the rows were kept instead; None
        when only moments were kept.

        Formed as :class:`ActivationStatistics` would have: the product of each chunk of
        batches (``row_batches`` joined by :func:`gram_chunks`) in the rows' dtype added to a
        float64 sum in order, divided by N, symmetrised; so it is bit for bit the Gram the
        accumulator would have returned.
        """
        if self.gram is not None or self.rows is None:
            return self.gram
        sizes = list(self.row_batches) if self.row_batches else [self.rows.shape[0]]
        dim = self.rows.shape[1]
        total = torch.zeros(dim, dim, dtype=torch.float64, device=self.rows.device)
        chunks = gram_chunks(sizes, gram_chunk_rows(int(self.rows.shape[1])))
        upper_only = False
        for chunk in torch.split(self.rows, chunks):
            upper_only |= add_gram_chunk(total, chunk)
        total.div_(self.count)
        return finish_gram(total, upper_only)

    @property
    def covariance(self) -> torch.Tensor:
        """``gram − mean meanᵀ`` (needs the full Gram or the rows)."""
        gram = self.gram_from_rows()
        if gram is None:
            raise ValueError("these statistics keep only moments; the covariance needs the Gram")
        return gram - torch.outer(self.mean, self.mean)

    @property
    def variance(self) -> torch.Tensor:
        """Per-feature variance ``second_moment − mean²`` (clamped at 0)."""
        assert self.second_moment is not None
        return (self.second_moment - self.mean.square()).clamp_min(0.0)


def flatten_tokens(hidden: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """``[B, T, D] -> [N, D]``: the rows of the non-padding positions (all of them without a mask).

    ``attention_mask`` is ``[B, T]`` with 1 for real tokens and 0 for padding. Rows laid out
    otherwise in the same order, flattened ``[B·T, D]`` (a mixture-of-experts router's input)
    or with singleton axes (DeepSeek-V3's ``[B, 1, T, D]`` latent), take the flattened mask.
    """
    if attention_mask is None:
        return hidden.reshape(-1, hidden.shape[-1])
    lead = tuple(hidden.shape[:-1])
    if lead != tuple(attention_mask.shape) and (
        (hidden.dim() == 2 and lead[0] == attention_mask.numel())
        or tuple(d for d in lead if d != 1) == tuple(d for d in attention_mask.shape if d != 1)
    ):
        rows = hidden.reshape(-1, hidden.shape[-1])
        return rows[attention_mask.reshape(-1).to(device=hidden.device).bool()]
    if hidden.dim() != 3 or tuple(attention_mask.shape) != tuple(hidden.shape[:2]):
        raise TensorError(
            f"attention mask of shape {tuple(attention_mask.shape)} does not fit hidden states of "
            f"shape {tuple(hidden.shape)}; expected [B, T] and [B, T, D]"
        )
    return hidden[attention_mask.to(device=hidden.device).bool()]


class ActivationStatistics:
    """Running sums of ``x x^T``, ``x``, ``x ⊙ x`` and (optionally) ``x̂ x̂^T``, ``x̂ = x / ||x||``.

    Sums are kept in ``dtype`` (float64 by default) on ``device`` (default: that of the first
    input); :meth:`finalize` divides by the token count. Rows with zero norm count as tokens
    and add zero to the normalized Gram.

    Speed: the product ``x_cᵀ x_c`` of each chunk of consecutive batches (at least
    :func:`gram_chunk_rows` rows, :func:`gram_chunks`) is formed in ``product_dtype`` and
    added to the ``dtype`` sum. The default (None) forms it in float32 for inputs of 32 bits
    or fewer (twice the GEMM throughput of float64 on a CPU; the float32 error is that of one
    chunk's sum, ~1e-7 relative) and in float64 for float64 inputs; pass ``torch.float64``
    for float64 products throughout.

    ``full_gram=False`` keeps only the mean and the per-feature second moment (``gram`` is
    then None in the result): what a diagonal-covariance diagnostic needs, at O(N·dim) cost
    instead of O(N·dim²).

    ``keep_rows=True`` (with ``full_gram``) keeps the rows themselves (in the product dtype)
    instead of the Gram while fewer than ``dim`` tokens have been seen: the result then has
    ``rows`` and ``gram=None`` (``TaskStatistics.gram_from_rows`` forms it on demand); the
    Gram has rank below ``dim`` and a least-squares solve is cheaper in the rows' span, and
    ``N x dim`` rows take less memory than the ``dim x dim`` float64 sum. Once ``dim`` tokens
    are reached the Gram sum is formed from the kept rows and they are dropped, so they never
    take more than ``dim² · 4`` bytes (float32).
    """

    def __init__(
        self,
        dim: int,
        *,
        normalized_gram: bool = False,
        full_gram: bool = True,
        dtype: torch.dtype = torch.float64,
        product_dtype: Optional[torch.dtype] = None,
        device: Optional[torch.device | str] = None,
        keep_rows: bool = False,
    ) -> None:
        if dtype not in (torch.float64, torch.float32):
            raise ValueError(f"ActivationStatistics accumulates in float64 or float32, not {dtype}")
        if product_dtype not in (None, torch.float64, torch.float32):
            raise ValueError(f"product_dtype must be float64, float32 or None, not {product_dtype}")
        if normalized_gram and not full_gram:
            raise ValueError("normalized_gram needs full_gram=True")
        self.dim = int(dim)
        self.normalized_gram = normalized_gram
        self.full_gram = full_gram
        self.dtype = dtype
        self.product_dtype = product_dtype
        self.device = torch.device(device) if device is not None else None
        self.count = 0
        self._gram_sum: Optional[torch.Tensor] = None
        self._sum: Optional[torch.Tensor] = None
        self._square_sum: Optional[torch.Tensor] = None
        self._normalized_gram_sum: Optional[torch.Tensor] = None
        # rows not yet in the Gram sum: fewer than gram_chunk_rows(dim) (gram_chunks)
        self._chunk_rows = gram_chunk_rows(self.dim)
        self._pending: list[torch.Tensor] = []
        # some chunk added only its product's upper block triangle (add_upper_gram)
        self._upper_only = False
        self._pending_rows = 0
        # rows instead of the Gram: only with float64 sums, which gram_from_rows reproduces
        keep = keep_rows and full_gram and dtype == torch.float64
        self._rows: Optional[list[torch.Tensor]] = [] if keep else None

    def _allocate(self, device: torch.device) -> None:
        self.device = self.device or device
        zeros = dict(dtype=self.dtype, device=self.device)
        self._sum = torch.zeros(self.dim, **zeros)
        if self.full_gram and self._rows is None:
            self._gram_sum = torch.zeros(self.dim, self.dim, **zeros)
        else:  # moments only, or rows instead of the Gram until ``dim`` tokens
            self._square_sum = torch.zeros(self.dim, **zeros)
        if self.normalized_gram:
            self._normalized_gram_sum = torch.zeros(self.dim, self.dim, **zeros)

    def _product_dtype(self, x: torch.Tensor) -> torch.dtype:
        if self.product_dtype is not None:
            return self.product_dtype
        if self.dtype == torch.float32 or x.dtype != torch.float64:
            return torch.float32
        return torch.float64

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        """Add the rows of ``x`` (``[N, dim]``, one token each, padding already dropped).

        Runs with autocast off: a hook inside a low-precision pass (``compute_dtype``) must
        not have its sums rounded to bfloat16.
        """
        if x.dim() != 2 or x.shape[1] != self.dim:
            raise TensorError(f"expected inputs of shape [N, {self.dim}], got {tuple(x.shape)}")
        if x.shape[0] == 0:
            return
        with torch.autocast(device_type=x.device.type, enabled=False):
            self._update(x)

    def _update(self, x: torch.Tensor) -> None:
        if self._sum is None:
            self._allocate(x.device)
        half = _half_product_rows(x, self.device, self.product_dtype)
        rows = (
            half.float()
            if half is not None
            else x.detach().to(device=self.device, dtype=self._product_dtype(x))
        )
        self._sum.add_(rows.sum(0, dtype=self.dtype))
        if self._rows is not None and self.count + int(rows.shape[0]) >= self.dim:
            # ``dim`` tokens: the Gram may have full rank; form its sum from the kept rows
            self._gram_sum = torch.zeros(self.dim, self.dim, dtype=self.dtype, device=self.device)
            for kept in self._rows:
                self._add_to_gram(kept, owned=True)
            self._rows, self._square_sum = None, None
        if self._gram_sum is not None:
            product_rows = half if half is not None else rows
            self._add_to_gram(product_rows, owned=not _shares_storage(product_rows, x))
        else:
            assert self._square_sum is not None
            # squared in place in the one widened copy: a second N x dim float64 temporary
            # per batch costs its page faults anew (the same values as .square())
            self._square_sum.add_(rows.to(self.dtype, copy=True).square_().sum(0))
        if self._normalized_gram_sum is not None:
            unit = rows / rows.norm(dim=1, keepdim=True).clamp_min(torch.finfo(rows.dtype).tiny)
            add_widened(self._normalized_gram_sum, unit.T @ unit)
        self.count += int(x.shape[0])
        if self._rows is not None:
            # own copy: ``rows`` may be a view of the caller's activations
            self._rows.append(rows.clone() if _shares_storage(rows, x) else rows)

    def _add_to_gram(self, rows: torch.Tensor, *, owned: bool) -> None:
        """Pend ``rows`` for the Gram sum and add the chunk once it is long enough
        (:func:`gram_chunks`). ``owned``: ``rows`` is not the caller's tensor (one the caller
        reuses must be copied to be held)."""
        if not self._pending and rows.shape[0] >= self._chunk_rows:
            self._add_chunk(rows)  # a long batch alone: no copy held
            return
        self._pending.append(rows if owned else rows.clone())
        self._pending_rows += int(rows.shape[0])
        if self._pending_rows >= self._chunk_rows:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        pending = self._pending
        self._pending, self._pending_rows = [], 0
        self._add_chunk(pending[0] if len(pending) == 1 else torch.cat(pending))

    def _add_chunk(self, rows: torch.Tensor) -> None:
        assert self._gram_sum is not None
        self._upper_only |= add_gram_chunk(self._gram_sum, rows)

    def finalize(self) -> TaskStatistics:
        """Means over the accumulated tokens; raises when there were none or they were not finite."""
        if self.count == 0 or self._sum is None:
            raise CalibrationError(
                "no tokens reached this layer: the calibration batches were empty"
            )
        self._flush()
        gram = None
        if self._gram_sum is not None:
            gram, self._gram_sum = self._gram_sum.div_(self.count), None  # in place: one copy less
            gram = finish_gram(gram, self._upper_only)
            second_moment = torch.diagonal(gram).clone()
        else:
            assert self._square_sum is not None
            second_moment = self._square_sum / self.count
        normalized = None
        if self._normalized_gram_sum is not None:
            normalized = self._normalized_gram_sum.div_(self.count)
            self._normalized_gram_sum = None
            normalized = symmetrized(normalized)
        # is_finite: one sum proves a finite Gram (an element-wise test of a 3584 x 3584
        # float64 Gram per task and group costs ~0.2 s, the sum ~0.01 s)
        if not is_finite(second_moment) or (gram is not None and not is_finite(gram)):
            raise TensorError(
                "the Gram matrix of the layer inputs is not finite (inf/NaN activations); "
                "check the checkpoint or use a wider dtype"
            )
        kept, sizes = None, None
        if self._rows is not None:
            sizes = tuple(int(r.shape[0]) for r in self._rows)
            kept, self._rows = torch.cat(self._rows), None
        return TaskStatistics(
            gram=gram,
            mean=self._sum / self.count,
            count=self.count,
            gram_normalized=normalized,
            second_moment=second_moment,
            rows=kept,
            row_batches=sizes,
        )


def gram_product(rows: torch.Tensor) -> torch.Tensor:
    """``rowsᵀ rows`` of one chunk of rows with float32 (or wider) sums.

    Rows that hold bfloat16 values exactly (the inputs of a bfloat16 pass's linears) take
    the bfloat16 units with float32 sums and a float32 result
    (:func:`~mergekit_ext.bf16_products.float32_product`: on CUDA one bfloat16 GEMM, on the
    CPU a float32 GEMM in oneDNN's bf16 fpmath mode, exact for such operands): the sums of a
    float32 GEMM at bfloat16 speed. Other rows are widened to float32 (exact for float16)
    and multiplied in float32. Never a bfloat16 result: the plain ``rows.T @ rows`` of
    bfloat16 rows rounds every entry to 8 bits (measured: 1.6e-3 relative to the float64 Gram
    of the same bfloat16 rows, against 1.4e-7 for the float32 GEMM; docs/methods.md,
    "Compute dtype").

    Args:
        rows: ``[N, dim]`` (float32, bfloat16 or float16; float64 stays float64).

    Returns:
        ``[dim, dim]`` float32 (float64 for float64 rows).
    """
    if rows.dtype == torch.float64:
        return rows.T @ rows
    if rows.dtype == torch.float16 and rows.device.type == "cuda":
        return torch.mm(rows.T, rows, out_dtype=torch.float32)
    return float32_product(rows.T, rows)


# Gram sums at least this wide add only the upper block triangle of each chunk's product
# (:func:`add_upper_gram`), in column blocks this wide; at most HALF_GRAM_MAX_DIM wide, which
# bounds the one-time check of :func:`upper_gram_is_exact` (a full product of the shape:
# 4096 inputs x 2048 rows, ~1 s and 67 MB; 14336 inputs would take ~15 s and 0.8 GB).
HALF_GRAM_MIN_DIM = 1024
HALF_GRAM_MAX_DIM = 4096
HALF_GRAM_BLOCK = 512
# (rows, dim, threads) -> whether this machine's products give the full product's bits
_HALF_GRAM_EXACT: dict[tuple[int, int, int], bool] = {}


def _column_blocks(dim: int) -> list[tuple[int, int]]:
    return [(a, min(a + HALF_GRAM_BLOCK, dim)) for a in range(0, dim, HALF_GRAM_BLOCK)]


def upper_gram_is_exact(rows: int, dim: int) -> bool:
    """Whether, for float32 ``rows x dim`` inputs on the CPU, the products
    ``X[:, :b]ᵀ X[:, a:b]`` of :func:`add_upper_gram` hold the bits of ``Xᵀ X`` in those
    entries and ``Xᵀ X`` is exactly symmetric, so that the upper block triangle mirrored is
    the full product bit for bit.

    A GEMM's rounding depends on its shapes and the library's kernels, not on the values:
    checked once per shape and thread count on seeded random rows (held on this AVX2 CPU
    with MKL for every shape the probes use; a machine whose kernels differ keeps the full
    product).
    """
    key = (int(rows), int(dim), torch.get_num_threads())
    if key not in _HALF_GRAM_EXACT:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(int(rows), int(dim), generator=generator)
        full = x.T @ x
        exact = torch.equal(full, full.T) and all(
            torch.equal(x[:, :b].T @ x[:, a:b], full[:b, a:b]) for a, b in _column_blocks(dim)
        )
        _HALF_GRAM_EXACT[key] = exact
    return _HALF_GRAM_EXACT[key]


def takes_upper_gram(rows: torch.Tensor) -> bool:
    """Whether :func:`add_upper_gram` gives ``rows``' Gram product the bits of
    :func:`gram_product`'s: wide float32 rows on the CPU that are not all bfloat16 values
    (those take the bf16 units), on a machine where :func:`upper_gram_is_exact`."""
    return (
        rows.dtype == torch.float32
        and rows.device.type == "cpu"
        and rows.ndim == 2
        and rows.is_contiguous()  # the layout the check multiplied
        and HALF_GRAM_MIN_DIM <= int(rows.shape[1]) <= HALF_GRAM_MAX_DIM
        and not holds_bfloat16(rows)
        and upper_gram_is_exact(int(rows.shape[0]), int(rows.shape[1]))
    )


def add_gram_chunk(total: torch.Tensor, rows: torch.Tensor) -> bool:
    """Add one chunk's Gram product ``rowsᵀ rows`` to ``total``; True where only its upper
    block triangle was added (:func:`finish_gram` then mirrors the sum).

    The one rule for every Gram sum, the accumulator's and :meth:`TaskStatistics.gram_from_rows`'s:
    both take the same chunks through it, so the two give the same bits whatever
    :func:`upper_gram_is_exact` says on a machine, even where some chunk shapes pass its check
    and others do not. Rows are made contiguous first, so a view and its copy (what a
    distributed run receives) take the same path.
    """
    if total.dtype == torch.float64:
        rows = rows.contiguous()
        if takes_upper_gram(rows):
            add_upper_gram(total, rows)
            return True
    add_widened(total, gram_product(rows))
    return False


def finish_gram(total: torch.Tensor, upper_only: bool) -> torch.Tensor:
    """The symmetric Gram from a sum of :func:`add_gram_chunk`: where some chunk added only
    its upper blocks (the strictly lower blocks then miss that chunk), those mirrored and each
    diagonal block ``(D + Dᵀ) / 2`` (a chunk that took the full product may have left it not
    exactly symmetric); else ``(S + Sᵀ) / 2``. Where every chunk passed
    :func:`upper_gram_is_exact` the two are the same bits (each full product exactly
    symmetric, its upper blocks the block products')."""
    if not upper_only:
        return symmetrized(total)
    mirror_upper(total)
    for a, b in _column_blocks(int(total.shape[1])):
        total[a:b, a:b] = symmetrized(total[a:b, a:b])
    return total


def add_upper_gram(total: torch.Tensor, rows: torch.Tensor) -> None:
    """Add the upper block triangle of ``rowsᵀ rows`` to ``total`` (the strictly lower
    blocks are left as they are; :func:`mirror_upper` completes the sum, and replaces what a
    chunk that took the full product added there by its transposed upper part: the same
    bits where that product is exactly symmetric, as every one checked so far).

    The Gram is symmetric: the blocks left of each diagonal block repeat those above it.
    ``(n + 1) / 2n`` of the product's FLOPs for ``n`` column blocks: 0.6x at 3584 inputs
    (0.386 s against 0.26 s per 896-row chunk, one thread, measured), the merged path's
    largest Gram in the 0.34B benchmark (issue #47).
    """
    for a, b in _column_blocks(int(rows.shape[1])):
        add_widened(total[:b, a:b], rows[:, :b].T @ rows[:, a:b])


def mirror_upper(matrix: torch.Tensor) -> torch.Tensor:
    """``matrix`` with the blocks left of its diagonal blocks copied from those above them
    (in place): the whole sum of :func:`add_upper_gram`'s products, whose diagonal blocks
    were formed whole. Exactly symmetric, so :func:`symmetrized` would return it unchanged."""
    for a, b in _column_blocks(int(matrix.shape[1])):
        matrix[a:b, :a].copy_(matrix[:a, a:b].T)
    return matrix


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _half_product_rows(
    x: torch.Tensor, device: Optional[torch.device], product_dtype: Optional[torch.dtype]
) -> Optional[torch.Tensor]:
    """``x`` as it is multiplied for the Gram when it is bfloat16 / float16 on CUDA and the
    products are float32 (the default): the half-precision rows themselves
    (:func:`gram_product` multiplies them on the tensor cores with a float32 result), not a
    float32 copy of them. None otherwise."""
    if x.dtype not in (torch.bfloat16, torch.float16) or product_dtype not in (None, torch.float32):
        return None
    target = device if device is not None else x.device
    if target.type != "cuda":
        return None
    return x.detach().to(device=target)


def multiplied_input(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``module`` multiplies it: what its input statistics describe.

    Inside a low-precision ``torch.autocast`` region (a bfloat16 / float16 pass,
    ``compute_dtype``) a linear (``nn.Linear``, HF ``Conv1D``: ``linear`` and ``addmm`` are
    on autocast's lower-precision list on the CPU and on CUDA) rounds a float32 input, such
    as a norm's output, to the autocast dtype before it multiplies: this returns the rounded
    values. The executor records them where the checkpoints store their linears in that dtype
    (:attr:`~mergekit_ext.executor.compute.ComputeChoice.rounds_inputs`: the merged model
    multiplies such rounded inputs when it runs in its own dtype), so that every row holds a
    bfloat16 value, which the Grams and the solve's products multiply on the bfloat16 units
    (docs/methods.md, "Compute dtype"). Anything else, and any input outside such a region,
    is returned as it is.
    """
    if x.dtype != torch.float32 or _linear_in_features(module) is None:
        return x
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return x
    dtype = torch.get_autocast_dtype(device)
    return x.to(dtype) if dtype in (torch.bfloat16, torch.float16) else x


def _linear_in_features(module: nn.Module) -> Optional[int]:
    """Input width of an ``nn.Linear`` or HF ``Conv1D`` (weight ``in x out``); None for others."""
    if isinstance(module, nn.Linear):
        return module.in_features
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    if isinstance(module, Conv1D):
        return int(module.weight.shape[0])
    return None


class LinearInputCapture:
    """Collect the input statistics of named linear modules during forward passes.

    Example::

        with LinearInputCapture(model, ["model.layers.0.self_attn.q_proj"]) as capture:
            for batch in data.batches:
                capture.set_attention_mask(batch["attention_mask"])
                model(**batch)
        stats = capture.statistics()  # {name: TaskStatistics}

    Inputs ``[B, T, D]`` drop the positions where the current mask is 0; inputs ``[B*T, D]``
    likewise; inputs ``[B, D]`` (a pooler on the first token) keep every row; without a mask
    every row is a token (vision patches).
    """

    def __init__(
        self,
        model: nn.Module,
        module_names: Sequence[str],
        *,
        normalized_gram: bool = False,
        dtype: torch.dtype = torch.float64,
        product_dtype: Optional[torch.dtype] = None,
    ) -> None:
        self.model = model
        self.module_names = list(dict.fromkeys(module_names))
        self._mask: Optional[torch.Tensor] = None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._accumulators: dict[str, ActivationStatistics] = {}
        modules = dict(model.named_modules())
        for name in self.module_names:
            module = modules.get(name)
            if module is None:
                linears = [n for n, m in modules.items() if _linear_in_features(m) is not None]
                near = difflib.get_close_matches(name, linears, n=3, cutoff=0.5)
                raise ModelInputError(
                    f"the model has no module {name!r}"
                    + (f"; linear modules with similar names: {', '.join(near)}" if near else "")
                )
            in_features = _linear_in_features(module)
            if in_features is None:
                raise ModelInputError(
                    f"module {name!r} is a {type(module).__name__}; input statistics need nn.Linear or Conv1D"
                )
            self._accumulators[name] = ActivationStatistics(
                in_features,
                normalized_gram=normalized_gram,
                dtype=dtype,
                product_dtype=product_dtype,
            )

    def set_attention_mask(self, mask: Optional[torch.Tensor]) -> None:
        """The ``[B, T]`` attention mask of the batch about to run (None: no padding)."""
        self._mask = mask

    def _hook(self, name: str):
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            x = args[0] if args else kwargs.get("input", kwargs.get("x"))
            self._accumulators[name].update(self._rows(name, x))

        return hook

    def _rows(self, name: str, x: torch.Tensor) -> torch.Tensor:
        mask = self._mask
        if mask is None:
            return x.reshape(-1, x.shape[-1])
        if x.dim() == 3 and tuple(x.shape[:2]) == tuple(mask.shape):
            return flatten_tokens(x, mask)
        if x.dim() == 2 and x.shape[0] == mask.numel():
            return x[mask.reshape(-1).to(x.device).bool()]
        if x.dim() == 2 and x.shape[0] == mask.shape[0]:
            return x
        raise TensorError(
            f"input of module {name!r} has shape {tuple(x.shape)}, which does not fit the attention "
            f"mask {tuple(mask.shape)}; set_attention_mask(None) if this batch has no padding"
        )

    def __enter__(self) -> LinearInputCapture:
        modules = dict(self.model.named_modules())
        for name in self.module_names:
            handle = modules[name].register_forward_pre_hook(self._hook(name), with_kwargs=True)
            self._handles.append(handle)
        return self

    def __exit__(
        self,
        exc_type: Optional[type[BaseException]],
        exc: Optional[BaseException],
        traceback: Optional[TracebackType],
    ) -> None:
        self.close()

    def close(self) -> None:
        """Remove the hooks (the accumulated statistics stay)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def statistics(self) -> dict[str, TaskStatistics]:
        """``{module name: TaskStatistics}`` of everything seen so far."""
        for name, acc in self._accumulators.items():
            if acc.count == 0:
                raise CalibrationError(
                    f"module {name!r} saw no tokens: run the calibration batches through the "
                    "model inside the capture"
                )
        return {name: acc.finalize() for name, acc in self._accumulators.items()}
