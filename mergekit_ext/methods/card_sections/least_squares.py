"""The card section of the least-squares methods (RegMean, Chain of Merges): per-layer
task weights, covariate shift, output error and conditioning."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from mergekit_ext.methods.registry import MethodReport
from mergekit_ext.plots import (
    Plot,
    as_float,
    finite,
    is_measured_nan,
    layer_ticks,
    new_figure,
    save_figure,
    summary_stats,
    worst_value,
)


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
    section_name: str,
    title: str,
    section: Mapping[str, Any],
    images_dir: str,
    parameters: Any = None,
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
    fig, (ax_shift, ax_err) = new_figure(rows=2)
    for task in tasks:
        ax_shift.plot(x, shift[task], marker=".", label=task)
        ax_err.plot(x, error[task], marker=".", label=task)
    ax_shift.set_ylabel("W2 distance")
    ax_shift.set_title(f"{title}: covariate shift of each task's inputs (merged vs expert)")
    ax_err.set_ylabel("‖W X − W_k X‖ / ‖W_k X‖")
    ax_err.set_title("relative output error per task")
    for ax in (ax_shift, ax_err):
        layer_ticks(ax, names)
        ax.grid(alpha=0.3)
    ax_shift.legend(fontsize=7, ncol=min(4, max(1, len(tasks))))
    ax_err.set_xlabel("linear group (forward order)")
    plots.append(
        Plot(
            save_figure(fig, images_dir, f"{section_name}_covariate_shift.png"),
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
    # Equal shares everywhere (uniform weighting): a flat bar chart says nothing, so only
    # the condition number is drawn and the caption says the weights were equal.
    uniform = all(
        math.isfinite(v) and abs(v - 1.0 / len(tasks)) < 1e-6 for t in tasks for v in shares[t]
    )
    fig, axes = new_figure(rows=1 if uniform else 2)
    ax_c = axes[-1]
    if not uniform:
        ax_w = axes[0]
        bottom = [0.0] * len(x)
        for task in tasks:
            values = [v if math.isfinite(v) else 0.0 for v in shares[task]]
            ax_w.bar(x, values, bottom=bottom, label=task, width=0.9)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax_w.set_ylim(0, 1)
        ax_w.set_ylabel("share of Σ ω")
        ax_w.set_title(f"{title}: task weights ω_k per layer")
        ax_w.legend(fontsize=7, ncol=min(4, max(1, len(tasks))))
        layer_ticks(ax_w, names)
    finite_conds = [c if math.isfinite(c) and c > 0 else math.nan for c in conds]
    ax_c.plot(x, finite_conds, marker=".", color="#55A868")
    if finite(finite_conds):
        ax_c.set_yscale("log")
    ax_c.set_ylabel("condition number")
    ax_c.set_title("condition number of the merged Gram Σ ω G̃")
    ax_c.set_xlabel("linear group (forward order)")
    layer_ticks(ax_c, names)
    ax_c.grid(alpha=0.3)
    plots.append(
        Plot(
            save_figure(fig, images_dir, f"{section_name}_task_weights.png"),
            f"{title} task weights",
            (
                f"The task weights are equal ({len(tasks)} tasks, each 1/{len(tasks)} of every "
                "layer), so only the condition number of the weighted Gram matrix that is "
                "inverted is drawn: the larger it is, the more the solve amplifies noise."
                if uniform
                else "Each task's share of the weights ω per layer, and the condition number "
                "of the weighted Gram matrix that is inverted."
            ),
        )
    )
    return plots


def summarize_layerwise(section: Mapping[str, Any], parameters: Any = None) -> dict[str, Any]:
    layers: Sequence[Mapping[str, Any]] = section.get("layers") or []
    tasks = layer_tasks(layers)
    rows = []
    for task in tasks:
        shares, shifts, errors, raw_errors = [], [], [], []
        worst_layer, worst_shift = None, -math.inf
        for layer in layers:
            per_task = layer.get("tasks") or {}
            rec = per_task.get(task) or {}
            total = sum(
                v
                for v in (as_float((r or {}).get("weight")) for r in per_task.values())
                if math.isfinite(v)
            )
            w = as_float(rec.get("weight"))
            shares.append(w / total if total > 0 and math.isfinite(w) else math.nan)
            s = as_float(rec.get("covariate_shift_w2"))
            shifts.append(s)
            if math.isfinite(s) and s > worst_shift:
                worst_shift, worst_layer = s, layer.get("layer")
            errors.append(as_float(rec.get("relative_output_error")))
            raw_errors.append(rec.get("relative_output_error"))
        error = summary_stats(errors)
        # inf and NaN are the worst values, not dropped (the mean is over the finite ones)
        error["max"] = worst_value(raw_errors)
        rows.append(
            {
                "task": task,
                "weight_share": summary_stats(shares)["mean"],
                "shift": summary_stats(shifts),
                "worst_shift_layer": worst_layer,
                "error": error,
                "error_nonfinite": sum(
                    1 for v in raw_errors if is_measured_nan(v) or math.isinf(as_float(v))
                ),
            }
        )
    settings: dict[str, Any] = {}
    for key, label in (
        ("statistics", "statistics"),
        ("task_weighting", "task weighting"),
        ("normalized_gram", "normalized Gram"),
        ("solver", "solver"),
        ("covariate_shift_covariance", "W2 covariance"),
        ("condition_number_method", "condition number"),
    ):
        values = {str(layer.get(key)) for layer in layers if layer.get(key) is not None}
        if values:
            settings[label] = ", ".join(sorted(values))
    raw_conditions = [layer.get("condition_number") for layer in layers]
    condition = summary_stats([as_float(c) for c in raw_conditions])
    condition["max"] = worst_value(raw_conditions)  # inf (singular) kept
    return {
        "n_layers": len(layers),
        "worst": worst_layer_record(layers),
        "out_of_range": [
            {"layer": layer.get("layer"), "norm_ratio": _measured(layer.get("max_norm_ratio"))}
            for layer in layers
            if layer.get("guard") in ("warned", "allowed")
        ],
        "ridged": sum(1 for layer in layers if as_float(layer.get("ridge")) > 0.0),
        # groups whose solution ridge: auto brought back into the experts' range
        "kept_in_range": [
            {
                "layer": layer.get("layer"),
                "before": _measured(layer.get("norm_ratio_before_ridge")),
                "ridge": _measured(layer.get("ridge")),
            }
            for layer in layers
            if layer.get("norm_ratio_before_ridge") is not None
        ],
        "tasks": rows,
        "settings": settings,
        "shift_measured": any(math.isfinite(v) for r in rows for v in (r["shift"]["max"],)),
        "condition_number": condition,
        "singular": sum(1 for c in raw_conditions if as_float(c) == math.inf),
    }


def _measured(value: Any) -> float | None:
    """A raw diagnostics value as float (inf and NaN kept), None when it was not recorded."""
    return None if value is None else as_float(value)


def _error_order(value: Any) -> tuple[int, float]:
    """A measured NaN is the worst error, then inf, then the largest number."""
    if is_measured_nan(value):
        return (2, 0.0)
    number = as_float(value)
    if math.isinf(number) and number > 0:
        return (1, 0.0)
    return (0, -math.inf if math.isnan(number) else number)


def worst_layer_record(layers: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The worst layer, with its task, output error, norm ratio, condition number and ridge.

    A layer whose output error is NaN or inf is broken and the worst; after it, a layer the
    result guard flagged (outside the experts' range) is worse than any layer within it, so
    the card's "worst layer" line names the same layer as its warnings list: among flagged
    layers the largest norm ratio; otherwise the largest per-task relative output error
    (measured on the weights as written). None when nothing was recorded.
    Ties (e.g. two NaN) go to the first layer.
    """
    worst = _worst_error(*layers)
    broken = worst is not None and _error_order(worst["error"])[0] > 0  # a NaN or inf error
    flagged = [layer for layer in layers if layer.get("guard") in ("warned", "allowed")]
    if flagged and not broken:
        layer = max(flagged, key=lambda g: _error_order(g.get("max_norm_ratio")))
        record = _worst_error(layer) or {"layer": layer.get("layer"), "task": None, "error": None}
        return {**record, "out_of_range": True}
    return {**worst, "out_of_range": False} if worst is not None else None


def _worst_error(*layers: Mapping[str, Any]) -> dict[str, Any] | None:
    """The layer and task with the worst relative output error among ``layers``."""
    worst: dict[str, Any] | None = None
    order = (-1, 0.0)
    for layer in layers:
        for task, rec in (layer.get("tasks") or {}).items():
            raw = (rec or {}).get("relative_output_error")
            if raw is None:
                continue
            key = _error_order(raw)
            if key > order:
                order = key
                worst = {
                    "layer": layer.get("layer"),
                    "task": task,
                    "error": _measured(raw),
                    "norm_ratio": _measured(layer.get("max_norm_ratio")),
                    "condition_number": _measured(layer.get("condition_number")),
                    "ridge": _measured(layer.get("ridge")),
                    "ridge_reason": layer.get("ridge_reason"),
                }
    return worst


def least_squares_report(section_name: str, title: str) -> MethodReport:
    """The card section and plots of a least-squares method (RegMean, CoM) named ``title``."""
    return MethodReport(
        title,
        summarize_layerwise,
        partial(plot_layerwise, section_name, title),
        template="least_squares",
    )
