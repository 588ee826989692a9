"""Offline merging benchmark on real pretrained models and real data shipped in packages.

    python -m benchmarks.suites.run --suite text|lm|vision|all [--methods ROW ...] [--smoke]
                             [--cache-dir DIR] [--out benchmarks/results]

For each suite (and variant: the text suite has ``full`` and ``lora`` experts) it builds
or reuses the base and the experts, scores the pretrained body with the experts' heads and
each expert alone (the ceiling), merges the experts with every method row through
``mergekit-ext run`` in a subprocess, scores the merge, and writes one table per suite and
variant as Markdown, JSON and a bar chart (PNG) into ``--out``.

Rows (``--methods``, row keys or method names): see ``benchmarks/suites/merging.py``'s ``ROWS``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from benchmarks.suites.cache import default_cache_dir, recipe_hash
from benchmarks.suites.merging import (
    REFERENCE_ROWS,
    ROW_KEYS,
    ROWS,
    SMOKE_ROWS,
    MethodRow,
    availability,
    build_config,
    needs_calibration,
    row_recipe,
    rows_for,
    run_merge_process,
)
from benchmarks.suites.report import environment_versions, mean, normalized_scores, write_reports
from benchmarks.suites.suite_base import Expert, Suite

LOG = logging.getLogger("benchmarks")

SUITES = ("text", "lm", "lm_full", "vision")
SMOKE_VARIANTS = {"text": ("full",)}  # smoke: one text variant keeps it within minutes
# ``--suite all --smoke``: lm_full's smoke run is a test of its own (CI time), the rest as before
SMOKE_ALL = ("text", "lm", "vision")


def _command_line() -> str:
    """The command that ran, as a user retypes it from the repository root: a script of this
    repository becomes ``python -m benchmarks.suites.<name>``, so that the tables (committed,
    published) never carry the absolute path of the checkout that made them."""
    if not sys.argv or not sys.argv[0]:
        return "run_variant()"
    script = os.path.abspath(sys.argv[0])
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if script.startswith(root + os.sep) and script.endswith(".py"):
        module = os.path.relpath(script, root)[: -len(".py")].replace(os.sep, ".")
        return " ".join(["python -m", module, *sys.argv[1:]])
    return "python " + " ".join(sys.argv)


def make_suite(
    name: str, cache_dir: str, smoke: bool, tasks: Optional[Sequence[str]] = None
) -> Suite:
    """Suite ``name``; ``tasks``: another set of its modality's tasks than its default
    three (the K sweeps of issue #51: 2 or 4 vision tasks)."""
    if name == "text":
        from benchmarks.suites.text_suite import TextSuite

        return TextSuite(cache_dir, smoke, tasks)
    if name == "lm":
        from benchmarks.suites.lm_suite import LMSuite

        return LMSuite(cache_dir, smoke, tasks)
    if name == "lm_full":
        from benchmarks.suites.lm_full_suite import LMFullSuite

        return LMFullSuite(cache_dir, smoke, tasks)
    if name == "vision":
        from benchmarks.suites.vision_suite import VisionSuite

        return VisionSuite(cache_dir, smoke, tasks)
    raise ValueError(f"unknown suite {name!r}; use one of {SUITES} or all")


def select_rows(names: Optional[list[str]], smoke: bool) -> list[MethodRow]:
    if not names:
        return rows_for(SMOKE_ROWS if smoke else ROW_KEYS)
    keys: list[str] = []
    for name in names:
        if name.startswith("row:"):  # exactly one row, even when its key is also a method name
            matches = [r.key for r in ROWS if r.key == name[4:]]
        else:
            matches = [r.key for r in ROWS if name in (r.key, r.method)]
        if not matches:
            raise SystemExit(
                f"unknown method {name!r}: use a row key ({', '.join(ROW_KEYS)}) or a method name"
            )
        keys += [k for k in matches if k not in keys]
    return rows_for(keys)


def _row(
    key: str,
    label: str,
    metric: str,
    scores: Optional[dict[str, float]],
    experts: Optional[dict[str, float]],
    pretrained: Optional[dict[str, float]],
    status: str = "ok",
    **extra: Any,
) -> dict[str, Any]:
    row: dict[str, Any] = {"key": key, "label": label, "status": status, **extra}
    if scores is not None and experts is not None and pretrained is not None:
        norm = normalized_scores(metric, scores, experts, pretrained)
        row.update(
            scores=scores,
            normalized=norm,
            avg_score=mean(list(scores.values())),
            avg_normalized=mean([v for v in norm.values() if v is not None]),
        )
    return row


def merge_input(row: MethodRow, expert: Expert) -> str:
    """The folder (or adapter folder) the row's YAML names for ``expert``."""
    if row.inputs == "body":
        return expert.body
    if row.inputs == "adapter" and expert.adapter is not None:
        return expert.adapter
    return expert.full


def evaluate_merge(
    suite: Suite, row: MethodRow, out_dir: str, experts: dict[str, Expert]
) -> dict[str, float]:
    if row.inputs == "body":
        return suite.evaluate_body(out_dir, experts)
    # a method over full experts (SyMerge) writes one complete model per task: OUT/<task>/
    scores = {}
    for task in experts:
        folder = os.path.join(out_dir, "tasks", task)
        if not os.path.isfile(os.path.join(folder, "config.json")):
            if suite.metric == "loss" and os.path.isfile(os.path.join(out_dir, "config.json")):
                folder = out_dir  # one merged LM for every domain
            else:
                raise RuntimeError(
                    f"{row.method} output has no per-task model {folder}/config.json; "
                    "expected one complete model per task under OUT/tasks/<task name>/"
                )
        scores[task] = suite.evaluate_full(folder, task)
    return scores


def _earlier_rows(
    path: str, result: dict[str, Any], rows: list[MethodRow]
) -> tuple[list[dict[str, Any]], list[str]]:
    """Rows of an earlier run of the same table (same settings) that this run does not redo,
    so that ``--methods`` can add rows to a table instead of replacing it; and the commands
    that produced that table."""
    if not os.path.isfile(path):
        return [], []
    with open(path, encoding="utf-8") as fp:
        previous = json.load(fp)
    if previous.get("settings") != result["settings"] or previous.get("tasks") != result["tasks"]:
        return [], []
    redo = {r.key for r in rows} | set(REFERENCE_ROWS)
    kept = [r for r in previous.get("rows", []) if r["key"] not in redo]
    return kept, list(previous.get("commands", [])) if kept else []


def _ordered(current: list[dict[str, Any]], earlier: list[dict[str, Any]]) -> list[dict[str, Any]]:
    order = {key: i for i, key in enumerate((*REFERENCE_ROWS, *ROW_KEYS))}
    return sorted([*current, *earlier], key=lambda r: order.get(r["key"], len(order)))


def reference_rows(
    metric: str, pretrained: dict[str, float], expert_scores: dict[str, float], pre_eval: float
) -> list[dict[str, Any]]:
    """The table's two reference rows: the pretrained body and each expert alone."""
    return [
        _row(
            "pretrained",
            "pretrained body + expert heads" if metric == "accuracy" else "pretrained (base)",
            metric,
            pretrained,
            expert_scores,
            pretrained,
            eval_seconds=round(pre_eval, 1),
            merge_method=None,
        ),
        _row(
            "expert",
            "expert alone (ceiling)",
            metric,
            expert_scores,
            expert_scores,
            pretrained,
            merge_method=None,
        ),
    ]


def reference_scores(
    suite: Suite,
    folder: str,
    base_dir: str,
    base_record: dict[str, Any],
    experts: dict[str, Expert],
) -> tuple[dict[str, float], dict[str, float], float]:
    """The pretrained body's and each expert's scores, and the seconds the pretrained one
    took; kept in ``folder/reference_scores.json`` for the same models, settings and torch
    thread count (scoring is deterministic), so that runs adding rows in parallel score the
    references once (the LM suites' scoring takes minutes on a shared CPU)."""
    import torch

    key = recipe_hash(
        {
            "base": base_record["hash"],
            "experts": {t: e.record["hash"] for t, e in experts.items()},
            "settings": suite.settings_dict(),
            "threads": torch.get_num_threads(),
        }
    )
    path = os.path.join(folder, "reference_scores.json")
    os.makedirs(folder, exist_ok=True)

    def stored() -> Optional[tuple[dict[str, float], dict[str, float], float]]:
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as fp:
            record = json.load(fp)
        if record.get("key") != key:
            return None
        LOG.info("reference scores of %s: %s", path, record)
        return record["pretrained"], record["experts"], record["pretrained_seconds"]

    # one process scores them; another run started beside it waits for its file
    lock = path + ".lock"
    while (found := stored()) is None:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if _locked_by_a_live_process(lock):
                time.sleep(5)
            else:  # left by a process that died
                with contextlib.suppress(OSError):
                    os.remove(lock)
            continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        break
    if found is not None:
        return found
    try:
        return _score_references(suite, path, key, base_dir, experts)
    finally:
        os.remove(lock)


def _locked_by_a_live_process(lock: str) -> bool:
    try:
        with open(lock, encoding="utf-8") as fp:
            pid = int(fp.read().strip() or 0)
        os.kill(pid, 0)  # signal 0: only whether the process exists
    except (OSError, ValueError):
        return False
    return True


def _score_references(
    suite: Suite, path: str, key: str, base_dir: str, experts: dict[str, Expert]
) -> tuple[dict[str, float], dict[str, float], float]:
    t = time.perf_counter()
    pretrained = suite.evaluate_body(base_dir, experts)
    pre_eval = round(time.perf_counter() - t, 1)
    expert_scores = {
        task: suite.evaluate_body(expert.body, {task: expert})[task]
        for task, expert in experts.items()
    }
    record = {
        "key": key,
        "pretrained": pretrained,
        "experts": expert_scores,
        "pretrained_seconds": pre_eval,
    }
    with open(path + ".tmp", "w", encoding="utf-8") as fp:
        json.dump(record, fp, indent=2)
    os.replace(path + ".tmp", path)
    LOG.info("pretrained %s | experts %s", pretrained, expert_scores)
    return pretrained, expert_scores, pre_eval


def run_variant(
    suite: Suite,
    variant: str,
    rows: list[MethodRow],
    out: str,
    keep_merges: bool,
    *,
    result_id: Optional[str] = None,
    title_suffix: str = "",
    calibration_overrides: Optional[dict[str, Any]] = None,
    merge_timeout_s: float = 3600,
) -> dict[str, Any]:
    """Build or reuse the models, score the reference rows and every row in ``rows``, and
    write the table as ``out/<result_id>.{md,json,png}`` (default id: ``<suite>_<variant>``).

    ``calibration_overrides``: keys replaced in every task's calibration section (e.g.
    ``{"samples": 32}`` for a method whose cost grows with each sample)."""
    title = suite.title(variant) + title_suffix
    if suite.smoke:
        title += " [smoke]"
    t0 = time.perf_counter()
    base_dir, base_record = suite.base()
    experts = {task: suite.expert(variant, task) for task in suite.tasks}
    build_s = {
        "base": base_record["build_seconds"],
        **{t: e.record["build_seconds"] for t, e in experts.items()},
    }
    LOG.info(
        "%s: base and experts ready in %.1fs (built: %s)", title, time.perf_counter() - t0, build_s
    )

    metric = suite.metric
    run_root = os.path.join(suite.root, "runs", variant)
    # the references are scored in a thread while the first merge runs (its own process)
    pool = ThreadPoolExecutor(max_workers=1)
    refs = pool.submit(reference_scores, suite, run_root, base_dir, base_record, experts)
    pool.shutdown(wait=False)
    result_rows: list[dict[str, Any]] = []

    def with_references() -> list[dict[str, Any]]:
        return [*reference_rows(metric, *refs.result()), *result_rows]

    result = {
        "id": (result_id or f"{suite.name}_{variant}") + ("_smoke" if suite.smoke else ""),
        "title": title,
        "suite": suite.name,
        "variant": variant,
        "metric": metric,
        "smoke": suite.smoke,
        "tasks": list(suite.tasks),
        "settings": suite.settings_dict(),
        "build_seconds": build_s,
        "total_seconds": None,
        "rows": [],
        "versions": environment_versions(),
        "commands": [],
    }
    earlier, earlier_commands = _earlier_rows(
        os.path.join(out, result["id"] + ".json"), result, rows
    )
    command = _command_line()
    result["commands"] = [*earlier_commands, command]
    for row in rows:
        if refs.done():  # the tables so far: an interrupted run keeps its rows
            result["rows"] = _ordered(with_references(), earlier)
            write_reports(result, out)
        reason = availability(row)
        if reason is not None:
            LOG.info("%s: %s", row.key, reason)
            result_rows.append(
                _row(row.key, row.label, metric, None, None, None, status=reason, **row_recipe(row))
            )
            continue
        calibration = (
            {
                task: {**suite.calibration(task), **(calibration_overrides or {})}
                for task in suite.tasks
            }
            if needs_calibration(row.method)
            else None
        )
        if row.inputs == "adapter" and any(e.adapter is None for e in experts.values()):
            reason = "not available (this suite does not keep its experts' LoRA adapters)"
            LOG.info("%s: %s", row.key, reason)
            result_rows.append(
                _row(row.key, row.label, metric, None, None, None, status=reason, **row_recipe(row))
            )
            continue
        inputs = {t: merge_input(row, e) for t, e in experts.items()}
        config = build_config(row, base_dir, inputs, calibration, suite.merge_dtype)
        work = os.path.join(run_root, row.key)
        merged = os.path.join(work, "merged")
        run = run_merge_process(config, work, merged, merge_timeout_s)
        LOG.info(
            "%s: %s in %.1fs, peak RSS %.0f MB",
            row.key,
            run.status,
            run.wall_seconds,
            run.peak_rss_mb,
        )
        if not run.ok:
            result_rows.append(
                _row(
                    row.key,
                    row.label,
                    metric,
                    None,
                    None,
                    None,
                    status=run.status,
                    log=run.log_path,
                    **row_recipe(row),
                )
            )
            continue
        t = time.perf_counter()
        try:
            scores = evaluate_merge(suite, row, merged, experts)
            status = "ok"
        except Exception as e:  # a broken output is a result to report, not a crash
            LOG.exception("%s: scoring the merge failed", row.key)
            scores, status = None, f"error: scoring failed: {e}"[:300]
        pretrained, expert_scores, _ = refs.result()
        result_rows.append(
            _row(
                row.key,
                row.label,
                metric,
                scores,
                expert_scores,
                pretrained,
                status=status,
                wall_seconds=round(run.wall_seconds, 2),
                peak_rss_mb=round(run.peak_rss_mb, 1),
                eval_seconds=round(time.perf_counter() - t, 1),
                **row_recipe(row),
            )
        )
        LOG.info("%s: %s", row.key, scores)
        if not keep_merges:
            shutil.rmtree(merged, ignore_errors=True)

    result["rows"] = _ordered(with_references(), earlier)
    result["total_seconds"] = round(time.perf_counter() - t0, 1)
    paths = write_reports(result, out)
    LOG.info("wrote %s", ", ".join(paths.values()))
    return result


def configure_process(threads: Optional[int], verbose: bool = False) -> None:
    """Offline, torch threads (inherited by the merge processes), logging, quiet transformers."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # inherited by the merge processes
            os.environ[var] = str(threads)
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", default="all", choices=[*SUITES, "all"])
    parser.add_argument(
        "--methods",
        nargs="+",
        help="row keys or method names (a method name selects all its rows; row:KEY exactly "
        "one row); default: all rows",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny step counts and subsets, few rows"
    )
    parser.add_argument("--variants", nargs="+", help="expert variants to run (text: full lora)")
    parser.add_argument("--cache-dir", default=default_cache_dir())
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    parser.add_argument(
        "--keep-merges", action="store_true", help="keep merged models in the cache"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for training, scoring and the merge processes (default: torch's); "
        "1 is much faster on a CPU shared with other jobs",
    )
    parser.add_argument(
        "--tasks",
        nargs="+",
        help="tasks instead of the suite's default three (e.g. vision: mnist digits "
        "fashion_grouped fashion_mnist); write such a run to its own --out",
    )
    parser.add_argument(
        "--merge-timeout",
        type=float,
        default=3600,
        metavar="S",
        help="stop a row's merge after S seconds and record it as timed out (default 3600)",
    )
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)

    configure_process(args.threads, args.verbose)

    rows = select_rows(args.methods, args.smoke)
    suites = (SMOKE_ALL if args.smoke else SUITES) if args.suite == "all" else (args.suite,)
    start = time.perf_counter()
    for name in suites:
        suite = make_suite(name, args.cache_dir, args.smoke, args.tasks)
        variants = SMOKE_VARIANTS.get(name, suite.variants) if args.smoke else suite.variants
        if args.variants:
            variants = tuple(v for v in suite.variants if v in args.variants)
        for variant in variants:
            result = run_variant(
                suite,
                variant,
                rows,
                args.out,
                args.keep_merges,
                merge_timeout_s=args.merge_timeout,
            )
            print(f"\n{result['title']}: {result['total_seconds']}s")
    LOG.info("benchmark finished in %.1fs", time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
