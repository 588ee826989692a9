"""QP projection's card section: residual energy captured, next to task arithmetic."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from mergekit_ext.plots import (
    Plot,
    as_float,
    finite,
    layer_ticks,
    new_figure,
    save_figure,
    summary_stats,
)


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
    j0 = sum(finite([as_float(w.get("J0")) for w in weights.values()]))
    j_opt = sum(finite([as_float(w.get("J_opt")) for w in weights.values()]))
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
            label: (1.0 - sum(js) / j0) if j0 > 0 and len(finite(js)) == len(weights) else math.nan
            for label, js in ta_sums.items()
        },
        "captured_other_basis": (1.0 - sum(other) / j0)
        if j0 > 0 and other and len(finite(other)) == len(weights)
        else math.nan,
    }


def plot_qp(section: Mapping[str, Any], images_dir: str, parameters: Any = None) -> list[Plot]:
    """Per-layer captured residual energy, next to task arithmetic at the same layer."""
    layers: Sequence[Mapping[str, Any]] = section.get("layers") or []
    if not layers:
        return []
    names = [str(layer.get("layer", i)) for i, layer in enumerate(layers)]
    energies = [qp_layer_energy(layer) for layer in layers]
    x = list(range(len(layers)))
    fig, (ax,) = new_figure(height=3.6)
    ax.plot(x, [e["captured"] for e in energies], marker="o", label="QP optimum d*")
    labels = list(dict.fromkeys(k for e in energies for k in e["captured_task_arithmetic"]))
    for label in labels:
        ta = [e["captured_task_arithmetic"].get(label, math.nan) for e in energies]
        if finite(ta):
            name = f"task arithmetic {label}".strip()
            ax.plot(x, ta, marker=".", linestyle="--", label=f"{name} (same layer)")
    other = [e["captured_other_basis"] for e in energies]
    if finite(other):
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
    layer_ticks(ax, names)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return [
        Plot(
            save_figure(fig, images_dir, "qp_captured_energy.png"),
            "QP captured energy",
            "Fraction of the base-vs-expert output residual energy J(0) removed by the "
            "optimal coefficients, per layer (summed over its weights).",
        )
    ]


def summarize_qp(section: Mapping[str, Any], parameters: Any = None) -> dict[str, Any]:
    layers: Sequence[Mapping[str, Any]] = section.get("layers") or []
    bases: set[str] = set()
    objectives: set[str] = set()
    j0 = j_opt = 0.0
    j_ta: dict[str, list[float]] = {}
    other_j: list[float] = []
    other_bases: set[str] = set()
    n_weights = 0
    worst = (None, math.inf)
    for layer in layers:
        for name, w in (layer.get("weights") or {}).items():
            n_weights += 1
            if w.get("basis"):
                bases.add(str(w["basis"]))
            objectives.add(str(w.get("objective", "layer_output")))
            a, b = as_float(w.get("J0")), as_float(w.get("J_opt"))
            if math.isfinite(a) and math.isfinite(b):
                j0, j_opt = j0 + a, j_opt + b
            for label, j in task_arithmetic_energies(w).items():
                j_ta.setdefault(label, []).append(j)
            ob = w.get("other_basis")
            if isinstance(ob, Mapping):
                other_j.append(as_float(ob.get("J_opt")))
                if ob.get("basis"):
                    other_bases.add(str(ob["basis"]))
            captured = as_float(w.get("captured_energy"))
            if math.isfinite(captured) and captured < worst[1]:
                worst = (name, captured)
    per_layer = [qp_layer_energy(layer)["captured"] for layer in layers]
    ta_rows = [
        {"label": label.strip() or "λ as recorded", "captured": 1.0 - sum(js) / j0}
        for label, js in j_ta.items()
        if j0 > 0 and len(js) == n_weights and all(math.isfinite(j) for j in js)
    ]
    other_complete = j0 > 0 and other_j and len(other_j) == n_weights
    output = section.get("model_output")
    return {
        "n_layers": len(layers),
        "n_weights": n_weights,
        "bases": sorted(bases),
        "objectives": sorted(objectives),
        # objective model_output: the model's output error before and after the merge
        "output_error_initial": as_float(output.get("output_error_initial"))
        if isinstance(output, Mapping)
        else math.nan,
        "output_error_final": as_float(output.get("output_error_final"))
        if isinstance(output, Mapping)
        else math.nan,
        "captured_total": 1.0 - j_opt / j0 if j0 > 0 else math.nan,
        "task_arithmetic": ta_rows,
        "other_basis": ", ".join(sorted(other_bases)) or None,
        "captured_other_basis": 1.0 - sum(other_j) / j0
        if other_complete and all(math.isfinite(j) for j in other_j)
        else math.nan,
        "captured_per_layer": summary_stats(per_layer),
        "worst_weight": worst[0],
        "worst_weight_captured": worst[1] if worst[0] is not None else math.nan,
        "J0_total": j0,
        "J_opt_total": j_opt,
    }
