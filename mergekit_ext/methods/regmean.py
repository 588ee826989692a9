"""RegMean: merge linear layers by the closed-form least squares on their input Grams.

Jin et al., "Dataless Knowledge Fusion by Merging Weights of Language Models", ICLR 2023,
https://arxiv.org/abs/2212.09849. Each linear group is merged by
``W = (Σ_k W_k G̃_k)(Σ_k G̃_k)⁻¹`` with the input Grams ``G_k`` of each expert's OWN forward
pass (the math is in ``least_squares.py``; ``docs/methods.md`` has the equations).
"""

from __future__ import annotations

from typing import Any

import torch

from mergekit_ext.methods.card_sections.least_squares import least_squares_report
from mergekit_ext.methods.kinds import Layerwise
from mergekit_ext.methods.layerwise import StatisticsRequest
from mergekit_ext.methods.least_squares import (
    LeastSquaresMethod,
    LeastSquaresSettings,
    RegMeanParameters,
)
from mergekit_ext.methods.registry import (
    MethodInfo,
    data_aware_method,
    register_method,
)


class RegMeanMethod(LeastSquaresMethod):
    """RegMean on the sequential executor: Grams of each expert's OWN forward pass."""

    name = "regmean"
    parameters_model = RegMeanParameters

    def statistics_request(self, parameters: Any) -> StatisticsRequest:
        p = self.parse(parameters)
        return StatisticsRequest(
            propagate=False,
            expert_path=True,
            normalized_gram=False,
            keep_rows=True,  # the span solve when a group has fewer tokens than inputs
            statistics_dtype=getattr(torch, p.statistics_dtype),
            compute_dtype=p.compute_dtype,
        )

    def settings(self, parameters: Any) -> LeastSquaresSettings:
        p = self.parse(parameters)
        return LeastSquaresSettings(
            method=self.name,
            reduce_non_diagonal=p.reduce_non_diagonal,
            ridge=p.ridge,
            solver=p.solver,
            use_merged_path=False,
            use_normalized_gram=False,
            max_norm_ratio=p.max_norm_ratio,
        )


INFO = MethodInfo(
    name="regmean",
    pretty_name="RegMean",
    kind=Layerwise(RegMeanMethod()),
    needs_calibration=True,
    paper='Jin et al., "Dataless Knowledge Fusion by Merging Weights of Language Models", ICLR 2023',
    paper_url="https://arxiv.org/abs/2212.09849",
    parameters_model=RegMeanParameters,
    report=least_squares_report("regmean", "RegMean"),
)

register_method(INFO, data_aware_method(INFO))
