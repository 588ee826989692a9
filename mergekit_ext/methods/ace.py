"""ACE: data-free merging with adaptive covariance estimation.

"Data-Free Model Merging with Adaptive Covariance Estimation", arXiv 2603.02945 (CVPR 2026);
reference code: github.com/unravel-xu/ACE-Merging (``src/merge/strategy.py::ace_merging``).
The computation is written down in ``docs/methods.md`` (section ACE) step by step; the step
numbers in the comments refer to it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Optional

import torch
from mergekit.merge_methods import TensorGroup
from mergekit.merge_methods.base import BasePolicy, InputContract, OptionalTensorPolicy
from pydantic import Field

from mergekit_ext import merge_record
from mergekit_ext.errors import TensorError
from mergekit_ext.methods.card_sections.ace import plot_ace, summarize_ace
from mergekit_ext.methods.kinds import TENSORWISE
from mergekit_ext.methods.parameters import MethodParameters
from mergekit_ext.methods.registry import (
    MethodInfo,
    MethodReport,
    register_method,
    tensorwise_method,
)

NormalizeMode = Literal["auto", "always", "never"]
HeterogeneityRule = Literal["paper", "scale_invariant"]
_TINY = 1e-12


@dataclass
class AceTensorDiagnostics:
    gamma: float
    normalized: bool
    condition_number: float
    top5_energy_share: float
    log_energy_spread: float = float("nan")
    heterogeneity: str = "paper"

    def as_dict(self) -> dict:
        return {
            "gamma": self.gamma,
            "log_energy_spread": self.log_energy_spread,
            "heterogeneity": self.heterogeneity,
            "normalized": self.normalized,
            "condition_number": self.condition_number,
            "top5_energy_share": self.top5_energy_share,
        }


def heterogeneity(task_vectors: Sequence[torch.Tensor]) -> float:
    """Step 1: ``γ = Var_k(l_k) / (Mean_k(l_k)² + 1e-12)``, ``l_k = log(‖Δ_k‖_F² + 1e-12)``."""
    energies = torch.stack([tv.double().pow(2).sum() for tv in task_vectors])
    log_energy = torch.log(energies + _TINY)
    return float(log_energy.var(unbiased=True) / (log_energy.mean() ** 2 + _TINY))


def log_energy_spread(task_vectors: Sequence[torch.Tensor]) -> float:
    """Scale-invariant heterogeneity: ``Var_k(log ‖Δ_k‖²_F)`` (unbiased).

    Multiplying every ``Δ_k`` by ``c`` adds ``2 log c`` to every log energy and leaves the
    variance unchanged, unlike the paper's ``γ``, whose denominator ``Mean(l)²`` makes it
    vanish for small task vectors (real fine-tunes: ``‖Δ‖² ≪ 1``, ``|l|`` large) and explode
    near ``‖Δ‖ = 1``. A spread of ``s`` means the experts' energies differ by a factor of
    about ``exp(√s)`` (one standard deviation in log energy).
    """
    energies = torch.stack([tv.double().pow(2).sum() for tv in task_vectors])
    # a floor, not an offset: an added 1e-12 would break the invariance for small task vectors
    return float(torch.log(energies.clamp_min(1e-30)).var(unbiased=True))


def top_energy_share(matrix: torch.Tensor, fraction: float = 0.05) -> float:
    """Share of ``‖matrix‖_F²`` held by the top ``fraction`` of its singular values."""
    s = torch.linalg.svdvals(matrix.double())
    total = float(s.pow(2).sum())
    if total <= 0.0:
        return 0.0
    k = max(1, math.ceil(fraction * s.numel()))
    return float(s[:k].pow(2).sum()) / total


def _solve_right(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``M = B A⁻¹`` by a solve, falling back to the pseudo-inverse when A is singular."""
    try:
        m = torch.linalg.solve(a.T, b.T).T
        if torch.isfinite(m).all():
            return m
    except RuntimeError:  # torch.linalg.LinAlgError subclasses RuntimeError
        pass
    return b @ torch.linalg.pinv(a)


def ace_merge_tensor(
    base: torch.Tensor,
    experts: Sequence[torch.Tensor],
    *,
    eps: float = 1e-2,
    k_frac: float = 0.3,
    gamma_threshold: float = 0.3,
    normalize: NormalizeMode = "auto",
    scale: float = 1.0,
    heterogeneity_rule: HeterogeneityRule = "paper",
    spread_threshold: float = 0.1,
    name: str = "<tensor>",
) -> tuple[torch.Tensor, Optional[AceTensorDiagnostics]]:
    """Merge one 2-D linear weight (``out x in``) with ACE; float64 math, cast back at the end.

    Returns the merged weight and its diagnostics. Raises :class:`TensorError` (naming
    ``name``) for fewer than two experts, mismatched shapes or non-finite values.
    """
    if not 0.0 <= k_frac <= 1.0:  # ACEParameters checks YAML values; this guards direct calls
        raise ValueError(f"ace: k_frac = {k_frac} is outside its range [0, 1]")
    check_tensor_inputs(base, experts, name, "ACE")
    if base.ndim != 2:
        raise TensorError(f"ACE's covariance merge needs a 2-D weight; {name} is {base.ndim}-D")
    out_dtype = base.dtype
    w0 = base.double()
    deltas = [e.double() - w0 for e in experts]
    n_in = w0.shape[1]
    eye = torch.eye(n_in, dtype=torch.float64, device=w0.device)

    # Step 1: heterogeneity of the task-vector energies decides normalization.
    gamma = heterogeneity(deltas)
    spread = log_energy_spread(deltas)
    if heterogeneity_rule not in ("paper", "scale_invariant"):
        raise ValueError(
            f"ACE heterogeneity must be paper or scale_invariant; got {heterogeneity_rule!r}"
        )
    if normalize == "always":
        normalizing = True
    elif normalize == "never":
        normalizing = False
    elif normalize == "auto":
        if heterogeneity_rule == "paper":
            normalizing = gamma > gamma_threshold
        else:
            normalizing = spread > spread_threshold
    else:
        raise TensorError(f"ACE normalize must be auto, always or never; got {normalize!r}")

    # Step 2: row-centred task vectors and their input covariances.
    centred = [d - d.mean(dim=0, keepdim=True) for d in deltas]
    covs, ridges = [], []
    for c in centred:
        cov = c.T @ c
        trace = float(torch.trace(cov)) + _TINY
        covs.append(cov / trace if normalizing else cov)
        ridges.append(eps / trace if normalizing else eps)

    # Step 3: A = Σ (Σ_k + ε_k I) + C_agg ; B = Σ C_k (Σ_k + ε_k I).
    regularised = [cov + r * eye for cov, r in zip(covs, ridges)]
    a = torch.stack(regularised).sum(0)
    # C_agg: column means of the SUM over tasks of the (unregularised) covariances, as the
    # authors' code computes it (mean(sum(Sigmas), dim=0)), a 1 x in row added to every row
    covariance_sum = torch.stack(covs).sum(0)
    collective_prior = covariance_sum.mean(dim=0, keepdim=True)
    if normalizing:
        mean_energy = float(torch.stack([d.pow(2).sum() for d in deltas]).mean())
        collective_prior = collective_prior / (mean_energy + _TINY)
    a = a + collective_prior
    b = torch.stack([c @ reg for c, reg in zip(centred, regularised)]).sum(0)

    # Step 4: M = B A⁻¹.
    merged_update = _solve_right(b, a)
    condition_number = float(torch.linalg.cond(a))
    top5 = top_energy_share(merged_update)

    # Step 5: spectral refinement (normalizing only).
    if normalizing:
        k_experts = len(deltas)
        mean_cov = torch.stack(regularised).sum(0) / k_experts
        residual = torch.stack([d @ (cov - mean_cov) for d, cov in zip(deltas, covs)]).sum(0)
        u, s, vh = torch.linalg.svd(residual + merged_update, full_matrices=False)
        k = int(math.floor(k_frac * min(merged_update.shape)))
        if k > 0:
            merged_update = merged_update + s[:k].mean() * (u[:, :k] @ vh[:k, :])

    # Step 6: W = W_0 + scale · M.
    merged = (w0 + scale * merged_update).to(out_dtype)
    return merged, AceTensorDiagnostics(
        gamma, normalizing, condition_number, top5, spread, heterogeneity_rule
    )


def ace_merge_simple(
    base: torch.Tensor,
    experts: Sequence[torch.Tensor],
    *,
    scale: float = 1.0,
    name: str = "<tensor>",
) -> torch.Tensor:
    """Step 6 for 1-D tensors and embedding tables: ``W_0 + scale · mean_k Δ_k``."""
    check_tensor_inputs(base, experts, name, "ACE")
    return mean_task_vector_merge(base, experts, scale)


def mean_task_vector_merge(
    base: torch.Tensor, experts: Sequence[torch.Tensor], scale: float
) -> torch.Tensor:
    """``W_0 + scale · mean_k (W_k − W_0)`` in float64, cast back to ``base``'s dtype (the
    data-free methods' merge of the tensors they do not optimise)."""
    w0 = base.double()
    mean_delta = torch.stack([e.double() - w0 for e in experts]).mean(0)
    return (w0 + scale * mean_delta).to(base.dtype)


def check_tensor_inputs(
    base: torch.Tensor, experts: Sequence[torch.Tensor], name: str, method: str
) -> None:
    """At least two experts, every shape equal to the base's, no NaN/Inf (``TensorError``
    naming ``method``, the tensor and the input)."""
    if len(experts) < 2:
        raise TensorError(
            f"{method} needs at least two experts besides the base model; {name} has {len(experts)}"
        )
    for i, t in enumerate([base, *experts]):
        who = "the base model" if i == 0 else f"expert {i}"
        if t.shape != base.shape:
            raise TensorError(
                f"shape mismatch for {name}: {who} has {tuple(t.shape)}, the base has {tuple(base.shape)}"
            )
        if not torch.isfinite(t).all():
            raise TensorError(f"{name} of {who} contains NaN or Inf values; fix that checkpoint")


_EMBEDDING_MARKERS = ("embed", "wte", "wpe", "lm_head", "word_embeddings", "position_embedding")


def is_linear_weight(
    name: Optional[str], tensor: torch.Tensor, vocabulary_axis: Optional[int]
) -> bool:
    """A 2-D weight that is a linear map (not an embedding table or a vocabulary head)."""
    if tensor.ndim != 2 or vocabulary_axis is not None:
        return False
    lowered = (name or "").lower()
    return not any(marker in lowered for marker in _EMBEDDING_MARKERS)


class ACEParameters(MethodParameters):
    """ACE's parameters (``docs/methods.md``, section ACE)."""

    eps: float = Field(
        1e-2, gt=0.0, allow_inf_nan=False, description="ridge ε added to each task covariance"
    )
    k_frac: float = Field(
        0.3,
        ge=0.0,
        le=1.0,
        description="fraction of singular directions boosted by the spectral refinement",
    )
    gamma_threshold: float = Field(
        0.3,
        ge=0.0,
        allow_inf_nan=False,
        description="normalize the covariances when the heterogeneity γ exceeds this",
    )
    heterogeneity: HeterogeneityRule = Field(
        "paper",
        description="paper: normalize when γ = Var(log τ)/Mean(log τ)² > gamma_threshold (depends "
        "on the task vectors' absolute size) | scale_invariant: when Var(log τ) > spread_threshold",
    )
    # the default's evidence: docs/methods.md, section ACE
    spread_threshold: float = Field(
        0.1,
        ge=0.0,
        allow_inf_nan=False,
        description="threshold of the scale-invariant rule on Var_k(log ‖Δ_k‖²)",
    )
    normalize: NormalizeMode = Field(
        "auto", description="auto | always | never: override the γ test"
    )
    scale: float = Field(1.0, allow_inf_nan=False, description="merged W = W_0 + scale · M")


def ace_kernel(group: TensorGroup, parameters: ACEParameters) -> torch.Tensor:
    """mergekit kernel: one tensor group → :func:`ace_merge_tensor` (or the simple mean)."""
    name = group.metadata.name or "<tensor>"
    if group.base is None:
        raise TensorError(f"ACE needs base_model (the pretrained model); none given for {name}")
    base = group.base.tensor
    experts = [e.tensor for e in group.non_base]
    if not is_linear_weight(name, base, group.metadata.vocabulary_axis):
        return ace_merge_simple(base, experts, scale=parameters.scale, name=name)
    merged, diag = ace_merge_tensor(
        base,
        experts,
        eps=parameters.eps,
        k_frac=parameters.k_frac,
        gamma_threshold=parameters.gamma_threshold,
        normalize=parameters.normalize,
        scale=parameters.scale,
        heterogeneity_rule=parameters.heterogeneity,
        spread_threshold=parameters.spread_threshold,
        name=name,
    )
    merge_record.record_item("ace", "tensors", name, diag.as_dict())
    return merged


INFO = MethodInfo(
    name="ace",
    pretty_name="ACE (Adaptive Covariance Estimation)",
    kind=TENSORWISE,
    needs_calibration=False,
    paper="Data-Free Model Merging with Adaptive Covariance Estimation (CVPR 2026)",
    paper_url="https://arxiv.org/abs/2603.02945",
    parameters_model=ACEParameters,
    report=MethodReport("ACE", summarize_ace, plot_ace, template="ace"),
)

ace_merge = tensorwise_method(
    INFO,
    ace_kernel,
    contract=InputContract(base=BasePolicy.REQUIRED, min_inputs=2),
    # an optional tensor only the base has (an old buffer such as embeddings.position_ids
    # that experts saved by transformers 5 lack) is taken from the base, as mergekit does
    optional_tensor_policy=OptionalTensorPolicy.PASSTHROUGH_BASE_SINGLETON,
)
register_method(INFO, ace_merge)
