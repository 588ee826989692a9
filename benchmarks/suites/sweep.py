"""Sweep one parameter of some merge methods on a benchmark suite, in one run.

    python -m benchmarks.suites.sweep --suite text --variant full \\
        --methods regmean chain_of_merges --param reduce_non_diagonal \\
        --values 0.5 0.8 0.9 0.95 1.0 --threads 1

Every (method row, value) pair is one row of the table ``sweep_<suite>_<variant>_<param>``
(Markdown, JSON, PNG in ``--out``), next to the pretrained and expert references, with the
same cached models, data and scoring as ``run.py``. This is how the methods' defaults were
chosen; the committed tables are the evidence.

Without ``--param``, each value is a YAML mapping of several parameters set together (one
row per (row, mapping)), and ``--name`` names the table ``sweep_<suite>_<variant>_<name>``:

    python -m benchmarks.suites.sweep --suite vision --methods qp_diagonal --name qp \
        --values '{}' '{prior: 1, ridge: 1}' '{bounds: [0, 1]}' --threads 1
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import replace
from typing import Any, Optional

import yaml

from benchmarks.suites.cache import default_cache_dir
from benchmarks.suites.merging import MethodRow
from benchmarks.suites.run import SUITES, configure_process, make_suite, run_variant, select_rows

LOG = logging.getLogger("benchmarks.suites.sweep")


def sweep_rows(rows: list[MethodRow], param: str, values: list[Any]) -> list[MethodRow]:
    """One row per (row, value): the row's parameters with ``param`` set to ``value``."""
    return [
        replace(
            row,
            key=f"{row.key}[{param}={value}]",
            label=f"{row.label}, {param}={value}",
            parameters={**row.parameters, param: value},
        )
        for row in rows
        for value in values
    ]


def sweep_settings(rows: list[MethodRow], settings: list[dict[str, Any]]) -> list[MethodRow]:
    """One row per (row, mapping): the row's parameters updated with the mapping (``{}``: the
    row itself)."""
    out = []
    for row in rows:
        for setting in settings:
            if not isinstance(setting, dict):
                raise SystemExit(
                    f"without --param every value must be a YAML mapping; got {setting!r}"
                )
            text = ", ".join(f"{k}={v}" for k, v in setting.items()) or "as is"
            out.append(
                replace(
                    row,
                    key=f"{row.key}[{text}]",
                    label=f"{row.label}, {text}",
                    parameters={**row.parameters, **setting},
                )
            )
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", required=True, choices=SUITES)
    parser.add_argument("--variant", default=None, help="expert variant (default: the first)")
    parser.add_argument("--methods", nargs="+", required=True, help="row keys or method names")
    parser.add_argument("--param", default=None, help="the method parameter to sweep")
    parser.add_argument(
        "--name", default=None, help="table name without --param (values are YAML mappings)"
    )
    parser.add_argument(
        "--values", nargs="+", required=True, help="values (YAML scalars: 0.5, true, diagonal)"
    )
    parser.add_argument(
        "--references",
        nargs="*",
        default=[],
        help="rows run as they are, for comparison in the same table (e.g. ties)",
    )
    parser.add_argument(
        "--calibration",
        default=None,
        help="YAML mapping replacing keys of every task's calibration (e.g. '{samples: 32}')",
    )
    parser.add_argument("--smoke", action="store_true", help="small subsets (a code-path check)")
    parser.add_argument("--cache-dir", default=default_cache_dir())
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--threads", type=int, default=None, help="torch threads (see run.py)")
    args = parser.parse_args(argv)

    configure_process(args.threads)

    values = [yaml.safe_load(v) for v in args.values]
    if args.param is None and args.name is None:
        raise SystemExit("give --param NAME (one parameter) or --name NAME (YAML mappings)")
    base_rows = select_rows(args.methods, smoke=False)
    if args.param is not None:
        rows = sweep_rows(base_rows, args.param, values)
    else:
        rows = sweep_settings(base_rows, values)
    table = args.param or args.name
    # a distinct key: run folders are per key, another run may be using the plain one
    if args.references:
        references = select_rows(args.references, smoke=False)
        rows = [replace(r, key=f"{r.key}[reference]") for r in references] + rows
    suite = make_suite(args.suite, args.cache_dir, args.smoke)
    variant = args.variant or suite.variants[0]
    if variant not in suite.variants:
        raise SystemExit(
            f"unknown variant {variant!r} of {args.suite}: {', '.join(suite.variants)}"
        )
    start = time.perf_counter()
    result = run_variant(
        suite,
        variant,
        rows,
        args.out,
        keep_merges=False,
        result_id=f"sweep_{args.suite}_{variant}_{table}",
        title_suffix=f", sweep of {table}",
        calibration_overrides=yaml.safe_load(args.calibration) if args.calibration else None,
    )
    print(f"\n{result['title']}: {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
