"""Chain of Merges (CoM): layer-wise RegMean without merging covariate shift.

"Rethinking Layer-wise Model Merging through Chain of Merges", arXiv 2508.21421
(NeurIPS 2026); no public code. CoM is RegMean (``regmean.py``) plus three changes, each
behind its own switch so that the paper's ablation can be run (``docs/methods.md``, section
"Chain of Merges"):

1. ``propagate``: the Gram of layer l for task k comes from task k's calibration data run
   through the ALREADY MERGED layers before l (``LinearGroup.merged_stats``), which removes
   the merging covariate shift that RegMean's expert-path Grams ignore;
2. ``normalize``: Grams of unit-norm inputs ``x / ‖x‖`` (``gram_normalized``), a
   correlation-like, better-conditioned matrix;
3. ``task_weighting: correlation``: ``ω_k = Σ_{p<q} |G_k[p, q]|`` from the normalized Gram
   of THAT layer, ``W = (Σ_k ω_k W_k G̃_k)(Σ_k ω_k G̃_k)⁻¹``.

All three off (``propagate: false, normalize: false, task_weighting: uniform``) is RegMean
with the same ``reduce_non_diagonal``/``ridge``/``solver``. Regularisation: the paper's
"Tikhonov, ridge coefficient 0.95, Moore–Penrose pseudo-inverse" is read as RegMean's
off-diagonal shrink α (``reduce_non_diagonal``) with a pseudo-inverse solve; the default is
α = 1 (no shrink; why: ``docs/methods.md``, section "RegMean"); ``ridge`` adds
``ridge · mean(diag) · I`` on top (default ``auto``: 1e-2 where the system solved is
ill-conditioned or rank-deficient, with the span solve where a group has fewer calibration
tokens than inputs, exactly 0 where it is well conditioned; ``docs/methods.md``, "ridge: auto").

Weights are ``out x in`` (``y = W x``); the executor transposes HF ``Conv1D`` weights.

Diagnostics per group and task: ω_k, the condition number of ``Σ ω G̃`` (exact up to 1024
inputs, a block power/inverse-iteration estimate above: ``condition_number_method``), the
relative output error ``‖W X − W_k X‖/‖W_k X‖`` (on the raw Gram of the path the objective
used) and, when merged-path statistics are present, the merging covariate shift: the
Wasserstein-2 distance between Gaussian fits of the merged-path and the expert-own-path
inputs (full covariance for input width ≤ 1024, diagonal above; the record says which under
``covariate_shift_covariance``). With ``propagate`` the expert path serves only this
diagnostic, so above that width it keeps means and variances, not Grams.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch
from pydantic import Field

from mergekit_ext.methods.card_sections.least_squares import least_squares_report
from mergekit_ext.methods.kinds import Layerwise
from mergekit_ext.methods.layerwise import (
    StatisticsRequest,
    TaskStatistics,
)
from mergekit_ext.methods.least_squares import (
    FULL_COVARIANCE_W2_MAX_DIM,
    LeastSquaresMethod,
    LeastSquaresSettings,
    RegMeanParameters,
)
from mergekit_ext.methods.registry import (
    MethodInfo,
    data_aware_method,
    register_method,
)

LOG = logging.getLogger(__name__)

TaskWeighting = Literal["correlation", "uniform"]


def correlation_task_weight(normalized_gram: torch.Tensor) -> float:
    """CoM's task weight ``ω_k = Σ_{p<q} |G_k[p, q]|`` of a layer's normalized Gram.

    The sum of the absolute strictly-upper-triangular entries (the Gram is symmetric, so
    this is half the absolute off-diagonal mass). Computed in float64.
    """
    g = normalized_gram.double()
    if g.ndim != 2 or g.shape[0] != g.shape[1]:
        raise ValueError(f"a Gram matrix must be square; got shape {tuple(g.shape)}")
    return float(torch.triu(g, diagonal=1).abs().sum())


def _correlation_weight_of(stats: TaskStatistics) -> float:
    assert stats.gram_normalized is not None  # checked by the group driver
    return correlation_task_weight(stats.gram_normalized)


class ChainOfMergesParameters(RegMeanParameters):
    """CoM's parameters: RegMean's plus the three ablation switches (their defaults, and what
    each did on the benchmark suites: ``docs/methods.md``, section "Chain of Merges")."""

    propagate: bool = Field(
        True,
        description="Grams from each task's data run through the already merged layers (removes "
        "the merging covariate shift); false uses each expert's own forward pass like RegMean",
    )
    normalize: bool = Field(
        False,
        description="form the Grams from unit-L2-norm input vectors (correlation-like, better "
        "conditioned)",
    )
    task_weighting: TaskWeighting = Field(
        "uniform",
        description="uniform (ω_k = 1) | correlation (ω_k = Σ_{p<q} |G_k[p,q]| of the layer's "
        "normalized Gram)",
    )


class ChainOfMergesMethod(LeastSquaresMethod):
    """Chain of Merges on the sequential executor."""

    name = "chain_of_merges"
    parameters_model = ChainOfMergesParameters

    def statistics_request(self, parameters: Any) -> StatisticsRequest:
        p = self.parse(parameters)
        # The correlation weight needs the normalized Gram even when the merge itself uses
        # the raw one. The expert path stays on: without propagation it is the merge's data,
        # with it the reference of the covariate-shift diagnostic, which is diagonal above
        # FULL_COVARIANCE_W2_MAX_DIM, so wider groups need only the reference's moments.
        return StatisticsRequest(
            propagate=p.propagate,
            expert_path=True,
            normalized_gram=p.normalize or p.task_weighting == "correlation",
            reference_gram_max_dim=FULL_COVARIANCE_W2_MAX_DIM if p.propagate else None,
            keep_rows=True,  # the span solve when a group has fewer tokens than inputs
            statistics_dtype=getattr(torch, p.statistics_dtype),
            compute_dtype=p.compute_dtype,
        )

    def settings(self, parameters: Any) -> LeastSquaresSettings:
        p = self.parse(parameters)
        correlation = p.task_weighting == "correlation"
        return LeastSquaresSettings(
            method=self.name,
            reduce_non_diagonal=p.reduce_non_diagonal,
            ridge=p.ridge,
            solver=p.solver,
            use_merged_path=p.propagate,
            use_normalized_gram=p.normalize,
            task_weight=_correlation_weight_of if correlation else None,
            task_weight_needs_normalized_gram=correlation,
            task_weighting_label=p.task_weighting,
            max_norm_ratio=p.max_norm_ratio,
        )


INFO = MethodInfo(
    name="chain_of_merges",
    pretty_name="Chain of Merges (CoM)",
    kind=Layerwise(ChainOfMergesMethod()),
    needs_calibration=True,
    paper='"Rethinking Layer-wise Model Merging through Chain of Merges" (NeurIPS 2026)',
    paper_url="https://arxiv.org/abs/2508.21421",
    parameters_model=ChainOfMergesParameters,
    report=least_squares_report("chain_of_merges", "Chain of Merges"),
)

register_method(INFO, data_aware_method(INFO))
