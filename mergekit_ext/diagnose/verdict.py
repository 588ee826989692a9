"""The verdict of a diagnosis: the merged model against the base model and each expert alone.

``base_ratio`` = (the base model's mean KL to the experts) / (the merged model's), and one
line in plain words (``docs/methods.md``, "Diagnose").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

from mergekit_ext.diagnose.probe import PROBE_REJECT


def evaluated_on(data: dict[str, dict[str, Any]]) -> str:
    """``held-out``, ``calibration`` or ``probe`` when every task's data is of that kind,
    else ``mixed``."""
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


def _probe_ratio(result: dict[str, Any], measure: str) -> Optional[float]:
    """The base model's mean on the probe over the merged model's (None without both)."""
    probe = result.get("probe")
    base = ((result.get("references") or {}).get("base") or {}).get("probe")
    if not probe or not base:
        return None
    return _ratio(_mean_value(base, measure), _mean_value(probe, measure))


def compare_with_references(result: dict[str, Any]) -> dict[str, Any]:
    """``base_ratio``, ``probe_ratio``, the tasks where the merged model is worse than the base
    and its verdict.

    ``base_ratio`` = M(base) / M(merged), M the mean over the tasks t of the mean
    KL(expert_t ‖ model) on task t's evaluation data (the mean last-block relative error for
    models without a head); > 1: the merged model is that many times closer to the experts
    than the unmerged base model is. ``probe_ratio``: the same on the generic prose probe.
    Where the base model is one of the merged models (SLERP), ``best_single_ratio`` = the
    smallest M of one input model alone / M(merged) replaces ``base_ratio``
    (``docs/methods.md``, "Diagnose").
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
    singles = []
    for task_name, row in (refs.get("experts") or {}).items():
        value = _mean_value(row, measure)
        if value is not None:
            singles.append((task_name, row.get("model", task_name), value))
        # with one task, the expert alone is its own ceiling (K = 0): no comparison
        if len(result["tasks"]) > 1 and value is not None and merged_value is not None:
            if value <= merged_value:
                closer_experts.append((task_name, value))
    out: dict[str, Any] = {
        "base_ratio": _ratio(base_value, merged_value),
        "probe_ratio": _probe_ratio(result, measure),
        "ratio_measure": "mean_kl" if measure == "kl" else "mean_last_block_error",
        "worse_than_base_on": worse,
    }
    warnings = list(result.get("merge_warnings") or [])
    if refs.get("base_is_input") and singles and len(result["tasks"]) > 1:
        _, label, best = min(singles, key=lambda s: s[2])
        out["best_single_ratio"] = _ratio(best, merged_value)
        out["verdict"] = endpoint_verdict(
            out["best_single_ratio"],
            merged_value,
            label,
            best,
            measure,
            result.get("evaluated_on", "calibration"),
            warnings,
        )
        return out
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
        probe_ratio=out["probe_ratio"],
        merge_warnings=warnings,
    )
    return out


def _where(evaluated_on: str, data: dict[str, dict[str, Any]]) -> str:
    seen = [name for name, d in data.items() if d.get("kind") not in ("held-out", "probe")]
    if evaluated_on == "mixed" and not seen:
        return "on held-out data and the generic prose probe"
    return {
        "held-out": "on held-out data",
        "probe": "on the generic prose probe",
        "calibration": "on the calibration data the merge read, which flatters it",
    }.get(evaluated_on, f"on held-out data (on seen calibration data for {', '.join(seen)})")


def endpoint_verdict(
    ratio: Optional[float],
    merged_value: Optional[float],
    best_label: str,
    best_value: float,
    measure: str,
    evaluated_on: str,
    merge_warnings: Sequence[str] = (),
) -> str:
    """The verdict where the base model is an input of the merge (SLERP's endpoints): the
    merged model against the closest single input model, every input being a task."""
    where = _where(evaluated_on, {})
    what = "mean KL to the input models" if measure == "kl" else "mean last-block error"
    if merged_value is None:
        return "has no output or block measured: no verdict"
    if not math.isfinite(merged_value):
        return f"is broken: its {what} is {merged_value} {where}: do not publish"
    numbers = f"{what} {_fmt(merged_value)} vs {_fmt(best_value)} for {best_label} alone"
    if ratio is not None and not math.isnan(ratio) and ratio > 1.0:
        times = f"{ratio:.1f}" if ratio >= 1.1 else f"{ratio:.2f}"
        text = f"is {times}× closer to all its input models than the closest one alone {where} ({numbers})"
    else:
        text = (
            f"is no closer to all its input models than {best_label} alone {where} "
            f"({numbers}): publishing {best_label} would lose less"
        )
    return _with_warnings(text, merge_warnings)


def _with_warnings(text: str, merge_warnings: Sequence[str]) -> str:
    """A merge whose own record holds guard warnings never gets a positive verdict."""
    if not merge_warnings:
        return text
    reject = ": do not publish"
    if text.endswith(reject):  # the advice stays the last words of a rejecting verdict
        return f"{text[: -len(reject)]}; and {merge_warnings[0]}{reject}"
    return f"{text}; but {merge_warnings[0]}, which breaks it on other text: do not publish"


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
    probe_ratio: Optional[float] = None,
    merge_warnings: Sequence[str] = (),
) -> str:
    """One line in plain words, after the model's name: is it worth publishing, against the
    base model.

    Args:
        ratio: ``base_ratio`` (see :func:`compare_with_references`); None without a base.
        merged_value / base_value: the two means the ratio divides.
        measure: ``kl`` or ``lbe`` (last-block error).
        evaluated_on: ``held-out``, ``calibration``, ``probe`` or ``mixed``.
        data: per task, the evaluation data's description (``kind``).
        worse_tasks: tasks where the merged model is farther from the expert than the base.
        closer_experts: ``(task, mean)`` of the experts that, alone, are at least as close to
            all the experts as the merged model.
        skipped: the reference rows were not measured (``--no-references``).
        probe_ratio: the same ratio on the generic prose probe (None: not measured); below
            :data:`~mergekit_ext.diagnose.probe.PROBE_REJECT` the merge is broken outside
            its data: "do not publish"; below 1 a caveat.
        merge_warnings: guard warnings of the merge's own record: never a positive verdict.

    Returns:
        The verdict, e.g. "keeps 2.2× more of the experts' behaviour than the base model on
        held-out data (...)" or "is worse than the base model on held-out data (...): do not
        publish".
    """
    where = _where(evaluated_on, data)
    what = "mean KL to the experts" if measure == "kl" else "mean last-block error"
    if merged_value is None:
        return "has no output or block measured: no verdict"
    if not math.isfinite(merged_value):
        return f"is broken: its {what} is {merged_value} {where}: do not publish"
    numbers = f"{what} {_fmt(merged_value)}"
    if skipped:
        return _with_warnings(
            f"has a {numbers} {where}; reference rows skipped, so no comparison with the base",
            merge_warnings,
        )
    if base_value is None or ratio is None:
        return _with_warnings(
            f"has a {numbers} {where}; the config names no base model to compare with",
            merge_warnings,
        )
    numbers += f" vs the base model's {_fmt(base_value)}"
    probe_words = ""
    if probe_ratio is not None and not math.isnan(probe_ratio) and probe_ratio < 1.0:
        probe_words = (
            f"{1.0 / probe_ratio:.1f}× farther from the experts than the base model on "
            "generic text (the probe)"
            if probe_ratio > 0
            else "infinitely far from the experts on generic text (the probe)"
        )
    if math.isnan(ratio):
        text = f"cannot be compared with the base model {where} ({numbers})"
    elif ratio < 1.0:
        text = f"is worse than the base model {where} ({numbers}): do not publish"
    elif ratio == 1.0:
        text = f"is no better than the base model {where} ({numbers}): do not publish"
    elif probe_words and probe_ratio is not None and probe_ratio < PROBE_REJECT:
        text = (
            f"is {probe_words}: it breaks outside its calibration data (on held-out data it "
            f"looked {ratio:.2g}× better than the base: {numbers}): do not publish"
        )
        probe_words = ""
    elif math.isinf(ratio):
        text = f"matches the experts exactly {where} ({numbers})"
    else:
        times = f"{ratio:.1f}" if ratio >= 1.1 else f"{ratio:.2f}"
        text = (
            f"keeps {times}× more of the experts' behaviour than the base model {where} ({numbers})"
        )
        if worse_tasks:
            text += f"; but worse than the base model on {', '.join(worse_tasks)}"
    if probe_words:
        # the advice stays the last words, as every rejecting verdict ends
        reject = ": do not publish"
        if text.endswith(reject):
            text = f"{text[: -len(reject)]}, and {probe_words}{reject}"
        else:
            text += f"; {probe_words}"
    if closer_experts and (ratio is None or ratio >= 1.0) and not text.endswith("do not publish"):
        task, value = min(closer_experts, key=lambda e: e[1])
        text += (
            f"; the {task} expert alone is as close to all the experts ({what} "
            f"{_fmt(value)}): the merge adds nothing over it"
        )
    return _with_warnings(text, merge_warnings)
