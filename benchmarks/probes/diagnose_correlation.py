"""Does ``mergekit-ext diagnose`` predict how good a merge is, without any test data?

    python -m benchmarks.probes.diagnose_correlation [--suites lm text_full text_lora]
        [--rows ROW ...] [--calibration-samples N] [--threads 1] [--cache-dir DIR]
        [--out benchmarks/results]

For each suite (and expert variant) it takes the method rows of the committed benchmark
table (``benchmarks/results/<suite>_<variant>.json``: the measured per-task scores and the
normalized score of each row), builds or reuses the base, the experts and each row's merged
model through the benchmark's own cache (``benchmarks/suites/cache.py``; the merge runs as
``mergekit-ext run`` exactly as ``benchmarks/suites/run.py`` runs it, and the merged folder is
kept under ``<cache>/.../runs/<variant>/<row>/merged``), then diagnoses every merged model
against the experts on the tasks' calibration data (training texts, never test texts), in
one pass per task that shares the experts' forwards between the rows. It reports, per
suite, the Spearman rank correlation between the measured average normalized score and:

- the mean agreement with the experts (argmax / next-token top-1),
- minus the mean KL(expert ‖ merged),
- minus the mean relative error of the last block,

with a scatter plot, and the cost of ``diagnose`` on one merge next to two whole-model
calibration forward passes per task (expert and merged) with transformers.

The experts are rebuilt from their recipes when the cache is empty (seeded; CPU training),
so the merged models are those of the committed table up to floating-point differences of
the rebuilt experts; the scores are the committed ones (this script never scores a merge).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from typing import Any, Optional

import yaml

from benchmarks.suites.cache import default_cache_dir
from benchmarks.suites.merging import config_from_recipe, run_merge_process
from benchmarks.suites.report import environment_versions
from benchmarks.suites.run import configure_process, make_suite

LOG = logging.getLogger("benchmarks.probes.diagnose_correlation")

SUITES = {"lm": ("lm", "lora"), "text_full": ("text", "full"), "text_lora": ("text", "lora")}
# SyMerge writes one model per task (no single merged folder to diagnose); the others are
# listed cheapest first so that a time-limited run covers as many rows as possible.
ROW_ORDER = (
    "linear",
    "task_arithmetic_1.0",
    "dare_ties",
    "task_arithmetic_0.3",
    "ties",
    "regmean",
    "ace",
    "chain_of_merges",
    "qp_diagonal",
    "com_propagate_normalize",
    "com_propagate_normalize_weighting",
    "qp_residual_eigen",
    "com_propagate",
)
PREDICTORS = {
    "agreement": ("mean_agreement", 1.0),
    "-KL": ("mean_kl", -1.0),
    "-last-block error": ("mean_last_block_error", -1.0),
}


def spearman(xs: list[float], ys: list[float]) -> Optional[float]:
    """Spearman's rho (average ranks for ties); None below three points or for a constant."""
    if len(xs) < 3:
        return None
    from scipy.stats import spearmanr

    rho = spearmanr(xs, ys).statistic
    return None if rho is None or math.isnan(float(rho)) else float(rho)


def _rows(table: dict[str, Any], wanted: Optional[list[str]]) -> list[dict[str, Any]]:
    by_key = {r["key"]: r for r in table["rows"] if r.get("status") == "ok"}
    keys = [k for k in (wanted or ROW_ORDER) if k in by_key and by_key[k].get("merge_method")]
    return [by_key[k] for k in keys if by_key[k].get("inputs", "body") == "body"]


def _diagnose_config(suite: Any, variant: str, samples: int) -> dict[str, Any]:
    """The diagnose YAML: the experts with their heads, each with its calibration data."""
    models = []
    for task in suite.tasks:
        expert = suite.expert(variant, task)
        calibration = dict(suite.calibration(task))
        calibration["samples"] = min(samples, int(calibration.get("samples", samples)))
        calibration["batch_size"] = 8
        models.append({"model": expert.full, "name": task, "calibration": calibration})
    base, _ = suite.base()
    return {"merge_method": "linear", "base_model": base, "models": models}


def _merged_folder(suite: Any, variant: str, row: dict[str, Any], base: str) -> Optional[str]:
    """The row's merged model, merged (as benchmarks/suites/run.py does) when it is not cached."""
    work = os.path.join(suite.root, "runs", variant, row["key"])
    merged = os.path.join(work, "merged")
    recipe = {k: row[k] for k in ("merge_method", "parameters", "model_parameters", "base_model")}
    recipe["defaults"] = row.get("defaults", {})
    recipe["inputs"] = row.get("inputs", "body")
    marker = os.path.join(work, "diagnose_recipe.json")
    if os.path.isfile(os.path.join(merged, "config.json")) and os.path.isfile(marker):
        with open(marker, encoding="utf-8") as fp:
            if json.load(fp) == recipe:
                return merged
    from benchmarks.suites.merging import needs_calibration

    experts = {t: suite.expert(variant, t).body for t in suite.tasks}
    calibration = (
        {t: suite.calibration(t) for t in suite.tasks}
        if needs_calibration(row["merge_method"])
        else None
    )
    config = config_from_recipe(recipe, base, experts, calibration)
    run = run_merge_process(config, work, merged)
    LOG.info("%s: merge %s in %.1fs", row["key"], run.status, run.wall_seconds)
    if not run.ok:
        return None
    with open(marker, "w", encoding="utf-8") as fp:
        json.dump(recipe, fp)
    return merged


def _whole_model_forwards(cfg: Any, merged: str) -> float:
    """Seconds of two transformers forward passes per task (expert, merged LM) on its data,
    model loading included (as diagnose's time includes reading the weights)."""
    import torch
    import transformers

    from mergekit_ext.calibration.sources import load_calibration

    cls = transformers.AutoModelForCausalLM
    start = time.perf_counter()
    merged_model = cls.from_pretrained(merged, dtype=torch.float32).eval()
    for entry in cfg.models:
        data = load_calibration(
            cfg.calibration_for(entry), entry.model, task=entry.name, modality="text"
        )
        expert = cls.from_pretrained(entry.model, dtype=torch.float32).eval()
        with torch.no_grad():
            for model in (expert, merged_model):
                for batch in data.batches:
                    model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        del expert
    return time.perf_counter() - start


def run_suite(name: str, args: argparse.Namespace, results_dir: str) -> Optional[dict[str, Any]]:
    from mergekit_ext.config import parse_config
    from mergekit_ext.diagnose import diagnose

    suite_name, variant = SUITES[name]
    table_path = os.path.join(
        results_dir, f"{suite_name}_{variant}{'_smoke' if args.smoke else ''}.json"
    )
    with open(table_path, encoding="utf-8") as fp:
        table = json.load(fp)
    suite = make_suite(suite_name, args.cache_dir, args.smoke)
    if table.get("settings") != suite.settings_dict():
        LOG.warning("%s: the table's settings differ from the suite's; rows may not match", name)
    rows = _rows(table, args.rows)[: args.max_rows]
    base, _ = suite.base()
    raw = _diagnose_config(suite, variant, args.calibration_samples)
    cfg = parse_config(yaml.safe_dump(raw))
    folders: dict[str, str] = {}
    for row in rows:
        folder = _merged_folder(suite, variant, row, base)
        if folder is not None:
            folders[row["key"]] = folder
        if args.deadline and time.time() > args.deadline:
            LOG.warning("deadline reached after %d rows of %s", len(folders), name)
            break
    if not folders:
        return None
    start = time.perf_counter()
    # the committed results: measured on the calibration texts, without reference rows
    # as the numbers in README were measured: no reference rows, no probe (issue #50)
    results = diagnose(
        cfg, list(folders.values()), data="calibration", references=False, probe=False
    )
    all_seconds = time.perf_counter() - start
    points = []
    for key, result in zip(folders, results):
        row = next(r for r in rows if r["key"] == key)
        points.append(
            {
                "key": key,
                "label": row["label"],
                "avg_normalized": row["avg_normalized"],
                "mean_agreement": result["mean_agreement"],
                "mean_kl": result["mean_kl"],
                "mean_last_block_error": result["mean_last_block_error"],
                "tasks": {
                    t: {"agreement": v["agreement"], "kl": v["kl"], "blocks": v["blocks"]}
                    for t, v in result["tasks"].items()
                },
            }
        )
    correlations = {}
    scores = [p["avg_normalized"] for p in points]
    for label, (field, sign) in PREDICTORS.items():
        values = [p[field] for p in points]
        if all(v is not None for v in values):
            correlations[label] = spearman([sign * v for v in values], scores)
    cost = None
    if args.cost and folders and suite_name == "lm":
        key = next(iter(folders))
        one = time.perf_counter()
        diagnose(cfg, folders[key], data="calibration", references=False, probe=False)
        diagnose_s = time.perf_counter() - one
        forwards_s = _whole_model_forwards(cfg, folders[key])
        cost = {
            "row": key,
            "diagnose_seconds": round(diagnose_s, 2),
            "two_forwards_per_task_seconds": round(forwards_s, 2),
            "ratio": round(diagnose_s / forwards_s, 2) if forwards_s else None,
        }
    return {
        "suite": name,
        "title": table.get("title", name),
        "rows_in_table": len(_rows(table, None)),
        "calibration_samples": args.calibration_samples,
        "diagnose_seconds_all_rows": round(all_seconds, 1),
        "points": points,
        "spearman": correlations,
        "cost": cost,
    }


def _fmt(value: Optional[float], digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def write_report(suites: list[dict[str, Any]], out: str, command: str) -> list[str]:
    os.makedirs(out, exist_ok=True)
    json_path = os.path.join(out, "diagnose_correlation.json")
    commands = [command]
    if os.path.isfile(json_path):  # keep the suites of earlier runs that this one did not redo
        with open(json_path, encoding="utf-8") as fp:
            earlier = json.load(fp)
        redone = {s["suite"] for s in suites}
        suites = [s for s in earlier.get("suites", []) if s["suite"] not in redone] + suites
        commands = [c for c in earlier.get("commands", []) if c != command] + commands
    payload = {"suites": suites, "commands": commands, "versions": environment_versions()}
    with open(json_path, "w", encoding="utf-8") as fp:
        json.dump(payload, fp, indent=2)
        fp.write("\n")
    lines = ["# Does `diagnose` predict the measured merge quality?", ""]
    for s in suites:
        lines += [
            f"## {s['title']} ({len(s['points'])} of {s['rows_in_table']} method rows)",
            "",
            "Spearman rank correlation with the measured average normalized score: "
            + ", ".join(f"{k} {_fmt(v)}" for k, v in s["spearman"].items()),
            "",
            "| row | avg normalized (measured) | mean agreement | mean KL | mean last-block error |",
            "|---|---|---|---|---|",
        ]
        for p in sorted(s["points"], key=lambda p: -p["avg_normalized"]):
            lines.append(
                f"| {p['label']} | {_fmt(p['avg_normalized'])} | {_fmt(p['mean_agreement'])} "
                f"| {_fmt(p['mean_kl'], 4)} | {_fmt(p['mean_last_block_error'])} |"
            )
        lines.append("")
        lines.append(
            f"diagnose of all {len(s['points'])} merges together (experts' forwards shared), "
            f"{s['calibration_samples']} calibration samples per task: "
            f"{s['diagnose_seconds_all_rows']} s"
        )
        if s["cost"]:
            c = s["cost"]
            lines.append(
                f"\nCost on one merge ({c['row']}): diagnose {c['diagnose_seconds']} s vs two "
                f"whole-model calibration forward passes per task with transformers "
                f"{c['two_forwards_per_task_seconds']} s (ratio {c['ratio']})"
            )
        lines.append("")
    lines += [f"Command: `{c}`  " for c in commands]
    lines += [
        "Versions: " + ", ".join(f"{k} {v}" for k, v in payload["versions"].items()),
        "",
        "![scatter](diagnose_correlation.png)",
        "",
    ]
    md_path = os.path.join(out, "diagnose_correlation.md")
    with open(md_path, "w", encoding="utf-8") as fp:
        fp.write("\n".join(lines))
    png_path = os.path.join(out, "diagnose_correlation.png")
    _scatter(suites, png_path)
    return [json_path, md_path, png_path]


def _scatter(suites: list[dict[str, Any]], path: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2 * max(1, len(suites)), 3.8), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    for i, s in enumerate(suites):
        ax = fig.add_subplot(1, max(1, len(suites)), i + 1)
        xs = [p["mean_agreement"] for p in s["points"]]
        ys = [p["avg_normalized"] for p in s["points"]]
        ax.scatter(xs, ys, s=18)
        for p, x, y in zip(s["points"], xs, ys):
            ax.annotate(p["key"], (x, y), fontsize=6, xytext=(2, 2), textcoords="offset points")
        rho = s["spearman"].get("agreement")
        ax.set_title(f"{s['suite']}: Spearman ρ = {_fmt(rho, 2)}", fontsize=9)
        ax.set_xlabel("diagnose: mean agreement with the experts")
        ax.set_ylabel("measured avg normalized score")
        ax.grid(True, alpha=0.3)
    fig.savefig(path, format="png", metadata={"Software": None})


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suites", nargs="+", default=["lm"], choices=list(SUITES))
    parser.add_argument("--rows", nargs="+", help="row keys (default: every body row)")
    parser.add_argument("--max-rows", type=int, default=None)
    parser.add_argument("--calibration-samples", type=int, default=32)
    parser.add_argument("--cache-dir", default=default_cache_dir())
    parser.add_argument("--results", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--smoke", action="store_true", help="the suites' smoke models (plumbing check only)"
    )
    parser.add_argument("--no-cost", dest="cost", action="store_false")
    parser.add_argument(
        "--deadline-minutes", type=float, default=None, help="stop merging new rows after this"
    )
    args = parser.parse_args(argv)
    args.deadline = time.time() + 60 * args.deadline_minutes if args.deadline_minutes else None
    configure_process(args.threads)
    command = "python -m benchmarks.probes.diagnose_correlation " + " ".join(sys.argv[1:])
    done = []
    for name in args.suites:
        result = run_suite(name, args, args.results)
        if result is not None:
            done.append(result)
            LOG.info("%s: %s", name, result["spearman"])
            write_report(done, args.out, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
