"""Per-step probe of issue #31 at Llama-3-8B widths, side by side in one process.

Each step timed old vs new on the same inputs (median of ``--repeat``):

1. **passes**: one Llama-3-8B-shaped block (hidden 4096, intermediate 14336, 32 / 8 heads)
   on 8 x 125 tokens, float32 vs ``compute_dtype: bfloat16`` (the executor's own code:
   block tensors cast once, ``torch.autocast``, float32 residual);
2. **carried hidden states**: a narrower random bf16 Llama (``--carry-width``, 8 blocks)
   run three ways: float32 (the reference), bfloat16 passes with float32 carried between
   blocks (what the executor does), and pure bfloat16 (bf16 hidden states, as a bf16 model
   runs natively); the relative error of the last hidden states and of every block's
   ``down_proj`` input Gram against the float32 run;
3. **Grams**: ``xᵀx`` of 1000 bfloat16 rows (4096 and 14336 wide): the float32 GEMM of the
   widened rows (what the CPU path does) vs the bfloat16 GEMM (bfloat16 result), each
   against the float64 Gram of the same rows;
4. **solve**: the span solve's accumulation of ``W₀`` for an 8B ``gate_up`` (28672 x 4096,
   two tasks): mixed-dtype ``add_`` (before) vs widening into a buffer (after), and bitwise
   equality of the two;
5. **diagnostics**: one task's relative output error of a dense group (K = 4: 2,000 kept
   rows per task, 4096 inputs), Gram form ``out x in x in`` (before) vs rows form
   ``out x in x N`` with the solve's ``W_k G_k`` (after), ``--diag-out`` rows.

    python -m benchmarks.probes.compute_dtype_probe --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch


def side_by_side_arguments(doc: str, argv: list[str] | None) -> argparse.Namespace:
    """``--threads`` (default 2, applied to torch here) and ``--repeat`` (default 3): the
    options every side-by-side timing probe takes."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    return args


def print_table_head(threads: int, columns: list[str]) -> None:
    """The machine line (torch, threads, CPU capability) and a markdown table's head."""
    print(
        f"torch {torch.__version__}, {threads} threads, capability "
        f"{torch.backends.cpu.get_cpu_capability()}\n"
    )
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))


def median_seconds(fn: Callable[[], Any], repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _llama_block(hidden: int, intermediate: int, heads: int, kv: int, layers: int = 1):
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_hidden_layers=layers,
        vocab_size=256,
        max_position_embeddings=512,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaModel(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())  # values a bf16 checkpoint holds
    return model


def _block_inputs(model, tokens: torch.Tensor):
    """The first block's input and call arguments, as the executor records them."""
    from mergekit_ext.executor.blocks import BlockCallRecorder, CallSink, StopForward

    sink = CallSink(last=len(model.layers) - 1)
    real = list(model.layers)
    for i in range(len(real)):
        model.layers[i] = BlockCallRecorder(i, sink)
    try:
        model(input_ids=tokens, use_cache=False)
    except StopForward:
        pass
    for i, block in enumerate(real):
        model.layers[i] = block
    return sink.hidden.float(), sink.calls


def passes(threads: int, repeat: int) -> list[str]:
    from mergekit_ext.executor.compute import LowPrecisionParams, carried, compute_in

    model = _llama_block(4096, 14336, 32, 8)
    tokens = torch.randint(5, 256, (8, 125), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden, calls = _block_inputs(model, tokens)
        block = model.layers[0]
        params = dict(block.named_parameters())
        args, kwargs = calls[0]
        low = LowPrecisionParams(torch.bfloat16)

        def run(dtype: torch.dtype) -> torch.Tensor:
            p = low(params) if dtype != torch.float32 else params
            with compute_in(dtype, torch.device("cpu")):
                out = torch.func.functional_call(block, p, (hidden, *args), kwargs)
            return carried(out[0] if isinstance(out, tuple) else out)

        f32 = median_seconds(lambda: run(torch.float32), repeat)
        bf16 = median_seconds(lambda: run(torch.bfloat16), repeat)
        cast_start = time.perf_counter()
        low.clear()
        low(params)
        cast = time.perf_counter() - cast_start
        a, b = run(torch.float32), run(torch.bfloat16)
        rel = float((a - b).norm() / a.norm())
    return [
        f"passes (one 8B block, 8 x 125 tokens, {threads} threads): float32 {f32:.2f} s, "
        f"bfloat16 {bf16:.2f} s ({f32 / bf16:.2f}x); casting the block's tensors once "
        f"{cast:.2f} s; block output relative difference {rel:.2e}"
    ]


def carry(width: int) -> list[str]:
    from mergekit_ext.calibration.statistics import ActivationStatistics
    from mergekit_ext.executor.compute import LowPrecisionParams, compute_in

    heads = max(width // 128, 1)
    model = _llama_block(width, int(width * 3.5), heads, max(heads // 4, 1), layers=8)
    tokens = torch.randint(5, 256, (8, 125), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hidden0, calls = _block_inputs(model, tokens)
        low = LowPrecisionParams(torch.bfloat16)

        def run(mode: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
            hidden = hidden0.bfloat16() if mode == "bf16" else hidden0
            grams = []
            for i, block in enumerate(model.layers):
                acc = ActivationStatistics(int(width * 3.5))
                handle = block.mlp.down_proj.register_forward_pre_hook(
                    lambda m, a, acc=acc: acc.update(a[0].reshape(-1, a[0].shape[-1]))
                )
                params = dict(block.named_parameters())
                args, kwargs = calls[i]
                if mode == "float32":
                    out = torch.func.functional_call(block, params, (hidden, *args), kwargs)
                elif mode == "carry32":
                    with compute_in(torch.bfloat16, torch.device("cpu")):
                        out = torch.func.functional_call(
                            block, low(params), (hidden, *args), kwargs
                        )
                else:  # pure bf16: bf16 tensors and hidden states, no autocast
                    kw = {
                        k: tuple(t.bfloat16() for t in v) if k == "position_embeddings" else v
                        for k, v in kwargs.items()
                    }
                    out = torch.func.functional_call(block, low(params), (hidden, *args), kw)
                handle.remove()
                hidden = out[0] if isinstance(out, tuple) else out
                if mode == "carry32":
                    hidden = hidden.float()
                grams.append(acc.finalize().gram)
            return hidden.float(), grams

        ref, ref_grams = run("float32")
        lines = []
        for mode, label in (
            ("carry32", "bfloat16 passes, float32 carried (the executor)"),
            ("bf16", "pure bfloat16 (bf16 carried)"),
        ):
            out, grams = run(mode)
            rel = float((out - ref).norm() / ref.norm())
            gram_rel = max(float((g - r).norm() / r.norm()) for g, r in zip(grams, ref_grams))
            lines.append(
                f"carry (random bf16 Llama, hidden {width}, 8 blocks): {label}: last hidden "
                f"states {rel:.2e} relative to float32, worst down_proj Gram {gram_rel:.2e}"
            )
    return lines


def grams(repeat: int) -> list[str]:
    from mergekit_ext.calibration.statistics import gram_product

    lines = []
    for width in (4096, 14336):
        g = torch.Generator().manual_seed(width)
        x = torch.nn.functional.silu(torch.randn(1000, width, generator=g)).bfloat16()
        reference = x.double().T @ x.double()
        f32 = median_seconds(lambda x=x: gram_product(x), repeat)
        b16 = median_seconds(lambda x=x: x.T @ x, repeat)
        err32 = float((gram_product(x).double() - reference).norm() / reference.norm())
        err16 = float(((x.T @ x).double() - reference).norm() / reference.norm())
        lines.append(
            f"Gram of 1000 bf16 rows x {width}: float32 GEMM of the widened rows {f32:.2f} s "
            f"(relative error {err32:.1e} vs float64), bfloat16 GEMM {b16:.2f} s "
            f"(bf16 result: {err16:.1e}, rejected)"
        )
    return lines


def solve(repeat: int) -> list[str]:
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(28672, 4096, generator=g) for _ in range(2)]
    alpha = 0.123456789

    def before() -> torch.Tensor:
        w0 = torch.zeros(28672, 4096, dtype=torch.float64)
        for w in ws:
            w0.add_(w, alpha=alpha)
        return w0

    def after() -> torch.Tensor:
        w0 = torch.zeros(28672, 4096, dtype=torch.float64)
        buffer = torch.empty_like(w0)
        for w in ws:
            w0.add_(buffer.copy_(w), alpha=alpha)
        return w0

    t0 = median_seconds(before, repeat)
    t1 = median_seconds(after, repeat)
    same = torch.equal(before(), after())
    return [
        f"span solve, W0 of an 8B gate_up (2 tasks): mixed-dtype add_ {t0:.2f} s, widened "
        f"into a buffer {t1:.2f} s ({t0 / t1:.1f}x), bitwise equal: {same}"
    ]


def diagnostics(out: int, repeat: int) -> list[str]:
    from mergekit_ext.methods.least_squares.measures import (
        relative_output_error,
        relative_output_error_rows,
    )

    g = torch.Generator().manual_seed(2)
    n, tokens = 4096, 2000
    w = torch.randn(out, n, generator=g) * 0.02
    merged = w + torch.randn(out, n, generator=g) * 0.002
    x = torch.nn.functional.silu(torch.randn(tokens, n, generator=g))
    gram = (x.double().T @ x.double()) / tokens
    product = w @ gram.float()
    gram_form = median_seconds(lambda: relative_output_error(merged, w, gram, product), repeat)
    rows_form = median_seconds(lambda: relative_output_error_rows(merged, w, x, product), repeat)
    a = relative_output_error(merged, w, gram, product)
    b = relative_output_error_rows(merged, w, x, product)
    return [
        f"dense-group output error of one task ({out} x {n}, {tokens} kept rows): Gram form "
        f"{gram_form:.2f} s, rows form with the solve's W_k G_k {rows_form:.2f} s "
        f"({gram_form / rows_form:.2f}x); values {a:.12f} / {b:.12f}"
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--carry-width", type=int, default=1024)
    parser.add_argument("--diag-out", type=int, default=6144, help="rows of the dense group")
    parser.add_argument(
        "--steps", nargs="*", default=["passes", "carry", "grams", "solve", "diagnostics"]
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    steps = {
        "passes": lambda: passes(args.threads, args.repeat),
        "carry": lambda: carry(args.carry_width),
        "grams": lambda: grams(args.repeat),
        "solve": lambda: solve(args.repeat),
        "diagnostics": lambda: diagnostics(args.diag_out, args.repeat),
    }
    for name in args.steps:
        for line in steps[name]():
            print(line, flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
