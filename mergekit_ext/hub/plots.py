"""Diagnostics plots for the model card, rendered with matplotlib's Agg canvas into ``images/``.

Every function takes one section of ``mergekit_ext_diagnostics.json`` (schema in
:mod:`mergekit_ext.diagnostics`) and the folder to write into, and returns the
:class:`Plot` records the card links to (paths relative to the output folder, so the
images render on the Hub and in a local Markdown viewer alike).

Figures are built with :class:`matplotlib.figure.Figure` and never touch ``pyplot``: no
global backend switch, no GUI, safe in threads and on headless machines. PNGs are written
without the "Software" metadata entry so that the same diagnostics give the same bytes.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

IMAGES_DIR = "images"
_DPI = 110
_MAX_TICK_LABELS = 12


@dataclass(frozen=True)
class Plot:
    """One image of the card: ``path`` is relative to the output folder (POSIX separators)."""

    path: str
    title: str
    caption: str


def as_float(value: Any) -> float:
    """A diagnostics number as float: ``None`` (NaN in the JSON) → nan, ``"inf"`` → inf."""
    if value is None:
        return math.nan
    if isinstance(value, str):
        lowered = value.strip().lower()
        if lowered in ("inf", "+inf", "infinity"):
            return math.inf
        if lowered in ("-inf", "-infinity"):
            return -math.inf
        try:
            return float(lowered)
        except ValueError:
            return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def short_layer_name(name: str) -> str:
    """``model.layers.3.self_attn.qkv`` → ``3.self_attn.qkv`` (tick labels stay short)."""
    match = re.search(r"(?:^|\.)(\d+)\.(.*)$", name)
    if match:
        return f"{match.group(1)}.{match.group(2)}"
    return name.rsplit(".", 2)[-1] if name.count(".") > 2 else name


def tensor_kind(name: str) -> str:
    """Tensor name with its layer index replaced by ``*``: one row per kind of weight."""
    return re.sub(r"\.\d+\.", ".*.", name)


def _new_figure(rows: int = 1, height: float = 3.2) -> tuple[Figure, list[Any]]:
    fig = Figure(figsize=(7.5, height * rows), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(rows, 1, i + 1) for i in range(rows)]
    return fig, axes


def _save(fig: Figure, images_dir: str, filename: str) -> str:
    os.makedirs(images_dir, exist_ok=True)
    path = os.path.join(images_dir, filename)
    fig.savefig(path, format="png", metadata={"Software": None})
    return f"{IMAGES_DIR}/{filename}"


def _layer_ticks(ax: Any, names: Sequence[str]) -> None:
    n = len(names)
    if n == 0:
        return
    step = max(1, math.ceil(n / _MAX_TICK_LABELS))
    positions = list(range(0, n, step))
    ax.set_xticks(positions)
    ax.set_xticklabels(
        [short_layer_name(names[i]) for i in positions], rotation=45, ha="right", fontsize=7
    )


def _finite(values: Sequence[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


# ----------------------------------------------------------------------------------- ACE


def plot_ace(section: Mapping[str, Any], images_dir: str, gamma_threshold: float) -> list[Plot]:
    """γ distribution (normalized vs not, with the threshold) and the normalization share."""
    tensors: Mapping[str, Mapping[str, Any]] = section.get("tensors") or {}
    if not tensors:
        return []
    plots: list[Plot] = []

    gammas_norm = _finite(
        [as_float(t.get("gamma")) for t in tensors.values() if t.get("normalized")]
    )
    gammas_raw = _finite(
        [as_float(t.get("gamma")) for t in tensors.values() if not t.get("normalized")]
    )
    fig, (ax,) = _new_figure()
    everything = gammas_norm + gammas_raw
    if everything:
        lo, hi = min(everything), max(everything)
        if lo == hi:
            lo, hi = lo - 0.5, hi + 0.5
        bins = [lo + (hi - lo) * i / 30 for i in range(31)]
        ax.hist(
            [gammas_raw, gammas_norm],
            bins=bins,
            stacked=True,
            label=["not normalized", "normalized"],
            color=["#4C72B0", "#DD8452"],
        )
    ax.axvline(gamma_threshold, color="black", linestyle="--", linewidth=1)
    ax.annotate(
        f"threshold {gamma_threshold:g}",
        xy=(gamma_threshold, 1),
        xycoords=("data", "axes fraction"),
        xytext=(3, -12),
        textcoords="offset points",
        fontsize=8,
    )
    ax.set_xlabel("heterogeneity γ of the task-vector energies")
    ax.set_ylabel("tensors")
    ax.set_title(f"ACE: γ over {len(tensors)} linear weights")
    ax.legend(fontsize=8)
    plots.append(
        Plot(
            _save(fig, images_dir, "ace_gamma.png"),
            "ACE γ distribution",
            "Heterogeneity γ per linear weight; weights above the threshold had their task "
            "covariances trace-normalized.",
        )
    )

    kinds: dict[str, list[bool]] = {}
    for name, record in tensors.items():
        kinds.setdefault(tensor_kind(name), []).append(bool(record.get("normalized")))
    names = sorted(kinds)
    shares = [sum(kinds[k]) / len(kinds[k]) for k in names]
    fig, (ax,) = _new_figure(height=max(2.4, 0.28 * len(names) + 1.2))
    ax.barh(range(len(names)), shares, color="#DD8452")
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels([f"{k}  (n={len(kinds[k])})" for k in names], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of weights normalized")
    ax.set_title("ACE: normalization share per kind of weight")
    plots.append(
        Plot(
            _save(fig, images_dir, "ace_normalization.png"),
            "ACE normalization share",
            "Fraction of the weights of each kind (layer index shown as `*`) whose "
            "covariances were normalized.",
        )
    )
    return plots


# ---------------------------------------------------------------- CoM / RegMean (layerwise)


def _task_series(layers: Sequence[Mapping[str, Any]], tasks: Sequence[str], key: str) -> dict:
    return {
        task: [as_float(((layer.get("tasks") or {}).get(task) or {}).get(key)) for layer in layers]
        for task in tasks
    }


def layer_tasks(layers: Sequence[Mapping[str, Any]]) -> list[str]:
    """Task names in first-seen order across the layers."""
    seen: dict[str, None] = {}
    for layer in layers:
        for task in layer.get("tasks") or {}:
            seen.setdefault(task, None)
    return list(seen)


def plot_layerwise(
    section_name: str, title: str, section: Mapping[str, Any], images_dir: str
) -> list[Plot]:
    """Per-layer covariate shift and output error, and per-layer task weights."""
    layers: Sequence[Mapping[str, Any]] = section.get("layers") or []
    if not layers:
        return []
    names = [str(layer.get("layer", i)) for i, layer in enumerate(layers)]
    tasks = layer_tasks(layers)
    x = list(range(len(layers)))
    plots: list[Plot] = []

    shift = _task_series(layers, tasks, "covariate_shift_w2")
    error = _task_series(layers, tasks, "relative_output_error")
    fig, (ax_shift, ax_err) = _new_figure(rows=2)
    for task in tasks:
        ax_shift.plot(x, shift[task], marker=".", label=task)
        ax_err.plot(x, error[task], marker=".", label=task)
    ax_shift.set_ylabel("W2 distance")
    ax_shift.set_title(f"{title}: covariate shift of each task's inputs (merged vs expert)")
    ax_err.set_ylabel("‖W X − W_k X‖ / ‖W_k X‖")
    ax_err.set_title("relative output error per task")
    for ax in (ax_shift, ax_err):
        _layer_ticks(ax, names)
        ax.grid(alpha=0.3)
    ax_shift.legend(fontsize=7, ncol=min(4, max(1, len(tasks))))
    ax_err.set_xlabel("linear group (forward order)")
    plots.append(
        Plot(
            _save(fig, images_dir, f"{section_name}_covariate_shift.png"),
            f"{title} covariate shift",
            "Wasserstein-2 distance between Gaussian fits of the inputs the merged model "
            "sees and those each unmerged expert sees, and the relative output error, per layer.",
        )
    )

    weights = _task_series(layers, tasks, "weight")
    totals = [sum(weights[t][i] for t in tasks if math.isfinite(weights[t][i])) for i in x]
    shares = {
        t: [weights[t][i] / totals[i] if totals[i] > 0 else math.nan for i in x] for t in tasks
    }
    conds = [as_float(layer.get("condition_number")) for layer in layers]
    fig, (ax_w, ax_c) = _new_figure(rows=2)
    bottom = [0.0] * len(x)
    for task in tasks:
        values = [v if math.isfinite(v) else 0.0 for v in shares[task]]
        ax_w.bar(x, values, bottom=bottom, label=task, width=0.9)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax_w.set_ylim(0, 1)
    ax_w.set_ylabel("share of Σ ω")
    ax_w.set_title(f"{title}: task weights ω_k per layer")
    ax_w.legend(fontsize=7, ncol=min(4, max(1, len(tasks))))
    finite_conds = [c if math.isfinite(c) and c > 0 else math.nan for c in conds]
    ax_c.plot(x, finite_conds, marker=".", color="#55A868")
    if _finite(finite_conds):
        ax_c.set_yscale("log")
    ax_c.set_ylabel("condition number")
    ax_c.set_title("condition number of the merged Gram Σ ω G̃")
    ax_c.set_xlabel("linear group (forward order)")
    for ax in (ax_w, ax_c):
        _layer_ticks(ax, names)
    ax_c.grid(alpha=0.3)
    plots.append(
        Plot(
            _save(fig, images_dir, f"{section_name}_task_weights.png"),
            f"{title} task weights",
            "Each task's share of the weights ω per layer, and the condition number of the "
            "weighted Gram matrix that is inverted.",
        )
    )
    return plots


# ------------------------------------------------------------------------------------- QP


def task_arithmetic_energies(weight: Mapping[str, Any]) -> dict[str, float]:
    """``J_task_arithmetic`` of one weight as ``{label: J}``.

    The QP method records J for task arithmetic at several λ (``{"1/K": J, "1": J}``);
    a plain number is accepted too (label ``""``).
    """
    value = weight.get("J_task_arithmetic")
    if isinstance(value, Mapping):
        return {f"λ={k}": as_float(v) for k, v in value.items()}
    return {"": as_float(value)}


def qp_layer_energy(layer: Mapping[str, Any]) -> dict[str, Any]:
    """Captured energy of one layer over its weights: ``1 − ΣJ(d*) / ΣJ(0)``.

    Also for task arithmetic (``{label: captured}``, one entry per recorded λ) and for the
    other basis when it was diagnosed; NaN where a weight lacks the number.
    """
    weights: Mapping[str, Mapping[str, Any]] = layer.get("weights") or {}
    j0 = sum(_finite([as_float(w.get("J0")) for w in weights.values()]))
    j_opt = sum(_finite([as_float(w.get("J_opt")) for w in weights.values()]))
    ta_sums: dict[str, list[float]] = {}
    for w in weights.values():
        for label, j in task_arithmetic_energies(w).items():
            ta_sums.setdefault(label, []).append(j)
    other = []
    for w in weights.values():
        ob = w.get("other_basis")
        if isinstance(ob, Mapping):
            j = as_float(ob.get("J_opt"))
            if not math.isfinite(j) and math.isfinite(as_float(ob.get("captured_energy"))):
                j = (1.0 - as_float(ob.get("captured_energy"))) * as_float(w.get("J0"))
            other.append(j)
    return {
        "J0": j0,
        "J_opt": j_opt,
        "captured": 1.0 - j_opt / j0 if j0 > 0 else math.nan,
        "captured_task_arithmetic": {
            label: (1.0 - sum(js) / j0) if j0 > 0 and len(_finite(js)) == len(weights) else math.nan
            for label, js in ta_sums.items()
        },
        "captured_other_basis": (1.0 - sum(other) / j0)
        if j0 > 0 and other and len(_finite(other)) == len(weights)
        else math.nan,
    }


def plot_qp(section: Mapping[str, Any], images_dir: str) -> list[Plot]:
    """Per-layer captured residual energy, next to task arithmetic at the same layer."""
    layers: Sequence[Mapping[str, Any]] = section.get("layers") or []
    if not layers:
        return []
    names = [str(layer.get("layer", i)) for i, layer in enumerate(layers)]
    energies = [qp_layer_energy(layer) for layer in layers]
    x = list(range(len(layers)))
    fig, (ax,) = _new_figure(height=3.6)
    ax.plot(x, [e["captured"] for e in energies], marker="o", label="QP optimum d*")
    labels = list(dict.fromkeys(k for e in energies for k in e["captured_task_arithmetic"]))
    for label in labels:
        ta = [e["captured_task_arithmetic"].get(label, math.nan) for e in energies]
        if _finite(ta):
            name = f"task arithmetic {label}".strip()
            ax.plot(x, ta, marker=".", linestyle="--", label=f"{name} (same layer)")
    other = [e["captured_other_basis"] for e in energies]
    if _finite(other):
        other_names = {
            str(w["other_basis"].get("basis"))
            for layer in layers
            for w in (layer.get("weights") or {}).values()
            if isinstance(w.get("other_basis"), Mapping) and w["other_basis"].get("basis")
        }
        label = f"{other_names.pop()} basis" if len(other_names) == 1 else "other basis"
        ax.plot(x, other, marker="x", linestyle=":", label=label)
    ax.set_ylabel("captured energy 1 − J(d*)/J(0)")
    ax.set_xlabel("layer (forward order)")
    ax.set_title("QP projection: residual energy captured per layer")
    _layer_ticks(ax, names)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return [
        Plot(
            _save(fig, images_dir, "qp_captured_energy.png"),
            "QP captured energy",
            "Fraction of the base-vs-expert output residual energy J(0) removed by the "
            "optimal coefficients, per layer (summed over its weights).",
        )
    ]


# -------------------------------------------------------------------------------- SyMerge


def plot_symerge(section: Mapping[str, Any], images_dir: str) -> list[Plot]:
    """Loss curve, per-task agreement curves and the λ heat map."""
    plots: list[Plot] = []
    loss = [as_float(v) for v in section.get("loss") or []]
    if loss:
        fig, (ax,) = _new_figure()
        ax.plot(range(1, len(loss) + 1), loss, color="#4C72B0")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title("SyMerge: training loss")
        if (
            _finite(loss)
            and min(_finite(loss)) > 0
            and max(_finite(loss)) / min(_finite(loss)) > 50
        ):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        plots.append(
            Plot(
                _save(fig, images_dir, "symerge_loss.png"),
                "SyMerge loss",
                "Expert-guided self-labelling loss over the adaptation steps.",
            )
        )
    agreement: Mapping[str, Sequence[Any]] = section.get("agreement") or {}
    if agreement:
        fig, (ax,) = _new_figure()
        for task, values in agreement.items():
            ys = [as_float(v) for v in values]
            ax.plot(range(1, len(ys) + 1), ys, marker=".", label=task)
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("evaluation point")
        ax.set_ylabel("agreement with the expert")
        ax.set_title("SyMerge: per-task agreement with the teacher")
        ax.legend(fontsize=7, ncol=min(4, len(agreement)))
        ax.grid(alpha=0.3)
        plots.append(
            Plot(
                _save(fig, images_dir, "symerge_agreement.png"),
                "SyMerge agreement",
                "Share of samples on which the merged model's prediction matches its expert's.",
            )
        )
    lam = section.get("lambda") or []
    if lam and all(isinstance(row, (list, tuple)) for row in lam):
        # the diagnostics hold lambda as K x P (one row per task); plot tensors x tasks
        matrix = [[as_float(v) for v in column] for column in zip(*lam)]
        tasks = list(section.get("tasks") or [f"task {k}" for k in range(len(lam))])
        tensors = list(section.get("lambda_tensors") or [str(i) for i in range(len(matrix))])
        fig, (ax,) = _new_figure(height=min(9.0, max(3.0, 0.12 * len(matrix) + 1.5)))
        image = ax.imshow(matrix, aspect="auto", interpolation="nearest", cmap="viridis")
        fig.colorbar(image, ax=ax, label="λ")
        ax.set_xticks(range(len(tasks)))
        ax.set_xticklabels(tasks, rotation=30, ha="right", fontsize=8)
        if len(tensors) <= 40:
            ax.set_yticks(range(len(tensors)))
            ax.set_yticklabels(tensors, fontsize=6)
        else:
            ax.set_ylabel(f"parameter tensor (1 … {len(tensors)}, forward order)")
        ax.set_title("SyMerge: learned coefficients λ[tensor, task]")
        plots.append(
            Plot(
                _save(fig, images_dir, "symerge_lambda.png"),
                "SyMerge λ",
                "The final per-tensor, per-task coefficients of the shared body.",
            )
        )
    return plots


def render_plots(
    sections: Mapping[str, Any], out_dir: str, *, gamma_threshold: Optional[float] = None
) -> dict[str, list[Plot]]:
    """Every plot for every known section; returns ``{section: [Plot, ...]}``."""
    images_dir = os.path.join(out_dir, IMAGES_DIR)
    result: dict[str, list[Plot]] = {}
    if "ace" in sections:
        result["ace"] = plot_ace(
            sections["ace"], images_dir, 0.3 if gamma_threshold is None else gamma_threshold
        )
    if "chain_of_merges" in sections:
        result["chain_of_merges"] = plot_layerwise(
            "chain_of_merges", "Chain of Merges", sections["chain_of_merges"], images_dir
        )
    if "regmean" in sections:
        result["regmean"] = plot_layerwise("regmean", "RegMean", sections["regmean"], images_dir)
    if "qp_projection" in sections:
        result["qp_projection"] = plot_qp(sections["qp_projection"], images_dir)
    if "symerge" in sections:
        result["symerge"] = plot_symerge(sections["symerge"], images_dir)
    return result
