"""Tables (Markdown, JSON) and a bar chart (PNG) of one suite's results."""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, Optional

LOG = logging.getLogger(__name__)


def mean(values: list[float]) -> Optional[float]:
    vals = [v for v in values if v is not None and not math.isnan(v)]
    return sum(vals) / len(vals) if vals else None


def normalized_scores(
    metric: str, scores: dict[str, float], experts: dict[str, float], pretrained: dict[str, float]
) -> dict[str, Optional[float]]:
    """accuracy: ``merged / expert``; loss: ``(base - merged) / (base - expert)``."""
    out: dict[str, Optional[float]] = {}
    for task, value in scores.items():
        if metric == "accuracy":
            out[task] = value / experts[task] if experts[task] > 0 else None
        else:
            gain = pretrained[task] - experts[task]
            out[task] = (pretrained[task] - value) / gain if abs(gain) > 1e-12 else None
    return out


def _fmt(value: Optional[float], pct: bool) -> str:
    if value is None:
        return "–"
    return f"{100 * value:.1f}" if pct else f"{value:.3f}"


def markdown_table(result: dict[str, Any]) -> str:
    tasks = result["tasks"]
    acc = result["metric"] == "accuracy"
    what = "accuracy % (normalized %)" if acc else "loss (kept share of the expert's gain %)"
    lines = [
        f"### {result['title']}",
        "",
        f"Per task: {what}. Merge time and peak RSS are those of the `mergekit-ext run` process.",
        "",
        "| method | " + " | ".join(tasks) + " | avg | avg normalized | merge s | peak RSS MB |",
        "|---" * (len(tasks) + 5) + "|",
    ]
    for row in result["rows"]:
        if row["status"] != "ok":
            cells = [row["status"]] + [""] * (len(tasks) + 3)
        else:
            cells = [
                f"{_fmt(row['scores'][t], acc)} ({_fmt(row['normalized'][t], True)})" for t in tasks
            ]
            cells += [
                _fmt(row["avg_score"], acc),
                _fmt(row["avg_normalized"], True),
                "" if row.get("wall_seconds") is None else f"{row['wall_seconds']:.1f}",
                "" if row.get("peak_rss_mb") is None else f"{row['peak_rss_mb']:.0f}",
            ]
        lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    lines.append("")
    for command in result.get("commands", []):
        lines.append(f"Command: `{command}`  ")
    versions = result.get("versions")
    if versions:
        lines.append("Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + "  ")
    if result.get("commands") or versions:
        lines.append("")
    return "\n".join(lines)


def environment_versions() -> dict[str, str]:
    """Versions of the packages a result depends on (for the committed tables)."""
    import platform
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for package in ("mergekit-ext", "mergekit", "torch", "transformers", "peft", "safetensors"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    found["cpu"] = cpu_description()
    return found


def cpu_description() -> str:
    """The CPU model and the cores this process may use (merge times depend on both)."""
    import platform

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fp:
            model = next(
                (ln.split(":", 1)[1].strip() for ln in fp if ln.startswith("model name")), model
            )
    except OSError:  # not Linux: platform's name
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores"


def bar_chart(result: dict[str, Any], path: str) -> None:
    """Grouped bars: normalized score per task and on average, one group per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [r for r in result["rows"] if r["status"] == "ok"]
    series = [*result["tasks"], "average"]
    values = np.array(
        [
            [
                np.nan
                if (v := (r["normalized"].get(s) if s != "average" else r["avg_normalized"]))
                is None
                else 100 * v
                for s in series
            ]
            for r in rows
        ]
    )
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows) + 2), 4.5))
    width = 0.8 / len(series)
    x = np.arange(len(rows))
    for i, name in enumerate(series):
        ax.bar(x + (i - (len(series) - 1) / 2) * width, values[:, i], width, label=name)
    ax.set_xticks(x)
    ax.set_xticklabels([r["label"] for r in rows], rotation=35, ha="right", fontsize=8)
    ax.axhline(100, color="black", linewidth=0.6)
    ylabel = (
        "accuracy / expert accuracy (%)"
        if result["metric"] == "accuracy"
        else "kept share of expert's loss gain (%)"
    )
    ax.set_ylabel(ylabel)
    ax.set_title(result["title"], fontsize=10)
    top = np.nanmax(values) if np.isfinite(values).any() else 100.0
    ax.set_ylim(
        min(0.0, np.nanmin(values)) if np.isfinite(values).any() else 0.0, max(100.0, top) * 1.15
    )
    ax.legend(fontsize=7, ncol=len(series), loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_reports(result: dict[str, Any], out_dir: str) -> dict[str, str]:
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, result["id"])
    with open(stem + ".json", "w", encoding="utf-8") as fp:
        json.dump(result, fp, indent=2, sort_keys=False)
    with open(stem + ".md", "w", encoding="utf-8") as fp:
        fp.write(markdown_table(result))
    bar_chart(result, stem + ".png")
    return {"json": stem + ".json", "md": stem + ".md", "png": stem + ".png"}
