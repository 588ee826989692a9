"""Least-squares merging of linear layers on input Grams: the math RegMean and CoM share.

For a linear layer ``y = W x`` (PyTorch ``out x in``) with per-task input Grams
``G_k = (1/N_k) Σ_x x xᵀ``, the merge minimises ``Σ_k ω_k ‖W X_k − W_k X_k‖² / N_k``
(RegMean, Jin et al., ICLR 2023, eq. 2 with per-task means), whose solution is (eq. 3)::

    W = (Σ_k ω_k W_k G̃_k) (Σ_k ω_k G̃_k)⁻¹,
    G̃_k = α G_k + (1 − α) diag(G_k)            (the off-diagonal shrink, ``reduce_non_diagonal``)

``regmean.py`` uses it with ω_k = 1 and each expert's own Grams; ``chain_of_merges.py``
with the Grams of the already merged layers and optional task weights. The equations and
the choices behind them are in ``docs/methods.md``.

Orientation: every weight here is ``out x in``. HF ``Conv1D`` weights (GPT-2) are stored
``in x out``; the sequential executor transposes them before calling a method and back after.
Pure tensor math (float64 internally, cast back at the end): nothing here loads files,
runs models or registers a method.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Optional, Union

import torch
from pydantic import Field

from mergekit_ext.errors import CalibrationError, TensorError
from mergekit_ext.methods.guard import (
    expert_norms,
    guard_group,
    max_norm_ratio_field,
    norm_ratios,
    warn_output_errors,
)
from mergekit_ext.methods.layerwise import LinearGroup, SumReduction, TaskStatistics
from mergekit_ext.methods.parameters import (
    MethodParameters,
    StatisticsDtype,
    statistics_dtype_field,
)

LOG = logging.getLogger(__name__)

Solver = Literal["pinv", "solve"]
Fallback = Literal["mean", "base", "task_arithmetic"]

# Above this input width the covariate-shift W2 uses diagonal covariances (an in x in
# eigendecomposition per task and group would dominate the merge's cost).
FULL_COVARIANCE_W2_MAX_DIM = 1024
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
    products: Optional[list[torch.Tensor]] = None  # W_k G_k per task, when asked for
    ridge: float = 0.0  # the relative ridge applied (``auto`` resolved)
    tokens: Optional[int] = None  # calibration tokens behind Σ ω G̃ (None: not given)
    # why this ridge (``auto``: from the tokens or the condition number; else "as set")
    ridge_reason: str = "as set"
    # the condition number of Σ ω G̃ before ``auto`` added its ridge (None: no ridge added
    # by ``auto``, or the span solve, whose unregularised system is rank-deficient by count)
    condition_number_unregularized: Optional[float] = None
    # span solve: each task's ‖W X_kᵀ − W_k X_kᵀ‖²_F on the rows it solved with (None where
    # not computed: the solve did not form V H⁻¹, or the task had ω_k = 0)
    row_errors: Optional[list[Optional[float]]] = None


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
    if int(info) != 0 or not bool(torch.isfinite(factor).all()):
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
    start = torch.randn(n, width, generator=generator, dtype=torch.float64)
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
    keep_products: bool = False,
    tokens: Optional[int] = None,
    rows: Optional[Sequence[torch.Tensor]] = None,
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
      (the exact solution); the solution says which and why (``ridge_reason``).
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
    - ``keep_products``: also return each ``W_k G_k`` (for diagnostics that reuse them);
      None on the span path, which never forms them.

    The Grams, ``Σ ω G̃`` and the solve are float64; the products ``W_k G_k`` are float32
    GEMMs for float32 weights (float64 for float64 weights). The result has the dtype of
    ``expert_weights[0]``.
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
            return span_solve(
                expert_weights,
                grams,
                rows,
                reduce_non_diagonal,
                task_weights=weights,
                ridge=relative_ridge,
                tokens=tokens,
                ridge_reason=_ridge_reason(ridge, relative_ridge, n_in, tokens),
            )
    if any(g is None for g in grams):
        assert rows is not None
        grams = [_gram_of(r) if g is None else g for g, r in zip(grams, rows)]

    # The same sums and solve as the distributed reduction (LeastSquaresReduction), so one
    # process and several add and solve bit for bit alike.
    sums = regmean_zero_sums(
        shape, with_weighted_experts=isinstance(ridge, str) or relative_ridge > 0.0
    )
    products: list[torch.Tensor] = []
    for w, g, omega in zip(expert_weights, grams, weights):
        # W_k G̃_k = α W_k G_k + (1 − α) W_k diag(G_k): one GEMM, no shrunk copy of G_k.
        product = w.to(product_dtype) @ g.to(product_dtype)
        regmean_add_task(sums, w, g, reduce_non_diagonal, omega, product)
        if keep_products:
            products.append(product)
        del product
    solution = solve_regmean_sums(
        sums, ridge=ridge, solver=solver, name=name, out_dtype=out_dtype, tokens=tokens
    )
    solution.products = products if keep_products else None
    return solution


def _gram_of(rows: torch.Tensor) -> torch.Tensor:
    """``rowsᵀ rows / N`` in float64, exactly symmetric."""
    r = rows.double()
    gram = r.T @ r / r.shape[0]
    return (gram + gram.T).mul_(0.5)


def _outer_gram(rows: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """``rows @ rows.T`` (``T x T``) from its lower block triangle: about half the flops of
    one GEMM at T ≫ block, and exactly symmetric."""
    t = int(rows.shape[0])
    out = torch.empty((t, t), dtype=rows.dtype)
    for i in range(0, t, block):
        top = min(i + block, t)
        torch.mm(rows[i:top], rows[:top].T, out=out[i:top, :top])
        out[:i, i:top] = out[i:top, :i].T
        diagonal = out[i:top, i:top]
        diagonal.copy_(0.5 * (diagonal + diagonal.T))
    return out


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
    in the directions no token spans, ``W = W₀``.

    On the calibration rows, ``W Rᵀ − [W_k R_kᵀ]_k = W₀Rᵀ + V H⁻¹(H − D⁻¹) − (W₀Rᵀ + V)
    = −V H⁻¹ D⁻¹``: where ``V H⁻¹`` is formed (``out ≤ in``) each task's squared output error
    comes with it (``RegMeanSolution.row_errors``).

    Float64 throughout (``H``, its Cholesky factor, the solve and the ``out x in x T``
    products), so the bytes do not depend on the number of torch threads. The condition
    number of ``A`` is exact (dense) up to :data:`EXACT_CONDITION_MAX_DIM` inputs, estimated
    above from ``A``'s action (``Rᵀ D R q + E q``) and its inverse (by Woodbury), with no
    ``in x in`` matrix formed.
    """
    out_dtype = expert_weights[0].dtype
    # float64 throughout: BLAS splits a GEMM's reduction differently with the number of
    # threads (float32 and float64 alike); in float64 those last-bit differences do not reach
    # the float32/bf16 result, so one process and several give the same bytes
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
    e = torch.full((n_in,), strength, dtype=torch.float64)
    # At LLM widths these are GB-sized: accumulate into one float64 buffer (mixed-dtype
    # in-place ops convert on the fly) instead of a float64 copy of every expert weight.
    w0 = torch.zeros((out, n_in), dtype=torch.float64)
    for w, d, omega in zip(expert_weights, diagonals, weights):
        e.add_(d, alpha=omega * (1.0 - reduce_non_diagonal))
        if reduce_non_diagonal == 1.0:
            w0.add_(w, alpha=omega * strength / total)
        else:
            w0.addcmul_(w, omega * ((1.0 - reduce_non_diagonal) * d + strength / total))
    if not bool((e > 0.0).all()):
        raise TensorError("span_solve needs a positive E = (1 − α) Σ ω diag(G) + λ; use a ridge")
    w0.div_(e)  # W₀ = M E⁻¹

    kept = [k for k, omega in enumerate(weights) if omega > 0.0]
    r_all = torch.cat([rows[k].double() for k in kept])  # T x in
    counts = [int(rows[k].shape[0]) for k in kept]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    d_inv = torch.cat(
        [
            torch.full((c,), c / (reduce_non_diagonal * weights[k]), dtype=torch.float64)
            for k, c in zip(kept, counts)
        ]
    )
    # Vᵀ = [R_k (W_k − W₀)ᵀ]_k (T x out), each task's rows a contiguous slice
    v_t = torch.empty((int(r_all.shape[0]), out), dtype=torch.float64)
    delta = torch.empty((out, n_in), dtype=torch.float64)
    for k, a, b in zip(kept, offsets, offsets[1:]):
        delta.copy_(expert_weights[k]).sub_(w0)
        torch.mm(r_all[a:b], delta.T, out=v_t[a:b])
    del delta
    root_e = e.sqrt()
    scaled = r_all / root_e  # R E^(-1/2)
    h = _outer_gram(scaled)  # R E⁻¹ Rᵀ, exactly symmetric
    f = scaled.div_(root_e)  # R E⁻¹, in place
    del scaled
    torch.diagonal(h).add_(d_inv)
    factor = _cholesky(h)
    if factor is None:  # pragma: no cover - H ⪰ D⁻¹ > 0
        raise TensorError("span_solve: H = R E⁻¹ Rᵀ + D⁻¹ is not positive definite")
    row_errors: Optional[list[Optional[float]]] = None
    # Forming V H⁻¹ costs 2T²·out in triangular solves against 2T²·in for H⁻¹ R E⁻¹, but it
    # gives the output errors for free (below), which otherwise take an out x in x T product:
    # the cheaper of the two up to about out = 2·in (a Llama q/k/v group, not gate/up).
    if out <= 2 * n_in:
        z_t = torch.cholesky_solve(v_t, factor)  # (V H⁻¹)ᵀ, T x out
        del v_t
        w0.addmm_(z_t.T, f)  # W = W₀ + V H⁻¹ R E⁻¹, in place
        # On the calibration rows W Rᵀ − [W_k R_kᵀ]_k = −V H⁻¹ D⁻¹ (from H = R E⁻¹ Rᵀ + D⁻¹):
        # each task's output error comes free with Z, no out x in x N product
        row_errors = [None] * len(weights)
        for k, a, b in zip(kept, offsets, offsets[1:]):
            scale = (b - a) / (reduce_non_diagonal * weights[k])
            row_errors[k] = float(z_t[a:b].square().sum()) * scale * scale
        del z_t
    else:
        p = torch.cholesky_solve(f, factor)  # H⁻¹ R E⁻¹, T x in
        w0.addmm_(v_t.T, p)
        del v_t, p
    merged = w0

    d = 1.0 / d_inv
    if n_in <= EXACT_CONDITION_MAX_DIM:
        system = (r_all.T * d) @ r_all
        torch.diagonal(system).add_(e)
        eigenvalues = torch.linalg.eigvalsh(0.5 * (system + system.T))
        condition, method = _condition_number(eigenvalues), "exact"
    elif reduce_non_diagonal == 1.0:
        # E = λ I and T < in: λ_min(A) = λ exactly (A = λ I off the tokens' span) and
        # λ_max(A) = λ · λ_max(D^½ H D^½), from the T x T matrix already formed.
        root = d.sqrt()
        scaled = root[:, None] * h * root[None, :]
        condition = float(_ritz_values(lambda q: scaled @ q, lambda q: scaled @ q, len(d)).max())
        method = "estimate"
    else:
        condition = estimate_condition_number_of(
            lambda q: r_all.T @ (d[:, None] * (r_all @ q)) + e[:, None] * q,
            lambda q: q / e[:, None] - f.T @ torch.cholesky_solve(f @ q, factor),
            n_in,
        )
        method = "estimate"
    total_rows = int(r_all.shape[0])
    return RegMeanSolution(
        merged.to(out_dtype),
        condition,
        f"cholesky in the span of {total_rows} tokens",
        method,
        None,
        ridge=ridge,
        tokens=tokens if tokens is not None else total_rows,
        row_errors=row_errors,
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


def relative_output_error(
    merged_weight: torch.Tensor,
    expert_weight: torch.Tensor,
    gram: torch.Tensor,
    expert_product: Optional[torch.Tensor] = None,
) -> float:
    """``‖W X − W_k X‖_F / ‖W_k X‖_F`` from the Gram ``G = X Xᵀ / N`` alone (CoM's diagnostic).

    ``= sqrt(tr((W − W_k) G (W − W_k)ᵀ) / tr(W_k G W_kᵀ))``; 0 when both are zero, inf when
    only the expert's output is zero, NaN when a weight holds NaN. The error term is float64
    throughout (difference, product, trace) and never clamped: a float32 product cancels to
    noise when W is close to W_k. The reference (a sum of squares, no cancellation) reuses
    ``expert_product`` = ``W_k G`` when the caller has it, summed in float64. A negative
    value can only be float64 rounding of a zero error (an indefinite Gram by rounding) and
    is returned as ``-sqrt(|e| / ref)``, not hidden.
    """
    diff = merged_weight.double() - expert_weight.double()
    error = float(((diff @ gram.double()) * diff).sum())
    del diff
    if expert_product is None:
        expert_product = expert_weight.double() @ gram.double()
    reference = float((expert_product.double() * expert_weight.double()).sum(dtype=torch.float64))
    return _ratio(error, reference)


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
) -> float:
    """:func:`relative_output_error` from the inputs themselves (``rows``: ``N x in``).

    ``‖(W − W_k) Xᵀ‖_F / ‖W_k Xᵀ‖_F``: ``out x in x N`` products instead of ``out x in x in``
    ones, the cheaper form when N < in. The error term is float64 (difference and product);
    the reference in the weights' dtype (float32 for float32 weights), summed in float64.
    """
    x = rows.double()
    diff = merged_weight.double() - expert_weight.double()
    error = float((diff @ x.T).square().sum())
    del diff
    xr = rows.float() if expert_weight.dtype != torch.float64 else x
    reference = float((expert_weight.to(xr.dtype) @ xr.T).square().sum(dtype=torch.float64))
    return _ratio(error, reference)


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


# --------------------------------------------------------------------------------------
# The group driver shared with Chain of Merges
# --------------------------------------------------------------------------------------


def _all_finite(tensor: torch.Tensor) -> bool:
    """No NaN or Inf in ``tensor``: one float64 sum (a NaN or Inf entry makes it non-finite)."""
    return bool(torch.isfinite(tensor.sum(dtype=torch.float64)))


def _check_statistics(
    stats: Optional[Sequence[TaskStatistics]],
    group: LinearGroup,
    n_in: int,
    method: str,
    path: str,
    need_normalized: bool,
    need_gram: bool = True,
) -> list[TaskStatistics]:
    n_tasks = len(group.task_names)
    if stats is None:
        raise CalibrationError(
            f"{method}: no {path} statistics for linear group {group.name}; the executor must "
            "compute them (check the method's statistics_request and the calibration data)"
        )
    if len(stats) != n_tasks:
        raise CalibrationError(
            f"{method}: linear group {group.name} has {n_tasks} tasks but {len(stats)} sets of "
            f"{path} statistics"
        )
    for task, st in zip(group.task_names, stats):
        where = f"{method}: {path} statistics of task {task!r} for linear group {group.name}"
        if st is None:
            raise CalibrationError(f"{where} are missing")
        if st.count <= 0:
            raise CalibrationError(
                f"{where} were accumulated over {st.count} tokens; give that task calibration data"
            )
        if st.rows is not None and (st.rows.ndim != 2 or tuple(st.rows.shape) != (st.count, n_in)):
            st.rows = None  # not this Gram's rows (e.g. counts summed over processes)
        if st.gram is None and st.rows is None and need_gram:
            raise CalibrationError(
                f"{where} keep only moments, but the merge needs the full Gram; the executor "
                "must not apply reference_gram_max_dim to the path a merge uses"
            )
        gram_shape = tuple(st.gram.shape) if st.gram is not None else (n_in, n_in)
        if gram_shape != (n_in, n_in) or tuple(st.mean.shape) != (n_in,):
            raise CalibrationError(
                f"{where}: Gram {gram_shape} / mean {tuple(st.mean.shape)} do not fit "
                f"the group's input width {n_in}"
            )
        if (st.gram is not None and not _all_finite(st.gram)) or not _all_finite(st.mean):
            raise CalibrationError(f"{where} contain NaN or Inf (overflowing activations?)")
        if need_normalized:
            if st.gram_normalized is None:
                raise CalibrationError(
                    f"{where} lack the Gram of unit-norm inputs (gram_normalized); the executor "
                    "must honour StatisticsRequest(normalized_gram=True)"
                )
            if tuple(st.gram_normalized.shape) != (n_in, n_in):
                raise CalibrationError(
                    f"{where}: gram_normalized is {tuple(st.gram_normalized.shape)}, expected "
                    f"({n_in}, {n_in})"
                )
    return list(stats)


def _stacked_weights(group: LinearGroup, method: str) -> tuple[list[torch.Tensor], list[int], int]:
    """Each task's group weights concatenated along ``out`` (they share the input)."""
    if not group.weights:
        raise TensorError(f"{method}: linear group {group.name} lists no weights")
    n_tasks = len(group.task_names)
    if n_tasks == 0 or len(group.experts) != n_tasks:
        raise TensorError(
            f"{method}: linear group {group.name} has {len(group.experts)} expert weight sets "
            f"for {n_tasks} task names; need one per task and at least one"
        )
    n_in: Optional[int] = None
    rows: list[int] = []
    for weight_name in group.weights:
        reference = group.experts[0].get(weight_name)
        if reference is None:
            raise TensorError(
                f"{method}: task {group.task_names[0]!r} has no tensor {weight_name} "
                f"(linear group {group.name})"
            )
        if reference.ndim != 2:
            raise TensorError(
                f"{method}: {weight_name} (linear group {group.name}) is "
                f"{tuple(reference.shape)}, not a 2-D out x in linear weight"
            )
        if n_in is None:
            n_in = reference.shape[1]
        elif reference.shape[1] != n_in:
            raise TensorError(
                f"{method}: the weights of linear group {group.name} must share an input width; "
                f"{weight_name} has {reference.shape[1]}, {group.weights[0]} has {n_in}"
            )
        rows.append(reference.shape[0])
        base = group.base.get(weight_name) if group.base is not None else None
        if base is not None and base.shape != reference.shape:
            raise TensorError(
                f"shape mismatch for {weight_name}: the base model has {tuple(base.shape)}, "
                f"task {group.task_names[0]!r} has {tuple(reference.shape)}"
            )
    stacked = []
    for task, expert in zip(group.task_names, group.experts):
        parts = []
        for weight_name, n_rows in zip(group.weights, rows):
            w = expert.get(weight_name)
            if w is None:
                raise TensorError(
                    f"{method}: task {task!r} has no tensor {weight_name} (linear group {group.name})"
                )
            if tuple(w.shape) != (n_rows, n_in):
                raise TensorError(
                    f"shape mismatch for {weight_name}: task {task!r} has {tuple(w.shape)}, "
                    f"task {group.task_names[0]!r} has {(n_rows, n_in)}"
                )
            if not _all_finite(w):
                raise TensorError(f"{weight_name} of task {task!r} contains NaN or Inf values")
            parts.append(w)
        stacked.append(torch.cat(parts, dim=0))
    assert n_in is not None
    return stacked, rows, n_in


def _kept_rows(st: TaskStatistics) -> Optional[torch.Tensor]:
    """The task's kept input rows when they are its Gram's rows, else None."""
    return st.rows if st.rows is not None and st.rows.shape[0] == st.count else None


def _task_output_error(
    merged: torch.Tensor,
    weight: torch.Tensor,
    st: TaskStatistics,
    raw_gram: Optional[torch.Tensor],
    product: Optional[torch.Tensor],
) -> float:
    """One task's relative output error, on the raw inputs, of ``merged`` as written: from
    its kept rows where no product ``W_k G_k`` of the raw Gram was formed (span solve,
    normalized Gram), else from ``raw_gram`` (formed from the rows when None) and
    ``product``."""
    rows = _kept_rows(st)
    if product is None and rows is not None:
        return relative_output_error_rows(merged, weight, rows)
    gram = raw_gram if raw_gram is not None else st.gram_from_rows()
    return relative_output_error(merged, weight, gram, product)  # type: ignore[arg-type]


def _token_rows(stats: Sequence[TaskStatistics]) -> Optional[list[torch.Tensor]]:
    """Every task's kept input rows (``TaskStatistics.rows``), or None unless all have them.

    Rows whose count differs from the statistics' token count (statistics reduced from
    several processes, say) are not the Gram's rows: then None, and the Gram path is used.
    """
    rows = [st.rows for st in stats]
    if any(r is None or r.shape[0] != st.count for r, st in zip(rows, stats)):
        return None
    return rows  # type: ignore[return-value]


def merge_group_least_squares(
    group: LinearGroup,
    *,
    method: str,
    reduce_non_diagonal: float,
    ridge: Ridge,
    solver: Solver,
    use_merged_path: bool,
    use_normalized_gram: bool,
    task_weight: Optional[Callable[[TaskStatistics], float]] = None,
    task_weight_needs_normalized_gram: bool = False,
    task_weighting_label: str = "uniform",
    full_covariance_max_dim: int = FULL_COVARIANCE_W2_MAX_DIM,
    max_norm_ratio: float = math.inf,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Merge one :class:`LinearGroup` by (weighted) RegMean; shared by RegMean and CoM.

    - ``use_merged_path``: Grams from ``group.merged_stats`` (CoM ``propagate``) instead of
      ``group.expert_stats`` (RegMean).
    - ``use_normalized_gram``: solve with ``gram_normalized`` (CoM ``normalize``).
    - ``task_weight``: ω_k from the task's statistics on the chosen path (None: ω_k = 1);
      ``task_weight_needs_normalized_gram`` when it reads ``gram_normalized``.

    The relative output error is measured on the merged weights as written (cast to
    ``group.output_dtypes``), on the raw Gram of the chosen path (the inputs the objective
    used); the covariate shift W2 whenever ``merged_stats`` are present. The result guard
    (:mod:`~mergekit_ext.methods.guard`) then compares each merged linear's norm with the
    experts' and stops the merge above ``max_norm_ratio`` (None: never).
    """
    stacked, rows, n_in = _stacked_weights(group, method)
    path = "merged-path" if use_merged_path else "expert-path"
    # Statistics the objective uses; the expert path is checked too when W2 needs it.
    chosen = _check_statistics(
        group.merged_stats if use_merged_path else group.expert_stats,
        group,
        n_in,
        method,
        path,
        need_normalized=use_normalized_gram or task_weight_needs_normalized_gram,
    )
    # W2 compares the two paths of the same task; either may be absent (then no W2).
    if use_merged_path:
        merged_path: Optional[list[TaskStatistics]] = chosen
        expert_path = (
            _check_statistics(
                group.expert_stats, group, n_in, method, "expert-path", False, need_gram=False
            )
            if group.expert_stats
            else None
        )
    else:
        expert_path = chosen
        merged_path = (
            _check_statistics(
                group.merged_stats, group, n_in, method, "merged-path", False, need_gram=False
            )
            if group.merged_stats
            else None
        )

    omegas = [float(task_weight(st)) if task_weight else 1.0 for st in chosen]
    if sum(omegas) <= 0.0:
        raise TensorError(
            f"{method}: all task weights are zero for linear group {group.name} ({omegas}); "
            "use task_weighting: uniform"
        )
    # raw Grams may be None where the rows were kept instead (regmean_solve forms them if needed)
    grams = [st.gram_normalized if use_normalized_gram else st.gram for st in chosen]
    # The rank of Σ ω G̃ is at most the tokens behind it (tasks with ω > 0)
    tokens = sum(st.count for st, omega in zip(chosen, omegas) if omega > 0.0)
    raw_rows = _token_rows(chosen)
    span = raw_rows is not None and span_solve_applies(
        reduce_non_diagonal, resolve_ridge(ridge, n_in, tokens), tokens, n_in
    )
    if not span:
        # The n x n solve: the Gram of each task that kept rows, bit for bit as accumulated
        grams = [g if g is not None else st.gram_from_rows() for g, st in zip(grams, chosen)]
    solve_rows = raw_rows
    if raw_rows is not None and use_normalized_gram:
        solve_rows = [
            r / r.norm(dim=1, keepdim=True).clamp_min(torch.finfo(r.dtype).tiny) for r in raw_rows
        ]
    solution = regmean_solve(
        stacked,
        grams,  # type: ignore[arg-type]  # checked non-None above
        reduce_non_diagonal,
        task_weights=omegas,
        ridge=ridge,
        solver=solver,
        name=f"linear group {group.name}",
        keep_products=not use_normalized_gram,  # W_k G_k of the diagnostic's own Gram
        tokens=tokens,
        rows=solve_rows,
    )
    del solve_rows
    merged_parts = torch.split(solution.merged_weight, rows, dim=0)
    merged = {
        weight_name: part.to(group.experts[0][weight_name].dtype).contiguous()
        for weight_name, part in zip(group.weights, merged_parts)
    }
    # The diagnostics describe the model that ships: the weights rounded as written
    written = {w: group.as_written(w, merged[w]) for w in group.weights}
    written_weight = torch.cat([written[w] for w in group.weights])
    guard = guard_group(
        method,
        group.name,
        norm_ratios(written, expert_norms(group.experts, group.weights)),
        max_norm_ratio,
    )

    tasks: dict[str, dict[str, Any]] = {}
    shift_kind: Optional[str] = None
    for k, task in enumerate(group.task_names):
        shift: Optional[float] = None
        if merged_path is not None and expert_path is not None:
            shift, shift_kind = covariate_shift_w2(
                merged_path[k], expert_path[k], full_covariance_max_dim=full_covariance_max_dim
            )
        output_error = _task_output_error(
            written_weight,
            stacked[k],
            chosen[k],
            None if use_normalized_gram else grams[k],
            solution.products[k] if solution.products is not None else None,
        )
        tasks[task] = {
            "weight": omegas[k],
            "relative_output_error": output_error,
            "covariate_shift_w2": shift,
        }
    warn_output_errors(
        method, group.name, {t: rec["relative_output_error"] for t, rec in tasks.items()}
    )
    diagnostics: dict[str, Any] = {
        "layer": group.name,
        **_solve_record(solution, ridge),
        "reduce_non_diagonal": float(reduce_non_diagonal),
        "tokens": tokens,
        "input_width": n_in,
        "statistics": "merged_path" if use_merged_path else "expert_path",
        "normalized_gram": bool(use_normalized_gram),
        "task_weighting": task_weighting_label,
        "covariate_shift_covariance": shift_kind,
        **guard,
        "tasks": tasks,
    }
    return merged, diagnostics


def _solve_record(solution: RegMeanSolution, ridge: Ridge) -> dict[str, Any]:
    """The group record's fields on the solve: conditioning, solver, ridge and why."""
    return {
        "condition_number": solution.condition_number,
        "condition_number_method": solution.condition_number_method,
        "condition_number_unregularized": solution.condition_number_unregularized,
        "solver": solution.solver,
        "ridge": solution.ridge,
        "ridge_setting": ridge if isinstance(ridge, str) else float(ridge),
        "ridge_reason": solution.ridge_reason,
    }


# --------------------------------------------------------------------------------------
# Several processes: the same merge from sums over disjoint task sets
# --------------------------------------------------------------------------------------


def regmean_zero_sums(
    shape: Sequence[int], *, with_weighted_experts: bool = False, device: Any = None
) -> dict[str, torch.Tensor]:
    """The accumulators of :func:`regmean_solve`'s sums (float64 zeros), for
    :func:`regmean_add_task`: ``numerator`` (out x in), ``system`` (in x in),
    ``system_diagonal`` (in), ``task_weight_sum`` (1), ``tokens`` (1) and, for a ridge,
    ``weighted_experts``."""
    out, n_in = int(shape[0]), int(shape[1])
    zeros = dict(dtype=torch.float64, device=device)
    sums = {
        "numerator": torch.zeros((out, n_in), **zeros),
        "system": torch.zeros((n_in, n_in), **zeros),
        "system_diagonal": torch.zeros(n_in, **zeros),
        "task_weight_sum": torch.zeros(1, **zeros),
        "tokens": torch.zeros(1, **zeros),  # Σ N_k over tasks with ω_k > 0 (for ridge: auto)
    }
    if with_weighted_experts:
        sums["weighted_experts"] = torch.zeros((out, n_in), **zeros)
    return sums


def regmean_add_task(
    sums: dict[str, torch.Tensor],
    weight: torch.Tensor,
    gram: torch.Tensor,
    reduce_non_diagonal: float,
    omega: float,
    product: Optional[torch.Tensor] = None,
    count: int = 0,
) -> None:
    """Add one task's terms to the sums, in place: ``ω (α W G + (1 − α) W diag(G))`` to the
    numerator, ``ω (α G + (1 − α) diag(G))`` to the system (its diagonal part kept apart),
    ``ω``, ``ω W`` and (ω > 0) the task's token count ``count``.

    The same operations in the same order as :func:`regmean_solve`'s loop, so adding the
    tasks in order gives its sums bit for bit; ``product`` is ``W G`` when already computed
    (as :func:`regmean_solve` forms it: float32 for float32 weights).
    """
    if product is None:
        product_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        product = weight.to(product_dtype) @ gram.to(product_dtype)
    diagonal = torch.diagonal(gram).double()
    sums["numerator"].add_(product.double(), alpha=omega * reduce_non_diagonal)
    sums["numerator"].add_(weight.double() * diagonal, alpha=omega * (1.0 - reduce_non_diagonal))
    sums["system"].add_(gram.double(), alpha=omega * reduce_non_diagonal)
    sums["system_diagonal"].add_(diagonal, alpha=omega * (1.0 - reduce_non_diagonal))
    sums["task_weight_sum"].add_(omega)
    if omega > 0.0:
        sums["tokens"].add_(float(count))
    if "weighted_experts" in sums:
        sums["weighted_experts"].add_(omega * weight.double())


def solve_regmean_sums(
    sums: dict[str, torch.Tensor],
    *,
    ridge: Ridge = 0.0,
    solver: Solver = "pinv",
    name: str = "<weight>",
    out_dtype: torch.dtype = torch.float32,
    tokens: Optional[int] = None,
) -> RegMeanSolution:
    """``W = numerator · system⁻¹`` from the sums of :func:`regmean_add_task`.

    The one dense solve of every least-squares merge (:func:`regmean_solve` and the
    distributed :class:`LeastSquaresReduction`). ``ridge``: a relative ridge, or ``"auto"``:
    :data:`AUTO_RIDGE` when ``tokens`` is below the input width, or when the unregularised
    system is singular or its condition number exceeds :data:`AUTO_RIDGE_MAX_CONDITION`
    (:func:`auto_ridge_needed`), else exactly 0. ``auto`` needs ``sums["weighted_experts"]``.
    ``tokens`` is recorded in the solution. The ``solver`` choice is :func:`regmean_solve`'s.
    """
    if float(sums["task_weight_sum"].sum()) <= 0.0:
        raise TensorError(f"{name}: the task weights are all zero; use task_weighting: uniform")
    numerator = sums["numerator"].double().clone()
    system = sums["system"].double().clone()
    n_in = system.shape[0]
    auto = isinstance(ridge, str)
    relative_ridge = resolve_ridge(ridge, n_in, tokens)
    reason = _ridge_reason(ridge, relative_ridge, n_in, tokens)
    torch.diagonal(system).add_(sums["system_diagonal"].double())
    system = 0.5 * (system + system.T)  # exact symmetry for eigh

    def add_ridge(value: float) -> None:
        nonlocal numerator
        strength = value * float(torch.diagonal(system).mean())
        torch.diagonal(system).add_(strength)
        numerator += (strength / float(sums["task_weight_sum"].sum())) * sums[
            "weighted_experts"
        ].double()

    if relative_ridge > 0.0:
        add_ridge(relative_ridge)

    n_eps = n_in * torch.finfo(torch.float64).eps
    cholesky = _cholesky(system)
    if cholesky is None and solver == "pinv" and not auto:
        # pinv's eigh below gives the condition number: no eigvalsh of the same matrix first
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
    elif cholesky is not None and condition * n_eps < _CHOLESKY_PINV_MARGIN:
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
                n_in,
                AUTO_RIDGE,
            )
        pinv, eigenvalues = _symmetric_pinv(system)
        merged = numerator @ pinv
        condition, condition_method = _condition_number(eigenvalues), "exact"
    return RegMeanSolution(
        merged.to(out_dtype),
        condition,
        used,
        condition_method,
        None,
        ridge=relative_ridge,
        tokens=tokens,
        ridge_reason=reason,
        condition_number_unregularized=unregularized,
    )


class LeastSquaresReduction(SumReduction):
    """:func:`merge_group_least_squares` split over processes (:class:`SumReduction`).

    Takes the same settings. Each rank computes its tasks' products ``W_k G_k`` and adds
    its tasks' terms of ``Σ ω_k W_k G̃_k``, ``Σ ω_k G̃_k``, ``Σ ω_k`` (and ``Σ ω_k W_k`` with
    a ridge) when the sums reach it in task order, so they equal :func:`regmean_solve`'s
    bit for bit; the correlation weight ω_k needs only task k's own normalized Gram, so it
    is computed where the task lives. The
    per-task diagnostics (relative output error, covariate shift) are computed by the
    task's rank once the merged weights are known; the group record is the one
    :func:`merge_group_least_squares` writes.
    """

    def __init__(
        self,
        *,
        method: str,
        reduce_non_diagonal: float,
        ridge: Ridge,
        solver: Solver,
        use_merged_path: bool,
        use_normalized_gram: bool,
        task_weight: Optional[Callable[[TaskStatistics], float]] = None,
        task_weight_needs_normalized_gram: bool = False,
        task_weighting_label: str = "uniform",
        full_covariance_max_dim: int = FULL_COVARIANCE_W2_MAX_DIM,
        max_norm_ratio: float = math.inf,
    ) -> None:
        self.method = method
        self.max_norm_ratio = max_norm_ratio
        self.reduce_non_diagonal = reduce_non_diagonal
        self.ridge = ridge
        self.solver = solver
        self.use_merged_path = use_merged_path
        self.use_normalized_gram = use_normalized_gram
        self.task_weight = task_weight
        self.task_weight_needs_normalized_gram = task_weight_needs_normalized_gram
        self.task_weighting_label = task_weighting_label
        self.full_covariance_max_dim = full_covariance_max_dim
        self._stacked: list[torch.Tensor] = []
        self._rows: list[int] = []
        self._chosen: list[TaskStatistics] = []
        self._other: Optional[list[TaskStatistics]] = None
        self._omegas: list[float] = []
        self._grams: list[torch.Tensor] = []
        self._products: list[torch.Tensor] = []
        self._norms: list[torch.Tensor] = []

    def _paths(self, group: LinearGroup, n_in: int) -> None:
        path = "merged-path" if self.use_merged_path else "expert-path"
        self._chosen = _check_statistics(
            group.merged_stats if self.use_merged_path else group.expert_stats,
            group,
            n_in,
            self.method,
            path,
            need_normalized=self.use_normalized_gram or self.task_weight_needs_normalized_gram,
        )
        other, other_path = (
            (group.expert_stats, "expert-path")
            if self.use_merged_path
            else (group.merged_stats, "merged-path")
        )
        self._other = (
            _check_statistics(other, group, n_in, self.method, other_path, False, need_gram=False)
            if other
            else None
        )

    def _setup(self, group: LinearGroup) -> None:
        """This rank's weights, checked statistics and task weights (once per group)."""
        if self._chosen:
            return
        self._stacked, self._rows, n_in = _stacked_weights(group, self.method)
        self._paths(group, n_in)
        self._omegas = [
            float(self.task_weight(st)) if self.task_weight else 1.0 for st in self._chosen
        ]
        if any(not math.isfinite(w) or w < 0.0 for w in self._omegas):
            raise TensorError(
                f"{self.method}: task weights must be finite and non-negative for linear group "
                f"{group.name}; got {self._omegas}"
            )

    def gather_vote(self, group: LinearGroup) -> dict[str, Any]:
        self._setup(group)
        return {
            "rows": _token_rows(self._chosen) is not None,
            "tokens": sum(st.count for st, w in zip(self._chosen, self._omegas) if w > 0.0),
            "inputs": int(self._stacked[0].shape[1]),
        }

    def needs_gather(self, votes: Sequence[Any]) -> bool:
        # The span solve (every task kept its rows and all tasks together have fewer tokens
        # than inputs, with a ridge) needs every task's rows on one rank; the dense solve
        # needs only the sums, each task's Gram formed from its rows where it kept them.
        tokens = sum(v["tokens"] for v in votes)
        n_in = votes[0]["inputs"]
        return all(v["rows"] for v in votes) and span_solve_applies(
            self.reduce_non_diagonal, resolve_ridge(self.ridge, n_in, tokens), tokens, n_in
        )

    def prepare(self, group: LinearGroup) -> dict[str, torch.Tensor]:
        self._setup(group)
        # A task that kept its rows gets its Gram formed from them, bit for bit as the
        # single process's dense path forms it
        self._grams = [
            st.gram_normalized if self.use_normalized_gram else st.gram_from_rows()  # type: ignore[misc]
            for st in self._chosen
        ]
        product_dtype = torch.float64 if self._stacked[0].dtype == torch.float64 else torch.float32
        # The GEMMs W_k G_k of this rank's tasks, in parallel with the other ranks'.
        self._products = [
            w.to(product_dtype) @ g.to(product_dtype) for w, g in zip(self._stacked, self._grams)
        ]
        # each task's weight norms (per weight of the group), for the result guard
        self._norms = [
            torch.stack(
                [
                    torch.linalg.vector_norm(part, dtype=torch.float64)
                    for part in torch.split(w, self._rows, dim=0)
                ]
            )
            for w in self._stacked
        ]
        sums = regmean_zero_sums(
            self._stacked[0].shape,
            # auto is resolved in solve from the tokens of every task
            with_weighted_experts=isinstance(self.ridge, str) or float(self.ridge) > 0.0,
            device=self._stacked[0].device,
        )
        sums["expert_norm_max"] = torch.zeros(
            len(self._rows), dtype=torch.float64, device=self._stacked[0].device
        )
        return sums

    def add_task(self, sums: dict[str, torch.Tensor], position: int) -> None:
        regmean_add_task(
            sums,
            self._stacked[position],
            self._grams[position],
            self.reduce_non_diagonal,
            self._omegas[position],
            self._products[position],
            count=self._chosen[position].count,
        )
        # a running max, not a sum: the largest expert's norm per weight
        torch.maximum(sums["expert_norm_max"], self._norms[position], out=sums["expert_norm_max"])

    def solve(
        self, sums: Mapping[str, torch.Tensor], group: LinearGroup
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        if not self._rows:
            self._stacked, self._rows, _ = _stacked_weights(group, self.method)
        reference = group.experts[0]
        n_in = int(sums["system"].shape[0])
        tokens = int(round(float(sums["tokens"].sum())))
        reference_norms = sums["expert_norm_max"].tolist()
        solution = solve_regmean_sums(
            {k: v for k, v in sums.items() if k != "expert_norm_max"},
            ridge=self.ridge,
            tokens=tokens,
            solver=self.solver,
            name=f"linear group {group.name}",
            out_dtype=reference[group.weights[0]].dtype,
        )
        parts = torch.split(solution.merged_weight, self._rows, dim=0)
        merged = {
            weight_name: part.to(reference[weight_name].dtype).contiguous()
            for weight_name, part in zip(group.weights, parts)
        }
        guard = guard_group(
            self.method,
            group.name,
            norm_ratios(
                {w: group.as_written(w, merged[w]) for w in group.weights},
                dict(zip(group.weights, reference_norms)),
            ),
            self.max_norm_ratio,
        )
        shift_kind: Optional[str] = None
        if self._other is not None and self._chosen:
            merged_path, expert_path = (
                (self._chosen[0], self._other[0])
                if self.use_merged_path
                else (self._other[0], self._chosen[0])
            )
            shift_kind = shift_covariance(merged_path, expert_path, self.full_covariance_max_dim)
        diagnostics: dict[str, Any] = {
            "layer": group.name,
            **_solve_record(solution, self.ridge),
            "reduce_non_diagonal": float(self.reduce_non_diagonal),
            "tokens": tokens,
            "input_width": n_in,
            "statistics": "merged_path" if self.use_merged_path else "expert_path",
            "normalized_gram": bool(self.use_normalized_gram),
            "task_weighting": self.task_weighting_label,
            "covariate_shift_covariance": shift_kind,
            **guard,
            "tasks": {},
        }
        return merged, diagnostics

    def task_diagnostics(
        self, group: LinearGroup, merged: Mapping[str, torch.Tensor]
    ) -> dict[str, dict[str, Any]]:
        # as written (the shared weights were broadcast in float32 before the cast)
        merged_weight = torch.cat(
            [group.as_written(w, merged[w].to(self._stacked[0].dtype)) for w in group.weights]
        )
        tasks: dict[str, dict[str, Any]] = {}
        for k, task in enumerate(group.task_names):
            shift: Optional[float] = None
            # W_k G_k of the diagnostic's own (raw) Gram, as the single process does
            output_error = _task_output_error(
                merged_weight,
                self._stacked[k],
                self._chosen[k],
                None if self.use_normalized_gram else self._grams[k],
                None if self.use_normalized_gram else self._products[k],
            )
            if self._other is not None:
                merged_path, expert_path = (
                    (self._chosen[k], self._other[k])
                    if self.use_merged_path
                    else (self._other[k], self._chosen[k])
                )
                shift, _ = covariate_shift_w2(
                    merged_path, expert_path, full_covariance_max_dim=self.full_covariance_max_dim
                )
            tasks[task] = {
                "weight": self._omegas[k],
                "relative_output_error": output_error,
                "covariate_shift_w2": shift,
            }
        warn_output_errors(
            self.method, group.name, {t: r["relative_output_error"] for t, r in tasks.items()}
        )
        return tasks


# --------------------------------------------------------------------------------------
# The parameters every least-squares method shares
# --------------------------------------------------------------------------------------


# The sweep behind reduce_non_diagonal's default (benchmarks/sweep.py; README, "Benchmark results")
ALPHA_EVIDENCE = (
    " (default chosen by a sweep over 0.5, 0.8, 0.9, 0.95, 1.0: best for chain_of_merges and "
    "regmean on the text and vision suites, equal or better than 0.95 on the text-LoRA and LM "
    'suites; docs/methods.md, section "RegMean")'
)


class RegMeanParameters(MethodParameters):
    """RegMean's parameters, shared by every least-squares method (``docs/methods.md``)."""

    reduce_non_diagonal: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="α of the off-diagonal shrink G̃ = α G + (1 − α) diag(G); 1 keeps the Gram, "
        "0 gives a per-column average weighted by diag(G)" + ALPHA_EVIDENCE,
    )
    ridge: Union[Literal["auto"], Annotated[float, Field(ge=0.0, allow_inf_nan=False)]] = Field(
        "auto",
        description="Tikhonov term toward the experts' mean: adds ridge · mean(diag(Σ ω G̃)) · I "
        "to the inverted matrix (and the matching term to the numerator); auto: "
        f"{AUTO_RIDGE:g} for a group whose calibration tokens are fewer than its inputs (a "
        "rank-deficient Gram: unseen directions keep the experts' mean instead of 0, and the "
        "solve runs in the span of the tokens), exactly 0 otherwise (outputs as with ridge: 0)",
    )
    solver: Solver = Field(
        "pinv",
        description="pinv (Moore–Penrose pseudo-inverse: a Cholesky solve where it equals the "
        "inverse, eigh otherwise) | solve (Cholesky or LU; falls back to pinv when singular)",
    )
    fallback: Fallback = Field(
        "mean",
        description="merge of biases, norms, embeddings and heads: mean | base | task_arithmetic",
    )
    statistics_dtype: StatisticsDtype = statistics_dtype_field()
    max_norm_ratio: float = max_norm_ratio_field()
