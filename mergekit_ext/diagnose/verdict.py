"""The verdict of a diagnosis: the merged model against the base model and each expert alone.

``base_ratio`` = (the base model's mean KL to the experts) / (the merged model's), and one
line in plain words (``docs/methods.md``, "Diagnose").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional


def evaluated_on(data: dict[str, dict[str, Any]]) -> str:
    """``held-out`` or ``calibration`` when every task's data is of that kind, else ``mixed``."""
    kinds = {d.get("kind") for d in data.values()}
    return kinds.pop() if len(kinds) == 1 else "mixed"


def _measure(result: dict[str, Any]) -> str:
    """``kl`` when every task has an output KL, else ``last_block_error`` (models without a head)."""
    return "kl" if all(t.get("kl") is not None for t in result["tasks"].values()) else "lbe"


def _task_value(task: dict[str, Any], measure: str) -> Optional[float]:
    if measure == "kl":
        return task.get("kl")
    return task["blocks"][-1]["relative_error"] if task.get("blocks") else None


def _mean_value(row: dict[str, Any], measure: str) -> Optional[float]:
    return row.get("mean_kl" if measure == "kl" else "mean_last_block_error")


def _ratio(base: Optional[float], merged: Optional[float]) -> Optional[float]:
    """``base / merged``: inf when the merged model is exact and the base is not."""
    if base is None or merged is None:
        return None
    if math.isnan(base) or math.isnan(merged):
        return math.nan
    merged = max(merged, 0.0)  # a KL of -1e-17 is float rounding of 0
    if merged == 0.0:
        return math.inf if base > 0.0 else math.nan
    return base / merged


def _fmt(value: Optional[float]) -> str:
    if value is None:
        return "—"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.3g}"


def compare_with_references(result: dict[str, Any]) -> dict[str, Any]:
    """``base_ratio``, the tasks where the merged model is worse than the base and its verdict.

    ``base_ratio`` = M(base) / M(merged), M the mean over the tasks t of the mean
    KL(expert_t ‖ model) on task t's evaluation data (the mean last-block relative error for
    models without a head); > 1: the merged model is that many times closer to the experts
    than the unmerged base model is (``docs/methods.md``, "Diagnose").
    """
    measure = _measure(result)
    refs = result.get("references") or {}
    base = refs.get("base")
    merged_value = _mean_value(result, measure)
    base_value = _mean_value(base, measure) if base else None
    worse: list[str] = []
    if base:
        for name, task in result["tasks"].items():
            mine, theirs = _task_value(task, measure), _task_value(base["tasks"][name], measure)
            if mine is not None and theirs is not None and not mine <= theirs:
                worse.append(name)
    closer_experts = []
    for task_name, row in (refs.get("experts") or {}).items():
        value = _mean_value(row, measure)
        if value is not None and merged_value is not None and value <= merged_value:
            closer_experts.append((task_name, value))
    out = {
        "base_ratio": _ratio(base_value, merged_value),
        "ratio_measure": "mean_kl" if measure == "kl" else "mean_last_block_error",
        "worse_than_base_on": worse,
    }
    out["verdict"] = verdict(
        out["base_ratio"],
        merged_value,
        base_value,
        measure,
        result.get("evaluated_on", "calibration"),
        result.get("data") or {},
        worse,
        closer_experts,
        skipped=bool(refs.get("skipped")),
    )
    return out


def verdict(
    ratio: Optional[float],
    merged_value: Optional[float],
    base_value: Optional[float],
    measure: str,
    evaluated_on: str,
    data: dict[str, dict[str, Any]],
    worse_tasks: Sequence[str] = (),
    closer_experts: Sequence[tuple[str, float]] = (),
    skipped: bool = False,
) -> str:
    """One line in plain words, after the model's name: is it worth publishing, against the
    base model.

    Args:
        ratio: ``base_ratio`` (see :func:`compare_with_references`); None without a base.
        merged_value / base_value: the two means the ratio divides.
        measure: ``kl`` or ``lbe`` (last-block error).
        evaluated_on: ``held-out``, ``calibration`` or ``mixed``.
        data: per task, the evaluation data's description (``kind``).
        worse_tasks: tasks where the merged model is farther from the expert than the base.
        closer_experts: ``(task, mean)`` of the experts that, alone, are at least as close to
            all the experts as the merged model.
        skipped: the reference rows were not measured (``--no-references``).

    Returns:
        The verdict, e.g. "keeps 2.2× more of the experts' behaviour than the base model on
        held-out data (...)" or "is worse than the base model on held-out data (...): do not
        publish".
    """
    seen = [name for name, d in data.items() if d.get("kind") != "held-out"]
    where = {
        "held-out": "on held-out data",
        "calibration": "on the calibration data the merge read, which flatters it",
    }.get(evaluated_on, f"on held-out data (on seen calibration data for {', '.join(seen)})")
    what = "mean KL to the experts" if measure == "kl" else "mean last-block error"
    if merged_value is None:
        return "has no output or block measured: no verdict"
    if not math.isfinite(merged_value):
        return f"is broken: its {what} is {merged_value} {where}: do not publish"
    numbers = f"{what} {_fmt(merged_value)}"
    if skipped:
        return f"has a {numbers} {where}; reference rows skipped, so no comparison with the base"
    if base_value is None or ratio is None:
        return f"has a {numbers} {where}; the config names no base model to compare with"
    numbers += f" vs the base model's {_fmt(base_value)}"
    if math.isnan(ratio):
        text = f"cannot be compared with the base model {where} ({numbers})"
    elif ratio < 1.0:
        text = f"is worse than the base model {where} ({numbers}): do not publish"
    elif ratio == 1.0:
        text = f"is no better than the base model {where} ({numbers}): do not publish"
    elif math.isinf(ratio):
        text = f"matches the experts exactly {where} ({numbers})"
    else:
        times = f"{ratio:.1f}" if ratio >= 1.1 else f"{ratio:.2f}"
        text = (
            f"keeps {times}× more of the experts' behaviour than the base model {where} ({numbers})"
        )
        if worse_tasks:
            text += f"; but worse than the base model on {', '.join(worse_tasks)}"
    if closer_experts and (ratio is None or ratio >= 1.0):
        task, value = min(closer_experts, key=lambda e: e[1])
        text += (
            f"; the {task} expert alone is as close to all the experts ({what} "
            f"{_fmt(value)}): the merge adds nothing over it"
        )
    return text
