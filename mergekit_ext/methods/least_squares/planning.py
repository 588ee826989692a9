"""What the plan asks of a least-squares method before anything loads: whether a group is
solved in its tokens' span, the solve's working memory, and the rank warnings; and the merge
itself, from the :class:`~.group.LeastSquaresSettings` each method builds of its parameters.

RegMean and CoM (and block distillation, which is CoM with a refinement) derive from
:class:`LeastSquaresMethod`; the executor's plan asks these through
:class:`~mergekit_ext.methods.layerwise.LayerwiseMethod` and never reads ``ridge`` itself.
The numbers follow the solves of ``solve.py`` (docs/methods.md, "The span solve").
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, Optional

import torch

from mergekit_ext.methods.layerwise import (
    GroupToSize,
    LayerwiseMethod,
    LinearGroup,
    SpanSolve,
    dense_solve_bytes,
)
from mergekit_ext.methods.least_squares.group import LeastSquaresSettings, merge_group_least_squares
from mergekit_ext.methods.least_squares.reduction import LeastSquaresReduction
from mergekit_ext.methods.least_squares.solve import AUTO_RIDGE, span_solve_may_apply


def _ridge(parameters: Any) -> Any:
    return getattr(parameters, "ridge", None)


def _alpha(parameters: Any) -> float:
    return getattr(parameters, "reduce_non_diagonal", 1.0)


def span_solve_bytes(
    width: int, out: int, tasks: int, span_tokens: int, low_precision: bool = False
) -> int:
    """Working memory of :func:`~mergekit_ext.methods.least_squares.solve.span_solve` on
    ``span_tokens`` T < width rows: the ``tasks`` stacked expert weights (float32), W₀ and one
    ``W_k − W₀`` (float64, and a float32 result; after a bf16 / fp16 pass (``low_precision``)
    both float32, W₀ becoming the result), Vᵀ and ``(V H⁻¹)ᵀ`` (``T x out``), the rows, R E⁻¹
    and ``H⁻¹ R E⁻¹`` (``T x in``), H, its symmetrised copy and its factor (``T x T``), all
    float64."""
    weights = tasks * out * width * 4
    t = span_tokens
    buffers = out * width * (4 + 4 if low_precision else 8 + 8 + 4)
    return weights + buffers + 2 * out * t * 8 + t * width * 24 + 3 * t * t * 8


class LeastSquaresMethod(LayerwiseMethod):
    """A layer-wise method that merges each group by the least-squares solve on input Grams
    (``least_squares/solve.py``), with a ``ridge`` and ``reduce_non_diagonal``: the dense
    solve, or, with fewer tokens than inputs and a ridge, the solve in the tokens' span."""

    @abstractmethod
    def settings(self, parameters: Any) -> LeastSquaresSettings:
        """How this method merges a group: its parameters as the solve's settings."""

    def merge_linear_group(
        self, group: LinearGroup, parameters: Any
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return merge_group_least_squares(group, self.settings(parameters))

    def reduction(self, parameters: Any) -> LeastSquaresReduction:
        return LeastSquaresReduction(self.settings(parameters))

    def solve_in_span(self, parameters: Any, group: GroupToSize) -> SpanSolve:
        ridge, alpha = _ridge(parameters), _alpha(parameters)
        tokens = group.tokens
        now = bool(
            group.rows_kept
            and tokens is not None
            and tokens < group.width
            and alpha > 0
            and (ridge == "auto" or (isinstance(ridge, (int, float)) and ridge > 0))
        )
        # more tokens than inputs, each task's fewer: where a ridge makes the span solve
        # pay, several processes gather the group on rank 0, which forms every task's Gram
        # first (the dense bytes bound both solves)
        counts = group.task_tokens
        after = bool(
            group.several
            and group.rows_kept
            and not now
            and ridge is not None
            and counts is not None
            and all(n < group.width for n in counts)
            and span_solve_may_apply(alpha, ridge, group.out, group.width, counts)
        )
        return SpanSolve(now=now, after_gather=after)

    def solve_bytes(
        self,
        parameters: Any,
        group: GroupToSize,
        tasks: int,
        *,
        span: SpanSolve = SpanSolve(),
        gathered: bool = False,
        row_tasks: int = 0,
    ) -> int:
        width, out = group.width, group.out
        if span.now and group.tokens is not None:
            solve = span_solve_bytes(width, out, tasks, group.tokens, group.low_precision)
        else:
            solve = dense_solve_bytes(width, out, tasks)
        if gathered:
            # after the gather, rank 0 forms every task's Gram before deciding the span
            return solve + (tasks * width * width * 8 if span.after_gather else 0)
        # the dense solve of a task that kept its rows forms its Gram from them (float64)
        formed = (
            row_tasks * width * width * 8
            if group.rows_kept and not span.now and not group.normalized_gram
            else 0
        )
        return solve + formed

    def plan_warnings(self, parameters: Any, groups: Sequence[GroupToSize]) -> list[str]:
        """One line per group whose summed Gram is rank-deficient by count: a group with
        ``n`` inputs summed over tasks with ``T < n`` tokens has rank at most ``T``."""
        ridge = _ridge(parameters)
        out = []
        for g in groups:
            tokens: Optional[int] = g.tokens
            if not g.keep_rows or tokens is None or tokens >= g.width:
                continue
            if ridge == "auto":
                remedy = (
                    f"meanwhile ridge: auto applies a relative ridge of {AUTO_RIDGE:g} toward "
                    "the experts' mean "
                    "(unseen directions keep the experts' mean) and solves in the tokens' span"
                )
            elif ridge == 0:
                remedy = (
                    "with ridge: 0 the pseudo-inverse sets the merged weight to 0 in the unseen "
                    f"directions and needs an eigendecomposition of a {g.width} x {g.width} "
                    "matrix (slow): use ridge: auto"
                )
            else:
                remedy = f"ridge: {ridge} regularises it toward the experts' mean"
            tasks = len(g.task_tokens or ())
            out.append(
                f"{self.name}: the Gram of {g.label} ({g.width} inputs) has at most "
                f"{tokens:,} ranks from {tokens:,} calibration tokens ({tasks} tasks): "
                f"add calibration data (at least {g.width:,} tokens in all) for the "
                f"unregularised solution; {remedy}"
            )
        return out
