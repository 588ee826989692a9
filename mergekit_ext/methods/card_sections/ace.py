"""ACE's card section: heterogeneity, normalization share, conditioning."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from mergekit_ext.plots import (
    Plot,
    as_float,
    finite,
    new_figure,
    save_figure,
    summary_stats,
    tensor_kind,
    worst_value,
)


def heterogeneity_rule(parameters: Any) -> tuple[str, str, float]:
    """(record key, label, threshold) of the rule that decided normalization."""
    if getattr(parameters, "heterogeneity", "paper") == "scale_invariant":
        return "log_energy_spread", "Var(log τ)", float(parameters.spread_threshold)
    return "gamma", "γ", float(getattr(parameters, "gamma_threshold", 0.3))


def summarize_ace(section: Mapping[str, Any], parameters: Any) -> dict[str, Any]:
    """Counts, the heterogeneity statistic, conditioning and spectra, overall and per kind."""
    key, label, threshold = heterogeneity_rule(parameters)
    tensors: Mapping[str, Mapping[str, Any]] = section.get("tensors") or {}
    kinds: dict[str, list[Mapping[str, Any]]] = {}
    for name, rec in tensors.items():
        kinds.setdefault(tensor_kind(name), []).append(rec)
    conds = {name: as_float(rec.get("condition_number")) for name, rec in tensors.items()}
    finite_conds = {k: v for k, v in conds.items() if math.isfinite(v)}
    worst = max(finite_conds, key=finite_conds.__getitem__) if finite_conds else None
    n_norm = sum(bool(r.get("normalized")) for r in tensors.values())
    return {
        "n_tensors": len(tensors),
        "n_normalized": n_norm,
        "normalized_share": n_norm / len(tensors) if tensors else math.nan,
        "rule": getattr(parameters, "heterogeneity", "paper"),
        "statistic_label": label,
        "threshold": threshold,
        "statistic": summary_stats([as_float(r.get(key)) for r in tensors.values()]),
        # inf (a singular A) is the worst value, not dropped
        "condition_number": {
            **summary_stats(list(conds.values())),
            "max": worst_value([rec.get("condition_number") for rec in tensors.values()]),
        },
        "worst_condition_tensor": worst,
        "top5_energy_share": summary_stats(
            [as_float(r.get("top5_energy_share")) for r in tensors.values()]
        ),
        "kinds": [
            {
                "kind": kind,
                "count": len(recs),
                "normalized_share": sum(bool(r.get("normalized")) for r in recs) / len(recs),
                "statistic_median": summary_stats([as_float(r.get(key)) for r in recs])["median"],
                "condition_median": summary_stats(
                    [as_float(r.get("condition_number")) for r in recs]
                )["median"],
                "top5_median": summary_stats([as_float(r.get("top5_energy_share")) for r in recs])[
                    "median"
                ],
            }
            for kind, recs in sorted(kinds.items())
        ],
    }


def threshold_bins(
    values: list[float], threshold: float, count: int = 30
) -> tuple[list[float], bool]:
    """Histogram bin edges with ``threshold`` on an edge, and whether the axis is logarithmic.

    γ spans orders of magnitude (most weights near 0.01, a few near 1): on a linear axis
    almost every weight falls into the first bin, the threshold inside it. With positive
    values and threshold the edges are geometric (``count`` bins over the values' range, the
    threshold one of them), else linear, still with the threshold on an edge.
    """
    positive = [v for v in values if v > 0]
    if positive and threshold > 0:
        lo, hi = min(min(positive), threshold), max(max(positive), threshold)
        step = math.log(hi / lo) / count if hi > lo else 0.1
        below = math.ceil(math.log(threshold / lo) / step + 1e-9)
        above = math.ceil(math.log(hi / threshold) / step + 1e-9)
        return [threshold * math.exp(step * k) for k in range(-below, above + 1)], True
    lo, hi = min([*values, threshold]), max([*values, threshold])
    step = (hi - lo) / count if hi > lo else 0.5
    below = math.ceil((threshold - lo) / step + 1e-9)
    above = math.ceil((hi - threshold) / step + 1e-9)
    return [threshold + step * k for k in range(-below, max(above, 1) + 1)], False


def plot_ace(section: Mapping[str, Any], images_dir: str, parameters: Any) -> list[Plot]:
    """Heterogeneity distribution (normalized vs not, with the threshold), normalization share."""
    key, label, gamma_threshold = heterogeneity_rule(parameters)
    tensors: Mapping[str, Mapping[str, Any]] = section.get("tensors") or {}
    if not tensors:
        return []
    plots: list[Plot] = []

    gammas_norm = finite([as_float(t.get(key)) for t in tensors.values() if t.get("normalized")])
    gammas_raw = finite([as_float(t.get(key)) for t in tensors.values() if not t.get("normalized")])
    fig, (ax,) = new_figure()
    everything = gammas_norm + gammas_raw
    if everything:
        bins, log_axis = threshold_bins(everything, gamma_threshold)
        if log_axis:  # a γ of exactly 0 (equal energies) lands in the first bin
            gammas_raw = [max(g, bins[0]) for g in gammas_raw]
            gammas_norm = [max(g, bins[0]) for g in gammas_norm]
            ax.set_xscale("log")
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
    ax.set_xlabel(f"heterogeneity {label} of the task-vector energies")
    ax.set_ylabel("tensors")
    ax.set_title(f"ACE: {label} over {len(tensors)} linear weights")
    ax.legend(fontsize=8)
    plots.append(
        Plot(
            save_figure(fig, images_dir, "ace_gamma.png"),
            f"ACE {label} distribution",
            f"Heterogeneity {label} per linear weight; weights above the threshold had their "
            "task covariances trace-normalized.",
        )
    )

    kinds: dict[str, list[bool]] = {}
    for name, record in tensors.items():
        kinds.setdefault(tensor_kind(name), []).append(bool(record.get("normalized")))
    names = sorted(kinds)
    shares = [sum(kinds[k]) / len(kinds[k]) for k in names]
    fig, (ax,) = new_figure(height=max(2.4, 0.28 * len(names) + 1.2))
    ax.barh(range(len(names)), shares, color="#DD8452")
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels([f"{k}  (n={len(kinds[k])})" for k in names], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of weights normalized")
    ax.set_title("ACE: normalization share per kind of weight")
    plots.append(
        Plot(
            save_figure(fig, images_dir, "ace_normalization.png"),
            "ACE normalization share",
            "Fraction of the weights of each kind (layer index shown as `*`) whose "
            "covariances were normalized.",
        )
    )
    return plots
