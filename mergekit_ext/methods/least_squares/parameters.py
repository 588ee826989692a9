"""The parameters every least-squares method shares (:class:`RegMeanParameters`)."""

from __future__ import annotations

import logging
from typing import Annotated, Literal, Union

from pydantic import Field

from mergekit_ext.methods.guard import (
    max_norm_ratio_field,
)
from mergekit_ext.methods.least_squares.in_range import AUTO_MAX_NORM_RATIO
from mergekit_ext.methods.least_squares.solve import (
    AUTO_RIDGE,
    Fallback,
    Solver,
)
from mergekit_ext.methods.parameters import (
    ComputeDtype,
    MethodParameters,
    StatisticsDtype,
    compute_dtype_field,
    statistics_dtype_field,
)

LOG = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------
# The parameters every least-squares method shares
# --------------------------------------------------------------------------------------


class RegMeanParameters(MethodParameters):
    """RegMean's parameters, shared by every least-squares method (``docs/methods.md``, section
    "RegMean", which also has the sweep behind ``reduce_non_diagonal``'s default)."""

    reduce_non_diagonal: float = Field(
        1.0,
        ge=0.0,
        le=1.0,
        description="α of the off-diagonal shrink G̃ = α G + (1 − α) diag(G); 1 keeps the Gram, "
        "0 gives a per-column average weighted by diag(G)",
    )
    ridge: Union[Literal["auto"], Annotated[float, Field(ge=0.0, allow_inf_nan=False)]] = Field(
        "auto",
        description="Tikhonov term toward the experts' mean: adds ridge · mean(diag(Σ ω G̃)) · I "
        "to the inverted matrix (and the matching term to the numerator); auto: "
        f"{AUTO_RIDGE:g} for a group whose calibration tokens are fewer than its inputs (a "
        "rank-deficient Gram: unseen directions keep the experts' mean instead of 0, and the "
        "solve runs in the span of the tokens) or an ill-conditioned system, exactly 0 otherwise "
        "(outputs as with ridge: 0); then, where a merged linear of the group leaves "
        f"{AUTO_MAX_NORM_RATIO:g}x the largest expert's norm, the smallest larger ridge that "
        "brings every linear back (docs/methods.md, ridge: auto)",
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
    compute_dtype: ComputeDtype = compute_dtype_field()
    max_norm_ratio: float = max_norm_ratio_field()
