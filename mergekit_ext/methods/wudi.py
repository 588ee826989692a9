"""WUDI-Merging: data-free merging that lets the task vectors remove their own interference.

"Whoever Started the Interference Should End It: Guiding Data-Free Model Merging via Task
Vectors", Cheng et al., arXiv 2503.08099 (ICML 2025); reference code:
github.com/nathanielyvo/WUDI-Merging (``wudi_main.py::get_redundant_task_vector``). The
computation is written down in ``docs/methods.md`` (section WUDI).

For one linear weight (``out x in``) with task vectors ``τ_k = W_k − W_0`` the merged task
vector ``τ`` minimises, by Adam from ``τ = Σ_k τ_k``,

    L(τ) = Σ_k ‖(τ − τ_k) τ_kᵀ‖²_F / ‖τ_k‖²_F.

The closed form computed here, ``L(τ) = tr(τ A τᵀ) − 2 ⟨τ, B⟩ + c`` with
``A = Σ_k G_k / n_k``, ``B = Σ_k τ_k G_k / n_k`` (``G_k = τ_kᵀ τ_k``, ``n_k = ‖τ_k‖²_F``) and
``∇L(τ) = 2 (τ A − B)``, is derived in ``docs/methods.md`` (section WUDI).

The authors' code forms the ``K x out x out`` products ``(τ − τ_k) τ_kᵀ`` and
back-propagates through them at every step; the gradient above is the same quantity (up to
rounding) at the cost of one ``out x in`` by ``in x in`` product per step, and of an
``out x r`` by ``r x in`` pair when ``A = U Uᵀ`` has rank ``r ≤ in / 2`` (LoRA experts:
``r ≤ K · rank``). ``A``, ``B``, ``c`` and the reported losses are float64; the Adam
iterations run in ``dtype`` (float32 by default, as the authors run them). Adam is written
out (the same operations, in the same order, as ``torch.optim.Adam`` with
``weight_decay = 0``) so that no autograd graph is built; nothing is random.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch
from mergekit.merge_methods import TensorGroup
from mergekit.merge_methods.base import BasePolicy, InputContract, OptionalTensorPolicy
from pydantic import Field

from mergekit_ext import merge_record
from mergekit_ext.errors import TensorError
from mergekit_ext.methods.ace import check_tensor_inputs, is_linear_weight, mean_task_vector_merge
from mergekit_ext.methods.kinds import TENSORWISE
from mergekit_ext.methods.parameters import MethodParameters
from mergekit_ext.methods.registry import (
    MethodInfo,
    MethodReport,
    register_method,
    tensorwise_method,
)
from mergekit_ext.plots import (
    Plot,
    as_float,
    finite,
    layer_ticks,
    new_figure,
    save_figure,
    summary_stats,
)

LOG = logging.getLogger(__name__)

InitMode = Literal["sum", "mean"]
OtherTensors = Literal["mean", "base"]
IterationDtype = Literal["float32", "float64"]
_DTYPES = {"float32": torch.float32, "float64": torch.float64}
CURVE_POINTS = 20  # loss recorded at about this many steps (plus the start) per tensor


# ----------------------------------------------------------------------------- the math


@dataclass(frozen=True)
class InterferenceQuadratic:
    """``L(τ) = tr(τ A τᵀ) − 2 ⟨τ, B⟩ + c`` (float64), and ``A``'s factor when it is low-rank.

    ``factor`` is ``U`` (``in x r``) with ``A = U Uᵀ`` when ``r ≤ in / 2``, else None.
    ``tasks`` counts the task vectors that enter the loss (an all-zero one has no term).
    """

    a: torch.Tensor
    b: torch.Tensor
    c: float
    rank: int
    factor: Optional[torch.Tensor]
    tasks: int

    def loss(self, tau: torch.Tensor) -> float:
        """``L(τ)`` in float64."""
        t = tau.double()
        return float((t * (_times_a(t, self.a, self.factor) - 2.0 * self.b)).sum()) + self.c


def _times_a(
    tau: torch.Tensor, a: Optional[torch.Tensor], u: Optional[torch.Tensor]
) -> torch.Tensor:
    """``τ A``: through the factor ``A = U Uᵀ`` when there is one (two thin products)."""
    return (tau @ u) @ u.T if u is not None else tau @ a


def interference_quadratic(
    task_vectors: Sequence[torch.Tensor], rank_tolerance: Optional[float] = None
) -> InterferenceQuadratic:
    """``A``, ``B`` and ``c`` of WUDI's loss for 2-D task vectors (``out x in``), float64.

    Args:
        task_vectors: ``τ_k = W_k − W_0``, all of the same 2-D shape.
        rank_tolerance: eigenvalues of ``A`` below ``rank_tolerance · λ_max`` count as zero
            for the factor (default ``in · ε_float64``). The iterations pass their dtype's ε:
            dropping those directions changes ``τ A`` by less than that dtype's own rounding
            of the product, and finds the low rank of LoRA experts stored in float32 or
            bfloat16, whose rounding noise makes ``A`` numerically full-rank in float64.

    Returns:
        The quadratic; a task vector with ``‖τ_k‖ = 0`` contributes no term (the authors'
        ``0 / 0`` would make the loss NaN).
    """
    taus = [t.double() for t in task_vectors]
    n_in = taus[0].shape[1]
    a = torch.zeros(n_in, n_in, dtype=torch.float64, device=taus[0].device)
    b = torch.zeros_like(taus[0])
    c = 0.0
    tasks = 0
    for tau in taus:
        n_k = float(tau.pow(2).sum())
        if n_k == 0.0:
            continue
        tasks += 1
        gram_in = tau.T @ tau
        a += gram_in / n_k
        # B's term τ_k G_k = (τ_k τ_kᵀ) τ_k and c's ‖G_k‖² = ‖τ_k τ_kᵀ‖²: the smaller Gram
        if tau.shape[0] < n_in:
            gram_out = tau @ tau.T
            b += (gram_out @ tau) / n_k
            c += float(gram_out.pow(2).sum()) / n_k
        else:
            b += (tau @ gram_in) / n_k
            c += float(gram_in.pow(2).sum()) / n_k
    a = (a + a.T) / 2  # exactly symmetric, for eigh
    factor = None
    rank = 0
    if tasks:
        evals, evecs = torch.linalg.eigh(a)
        top = float(evals[-1])
        tolerance = (
            n_in * torch.finfo(torch.float64).eps if rank_tolerance is None else rank_tolerance
        )
        keep = evals > top * tolerance
        rank = int(keep.sum())
        if rank <= n_in // 2:
            factor = evecs[:, keep] * evals[keep].sqrt()
    return InterferenceQuadratic(a, b, c, rank, factor, tasks)


@dataclass
class WudiTensorDiagnostics:
    initial_loss: float
    final_loss: float
    relative_reduction: float
    norm_ratio: float
    rank: int
    steps: int
    curve_steps: list[int] = field(default_factory=list)
    curve: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "initial_loss": self.initial_loss,
            "final_loss": self.final_loss,
            "relative_reduction": self.relative_reduction,
            "norm_ratio": self.norm_ratio,
            "rank": self.rank,
            "steps": self.steps,
            "curve_steps": self.curve_steps,
            "curve": self.curve,
        }


def adam_minimise(
    quadratic: InterferenceQuadratic,
    init: torch.Tensor,
    *,
    steps: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    dtype: torch.dtype = torch.float32,
    curve_every: int = 0,
) -> tuple[torch.Tensor, list[int], list[float]]:
    """``steps`` Adam steps on ``L`` from ``init``; torch.optim.Adam's update, written out.

    Per step ``t`` (from 1): ``g = 2 (τ A − B)``; ``m ← m + (1 − β₁)(g − m)``;
    ``v ← β₂ v + (1 − β₂) g²``; ``τ ← τ − (lr / (1 − β₁ᵗ)) · m / (√v / √(1 − β₂ᵗ) + eps)``.

    Args:
        quadratic: the loss (:func:`interference_quadratic`).
        init: the starting ``τ`` (``out x in``).
        steps, lr, beta1, beta2, eps: Adam's settings.
        dtype: the dtype of the iterations.
        curve_every: record ``L`` every this many steps (0: never).

    Returns:
        The final ``τ`` (in ``dtype``), and the steps and losses recorded (``L`` at the
        iterate before step ``t`` is recorded as step ``t − 1``; the final one as ``steps``).
    """
    tau = init.to(dtype).clone()
    # 2A, 2B (or U and 2Uᵀ): scaling by 2 is exact, so g = τ(2A) − 2B is 2(τA − B) bit for bit
    if quadratic.factor is None:
        a2, u, u2t = 2.0 * quadratic.a.to(dtype), None, None
    else:
        a2, u = None, quadratic.factor.to(dtype)
        u2t = 2.0 * u.T
    b2 = 2.0 * quadratic.b.to(dtype)
    exp_avg = torch.zeros_like(tau)
    exp_avg_sq = torch.zeros_like(tau)
    grad = torch.empty_like(tau)
    denom = torch.empty_like(tau)
    b2_64 = 2.0 * quadratic.b.double()
    curve_steps: list[int] = []
    curve: list[float] = []
    for step in range(1, steps + 1):
        if u is None:
            torch.matmul(tau, a2, out=grad)
        else:
            torch.matmul(tau @ u, u2t, out=grad)
        if curve_every and (step - 1) % curve_every == 0:
            curve_steps.append(step - 1)
            # ⟨τ, τA − 2B⟩ + c, reduced in float64 from the product the step needs anyway
            curve.append(float((tau.double() * (grad.double() / 2 - b2_64)).sum()) + quadratic.c)
        grad.sub_(b2)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        torch.sqrt(exp_avg_sq, out=denom).div_(bias_correction2**0.5).add_(eps)
        tau.addcdiv_(exp_avg, denom, value=-step_size)
    if curve_every:
        curve_steps.append(steps)
        curve.append(quadratic.loss(tau))
    return tau, curve_steps, curve


def wudi_merge_tensor(
    base: torch.Tensor,
    experts: Sequence[torch.Tensor],
    *,
    steps: int = 300,
    lr: float = 1e-5,
    beta1: float = 0.9,
    beta2: float = 0.999,
    adam_eps: float = 1e-8,
    init: InitMode = "sum",
    scaling: float = 1.0,
    dtype: IterationDtype = "float32",
    name: str = "<tensor>",
) -> tuple[torch.Tensor, WudiTensorDiagnostics]:
    """Merge one 2-D linear weight (``out x in``) with WUDI: ``W_0 + scaling · τ``.

    Returns the merged weight (in ``base``'s dtype) and its diagnostics. Raises
    :class:`TensorError` (naming ``name``) for fewer than two experts, mismatched shapes,
    non-finite values or a weight that is not 2-D.
    """
    check_tensor_inputs(base, experts, name, "WUDI")
    if base.ndim != 2:
        raise TensorError(f"WUDI's interference loss needs a 2-D weight; {name} is {base.ndim}-D")
    if init not in ("sum", "mean"):
        raise ValueError(f"wudi: init must be sum or mean; got {init!r}")
    w0 = base.double()
    taus = [e.double() - w0 for e in experts]
    start = torch.stack(taus).sum(0)
    if init == "mean":
        start = start / len(taus)
    iteration_dtype = _DTYPES[dtype]
    quadratic = interference_quadratic(
        taus, None if iteration_dtype == torch.float64 else torch.finfo(iteration_dtype).eps
    )
    initial = quadratic.loss(start)
    curve_every = max(1, steps // CURVE_POINTS)
    if quadratic.tasks == 0:  # every task vector is zero: nothing to merge
        tau, curve_steps, curve = start, [0, steps], [0.0, 0.0]
    else:
        tau, curve_steps, curve = adam_minimise(
            quadratic,
            start,
            steps=steps,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=adam_eps,
            dtype=iteration_dtype,
            curve_every=curve_every,
        )
    final = curve[-1]
    start_norm = float(start.norm())
    diag = WudiTensorDiagnostics(
        initial_loss=initial,
        final_loss=final,
        relative_reduction=1.0 - final / initial if initial > 0 else math.nan,
        norm_ratio=float(tau.double().norm()) / start_norm if start_norm > 0 else math.nan,
        rank=quadratic.rank,
        steps=steps,
        curve_steps=curve_steps,
        curve=[v / initial if initial > 0 else math.nan for v in curve],
    )
    merged = (w0 + scaling * tau.double()).to(base.dtype)
    return merged, diag


def wudi_merge_simple(
    base: torch.Tensor,
    experts: Sequence[torch.Tensor],
    *,
    other_tensors: OtherTensors = "mean",
    scaling: float = 1.0,
    name: str = "<tensor>",
) -> torch.Tensor:
    """Tensors WUDI does not optimise: ``W_0 + scaling · mean_k τ_k`` (``mean``) or ``W_0``."""
    check_tensor_inputs(base, experts, name, "WUDI")
    if other_tensors == "base":
        return base.clone()
    return mean_task_vector_merge(base, experts, scaling)


# ----------------------------------------------------------------------------- parameters


class WUDIParameters(MethodParameters):
    """WUDI's parameters (``docs/methods.md``, section WUDI); defaults are the authors' code."""

    steps: int = Field(300, ge=1, le=100_000, description="Adam steps per linear weight")
    lr: float = Field(1e-5, gt=0.0, le=1.0, allow_inf_nan=False, description="Adam learning rate")
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="Adam's first-moment decay β₁")
    beta2: float = Field(0.999, ge=0.0, lt=1.0, description="Adam's second-moment decay β₂")
    adam_eps: float = Field(
        1e-8, gt=0.0, allow_inf_nan=False, description="Adam's denominator epsilon"
    )
    init: InitMode = Field(
        "sum", description="start from the sum of the task vectors (authors) or their mean"
    )
    scaling: float = Field(
        1.0, allow_inf_nan=False, description="merged W = W_0 + scaling · τ (every tensor)"
    )
    other_tensors: OtherTensors = Field(
        "mean",
        description="tensors that are not linear weights (1-D, embeddings): mean task vector "
        "(FusionBench) | base: keep the base model's (the authors' ViT code)",
    )
    dtype: IterationDtype = Field(
        "float32", description="dtype of the Adam iterations (the loss is reported in float64)"
    )


# ----------------------------------------------------------------------------- mergekit side


def wudi_kernel(group: TensorGroup, parameters: WUDIParameters) -> torch.Tensor:
    """mergekit kernel: one tensor group → :func:`wudi_merge_tensor` (or the simple rule)."""
    name = group.metadata.name or "<tensor>"
    if group.base is None:
        raise TensorError(f"WUDI needs base_model (the pretrained model); none given for {name}")
    base = group.base.tensor
    experts = [e.tensor for e in group.non_base]
    if not is_linear_weight(name, base, group.metadata.vocabulary_axis):
        return wudi_merge_simple(
            base,
            experts,
            other_tensors=parameters.other_tensors,
            scaling=parameters.scaling,
            name=name,
        )
    merged, diag = wudi_merge_tensor(
        base,
        experts,
        steps=parameters.steps,
        lr=parameters.lr,
        beta1=parameters.beta1,
        beta2=parameters.beta2,
        adam_eps=parameters.adam_eps,
        init=parameters.init,
        scaling=parameters.scaling,
        dtype=parameters.dtype,
        name=name,
    )
    LOG.debug("wudi %s: loss %.4g → %.4g", name, diag.initial_loss, diag.final_loss)
    merge_record.record_item("wudi", "tensors", name, diag.as_dict())
    return merged


# ----------------------------------------------------------------------------- model card


def summarize_wudi(section: Mapping[str, Any], parameters: Any) -> dict[str, Any]:
    """The card's table: settings, and the loss reduction over the optimised weights."""
    tensors: Mapping[str, Mapping[str, Any]] = section.get("tensors") or {}
    reductions = {n: as_float(r.get("relative_reduction")) for n, r in tensors.items()}
    finite_reductions = {n: v for n, v in reductions.items() if math.isfinite(v)}
    stats = summary_stats(list(reductions.values()))
    ratios = summary_stats([as_float(r.get("norm_ratio")) for r in tensors.values()])
    initial = sum(finite([as_float(r.get("initial_loss")) for r in tensors.values()]))
    final = sum(finite([as_float(r.get("final_loss")) for r in tensors.values()]))
    least = min(finite_reductions, key=finite_reductions.__getitem__) if finite_reductions else None
    return {
        "linear weights optimised": len(tensors),
        "Adam steps": getattr(parameters, "steps", None),
        "learning rate": getattr(parameters, "lr", None),
        "start": getattr(parameters, "init", None),
        "other tensors": getattr(parameters, "other_tensors", None),
        "median loss reduction": stats["median"],
        "min loss reduction": stats["min"],
        "max loss reduction": stats["max"],
        "total loss reduction": 1.0 - final / initial if initial > 0 else math.nan,
        "median ‖τ‖ / ‖τ₀‖ (τ₀: the start)": ratios["median"],
        "least reduced weight": least,
    }


def plot_wudi(section: Mapping[str, Any], images_dir: str, parameters: Any) -> list[Plot]:
    """The loss over the Adam steps (median and range over weights), and the reduction per weight."""
    tensors: Mapping[str, Mapping[str, Any]] = section.get("tensors") or {}
    if not tensors:
        return []
    plots: list[Plot] = []

    by_steps: dict[tuple[int, ...], list[list[float]]] = {}
    for record in tensors.values():
        key = tuple(int(s) for s in record.get("curve_steps") or [])
        curve = [as_float(v) for v in record.get("curve") or []]
        if key and len(curve) == len(key) and all(math.isfinite(v) for v in curve):
            by_steps.setdefault(key, []).append(curve)
    fig, (ax,) = new_figure()
    if by_steps:
        steps, curves = max(by_steps.items(), key=lambda kv: len(kv[1]))
        columns = list(zip(*curves))
        med = [summary_stats(list(c))["median"] for c in columns]
        ax.fill_between(
            steps,
            [min(c) for c in columns],
            [max(c) for c in columns],
            color="#4C72B0",
            alpha=0.25,
            label="min–max over weights",
        )
        ax.plot(steps, med, color="#4C72B0", marker="o", markersize=3, label="median")
        ax.set_title(f"WUDI: interference loss over {len(curves)} linear weights")
        ax.legend(fontsize=8)
    ax.set_xlabel("Adam step")
    ax.set_ylabel("loss / loss at the start")
    plots.append(
        Plot(
            save_figure(fig, images_dir, "wudi_loss.png"),
            "WUDI loss curve",
            "Interference loss Σ_k ‖(τ − τ_k) τ_kᵀ‖² / ‖τ_k‖² of each linear weight relative to "
            "its value at the start (sum of the task vectors), median and range over weights.",
        )
    )

    names = sorted(tensors, key=_natural_key)
    reductions = [as_float(tensors[n].get("relative_reduction")) for n in names]
    fig, (ax,) = new_figure()
    ax.bar(range(len(names)), [v if math.isfinite(v) else 0.0 for v in reductions], color="#55A868")
    layer_ticks(ax, names)
    ax.set_ylim(min(0.0, *finite(reductions)), 1)
    ax.set_ylabel("1 − final / initial loss")
    ax.set_title("WUDI: loss reduction per linear weight")
    plots.append(
        Plot(
            save_figure(fig, images_dir, "wudi_reduction.png"),
            "WUDI loss reduction",
            "Share of each linear weight's interference loss that the Adam steps removed, in "
            "layer order.",
        )
    )
    return plots


def _natural_key(name: str) -> list[Any]:
    """``layers.10`` after ``layers.9``: numbers in a tensor name compare as numbers."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", name)]


INFO = MethodInfo(
    name="wudi",
    pretty_name="WUDI-Merging",
    kind=TENSORWISE,
    needs_calibration=False,
    paper="Whoever Started the Interference Should End It: Guiding Data-Free Model Merging "
    "via Task Vectors (ICML 2025)",
    paper_url="https://arxiv.org/abs/2503.08099",
    parameters_model=WUDIParameters,
    report=MethodReport("WUDI", summarize_wudi, plot_wudi),
)

wudi_merge = tensorwise_method(
    INFO,
    wudi_kernel,
    contract=InputContract(base=BasePolicy.REQUIRED, min_inputs=2),
    optional_tensor_policy=OptionalTensorPolicy.PASSTHROUGH_BASE_SINGLETON,
)
register_method(INFO, wudi_merge)
