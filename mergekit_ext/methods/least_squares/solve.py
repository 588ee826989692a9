"""The least-squares solve RegMean and CoM share: off-diagonal shrink, ridge, condition number,
pseudo-inverse / span solve, and the sums the solve is formed from (so several processes can
form the same sums over disjoint task sets). Equations: ``docs/methods.md``."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import torch

from mergekit_ext.bf16_products import float32_product, holds_bfloat16
from mergekit_ext.calibration.statistics import symmetrized
from mergekit_ext.errors import TensorError
from mergekit_ext.finite import is_finite
from mergekit_ext.methods.least_squares.in_range import (
    NormRange,
    RangeFit,
    dense_ridge_in_range,
    reason,
    span_ridge_in_range,
)
from mergekit_ext.wide_sums import dot64

LOG = logging.getLogger(__name__)


Solver = Literal["pinv", "solve"]
Fallback = Literal["mean", "base", "task_arithmetic"]

# Up to this size the condition number of Σ ω G̃ comes from all its eigenvalues; above it,
# from block power / inverse iterations on its Cholesky factor (an estimate from below).
EXACT_CONDITION_MAX_DIM = 1024
# The pseudo-inverse is computed as a Cholesky solve when cond(Σ ω G̃) · n · eps is below
# this: then no eigenvalue is near pinv's cut-off n · eps · max|λ| and pinv = inverse.
_CHOLESKY_PINV_MARGIN = 1e-3
_CONDITION_ITERATIONS = 10
_CONDITION_BLOCK = 8
# ``ridge: auto`` regularises a group whose system Σ ω G̃ is rank-deficient or ill-conditioned:
# this relative ridge, toward the experts' mean (docs/methods.md, "ridge: auto"). In the
# directions the calibration inputs do not span (or span below the ridge) the merged weight is
# then the experts' mean whatever its size; in the well-spanned ones it moves the solution by
# about AUTO_RIDGE relative.
AUTO_RIDGE = 1e-2
# ``ridge: auto`` leaves a group unregularised (the exact least-squares solution) when the
# condition number of Σ ω G̃ is at most this. The Grams and the products W_k G_k are summed
# from float32 products, whose rounding (~1e-7 of the largest entries) swamps any direction
# whose eigenvalue is below about 1e-6 of the largest: there the solve amplifies rounding and
# the directions the calibration data barely spans (docs/methods.md gives the measurements).
AUTO_RIDGE_MAX_CONDITION = 1e6
# ``W_k G_k`` is formed from the rows behind ``G_k`` (:func:`task_product`) when they number
# at most this fraction of the inputs: ``(W_k X_kᵀ) X_k / N`` is 2·out·in·N multiply-adds
# against out·in² for ``W_k G_k``, half of them on the bfloat16 units. At this fraction it is
# no slower even where the CPU has no fast bfloat16 (both forms then cost the same).
_ROW_PRODUCT_MAX_FRACTION = 0.5

Ridge = Union[float, Literal["auto"]]


# --------------------------------------------------------------------------------------
# Pure tensor functions
# --------------------------------------------------------------------------------------


def shrink_off_diagonal(gram: torch.Tensor, reduce_non_diagonal: float) -> torch.Tensor:
    """RegMean's off-diagonal shrink ``G̃ = α G + (1 − α) diag(G)`` (Jin et al., §3.2).

    ``reduce_non_diagonal`` (α) = 1 keeps the Gram; 0 keeps only its diagonal, which turns the
    merge into a per-input-column average of the experts weighted by ``G[j, j]``.
    """
    if not 0.0 <= reduce_non_diagonal <= 1.0:
        raise ValueError(f"reduce_non_diagonal must be in [0, 1]; got {reduce_non_diagonal}")
    return reduce_non_diagonal * gram + (1.0 - reduce_non_diagonal) * torch.diag_embed(
        torch.diagonal(gram)
    )


@dataclass
class RegMeanSolution:
    """The merged weight and how it was solved."""

    merged_weight: torch.Tensor
    condition_number: float  # of the matrix inverted: Σ ω G̃ (+ ridge term)
    solver: str  # "pinv", "solve", or "pinv (solve failed: singular)"
    condition_number_method: str = "exact"  # "exact" (all eigenvalues) | "estimate"
    # tr(W_k G_k W_kᵀ) per task from the solve's own products W_k G_k, when asked for
    references: Optional[list[float]] = None
    ridge: float = 0.0  # the relative ridge applied (``auto`` resolved)
    tokens: Optional[int] = None  # calibration tokens behind Σ ω G̃ (None: not given)
    # why this ridge (``auto``: from the tokens or the condition number; else "as set")
    ridge_reason: str = "as set"
    # the condition number of Σ ω G̃ before ``auto`` added its ridge (None: no ridge added
    # by ``auto``, or the span solve, whose unregularised system is rank-deficient by count)
    condition_number_unregularized: Optional[float] = None
    # ``auto``'s range rule raised the ridge: the largest written norm ratio of the solution
    # at the ridge first solved (None: that solution was in range, or no rule applied)
    norm_ratio_before_ridge: Optional[float] = None


def _pinv_tolerance(eigenvalues: torch.Tensor, n: int) -> float:
    """Eigenvalues at or below ``n · eps · max|λ|`` count as zero (``torch.linalg.pinv``'s rule)."""
    return n * torch.finfo(eigenvalues.dtype).eps * float(eigenvalues.abs().max())


def _symmetric_pinv(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Moore–Penrose pseudo-inverse of a symmetric matrix via ``eigh``, and its eigenvalues."""
    eigenvalues, eigenvectors = torch.linalg.eigh(matrix)
    keep = eigenvalues.abs() > _pinv_tolerance(eigenvalues, matrix.shape[0])
    inverse = torch.where(keep, 1.0 / eigenvalues, torch.zeros_like(eigenvalues))
    return (eigenvectors * inverse) @ eigenvectors.T, eigenvalues


def _condition_number(eigenvalues: torch.Tensor) -> float:
    """2-norm condition number ``max|λ| / min|λ|`` of a symmetric matrix.

    inf when the matrix is numerically singular (its smallest eigenvalue is one the
    pseudo-inverse treats as zero).
    """
    magnitude = eigenvalues.abs()
    smallest = float(magnitude.min())
    if smallest <= _pinv_tolerance(eigenvalues, eigenvalues.numel()):
        return math.inf
    return float(magnitude.max()) / smallest


def _cholesky(matrix: torch.Tensor) -> Optional[torch.Tensor]:
    """The lower Cholesky factor of a symmetric matrix, or None when it is not positive definite."""
    factor, info = torch.linalg.cholesky_ex(matrix)
    if int(info) != 0 or not is_finite(factor):
        return None
    return factor


def estimate_condition_number(
    matrix: torch.Tensor,
    cholesky: torch.Tensor,
    *,
    iterations: int = _CONDITION_ITERATIONS,
    block: int = _CONDITION_BLOCK,
) -> float:
    """``λ_max / λ_min`` of a symmetric positive definite matrix, estimated cheaply.

    Block subspace iteration (``block`` seeded random vectors, ``iterations`` steps) on the
    matrix for ``λ_max`` and on its inverse (two triangular solves with ``cholesky``) for
    ``λ_min``, each finished by a Rayleigh–Ritz step. Ritz values lie inside the spectrum,
    so the estimate is never above the true condition number. O(iterations · block · n²)
    instead of the O(n³) of an eigendecomposition; deterministic.
    """
    return estimate_condition_number_of(
        lambda q: matrix @ q,
        lambda q: torch.cholesky_solve(q, cholesky),
        matrix.shape[0],
        dtype=matrix.dtype,
        device=matrix.device,
        iterations=iterations,
        block=block,
    )


def estimate_condition_number_of(
    apply: Callable[[torch.Tensor], torch.Tensor],
    apply_inverse: Callable[[torch.Tensor], torch.Tensor],
    n: int,
    *,
    dtype: torch.dtype = torch.float64,
    device: Optional[torch.device] = None,
    iterations: int = _CONDITION_ITERATIONS,
    block: int = _CONDITION_BLOCK,
) -> float:
    """:func:`estimate_condition_number` for a matrix given as ``apply`` / ``apply_inverse``.

    Both map an ``n x b`` block to ``A @ block`` / ``A⁻¹ @ block``; the Rayleigh–Ritz steps
    use ``apply`` too, so the matrix itself is never formed (the span solve's ``A`` is
    ``Rᵀ D R + E``, applied in O(n · T) per vector).
    """
    largest = float(_ritz_values(apply, apply, n, dtype, device, iterations, block).max())
    smallest = float(_ritz_values(apply, apply_inverse, n, dtype, device, iterations, block).min())
    if smallest <= 0.0:
        return math.inf
    return largest / smallest


def _ritz_values(
    apply: Callable[[torch.Tensor], torch.Tensor],
    power: Callable[[torch.Tensor], torch.Tensor],
    n: int,
    dtype: torch.dtype = torch.float64,
    device: Optional[torch.device] = None,
    iterations: int = _CONDITION_ITERATIONS,
    block: int = _CONDITION_BLOCK,
) -> torch.Tensor:
    """Ritz values of ``apply`` on the subspace that ``iterations`` steps of ``power`` reach
    from a seeded random block: the extreme eigenvalues of ``power``'s dominant end."""
    width = min(block, n)
    generator = torch.Generator().manual_seed(0)
    # drawn on the CPU whatever the device: the same start, so the same estimate, everywhere
    start = torch.randn(n, width, generator=generator, dtype=torch.float64, device="cpu")
    basis = torch.linalg.qr(start.to(device=device, dtype=dtype)).Q
    for _ in range(iterations):
        basis = torch.linalg.qr(power(basis)).Q
    projected = basis.T @ apply(basis)
    return torch.linalg.eigvalsh(0.5 * (projected + projected.T))


def _condition(system: torch.Tensor, cholesky: Optional[torch.Tensor]) -> tuple[float, str]:
    """``(condition number, "exact" | "estimate")`` of ``system``."""
    if cholesky is None or system.shape[0] <= EXACT_CONDITION_MAX_DIM:
        return _condition_number(torch.linalg.eigvalsh(system)), "exact"
    return estimate_condition_number(system, cholesky), "estimate"


def span_solve_applies(
    reduce_non_diagonal: float, relative_ridge: float, tokens: int, n_in: int
) -> bool:
    """Whether a group whose tasks all kept their input rows is solved in the rows' span
    (:func:`span_solve`): a ridge, an off-diagonal part, and fewer tokens than inputs."""
    return relative_ridge > 0.0 and reduce_non_diagonal > 0.0 and tokens < n_in


def span_solve_pays(out: int, n_in: int, counts: Sequence[int]) -> bool:
    """Whether :func:`span_solve` is worth its work against the dense solve's numerator and
    solve, with a ridge applied and every weighted task's rows at hand (``counts``: their
    tokens): at most twice the dense work.

    Twice, because the span form is the more accurate one where a ridge was needed: its
    products are of the experts' differences from ``W₀``, so their float32 rounding is not
    amplified by the condition number that called for the ridge, where the dense solve's
    ``Σ ω W_k G_k`` is (8B groups at 2 x 2,048 tokens, bf16 rows: 0.01–0.08 % of the written
    bf16 entries differ from the float64 solution's, against 1.26 % densely; measured,
    docs/methods.md). The dense solve has formed the Grams and factored ``Σ ω G̃`` by then
    (its ridge decided from them), so only what follows is compared: the products
    ``W_k G_k`` and the numerator's triangular solves (``2·out·in²``, float64) against the
    span solve's ``H``, its factor, its triangular solves and its ``out x in x T`` products
    (:func:`_regroups`). Counted in multiply-adds, a float64 one as two float32 ones (their
    rates on AVX-512 and on most GPUs' CUDA cores): an 8B ``gate_up`` at 2 x 2,048 tokens
    does 3.1x less work in the span, ``qkv`` 1.1x less, ``o_proj`` 1.3x more.
    """
    product_rows = sum(min(2 * n, n_in) for n in counts)
    return span_work_pays(out, n_in, sum(counts), len(counts), product_rows)


def span_work_pays(out: int, n_in: int, tokens: int, tasks: int, product_rows: int) -> bool:
    """:func:`span_solve_pays` from sums over the weighted tasks (what a reduction carries):
    their ``tokens``, their number and ``product_rows`` = ``Σ_k min(2·N_k, in)``."""
    t = tokens
    system = t * t * n_in + 2 * t**3 // 3  # H (half a GEMM) and its factor, float64
    if out <= n_in:  # V H⁻¹ solved (T x out); V and its expansion
        span = system + 4 * t * t * out + 2 * out * n_in * t
    elif _regroups(out, n_in, t, tasks):  # H⁻¹ R E⁻¹ solved; the M_k; one out x in x in
        span = system + 4 * t * t * n_in + n_in * n_in * t + out * n_in * n_in
    else:  # H⁻¹ R E⁻¹ solved; V and its expansion
        span = system + 4 * t * t * n_in + 2 * out * n_in * t
    products = out * n_in * product_rows  # task_product: from the rows or with the Gram
    return span <= 2 * (products + 4 * out * n_in * n_in)


def span_solve_may_apply(
    reduce_non_diagonal: float, ridge: Ridge, out: int, n_in: int, counts: Sequence[int]
) -> bool:
    """Before any sum: whether a group whose weighted tasks all kept their rows (``counts``:
    their tokens) may be solved in the rows' span, by :func:`regmean_solve` either at once
    (:func:`span_solve_applies`) or once the dense system has its ridge (a ridge that
    ``auto`` may add there, and :func:`span_solve_pays`). Where it may, the tasks' rows
    must meet on one process."""
    tokens = sum(counts)
    relative = resolve_ridge(ridge, n_in, tokens)
    if span_solve_applies(reduce_non_diagonal, relative, tokens, n_in):
        return True
    may_ridge = relative > 0.0 or ridge == "auto"
    return may_ridge and reduce_non_diagonal > 0.0 and span_solve_pays(out, n_in, counts)


def resolve_ridge(ridge: Ridge, n_in: int, tokens: Optional[int]) -> float:
    """The relative ridge known before the solve: ``auto`` is :data:`AUTO_RIDGE` when fewer
    than ``n_in`` calibration tokens stand behind the Gram (it is then rank-deficient by
    count), else 0 here; :func:`solve_regmean_sums` then adds :data:`AUTO_RIDGE` when the
    system it solves is ill-conditioned (:func:`auto_ridge_needed`). A number is used as given."""
    if isinstance(ridge, str):
        if ridge != "auto":
            raise ValueError(f"ridge must be a number >= 0 or 'auto'; got {ridge!r}")
        return AUTO_RIDGE if tokens is not None and tokens < n_in else 0.0
    value = float(ridge)
    if value < 0.0 or not math.isfinite(value):
        raise ValueError(f"ridge must be a finite number >= 0 or 'auto'; got {ridge}")
    return value


def auto_ridge_needed(condition: float) -> bool:
    """Whether ``ridge: auto`` regularises a system of this condition number (inf or NaN:
    singular; above :data:`AUTO_RIDGE_MAX_CONDITION`: ill-conditioned)."""
    return not condition <= AUTO_RIDGE_MAX_CONDITION


def _ridge_reason(ridge: Ridge, applied: float, n_in: int, tokens: Optional[int]) -> str:
    """Why the ridge known before the solve is what it is (for the diagnostics)."""
    if not isinstance(ridge, str):
        return "as set"
    if applied > 0.0:
        return (
            f"auto: {tokens} calibration tokens for {n_in} inputs (Σ ω G̃ has rank at most "
            f"{tokens} < {n_in})"
        )
    return "auto"


def regmean_solve(
    expert_weights: Sequence[torch.Tensor],
    grams: Sequence[Optional[torch.Tensor]],
    reduce_non_diagonal: float,
    *,
    task_weights: Optional[Sequence[float]] = None,
    ridge: Ridge = 0.0,
    solver: Solver = "pinv",
    name: str = "<weight>",
    keep_references: bool = False,
    tokens: Optional[int] = None,
    rows: Optional[Sequence[torch.Tensor]] = None,
    compute_dtype: torch.dtype = torch.float32,
    gram_rows: Optional[Sequence[Optional[torch.Tensor]]] = None,
    norm_range: Optional[NormRange] = None,
    written_dtype: Optional[torch.dtype] = None,
) -> RegMeanSolution:
    """``W = (Σ_k ω_k W_k G̃_k)(Σ_k ω_k G̃_k)⁻¹`` with diagnostics (RegMean eq. 3; CoM eq. for ω).

    - ``expert_weights``: one ``out x in`` weight per task; ``grams``: one ``in x in`` input
      Gram per task (means over tokens); ``task_weights``: ω_k (default 1 each).
    - ``ridge`` > 0 is Tikhonov regularisation toward the ω-weighted mean of the experts:
      with ``λ = ridge · mean(diag(A)) / Σ_k ω_k``, ``A = Σ_k ω_k G̃_k``, it solves
      ``min_W Σ_k ω_k (‖W X_k − W_k X_k‖²/N_k + λ ‖W − W_k‖²_F)``, i.e. the inverted matrix is
      ``A + ridge · mean(diag(A)) · I`` and the numerator gains ``λ Σ_k ω_k W_k``
      (so a huge ridge gives the weighted mean of the experts, not zero). ``"auto"``:
      :data:`AUTO_RIDGE` when ``tokens < in`` (:func:`resolve_ridge`) or when ``Σ ω G̃`` is
      singular or its condition number exceeds :data:`AUTO_RIDGE_MAX_CONDITION`, else 0
      (the exact solution); then, given a ``norm_range``, where that solution leaves the
      experts' range, the smallest larger ridge that brings every linear of the group back
      (:mod:`.in_range`); the solution says which and why (``ridge_reason``).
    - ``solver``: ``pinv`` (Moore–Penrose pseudo-inverse, the CoM paper's choice) or
      ``solve`` (falls back to pinv with a warning when the matrix is singular). ``pinv`` is
      computed as a Cholesky solve when ``Σ ω G̃`` is positive definite and its condition
      number is far from pinv's cut-off (then the two are the same matrix), by ``eigh``
      otherwise. With a ridge the matrix is positive definite and both are its inverse.
    - ``tokens``: the calibration tokens behind the Grams (``Σ_k N_k``), for ``auto``.
    - ``rows``: optionally each task's inputs ``X_kᵀ`` (``N_k x in``, ``G_k = X_kᵀ X_k / N_k``,
      the rows of the Gram the solve uses; a Gram may then be None and is formed from its
      rows where the dense path needs it). With a ridge and ``Σ N_k < in`` the solve is then
      written in the span of the tokens (:func:`span_solve`: a ``T x T`` system, T = Σ N_k)
      instead of the ``in x in`` one; same solution, O(T · in · (T + out)) instead of O(in³).
    - ``keep_references``: also return each task's ``tr(W_k G_k W_kᵀ)`` from the product
      ``W_k G_k`` the dense solve forms anyway (the output error's reference,
      :func:`trace_product`), a number instead of an ``out x in`` product kept through the
      solve; None on the span path, which never forms the products.
    - ``gram_rows``: optionally, per task, the rows behind its Gram where it kept them
      (``G_k = X_kᵀ X_k / N_k``; None for a task that kept only its Gram): the dense
      solve's ``W_k G_k`` is formed from them where cheaper (:func:`task_product`).
    - ``compute_dtype``: the dtype of the forward passes the statistics came from
      (:func:`span_product_dtype`: a bfloat16 / float16 pass lets the span solve's
      ``out x in x T`` products run in float32).
    - ``written_dtype``: the dtype the merged weights are written in, where all share one
      (:func:`span_product_dtype`: bfloat16 / float16 lets those products run in float32
      after a float32 pass too).

    The Grams, ``Σ ω G̃`` and the solve are float64; the products ``W_k G_k`` are float32
    for float32 weights (float64 for float64 weights; :func:`task_product`). The result has
    the dtype of ``expert_weights[0]``.
    """
    n_tasks = len(expert_weights)
    if n_tasks == 0:
        raise TensorError(f"RegMean needs at least one expert weight for {name}; got none")
    if len(grams) != n_tasks:
        raise TensorError(f"{name}: {n_tasks} expert weights but {len(grams)} input Grams")
    weights = [1.0] * n_tasks if task_weights is None else [float(w) for w in task_weights]
    if len(weights) != n_tasks:
        raise TensorError(f"{name}: {n_tasks} expert weights but {len(weights)} task weights")
    if any(not math.isfinite(w) or w < 0.0 for w in weights) or sum(weights) <= 0.0:
        raise TensorError(
            f"{name}: task weights must be finite, non-negative and not all zero; got {weights}"
        )
    if solver not in ("pinv", "solve"):
        raise ValueError(f"solver must be pinv or solve; got {solver!r}")

    out_dtype = expert_weights[0].dtype
    # float32 GEMMs for float32 (or narrower) weights: their own rounding is of that order
    product_dtype = torch.float64 if out_dtype == torch.float64 else torch.float32
    shape = tuple(expert_weights[0].shape)
    if len(shape) != 2:
        raise TensorError(f"RegMean merges 2-D linear weights; {name} has shape {shape}")
    n_in = shape[1]
    relative_ridge = resolve_ridge(ridge, n_in, tokens)
    for k, (w, g) in enumerate(zip(expert_weights, grams)):
        if tuple(w.shape) != shape:
            raise TensorError(
                f"shape mismatch for {name}: task {k} has {tuple(w.shape)}, task 0 has {shape}"
            )
        if g is None:
            if rows is None:
                raise TensorError(f"{name}: task {k} has neither an input Gram nor input rows")
            continue
        if tuple(g.shape) != (n_in, n_in):
            raise TensorError(
                f"{name}: the input Gram of task {k} is {tuple(g.shape)}, expected "
                f"({n_in}, {n_in}) for an out x in weight of shape {shape}"
            )
    if gram_rows is not None and len(gram_rows) != n_tasks:
        raise TensorError(f"{name}: {n_tasks} expert weights but {len(gram_rows)} row sets")
    if rows is not None:
        if len(rows) != n_tasks or any(
            r.ndim != 2 or r.shape[1] != n_in or r.shape[0] == 0 for r in rows
        ):
            raise TensorError(
                f"{name}: rows must be one non-empty N_k x {n_in} tensor per task; got "
                f"{[tuple(r.shape) for r in rows]}"
            )
        span_tokens = sum(r.shape[0] for r, omega in zip(rows, weights) if omega > 0.0)
        if span_solve_applies(reduce_non_diagonal, relative_ridge, span_tokens, n_in):

            def at(value: float) -> RegMeanSolution:
                return span_solve(
                    expert_weights,
                    grams,
                    rows,  # type: ignore[arg-type]
                    reduce_non_diagonal,
                    task_weights=weights,
                    ridge=value,
                    tokens=tokens,
                    ridge_reason=_ridge_reason(ridge, relative_ridge, n_in, tokens),
                    product_dtype=span_product_dtype(compute_dtype, out_dtype, written_dtype),
                )

            return _span_in_range(at, at(relative_ridge), ridge, norm_range)
    if any(g is None for g in grams):
        assert rows is not None
        grams = [_gram_of(r) if g is None else g for g, r in zip(grams, rows)]

    # The same sums and solve as the distributed reduction (LeastSquaresReduction), so one
    # process and several add and solve bit for bit alike: the system first, factored with
    # its ridge decided, then the numerator or the row terms.
    device = expert_weights[0].device
    sums = regmean_zero_system_sums(n_in, device=device)
    for g, omega in zip(grams, weights):
        regmean_add_system(sums, g, reduce_non_diagonal, omega)
    factored = factor_regmean_system(sums, ridge=ridge, solver=solver, tokens=tokens, name=name)
    positive = [k for k, omega in enumerate(weights) if omega > 0.0]
    if rows is not None and factored.ridge > 0.0 and reduce_non_diagonal > 0.0:
        # As many tokens as inputs or more, and a ridge (set, or added by auto on an
        # ill-conditioned system): the same solution in the tokens' span where that pays
        counts = [int(rows[k].shape[0]) for k in positive]
        if span_solve_pays(shape[0], n_in, counts):
            del sums

            def at_factored(value: float) -> RegMeanSolution:
                solution = span_solve(
                    expert_weights,
                    grams,
                    rows,  # type: ignore[arg-type]
                    reduce_non_diagonal,
                    task_weights=weights,
                    ridge=value,
                    tokens=tokens,
                    ridge_reason=factored.reason,
                    product_dtype=span_product_dtype(compute_dtype, out_dtype, written_dtype),
                    # the factored system's condition number, at the ridge it holds
                    condition=(factored.condition, factored.condition_method)
                    if value == factored.ridge
                    else None,
                )
                solution.condition_number_unregularized = factored.unregularized
                return solution

            return _span_in_range(at_factored, at_factored(factored.ridge), ridge, norm_range)
    by_rows = gram_rows is not None and all(gram_rows[k] is not None for k in positive)
    row_tokens = sum(int(gram_rows[k].shape[0]) for k in positive) if by_rows else 0  # type: ignore[index,union-attr]
    sums.update(
        regmean_zero_numerator_sums(
            shape, with_weighted_experts=factored.ridge > 0.0, device=device
        )
    )
    references: list[float] = []
    # One float64 and two product-dtype out x in buffers for every task's widened copies and
    # products: a fresh GB-sized tensor per copy costs more in page faults than the copy
    # itself (~10x for an 8B gate_up weight, measured).
    scratch = torch.empty(shape, dtype=torch.float64, device=device)
    if takes_row_terms(factored, reduce_non_diagonal, shape[0], row_tokens, by_rows):
        assert gram_rows is not None and factored.cholesky is not None
        for w, g, x, omega in zip(expert_weights, grams, gram_rows, weights):
            term, reference = task_row_term(w, g, x, omega, factored.cholesky, keep_references)
            if term is not None:
                regmean_add_row_term(sums, term, omega, scratch)
            del term
            references.append(reference)
        del scratch
        if factored.auto and norm_range is not None:
            solution = finish_in_range(
                factored,
                sums["numerator"],
                lambda: weighted_expert_sum(expert_weights, weights),
                norm_range,
                tokens,
                out_dtype,
            )
        else:
            solution = factored_solution(factored, sums["numerator"].to(out_dtype), tokens)
        solution.references = references if keep_references else None
        return solution
    narrow = (
        torch.empty(shape, dtype=product_dtype, device=device)
        if any(w.dtype != product_dtype for w in expert_weights)
        else None
    )
    product = torch.empty(shape, dtype=product_dtype, device=device)
    for k, (w, g, omega) in enumerate(zip(expert_weights, grams, weights)):
        # W_k G̃_k = α W_k G_k + (1 − α) W_k diag(G_k): one product, no shrunk copy of G_k.
        wide = w if w.dtype == product_dtype else narrow.copy_(w)  # type: ignore[union-attr]
        task_product(wide, g, gram_rows[k] if gram_rows else None, out=product)
        regmean_add_numerator(sums, w, g, reduce_non_diagonal, omega, product, scratch=scratch)
        if keep_references:
            references.append(trace_product(product, w))
        del wide
    del scratch, narrow, product
    solution = solve_factored(
        factored,
        sums,
        name=name,
        out_dtype=out_dtype,
        tokens=tokens,
        consume=True,
        norm_range=norm_range,
        weighted_experts=lambda: weighted_expert_sum(expert_weights, weights),
    )
    solution.references = references if keep_references else None
    return solution


def _span_in_range(
    at: Callable[[float], RegMeanSolution],
    first: RegMeanSolution,
    ridge: Ridge,
    norm_range: Optional[NormRange],
) -> RegMeanSolution:
    """``auto``'s range rule on a span solution: ``first`` where it is in range, else the
    span solution ``at`` the smallest larger ridge found in range (:func:`span_ridge_in_range`)."""
    if not isinstance(ridge, str) or norm_range is None:
        return first
    found = span_ridge_in_range(at, lambda s: s.merged_weight, first, first.ridge, norm_range)
    if found is None:
        return first
    solution, fit = found
    solution.ridge_reason = reason(first.ridge_reason, fit, first.ridge, norm_range.limit)
    solution.norm_ratio_before_ridge = fit.before
    return solution


def regmean_add_row_term(
    sums: dict[str, torch.Tensor],
    term: torch.Tensor,
    omega: float,
    scratch: Optional[torch.Tensor] = None,
) -> None:
    """Add ``ω_k`` times task k's :func:`row_term` to ``sums["numerator"]`` (float64, in task
    order, as the numerator's terms); ``scratch`` as in :func:`regmean_add_numerator`."""
    if scratch is None:
        scratch = torch.empty(term.shape, dtype=torch.float64, device=term.device)
    sums["numerator"].add_(scratch.copy_(term), alpha=omega)


def task_row_term(
    weight: torch.Tensor,
    gram: torch.Tensor,
    rows: Optional[torch.Tensor],
    omega: float,
    cholesky: torch.Tensor,
    keep_reference: bool = True,
) -> tuple[Optional[torch.Tensor], float]:
    """Task k's part on the row path, the same on one process and several.

    Returns:
        With ω > 0, its :func:`row_term` and reference (the task kept its rows). With ω = 0,
        no term and the output error's reference ``tr(W G Wᵀ)`` alone, from its rows where it
        kept them (NaN unless ``keep_reference``).
    """
    if omega > 0.0:
        assert rows is not None
        return row_term(weight, rows, cholesky)
    if not keep_reference:
        return None, math.nan
    if rows is not None:
        outputs = row_outputs(weight, rows)
        return None, dot64(outputs, outputs) / int(rows.shape[0])
    return None, trace_product(task_product(weight, gram), weight)


def task_product(
    weight: torch.Tensor,
    gram: torch.Tensor,
    rows: Optional[torch.Tensor] = None,
    *,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``W_k G_k``, the dense solve's per-task product (``out x in``).

    The one place it is formed, so that one process and several (:func:`regmean_solve`,
    the distributed reduction) form it bit for bit alike. From the rows as
    ``(W_k X_kᵀ) X_k / N`` when they and the weight hold bfloat16 values (a bfloat16 pass
    and bfloat16 checkpoints) and ``N ≤ in / 2``: ``W_k X_kᵀ`` then has exact operands and runs
    on the bfloat16 units with float32 sums
    (:func:`~mergekit_ext.bf16_products.float32_product`), the second product is a float32
    GEMM. Measured on an 8B ``gate_up`` (28672 x 4096, N = 2000, two threads, AMX;
    ``benchmarks/probes/bf16_products_probe.py``): 1.55 s against 2.24 s, relative error to
    the float64 product 3.1e-7 against 3.5e-7. Otherwise one GEMM with the Gram.

    Args:
        weight: ``W_k`` (``out x in``).
        gram: ``G_k`` (``in x in``).
        rows: optionally ``X_k`` (``N x in``, float32 or bfloat16) with
            ``G_k = X_kᵀ X_k / N``; only the rows of the Gram itself, not of a normalised one.
        out: an ``out x in`` buffer of the product's dtype to write into.

    Returns:
        ``W_k G_k``: float32 for float32 (or narrower) weights, float64 for float64 ones.
    """
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    wide = weight.to(dtype)
    if out is None:
        out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    if (
        rows is not None
        and dtype == torch.float32
        and rows.shape[0] <= _ROW_PRODUCT_MAX_FRACTION * weight.shape[1]
        and holds_bfloat16(rows)
    ):
        # the fast path when the weight holds bfloat16 values too; else two float32 GEMMs,
        # at N ≤ in / 2 no more work than the one with the Gram
        outputs = float32_product(wide, rows.T)  # out x N
        torch.mm(outputs, rows.to(dtype), out=out)
        return out.div_(int(rows.shape[0]))
    return torch.mm(wide, gram.to(dtype), out=out)


def trace_product(product: torch.Tensor, weight: torch.Tensor) -> float:
    """``tr(W G Wᵀ) = Σ (W G) ⊙ W`` from the product ``W G`` (``out x in``), in float64.

    Args:
        product: ``W G`` in any float dtype.
        weight: ``W``.

    Returns:
        The trace, a Python float (the reference of :func:`relative_output_error`).
    """
    return dot64(product, weight)


def span_product_dtype(
    compute_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    written_dtype: Optional[torch.dtype] = None,
) -> torch.dtype:
    """The dtype of :func:`span_solve`'s ``out x in x T`` products.

    float32 when the weights are not float64 and either the rows come from a bfloat16 /
    float16 pass (the activations then carry ~3 significant digits, float32 products ~7) or
    the merged weights are written as bfloat16 / float16 (``written_dtype``: their rounding,
    2⁻⁹ relative, is four orders above the float32 products' error, which the span form does
    not amplify by the condition number: its products are of the experts' differences from
    ``W₀``). On an 8B ``o_proj`` after a float32 pass 3.9e-5 of the written bf16 entries
    differ from those of the float64 products (``benchmarks/results/roofline_8b.md``), at
    the float32 GEMM rate (twice float64's on AVX2 and AVX-512: issue #47's roofline).
    float64 otherwise: a float32 pass's solve written as float32 keeps its bytes.
    """
    if weight_dtype == torch.float64:
        return torch.float64
    low = (torch.bfloat16, torch.float16)
    return torch.float32 if compute_dtype in low or written_dtype in low else torch.float64


def _gram_of(rows: torch.Tensor) -> torch.Tensor:
    """``rowsᵀ rows / N`` in float64, exactly symmetric."""
    r = rows.double()
    return symmetrized(r.T @ r / r.shape[0])


def _outer_gram(rows: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """``rows @ rows.T`` (``T x T``) from its lower block triangle: about half the flops of
    one GEMM at T ≫ block, and exactly symmetric."""
    t = int(rows.shape[0])
    out = torch.empty((t, t), dtype=rows.dtype, device=rows.device)
    for i in range(0, t, block):
        top = min(i + block, t)
        torch.mm(rows[i:top], rows[:top].T, out=out[i:top, :top])
        out[:i, i:top] = out[i:top, :i].T
        diagonal = out[i:top, i:top]
        diagonal.copy_(0.5 * (diagonal + diagonal.T))
    return out


def _regroups(out: int, n_in: int, tokens: int, tasks: int) -> bool:
    """Whether :func:`span_solve` writes two tasks' correction regrouped: ``2·in²·T`` for the
    ``M_k`` plus ``2·out·in²`` for one ``out x in x in`` product, against ``4·out·in·T`` for
    ``V`` and its expansion. With T < in this can only pay for two tasks (``K' − 1 < 2T/in``)
    and when out > in: an 8B ``gate_up`` at 4,000 tokens does 41 % fewer multiply-adds."""
    return tasks == 2 and n_in * (tokens + out) < 2 * out * tokens


def span_solve(
    expert_weights: Sequence[torch.Tensor],
    grams: Sequence[Optional[torch.Tensor]],
    rows: Sequence[torch.Tensor],
    reduce_non_diagonal: float,
    *,
    task_weights: Sequence[float],
    ridge: float,
    tokens: Optional[int] = None,
    ridge_reason: str = "as set",
    product_dtype: torch.dtype = torch.float64,
    condition: Optional[tuple[float, str]] = None,
) -> RegMeanSolution:
    """The ridge-regularised RegMean solution written in the span of the calibration tokens.

    With ``R`` the ``T x in`` stack of every task's rows (tasks with ω_k = 0 left out),
    ``D = diag(α ω_k / N_k)`` per row, ``E = diag((1 − α) Σ_k ω_k diag(G_k) + λ)``
    (``λ = ridge · mean(diag(A))``, the same λ as :func:`regmean_solve`), the inverted matrix
    is ``A = Rᵀ D R + E`` and the numerator ``N = Σ_k α ω_k W_k R_kᵀ R_k / N_k + M`` with
    ``M = Σ_k ω_k W_k ((1 − α) diag(G_k) + λ / Σ ω)``. Let ``W₀ = M E⁻¹`` (a per-input-column
    weighted mean of the experts; with α = 1 their ω-mean). Then ``N − W₀ A = V D R`` with
    ``V = [(W_k − W₀) R_kᵀ]_k`` (``out x T``), and the push-through identity
    ``D R (Rᵀ D R + E)⁻¹ = (R E⁻¹ Rᵀ + D⁻¹)⁻¹ R E⁻¹`` gives::

        W = N A⁻¹ = W₀ + V H⁻¹ (R E⁻¹),     H = R E⁻¹ Rᵀ + D⁻¹     (T x T, positive definite)

    exactly (Woodbury), for any T. It is used when T < in: then ``A``'s ``in x in``
    factorisation (O(in³)) is replaced by ``H``'s (O(T³)) and O(T · in · (T + out)) products;
    in the directions no token spans, ``W = W₀``. With T ≥ in, :func:`regmean_solve` takes
    it where a ridge was applied and it does less work (:func:`span_solve_pays`), passing
    the ``condition`` number (and its method) it already has.

    Two tasks (a, b) with out > in regroup the correction when that is cheaper
    (:func:`_regroups`): ``W₀ = W_a S_a + W_b S_b`` with ``S_k`` the diagonal of expert k's
    column weights (``S_a + S_b = I``), so with ``Y = H⁻¹ R E⁻¹`` and ``M_k = R_kᵀ Y_k``
    (``in x in``)::

        V Y = Σ_k (W_k − W₀) M_k = (W_a − W_b)(S_b M_a − S_a M_b)

    one ``out x in x in`` product instead of the two ``out x in x T`` ones.

    ``H``, its Cholesky factor and the triangular solves are float64. The two ``out x in x T``
    products (forming ``V`` and expanding ``V H⁻¹ R E⁻¹``), the bulk of the cost, are
    ``product_dtype`` GEMMs: float64 by default; float32 where the activations come from a
    bfloat16 / float16 pass (``compute_dtype``), whose own rounding (~4e-3) is four orders
    above float32's, so the merged weight moves by far less than its bf16 rounding
    (docs/methods.md, "Compute dtype", gives the measurement). The condition
    number of ``A`` is exact (dense) up to :data:`EXACT_CONDITION_MAX_DIM` inputs, estimated
    above from ``A``'s action (``Rᵀ D R q + E q``) and its inverse (by Woodbury), with no
    ``in x in`` matrix formed.
    """
    out_dtype = expert_weights[0].dtype
    if product_dtype not in (torch.float64, torch.float32):
        raise ValueError(f"product_dtype must be float64 or float32; got {product_dtype}")
    out, n_in = expert_weights[0].shape
    weights = [float(w) for w in task_weights]
    total = sum(weights)
    # mean(diag(A)) of the dense path: Σ_k ω_k mean(diag(G̃_k)) = Σ_k ω_k mean(diag(G_k))
    diagonals = [
        torch.diagonal(g).double() if g is not None else r.double().square().mean(0)
        for g, r in zip(grams, rows)
    ]
    mean_diagonal = float(sum(omega * d for d, omega in zip(diagonals, weights)).mean())
    strength = ridge * mean_diagonal
    device = expert_weights[0].device
    f64 = dict(dtype=torch.float64, device=device)
    e = torch.full((n_in,), strength, **f64)
    # The out x in work (W₀, each W_k − W₀, the expansion) runs in the products' dtype:
    # float32 after a bf16 / fp16 pass halves its memory traffic, which at LLM widths costs
    # as much as the products themselves (~5 s per block at 8B widths, measured); float64
    # otherwise, the float32 pass's solve unchanged bit for bit. At these widths the buffers
    # are GB-sized: one W₀ accumulator and one reused widened copy, not a copy per expert.
    # Each weight is widened into ``delta`` and added like to like: a mixed-dtype in-place
    # add_/addcmul_ gives the same bits but runs ~10x slower (~5 s per task for an 8B
    # gate_up, measured).
    work = product_dtype
    w0 = torch.zeros((out, n_in), dtype=work, device=device)
    delta = torch.empty((out, n_in), dtype=work, device=device)
    scales: list[torch.Tensor] = []  # W₀'s per-column weight of each expert, times E
    for w, d, omega in zip(expert_weights, diagonals, weights):
        e.add_(d, alpha=omega * (1.0 - reduce_non_diagonal))
        wide = delta.copy_(w)
        if reduce_non_diagonal == 1.0:
            w0.add_(wide, alpha=omega * strength / total)
            scales.append(torch.full((n_in,), omega * strength / total, **f64))
        else:
            scale = omega * ((1.0 - reduce_non_diagonal) * d + strength / total)
            w0.addcmul_(wide, scale.to(work))
            scales.append(scale)
    if not bool((e > 0.0).all()):
        raise TensorError("span_solve needs a positive E = (1 − α) Σ ω diag(G) + λ; use a ridge")
    w0.div_(e.to(work))  # W₀ = M E⁻¹

    kept = [k for k, omega in enumerate(weights) if omega > 0.0]
    r_all = torch.cat([rows[k].double() for k in kept])  # T x in
    counts = [int(rows[k].shape[0]) for k in kept]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    d_inv = torch.cat(
        [
            torch.full((c,), c / (reduce_non_diagonal * weights[k]), **f64)
            for k, c in zip(kept, counts)
        ]
    )
    # The triangular solves cost 2T²·min(out, in): solve for V H⁻¹ (T x out) or for
    # H⁻¹ R E⁻¹ (T x in), whichever is narrower; the expansion costs out·T·in either way.
    solve_left = out <= n_in
    total_rows = offsets[-1]
    # Two tasks and out > in: the correction regrouped (docstring), no V
    regroup = not solve_left and _regroups(out, n_in, total_rows, len(counts))
    # Vᵀ = [R_k (W_k − W₀)ᵀ]_k (T x out), each task's rows a contiguous slice; float64 where
    # the triangular solve reads it, else kept in the products' dtype for the expansion
    r_product = r_all.to(work)  # r_all itself when work is float64
    v_t: Optional[torch.Tensor] = None
    if not regroup:
        v_dtype = torch.float64 if solve_left else work
        v_t = torch.empty((total_rows, out), dtype=v_dtype, device=device)
        for k, a, b in zip(kept, offsets, offsets[1:]):
            delta.copy_(expert_weights[k]).sub_(w0)
            if v_t.dtype == work:
                torch.mm(r_product[a:b], delta.T, out=v_t[a:b])
            else:
                v_t[a:b].copy_(r_product[a:b] @ delta.T)
        del delta, r_product
    root_e = e.sqrt()
    scaled = r_all / root_e  # R E^(-1/2)
    h = _outer_gram(scaled)  # R E⁻¹ Rᵀ, exactly symmetric
    f = scaled.div_(root_e)  # R E⁻¹, in place
    del scaled
    torch.diagonal(h).add_(d_inv)
    factor = _cholesky(h)
    if factor is None:  # pragma: no cover - H ⪰ D⁻¹ > 0
        raise TensorError("span_solve: H = R E⁻¹ Rᵀ + D⁻¹ is not positive definite")
    if regroup:
        first, second = kept
        y = torch.cholesky_solve(f, factor).to(work)  # Y = H⁻¹ R E⁻¹, T x in
        split = counts[0]
        m_first = r_product[:split].T @ y[:split]  # M_a = R_aᵀ Y_a, in x in
        m_second = r_product[split:].T @ y[split:]
        del y, r_product
        # S_b M_a − S_a M_b, the S_k = diag(W₀'s column weights of expert k) scaling rows
        m_first.mul_((scales[second] / e).to(work)[:, None])
        m_first.sub_(m_second.mul_((scales[first] / e).to(work)[:, None]))
        del m_second
        delta.copy_(expert_weights[first]).sub_(expert_weights[second].to(work))
        w0.addmm_(delta, m_first)  # W = W₀ + (W_a − W_b)(S_b M_a − S_a M_b), in place
        del delta, m_first
    else:
        assert v_t is not None
        if solve_left:
            left = torch.cholesky_solve(v_t, factor).T.to(work)  # V H⁻¹, out x T
            right = f.to(work)  # R E⁻¹
        else:
            left = v_t.T  # V
            right = torch.cholesky_solve(f, factor).to(work)  # H⁻¹ R E⁻¹, T x in
        del v_t
        w0.addmm_(left, right)  # W = W₀ + V H⁻¹ R E⁻¹, in place
        del left, right
    merged = w0

    d = 1.0 / d_inv
    if condition is not None:
        number, method = condition
    elif n_in <= EXACT_CONDITION_MAX_DIM:
        system = (r_all.T * d) @ r_all
        torch.diagonal(system).add_(e)
        eigenvalues = torch.linalg.eigvalsh(0.5 * (system + system.T))
        number, method = _condition_number(eigenvalues), "exact"
    elif reduce_non_diagonal == 1.0:
        # E = λ I and T < in: λ_min(A) = λ exactly (A = λ I off the tokens' span) and
        # λ_max(A) = λ · λ_max(D^½ H D^½), from the T x T matrix already formed.
        root = d.sqrt()
        scaled = root[:, None] * h * root[None, :]
        number = float(_ritz_values(lambda q: scaled @ q, lambda q: scaled @ q, len(d)).max())
        method = "estimate"
    else:
        number = estimate_condition_number_of(
            lambda q: r_all.T @ (d[:, None] * (r_all @ q)) + e[:, None] * q,
            lambda q: q / e[:, None] - f.T @ torch.cholesky_solve(f @ q, factor),
            n_in,
        )
        method = "estimate"
    return RegMeanSolution(
        merged.to(out_dtype),
        number,
        f"cholesky in the span of {total_rows} tokens",
        method,
        None,
        ridge=ridge,
        tokens=tokens if tokens is not None else total_rows,
        ridge_reason=ridge_reason,
    )


def regmean_merge_weights(
    expert_weights: Sequence[torch.Tensor],
    grams: Sequence[torch.Tensor],
    reduce_non_diagonal: float,
    *,
    task_weights: Optional[Sequence[float]] = None,
    ridge: Ridge = 0.0,
    solver: Solver = "pinv",
) -> torch.Tensor:
    """``W = (Σ_k ω_k W_k G̃_k)(Σ_k ω_k G̃_k)⁻¹``; see :func:`regmean_solve` for the details."""
    return regmean_solve(
        expert_weights,
        grams,
        reduce_non_diagonal,
        task_weights=task_weights,
        ridge=ridge,
        solver=solver,
    ).merged_weight


# --------------------------------------------------------------------------------------
# Several processes: the same merge from sums over disjoint task sets
# --------------------------------------------------------------------------------------


def regmean_zero_system_sums(n_in: int, *, device: Any = None) -> dict[str, torch.Tensor]:
    """The accumulators of the system (float64 zeros), for :func:`regmean_add_system`:
    ``system`` (in x in), ``system_diagonal`` (in), ``task_weight_sum`` (1), ``tokens`` (1)."""
    zeros = dict(dtype=torch.float64, device=device)
    return {
        "system": torch.zeros((n_in, n_in), **zeros),
        "system_diagonal": torch.zeros(n_in, **zeros),
        "task_weight_sum": torch.zeros(1, **zeros),
        "tokens": torch.zeros(1, **zeros),  # Σ N_k over tasks with ω_k > 0 (for ridge: auto)
    }


def regmean_zero_numerator_sums(
    shape: Sequence[int], *, with_weighted_experts: bool = False, device: Any = None
) -> dict[str, torch.Tensor]:
    """The out x in accumulators (float64 zeros), for :func:`regmean_add_numerator`:
    ``numerator`` and, for a ridge, ``weighted_experts``; :func:`regmean_add_row_term` adds
    into ``numerator`` too."""
    out, n_in = int(shape[0]), int(shape[1])
    sums = {"numerator": torch.zeros((out, n_in), dtype=torch.float64, device=device)}
    if with_weighted_experts:
        sums["weighted_experts"] = torch.zeros((out, n_in), dtype=torch.float64, device=device)
    return sums


def regmean_zero_sums(
    shape: Sequence[int], *, with_weighted_experts: bool = False, device: Any = None
) -> dict[str, torch.Tensor]:
    """The accumulators of :func:`regmean_solve`'s sums (float64 zeros), for
    :func:`regmean_add_task`: :func:`regmean_zero_system_sums` and
    :func:`regmean_zero_numerator_sums` together."""
    return {
        **regmean_zero_numerator_sums(
            shape, with_weighted_experts=with_weighted_experts, device=device
        ),
        **regmean_zero_system_sums(int(shape[1]), device=device),
    }


def regmean_add_system(
    sums: dict[str, torch.Tensor],
    gram: torch.Tensor,
    reduce_non_diagonal: float,
    omega: float,
    count: int = 0,
) -> None:
    """Add one task's system terms, in place: ``ω α G`` to the system, ``ω (1 − α) diag(G)``
    to its diagonal part, ``ω`` and (ω > 0) the task's token count ``count``."""
    diagonal = torch.diagonal(gram).double()
    sums["system"].add_(gram.double(), alpha=omega * reduce_non_diagonal)
    sums["system_diagonal"].add_(diagonal, alpha=omega * (1.0 - reduce_non_diagonal))
    sums["task_weight_sum"].add_(omega)
    if omega > 0.0:
        sums["tokens"].add_(float(count))


def regmean_add_numerator(
    sums: dict[str, torch.Tensor],
    weight: torch.Tensor,
    gram: torch.Tensor,
    reduce_non_diagonal: float,
    omega: float,
    product: Optional[torch.Tensor] = None,
    scratch: Optional[torch.Tensor] = None,
) -> None:
    """Add one task's numerator terms, in place: ``ω (α W G + (1 − α) W diag(G))`` and, where
    the sums have it, ``ω W``. ``product`` is ``W G`` when already computed (as
    :func:`regmean_solve` forms it: float32 for float32 weights). ``scratch``: an
    ``out x in`` float64 buffer for the widened terms (allocated here when None); the values
    are those of the fresh temporaries it replaces."""
    if product is None:
        product = task_product(weight, gram)
    if scratch is None:
        scratch = torch.empty(weight.shape, dtype=torch.float64, device=weight.device)
    sums["numerator"].add_(scratch.copy_(product), alpha=omega * reduce_non_diagonal)
    if reduce_non_diagonal != 1.0:
        # α = 1 would add 0 · W diag(G): an out x in float64 term for nothing
        diagonal = torch.diagonal(gram).double()
        torch.mul(scratch.copy_(weight), diagonal, out=scratch)
        sums["numerator"].add_(scratch, alpha=omega * (1.0 - reduce_non_diagonal))
    if "weighted_experts" in sums:
        # ω · W rounded, then added: not add_(alpha=ω), whose fused multiply-add rounds once
        sums["weighted_experts"].add_(scratch.copy_(weight).mul_(omega))


def regmean_add_task(
    sums: dict[str, torch.Tensor],
    weight: torch.Tensor,
    gram: torch.Tensor,
    reduce_non_diagonal: float,
    omega: float,
    product: Optional[torch.Tensor] = None,
    count: int = 0,
    scratch: Optional[torch.Tensor] = None,
) -> None:
    """Add one task's terms to the sums, in place (:func:`regmean_add_numerator` and
    :func:`regmean_add_system`).

    The same operations in the same order as :func:`regmean_solve`'s, so adding the tasks in
    order gives its sums bit for bit.
    """
    regmean_add_numerator(
        sums, weight, gram, reduce_non_diagonal, omega, product=product, scratch=scratch
    )
    regmean_add_system(sums, gram, reduce_non_diagonal, omega, count)


def takes_row_terms(
    factored: FactoredSystem, reduce_non_diagonal: float, out: int, tokens: int, rows: bool
) -> bool:
    """Whether the dense solve forms the merged weight task by task from the rows
    (:func:`row_term`) instead of solving the numerator: α = 1, no ridge, a Cholesky solve,
    every weighted task's rows at hand (``rows``) and fewer tokens in all than outputs, where
    ``2·T·in²`` for the tasks' ``X_k A⁻¹`` is less than ``2·out·in²`` for ``N A⁻¹``."""
    return (
        rows
        and reduce_non_diagonal == 1.0
        and factored.ridge == 0.0
        and factored.cholesky_solves
        and tokens < out
    )


def row_term(
    weight: torch.Tensor, rows: torch.Tensor, cholesky: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """Task k's part of the merged weight, ``(W_k X_kᵀ)(X_k A⁻¹) / N_k``.

    With α = 1 and no ridge the merged weight is ``W = Σ_k ω_k W_k G_k A⁻¹`` and
    ``W_k G_k = (W_k X_kᵀ) X_k / N_k``, so ``W = Σ_k ω_k (W_k X_kᵀ)(X_k A⁻¹) / N_k``: the
    triangular solves then cost ``2·N_k·in²`` per task instead of ``2·out·in²`` for the
    numerator (an 8B ``gate_up`` at K = 4 and 2,000 tokens per task: 3.5x fewer float64
    multiply-adds). ``W_k X_kᵀ`` is :func:`task_product`'s first product (on the bfloat16
    units where both operands hold bfloat16 values), the second a GEMM in the products'
    dtype, as there.

    Args:
        weight: ``W_k`` (``out x in``).
        rows: ``X_k`` (``N_k x in``), the rows of the task's plain Gram.
        cholesky: the lower Cholesky factor of ``A = Σ ω G`` (:class:`FactoredSystem`).

    Returns:
        The term (float32 for float32 or narrower weights, float64 for float64 ones) and the
        output error's reference ``tr(W_k G_k W_kᵀ) = ‖W_k X_kᵀ‖² / N_k``.
    """
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    outputs = row_outputs(weight, rows)
    count = int(rows.shape[0])
    # X_k A⁻¹ = X_k L⁻ᵀ L⁻¹ solved from the right: N x in and contiguous for the GEMM
    # (cholesky_solve on X_kᵀ and a transposed view: 0.95 + 2.8 s against 0.57 + 1.5 s for
    # an 8B gate_up task, two threads, measured)
    solved = torch.linalg.solve_triangular(cholesky.T, rows.double(), upper=True, left=False)
    solved = torch.linalg.solve_triangular(cholesky, solved, upper=False, left=False)
    term = torch.mm(outputs, solved.to(dtype)).div_(count)
    return term, dot64(outputs, outputs) / count


def row_outputs(weight: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``W_k X_kᵀ`` (``out x N``) in the products' dtype (:func:`row_term`)."""
    if weight.dtype == torch.float64:
        return weight @ rows.T.double()
    if holds_bfloat16(rows):  # as in task_product: the bfloat16 units where exact
        return float32_product(weight.float(), rows.T)
    return weight.float() @ rows.T.float()


@dataclass
class FactoredSystem:
    """``Σ ω G̃`` with its ridge, factored, and how (:func:`factor_regmean_system`): what the
    dense solve needs besides the numerator."""

    system: torch.Tensor  # Σ ω G̃ + λ I, float64, exactly symmetric
    cholesky: Optional[torch.Tensor]  # its lower factor; None where it is not positive definite
    condition: float
    condition_method: str
    ridge: float  # the relative ridge applied
    reason: str
    unregularized: Optional[float]  # the condition number before auto added its ridge
    numerator_ridge: float  # λ / Σω: the numerator gains it times Σ ω W_k
    solver: Solver
    diagonal_mean: float = 0.0  # mean(diag(Σ ω G̃)): a relative ridge ρ adds ρ times it
    auto: bool = False  # ``ridge: auto``: the range rule applies (:func:`finish_in_range`)
    total_weight: float = 1.0  # Σ ω

    @property
    def cholesky_solves(self) -> bool:
        """Whether the merged weight is the numerator's Cholesky solve (no eigendecomposition,
        no fallback): the solve that :func:`row_term` can take task by task."""
        if self.cholesky is None:
            return False
        n_eps = self.system.shape[0] * torch.finfo(torch.float64).eps
        return self.solver == "solve" or self.condition * n_eps < _CHOLESKY_PINV_MARGIN


def factor_regmean_system(
    sums: dict[str, torch.Tensor],
    *,
    ridge: Ridge = 0.0,
    solver: Solver = "pinv",
    tokens: Optional[int] = None,
    name: str = "<weight>",
) -> FactoredSystem:
    """The system of :func:`solve_regmean_sums` with its ridge decided and added, factored.

    Reads only ``system``, ``system_diagonal`` and ``task_weight_sum``, so it can run before
    any numerator term is formed (:func:`takes_row_terms`). ``ridge``: a relative ridge, or
    ``"auto"``: :data:`AUTO_RIDGE` when ``tokens`` is below the input width, or when the
    unregularised system is singular or its condition number exceeds
    :data:`AUTO_RIDGE_MAX_CONDITION` (:func:`auto_ridge_needed`), else exactly 0.
    """
    if float(sums["task_weight_sum"].sum()) <= 0.0:
        raise TensorError(f"{name}: the task weights are all zero; use task_weighting: uniform")
    system = sums["system"].double().clone()
    n_in = system.shape[0]
    auto = isinstance(ridge, str)
    relative_ridge = resolve_ridge(ridge, n_in, tokens)
    reason = _ridge_reason(ridge, relative_ridge, n_in, tokens)
    torch.diagonal(system).add_(sums["system_diagonal"].double())
    system = symmetrized(system)  # exact symmetry for eigh
    numerator_ridge = 0.0
    diagonal_mean = float(torch.diagonal(system).mean())  # add_ridge's, before any ridge

    def add_ridge(value: float) -> None:
        nonlocal numerator_ridge
        strength = value * float(torch.diagonal(system).mean())
        torch.diagonal(system).add_(strength)
        numerator_ridge = strength / float(sums["task_weight_sum"].sum())

    if relative_ridge > 0.0:
        add_ridge(relative_ridge)

    cholesky = _cholesky(system)
    if cholesky is None and solver == "pinv" and not auto:
        # pinv's eigh gives the condition number: no eigvalsh of the same matrix first
        condition, condition_method = math.inf, "exact"
    elif cholesky is None and auto and relative_ridge == 0.0:
        condition, condition_method = math.inf, "exact"  # not positive definite: singular
    else:
        condition, condition_method = _condition(system, cholesky)
    unregularized: Optional[float] = None
    if auto and relative_ridge == 0.0:
        if auto_ridge_needed(condition):
            # Decided from the system actually solved, whatever the token count: a few
            # distinct tokens repeated many times give a Gram of low numerical rank.
            unregularized = condition
            relative_ridge = AUTO_RIDGE
            reason = (
                f"auto: condition number {condition:.3g} of Σ ω G̃ above "
                f"{AUTO_RIDGE_MAX_CONDITION:g}"
                if math.isfinite(condition)
                else "auto: Σ ω G̃ is numerically singular (not positive definite in float64)"
            )
            add_ridge(relative_ridge)
            cholesky = _cholesky(system)
            condition, condition_method = _condition(system, cholesky)
        else:
            reason = (
                f"auto: condition number {condition:.3g} of Σ ω G̃ at most "
                f"{AUTO_RIDGE_MAX_CONDITION:g} (exact solution)"
            )
    return FactoredSystem(
        system,
        cholesky,
        condition,
        condition_method,
        relative_ridge,
        reason,
        unregularized,
        numerator_ridge,
        solver,
        diagonal_mean,
        auto,
        float(sums["task_weight_sum"].sum()),
    )


def solve_regmean_sums(
    sums: dict[str, torch.Tensor],
    *,
    ridge: Ridge = 0.0,
    solver: Solver = "pinv",
    name: str = "<weight>",
    out_dtype: torch.dtype = torch.float32,
    tokens: Optional[int] = None,
    consume: bool = False,
    norm_range: Optional[NormRange] = None,
) -> RegMeanSolution:
    """``W = numerator · system⁻¹`` from the sums of :func:`regmean_add_task`.

    The one dense solve of every least-squares merge (:func:`regmean_solve` and the
    distributed :class:`LeastSquaresReduction`): :func:`factor_regmean_system`, then
    :func:`solve_factored`. ``auto`` needs ``sums["weighted_experts"]``. ``tokens`` is
    recorded in the solution. The ``solver`` choice is :func:`regmean_solve`'s.
    ``consume``: the caller no longer needs ``sums``, so the out x in ones are solved in
    place instead of copied first (the same values). ``norm_range``: the group's range,
    which ``auto`` keeps the solution within (:func:`finish_in_range`).
    """
    factored = factor_regmean_system(sums, ridge=ridge, solver=solver, tokens=tokens, name=name)
    return solve_factored(
        factored,
        sums,
        name=name,
        out_dtype=out_dtype,
        tokens=tokens,
        consume=consume,
        norm_range=norm_range,
    )


def solve_factored(
    factored: FactoredSystem,
    sums: dict[str, torch.Tensor],
    *,
    name: str = "<weight>",
    out_dtype: torch.dtype = torch.float32,
    tokens: Optional[int] = None,
    consume: bool = False,
    norm_range: Optional[NormRange] = None,
    weighted_experts: Optional[Callable[[], torch.Tensor]] = None,
) -> RegMeanSolution:
    """``W = (numerator + λ/Σω Σ ω W_k) · system⁻¹`` with the factored system; ``sums`` needs
    ``numerator`` and, where a ridge was added, ``weighted_experts``. With ``auto`` and a
    ``norm_range``, :func:`finish_in_range` then keeps the solution within it, reading
    ``Σ ω W_k`` from ``sums["weighted_experts"]`` or, where the sums lack it, from
    ``weighted_experts()`` (:func:`weighted_expert_sum`)."""
    numerator = sums["numerator"].double()
    if not consume or numerator is not sums["numerator"]:
        numerator = numerator.clone()
    ranged = factored.auto and norm_range is not None
    if factored.ridge > 0.0:
        weighted = sums["weighted_experts"].double()
        if consume and weighted is sums["weighted_experts"] and not ranged:
            numerator += weighted.mul_(factored.numerator_ridge)  # in place: no copy
        else:
            # the same bits: μ · S rounded, then added (the range rule reads S after)
            numerator += factored.numerator_ridge * weighted
    system, cholesky, solver = factored.system, factored.cholesky, factored.solver
    condition, condition_method = factored.condition, factored.condition_method
    relative_ridge = factored.ridge
    used = solver
    merged: Optional[torch.Tensor] = None
    if solver == "solve":
        try:
            if cholesky is not None:
                merged = torch.cholesky_solve(numerator.T, cholesky).T
            else:
                merged = torch.linalg.solve(system, numerator.T).T
        except RuntimeError:  # torch.linalg.LinAlgError subclasses RuntimeError
            merged = None
        if merged is None or not torch.isfinite(merged).all():
            LOG.warning("%s: Σ ω G̃ is singular; solving with the pseudo-inverse instead", name)
            used = "pinv (solve failed: singular)"
            merged = None
    elif factored.cholesky_solves:
        # No eigenvalue is anywhere near pinv's cut-off: the pseudo-inverse is the inverse,
        # and a Cholesky solve gives it at a fraction of an eigendecomposition's cost.
        merged = torch.cholesky_solve(numerator.T, cholesky).T
    if merged is None:
        if relative_ridge == 0.0:
            # only an explicit ridge: 0 gets here (auto regularises a singular system)
            LOG.warning(
                "%s: Σ ω G̃ (%d inputs) is singular or nearly so and ridge: 0 was set; taking "
                "its pseudo-inverse by an eigendecomposition (slow at large widths, and the "
                "merged weight may leave the experts' range: ridge: auto or ridge: %g "
                'regularises it; docs/methods.md, "ridge: auto")',
                name,
                system.shape[0],
                AUTO_RIDGE,
            )
        pinv, eigenvalues = _symmetric_pinv(system)
        merged = numerator @ pinv
        condition, condition_method = _condition_number(eigenvalues), "exact"
    del numerator
    if ranged and merged.dtype == torch.float64 and factored.cholesky is not None:

        def weighted_sum() -> torch.Tensor:
            if "weighted_experts" in sums:
                return sums["weighted_experts"]
            assert weighted_experts is not None, "auto's range rule needs Σ ω W_k"
            return weighted_experts()

        return finish_in_range(
            factored,
            merged,
            weighted_sum,
            norm_range,
            tokens,
            out_dtype,
            used,  # type: ignore[arg-type]
        )
    return factored_solution(
        factored, merged.to(out_dtype), tokens, used, condition, condition_method
    )


def weighted_expert_sum(
    expert_weights: Sequence[torch.Tensor], task_weights: Sequence[float]
) -> torch.Tensor:
    """``Σ_k ω_k W_k`` in float64, bit for bit as :func:`regmean_add_numerator` sums it
    (``ω · W`` rounded, then added, in task order), for the range rule of a solve whose
    sums did not carry it (no ridge, so no ``weighted_experts``)."""
    total = torch.zeros(
        expert_weights[0].shape, dtype=torch.float64, device=expert_weights[0].device
    )
    scratch = torch.empty_like(total)
    for weight, omega in zip(expert_weights, task_weights):
        total.add_(scratch.copy_(weight).mul_(omega))
    return total


def finish_in_range(
    factored: FactoredSystem,
    merged: torch.Tensor,
    weighted_experts: Callable[[], torch.Tensor],
    norm_range: NormRange,
    tokens: Optional[int],
    out_dtype: torch.dtype,
    used: Optional[str] = None,
) -> RegMeanSolution:
    """``auto``'s range rule on a dense solution (:mod:`.in_range`): ``merged`` (float64, at
    the ridge :func:`factor_regmean_system` decided) where every linear of the group is
    within ``norm_range`` as written; else the solution at the smallest larger ridge that
    brings them all back, from an eigendecomposition of the factored system (the record
    says which ridge and why). Every process that holds the same sums gets the same bytes."""
    fit = dense_ridge_in_range(
        merged,
        factored.system,
        weighted_experts(),
        factored.total_weight,
        factored.diagonal_mean,
        factored.ridge,
        norm_range,
    )
    if fit is None:
        return factored_solution(factored, merged.to(out_dtype), tokens, used)
    return _fitted_solution(factored, fit, norm_range, tokens, out_dtype, used)


def _fitted_solution(
    factored: FactoredSystem,
    fit: RangeFit,
    norm_range: NormRange,
    tokens: Optional[int],
    out_dtype: torch.dtype,
    used: Optional[str],
) -> RegMeanSolution:
    solution = factored_solution(
        factored, fit.merged.to(out_dtype), tokens, used, fit.condition, "exact"
    )
    solution.solver = f"{solution.solver}, ridge from the eigendecomposition of Σ ω G̃"
    solution.ridge = fit.ridge
    solution.ridge_reason = reason(factored.reason, fit, factored.ridge, norm_range.limit)
    solution.norm_ratio_before_ridge = fit.before
    if factored.unregularized is None:  # the first solve was unregularised
        solution.condition_number_unregularized = factored.condition
    return solution


def factored_solution(
    factored: FactoredSystem,
    merged: torch.Tensor,
    tokens: Optional[int],
    used: Optional[str] = None,
    condition: Optional[float] = None,
    condition_method: Optional[str] = None,
) -> RegMeanSolution:
    """The solution record of ``merged``, solved with ``factored`` (its solver, condition
    number and ridge unless the solve fell back to another: ``used`` and the rest)."""
    return RegMeanSolution(
        merged,
        factored.condition if condition is None else condition,
        factored.solver if used is None else used,
        factored.condition_method if condition_method is None else condition_method,
        None,
        ridge=factored.ridge,
        tokens=tokens,
        ridge_reason=factored.reason,
        condition_number_unregularized=factored.unregularized,
    )
