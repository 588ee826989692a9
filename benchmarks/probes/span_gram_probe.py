"""The span solve's token Gram ``H = R E⁻¹ Rᵀ`` after a bfloat16 pass: float64 (what the solve
does) against float32 sums on the bfloat16 units (an alternative tried and not taken), side by
side (issue #31).

With α = 1, ``E = e₀ I`` and ``H = (R Rᵀ) / e₀``. Each case forms it for seeded rows that hold
bfloat16 values (what a bfloat16 pass's linear multiplies), two ways, both from the lower
block triangle:

- float64: the rows scaled by ``E^(-1/2)`` and multiplied in float64
  (``least_squares.solve._outer_gram``, as ``span_solve`` does);
- float32 sums: ``R Rᵀ`` of the unscaled rows on the bfloat16 units
  (``bf16_products.float32_product``), then widened and divided by ``e₀``.

Each is compared with the float64 product of the same rows. The float32 sums are 3-4x faster
but perturb ``H``, the matrix the solve inverts, by ~3e-7 relative, which moves the written
bf16 weights of ``tests/test_compute_dtype.py``'s span groups by one bf16 step in up to 1.9 %
of their entries (docs/methods.md, "Compute dtype"). The cases are the 8B probe's groups that
take the span solve: ``down_proj`` (14336 inputs) at K = 2 and K = 4 (2000 tokens per task)
and a 4096-wide group at 8000 tokens. Median of ``--repeat`` after a warm-up.

    python -m benchmarks.probes.span_gram_probe --threads 2
"""

from __future__ import annotations

import sys

import torch

from benchmarks.probes.compute_dtype_probe import (
    median_seconds,
    print_table_head,
    side_by_side_arguments,
)
from mergekit_ext.bf16_products import float32_product
from mergekit_ext.methods.least_squares.solve import _outer_gram

# (label, tokens T, inputs)
CASES = [
    ("down_proj, K = 2", 4000, 14336),
    ("down_proj, K = 4", 8000, 14336),
    ("4096 inputs, 8000 tokens", 8000, 4096),
]


def _float32_sums(rows: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """``rows @ rows.T`` from its lower block triangle with float32 sums (the alternative)."""
    t = int(rows.shape[0])
    out = torch.empty((t, t), dtype=torch.float32)
    for i in range(0, t, block):
        top = min(i + block, t)
        out[i:top, :top] = float32_product(rows[i:top], rows[:top].T)
        out[:i, i:top] = out[i:top, :i].T
    return out


def _case(label: str, tokens: int, width: int, repeat: int) -> str:
    g = torch.Generator().manual_seed(tokens + width)
    rows = torch.nn.functional.silu(torch.randn(tokens, width, generator=g)).bfloat16().float()
    e0 = 0.37  # any E = e₀ I
    wide = rows.double()
    reference = wide @ wide.T / e0

    def before() -> torch.Tensor:
        return _outer_gram(wide / e0**0.5)

    def now() -> torch.Tensor:
        return _float32_sums(rows).double().div_(e0)

    seconds = {name: median_seconds(fn, repeat) for name, fn in (("f64", before), ("f32", now))}
    errors = {
        name: float((fn() - reference).norm() / reference.norm())
        for name, fn in (("f64", before), ("f32", now))
    }
    line = (
        f"| {label} | {tokens} x {width} | {seconds['f64']:.2f} | {seconds['f32']:.2f} | "
        f"{seconds['f32'] / seconds['f64']:.2f} | {errors['f64']:.1e} | {errors['f32']:.1e} |"
    )
    print(line, flush=True)
    return line


def main(argv: list[str] | None = None) -> int:
    args = side_by_side_arguments(__doc__, argv)
    print_table_head(
        args.threads,
        [
            "group",
            "T x in",
            "float64 s",
            "float32 sums s",
            "ratio",
            "rel. error f64",
            "rel. error f32",
        ],
    )
    for label, tokens, width in CASES:
        _case(label, tokens, width, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
