"""QP projection with the paper's model-output objective (``objective: model_output``).

arXiv 2605.29101 states the QP at the *model's output*: each linear's coefficients ``d``
(diagonal basis, ``δ(d) = Σ_k diag(d_k) Δ_k``) minimise ``J(d) = Σ_j w_j ‖A_j d + b_j‖²``,
``b_j`` the error of the model merged so far against task t's expert on sample j and ``A_j``
the linearised effect of each masked update on the output, recomputed after each merged
linear (``docs/methods.md``, "The model-output objective", has the derivation, the sketch and
the costs). ``qp_projection``'s default objective fits each linear to its own output instead
(``qp_projection.py``).

Here: the sketched design rows ``S A_j`` from the executor's vector-Jacobian products
(:func:`output_design`, ``[B, P, m·K]``, column ``r·K + k``), their float64 running sums
(:class:`OutputNormalEquations`: one dense ``mK x mK`` quadratic, as J does not separate by
direction), the solve by ``qp_solve`` (:class:`QPModelOutputFit`: the same relative ridge,
prior and box as the layer objective) and the implementation the executor calls
(:class:`QPModelOutputMethod`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Optional

import torch

from mergekit_ext.errors import TensorError
from mergekit_ext.methods import qp_solve as qp
from mergekit_ext.methods.layerwise import (
    LayerwiseMethod,
    LinearGroup,
    ModelOutputFit,
    ModelOutputRequest,
    StatisticsRequest,
)
from mergekit_ext.methods.qp_parameters import QPModelOutputParameters

LOG = logging.getLogger(__name__)

_COMPUTE_DTYPE = torch.float64
# |d| beyond this (d = 1 is an expert's full update) means the fit left the experts: on the
# LM and text suites such unbounded fits diverged where bounds [0, 1] held
# (docs/methods.md, "What was measured on the LM suite")
FAR_COEFFICIENT = 10.0


def output_design(output_grads: torch.Tensor, projected: torch.Tensor) -> torch.Tensor:
    """The sketched design rows ``S A_j`` of a batch (see the module docstring).

    Args:
        output_grads: ``[P, B, T, m]``, row p = ``∂(s_p · f)/∂z`` per sample and token.
        projected: ``[K, B, T, m]``, ``Δ_k x_τ`` per update, sample and token.

    Returns:
        ``[B, P, m·K]`` (float64): ``A[b, p, r·K + k] = Σ_τ g_p[b, τ, r] (Δ_k x_τ)[b, τ, r]``.
    """
    if output_grads.shape[1:] != projected.shape[1:]:
        raise TensorError(
            f"output gradients {tuple(output_grads.shape)} and projected updates "
            f"{tuple(projected.shape)} must agree in [B, T, m]"
        )
    design = torch.einsum(
        "pbtr,kbtr->bprk", output_grads.to(_COMPUTE_DTYPE), projected.to(_COMPUTE_DTYPE)
    )
    return design.reshape(design.shape[0], design.shape[1], -1)


class OutputNormalEquations:
    """Running sums ``N = Σ_j w_j A_jᵀ A_j``, ``h = −Σ_j w_j A_jᵀ b_j``, ``e = Σ_j w_j ‖b_j‖²``
    (float64), over batches of design rows."""

    def __init__(self, columns: int, device: Any = None) -> None:
        self.normal = torch.zeros(columns, columns, dtype=_COMPUTE_DTYPE, device=device)
        self.rhs = torch.zeros(columns, dtype=_COMPUTE_DTYPE, device=device)
        self.energy = torch.zeros((), dtype=_COMPUTE_DTYPE, device=device)
        self.samples = 0

    def add(
        self,
        design: torch.Tensor,
        residual: torch.Tensor,
        sample_weight: float,
        linear_term: Optional[torch.Tensor] = None,
    ) -> None:
        """Add a batch: ``design`` ``[B, P, n]``, ``residual`` ``[B, P]``, weight ``w`` each.

        ``√w`` scales the rows, so ``N += Σ_rows (√w a)(√w a)ᵀ`` is one matrix product.
        ``linear_term`` (``[B, n]``, ``A_jᵀ b_j`` computed exactly) replaces the sketched
        ``Σ_p a_p b_p`` in ``h``; the sketched residuals still give ``e``."""
        if design.shape[:2] != residual.shape or design.shape[-1] != self.rhs.shape[0]:
            raise TensorError(
                f"design {tuple(design.shape)} and residual {tuple(residual.shape)} do not fit "
                f"{self.rhs.shape[0]} coefficients"
            )
        if sample_weight <= 0 or not math.isfinite(sample_weight):
            raise TensorError(f"sample weights must be finite and > 0; got {sample_weight}")
        scale = math.sqrt(sample_weight)
        rows = design.to(_COMPUTE_DTYPE).reshape(-1, design.shape[-1]) * scale
        targets = residual.to(_COMPUTE_DTYPE).reshape(-1) * scale
        self.normal += rows.T @ rows
        if linear_term is None:
            self.rhs -= rows.T @ targets
        else:
            self.rhs -= linear_term.to(_COMPUTE_DTYPE).sum(0) * sample_weight
        self.energy += targets @ targets
        self.samples += int(design.shape[0])

    def equations(self, k_updates: int) -> qp.QPNormalEquations:
        """The sums as ``qp_projection``'s :class:`QPNormalEquations`: one dense direction."""
        normal = (self.normal + self.normal.T) / 2
        return qp.QPNormalEquations(
            normal.unsqueeze(0),
            self.rhs.unsqueeze(0).clone(),
            self.energy.reshape(1).clone(),
            None,
            f"model_output (K={k_updates})",
        )


class QPModelOutputFit(ModelOutputFit):
    """One linear's model-output QP (diagonal basis): sums of design rows, then the
    ridge/prior/box solve of ``qp_projection`` (see the module docstring)."""

    def __init__(
        self,
        name: str,
        base: torch.Tensor,
        experts: Sequence[torch.Tensor],
        task_names: Sequence[str],
        *,
        ridge: float,
        prior: float,
        bounds: Optional[Sequence[float]],
    ) -> None:
        qp._check_weight_inputs(base, experts, None, name)
        self.name = name
        self.base = base
        self.task_names = list(task_names)
        self.w0 = base.to(_COMPUTE_DTYPE)
        self.task_vectors = [e.to(_COMPUTE_DTYPE) - self.w0 for e in experts]
        self.ridge, self.prior, self.bounds = ridge, prior, bounds
        out_dim = base.shape[0]
        self.sums = OutputNormalEquations(out_dim * len(experts), device=base.device)
        # Δ_k stacked for one product per batch: [K·m, in]
        self._stacked = torch.cat(self.task_vectors)

    def add_batch(
        self,
        inputs: torch.Tensor,
        output_grads: torch.Tensor,
        residual: torch.Tensor,
        sample_weight: float,
        error_grad: Optional[torch.Tensor] = None,
    ) -> None:
        k_dim, out_dim = len(self.task_vectors), self.base.shape[0]
        batch, tokens = inputs.shape[0], inputs.shape[1]
        projected = inputs.to(_COMPUTE_DTYPE) @ self._stacked.T  # [B, T, K·m]
        projected = projected.reshape(batch, tokens, k_dim, out_dim).permute(2, 0, 1, 3)
        linear_term = None
        if error_grad is not None:
            linear_term = output_design(error_grad.unsqueeze(0), projected)[:, 0]
        self.sums.add(output_design(output_grads, projected), residual, sample_weight, linear_term)

    def solve(self) -> tuple[torch.Tensor, dict[str, Any]]:
        k_dim, out_dim = len(self.task_vectors), self.base.shape[0]
        equations = self.sums.equations(k_dim)
        solution = qp.solve_qp(equations, ridge=self.ridge, bounds=self.bounds, prior=self.prior)
        j_zero = qp.base_energy(equations)
        j_opt = qp.qp_objective(equations, solution.d)
        n, device = out_dim * k_dim, equations.normal.device
        j_task_arithmetic = {
            "1/K": qp.qp_objective(
                equations, qp.task_arithmetic_coefficients(n, 1 / k_dim, device)
            ),
            "1": qp.qp_objective(equations, qp.task_arithmetic_coefficients(n, 1.0, device)),
        }
        d = solution.d.reshape(out_dim, k_dim)  # column r·K + k is d[r, k]
        largest = float(d.abs().max()) if d.numel() else 0.0
        if self.bounds is None and largest > FAR_COEFFICIENT:
            LOG.warning(
                "%s: model-output coefficients up to %.3g (1 = an expert's full update): the "
                "fit has too few rows for its %d coefficients and leaves the experts; use "
                "bounds: [0, 1], more calibration samples or output_sketch, or a larger ridge",
                self.name,
                largest,
                n,
            )
        merged = (self.w0 + qp.merged_update(self.task_vectors, d)).to(self.base.dtype)
        if not torch.isfinite(merged).all():
            raise TensorError(
                f"the model-output QP merge of {self.name} produced NaN/Inf; raise ridge"
            )
        lo, hi = (-math.inf, math.inf) if self.bounds is None else self.bounds
        diagnostics: dict[str, Any] = {
            "basis": "diagonal",
            "objective": "model_output",
            "J0": j_zero,
            "J_opt": j_opt,
            "captured_energy": qp.captured_energy_fraction(
                j_opt, j_zero, zero_feasible=lo <= 0.0 <= hi and self.prior == 0.0
            ),
            "J_task_arithmetic": j_task_arithmetic,
            "d_stats": qp.coefficient_stats(d, self.task_names),
            "samples": self.sums.samples,
            "mu": solution.mu,
            "pinv_directions": solution.fallback_rows,
        }
        diagnostics.update(qp.box_diagnostics(solution))
        return merged, diagnostics


class QPModelOutputMethod(LayerwiseMethod):
    """QP with the model-output objective: the executor's whole-model path
    (``StatisticsRequest.model_output``) feeds one :class:`QPModelOutputFit` per linear."""

    name = "qp_projection"
    parameters_model = QPModelOutputParameters

    def statistics_request(self, parameters: Any) -> StatisticsRequest:
        resolved = self.parse(parameters)
        return StatisticsRequest(
            propagate=False,
            expert_path=False,
            model_output=ModelOutputRequest(
                sketch_rows=resolved.output_sketch,
                tokens=resolved.output_tokens,
                seed=resolved.output_seed,
            ),
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
        raise TensorError(
            f"qp_projection with objective: model_output fits {group.name} to the model's "
            "output; the executor must run its whole-model path (statistics_request)"
        )
