"""One table across suites: each method's average normalized score per results table.

    python -m benchmarks.suites.summary [--results benchmarks/results] [--out benchmarks/results/summary.md]

Reads the ``<suite>_<variant>.json`` tables written by ``run.py`` (sweeps are left out) and
prints a Markdown table: one row per method row, one column per table, the average
normalized score (accuracy: merged / expert %; LM: share of the expert's loss gain kept %).
A method missing from a table shows "–"; one that failed shows its status.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional

from benchmarks.suites.merging import REFERENCE_ROWS, ROW_KEYS

TABLE_ORDER = ("text_full", "text_lora", "lm_lora", "lm_full", "vision_full", "vision_full_issue51")


def load_tables(results_dir: str) -> list[dict[str, Any]]:
    tables = []
    for name in sorted(os.listdir(results_dir)):
        stem, ext = os.path.splitext(name)
        if ext != ".json" or stem.startswith("sweep_") or stem.endswith("_smoke"):
            continue
        with open(os.path.join(results_dir, name), encoding="utf-8") as fp:
            data = json.load(fp)
        # run.py names each table after its id; a copy kept under another name (an earlier
        # run of the same suite, e.g. lm_lora_ridge_auto_condition.json) is not a column
        if isinstance(data, dict) and "rows" in data and "tasks" in data and data["id"] == stem:
            tables.append(data)
    order = {k: i for i, k in enumerate(TABLE_ORDER)}
    return sorted(tables, key=lambda t: order.get(t["id"], len(order)))


def summary_table(tables: list[dict[str, Any]]) -> str:
    labels: dict[str, str] = {}
    cells: dict[str, dict[str, str]] = {}
    for table in tables:
        for row in table["rows"]:
            labels.setdefault(row["key"], row["label"])
            value: Optional[float] = row.get("avg_normalized")
            text = f"{100 * value:.1f}" if value is not None else row.get("status", "–")[:40]
            cells.setdefault(row["key"], {})[table["id"]] = text
    order = {k: i for i, k in enumerate((*REFERENCE_ROWS, *ROW_KEYS))}
    keys = sorted(cells, key=lambda k: order.get(k, len(order)))
    heads = [t["id"] for t in tables]
    lines = [
        "| method | " + " | ".join(heads) + " |",
        "|---" * (len(heads) + 1) + "|",
    ]
    for key in keys:
        lines.append(
            f"| {labels[key]} | " + " | ".join(cells[key].get(h, "–") for h in heads) + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--out", default=None, help="also write the table here")
    args = parser.parse_args(argv)
    text = summary_table(load_tables(args.results))
    print(text, end="")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fp:
            fp.write(
                "Average normalized score (%) per method and results table "
                "(`python -m benchmarks.suites.summary`).\n\n" + text
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
