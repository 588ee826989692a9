"""Add each row's recipe (:func:`benchmarks.suites.merging.row_recipe`: ``merge_method``, the YAML's
parameters and the method's defaults) to result tables written before rows recorded it.

The tables in ``benchmarks/results/`` were run with the row definitions of
``merging.ROWS`` as they are now (unchanged since those runs); a sweep row
``key[param=value]`` is that row with one parameter set, as ``sweep.sweep_rows`` builds it.
Rows that already carry ``merge_method`` are left as they are.

    python -m benchmarks.suites.backfill_recipes benchmarks/results/*.json
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import replace
from typing import Any, Optional

import yaml

from benchmarks.suites.merging import REFERENCE_ROWS, MethodRow, row_recipe, rows_for
from benchmarks.suites.sweep import sweep_settings

_SWEEP_KEY = re.compile(r"^(?P<key>[^\[]+)\[(?P<inner>.*)\]$")


_EXPONENT_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def method_row(key: str) -> Optional[MethodRow]:
    """The :class:`MethodRow` a result row key names (None for the reference rows)."""
    if key in REFERENCE_ROWS:
        return None
    match = _SWEEP_KEY.match(key)
    if match is None:
        return rows_for([key])[0]
    (base,) = rows_for([match["key"]])
    inner = match["inner"]
    if inner == "reference":  # a row run as it is, next to a sweep (sweep.py --references)
        return replace(base, key=key)
    # "p=v" (one parameter) or "p=v, q=w" (a settings sweep); "as is" = no change
    setting = {} if inner == "as is" else yaml.safe_load("{" + inner.replace("=", ": ") + "}")
    # Keys print floats as Python does (1e-06), which YAML 1.1 reads as a string
    setting = {
        k: float(v) if isinstance(v, str) and _EXPONENT_FLOAT.match(v) else v
        for k, v in setting.items()
    }
    (row,) = sweep_settings([base], [setting])
    if row.key != key:
        raise ValueError(f"sweep key {key!r} does not round-trip (got {row.key!r})")
    return row


def backfill(table: dict[str, Any]) -> int:
    """Add the recipe to every row of ``table`` lacking one; returns how many changed."""
    changed = 0
    for result_row in table["rows"]:
        if "merge_method" in result_row:
            continue
        row = method_row(result_row["key"])
        result_row.update(row_recipe(row) if row is not None else {"merge_method": None})
        changed += 1
    return changed


def main(paths: list[str]) -> int:
    for path in paths:
        with open(path, encoding="utf-8") as fp:
            table = json.load(fp)
        changed = backfill(table)
        if changed:
            with open(path, "w", encoding="utf-8") as fp:
                json.dump(table, fp, indent=2)
                fp.write("\n")
        print(f"{path}: {changed} row(s) given their recipe")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
