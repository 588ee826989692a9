"""QP / output-space projection merging.

"Model Merging by Output-Space Projection", Evans, Etheridge, Roberts, Tanner,
arXiv 2605.29101 (2026), https://arxiv.org/abs/2605.29101. No public reference code; the
computation follows ``docs/methods.md`` (section "QP / output-space projection").

Notation (PyTorch ``y = W x``, ``W`` is ``out x in``): ``W_0`` the base weight, ``W_k``
expert k's, ``Δ_k = W_k − W_0`` its task vector (the *updates*), ``K`` experts. Task ``t``
has calibration inputs ``x_j`` (``j ∈ t``, ``N_t`` of them) and residual
``b_j = (W_0 − W_t) x_j = R_t x_j`` (base output minus the expert's output), ``R_t = W_0 − W_t``.

The merged update is ``δ(d) = Σ_k U diag(d_k) Uᵀ Δ_k`` with ``U = [u_1 … u_R]`` an orthonormal
basis of the output space and ``d_k ∈ R^R`` one coefficient per task and basis direction. We
store ``d`` as an ``[R, K]`` tensor, ``d[r, k] = (d_k)_r``. The objective, with each task's
samples weighted by ``1/N_t`` so that tasks count equally, is

    J(d) = Σ_t (1/N_t) Σ_{j∈t} ‖δ(d) x_j + b_j‖².

Everything in it is a function of the per-task *mean* Grams ``G_t = (1/N_t) Σ_{j∈t} x_j x_jᵀ``
(``TaskStatistics.gram``), so no activations are kept. Because ``U`` is orthonormal,
``‖v‖² = Σ_r (u_rᵀ v)²`` and ``u_rᵀ δ(d) = Σ_k (d_k)_r u_rᵀ Δ_k``, so J separates by direction::

    J(d) = Σ_r Σ_j w_j (a_jᵀ d_r + c_j)²,   a_jk = u_rᵀ Δ_k x_j,  c_j = u_rᵀ b_j,  w_j = 1/N_t(j)

and with ``Σ_j w_j x_j x_jᵀ`` restricted to task t equal to ``G_t``:

    N_r[k, l] = Σ_j w_j a_jk a_jl = Σ_t u_rᵀ Δ_k G_t Δ_lᵀ u_r = u_rᵀ Δ_k G Δ_lᵀ u_r,  G = Σ_t G_t
    −h_r[k]   = Σ_j w_j a_jk c_j  = Σ_t u_rᵀ Δ_k G_t R_tᵀ u_r
    e_r       = Σ_j w_j c_j²      = Σ_t u_rᵀ R_t G_t R_tᵀ u_r = u_rᵀ S u_r
    J(d)      = Σ_r (d_rᵀ N_r d_r − 2 d_rᵀ h_r + e_r)
    J(0)      = Σ_r e_r = tr S = Σ_t tr(R_t G_t R_tᵀ),   S = Σ_t R_t G_t R_tᵀ

(``S`` is the residual energy matrix ``Σ_j w_j b_j b_jᵀ``.) The minimiser of
``J(d) + μ‖d − p·1‖²`` solves the K×K normal equations ``(N_r + μI) d_r = h_r + μp·1`` for every
direction r at once (batched); with a box ``lo ≤ d ≤ hi`` it is a K-variable QP per direction,
solved by a batched projected Newton method. The prior ``p`` (parameter ``prior``) is 1 by
default, task arithmetic at λ = 1: the experts' updates act alike on every task's inputs, so in
an output basis the columns ``a_jk`` are nearly collinear and the plain minimiser is close to
``d = 1/K`` (the experts' mean), a worse merge than λ = 1 on the benchmarks
(``docs/methods.md``, "Why a lower J did not give a better merge").

Bases (``basis``): ``diagonal`` (``U = I``: d_k masks output rows, the paper's diagonal-mask
QP) and ``residual_eigen`` (``U`` = eigenvectors of ``S`` in descending eigenvalue order, the
paper's optimal basis). Task arithmetic ``d_k = λ·1`` is a feasible point in every basis
(``δ = λ Σ_k Δ_k``); its J is reported next to ``J(d*)``.

In the method, the expert of task t is expert t, so ``R_t = −Δ_t``; the pure functions also
accept separate residual maps (e.g. trimmed task vectors as updates, full experts as targets).
With ``propagate`` the ``x_j`` are the inputs along the already merged path and the residuals
``(W_0 − W_t) x_j`` are recomputed on them (``docs/methods.md``), i.e. ``G_t`` is the merged-path Gram.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from mergekit_ext.errors import TensorError
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

# The shared QP math lives in qp_solve (both objectives use it); re-exported here so
# ``qp_projection.solve_qp`` etc. keep working.
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
from mergekit_ext.methods.reports.qp import plot_qp, summarize_qp

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
