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

from mergekit_ext.methods.least_squares.group import (
    LeastSquaresSettings,
    merge_group_least_squares,
)
from mergekit_ext.methods.least_squares.in_range import (
    AUTO_MAX_NORM_RATIO,
    NormRange,
)
from mergekit_ext.methods.least_squares.measures import (
    FULL_COVARIANCE_W2_MAX_DIM,
    covariate_shift_w2,
    gaussian_w2,
    relative_output_error,
    relative_output_error_rows,
    shift_covariance,
)
from mergekit_ext.methods.least_squares.parameters import (
    RegMeanParameters,
)
from mergekit_ext.methods.least_squares.planning import (
    LeastSquaresMethod,
    span_solve_bytes,
)
from mergekit_ext.methods.least_squares.reduction import (
    LeastSquaresReduction,
)
from mergekit_ext.methods.least_squares.solve import (
    AUTO_RIDGE,
    AUTO_RIDGE_MAX_CONDITION,
    EXACT_CONDITION_MAX_DIM,
    FactoredSystem,
    Fallback,
    RegMeanSolution,
    Ridge,
    Solver,
    auto_ridge_needed,
    estimate_condition_number,
    estimate_condition_number_of,
    factor_regmean_system,
    regmean_add_task,
    regmean_merge_weights,
    regmean_solve,
    regmean_zero_sums,
    resolve_ridge,
    row_term,
    shrink_off_diagonal,
    solve_factored,
    solve_regmean_sums,
    span_solve,
    span_solve_applies,
    span_solve_may_apply,
    span_solve_pays,
    takes_row_terms,
)

__all__ = [
    "AUTO_MAX_NORM_RATIO",
    "AUTO_RIDGE",
    "AUTO_RIDGE_MAX_CONDITION",
    "EXACT_CONDITION_MAX_DIM",
    "FULL_COVARIANCE_W2_MAX_DIM",
    "FactoredSystem",
    "Fallback",
    "LeastSquaresMethod",
    "LeastSquaresReduction",
    "LeastSquaresSettings",
    "NormRange",
    "RegMeanParameters",
    "RegMeanSolution",
    "Ridge",
    "Solver",
    "auto_ridge_needed",
    "covariate_shift_w2",
    "estimate_condition_number",
    "estimate_condition_number_of",
    "factor_regmean_system",
    "gaussian_w2",
    "merge_group_least_squares",
    "regmean_add_task",
    "regmean_merge_weights",
    "regmean_solve",
    "regmean_zero_sums",
    "relative_output_error",
    "relative_output_error_rows",
    "resolve_ridge",
    "row_term",
    "shift_covariance",
    "shrink_off_diagonal",
    "solve_factored",
    "solve_regmean_sums",
    "span_solve",
    "span_solve_applies",
    "span_solve_bytes",
    "span_solve_may_apply",
    "span_solve_pays",
    "takes_row_terms",
]
