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
from typing import Any, Literal, Optional

import torch
from pydantic import Field, field_validator, model_validator

from mergekit_ext.errors import TensorError
from mergekit_ext.methods.guard import expert_norms, guard_group, max_norm_ratio_field, norm_ratios
from mergekit_ext.methods.layerwise import (
    LayerwiseMethod,
    LinearGroup,
    ModelOutputFit,
    ModelOutputRequest,
    StatisticsRequest,
)
from mergekit_ext.methods.parameters import (
    ComputeDtype,
    MethodParameters,
    StatisticsDtype,
    compute_dtype_field,
    statistics_dtype_field,
)
from mergekit_ext.methods.qp_model_output import QPModelOutputFit

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


OBJECTIVES: tuple[str, ...] = ("layer_output", "model_output")
# --------------------------------------------------------------------------------------
# The executor-facing method
# --------------------------------------------------------------------------------------


class QPParameters(MethodParameters):
    """QP / output-space projection's parameters (``docs/methods.md``, section QP).

    Defaults (``basis: diagonal``, ``prior: 1``, ``ridge: 1``) were chosen by the committed
    sweep ``benchmarks/results/sweep_*_qp``: pulling d toward task arithmetic instead of the
    base raised the vision suite from 58.9% to 64.2% and cost 1 point on the LM suite."""

    basis: Literal["diagonal", "residual_eigen"] = Field(
        "diagonal",
        description="diagonal | residual_eigen: output basis U (identity rows, or eigenvectors "
        "of the residual energy matrix S in descending order, the paper's optimal basis)",
    )
    ridge: float = Field(
        1.0,
        ge=0.0,
        allow_inf_nan=False,
        description="relative ridge: μ = ridge · mean diagonal of the K×K normal matrices, "
        "added to each; it pulls d toward prior",
    )
    bounds: Optional[tuple[float, float]] = Field(
        None,
        description="optional [lo, hi] box on every coefficient d (a true QP); null = unconstrained",
    )
    prior: float = Field(
        1.0,
        allow_inf_nan=False,
        description="the coefficient the ridge pulls d toward, (N_r + μI) d_r = h_r + μ·prior·1: "
        "0 = the base model, 1 = task arithmetic λ=1",
    )
    energy_floor: float = Field(
        0.0,
        ge=0.0,
        allow_inf_nan=False,
        description="directions whose residual energy is below energy_floor · the mean energy "
        "per direction are not fitted and keep d = prior",
    )
    task_weighting: Literal["samples", "energy"] = Field(
        "samples",
        description="samples | energy: tasks count equally per sample (1/N_t), or each task's "
        "Gram is scaled so that every task has the same residual energy at the weight",
    )
    propagate: bool = Field(
        True,
        description="inputs (and residuals) along the already merged layers (merged-path statistics)",
    )
    diagnose_both_bases: bool = Field(
        False, description="also solve in the other basis and report its J and captured energy"
    )
    fallback: Literal["mean", "base", "task_arithmetic"] = Field(
        "mean",
        description="mean | base | task_arithmetic: merge of tensors that are not input-hooked "
        "linears",
    )

    statistics_dtype: StatisticsDtype = statistics_dtype_field()
    compute_dtype: ComputeDtype = compute_dtype_field()
    max_norm_ratio: float = max_norm_ratio_field()

    objective: Literal["layer_output", "model_output"] = Field(
        "layer_output",
        description="layer_output | model_output: fit each linear to its own output (streamed "
        "block by block), or to the model's output, the paper's objective (whole model in "
        "memory; diagonal basis; causal LMs: the per-token KL to each expert)",
    )
    output_sketch: int = Field(
        32,
        ge=0,
        description="model_output: random projections of each sample's output (one backward "
        "pass each per linear); 0 = every output coordinate (exact); causal LMs: next tokens "
        "sampled per position (>= 1)",
    )
    output_tokens: Literal["first", "all"] = Field(
        "first",
        description="model_output: the output is the backbone's last hidden state at the "
        "first position (CLS, what classification heads read) or at every unmasked position "
        "(causal LMs: always every position's next-token distribution)",
    )
    output_seed: int = Field(0, ge=0, description="model_output: seed of the output sketches")

    @field_validator("bounds")
    @classmethod
    def _ordered(cls, bounds: Optional[tuple[float, float]]) -> Optional[tuple[float, float]]:
        if bounds is not None and not bounds[0] <= bounds[1]:
            raise ValueError(f"bounds must be [lo, hi] with lo <= hi; got {list(bounds)}")
        return bounds

    @model_validator(mode="after")
    def _objective_options(self) -> QPParameters:
        if self.objective == "layer_output":
            given = sorted(
                {"output_sketch", "output_tokens", "output_seed"} & self.model_fields_set
            )
            if given:
                raise ValueError(
                    f"{', '.join(given)}: used only with objective: model_output "
                    "(the objective is layer_output)"
                )
            return self
        unsupported = {
            "basis": (self.basis != "diagonal", "only the diagonal basis is implemented"),
            "energy_floor": (
                self.energy_floor != 0.0,
                "the model-output QP is one dense system, without per-direction energies",
            ),
            "task_weighting": (
                self.task_weighting != "samples",
                "tasks are weighted by their samples (1/N_t)",
            ),
            "propagate": (not self.propagate, "the output is always that of the merged model"),
            "diagnose_both_bases": (self.diagnose_both_bases, "only the diagonal basis exists"),
            "max_norm_ratio": (
                "max_norm_ratio" in self.model_fields_set,
                "the result guard is the layer objective's; the model-output fit warns when "
                "its coefficients leave the experts",
            ),
        }
        bad = [f"{name} ({why})" for name, (is_set, why) in unsupported.items() if is_set]
        if bad:
            raise ValueError(
                "objective: model_output does not support " + "; ".join(bad) + "; remove them"
            )
        return self


class QPProjectionMethod(LayerwiseMethod):
    """QP / output-space projection (arXiv 2605.29101) on the sequential executor.

    Each weight of a group is its own problem (q, k, v share the input Gram but not the
    residuals). With ``propagate`` (default) the Grams are the merged-path statistics.
    Non-linear tensors: the fallback merge, ``mean`` of experts by default as in RegMean/CoM
    (equal to task arithmetic at λ = 1/K, the QP's neutral feasible point).
    """

    name = "qp_projection"
    parameters_model = QPParameters

    def statistics_request(self, parameters: Any) -> StatisticsRequest:
        resolved = self.parse(parameters)
        if resolved.objective == "model_output":
            return StatisticsRequest(
                propagate=False,
                expert_path=False,
                model_output=ModelOutputRequest(
                    sketch_rows=resolved.output_sketch,
                    tokens=resolved.output_tokens,
                    seed=resolved.output_seed,
                ),
            )
        return StatisticsRequest(
            propagate=resolved.propagate,
            expert_path=not resolved.propagate,
            statistics_dtype=getattr(torch, resolved.statistics_dtype),
            compute_dtype=resolved.compute_dtype,
        )

    def model_output_fit(
        self,
        name: str,
        base: torch.Tensor,
        experts: Sequence[torch.Tensor],
        task_names: Sequence[str],
        parameters: Any,
    ) -> ModelOutputFit:
        resolved = self.parse(parameters)
        return QPModelOutputFit(
            name,
            base,
            experts,
            task_names,
            ridge=resolved.ridge,
            prior=resolved.prior,
            bounds=resolved.bounds,
        )

    def merge_linear_group(
        self, group: LinearGroup, parameters: Any
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        resolved = self.parse(parameters)
        if resolved.objective == "model_output":
            raise TensorError(
                f"qp_projection with objective: model_output fits {group.name} to the model's "
                "output; the executor must run its whole-model path (statistics_request)"
            )
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
        # layer_output only: the model-output fit has its own coefficient warning
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


INFO = MethodInfo(
    name="qp_projection",
    pretty_name="QP / output-space projection",
    kind="layerwise",
    needs_calibration=True,
    paper="Model Merging by Output-Space Projection (Evans, Etheridge, Roberts, Tanner, 2026)",
    paper_url="https://arxiv.org/abs/2605.29101",
    parameters_model=QPParameters,
    implementation=QPProjectionMethod(),
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
    "QPNormalEquations",
    "QPParameters",
    "QPProjectionMethod",
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
