"""Per-task measures of a least-squares merge: relative output error and the covariate-shift
Wasserstein-2 distance (``docs/methods.md``)."""

from __future__ import annotations

import logging
import math
from typing import Literal, Optional

import torch

from mergekit_ext.methods.layerwise import TaskStatistics
from mergekit_ext.methods.least_squares.solve import _cholesky, trace_product
from mergekit_ext.wide_sums import dot64, row_chunks

LOG = logging.getLogger(__name__)

# Above this input width the covariate-shift W2 uses diagonal covariances (an in x in
# eigendecomposition per task and group would dominate the merge's cost).
FULL_COVARIANCE_W2_MAX_DIM = 1024


def relative_output_error(
    merged_weight: torch.Tensor,
    expert_weight: torch.Tensor,
    gram: torch.Tensor,
    expert_reference: Optional[float] = None,
) -> float:
    """``‖W X − W_k X‖_F / ‖W_k X‖_F`` from the Gram ``G = X Xᵀ / N`` alone (CoM's diagnostic).

    ``= sqrt(tr((W − W_k) G (W − W_k)ᵀ) / tr(W_k G W_kᵀ))``; 0 when both are zero, inf when
    only the expert's output is zero, NaN when a weight holds NaN. The error term is float64
    throughout (difference, product, trace) and never clamped: a float32 product cancels to
    noise when W is close to W_k. The reference (a sum of squares, no cancellation) is
    ``expert_reference`` = ``tr(W_k G W_kᵀ)`` when the caller has it (the dense solve forms
    ``W_k G`` anyway: :func:`~.solve.trace_product`), else formed here in float64. A negative
    value can only be float64 rounding of a zero error (an indefinite Gram by rounding) and
    is returned as ``-sqrt(|e| / ref)``, not hidden. Both traces are summed over chunks of
    output rows.
    """
    g = gram.double()
    error = reference = 0.0
    for rows in row_chunks(int(expert_weight.shape[0]), int(expert_weight.shape[1])):
        expert = expert_weight[rows].double()
        diff = merged_weight[rows].double() - expert
        error += _quadratic_form(diff, g)
        if expert_reference is None:
            reference += trace_product(expert @ g, expert)
    if expert_reference is not None:
        reference = float(expert_reference)
    return _ratio(error, reference)


# Columns per block of :func:`_quadratic_form` (float64 GEMMs of this width still run at
# the GEMM rate on one core; narrower blocks would cut the FLOPs further, by little).
_FORM_BLOCK = 256


def _quadratic_form(diff: torch.Tensor, gram: torch.Tensor) -> float:
    """``tr(D G Dᵀ)`` (float64) from the symmetric ``G``'s upper block triangle only.

    With column blocks ``c``: ``Σ_c ⟨D_c G_cc + 2 D_{<c} G_{<c,c}, D_c⟩``, one product per
    block: ``(n + 1) / 2n`` of ``D G``'s FLOPs for ``n`` blocks (0.54x for 3584 inputs,
    0.63x for 1024), the output error's largest cost where the solve is dense (the 0.34B
    benchmark's profile, issue #47). The same float64 sums in another order: the value
    moves by float64 rounding only. ``G`` is read as symmetric (the statistics symmetrise it).
    """
    n = int(gram.shape[0])
    total = 0.0
    for start in range(0, n, _FORM_BLOCK):
        stop = min(start + _FORM_BLOCK, n)
        part = diff[:, start:stop]
        product = part @ gram[start:stop, start:stop]
        if start > 0:
            # the blocks left of the diagonal, once for each side of it (x2 is exact)
            product.addmm_(diff[:, :start], gram[:start, start:stop], alpha=2.0)
        total += dot64(product, part)
    return total


def _ratio(error: float, reference: float) -> float:
    """``sqrt(error / reference)`` keeping the sign, inf and NaN of what was measured."""
    if math.isnan(error) or math.isnan(reference):
        return math.nan
    if reference <= 0.0:
        return 0.0 if error == 0.0 else math.inf
    return math.copysign(math.sqrt(abs(error) / reference), error)


def relative_output_error_rows(
    merged_weight: torch.Tensor,
    expert_weight: torch.Tensor,
    rows: torch.Tensor,
    expert_reference: Optional[float] = None,
    compute_dtype: torch.dtype = torch.float32,
) -> float:
    """:func:`relative_output_error` from the inputs themselves (``rows``: ``N x in``).

    ``‖(W − W_k) Xᵀ‖_F / ‖W_k Xᵀ‖_F``: ``out x in x N`` products instead of ``out x in x in``
    ones, the cheaper form when N < in. The error term's difference is formed in float64,
    its product is a GEMM in the weights' dtype (float32 for float32 weights and rows,
    float64 where any is float64); the reference in the weights' dtype, summed in float64,
    or, when the dense solve formed ``W_k G`` (``G = XᵀX / N``), from
    ``expert_reference`` = ``tr(W_k G W_kᵀ)`` (``N · expert_reference``, no product at all).
    Summed over chunks of output rows.

    ``compute_dtype`` bfloat16 (the rows come from a bfloat16 pass): the products are
    bfloat16 GEMMs of the exact difference ``W − W_k`` and (without ``expert_reference``) of
    ``W_k``, rounded to bfloat16 as the pass rounded the layer's input, their squares summed
    in float64. Each product
    entry then carries a relative rounding of ~2⁻⁹ with no preferred sign, so the sums of
    ``out · N`` squares move by far less: the ratio agrees with the float64 one to ~1e-4
    relative (docs/methods.md, "Compute dtype"), at a sixth of the cost.
    """
    low = compute_dtype == torch.bfloat16 and expert_weight.dtype != torch.float64
    wide = torch.float64 in (expert_weight.dtype, merged_weight.dtype, rows.dtype)
    if low:
        x = rows.to(torch.bfloat16).T
        xr = x
    elif wide:
        x = rows.double().T
        xr = rows.float().T if expert_weight.dtype != torch.float64 else x
    else:
        x = xr = rows.float().T
    error = reference = 0.0
    for part in row_chunks(int(expert_weight.shape[0]), int(expert_weight.shape[1])):
        expert, merged = expert_weight[part], merged_weight[part]
        if low:
            exact_diff = merged.float() - expert.float()  # exact: both hold bf16 values
            error += _square_sum(exact_diff.to(torch.bfloat16) @ x)
        elif wide:
            error += _square_sum((merged.double() - expert.double()) @ x)
        else:
            # float32 weights and rows: the difference formed in float64 and rounded once to
            # float32 (6e-8 relative per entry), then a float32 GEMM: the ratio moves by
            # ~1e-6 relative at most (sums of in ≤ 14,336 float32 products, squared and summed
            # in float64), far below the three digits the record keeps, at the float32 rate
            # (twice float64's on AVX2 and AVX-512; issue #47's roofline)
            difference = (merged.double() - expert.double()).float()
            error += _square_sum(difference @ x)
        if expert_reference is not None:
            continue
        if low:
            reference += _square_sum(expert.to(torch.bfloat16) @ x)
        else:
            reference += _square_sum(expert.to(xr.dtype) @ xr)
    if expert_reference is not None:
        reference = float(expert_reference) * int(rows.shape[0])
    return _ratio(error, reference)


def _square_sum(product: torch.Tensor) -> float:
    """``Σ product²`` summed in float64."""
    return dot64(product, product)


def _symmetric_sqrt(matrix: torch.Tensor) -> torch.Tensor:
    """Principal square root of a symmetric PSD matrix via eigh (negative rounding → 0)."""
    eigenvalues, eigenvectors = torch.linalg.eigh(0.5 * (matrix + matrix.T))
    return (eigenvectors * eigenvalues.clamp(min=0.0).sqrt()) @ eigenvectors.T


def gaussian_w2(
    mean_a: torch.Tensor,
    cov_a: torch.Tensor,
    mean_b: torch.Tensor,
    cov_b: torch.Tensor,
    *,
    diagonal: bool = False,
) -> float:
    """Wasserstein-2 distance between ``N(μ_a, Σ_a)`` and ``N(μ_b, Σ_b)``.

    Full: ``W2² = ‖μ_a − μ_b‖² + tr(Σ_a + Σ_b − 2 (Σ_b^½ Σ_a Σ_b^½)^½)`` (the symmetric
    square roots via eigh). ``diagonal=True`` keeps only the variances:
    ``W2² = ‖μ_a − μ_b‖² + Σ_i (σ_a,i − σ_b,i)²``. This is the merging covariate shift of
    CoM when a = the inputs the merged model sees, b = those the unmerged expert sees.
    """
    ca, cb = cov_a.double(), cov_b.double()
    if diagonal:
        return _diagonal_w2(mean_a, torch.diagonal(ca), mean_b, torch.diagonal(cb))
    mean_term = float((mean_a.double() - mean_b.double()).pow(2).sum())
    cov_term = float(
        torch.trace(ca) + torch.trace(cb) - 2.0 * _trace_sqrt_product(ca, 0.5 * (cb + cb.T))
    )
    return math.sqrt(max(mean_term + cov_term, 0.0))


def _diagonal_w2(
    mean_a: torch.Tensor, var_a: torch.Tensor, mean_b: torch.Tensor, var_b: torch.Tensor
) -> float:
    """W2 between diagonal Gaussians: ``sqrt(‖μ_a − μ_b‖² + Σ_i (σ_a,i − σ_b,i)²)``."""
    mean_term = float((mean_a.double() - mean_b.double()).pow(2).sum())
    sd_a = var_a.double().clamp(min=0.0).sqrt()
    sd_b = var_b.double().clamp(min=0.0).sqrt()
    return math.sqrt(max(mean_term + float((sd_a - sd_b).pow(2).sum()), 0.0))


def _trace_sqrt_product(cov_a: torch.Tensor, cov_b: torch.Tensor) -> float:
    """``tr((Σ_b^½ Σ_a Σ_b^½)^½)`` = the sum of the square roots of the eigenvalues of ``Σ_a Σ_b``.

    With ``Σ_b = L Lᵀ`` (Cholesky) those are the eigenvalues of the symmetric ``Lᵀ Σ_a L``:
    one factorisation and one ``eigvalsh`` instead of a matrix square root. A singular
    ``Σ_b`` falls back to the square root by ``eigh``.
    """
    factor = _cholesky(cov_b)
    if factor is not None:
        cross = factor.T @ cov_a @ factor
    else:
        root_b = _symmetric_sqrt(cov_b)
        cross = root_b @ cov_a @ root_b
    eigenvalues = torch.linalg.eigvalsh(0.5 * (cross + cross.T)).clamp(min=0.0)
    return float(eigenvalues.sqrt().sum())


def shift_covariance(
    merged_path: TaskStatistics, expert_path: TaskStatistics, full_covariance_max_dim: int
) -> Literal["full", "diagonal"]:
    """Which covariances :func:`covariate_shift_w2` compares for these two paths."""
    full = (
        merged_path.mean.numel() <= full_covariance_max_dim
        and (merged_path.gram is not None or merged_path.rows is not None)
        and (expert_path.gram is not None or expert_path.rows is not None)
    )
    return "full" if full else "diagonal"


def covariate_shift_w2(
    merged_path: TaskStatistics,
    expert_path: TaskStatistics,
    *,
    full_covariance_max_dim: int = FULL_COVARIANCE_W2_MAX_DIM,
) -> tuple[float, Literal["full", "diagonal"]]:
    """The merging covariate shift of one task at one group (CoM): W2 between Gaussian fits.

    Full covariances when the input width is at most ``full_covariance_max_dim`` and both
    paths kept their Gram, diagonal ones otherwise. Returns ``(W2, "full" | "diagonal")``.
    """
    if shift_covariance(merged_path, expert_path, full_covariance_max_dim) == "full":
        distance = gaussian_w2(
            merged_path.mean,
            merged_path.covariance.double(),
            expert_path.mean,
            expert_path.covariance.double(),
        )
        return distance, "full"
    distance = _diagonal_w2(
        merged_path.mean, merged_path.variance, expert_path.mean, expert_path.variance
    )
    return distance, "diagonal"
