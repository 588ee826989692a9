"""The span solve's ``out x in x T`` products in float32 after a float32 pass, where the merged
weights are written as bfloat16 (issue #47, item 4): speed and what changes in the bytes.

Synthetic groups of the Llama-3-8B shapes (``benchmarks/probes/llm_width.py``'s ``GROUPS``),
K experts (bf16-valued base + task vectors), float32 input rows as a float32 pass gives them
(``silu(a) · b``), ``tokens`` per task, so T = K · tokens < in and ``ridge: auto`` takes the
span solve. Each group is solved by :func:`regmean_solve` with the float64 products (what a
float32 pass wrote before) and with float32 ones (``written_dtype=bfloat16``), interleaved,
``--repeats`` times, under the roofline meter (``benchmarks/roofline.py``: FLOPs per GEMM
class, GEMM rates measured right before each solve, time / floor). The relative output
error's float64 and float32 error products (``relative_output_error_rows``) are timed the
same way. Then the written bf16 weights of the two solves are compared entry by entry.

    python -m benchmarks.probes.span_precision --threads 1
    python -m benchmarks.probes.span_precision --threads 1 --groups o_proj --repeats 1  # quick
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

from benchmarks.probes.llm_width import GROUPS
from benchmarks.roofline import Roofline


def _group(label: str, experts: int, tokens: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    rows_out, width = GROUPS[label]
    g = torch.Generator().manual_seed(width + rows_out)
    base = torch.randn(rows_out, width, generator=g) * 0.02
    weights = [
        (base + torch.randn(rows_out, width, generator=g) * 0.002).bfloat16().float()
        for _ in range(experts)
    ]
    rows = [
        torch.nn.functional.silu(torch.randn(tokens, width, generator=g))
        * torch.randn(tokens, width, generator=g)
        for _ in range(experts)
    ]
    return weights, rows


def run(labels: list[str], experts: int, tokens: int, repeats: int) -> list[dict[str, Any]]:
    from mergekit_ext.methods.least_squares import regmean_solve
    from mergekit_ext.methods.least_squares.measures import relative_output_error_rows

    results = []
    for label in labels:
        weights, rows = _group(label, experts, tokens)
        meter = Roofline()
        merged: dict[str, torch.Tensor] = {}
        seconds: dict[str, list[float]] = {}
        with meter:
            for _ in range(repeats):
                for variant, written in (
                    ("float64 products", None),
                    ("float32 products", torch.bfloat16),
                ):
                    meter.measure_rates()
                    start = time.perf_counter()
                    with meter.phase(f"solve, {variant}"):
                        solution = regmean_solve(
                            weights,
                            [None] * experts,
                            1.0,
                            ridge="auto",
                            tokens=experts * tokens,
                            rows=rows,
                            compute_dtype=torch.float32,
                            written_dtype=written,
                        )
                    seconds.setdefault(f"solve, {variant}", []).append(time.perf_counter() - start)
                    merged[variant] = solution.merged_weight.bfloat16()
                    del solution
                written = merged["float32 products"].float()
                for variant, cast in (
                    ("output error, float64 products", torch.float64),
                    ("output error, float32 products", torch.float32),
                ):
                    meter.measure_rates()
                    start = time.perf_counter()
                    with meter.phase(variant):
                        relative_output_error_rows(
                            written.to(cast), weights[0].to(cast), rows[0].to(cast), 1.0
                        )
                    seconds.setdefault(variant, []).append(time.perf_counter() - start)
        a, b = merged["float64 products"], merged["float32 products"]
        differ = int((a != b).sum())
        record = meter.record()
        result = {
            "group": label,
            "shape": GROUPS[label],
            "tokens": experts * tokens,
            "differing_bf16_entries": differ,
            "entries": a.numel(),
            "fraction": differ / a.numel(),
            "max_abs_difference": float((a.float() - b.float()).abs().max()),
            "seconds": seconds,
            "roofline": record,
            "load": os.getloadavg()[0],
        }
        print(json.dumps({k: v for k, v in result.items() if k != "roofline"}), flush=True)
        results.append(result)
        del weights, rows, merged, a, b
    return results


def report(results: list[dict[str, Any]], repeats: int) -> str:
    lines = [
        "| group (out x in) | T | variant | s (each repeat) | GFLOP f64 | GFLOP f32 | floor s "
        "| time / floor | written bf16 entries differing |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        phases = r["roofline"]["phases"]
        for name, times in r["seconds"].items():
            p = phases[name]
            f = p["flops"]
            ratio = p["seconds"] / p["floor_s"] if p["floor_s"] else float("nan")
            differ = (
                f"{r['differing_bf16_entries']:,} of {r['entries']:,} ({100 * r['fraction']:.4f} %)"
                if name == "solve, float32 products"
                else ""
            )
            lines.append(
                f"| {r['group']} ({r['shape'][0]} x {r['shape'][1]}) | {r['tokens']} | {name} "
                f"| {', '.join(f'{t:.1f}' for t in times)} "
                f"| {f.get('float64', 0) / 1e9 / repeats:.0f} | {f.get('float32', 0) / 1e9 / repeats:.0f} "
                f"| {p['floor_s'] / repeats:.1f} | {ratio:.2f} | {differ} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", nargs="*", default=list(GROUPS))
    parser.add_argument("--experts", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2000, help="tokens per task")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = run(args.groups, args.experts, args.tokens, args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(report(results, args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
