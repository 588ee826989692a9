"""Add rows of a fresh run's table to the committed table of the same suite and settings.

    python -m benchmarks.suites.merge_rows benchmarks/results/vision_full.json /tmp/out/vision_full.json \\
        --rows symerge_com_body symerge_default

A fresh run (``python -m benchmarks.suites.run --methods ...``) scores the reference rows again; they
must equal the committed ones (same models, data and scoring), otherwise the rows are not
comparable and nothing is written. ``--tolerance R`` accepts reference scores within a
relative R instead: the same models scored with another torch thread count differ in the
last digits (float summation order); the tolerance is then recorded with the command. The named rows replace or join the committed ones, the
fresh run's command is appended to the table's commands, and the Markdown, JSON and chart
are written again.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from benchmarks.suites.merging import REFERENCE_ROWS
from benchmarks.suites.report import write_reports
from benchmarks.suites.run import _ordered


def _scores_match(old: dict | None, new: dict | None, tolerance: float) -> bool:
    if tolerance == 0.0 or not old or not new:
        return old == new
    return old.keys() == new.keys() and all(
        abs(old[t] - new[t]) <= tolerance * max(abs(old[t]), abs(new[t])) for t in old
    )


def merge_rows(
    committed: dict,
    fresh: dict,
    keys: list[str],
    command: str | None = None,
    tolerance: float = 0.0,
) -> dict:
    """``committed`` with the rows ``keys`` of ``fresh`` (checked comparable first: reference
    rows equal, or within the relative ``tolerance``)."""
    for field in ("suite", "variant", "metric", "settings", "tasks"):
        if committed.get(field) != fresh.get(field):
            raise SystemExit(f"the tables differ in {field!r}: not comparable")
    by_key = {r["key"]: r for r in fresh["rows"]}
    for ref in REFERENCE_ROWS:
        old = next((r for r in committed["rows"] if r["key"] == ref), None)
        if (
            old is not None
            and ref in by_key
            and not _scores_match(old.get("scores"), by_key[ref].get("scores"), tolerance)
        ):
            raise SystemExit(f"reference row {ref!r} scores differ: {old.get('scores')} vs "
                             f"{by_key[ref].get('scores')}")  # fmt: skip
    missing = [k for k in keys if k not in by_key]
    if missing:
        raise SystemExit(f"rows not in the fresh table: {', '.join(missing)}")
    kept = [r for r in committed["rows"] if r["key"] not in keys]
    out = dict(committed)
    out["rows"] = _ordered([by_key[k] for k in keys], kept)
    commands = list(committed.get("commands") or [])
    new = [command] if command else list(fresh.get("commands") or [])
    if tolerance:
        new = [
            f"{c} (rows {', '.join(keys)}; reference rows equal within a relative {tolerance:g})"
            for c in new
        ]
    commands += [c for c in new if c not in commands]
    out["commands"] = commands
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("committed")
    parser.add_argument("fresh")
    parser.add_argument("--rows", nargs="+", required=True)
    parser.add_argument("--command", help="the command to record (default: the fresh table's)")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.0,
        help="accept reference scores within this relative difference (default: exact)",
    )
    args = parser.parse_args(argv)
    with open(args.committed, encoding="utf-8") as fp:
        committed = json.load(fp)
    with open(args.fresh, encoding="utf-8") as fp:
        fresh = json.load(fp)
    merged = merge_rows(committed, fresh, args.rows, args.command, args.tolerance)
    print(write_reports(merged, os.path.dirname(os.path.abspath(args.committed))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
