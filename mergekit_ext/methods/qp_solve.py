"""The QP math both ``qp_projection`` objectives share: the normal equations of
``J(d) = Σ_t ‖Σ_k d_k U_kᵀ Δ_k x − R_t x‖²`` per output basis, the batched (box-constrained)
solve, and one weight's solve, diagnostics and merge. Pure tensor functions; the
equations are in ``docs/methods.md`` (``qp_projection``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch

from mergekit_ext.errors import ConfigError, TensorError

LOG = logging.getLogger(__name__)


BasisKind = Literal["diagonal", "residual_eigen"]
FallbackKind = Literal["mean", "base", "task_arithmetic"]
BASES: tuple[str, ...] = ("diagonal", "residual_eigen")
FALLBACKS: tuple[str, ...] = ("mean", "base", "task_arithmetic")
TASK_WEIGHTINGS: tuple[str, ...] = ("samples", "energy")

_COMPUTE_DTYPE = torch.float64
# Elements of one [K, rows, in] block of rotated task vectors (float64: 256 MiB).
_CHUNK_ELEMENTS = 1 << 25
# --------------------------------------------------------------------------------------
# Pure tensor functions
# --------------------------------------------------------------------------------------


@dataclass
class QPNormalEquations:
    """The per-direction pieces of J for one weight (see the module docstring).

    - ``normal``: ``[R, K, K]``, ``N_r = Σ_j w_j a_j a_jᵀ``
    - ``rhs``: ``[R, K]``, ``h_r = −Σ_j w_j a_j c_j``
    - ``energy``: ``[R]``, ``e_r = Σ_j w_j c_j²`` (sums to ``J(0)``)
    - ``basis``: ``out x R`` orthonormal columns ``u_r``; None for the identity (``diagonal``)
    - ``basis_kind``: ``"diagonal"`` or ``"residual_eigen"``
    """

    normal: torch.Tensor
    rhs: torch.Tensor
    energy: torch.Tensor
    basis: Optional[torch.Tensor]
    basis_kind: str

    @property
    def num_directions(self) -> int:
        return int(self.normal.shape[0])

    @property
    def num_updates(self) -> int:
        return int(self.normal.shape[-1])


def residual_energy_matrix(
    residual_maps: Sequence[torch.Tensor], grams: Sequence[torch.Tensor]
) -> torch.Tensor:
    """``S = Σ_t R_t G_t R_tᵀ = Σ_j w_j b_j b_jᵀ`` (out x out, float64), ``R_t = W_0 − W_t``."""
    _check_pairs(residual_maps, grams)
    out = residual_maps[0].shape[0]
    energy = torch.zeros(out, out, dtype=_COMPUTE_DTYPE, device=residual_maps[0].device)
    for residual_map, gram in zip(residual_maps, grams):
        r = residual_map.to(_COMPUTE_DTYPE)
        energy += (r @ gram.to(dtype=_COMPUTE_DTYPE, device=r.device)) @ r.T
    return (energy + energy.T) / 2  # exact symmetry for eigh


def output_basis(
    basis_name: str, residual_maps: Sequence[torch.Tensor], grams: Sequence[torch.Tensor]
) -> Optional[torch.Tensor]:
    """The output basis ``U``: None (identity) for ``diagonal``; for ``residual_eigen`` the
    eigenvectors of :func:`residual_energy_matrix` as columns, eigenvalues descending."""
    if basis_name == "diagonal":
        return None
    if basis_name == "residual_eigen":
        _, vectors = torch.linalg.eigh(residual_energy_matrix(residual_maps, grams))
        return vectors.flip(-1).contiguous()
    raise ConfigError(f"qp_projection basis must be one of {', '.join(BASES)}; got {basis_name!r}")


def _rotate(basis_cols: Optional[torch.Tensor], matrix: torch.Tensor, rows: slice) -> torch.Tensor:
    """``U[:, rows]ᵀ matrix`` in float64 (for the identity basis: ``matrix[rows]``)."""
    if basis_cols is None:
        return matrix[rows].to(_COMPUTE_DTYPE)
    return basis_cols[:, rows].T @ matrix.to(_COMPUTE_DTYPE)


def qp_normal_equations(
    task_vectors: Sequence[torch.Tensor],
    grams: Sequence[torch.Tensor],
    *,
    residual_maps: Optional[Sequence[torch.Tensor]] = None,
    basis: Optional[torch.Tensor] = None,
    basis_kind: Optional[str] = None,
    chunk_rows: Optional[int] = None,
) -> QPNormalEquations:
    """Build ``N_r``, ``h_r`` and ``e_r`` for every basis direction r, batched.

    ``task_vectors``: the K updates ``Δ_k`` (out x in). ``grams``: the T per-task mean Grams
    ``G_t`` (in x in). ``residual_maps``: ``R_t = W_0 − W_t`` per task; default ``−Δ_t``
    (then T must equal K). ``basis``: ``out x R`` orthonormal columns, None for ``U = I``.

    With ``P_k = Uᵀ Δ_k`` and ``Q_t = Uᵀ R_t`` (R x in), row r of each is ``u_rᵀ Δ_k`` / ``u_rᵀ R_t``:
    ``N[r,k,l] = Σ_p P_k[r,p] (P_l G)[r,p]``, ``C[r,k,t] = Σ_p P_k[r,p] (Q_t G_t)[r,p]``,
    ``h = −Σ_t C[:, :, t]``, ``e[r] = Σ_t Σ_p Q_t[r,p] (Q_t G_t)[r,p]``. Cost: ``K + T``
    matrix products ``(R x in)(in x in)`` (plus the rotations for a non-identity basis).
    Directions are processed in blocks of ``chunk_rows`` to bound memory (not a row loop).
    """
    if not task_vectors:
        raise TensorError("the QP needs at least one task vector")
    negated_updates = residual_maps is None  # the method's case: R_t = W_0 − W_t = −Δ_t
    if negated_updates:
        if len(grams) != len(task_vectors):
            raise TensorError(
                f"{len(task_vectors)} task vectors but {len(grams)} task Grams: one Gram per expert's task"
            )
        _check_pairs(task_vectors, grams)
    else:
        _check_pairs(residual_maps, grams)
    out_dim, in_dim = task_vectors[0].shape
    for tensor in [*task_vectors, *(residual_maps or [])]:
        if tensor.shape != (out_dim, in_dim):
            raise TensorError(
                f"QP weights must all be {out_dim} x {in_dim}; got {tuple(tensor.shape)}"
            )
    grams64 = [g.to(dtype=_COMPUTE_DTYPE, device=task_vectors[0].device) for g in grams]
    gram_total = torch.stack(grams64).sum(0)
    basis64 = None if basis is None else basis.to(_COMPUTE_DTYPE)
    num_dirs = out_dim if basis64 is None else basis64.shape[1]
    if basis64 is not None and basis64.shape[0] != out_dim:
        raise TensorError(f"basis has {basis64.shape[0]} rows; the weights have {out_dim} outputs")
    k_updates, t_tasks = len(task_vectors), len(grams64)
    if chunk_rows is None:
        chunk_rows = max(1, _CHUNK_ELEMENTS // (max(k_updates, t_tasks) * in_dim))

    device = task_vectors[0].device
    normal = torch.empty(num_dirs, k_updates, k_updates, dtype=_COMPUTE_DTYPE, device=device)
    rhs = torch.empty(num_dirs, k_updates, dtype=_COMPUTE_DTYPE, device=device)
    energy = torch.empty(num_dirs, dtype=_COMPUTE_DTYPE, device=device)
    for start in range(0, num_dirs, chunk_rows):
        rows = slice(start, min(start + chunk_rows, num_dirs))
        rotated_updates = torch.stack([_rotate(basis64, tv, rows) for tv in task_vectors])  # P_k
        for l_idx in range(k_updates):
            weighted = rotated_updates[l_idx] @ gram_total  # rows of U^T Δ_l G
            normal[rows, :, l_idx] = torch.einsum("kcp,cp->ck", rotated_updates, weighted)
        cross = torch.zeros(rows.stop - start, k_updates, dtype=_COMPUTE_DTYPE, device=device)
        chunk_energy = torch.zeros(rows.stop - start, dtype=_COMPUTE_DTYPE, device=device)
        for t_idx in range(t_tasks):
            if negated_updates:
                rotated_residual = -rotated_updates[t_idx]  # Q_t = U^T R_t = −P_t
            else:
                rotated_residual = _rotate(basis64, residual_maps[t_idx], rows)
            weighted = rotated_residual @ grams64[t_idx]  # rows of U^T R_t G_t
            cross += torch.einsum("kcp,cp->ck", rotated_updates, weighted)
            chunk_energy += (rotated_residual * weighted).sum(-1)
        rhs[rows] = -cross
        energy[rows] = chunk_energy
    normal = (normal + normal.transpose(-1, -2)) / 2
    name = basis_kind or ("diagonal" if basis is None else "custom")
    return QPNormalEquations(normal, rhs, energy, basis64, name)


def ridge_strength(normal: torch.Tensor, ridge: float) -> float:
    """``μ = ridge · mean_{r,k} N_r[k,k]``: a relative ridge, so a given value has the same
    effect whatever the scale of the weights and activations. 0 when every ``N_r`` is 0."""
    if ridge < 0 or not math.isfinite(ridge):
        raise ConfigError(f"qp_projection ridge must be a finite number >= 0; got {ridge}")
    mean_diagonal = float(normal.diagonal(dim1=-2, dim2=-1).mean()) if normal.numel() else 0.0
    return ridge * max(mean_diagonal, 0.0)


def solve_symmetric_batched(matrices: torch.Tensor, rhs: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Solve ``M_b x_b = y_b`` for a batch ``[B, K, K]`` of symmetric PSD matrices.

    ``torch.linalg.solve_ex`` for the batch; matrices that are singular to working precision
    (LU failure, non-finite result, or ``λ_min ≤ 10·K·eps·λ_max``) get the Moore–Penrose
    pseudo-inverse solution (minimum-norm least squares) instead. Returns ``(x, n_fallback)``.
    """
    if matrices.shape[0] == 0:
        return rhs.clone(), 0
    solution, info = torch.linalg.solve_ex(matrices, rhs.unsqueeze(-1))
    solution = solution.squeeze(-1)
    eigenvalues = torch.linalg.eigvalsh(matrices)
    threshold = 10 * matrices.shape[-1] * torch.finfo(matrices.dtype).eps
    ill = eigenvalues[:, 0] <= threshold * eigenvalues[:, -1].clamp_min(0)
    bad = (info != 0) | ~torch.isfinite(solution).all(-1) | ill
    n_bad = int(bad.sum())
    if n_bad:
        pinv = torch.linalg.pinv(matrices[bad], hermitian=True)
        solution[bad] = (pinv @ rhs[bad].unsqueeze(-1)).squeeze(-1)
    return solution, n_bad


@dataclass
class BoxQPInfo:
    iterations: int
    unconverged: int  # directions whose scaled KKT residual is above ``tol`` (round-off stalls)
    max_kkt: float  # the largest scaled KKT residual ``‖d − clip(d − g/diag M)‖∞``


def _quadratic(matrices: torch.Tensor, rhs: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``½ dᵀ M d − yᵀ d`` per batch element."""
    return 0.5 * torch.einsum("bk,bkl,bl->b", d, matrices, d) - (rhs * d).sum(-1)


def solve_box_qp(
    matrices: torch.Tensor,
    rhs: torch.Tensor,
    lo: float,
    hi: float,
    *,
    max_iter: int = 100,
    tol: float = 1e-10,
) -> tuple[torch.Tensor, BoxQPInfo]:
    """``min ½ dᵀ M d − yᵀ d`` s.t. ``lo ≤ d ≤ hi``, for a batch ``[B, K, K]`` of PSD ``M``.

    Batched projected Newton (Bertsekas, "Projected Newton methods for optimization problems
    with simple constraints", SIAM J. Control Optim. 20(2), 1982): at each step the ε-binding
    set ``{d_i ≤ lo+ε, g_i > 0} ∪ {d_i ≥ hi−ε, g_i < 0}`` takes a diagonally scaled gradient
    step and the free variables the exact Newton step ``−M_FF⁻¹ g_F``, followed by an Armijo
    search along the projection arc. Once the optimal active set is identified the Newton step
    lands on the exact minimiser, so the method is exact at convergence (finite termination
    up to round-off). It starts from the clipped unconstrained solution, so when that lies
    inside the box it is returned unchanged. Convergence: the scaled KKT residual
    ``‖d − clip(d − g/diag M)‖∞ ≤ tol·(1 + ‖d‖∞)``.
    """
    if not lo <= hi:
        raise ConfigError(f"qp_projection bounds must satisfy lo <= hi; got [{lo}, {hi}]")
    batch = rhs.shape[0]
    diagonal = matrices.diagonal(dim1=-2, dim2=-1)
    scale = diagonal.clamp_min(torch.finfo(matrices.dtype).tiny)
    unconstrained, _ = solve_symmetric_batched(matrices, rhs)
    d = unconstrained.clamp(lo, hi)
    width = hi - lo
    eps_max = 1e-3 * (width if math.isfinite(width) and width > 0 else 1.0)
    sigma = 1e-4
    iterations = 0
    converged = torch.zeros(batch, dtype=torch.bool, device=rhs.device)
    stalled = torch.zeros(batch, dtype=torch.bool, device=rhs.device)
    for iterations in range(max_iter + 1):  # noqa: B007
        gradient = torch.einsum("bkl,bl->bk", matrices, d) - rhs
        kkt = (d - (d - gradient / scale).clamp(lo, hi)).abs().amax(-1)
        converged = kkt <= tol * (1 + d.abs().amax(-1))
        active = ~converged & ~stalled
        if not bool(active.any()) or iterations == max_iter:
            break
        eps = torch.clamp(kkt, max=eps_max).unsqueeze(-1)
        binding = ((d <= lo + eps) & (gradient > 0)) | ((d >= hi - eps) & (gradient < 0))
        free = ~binding
        newton_matrix = matrices * (free.unsqueeze(-1) & free.unsqueeze(-2)) + torch.diag_embed(
            torch.where(binding, scale, torch.zeros_like(scale))
        )
        step, _ = solve_symmetric_batched(newton_matrix, -gradient)
        free_decrease = -(gradient * step * free).sum(-1)  # g_F^T M_FF^-1 g_F >= 0
        value = _quadratic(matrices, rhs, d)
        slack = 1e-15 * (value.abs() + 1)
        alpha = torch.ones(batch, dtype=d.dtype, device=d.device)
        pending = active.clone()
        new_d = d.clone()
        for _ in range(60):  # Armijo backtracking along the projection arc, per direction
            candidate = (d + alpha.unsqueeze(-1) * step).clamp(lo, hi)
            predicted = sigma * (
                alpha * free_decrease + (gradient * (d - candidate) * binding).sum(-1)
            )
            accept = pending & (value - _quadratic(matrices, rhs, candidate) >= predicted - slack)
            new_d[accept] = candidate[accept]
            pending &= ~accept
            if not bool(pending.any()):
                break
            alpha = torch.where(pending, alpha / 2, alpha)
        stalled |= pending  # no acceptable step: at the minimiser up to round-off
        d = new_d
    gradient = torch.einsum("bkl,bl->bk", matrices, d) - rhs
    kkt = (d - (d - gradient / scale).clamp(lo, hi)).abs().amax(-1)
    unconverged = kkt > tol * (1 + d.abs().amax(-1))
    max_kkt = float(kkt.max()) if batch else 0.0
    info = BoxQPInfo(iterations=iterations, unconverged=int(unconverged.sum()), max_kkt=max_kkt)
    if max_kkt > 1e-6:
        LOG.warning(
            "box-constrained QP: %d of %d directions stopped with scaled KKT residual up to %.2g "
            "after %d iterations",
            info.unconverged,
            batch,
            max_kkt,
            iterations,
        )
    return d, info


@dataclass
class QPSolution:
    """``d``: ``[R, K]`` coefficients; ``mu``: the absolute ridge used; ``fallback_rows``:
    directions solved by the pseudo-inverse; ``box``: projected-Newton info (bounds only);
    ``floored_directions``: directions below the energy floor, left at the prior."""

    d: torch.Tensor
    mu: float
    fallback_rows: int
    box: Optional[BoxQPInfo] = None
    floored_directions: int = 0


def solve_qp(
    equations: QPNormalEquations,
    *,
    ridge: float = 1e-6,
    bounds: Optional[Sequence[float]] = None,
    prior: float = 0.0,
    energy_floor: float = 0.0,
) -> QPSolution:
    """``d* = argmin J(d) + μ‖d − p·1‖²`` (``μ`` = :func:`ridge_strength`, ``p`` = ``prior``),
    optionally on ``[lo, hi]``.

    Unconstrained: ``(N_r + μI) d_r = h_r + μ p 1`` for all r in one batched solve (the
    gradient of ``μ‖d − p1‖²`` is ``2μ(d − p1)``). ``p = 0`` shrinks toward the base model,
    ``p = 1`` toward task arithmetic at λ = 1 (``d → p1`` as ``μ → ∞``).

    ``energy_floor``: directions whose residual energy ``e_r`` is below
    ``energy_floor · mean_r e_r`` are not fitted (their ``N_r``, ``h_r`` are mostly noise):
    they keep the prior, ``d_r = p·1`` (clipped into the box). 0 fits every direction.
    """
    if energy_floor < 0 or not math.isfinite(energy_floor):
        raise ConfigError(
            f"qp_projection energy_floor must be a finite number >= 0; got {energy_floor}"
        )
    if not math.isfinite(prior):
        raise ConfigError(f"qp_projection prior must be a finite number; got {prior}")
    mu = ridge_strength(equations.normal, ridge)
    k_dim = equations.num_updates
    regularised = equations.normal + mu * torch.eye(
        k_dim, dtype=equations.normal.dtype, device=equations.normal.device
    )
    rhs = equations.rhs + mu * prior
    floored = low_energy_directions(equations.energy, energy_floor)
    if bounds is None:
        d, n_fallback = solve_symmetric_batched(regularised, rhs)
        box = None
        prior_value = prior
    else:
        lo, hi = _check_bounds(bounds)
        d, box = solve_box_qp(regularised, rhs, lo, hi)
        n_fallback = 0
        prior_value = min(max(prior, lo), hi)
    d[floored] = prior_value
    return QPSolution(d, mu, n_fallback, box, int(floored.sum()))


def low_energy_directions(energy: torch.Tensor, energy_floor: float) -> torch.Tensor:
    """Boolean ``[R]`` mask of the directions with ``e_r < energy_floor · mean_r e_r``."""
    if energy_floor <= 0 or energy.numel() == 0:
        return torch.zeros(energy.shape, dtype=torch.bool, device=energy.device)
    return energy < energy_floor * energy.mean()


def qp_objective(equations: QPNormalEquations, d: torch.Tensor) -> float:
    """``J(d) = Σ_r (d_rᵀ N_r d_r − 2 d_rᵀ h_r + e_r)`` for any ``d`` (``[R, K]``, or ``[K]``
    for the same coefficients in every direction, e.g. task arithmetic ``λ·1``).

    Clamped at 0 against round-off (J is a sum of squares)."""
    d = d.to(dtype=_COMPUTE_DTYPE, device=equations.normal.device)
    if d.ndim == 1:
        d = d.expand(equations.num_directions, -1)
    per_direction = (
        torch.einsum("rk,rkl,rl->r", d, equations.normal, d)
        - 2 * (d * equations.rhs).sum(-1)
        + equations.energy
    )
    return max(float(per_direction.sum()), 0.0)


def base_energy(equations: QPNormalEquations) -> float:
    """``J(0) = Σ_t tr(R_t G_t R_tᵀ) = tr S``: the residual energy with the base weight."""
    return max(float(equations.energy.sum()), 0.0)


def task_arithmetic_coefficients(
    k_dim: int, scale: float, device: Optional[torch.device] = None
) -> torch.Tensor:
    """Task arithmetic ``W_0 + λ Σ_k Δ_k`` as the feasible point ``d_k = λ·1`` (``[K]``)."""
    return torch.full((k_dim,), float(scale), dtype=_COMPUTE_DTYPE, device=device)


def captured_energy_fraction(j_opt: float, j_zero: float, *, zero_feasible: bool = True) -> float:
    """``1 − J(d*)/J(0)``, the share of the base residual energy the merge removes.

    Defined as 0 when ``J(0) = 0`` (nothing to capture). Mathematically ``0 ≤ J(d*) ≤ J(0)``
    whenever ``d = 0`` is feasible (always unconstrained; with the ridge too, since
    ``J(d*) + μ‖d*‖² ≤ J(0)``), so the result is clamped to [0, 1] only against round-off. When
    a box excludes 0 (``zero_feasible=False``) ``J(d*) > J(0)`` is possible and the (negative)
    value is returned unclamped below.
    """
    if j_zero <= 0.0:
        return 0.0
    fraction = 1.0 - j_opt / j_zero
    fraction = min(fraction, 1.0)
    return max(fraction, 0.0) if zero_feasible else fraction


def merged_update(
    task_vectors: Sequence[torch.Tensor],
    d: torch.Tensor,
    basis: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``δ(d) = Σ_k U diag(d_k) Uᵀ Δ_k = U (Σ_k d[:, k] ⊙_rows Uᵀ Δ_k)`` (float64, out x in)."""
    d = d.to(dtype=_COMPUTE_DTYPE, device=task_vectors[0].device)
    if d.ndim == 1:
        d = d.expand(task_vectors[0].shape[0] if basis is None else basis.shape[1], -1)
    if basis is None:
        update = torch.zeros(task_vectors[0].shape, dtype=_COMPUTE_DTYPE, device=d.device)
        for k_idx, tv in enumerate(task_vectors):
            update += d[:, k_idx : k_idx + 1] * tv.to(_COMPUTE_DTYPE)
        return update
    basis64 = basis.to(_COMPUTE_DTYPE)
    coefficients = torch.zeros(
        basis64.shape[1], task_vectors[0].shape[1], dtype=_COMPUTE_DTYPE, device=d.device
    )
    for k_idx, tv in enumerate(task_vectors):
        coefficients += d[:, k_idx : k_idx + 1] * (basis64.T @ tv.to(_COMPUTE_DTYPE))
    return basis64 @ coefficients


# --------------------------------------------------------------------------------------
# One weight: solve, diagnose, merge
# --------------------------------------------------------------------------------------


def task_energy_weights(
    residual_maps: Sequence[torch.Tensor], grams: Sequence[torch.Tensor]
) -> torch.Tensor:
    """``w_t = mean_s E_s / E_t`` with ``E_t = tr(R_t G_t R_tᵀ)``, task t's residual energy
    (``[T]``, float64). Scaling ``G_t`` by ``w_t`` makes every task's base energy ``J_t(0)``
    the same, so a task whose update is small at this layer is not outvoted by one whose
    update is large (the default weighting counts samples, ``1/N_t``). A task with ``E_t = 0``
    has nothing to fit and keeps weight 1."""
    _check_pairs(residual_maps, grams)
    energies = torch.stack(
        [
            ((r.to(_COMPUTE_DTYPE) @ g.to(_COMPUTE_DTYPE)) * r.to(_COMPUTE_DTYPE)).sum()
            for r, g in zip(residual_maps, grams)
        ]
    )
    positive = energies > 0
    if not bool(positive.any()):
        return torch.ones_like(energies)
    reference = energies[positive].mean()
    return torch.where(
        positive, reference / energies.clamp_min(torch.finfo(_COMPUTE_DTYPE).tiny), 1.0
    )


def _solve_in_basis(
    basis_name: str,
    task_vectors: Sequence[torch.Tensor],
    grams: Sequence[torch.Tensor],
    solve_options: dict[str, Any],
) -> tuple[QPNormalEquations, QPSolution]:
    # S = Σ_t R_t G_t R_tᵀ is the same for R_t = −Δ_t and Δ_t.
    basis = output_basis(basis_name, task_vectors, grams)
    equations = qp_normal_equations(task_vectors, grams, basis=basis, basis_kind=basis_name)
    return equations, solve_qp(equations, **solve_options)


def qp_merge_weight(
    base: torch.Tensor,
    experts: Sequence[torch.Tensor],
    grams: Sequence[torch.Tensor],
    *,
    basis: str = "diagonal",
    ridge: float = 1.0,
    bounds: Optional[Sequence[float]] = None,
    prior: float = 1.0,
    energy_floor: float = 0.0,
    task_weighting: str = "samples",
    diagnose_both_bases: bool = False,
    task_names: Optional[Sequence[str]] = None,
    name: str = "<weight>",
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Merge one linear weight: ``W = W_0 + δ(d*)``; returns the weight (base dtype) and its
    diagnostics (J(0), J(d*), captured energy, task-arithmetic J at λ = 1/K and 1, d stats).

    ``task_weighting``: ``samples`` (each task's mean Gram, tasks count equally per sample)
    or ``energy`` (Grams scaled by :func:`task_energy_weights`; the J values reported are
    then those of the weighted objective)."""
    _check_weight_inputs(base, experts, grams, name)
    if basis not in BASES:
        raise ConfigError(f"qp_projection basis must be one of {', '.join(BASES)}; got {basis!r}")
    if task_weighting not in TASK_WEIGHTINGS:
        raise ConfigError(
            f"qp_projection task_weighting must be one of {', '.join(TASK_WEIGHTINGS)}; "
            f"got {task_weighting!r}"
        )
    task_names = (
        list(task_names) if task_names is not None else [f"task_{i}" for i in range(len(experts))]
    )
    w0 = base.to(_COMPUTE_DTYPE)
    task_vectors = [e.to(_COMPUTE_DTYPE) - w0 for e in experts]
    if task_weighting == "energy":
        weights = task_energy_weights(task_vectors, grams)
        grams = [g.to(_COMPUTE_DTYPE) * w for g, w in zip(grams, weights.tolist())]
    lo, hi = _check_bounds(bounds) if bounds is not None else (-math.inf, math.inf)
    # J(d*) <= J(0) holds when d = 0 is feasible and the ridge and the floor pull toward 0.
    zero_bound = lo <= 0.0 <= hi and prior == 0.0
    solve_options = {
        "ridge": ridge,
        "bounds": bounds,
        "prior": prior,
        "energy_floor": energy_floor,
    }

    equations, solution = _solve_in_basis(basis, task_vectors, grams, solve_options)
    j_zero = base_energy(equations)
    j_opt = qp_objective(equations, solution.d)
    k_dim = len(task_vectors)
    device = equations.normal.device
    j_task_arithmetic = {
        "1/K": qp_objective(equations, task_arithmetic_coefficients(k_dim, 1.0 / k_dim, device)),
        "1": qp_objective(equations, task_arithmetic_coefficients(k_dim, 1.0, device)),
    }
    other: Optional[dict[str, float]] = None
    if diagnose_both_bases:
        other_kind = "diagonal" if basis == "residual_eigen" else "residual_eigen"
        other_eq, other_solution = _solve_in_basis(other_kind, task_vectors, grams, solve_options)
        other_j = qp_objective(other_eq, other_solution.d)
        other = {
            "basis": other_kind,
            "J_opt": other_j,
            "captured_energy": captured_energy_fraction(
                other_j, base_energy(other_eq), zero_feasible=zero_bound
            ),
        }
    merged = (w0 + merged_update(task_vectors, solution.d, equations.basis)).to(base.dtype)
    if not torch.isfinite(merged).all():
        raise TensorError(
            f"the QP merge of {name} produced NaN/Inf; raise ridge or check the inputs"
        )
    d = solution.d
    diagnostics: dict[str, Any] = {
        "basis": basis,
        "J0": j_zero,
        "J_opt": j_opt,
        "captured_energy": captured_energy_fraction(j_opt, j_zero, zero_feasible=zero_bound),
        "J_task_arithmetic": j_task_arithmetic,
        "d_stats": coefficient_stats(d, task_names),
        "other_basis": other,
        "mu": solution.mu,
        "pinv_directions": solution.fallback_rows,
        "floored_directions": solution.floored_directions,
    }
    diagnostics.update(box_diagnostics(solution))
    return merged, diagnostics


def coefficient_stats(d: torch.Tensor, task_names: Sequence[str]) -> dict[str, dict[str, float]]:
    """Mean, min and max of each task's coefficients (column k of ``d``), for diagnostics."""
    return {
        task: {
            "mean": float(d[:, i].mean()),
            "min": float(d[:, i].min()),
            "max": float(d[:, i].max()),
        }
        for i, task in enumerate(task_names)
    }


def box_diagnostics(solution: Any) -> dict[str, Any]:
    """``{"box_qp": …}`` for a box-constrained solve (iterations, unconverged directions,
    largest KKT residual); empty otherwise."""
    if solution.box is None:
        return {}
    return {
        "box_qp": {
            "iterations": solution.box.iterations,
            "unconverged_directions": solution.box.unconverged,
            "max_kkt_residual": solution.box.max_kkt,
        }
    }


# --------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------


def _check_bounds(bounds: Sequence[float]) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in bounds)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"qp_projection parameter bounds must be [lo, hi] (two numbers) or null; got {bounds!r}"
        ) from exc
    if math.isnan(lo) or math.isnan(hi) or lo > hi:
        raise ConfigError(f"qp_projection parameter bounds must satisfy lo <= hi; got [{lo}, {hi}]")
    return lo, hi


def _check_pairs(residual_maps: Sequence[torch.Tensor], grams: Sequence[torch.Tensor]) -> None:
    if len(residual_maps) != len(grams) or not grams:
        raise TensorError(
            f"{len(residual_maps)} residual maps but {len(grams)} task Grams: need one per task (>= 1)"
        )
    in_dim = residual_maps[0].shape[1]
    for gram in grams:
        if gram.shape != (in_dim, in_dim):
            raise TensorError(
                f"task Gram is {tuple(gram.shape)}; the weights need {in_dim} x {in_dim}"
            )


def _check_weight_inputs(
    base: torch.Tensor,
    experts: Sequence[torch.Tensor],
    grams: Optional[Sequence[torch.Tensor]],
    name: str,
) -> None:
    """Shapes and finiteness of one weight's inputs (``grams`` None: no Grams to check)."""
    if len(experts) < 2:
        raise TensorError(
            f"qp_projection needs at least two experts besides the base; {name} has {len(experts)}"
        )
    if base.ndim != 2:
        raise TensorError(f"qp_projection merges 2-D linear weights; {name} is {base.ndim}-D")
    for i, tensor in enumerate([base, *experts]):
        who = "the base model" if i == 0 else f"expert {i}"
        if tensor.shape != base.shape:
            raise TensorError(
                f"shape mismatch for {name}: {who} has {tuple(tensor.shape)}, the base has {tuple(base.shape)}"
            )
        if not torch.isfinite(tensor).all():
            raise TensorError(f"{name} of {who} contains NaN or Inf values; fix that checkpoint")
    if grams is None:
        return
    if len(grams) != len(experts):
        raise TensorError(f"{name}: {len(experts)} experts but {len(grams)} task Grams")
    for i, gram in enumerate(grams):
        if gram.shape != (base.shape[1], base.shape[1]):
            raise TensorError(
                f"{name}: the Gram of task {i} is {tuple(gram.shape)}, the weight's input has "
                f"{base.shape[1]} features (is an HF Conv1D weight not transposed?)"
            )
        if not torch.isfinite(gram).all():
            raise TensorError(f"{name}: the Gram of task {i} contains NaN or Inf")
