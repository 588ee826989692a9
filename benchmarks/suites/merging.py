"""The methods the benchmark compares, their YAML configs, and running them in a subprocess.

Every merge runs as its own process through the real command line (``mergekit-ext run
CONFIG OUT``), so that its wall time and peak resident memory are its own.

A method that is not registered, raises ``NotImplementedError`` or says it is "not
available yet" is reported as not available, never as a number.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import yaml

LOG = logging.getLogger(__name__)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))

BaseUse = Literal["required", "none"]
# body: the experts' bodies; full: whole experts with heads (SyMerge); adapter: the LoRA
# adapters the experts were merged from, for suites that keep them (else not run)
Inputs = Literal["body", "full", "adapter"]


@dataclass(frozen=True)
class MethodRow:
    """One row of the benchmark table: a merge method with fixed parameters."""

    key: str  # row id, e.g. "task_arithmetic_0.3"
    method: str  # merge_method in the YAML
    label: str
    parameters: dict[str, Any] = field(default_factory=dict)
    model_parameters: dict[str, Any] = field(default_factory=dict)
    base: BaseUse = "required"
    inputs: Inputs = "body"  # SyMerge merges the full experts (with heads)


ROWS: tuple[MethodRow, ...] = (
    MethodRow("linear", "linear", "linear (mean)", {"normalize": True}, {"weight": 1.0}, "none"),
    MethodRow(
        "task_arithmetic_0.3",
        "task_arithmetic",
        "task arithmetic λ=0.3",
        {"lambda": 0.3},
        {"weight": 1.0},
    ),
    MethodRow(
        "task_arithmetic_1.0",
        "task_arithmetic",
        "task arithmetic λ=1.0",
        {"lambda": 1.0},
        {"weight": 1.0},
    ),
    MethodRow(
        "ties", "ties", "TIES (density 0.5)", {"lambda": 1.0}, {"weight": 1.0, "density": 0.5}
    ),
    MethodRow(
        "dare_ties",
        "dare_ties",
        "DARE-TIES (density 0.5)",
        {"lambda": 1.0},
        {"weight": 1.0, "density": 0.5},
    ),
    MethodRow("ace", "ace", "ACE"),
    # issue #15: a heterogeneity rule that does not depend on the task vectors' absolute size;
    # threshold chosen on text (full, LoRA) and LM: benchmarks/results/sweep_*_ace_heterogeneity
    MethodRow(
        "ace_scale_invariant",
        "ace",
        "ACE (scale-invariant rule, Var(log τ) > 0.1)",
        {"heterogeneity": "scale_invariant", "spread_threshold": 0.1},
    ),
    # the normalized branch on every weight: what a heterogeneity rule can at most switch to
    MethodRow("ace_always", "ace", "ACE (normalize: always)", {"normalize": "always"}),
    MethodRow("wudi", "wudi", "WUDI (300 Adam steps, lr 1e-5)"),
    MethodRow("regmean", "regmean", "RegMean"),
    MethodRow("chain_of_merges", "chain_of_merges", "Chain of Merges (defaults)"),
    # issue #51: full fine-tunes train the embeddings and norms too, which the least-squares
    # methods merge by their fallback (the experts' mean by default); summed here instead
    MethodRow(
        "regmean_fallback_ta",
        "regmean",
        "RegMean (fallback: task_arithmetic)",
        {"fallback": "task_arithmetic"},
    ),
    MethodRow(
        "com_fallback_ta",
        "chain_of_merges",
        "CoM (fallback: task_arithmetic)",
        {"fallback": "task_arithmetic"},
    ),
    MethodRow(
        "com_propagate",
        "chain_of_merges",
        "CoM: propagate only",
        {"propagate": True, "normalize": False, "task_weighting": "uniform"},
    ),
    MethodRow(
        "com_propagate_normalize",
        "chain_of_merges",
        "CoM: + normalize",
        {"propagate": True, "normalize": True, "task_weighting": "uniform"},
    ),
    MethodRow(
        "com_propagate_normalize_weighting",
        "chain_of_merges",
        "CoM: + normalize + weighting",
        {"propagate": True, "normalize": True, "task_weighting": "correlation"},
    ),
    # issue #51: CoM's closed form, then each block distilled toward the experts' blocks
    MethodRow("block_distillation", "block_distillation", "Block distillation on CoM (defaults)"),
    # the settings the defaults were chosen against: the targets, then the step-size schedule
    MethodRow(
        "block_distillation_merged_path",
        "block_distillation",
        "Block distillation on CoM (merged-path targets: the first defaults)",
        {"distill_target": "merged_path"},
    ),
    MethodRow(
        "block_distillation_merged_path_cosine",
        "block_distillation",
        "Block distillation on CoM (merged-path targets, cosine step)",
        {"distill_target": "merged_path", "distill_schedule": "cosine"},
    ),
    MethodRow(
        "block_distillation_previous",
        "block_distillation",
        "Block distillation on CoM (the defaults before: 120 steps, linears only)",
        {
            "distill_steps": 120,
            "distill_first_block_factor": 1,
            "distill_vectors": False,
            "distill_embeddings": False,
        },
    ),
    MethodRow(
        "block_distillation_no_embeddings",
        "block_distillation",
        "Block distillation on CoM (defaults + vectors, embeddings not trained)",
        {"distill_embeddings": False, "distill_vectors": True},
    ),
    MethodRow(
        "block_distillation_vectors",
        "block_distillation",
        "Block distillation on CoM (defaults, biases and norms trained too)",
        {"distill_vectors": True},
    ),
    MethodRow(
        "block_distillation_first_1",
        "block_distillation",
        "Block distillation on CoM (defaults + vectors, first block no extra steps)",
        {"distill_first_block_factor": 1, "distill_vectors": True},
    ),
    MethodRow(
        "block_distillation_s120_emb",
        "block_distillation",
        "120 steps + embeddings",
        {"distill_steps": 120, "distill_first_block_factor": 1, "distill_vectors": False},
    ),
    MethodRow(
        "block_distillation_s120_emb_vec",
        "block_distillation",
        "120 steps + embeddings + vectors",
        {"distill_steps": 120, "distill_first_block_factor": 1, "distill_vectors": True},
    ),
    MethodRow(
        "block_distillation_s120_emb_first4",
        "block_distillation",
        "120 steps + embeddings, first block x4",
        {"distill_steps": 120, "distill_first_block_factor": 4, "distill_vectors": False},
    ),
    MethodRow(
        "block_distillation_s120_all_first4",
        "block_distillation",
        "120 steps + embeddings + vectors, first block x4",
        {"distill_steps": 120, "distill_first_block_factor": 4, "distill_vectors": True},
    ),
    MethodRow(
        "block_distillation_s120_all_first8",
        "block_distillation",
        "120 steps + embeddings + vectors, first block x8",
        {"distill_steps": 120, "distill_first_block_factor": 8, "distill_vectors": True},
    ),
    MethodRow(
        "block_distillation_s160_all_first4",
        "block_distillation",
        "160 steps + embeddings + vectors, first block x4",
        {"distill_steps": 160, "distill_first_block_factor": 4, "distill_vectors": True},
    ),
    MethodRow(
        "block_distillation_s480_emb",
        "block_distillation",
        "480 steps + embeddings",
        {"distill_steps": 480, "distill_first_block_factor": 1, "distill_vectors": False},
    ),
    MethodRow(
        "block_distillation_cosine",
        "block_distillation",
        "Block distillation on CoM (cosine step)",
        {"distill_schedule": "cosine"},
    ),
    # the steps before the norm limit (issue #51): every trained tensor free to leave the range
    MethodRow(
        "block_distillation_no_norm_limit",
        "block_distillation",
        "Block distillation on CoM (no norm limit)",
        {"distill_max_norm_ratio": float("inf")},
    ),
    # held at ridge: auto's range instead of the guard's warning line (docs/methods.md)
    MethodRow(
        "block_distillation_norm_limit_1_5",
        "block_distillation",
        "Block distillation on CoM (norm limit 1.5x)",
        {"distill_max_norm_ratio": 1.5},
    ),
    # the lowest-error weights of 7 measured points and the end (the constant step oscillates)
    MethodRow(
        "block_distillation_checkpoints_7",
        "block_distillation",
        "Block distillation on CoM (lowest error of 8 points)",
        {"distill_checkpoints": 7},
    ),
    # each token's relative error counts once: an LLM's attention sink no longer dominates
    MethodRow(
        "block_distillation_token_equal",
        "block_distillation",
        "Block distillation on CoM (tokens weighted equally)",
        {"distill_token_weight": "equal"},
    ),
    MethodRow(
        "qp_diagonal", "qp_projection", "QP projection (diagonal basis)", {"basis": "diagonal"}
    ),
    MethodRow(
        "qp_residual_eigen",
        "qp_projection",
        "QP projection (residual eigenbasis)",
        {"basis": "residual_eigen"},
    ),
    # the ridge pulls d toward task arithmetic λ=1 instead of the base (sweep `ridge` on these)
    MethodRow(
        "qp_diagonal_prior1",
        "qp_projection",
        "QP projection (diagonal, prior 1)",
        {"basis": "diagonal", "prior": 1.0},
    ),
    MethodRow(
        "qp_residual_eigen_prior1",
        "qp_projection",
        "QP projection (residual eigenbasis, prior 1)",
        {"basis": "residual_eigen", "prior": 1.0},
    ),
    # 10 epochs (one step per task each) instead of the method's 100: CPU-sized
    MethodRow("symerge", "symerge", "SyMerge (10 epochs)", {"epochs": 10}, inputs="full"),
    MethodRow("symerge_default", "symerge", "SyMerge (defaults: 100 epochs)", inputs="full"),
    MethodRow(
        "symerge_com_body",
        "symerge",
        "SyMerge on a CoM body (10 epochs)",
        {"epochs": 10, "body": "chain_of_merges"},
        inputs="full",
    ),
    # the same run with each expert given as its LoRA adapter: task vectors kept as factors
    MethodRow(
        "symerge_lora",
        "symerge",
        "SyMerge (10 epochs, LoRA adapters as experts)",
        {"epochs": 10},
        inputs="adapter",
    ),
)
ROW_KEYS = tuple(r.key for r in ROWS)
SMOKE_ROWS = ("linear", "regmean")  # ACE takes minutes even on a 1-layer MiniLM
# rows that are not merges: scored directly
REFERENCE_ROWS = ("pretrained", "expert")


def rows_for(keys: Sequence[str]) -> list[MethodRow]:
    by_key = {r.key: r for r in ROWS}
    unknown = [k for k in keys if k not in by_key]
    if unknown:
        raise ValueError(f"unknown method row(s) {unknown}; choose from {', '.join(ROW_KEYS)}")
    return [by_key[k] for k in keys]


def row_recipe(row: MethodRow) -> dict[str, Any]:
    """What a result row ran, so that a table can be reproduced from its JSON alone.

    ``parameters`` / ``model_parameters`` are the YAML's (shared / on every model entry);
    ``defaults`` the method's own values for every other parameter, as registered now.
    ``base_model`` and ``inputs`` say which models the YAML names (see :func:`build_config`).
    """
    from mergekit_ext.methods.registry import all_method_names, describe_method

    given = {**row.parameters, **row.model_parameters}
    defaults: dict[str, Any] = {}
    if row.method in all_method_names():
        defaults = {
            p["name"]: p["default"]
            for p in describe_method(row.method)["parameters"]
            if not p["required"] and p["name"] not in given
        }
    return {
        "merge_method": row.method,
        "parameters": dict(row.parameters),
        "model_parameters": dict(row.model_parameters),
        "defaults": defaults,
        "base_model": row.base == "required",
        "inputs": row.inputs,
    }


def availability(row: MethodRow) -> Optional[str]:
    """None when ``row`` can run now, else the reason it cannot (for the table)."""
    import mergekit_ext  # noqa: F401  (registers our methods)
    from mergekit_ext.methods.registry import all_method_names, describe_method

    if row.method not in all_method_names():
        return f"not available (method {row.method!r} not registered yet)"
    known = {p["name"] for p in describe_method(row.method)["parameters"]}
    missing = sorted(set(row.parameters) - known)
    if missing:
        return f"not available ({row.method} has no parameter(s) {missing} yet)"
    return None


def needs_calibration(method: str) -> bool:
    from mergekit_ext.methods.registry import ext_method_info

    info = ext_method_info(method)
    return bool(info and info.needs_calibration)


def build_config(
    row: MethodRow,
    base: str,
    experts: dict[str, str],
    calibration: Optional[dict[str, dict[str, Any]]],
    dtype: str = "float32",
) -> dict[str, Any]:
    """The merge YAML (as a dict) for ``row``; ``experts`` maps task name to folder."""
    return config_from_recipe(row_recipe(row), base, experts, calibration, dtype)


def config_from_recipe(
    recipe: dict[str, Any],
    base: str,
    experts: dict[str, str],
    calibration: Optional[dict[str, dict[str, Any]]],
    dtype: str = "float32",
) -> dict[str, Any]:
    """The merge YAML (as a dict) of a result row's recipe (:func:`row_recipe`)."""
    models = []
    for task, folder in experts.items():
        entry: dict[str, Any] = {"model": folder, "name": task}
        if recipe["model_parameters"]:
            entry["parameters"] = dict(recipe["model_parameters"])
        if calibration is not None:
            entry["calibration"] = dict(calibration[task])
        models.append(entry)
    config: dict[str, Any] = {
        "merge_method": recipe["merge_method"],
        "models": models,
        "dtype": dtype,
    }
    if recipe["base_model"]:
        config["base_model"] = base
    if recipe["parameters"]:
        config["parameters"] = dict(recipe["parameters"])
    return config


def merge_command(config_path: str, out_dir: str) -> list[str]:
    return [sys.executable, "-m", "mergekit_ext", "run", config_path, out_dir, "--random-seed", "0"]


@dataclass
class MergeRun:
    ok: bool
    wall_seconds: float
    peak_rss_mb: float
    status: str  # "ok", "not available (...)" or "error: ..."
    log_path: str


NOT_AVAILABLE_MARKERS = ("NotImplementedError", "not available yet")


def run_merge_process(
    config: dict[str, Any], work_dir: str, out_dir: str, timeout_s: float = 3600
) -> MergeRun:
    """Write ``config`` to ``work_dir/config.yaml`` and merge it into ``out_dir`` in a
    subprocess; wall time and peak RSS (its ``VmHWM``, polled every 50 ms) are that process's."""
    os.makedirs(work_dir, exist_ok=True)
    config_path = os.path.join(work_dir, "config.yaml")
    with open(config_path, "w", encoding="utf-8") as fp:
        yaml.safe_dump(config, fp, sort_keys=False)
    shutil.rmtree(out_dir, ignore_errors=True)
    log_path = os.path.join(work_dir, "merge.log")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    cmd = merge_command(config_path, out_dir)
    LOG.info("merging: %s", " ".join(cmd))
    peak_kb = 0
    with open(log_path, "w", encoding="utf-8") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work_dir)
        deadline = start + timeout_s
        timed_out = False
        while proc.poll() is None:
            peak_kb = max(peak_kb, _peak_rss_kb(proc.pid))
            if time.perf_counter() > deadline:
                proc.kill()
                proc.wait()
                timed_out = True
                break
            time.sleep(0.05)
        wall = time.perf_counter() - start
    peak_mb = peak_kb / 1024.0
    if proc.returncode == 0 and os.path.isdir(out_dir):
        return MergeRun(True, wall, peak_mb, "ok", log_path)
    with open(log_path, encoding="utf-8", errors="replace") as fp:
        text = fp.read()
    last = _last_error_line(text)
    if any(m in text for m in NOT_AVAILABLE_MARKERS):
        return MergeRun(False, wall, peak_mb, f"not available ({last})", log_path)
    if timed_out:
        last = f"timed out after {timeout_s:.0f}s"
    return MergeRun(False, wall, peak_mb, f"error: {last}", log_path)


def _peak_rss_kb(pid: int) -> int:
    """The process's own peak resident set (``VmHWM``) plus its children's current RSS.

    ``wait4``'s ``ru_maxrss`` cannot be used: Linux folds the parent's peak into a forked
    child's at ``exec``, so every merge would report at least the harness's own size.
    """
    total = 0
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fp:
            for line in fp:
                if line.startswith("VmHWM:"):
                    total = int(line.split()[1])
                    break
        import psutil

        for child in psutil.Process(pid).children(recursive=True):
            total += child.memory_info().rss // 1024
    except Exception as e:  # the process exited between polls (OSError, psutil.NoSuchProcess)
        LOG.debug("rss poll of %d: %s", pid, e)
    return total


def _last_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for line in reversed(lines):
        if "Error" in line or "error" in line or "Exception" in line:
            return line[:300]
    return (lines[-1] if lines else "no output")[:300]
