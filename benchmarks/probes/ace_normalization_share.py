"""How often each ACE heterogeneity rule normalizes: the share of linear weights, per suite.

    python -m benchmarks.probes.ace_normalization_share --suites text lm vision --threads 1 \\
        [--out benchmarks/results/ace_normalization_share.md]

Reads the per-tensor diagnostics (``sections.ace.tensors``: ``normalized``, ``gamma``,
``log_energy_spread``) of the ACE rows' merges that ``python -m benchmarks.suites.run --methods ace
--keep-merges`` left in the cache (``<cache>/full/<suite>/runs/<variant>/<row>/merged``) and
merges a row whose merge is not there (the same config and command as ``run.py``, not
scored). For each suite and ACE row it reports the share of the linear weights that merge
normalized, and the spread of both statistics, so a threshold can be read against them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
from typing import Any, Optional

from benchmarks.suites.cache import default_cache_dir
from benchmarks.suites.merging import ROWS, MethodRow, build_config, run_merge_process
from benchmarks.suites.report import environment_versions
from benchmarks.suites.run import SUITES, configure_process, make_suite

LOG = logging.getLogger("benchmarks.probes.ace_normalization_share")
DIAGNOSTICS = "mergekit_ext_diagnostics.json"


def ace_rows() -> list[MethodRow]:
    return [r for r in ROWS if r.method == "ace"]


def tensor_diagnostics(merged: str) -> dict[str, dict[str, Any]]:
    """``sections.ace.tensors`` of a finished ACE merge (one record per linear weight)."""
    with open(os.path.join(merged, DIAGNOSTICS), encoding="utf-8") as fp:
        data = json.load(fp)
    tensors = data.get("sections", {}).get("ace", {}).get("tensors", {})
    if not tensors:
        raise SystemExit(f"{merged}/{DIAGNOSTICS} has no ACE tensor records")
    return tensors


def kept_or_new_merge(suite: Any, variant: str, row: MethodRow) -> str:
    """The folder of ``row``'s merge on ``suite``/``variant``: the kept one, else a new one."""
    work = os.path.join(suite.root, "runs", variant, row.key)
    merged = os.path.join(work, "merged")
    if os.path.isfile(os.path.join(merged, DIAGNOSTICS)):
        return merged
    base_dir, _ = suite.base()
    inputs = {t: suite.expert(variant, t).body for t in suite.tasks}
    run = run_merge_process(build_config(row, base_dir, inputs, None), work, merged)
    if not run.ok:
        raise SystemExit(f"{suite.name}/{variant} {row.key}: {run.status} (log {run.log_path})")
    LOG.info("%s/%s %s merged in %.0fs", suite.name, variant, row.key, run.wall_seconds)
    return merged


def share_rows(table: str, rows: list[MethodRow], merges: dict[str, str]) -> list[str]:
    """One Markdown line per ACE row: normalized / linear weights."""
    lines = []
    for row in rows:
        tensors = tensor_diagnostics(merges[row.key])
        count = sum(bool(t["normalized"]) for t in tensors.values())
        rule = ", ".join(f"{k}: {v}" for k, v in row.parameters.items()) or "defaults"
        lines.append(
            f"| {table} | {row.label} | {rule} | {count} / {len(tensors)} | "
            f"{100 * count / len(tensors):.0f}% |"
        )
    return lines


def _quantiles(values: list[float]) -> str:
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else [ordered[0]] * 3
    return f"{ordered[0]:.3g} / {q[0]:.3g} / {q[1]:.3g} / {q[2]:.3g} / {ordered[-1]:.3g}"


def statistic_line(table: str, merged: str) -> str:
    """The per-weight statistics (the same in every ACE merge of a table: both are recorded)."""
    tensors = tensor_diagnostics(merged)
    gammas = [t["gamma"] for t in tensors.values()]
    spreads = [t["log_energy_spread"] for t in tensors.values()]
    return f"| {table} | {len(tensors)} | {_quantiles(gammas)} | {_quantiles(spreads)} |"


def report(lines: list[str], stats: list[str], command: str) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in environment_versions().items())
    return "\n".join(
        [
            "# ACE: share of linear weights each heterogeneity rule normalizes",
            "",
            f"Command: `{command}`",
            f"Versions: {versions}. Read from each merge's `{DIAGNOSTICS}` "
            "(`sections.ace.tensors[*].normalized`); the merges are the benchmark rows' "
            "(`benchmarks/suites/merging.py`), on the cached experts of each suite.",
            "",
            "| table | row | parameters | normalized / linear weights | share |",
            "|---|---|---|---|---|",
            *lines,
            "",
            "Per-weight statistics (min / 25% / median / 75% / max): the paper's "
            "`γ = Var(log τ) / Mean(log τ)²` (normalizes when > `gamma_threshold` 0.3) and the "
            "scale-invariant `Var(log τ)` (normalizes when > `spread_threshold`), "
            "`τ_k = ‖Δ_k‖²_F`.",
            "",
            "| table | linear weights | γ | Var(log τ) |",
            "|---|---|---|---|",
            *stats,
            "",
        ]
    )


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suites", nargs="+", default=list(SUITES), choices=SUITES)
    parser.add_argument("--cache-dir", default=default_cache_dir())
    parser.add_argument("--out", default=None, help="also write the Markdown report here")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (see run.py)")
    args = parser.parse_args(argv)
    configure_process(args.threads)
    rows = ace_rows()
    lines, stats = [], []
    for name in args.suites:
        suite = make_suite(name, args.cache_dir, smoke=False)
        for variant in suite.variants:
            table = f"{name}_{variant}"
            merges = {row.key: kept_or_new_merge(suite, variant, row) for row in rows}
            lines += share_rows(table, rows, merges)
            stats.append(statistic_line(table, merges[rows[0].key]))
    command = "python -m benchmarks.probes.ace_normalization_share " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    text = report(lines, stats, command)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fp:
            fp.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
