"""One task's input Gram as a bfloat16 pass accumulates it, side by side (issue #31).

At Llama-3-8B widths, each case times :class:`ActivationStatistics` (``update`` per batch,
then ``finalize``) on the same seeded activations, four ways:

- the rows as float32 values (a norm's output as the hooks recorded it before they rounded
  it as the linear does) or as bfloat16 values (``calibration.statistics.multiplied_input``:
  what a bfloat16 pass's linear multiplies), which take the bfloat16 units
  (``bf16_products.float32_product``);
- one float64 addition of a ``dim x dim`` product per batch (as before) or per chunk of
  batches of at least ``gram_chunk_rows(width)`` rows (``calibration.statistics.gram_chunks``).

Each Gram is compared with the float64 Gram of the same rows. Median of ``--repeat`` after a
warm-up (one run for the 14336-wide case, whose float64 sum is 1.6 GB).

    python -m benchmarks.probes.gram_statistics_probe --threads 2
"""

from __future__ import annotations

import sys
from unittest import mock

import torch

from benchmarks.probes.compute_dtype_probe import median_seconds, side_by_side_arguments
from mergekit_ext.calibration import statistics

# (label, width, batches, rows per batch): the 8B probe's calibration (16 x 125 tokens per
# task) at the attention / gate_up width and at down_proj's, and larger batches
CASES = [
    ("4096 inputs, 16 x 125 rows", 4096, 16, 125),
    ("4096 inputs, 8 x 1024 rows", 4096, 8, 1024),
    ("14336 inputs, 16 x 125 rows", 14336, 16, 125),
]


def _batches(width: int, count: int, rows: int, bfloat16: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(width + count)
    out = []
    for _ in range(count):
        x = torch.nn.functional.silu(torch.randn(rows, width, generator=g))
        out.append(x.bfloat16() if bfloat16 else x)
    return out


def _gram(batches: list[torch.Tensor], chunked: bool) -> torch.Tensor:
    minimum = statistics.GRAM_CHUNK_MIN_ROWS if chunked else 1
    with mock.patch.object(statistics, "GRAM_CHUNK_MIN_ROWS", minimum):
        acc = statistics.ActivationStatistics(int(batches[0].shape[1]))
        for batch in batches:
            acc.update(batch)
        gram = acc.finalize().gram
    assert gram is not None
    return gram


def _case(label: str, width: int, count: int, rows: int, repeat: int) -> list[str]:
    lines = []
    for bfloat16 in (False, True):
        batches = _batches(width, count, rows, bfloat16)
        x = torch.cat(batches).double()
        reference = x.T @ x / x.shape[0]
        del x
        seconds, errors = {}, {}
        for chunked in (False, True):
            seconds[chunked] = median_seconds(lambda b=batches, c=chunked: _gram(b, c), repeat)
            gram = _gram(batches, chunked)
            errors[chunked] = float((gram - reference).norm() / reference.norm())
            del gram
        kind = "bfloat16 values" if bfloat16 else "float32 values"
        lines.append(
            f"| {label}, {kind} | {seconds[False]:.2f} | {seconds[True]:.2f} | "
            f"{seconds[True] / seconds[False]:.2f} | {errors[False]:.1e} | {errors[True]:.1e} |"
        )
        print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    args = side_by_side_arguments(__doc__, argv)
    print(
        f"torch {torch.__version__}, {args.threads} threads, capability "
        f"{torch.backends.cpu.get_cpu_capability()}; rows per chunk "
        f"{', '.join(str(statistics.gram_chunk_rows(w)) for _, w, _, _ in CASES)}\n"
    )
    print(
        "| rows | per batch s | in chunks s | chunks / batch | rel. error per batch | rel. error chunks |"
    )
    print("|---|---|---|---|---|---|")
    for label, width, count, rows in CASES:
        _case(label, width, count, rows, 1 if width > 8192 else args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
