"""QP / output-space projection merging, the method as registered.

"Model Merging by Output-Space Projection", Evans, Etheridge, Roberts, Tanner,
arXiv 2605.29101 (2026), https://arxiv.org/abs/2605.29101. No public reference code; the
computation follows ``docs/methods.md``, section "QP / output-space projection" (the
objective, its normal equations per output direction, the bases, the ridge and its prior,
the box; and "Why a lower J did not give a better merge" for the defaults).

Notation (PyTorch ``y = W x``, ``W`` is ``out x in``): ``W_0`` the base weight, ``Δ_k = W_k −
W_0`` expert k's task vector; the merged update is ``δ(d) = Σ_k U diag(d_k) Uᵀ Δ_k`` with ``U``
an orthonormal output basis and ``d`` stored as ``[R, K]``.

Two implementations over the shared solve (``qp_solve.py``), chosen by ``objective``
(:data:`IMPLEMENTATIONS`, parameters in ``qp_parameters.py``):

- :class:`QPLayerOutputMethod` (``layer_output``, default): each linear fitted to its own
  output on the per-task input Grams, block by block. The expert of task t is expert t, so
  the residual map is ``R_t = −Δ_t``; with ``propagate`` the Grams are those of the inputs
  along the already merged path;
- :class:`~mergekit_ext.methods.qp_model_output.QPModelOutputMethod` (``model_output``):
  each linear fitted to the model's output (``docs/methods.md``, "The model-output
  objective").

The pure QP functions are re-exported from ``qp_solve`` (``qp_projection.solve_qp`` etc.).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from mergekit_ext.errors import TensorError
from mergekit_ext.methods.card_sections.qp import plot_qp, summarize_qp
from mergekit_ext.methods.guard import expert_norms, guard_group, norm_ratios
from mergekit_ext.methods.kinds import Layerwise
from mergekit_ext.methods.layerwise import (
    LayerwiseMethod,
    LinearGroup,
    ModelOutputFit,
    StatisticsRequest,
)
from mergekit_ext.methods.qp_model_output import QPModelOutputMethod
from mergekit_ext.methods.qp_parameters import (
    OBJECTIVE_PARAMETERS,
    QPLayerOutputParameters,
    QPModelOutputParameters,
    QPParameters,
    QPSharedParameters,
)

# The shared QP math lives in qp_solve (both objectives use it); re-exported here.
from mergekit_ext.methods.qp_solve import (
    BASES,
    FALLBACKS,
    TASK_WEIGHTINGS,
    BasisKind,
    BoxQPInfo,
    FallbackKind,
    QPNormalEquations,
    QPSolution,
    base_energy,
    box_diagnostics,
    captured_energy_fraction,
    coefficient_stats,
    low_energy_directions,
    merged_update,
    output_basis,
    qp_merge_weight,
    qp_normal_equations,
    qp_objective,
    residual_energy_matrix,
    ridge_strength,
    solve_box_qp,
    solve_qp,
    solve_symmetric_batched,
    task_arithmetic_coefficients,
    task_energy_weights,
)
from mergekit_ext.methods.registry import (
    MethodInfo,
    MethodReport,
    data_aware_method,
    register_method,
)

LOG = logging.getLogger(__name__)


OBJECTIVES: tuple[str, ...] = tuple(OBJECTIVE_PARAMETERS)

# --------------------------------------------------------------------------------------
# The executor-facing methods: one implementation per objective, chosen by ``objective``
# --------------------------------------------------------------------------------------


class QPLayerOutputMethod(LayerwiseMethod):
    """QP with the layer objective (the default), block by block on the sequential executor.

    Each weight of a group is its own problem (q, k, v share the input Gram but not the
    residuals). With ``propagate`` (default) the Grams are the merged-path statistics.
    Non-linear tensors: the fallback merge, ``mean`` of experts by default as in RegMean/CoM
    (equal to task arithmetic at λ = 1/K, the QP's neutral feasible point).
    """

    name = "qp_projection"
    parameters_model = QPLayerOutputParameters

    def statistics_request(self, parameters: Any) -> StatisticsRequest:
        resolved = self.parse(parameters)
        return StatisticsRequest(
            propagate=resolved.propagate,
            expert_path=not resolved.propagate,
            statistics_dtype=getattr(torch, resolved.statistics_dtype),
            compute_dtype=resolved.compute_dtype,
        )

    def merge_linear_group(
        self, group: LinearGroup, parameters: Any
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        resolved = self.parse(parameters)
        stats = group.merged_stats if resolved.propagate else group.expert_stats
        if stats is None:
            raise TensorError(
                f"qp_projection with propagate: true needs merged-path statistics for {group.name}, "
                "but the executor supplied none (it must honour statistics_request)"
            )
        if len(stats) != len(group.experts) or len(group.task_names) != len(group.experts):
            raise TensorError(
                f"{group.name}: {len(group.experts)} experts, {len(group.task_names)} task names and "
                f"{len(stats)} task statistics; need one of each per expert"
            )
        grams = [s.gram for s in stats]
        merged: dict[str, torch.Tensor] = {}
        weights_diag: dict[str, Any] = {}
        for weight_name in group.weights:
            merged[weight_name], weights_diag[weight_name] = qp_merge_weight(
                group.base[weight_name],
                [expert[weight_name] for expert in group.experts],
                grams,
                basis=resolved.basis,
                ridge=resolved.ridge,
                bounds=resolved.bounds,
                prior=resolved.prior,
                energy_floor=resolved.energy_floor,
                task_weighting=resolved.task_weighting,
                diagnose_both_bases=resolved.diagnose_both_bases,
                task_names=group.task_names,
                name=weight_name,
            )
            LOG.debug(
                "qp_projection %s: captured %.4f of J0=%.4g",
                weight_name,
                weights_diag[weight_name]["captured_energy"],
                weights_diag[weight_name]["J0"],
            )
        guard = guard_group(
            self.name,
            group.name,
            norm_ratios(
                {w: group.as_written(w, merged[w]) for w in group.weights},
                expert_norms(group.experts, group.weights),
            ),
            resolved.max_norm_ratio,
        )
        return merged, {"layer": group.name, **guard, "weights": weights_diag}


class QPProjectionMethod(LayerwiseMethod):
    """``qp_projection`` as registered (arXiv 2605.29101): the implementation of the
    ``objective`` the parameters choose (:data:`IMPLEMENTATIONS`) does the work."""

    name = "qp_projection"
    parameters_model = QPParameters

    def implementation_for(self, parameters: Any) -> LayerwiseMethod:
        """The chosen objective's implementation."""
        return IMPLEMENTATIONS[self.parse(parameters).objective]

    def statistics_request(self, parameters: Any) -> StatisticsRequest:
        return self.implementation_for(parameters).statistics_request(self.parse(parameters))

    def merge_linear_group(
        self, group: LinearGroup, parameters: Any
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return self.implementation_for(parameters).merge_linear_group(group, self.parse(parameters))

    def model_output_fit(
        self,
        name: str,
        base: torch.Tensor,
        experts: Sequence[torch.Tensor],
        task_names: Sequence[str],
        parameters: Any,
    ) -> ModelOutputFit:
        return self.implementation_for(parameters).model_output_fit(
            name, base, experts, task_names, self.parse(parameters)
        )


#: one implementation per ``objective``, both over the solve of ``qp_solve.py``
IMPLEMENTATIONS: dict[str, LayerwiseMethod] = {
    "layer_output": QPLayerOutputMethod(),
    "model_output": QPModelOutputMethod(),
}


INFO = MethodInfo(
    name="qp_projection",
    pretty_name="QP / output-space projection",
    kind=Layerwise(QPProjectionMethod()),
    needs_calibration=True,
    paper="Model Merging by Output-Space Projection (Evans, Etheridge, Roberts, Tanner, 2026)",
    paper_url="https://arxiv.org/abs/2605.29101",
    parameters_model=QPParameters,
    report=MethodReport(
        "QP output-space projection", summarize_qp, plot_qp, template="qp_projection"
    ),
)

register_method(INFO, data_aware_method(INFO))

__all__ = [
    "BASES",
    "FALLBACKS",
    "TASK_WEIGHTINGS",
    "BasisKind",
    "BoxQPInfo",
    "FallbackKind",
    "INFO",
    "IMPLEMENTATIONS",
    "OBJECTIVES",
    "QPLayerOutputMethod",
    "QPLayerOutputParameters",
    "QPModelOutputMethod",
    "QPModelOutputParameters",
    "QPNormalEquations",
    "QPParameters",
    "QPProjectionMethod",
    "QPSharedParameters",
    "QPSolution",
    "base_energy",
    "box_diagnostics",
    "captured_energy_fraction",
    "coefficient_stats",
    "low_energy_directions",
    "merged_update",
    "output_basis",
    "qp_merge_weight",
    "qp_normal_equations",
    "qp_objective",
    "residual_energy_matrix",
    "ridge_strength",
    "solve_box_qp",
    "solve_qp",
    "solve_symmetric_batched",
    "task_arithmetic_coefficients",
    "task_energy_weights",
]
