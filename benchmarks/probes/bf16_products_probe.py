"""The solve's big products on the bfloat16 units at float32 accuracy, side by side (issue #31).

At Llama-3-8B widths, two threads, each product timed three ways on the same operands (median
of ``--repeat`` after a warm-up) and compared with the float64 product:

1. **float32**: one float32 GEMM (what the solve does when an operand is not bfloat16);
2. **three pieces**: the float32 operand split exactly into three bfloat16 ones
   (8 + 8 + 8 significant bits), each multiplied with the bfloat16 operand in oneDNN's bf16
   fpmath mode (float32 sums), the three results added (smallest first);
3. **stacked pieces**: the same as one GEMM over a three-times-longer inner dimension.

Shapes: the span solve's ``X_k (W_k − W₀)ᵀ`` for ``gate_up`` and ``down_proj`` (2048 rows),
its expansion ``(V H⁻¹) X`` for ``down_proj``, and the dense solve's ``W_k G_k`` for
``gate_up``. Then the dense solve's ``W_k G_k`` as ``solve.task_product`` forms it, from the
Gram (one float32 GEMM) and from 2,000 kept bfloat16 rows, for the three 4096-wide groups.

    python -m benchmarks.probes.bf16_products_probe --threads 2
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

import torch

from benchmarks.probes.compute_dtype_probe import median_seconds
from mergekit_ext.bf16_products import bfloat16_fpmath
from mergekit_ext.methods.least_squares.solve import task_product


def _pieces(x: torch.Tensor) -> list[torch.Tensor]:
    """``x`` (float32) as three float32 tensors holding bfloat16 values that sum to it."""
    high = x.bfloat16().float()
    rest = x - high
    middle = rest.bfloat16().float()
    return [high, middle, rest.sub_(middle)]


def _relative(a: torch.Tensor, reference: torch.Tensor) -> float:
    return float((a.double() - reference).norm() / reference.norm())


def _float32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, b, out=out)


def _three_pieces(a: torch.Tensor, b: torch.Tensor, which: str) -> torch.Tensor:
    parts = _pieces(b if which == "b" else a)
    total = None
    with bfloat16_fpmath():
        for part in reversed(parts):  # smallest first
            product = a @ part if which == "b" else part @ b
            total = product if total is None else total.add_(product)
    assert total is not None
    return total


def _stacked(a: torch.Tensor, b: torch.Tensor, which: str, out: torch.Tensor) -> torch.Tensor:
    if which == "b":
        left, right = torch.cat([a, a, a], 1), torch.cat(_pieces(b), 0)
    else:
        left, right = torch.cat(_pieces(a), 1), torch.cat([b, b, b], 0)
    with bfloat16_fpmath():
        return torch.mm(left, right, out=out)


def _split_case(name: str, a: torch.Tensor, b: torch.Tensor, which: str, repeat: int) -> str:
    out = torch.empty(a.shape[0], b.shape[1])
    reference = a.double() @ b.double()
    error32 = _relative(_float32(a, b, out), reference)
    error_pieces = _relative(_three_pieces(a, b, which), reference)
    t32 = median_seconds(functools.partial(_float32, a, b, out), repeat)
    tp = median_seconds(functools.partial(_three_pieces, a, b, which), repeat)
    ts = median_seconds(functools.partial(_stacked, a, b, which, out), repeat)
    return (
        f"| {name} ({a.shape[0]}x{a.shape[1]} by {b.shape[0]}x{b.shape[1]}) | {t32:.2f} "
        f"| {tp:.2f} | {ts:.2f} | {tp / t32:.2f} | {ts / t32:.2f} | {error32:.1e} "
        f"| {error_pieces:.1e} |"
    )


def _split_rows(repeat: int) -> list[str]:
    g = torch.Generator().manual_seed(0)

    def exact(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.02).bfloat16().float()

    def wide(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    rows = [
        "| product | float32 s | three pieces s | stacked s | pieces / float32 | stacked / float32 "
        "| rel. error float32 | rel. error pieces |",
        "|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(rows), flush=True)
    # (name, a, b, which operand is float32), made one at a time: a few GB each
    cases: list[tuple[str, Callable[[], torch.Tensor], Callable[[], torch.Tensor], str]] = [
        (
            "span X_k (W_k − W₀)ᵀ, gate_up",
            lambda: exact(2048, 4096),
            lambda: wide(4096, 28672),
            "b",
        ),
        (
            "span X_k (W_k − W₀)ᵀ, down_proj",
            lambda: exact(2048, 14336),
            lambda: wide(14336, 4096),
            "b",
        ),
        ("span (V H⁻¹) X, down_proj", lambda: wide(4096, 4096), lambda: exact(4096, 14336), "a"),
        ("dense W_k G_k, gate_up", lambda: exact(28672, 4096), lambda: wide(4096, 4096), "b"),
    ]
    for name, make_a, make_b, which in cases:
        rows.append(_split_case(name, make_a(), make_b(), which, repeat))
        print(rows[-1], flush=True)
    return rows


def _task_product_case(name: str, weight: torch.Tensor, x: torch.Tensor, repeat: int) -> str:
    gram = x.double().T @ x.double() / x.shape[0]
    reference = weight.double() @ gram
    buffer = torch.empty(weight.shape)
    errors = [_relative(task_product(weight, gram, r, out=buffer), reference) for r in (None, x)]
    t_gram = median_seconds(functools.partial(task_product, weight, gram, None, out=buffer), repeat)
    t_rows = median_seconds(functools.partial(task_product, weight, gram, x, out=buffer), repeat)
    return (
        f"| {name} ({weight.shape[0]}x{weight.shape[1]}) | {t_gram:.2f} | {t_rows:.2f} "
        f"| {t_rows / t_gram:.2f} | {errors[0]:.1e} | {errors[1]:.1e} |"
    )


def _task_product_rows(repeat: int, tokens: int) -> list[str]:
    g = torch.Generator().manual_seed(1)
    rows = [
        f"| group | W_k G_k from the Gram s | from {tokens} bfloat16 rows s | ratio "
        "| rel. error Gram | rel. error rows |",
        "|---|---|---|---|---|---|",
    ]
    print("\n".join(rows), flush=True)
    for name, out_features in (("gate_up", 28672), ("qkv", 6144), ("o_proj", 4096)):
        weight = (torch.randn(out_features, 4096, generator=g) * 0.02).bfloat16().float()
        x = torch.randn(tokens, 4096, generator=g) * torch.rand(4096, generator=g) * 3
        rows.append(_task_product_case(name, weight, x.bfloat16().float(), repeat))
        print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=2000, help="kept rows per task")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    print(
        f"torch {torch.__version__}, {args.threads} threads, AMX {amx}, "
        f"capability {torch.backends.cpu.get_cpu_capability()}"
    )
    _split_rows(args.repeat)
    print()
    _task_product_rows(args.repeat, args.tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
