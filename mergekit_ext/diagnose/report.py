"""Presenting a diagnosis: the terminal table, the block-error plot and the JSON values."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

from mergekit_ext import merge_record


def _cell(value: Optional[float], digits: int = 4) -> str:
    if value is None:
        return "—"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.{digits}f}"


def _head_words(t: dict[str, Any]) -> str:
    if t.get("itself"):
        return "the expert itself"
    if t["head"] == "expert":
        return "expert's head on this body"
    return "own" if t["output"] else "no head (blocks only)"


def _task_rows(
    label: str, tasks: dict[str, dict[str, Any]], means: dict[str, Any], suffix: str
) -> list[tuple[str, ...]]:
    rows = []
    for name, t in tasks.items():
        worst = t.get("worst_block")
        last = t["blocks"][-1]["relative_error"] if t["blocks"] else None
        rows.append(
            (
                label,
                name + suffix,
                _cell(t["agreement"]),
                _cell(t["kl"], 5),
                f"{worst['index']} ({_cell(worst['relative_error'])})" if worst else "—",
                _cell(last),
                _head_words(t),
            )
        )
        label = ""
    if len(tasks) > 1:
        rows.append(
            (
                label,
                "mean" + suffix,
                _cell(means.get("mean_agreement")),
                _cell(means.get("mean_kl"), 5),
                "",
                _cell(means.get("mean_last_block_error")),
                "",
            )
        )
    return rows


def _model_rows(label: str, row: dict[str, Any]) -> list[tuple[str, ...]]:
    rows = _task_rows(label, row["tasks"], row, "")
    probe = row.get("probe") or {}
    # the probe's rows below the held-out ones (a task measured on the probe alone: once)
    extra = {
        name: t for name, t in (probe.get("tasks") or {}).items() if t is not row["tasks"].get(name)
    }
    if extra:
        rows += _task_rows("", extra, probe if len(extra) == len(probe["tasks"]) else {}, " probe")
    return rows


def format_report(results: Sequence[dict[str, Any]]) -> str:
    """The terminal report of one or more merged models: which data, a table with the merged
    models and the reference rows (base model, each expert alone), and each verdict."""
    if not results:
        return ""
    first = results[0]
    lines = ["Evaluation data:"]
    for name, d in (first.get("data") or {}).items():
        lines.append(f"  {name}: {d['note']}")
        lines += [f"  {name}: WARNING: {w}" for w in d.get("warnings") or []]
    for name, d in (first.get("probe_data") or {}).items():
        if (first.get("data") or {}).get(name, {}).get("kind") != "probe":
            lines.append(f"  {name}: {d['note']} (off-distribution check)")
    if first.get("probe_skipped"):
        lines.append(f"  {first['probe_skipped']}")
    table = [("model", "task", "agreement", "KL", "worst block (rel. error)", "last block", "head")]
    for r in results:
        table += _model_rows(f"{r['merged']} (merged)", r)
    refs = first.get("references") or {}
    if refs.get("base"):
        table += _model_rows(f"{refs['base']['model']} (base)", refs["base"])
    for task, row in (refs.get("experts") or {}).items():
        table += _model_rows(f"{row['model']} (expert {task} alone)", row)
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    body = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
    body.insert(1, "  ".join("-" * w for w in widths))
    lines += body
    lines.append(
        "KL: mean KL(expert ‖ model) on the task's data; agreement: top-1 / argmax; "
        "'probe': the same on generic prose (the mean row is over the held-out rows)."
    )
    for r in results:
        for name, t in r["tasks"].items():
            if t["expert_tensors_used"]:
                lines.append(
                    f"{name}: {r['merged']} has no {', '.join(t['expert_tensors_used'])} of "
                    "this task; the expert's own was used on the merged body"
                )
    lines.append("Verdict:")
    for r in results:
        ratio = r.get("base_ratio")
        lines.append(f"  {r['merged']} {r.get('verdict', '')}")
        if r.get("best_single_ratio") is not None:
            lines.append(
                f"    best_single_ratio {_cell(r['best_single_ratio'], 3)} (the closest input "
                f"model's {r['ratio_measure']} alone / this model's)"
            )
        elif ratio is not None:
            lines.append(
                f"    base_ratio {_cell(ratio, 3)} (base model's {r['ratio_measure']} / this model's)"
            )
        if r.get("probe_ratio") is not None:
            lines.append(f"    probe_ratio {_cell(r['probe_ratio'], 3)} (the same on the probe)")
        for w in r.get("merge_warnings") or []:
            lines.append(f"    merge record: {w}")
    return "\n".join(lines)


def format_table(result: dict[str, Any]) -> str:
    """The terminal report of one merged model (:func:`format_report`)."""
    return format_report([result])


def plot_block_errors(
    result: dict[str, Any] | Sequence[dict[str, Any]], images_dir: str, filename: str
) -> Any:
    """The per-block error plot of a diagnosis (:func:`mergekit_ext.plots.plot_block_errors`)."""
    from mergekit_ext.plots import plot_block_errors as plot

    return plot(result, images_dir, filename)


def jsonable(value: Any) -> Any:
    """NaN/Inf as strings (``"inf"``): the JSON stays standard and plots.as_float reads them back."""
    return merge_record.jsonable(value)
