"""SyMerge's card section: loss, agreement with each expert, learned coefficients."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from mergekit_ext.plots import (
    Plot,
    as_float,
    finite,
    new_figure,
    save_figure,
    summary_stats,
)


def summarize_symerge(section: Mapping[str, Any], parameters: Any = None) -> dict[str, Any]:
    loss = [as_float(v) for v in section.get("loss") or []]
    tasks = list(section.get("tasks") or [])
    agreement = section.get("agreement") or {}
    heldout = section.get("heldout_accuracy") or {}
    lam = section.get("lambda") or []
    for task in list(agreement) + list(heldout):
        if task not in tasks:
            tasks.append(task)
    rows = []
    for k, task in enumerate(tasks):
        curve = [as_float(v) for v in agreement.get(task) or []]
        # lambda is K x P: one row per task (see adaptation/symerge.py)
        row = lam[k] if k < len(lam) and isinstance(lam[k], (list, tuple)) else []
        column = [as_float(v) for v in row]
        rows.append(
            {
                "task": task,
                "agreement_first": curve[0] if curve else math.nan,
                "agreement_last": curve[-1] if curve else math.nan,
                "heldout_accuracy": as_float(heldout.get(task)) if task in heldout else math.nan,
                "lambda": summary_stats(column),
            }
        )
    return {
        "steps": len(loss),
        "loss_first": loss[0] if loss else math.nan,
        "loss_last": loss[-1] if loss else math.nan,
        "loss_min": summary_stats(loss)["min"],
        "n_lambda_tensors": len(lam[0]) if lam and isinstance(lam[0], (list, tuple)) else 0,
        "tasks": rows,
    }


def plot_symerge(section: Mapping[str, Any], images_dir: str, parameters: Any = None) -> list[Plot]:
    """Loss curve, per-task agreement curves and the λ heat map."""
    plots: list[Plot] = []
    loss = [as_float(v) for v in section.get("loss") or []]
    if loss:
        fig, (ax,) = new_figure()
        ax.plot(range(1, len(loss) + 1), loss, color="#4C72B0")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title("SyMerge: training loss")
        if finite(loss) and min(finite(loss)) > 0 and max(finite(loss)) / min(finite(loss)) > 50:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        plots.append(
            Plot(
                save_figure(fig, images_dir, "symerge_loss.png"),
                "SyMerge loss",
                "Expert-guided self-labelling loss over the adaptation steps.",
            )
        )
    agreement: Mapping[str, Sequence[Any]] = section.get("agreement") or {}
    if agreement:
        fig, (ax,) = new_figure()
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
                save_figure(fig, images_dir, "symerge_agreement.png"),
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
        fig, (ax,) = new_figure(height=min(9.0, max(3.0, 0.12 * len(matrix) + 1.5)))
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
                save_figure(fig, images_dir, "symerge_lambda.png"),
                "SyMerge λ",
                "The final per-tensor, per-task coefficients of the shared body.",
            )
        )
    return plots
