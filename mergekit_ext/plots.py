"""What every method's card section and plots are built from: plot records, figures, numbers.

A method describes its diagnostics for the model card through
:class:`~mergekit_ext.methods.registry.MethodReport` (a summary for the card's template and
its plots); the helpers here are shared by those reports. Figures use matplotlib's Agg
canvas through :class:`matplotlib.figure.Figure`, never ``pyplot``: no global backend, no
GUI, safe on headless machines. PNGs are written without the "Software" metadata entry so
that the same diagnostics give the same bytes. matplotlib is imported only when a figure
is drawn.
"""

from __future__ import annotations

import io
import math
import os
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from mergekit_ext.output import write_file

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
    """A diagnostics number as float: ``None`` (not measured) and ``"nan"`` → nan, ``"inf"`` → inf."""
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


def new_figure(rows: int = 1, height: float = 3.2) -> tuple[Any, list[Any]]:
    """A figure with ``rows`` stacked axes (Agg canvas, constrained layout)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, height * rows), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(rows, 1, i + 1) for i in range(rows)]
    return fig, axes


def save_figure(fig: Any, images_dir: str, filename: str) -> str:
    """Write ``fig`` as ``images_dir/filename`` (PNG); returns the card-relative path."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", metadata={"Software": None})
    write_file(os.path.join(images_dir, filename), buffer.getvalue())
    return f"{IMAGES_DIR}/{filename}"


def layer_ticks(ax: Any, names: Sequence[str]) -> None:
    """At most a dozen shortened layer names as x tick labels."""
    n = len(names)
    if n == 0:
        return
    step = max(1, math.ceil(n / _MAX_TICK_LABELS))
    positions = list(range(0, n, step))
    ax.set_xticks(positions)
    ax.set_xticklabels(
        [short_layer_name(names[i]) for i in positions], rotation=45, ha="right", fontsize=7
    )


def finite(values: Sequence[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def is_measured_nan(value: Any) -> bool:
    """A NaN that was measured (``"nan"`` in the JSON, or a float NaN), not a missing value."""
    if isinstance(value, str):
        return value.strip().lower() == "nan"
    return isinstance(value, float) and math.isnan(value)


def worst_value(values: Sequence[Any]) -> Optional[float]:
    """The largest of raw diagnostics values with the non-finite ones kept: a measured NaN
    (:func:`is_measured_nan`) is worse than inf, inf worse than any number; missing values
    (None) are skipped. None when nothing was measured."""
    if any(is_measured_nan(v) for v in values):
        return math.nan
    numbers = [as_float(v) for v in values if v is not None]
    numbers = [v for v in numbers if not math.isnan(v)]
    return max(numbers) if numbers else None


def summary_stats(values: Sequence[float]) -> dict[str, float]:
    """n, min, median, mean and max of the finite values (NaN when there are none)."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return {"n": 0, "min": math.nan, "median": math.nan, "mean": math.nan, "max": math.nan}
    return {
        "n": len(finite),
        "min": min(finite),
        "median": statistics.median(finite),
        "mean": statistics.fmean(finite),
        "max": max(finite),
    }


def integer_ticks(ax: Any) -> None:
    """Only whole numbers on the x axis (block indices)."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def block_error_figure(results: Sequence[dict[str, Any]]) -> Any:
    """One panel per task: the relative error of each block's output against the task's
    expert, one line per merged model, the base model dashed and the other experts alone
    dotted (the reference rows of a ``mergekit-ext diagnose`` result); integer block ticks."""
    first = results[0]
    tasks = list(first["tasks"])
    fig, axes = new_figure(max(1, len(tasks)), height=2.8)
    refs = first.get("references") or {}
    for ax, name in zip(axes, tasks):
        lines: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
            (str(r["merged"]), r["tasks"][name], {"marker": "o", "markersize": 3}) for r in results
        ]
        if refs.get("base"):
            style = {"linestyle": "--", "color": "0.2"}
            lines.append(("base model", refs["base"]["tasks"][name], style))
        for task, row in (refs.get("experts") or {}).items():
            if task != name:
                style = {"linestyle": ":", "color": "0.55"}
                lines.append((f"expert {task} alone", row["tasks"][name], style))
        drawn: list[float] = []
        for label, t, style in lines:
            xs = [int(b["index"]) for b in t["blocks"]]
            ys = [as_float(b["relative_error"]) for b in t["blocks"]]
            ax.plot(xs, ys, label=label, **style)
            drawn += finite(ys)
        if drawn and min(drawn) > 0 and max(drawn) > 30 * min(drawn):
            ax.set_yscale("log")  # a broken merge would flatten every other line
        data = (first.get("data") or {}).get(name, {}).get("kind", "calibration")
        ax.set_title(f"{name} ({data} data)", fontsize=9)
        ax.set_xlabel("block")
        ax.set_ylabel("‖h − h_expert‖ / ‖h_expert‖", fontsize=8)
        integer_ticks(ax)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    return fig


def plot_block_errors(
    result: dict[str, Any] | Sequence[dict[str, Any]], images_dir: str, filename: str
) -> Plot:
    """A ``mergekit-ext diagnose`` result (or several, sharing their experts), drawn by
    :func:`block_error_figure` and written as ``images_dir/filename``."""
    results = [result] if isinstance(result, dict) else list(result)
    fig = block_error_figure(results)
    path = save_figure(fig, images_dir, filename)
    return Plot(
        path=path,
        title="Per-block error against each expert",
        caption="Relative error of each block's output against the task's expert, on the "
        "task's evaluation data (non-padding positions): the merged model(s), the base "
        "model (dashed) and the other experts alone (dotted).",
    )
