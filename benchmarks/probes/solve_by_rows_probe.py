"""The least-squares solve's row-based shortcuts against the forms they replace, side by
side in one process (issue #31).

- **span, regrouped**: two tasks, fewer tokens than inputs, more outputs than inputs; the
  correction ``(W_a − W_b)(S_b M_a − S_a M_b)`` (one ``out x in x in`` product) against
  ``V = [(W_k − W₀) X_kᵀ]_k`` and its expansion (two ``out x in x T`` ones);
- **dense, row terms**: α = 1, no ridge, every task's rows kept, fewer tokens than outputs;
  ``Σ_k ω_k (W_k X_kᵀ)(X_k A⁻¹) / N_k`` (``2·T·in²`` float64 for the solves) against the
  numerator's solve ``N A⁻¹`` (``2·out·in²``);
- **span at T ≥ in**: a ridge, every task's rows kept, as many tokens as inputs (2 x 2,048
  for 4,096: ``ridge: auto`` finds such a system ill-conditioned); the span solve after the
  dense system is factored, where ``solve.span_solve_pays``, against the dense numerator and
  its solve.

The "before" side is the same ``regmean_solve`` with the shortcut's test
(``solve._regroups`` / ``solve.takes_row_terms`` / ``solve.span_solve_pays``) answering
no. The groups have 8B
(Llama-3-8B) shapes, bfloat16-valued weights and rows (a bfloat16 pass on bfloat16
checkpoints), 2,000 or 2,048 tokens per task. Besides the times, each case prints both results'
distance to the float64 solution of the same system (relative Frobenius error) and the share
of entries whose bfloat16 rounding (the written checkpoint's) differs from the float64
solution's. Median of ``--repeat`` after a warm-up.

    python -m benchmarks.probes.solve_by_rows_probe --threads 2
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch

from benchmarks.probes.compute_dtype_probe import (
    median_seconds,
    print_table_head,
    side_by_side_arguments,
)
from mergekit_ext.methods.least_squares import solve

# (label, out, inputs, tasks, tokens per task, ridge)
CASES = [
    ("span, regrouped: gate_up, K = 2", 28672, 4096, 2, 2000, 0.01),
    ("span, regrouped: qkv, K = 2", 6144, 4096, 2, 2000, 0.01),
    ("dense, row terms: gate_up, K = 4", 28672, 4096, 4, 2000, 0.0),
    ("span at T = in: gate_up, K = 2", 28672, 4096, 2, 2048, 0.01),
    ("span at T = in: qkv, K = 2", 6144, 4096, 2, 2048, 0.01),
    ("span at T = in: o_proj, K = 2", 4096, 4096, 2, 2048, 0.01),
]


@contextlib.contextmanager
def _without_shortcuts() -> Iterator[None]:
    """``regmean_solve`` as it was: no regrouped span correction, no row terms, no span solve
    at T ≥ in."""
    saved = solve._regroups, solve.takes_row_terms, solve.span_solve_pays
    solve._regroups = lambda *args: False  # type: ignore[assignment]
    solve.takes_row_terms = lambda *args: False  # type: ignore[assignment]
    solve.span_solve_pays = lambda *args: False  # type: ignore[assignment]
    try:
        yield
    finally:
        solve._regroups, solve.takes_row_terms, solve.span_solve_pays = saved  # type: ignore[assignment]


def _case(label: str, out: int, width: int, tasks: int, tokens: int, ridge: float, repeat: int):
    g = torch.Generator().manual_seed(out + width + tasks)
    base = torch.randn(out, width, generator=g) * 0.02
    weights = [
        (base + torch.randn(out, width, generator=g) * 0.002).bfloat16().float()
        for _ in range(tasks)
    ]
    rows = [
        (torch.nn.functional.silu(torch.randn(tokens, width, generator=g)) * 2).bfloat16().float()
        for _ in range(tasks)
    ]
    # as the group driver passes them: every task's rows while each has fewer tokens than
    # inputs, the Grams formed from them unless the span solve applies before any solve
    span = tasks * tokens < width
    grams = [None if span else solve._gram_of(x) for x in rows]
    kept = rows if tokens < width else None

    def run() -> torch.Tensor:
        return solve.regmean_solve(
            weights,
            grams,
            1.0,
            ridge=ridge,
            rows=kept,
            gram_rows=None if span else rows,
            tokens=tasks * tokens,
            compute_dtype=torch.bfloat16,
        ).merged_weight

    with _without_shortcuts():
        before_s = median_seconds(run, repeat)
        before = run()
    now_s = median_seconds(run, repeat)
    now = run()
    reference = _float64_solution(weights, rows, ridge)
    errors = [float((m.double() - reference).norm() / reference.norm()) for m in (before, now)]
    flips = [float((m.bfloat16() != reference.bfloat16()).float().mean()) for m in (before, now)]
    line = (
        f"| {label} | {out} x {width} | {tasks * tokens} | {before_s:.2f} | {now_s:.2f} | "
        f"{now_s / before_s:.2f} | {errors[0]:.1e} / {errors[1]:.1e} | "
        f"{flips[0] * 100:.3f} / {flips[1] * 100:.3f} % |"
    )
    print(line, flush=True)
    return line


def _float64_solution(
    weights: list[torch.Tensor], rows: list[torch.Tensor], ridge: float
) -> torch.Tensor:
    """``(Σ W_k G_k + λ/K Σ W_k)(Σ G_k + λ I)⁻¹`` (α = 1, λ = ridge · mean diag), all in
    float64: the reference both sides are measured against."""
    grams = [solve._gram_of(x) for x in rows]
    system = sum(grams)
    strength = ridge * float(torch.diagonal(system).mean())
    torch.diagonal(system).add_(strength)
    numerator = sum(w.double() @ g for w, g in zip(weights, grams))
    if strength > 0.0:
        numerator += strength / len(weights) * sum(w.double() for w in weights)
    return torch.cholesky_solve(numerator.T, torch.linalg.cholesky(system)).T


def main(argv: list[str] | None = None) -> int:
    args = side_by_side_arguments(__doc__, argv)
    print_table_head(
        args.threads,
        [
            "case",
            "out x in",
            "tokens",
            "before s",
            "now s",
            "ratio",
            "error before / now",
            "bf16 flips before / now",
        ],
    )
    for case in CASES:
        _case(*case, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
