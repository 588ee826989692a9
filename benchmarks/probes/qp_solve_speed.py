"""Speed of the batched QP / output-space projection solve for one layer.

Times :mod:`mergekit_ext.methods.qp_projection` on one ``out x in`` linear weight with K
experts and K task Grams (random weights, random low-rank-plus-diagonal Grams), in both bases:

- ``basis``: the residual energy matrix S and its eigendecomposition (``residual_eigen`` only)
- ``build``: the per-direction K×K normal equations (2K products ``(out x in)(in x in)``)
- ``solve``: the batched ``(N_r + μI) d_r = h_r`` solve over all directions
- ``box``: the batched projected-Newton box QP (``--bounds``, default [0.1, 0.15], active)
- ``update``: the merged update ``δ(d*)``

and compares with a naive Python loop over output rows (per row: its K×K normal equations
from matrix-vector products with every Gram, then ``torch.linalg.solve``), timed on a subset of
rows and extrapolated to all rows. Usage::

    python -m benchmarks.probes.qp_solve_speed                      # out=in=4096, K=8, CPU
    python -m benchmarks.probes.qp_solve_speed --out 1024 --in 1024 --naive-rows 16
    python -m benchmarks.probes.qp_solve_speed --device cuda
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import torch

from mergekit_ext.methods import qp_projection as qp


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - start


def random_layer(
    out_dim: int, in_dim: int, k: int, rank: int, seed: int, device: torch.device
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """K float32 task vectors and K float64 Grams ``(1/r) AᵀA + diag(s)`` (PSD, full rank)."""
    g = torch.Generator().manual_seed(seed)
    task_vectors = [0.01 * torch.randn(out_dim, in_dim, generator=g) for _ in range(k)]
    grams = []
    for _ in range(k):
        factor = torch.randn(rank, in_dim, generator=g, dtype=torch.float64)
        diagonal = torch.rand(in_dim, generator=g, dtype=torch.float64) * 0.1 + 0.01
        grams.append(factor.T @ factor / rank + torch.diag(diagonal))
    return [t.to(device) for t in task_vectors], [gm.to(device) for gm in grams]


def naive_rows(
    task_vectors: list[torch.Tensor],
    grams: list[torch.Tensor],
    basis: torch.Tensor | None,
    rows: int,
    mu: float,
) -> torch.Tensor:
    """The same equations, one output direction at a time (the loop the batched code avoids)."""
    gram_total = torch.stack(grams).sum(0)
    k = len(task_vectors)
    solutions = []
    for r in range(rows):
        if basis is None:
            a = torch.stack([tv[r].double() for tv in task_vectors])  # K x in: u_rᵀ Δ_k
        else:
            a = torch.stack([basis[:, r] @ tv.double() for tv in task_vectors])
        normal = a @ gram_total @ a.T
        rhs = torch.stack([a @ (grams[t] @ a[t]) for t in range(k)]).sum(0)  # −Σ_t u Δ_k G_t R_tᵀ u
        eye = torch.eye(k, dtype=normal.dtype, device=normal.device)
        solutions.append(torch.linalg.solve(normal + mu * eye, rhs))
    return torch.stack(solutions)


def bench_basis(
    kind: str,
    task_vectors: list[torch.Tensor],
    grams: list[torch.Tensor],
    args: argparse.Namespace,
    device: torch.device,
) -> dict[str, Any]:
    timings: dict[str, float] = {}
    basis, timings["basis"] = _timed(lambda: qp.output_basis(kind, task_vectors, grams), device)
    equations, timings["build"] = _timed(
        lambda: qp.qp_normal_equations(task_vectors, grams, basis=basis, basis_kind=kind), device
    )
    solution, timings["solve"] = _timed(lambda: qp.solve_qp(equations, ridge=1e-6), device)
    boxed, timings["box"] = _timed(
        lambda: qp.solve_qp(equations, ridge=1e-6, bounds=args.bounds), device
    )
    _, timings["update"] = _timed(lambda: qp.merged_update(task_vectors, solution.d, basis), device)
    timings["total"] = sum(timings.values())

    # the per-row K×K solve alone, looped over all rows: what batching the solve saves
    regularised = equations.normal + solution.mu * torch.eye(
        args.k, dtype=equations.normal.dtype, device=device
    )
    rows = range(regularised.shape[0])
    looped, loop_solve_s = _timed(
        lambda: torch.stack([torch.linalg.solve(regularised[r], equations.rhs[r]) for r in rows]),
        device,
    )
    # the whole per-row computation (equations + solve) on a subset of rows, extrapolated
    subset = min(args.naive_rows, equations.num_directions)
    naive, naive_s = _timed(
        lambda: naive_rows(task_vectors, grams, basis, subset, solution.mu), device
    )
    naive_total = naive_s * equations.num_directions / subset
    batched_s = timings["build"] + timings["solve"]
    result = {
        "seconds": timings,
        "looped_solve_all_rows_s": loop_solve_s,
        "solve_speedup_vs_loop": loop_solve_s / max(timings["solve"], 1e-12),
        "naive_rows_timed": subset,
        "naive_row_loop_extrapolated_s": naive_total,
        "speedup_vs_naive_row_loop": naive_total / max(batched_s, 1e-12),
        "max_abs_diff_naive_vs_batched": max(
            float((naive - solution.d[:subset]).abs().max()),
            float((looped - solution.d).abs().max()),
        ),
        "box_iterations": boxed.box.iterations if boxed.box else None,
        "box_unconverged": boxed.box.unconverged if boxed.box else None,
        "box_active_share": float(
            ((boxed.d <= args.bounds[0]) | (boxed.d >= args.bounds[1])).double().mean()
        ),
        "captured_energy": qp.captured_energy_fraction(
            qp.qp_objective(equations, solution.d), qp.base_energy(equations)
        ),
    }
    print(
        f"[{kind}] basis {timings['basis']:.2f}s  build {timings['build']:.2f}s  "
        f"solve {timings['solve']:.3f}s  box {timings['box']:.3f}s  update {timings['update']:.2f}s  "
        f"total {timings['total']:.2f}s | looped solve {loop_solve_s:.2f}s "
        f"(x{result['solve_speedup_vs_loop']:.0f}) | naive row loop ~{naive_total:.0f}s "
        f"extrapolated from {subset} rows (x{result['speedup_vs_naive_row_loop']:.1f} vs build+solve)",
        flush=True,
    )
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    task_vectors, grams = random_layer(
        args.out, args.in_, args.k, args.gram_rank, args.seed, device
    )
    report: dict[str, Any] = {
        "out": args.out,
        "in": args.in_,
        "K": args.k,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "bases": {},
    }
    for kind in qp.BASES:
        report["bases"][kind] = bench_basis(kind, task_vectors, grams, args, device)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=int, default=4096)
    parser.add_argument("--in", dest="in_", type=int, default=4096)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--gram-rank", type=int, default=256, help="rank of the random Gram factor")
    parser.add_argument("--naive-rows", type=int, default=8, help="rows timed in the naive loop")
    parser.add_argument(
        "--bounds",
        type=float,
        nargs=2,
        default=[0.1, 0.15],
        metavar=("LO", "HI"),
        help="box for the box-QP timing (the random problem's d* lie around 1/K)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the report to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run(args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fp:
            json.dump(report, fp, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
