"""A dense 8B ``gate_up`` group at K = 4 with and without rounded inputs, side by side (issue #31).

Four tasks of 16 x 125 seeded rows (a norm's float32 output stand-in, ``silu`` of Gaussian
values) at 4096 inputs, and 28672 x 4096 bfloat16-valued expert weights. Each repetition
runs, in alternation and in one process, the statistics as the executor keeps them
(``ActivationStatistics(keep_rows=True)``), the Grams from the kept rows and the dense solve
(``regmean_solve`` with ``gram_rows``, ``ridge: auto``, references kept, as Chain of Merges
calls it):

- **float32**: the rows as given (what the hooks recorded before for ``q/k/v`` and
  ``gate/up``, and still record for float32 checkpoints);
- **rounded**: the rows as a bfloat16 pass's linear multiplies them
  (``calibration.statistics.multiplied_input``; bfloat16 checkpoints), which take the
  bfloat16 units in the Grams and in ``W_k G_k`` (``solve.task_product``).

    python -m benchmarks.probes.rounded_inputs_probe --threads 2
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from benchmarks.probes.compute_dtype_probe import side_by_side_arguments
from mergekit_ext.calibration.statistics import ActivationStatistics, multiplied_input
from mergekit_ext.methods.least_squares.solve import regmean_solve

DIM, OUT, TASKS, BATCHES, ROWS = 4096, 28672, 4, 16, 125


def _statistics(batches, rounded: bool):
    linear = torch.nn.Linear(DIM, 1)  # only its type matters to multiplied_input
    out = []
    for task in batches:
        acc = ActivationStatistics(DIM, keep_rows=True)
        for x in task:
            if rounded:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    x = multiplied_input(linear, x)
            acc.update(x)
        out.append(acc.finalize())
    return out


def _solve(weights, stats) -> None:
    regmean_solve(
        weights,
        [s.gram_from_rows() for s in stats],
        1.0,
        ridge="auto",
        tokens=sum(s.count for s in stats),
        gram_rows=[s.rows for s in stats],
        keep_references=True,
        compute_dtype=torch.bfloat16,
    )


def main(argv: list[str] | None = None) -> int:
    args = side_by_side_arguments(__doc__, argv)
    g = torch.Generator().manual_seed(0)
    batches = [
        [torch.nn.functional.silu(torch.randn(ROWS, DIM, generator=g)) for _ in range(BATCHES)]
        for _ in range(TASKS)
    ]
    base = torch.randn(OUT, DIM, generator=g) * 0.02
    weights = [
        (base + 0.002 * torch.randn(OUT, DIM, generator=g)).bfloat16().float() for _ in range(TASKS)
    ]
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for rep in range(args.repeat):
        for rounded in (False, True):
            start = time.perf_counter()
            _solve(weights, _statistics(batches, rounded))
            seconds[rounded].append(time.perf_counter() - start)
            kind = "rounded" if rounded else "float32"
            print(f"repetition {rep}: {kind} {seconds[rounded][-1]:.2f} s", flush=True)
    plain, rounded = (statistics.median(seconds[r]) for r in (False, True))
    print(
        f"\ntorch {torch.__version__}, {args.threads} threads; statistics, Grams and dense solve "
        f"of one {OUT} x {DIM} group, K = {TASKS}, {BATCHES} x {ROWS} rows per task\n"
        f"median float32 rows {plain:.2f} s, rounded rows {rounded:.2f} s, "
        f"ratio {rounded / plain:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
