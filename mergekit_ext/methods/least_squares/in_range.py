"""``ridge: auto``'s range rule: the smallest ridge that keeps every merged linear of a group
within the experts' range (docs/methods.md, "ridge: auto").

The exact least-squares solution fits the calibration inputs; in the directions they span
weakly it can grow far beyond any expert (issue #47: the tiny example's ``o_proj`` groups,
condition numbers 1.2e5–6.8e5, came out 3.4x, 6.2x and 11.6x the largest expert's norm).
Where the solution ``auto`` first reached leaves the range, the ridge is raised to the
smallest value that brings every linear of the group back: with ``A`` the factored system
(its own ridge included) and ``A = Q Λ Qᵀ``, a larger ridge ``λ + δ`` gives

    W(δ) Q = (W Q Λ + δ/Σω · S Q) / (Λ + δ),     S = Σ_k ω_k W_k

(the numerator ``N = W A`` gains ``δ/Σω · S``), so after one eigendecomposition and two
``out x in x in`` products each linear's norm at any ridge is a sum over ``in`` terms and
a bisection costs nothing. The span solve (fewer tokens than inputs) has no ``in x in``
system; there the bisection re-solves (:func:`span_ridge_in_range`).

Pure tensor arithmetic: nothing here loads files or writes output.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional, TypeVar

import torch

# ``ridge: auto`` keeps every merged linear within this multiple of the largest expert's
# Frobenius norm: the largest ratio measured on healthy merges (unregularised RegMean on
# varied text 1.31x, a 1e-4 ridge 1.5x; docs/methods.md, "The result guard"), below the
# guard's warning at 2x and far below its stop at 10x, so a default merge never stops.
AUTO_MAX_NORM_RATIO = 1.5
# The bisection's bounds on the relative ridge: at 1e6 the solution is the experts'
# ω-mean to ~1e-6, whose norm is at most the largest expert's (a convex combination).
_RIDGE_START = 1e-8
_RIDGE_MAX = 1e6
_BISECTIONS = 40  # on log(ridge): (upper / lower)^(2^-40), far below the 3 digits kept
_SPAN_BISECTIONS = 7  # each a full span solve: to within 10^(1/128) ≈ 1.8 %
# The written weight is rounded (bf16, say): where that lifts a linear just above the limit
# the ridge grows by this factor, at most _WRITTEN_RETRIES times.
_WRITTEN_STEP = 1.1
_WRITTEN_RETRIES = 8


@dataclass(frozen=True)
class NormRange:
    """The experts' range of one linear group, as the result guard measures it.

    ``rows``: each linear's output rows in the stacked merged weight; ``reference``: its
    largest expert norm ``max_k ‖W_k‖_F``; ``ratios``: the stacked merged weight's
    per-linear norm ratios as written (rounded to the output dtype); ``limit``: the largest
    ratio ``auto`` accepts.
    """

    rows: tuple[int, ...]
    reference: tuple[float, ...]
    ratios: Callable[[torch.Tensor], Sequence[float]]
    limit: float = AUTO_MAX_NORM_RATIO

    def worst(self, merged: torch.Tensor) -> float:
        """The largest written norm ratio of ``merged`` (NaN counts as inf)."""
        values = [math.inf if math.isnan(r) else r for r in self.ratios(merged)]
        return max(values)

    def holds(self, merged: torch.Tensor) -> bool:
        return self.worst(merged) <= self.limit


@dataclass
class RangeFit:
    """The merged weight at the ridge the range rule chose."""

    merged: torch.Tensor
    ridge: float  # the relative ridge
    before: float  # the largest written norm ratio at the ridge first solved
    after: float  # ... at ``ridge``
    condition: Optional[float] = None  # of the regularised system (dense: exact)


def reason(first: str, fit: RangeFit, floor: float, limit: float) -> str:
    """The ``ridge_reason`` of a ridge the range rule raised (``first``: why the first one)."""
    if not fit.after <= limit:  # even the experts' mean is outside (a limit below 1, say)
        return (
            f"{first}; the solution at ridge {floor:g} had {fit.before:.3g}x the largest "
            f"expert's norm, above {limit:g}x, and no ridge up to {_RIDGE_MAX:g} brings every "
            f"linear within it: ridge {fit.ridge:.3g} (the experts' mean, {fit.after:.3g}x)"
        )
    return (
        f"{first}; the solution at ridge {floor:g} had {fit.before:.3g}x the largest expert's "
        f"norm, above {limit:g}x: ridge {fit.ridge:.3g}, the smallest that keeps every linear "
        f"of the group within {limit:g}x ({fit.after:.3g}x)"
    )


def _round_up(value: float) -> float:
    """``value`` rounded up to 3 significant digits (the ridge the record shows)."""
    scale = 10.0 ** (math.floor(math.log10(value)) - 2)
    return math.ceil(value / scale - 1e-9) * scale


def _bisect(in_range: Callable[[float], bool], floor: float, steps: int) -> Optional[float]:
    """The smallest relative ridge above ``floor`` (out of range) that is ``in_range``, to
    ``steps`` bisections on its logarithm; None when even :data:`_RIDGE_MAX` is not."""
    high = max(10.0 * floor, _RIDGE_START)
    if in_range(high) and floor == 0.0:
        while high / 10.0 >= _RIDGE_START * 1e-4 and in_range(high / 10.0):
            high /= 10.0
    while not in_range(high):
        if high >= _RIDGE_MAX:
            return None
        high *= 10.0
    low = max(floor, high / 10.0)
    for _ in range(steps):
        middle = math.sqrt(low * high) if low > 0.0 else 0.5 * high
        if in_range(middle):
            high = middle
        else:
            low = middle
    return high


def dense_ridge_in_range(
    merged: torch.Tensor,
    system: torch.Tensor,
    weighted: torch.Tensor,
    total_weight: float,
    diagonal_mean: float,
    floor: float,
    target: NormRange,
) -> Optional[RangeFit]:
    """The smallest relative ridge above ``floor`` that keeps ``merged``'s group in range.

    Args:
        merged: the float64 solution ``W = N A⁻¹`` at the relative ridge ``floor``.
        system: ``A``, float64 and symmetric positive definite (``floor``'s ridge included).
        weighted: ``S = Σ_k ω_k W_k`` (the numerator gains ``λ/Σω · S`` with a ridge).
        total_weight: ``Σ_k ω_k``.
        diagonal_mean: ``mean(diag(Σ ω G̃))``: a relative ridge ρ adds ``ρ`` times it.
        floor: the relative ridge ``A`` holds.
        target: the range.

    Returns:
        None when ``merged`` is in range (checked as written), else the solution at the
        smallest such ridge (3 significant digits, rounded up), float64.
    """
    before = target.worst(merged)
    if before <= target.limit:
        return None
    eigenvalues, vectors = torch.linalg.eigh(system)
    projected = (merged @ vectors).mul_(eigenvalues)  # N Q = W Q Λ
    pulled = weighted.double() @ vectors  # S Q
    # per linear and eigen-direction: ‖N q‖², (N q)·(S q), ‖S q‖²
    terms = []
    for p, s in zip(projected.split(target.rows), pulled.split(target.rows)):
        terms.append(torch.stack([p.square().sum(0), (p * s).sum(0), s.square().sum(0)]))
    squares = torch.stack(terms)  # linears x 3 x in
    reference = torch.tensor(target.reference, dtype=torch.float64, device=squares.device)

    def ratios(ridge: float) -> torch.Tensor:
        extra = (ridge - floor) * diagonal_mean
        pull = extra / total_weight
        numerator = squares[:, 0] + 2.0 * pull * squares[:, 1] + pull * pull * squares[:, 2]
        norms = (numerator / (eigenvalues + extra).square()).sum(1).sqrt()
        return torch.where(reference > 0.0, norms / reference, norms * math.inf)

    def in_range(ridge: float) -> bool:
        return bool((ratios(ridge) <= target.limit).all())

    found = _bisect(in_range, floor, _BISECTIONS)
    ridge = _RIDGE_MAX if found is None else _round_up(found)
    if found is not None and not in_range(ridge):
        ridge = found

    def solve(ridge: float) -> torch.Tensor:
        extra = (ridge - floor) * diagonal_mean
        scaled = (projected + (extra / total_weight) * pulled) / (eigenvalues + extra)
        return scaled @ vectors.T

    solution = solve(ridge)
    after = target.worst(solution)
    for _ in range(_WRITTEN_RETRIES if found is not None else 0):
        if after <= target.limit:
            break
        ridge = _round_up(ridge * _WRITTEN_STEP)
        solution = solve(ridge)
        after = target.worst(solution)
    extra = (ridge - floor) * diagonal_mean
    shifted = eigenvalues + extra
    condition = float(shifted.abs().max() / shifted.abs().min())
    return RangeFit(solution, ridge, before, after, condition)


Solved = TypeVar("Solved")


def span_ridge_in_range(
    solve: Callable[[float], Solved],
    merged_of: Callable[[Solved], torch.Tensor],
    first: Solved,
    floor: float,
    target: NormRange,
) -> Optional[tuple[Solved, RangeFit]]:
    """:func:`dense_ridge_in_range` for a solve with no ``in x in`` system (the span solve):
    the bisection re-solves (``solve(ridge)``), a few solves for a group out of range.

    Returns:
        None when ``first`` (the solution at ``floor``) is in range; else the solution at the
        smallest ridge found in range (to :data:`_SPAN_BISECTIONS` steps) and its record.
    """
    before = target.worst(merged_of(first))
    if before <= target.limit:
        return None
    solved: dict[float, Solved] = {}

    def in_range(ridge: float) -> bool:
        solved[ridge] = solve(ridge)
        return target.holds(merged_of(solved[ridge]))

    found = _bisect(in_range, floor, _SPAN_BISECTIONS)
    ridge = _RIDGE_MAX if found is None else found
    if ridge not in solved:
        solved[ridge] = solve(ridge)
    result = solved[ridge]
    after = target.worst(merged_of(result))
    return result, RangeFit(merged_of(result), ridge, before, after)
