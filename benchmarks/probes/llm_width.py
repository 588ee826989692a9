"""Chain of Merges and RegMean at LLM widths: per-block time, solve time, peak RSS, dry-run estimate.

A synthetic Llama-3-8B-shaped model (hidden 4096, intermediate 14336, 32 heads / 8 KV heads)
with TWO blocks and a small vocabulary (1024 instead of 128256, to save disk and time: the
embeddings and the head are merged by the fallback and are no part of the per-block cost),
bfloat16 checkpoints: a base and K experts (base + seeded random task vectors, as
``benchmarks/executor_memory.py`` builds them), 16 calibration sequences of 125 random tokens
per task (2,000 tokens each). So with K = 2 every group has fewer tokens (4,000) than inputs
(4,096 or 14,336), and with K = 4 (8,000 tokens) only ``mlp.down_proj`` does.

Each merge runs in a fresh subprocess (peak RSS = its ``ru_maxrss``; also polled with psutil)
with 1 or 2 torch threads and the method's defaults; the child first builds the plan
(``--dry-run``'s estimate and warnings), then merges, timing each block
(``SequentialExecutor._merge_block``), each ``merge_linear_group`` (solve + diagnostics) and
each ``regmean_solve`` (the solve alone).

    python -m benchmarks.probes.llm_width                       # K=2 and K=4, CoM and RegMean, 1 and 2 threads
    python -m benchmarks.probes.llm_width --experts 2 --threads 2
    python -m benchmarks.probes.llm_width --cleanup             # delete the checkpoints under --models-dir
    python -m benchmarks.probes.llm_width --experts 2 --threads 1 --methods chain_of_merges \
        --compute-dtype auto --roofline --setting native avx512-no-amx avx2   # issue #47's roofline

``--roofline`` counts the FLOPs of each phase (the block passes, the statistics' Gram sums,
each group's solve, the rest of ``merge_linear_group``) by GEMM class, measures this process's
GEMM rate per class before every block and group, and prints time / floor per phase
(``benchmarks/roofline.py``). ``--setting`` runs each merge under the variables of
``benchmarks/cpu_kernels.py`` (on an AMX machine: ``avx512-no-amx`` is AMX off, ``avx2`` the
AVX2-only kernels; a setting can only take away what this CPU has).

The checkpoints (about 0.9 GB each) go to ``--models-dir`` (default /tmp/llm_width_models).
Before each merge the script waits (up to ``--wait-memory-s``) until ``--min-available-gb``
(default 14) of memory is available and skips the run otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZE: dict[str, int] = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=2,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=1024,
    sequences=16,
    seq_len=125,
)
DEFAULT_MODELS_DIR = "/tmp/llm_width_models"
# ``--small``: the same probe on a tiny Llama (a check of the probe itself, in seconds)
SMALL: dict[str, int] = dict(
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    sequences=16,
    seq_len=125,
)


# ------------------------------------------------------------------------------------------
# Models (bf16) and calibration data, built once per expert count


def _build(folder: str, experts: int, small: bool = False) -> None:
    import torch
    from accelerate import init_empty_weights
    from huggingface_hub import save_torch_state_dict
    from transformers import LlamaForCausalLM

    from benchmarks.probes.executor_memory import _llama_config, _tensor, write_calibration

    size = SMALL if small else SIZE
    config = _llama_config(size)
    config.dtype = "bfloat16"
    with init_empty_weights():
        skeleton = LlamaForCausalLM(config)
    shapes = {name: tuple(p.shape) for name, p in skeleton.state_dict().items()}
    os.makedirs(folder, exist_ok=True)
    for index, label in enumerate(["base", *[f"expert{k}" for k in range(experts)]]):
        out = os.path.join(folder, label)
        if os.path.isfile(os.path.join(out, "config.json")):
            continue
        tmp = out + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        state = {
            name: _tensor(name, shape, index - 1).to(torch.bfloat16)
            for name, shape in shapes.items()
        }
        save_torch_state_dict(state, tmp, max_shard_size="2GB")
        config.save_pretrained(tmp)
        del state
        os.rename(tmp, out)
    write_calibration(folder, experts, size)


def _yaml(
    method: str,
    folder: str,
    experts: int,
    compute: str = "auto",
    parameters: dict[str, Any] | None = None,
) -> str:
    """The merge's YAML; ``parameters``: the method's own, beside ``compute_dtype``."""
    import yaml

    models = []
    for k in range(experts):
        models.append(
            {
                "model": os.path.join(folder, f"expert{k}"),
                "name": f"task{k}",
                "calibration": {
                    "path": os.path.join(folder, f"calibration{k}.safetensors"),
                    "samples": SIZE["sequences"],
                    "max_length": SIZE["seq_len"],
                    "batch_size": 8,
                },
            }
        )
    config = {
        "merge_method": method,
        "base_model": os.path.join(folder, "base"),
        "models": models,
        "dtype": "bfloat16",
        "parameters": {"compute_dtype": compute, **(parameters or {})},
    }
    return yaml.safe_dump(config)


# ------------------------------------------------------------------------------------------
# One merge (child process)


def _child(
    method: str,
    folder: str,
    experts: int,
    out: str,
    threads: int,
    compute: str = "auto",
    device_name: str = "cpu",
    roofline: bool = False,
    parameters: dict[str, Any] | None = None,
) -> None:
    import logging

    import psutil
    import torch

    torch.set_num_threads(threads)
    device = torch.device(device_name)

    def synchronize() -> None:  # the GPU's queued work belongs to the timed step
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    from mergekit.options import MergeOptions

    import mergekit_ext  # noqa: F401  (registers the methods)
    from mergekit_ext.config import parse_config
    from mergekit_ext.executor import plan_layerwise_merge
    from mergekit_ext.executor import sequential as seq
    from mergekit_ext.methods import least_squares
    from mergekit_ext.methods.registry import ext_method_info

    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger("mergekit_ext").addHandler(Collect())
    cfg = parse_config(_yaml(method, folder, experts, compute, parameters))
    options = MergeOptions(quiet=True, write_model_card=False, copy_tokenizer=False)
    info = ext_method_info(method)
    assert info is not None
    baseline = psutil.Process().memory_info().rss

    timings: dict[str, Any] = {"block_s": [], "block_cpu_s": [], "group_s": {}, "solve_s": {}}
    solve = least_squares.regmean_solve

    def timed_solve(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            if meter is None:
                return solve(*args, **kwargs)
            label = str(kwargs.get("name", "?")).rsplit(".", 1)[-1]
            with meter.phase(f"solve {label}"):
                return solve(*args, **kwargs)
        finally:
            synchronize()
            name = str(kwargs.get("name", "?")).removeprefix("linear group ")
            timings["solve_s"][name] = time.perf_counter() - start

    least_squares.group.regmean_solve = timed_solve  # where the group driver looks it up
    merge_block = seq.SequentialExecutor._merge_block
    meter = _instrument(seq, least_squares) if roofline else None

    def timed_block(self: Any, block: Any, progress: Any = None) -> None:
        if meter is not None:
            meter.measure_rates()  # the floor of this block's passes, from the machine now
        start, cpu = time.perf_counter(), time.process_time()
        rate_s = meter.rate_s if meter is not None else 0.0
        merge_block(self, block, progress)
        synchronize()
        rate_s = (meter.rate_s if meter is not None else 0.0) - rate_s
        timings["block_s"].append(time.perf_counter() - start - rate_s)
        timings["block_cpu_s"].append(time.process_time() - cpu)

    seq.SequentialExecutor._merge_block = timed_block  # type: ignore[method-assign]
    implementation = info.implementation
    merge_group = implementation.merge_linear_group

    def timed_group(group: Any, parameters: Any) -> Any:
        if meter is not None:
            meter.measure_rates()  # right before the group's solve
        start = time.perf_counter()
        try:
            if meter is None:
                return merge_group(group, parameters)
            with meter.phase("diagnostics"):  # what merge_linear_group does besides the solve
                return merge_group(group, parameters)
        finally:
            synchronize()
            timings["group_s"][group.name] = time.perf_counter() - start

    implementation.merge_linear_group = timed_group  # type: ignore[method-assign]

    start = time.perf_counter()
    plan = plan_layerwise_merge(cfg, options, implementation, cfg.parameters)
    plan_s = time.perf_counter() - start
    estimate = plan.memory.peak
    plan_warnings = list(warnings)
    start = time.perf_counter()
    if meter is not None:
        with meter:
            result = seq.SequentialExecutor(plan, out, device).run()
        timings["roofline"] = meter.record()
    else:
        result = seq.SequentialExecutor(plan, out, device).run()
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    diagnostics = [
        {
            k: d.get(k)
            for k in ("layer", "solver", "ridge", "tokens", "input_width", "condition_number")
        }
        for d in result.diagnostics.get("layers", [])
        if isinstance(d, dict)
    ]
    # a block refinement's record per block (block_distillation: its steps and errors)
    refined = [
        {k: d.get(k) for k in ("layer", "steps", "kept", "error_before", "error_refined")}
        for d in result.diagnostics.get("blocks", [])
        if isinstance(d, dict)
    ]
    record = {
        "method": method,
        "experts": experts,
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "gpu_peak": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "compute": plan.compute.name if plan.compute is not None else "float32",
        "plan_s": plan_s,
        "wall_s": wall,
        "peak_rss": peak,
        "baseline_rss": baseline,
        "estimate": estimate,
        "estimate_parts": {k: int(v) for k, v in vars(plan.memory).items()},
        "plan_warnings": plan_warnings,
        "diagnostics": diagnostics,
        "parameters": parameters or {},
        "refined_blocks": refined,
        **timings,
    }
    print("RESULT " + json.dumps(record), flush=True)


def _instrument(seq: Any, least_squares: Any) -> Any:
    """The roofline's phases (``benchmarks/roofline.py``): the block passes (expert path,
    merged path, propagation), the statistics' updates (the Grams' sums; nested in the
    passes, timed apart), each group's solve and the rest of ``merge_linear_group``."""
    from benchmarks.roofline import Roofline
    from mergekit_ext.calibration.statistics import ActivationStatistics

    meter = Roofline()
    meter.rate_s = 0.0
    measure = meter.measure_rates

    def timed_measure(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return measure(*args, **kwargs)
        finally:
            meter.rate_s += time.perf_counter() - start

    meter.measure_rates = timed_measure

    def in_phase(owner: Any, attribute: str, name: str) -> None:
        original = getattr(owner, attribute)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with meter.phase(name):
                return original(*args, **kwargs)

        setattr(owner, attribute, wrapped)

    executor = seq.SequentialExecutor
    for attribute in ("_expert_path_statistics", "_merged_path_statistics", "run_block"):
        in_phase(executor, attribute, "passes")
    for attribute in ("update", "finalize"):
        in_phase(ActivationStatistics, attribute, "grams")
    return meter


def _run_child(
    method: str,
    folder: str,
    experts: int,
    threads: int,
    compute: str = "auto",
    device: str = "cpu",
    roofline: bool = False,
    setting: str = "native",
    parameters: dict[str, Any] | None = None,
) -> dict[str, Any]:
    from benchmarks.cpu_kernels import SETTINGS

    out = tempfile.mkdtemp(prefix="llm-width-out-", dir=os.path.dirname(folder))
    cmd = [sys.executable, "-m", "benchmarks.probes.llm_width", "--child", method]
    cmd += ["--models-dir", folder, "--experts", str(experts), "--threads", str(threads)]
    cmd += ["--out", out, "--compute-dtype", compute, "--device", device]
    if roofline:
        cmd.append("--roofline")
    if parameters:
        cmd += ["--parameters-json", json.dumps(parameters)]
    env = {
        **os.environ,
        **(SETTINGS[setting] if setting != "native" else {}),
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": ROOT,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
    }
    from benchmarks.probes.executor_memory import run_polled

    try:
        returncode, output, errors, polled = run_polled(cmd, env, 0.2)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    if returncode != 0:
        raise RuntimeError(f"{method} K={experts} failed ({returncode}):\n{errors[-4000:]}")
    line = next(line for line in output.splitlines() if line.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    result["polled_rss"] = polled
    result["load"] = os.getloadavg()[0]  # other processes on the machine during the run
    result["setting"] = setting
    return result


def _available_gb() -> float:
    import psutil

    return psutil.virtual_memory().available / 2**30


# ------------------------------------------------------------------------------------------
# Report


def _short(layer: str) -> str:
    return layer.split("layers.")[-1]


def report(results: list[dict[str, Any]]) -> str:
    gb = 1e9
    lines = [
        f"synthetic Llama-3-8B widths: hidden {SIZE['hidden_size']}, intermediate "
        f"{SIZE['intermediate_size']}, {SIZE['num_attention_heads']} heads / "
        f"{SIZE['num_key_value_heads']} KV heads, {SIZE['num_hidden_layers']} blocks, vocab "
        f"{SIZE['vocab_size']}, bf16 checkpoints; {SIZE['sequences']} x {SIZE['seq_len']} "
        "calibration tokens per task",
        "",
        "| method | compute | K | threads | s / block | CPU s / block | solve s / block "
        "| merge_linear_group s / block | wall s | peak RSS GB | polled GB | dry-run estimate GB "
        "| estimate / peak | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        blocks = max(len(r["block_s"]), 1)
        per_block = sum(r["block_s"]) / blocks
        solve = sum(r["solve_s"].values()) / blocks
        group = sum(r["group_s"].values()) / blocks
        cpu = sum(r["block_cpu_s"]) / blocks
        lines.append(
            f"| {r['method']} | {r.get('compute', 'float32')} | {r['experts']} | {r['threads']} "
            f"| {per_block:.1f} | {cpu:.1f} "
            f"| {solve:.1f} "
            f"| {group:.1f} | {r['wall_s']:.1f} | {r['peak_rss'] / gb:.2f} | "
            f"{r['polled_rss'] / gb:.2f} | {r['estimate'] / gb:.2f} | "
            f"{r['estimate'] / r['peak_rss']:.2f} | {r.get('load', float('nan')):.1f} |"
        )
    lines.append("")
    for r in results:
        if r.get("gpu_peak") is not None:
            lines.append(
                f"{r['method']} K={r['experts']} on {r['device']}: "
                f"peak GPU memory {r['gpu_peak'] / gb:.2f} GB"
            )
    for r in results:
        lines.append(
            f"{r['method']} {r.get('compute', 'float32')} K={r['experts']} "
            f"threads={r['threads']}: blocks "
            + ", ".join(f"{s:.1f}" for s in r["block_s"])
            + " s; solve per group (block 0): "
            + ", ".join(
                f"{_short(k)} {v:.1f} s" for k, v in r["solve_s"].items() if "layers.0." in k
            )
        )
    seen = set()
    for r in results:
        for d in r["diagnostics"]:
            key = (r["experts"], _short(d["layer"]).split(".", 1)[-1])
            if "layers.0." in d["layer"] and key not in seen and r["method"] == "chain_of_merges":
                seen.add(key)
                lines.append(
                    f"  K={r['experts']} {key[1]}: {d['tokens']} tokens, {d['input_width']} inputs, "
                    f"solver {d['solver']}, ridge {d['ridge']}, condition {d['condition_number']:.3g}"
                )
    warned = sorted({w for r in results for w in r["plan_warnings"] if "tokens" in w})
    if warned:
        lines += ["", "plan-time warnings:"] + [f"- {w}" for w in warned]
    return "\n".join(lines)


GROUPS = {  # one Llama-3-8B block: (rows out, inputs) of each linear group
    "qkv": (4096 + 2 * 1024, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (2 * 14336, 4096),
    "down_proj": (4096, 14336),
}


def solve_only(experts: int, tokens: int, dense_max_inputs: int) -> list[dict[str, Any]]:
    """``merge_group_least_squares`` on synthetic groups of 8B shapes, no model: the span solve
    (rows kept, the default) and, up to ``dense_max_inputs`` inputs, the dense regularised
    Cholesky solve of the same system (Grams only). Same process, so no RSS figures."""
    import torch

    from mergekit_ext.methods.layerwise import LinearGroup, TaskStatistics
    from mergekit_ext.methods.least_squares import LeastSquaresSettings, merge_group_least_squares

    out = []
    for label, (rows_out, width) in GROUPS.items():
        g = torch.Generator().manual_seed(width + rows_out)
        base = torch.randn(rows_out, width, generator=g) * 0.02
        weights = [base + torch.randn(rows_out, width, generator=g) * 0.002 for _ in range(experts)]
        xs = []
        for _ in range(experts):
            a = torch.randn(tokens, width, generator=g)
            xs.append(torch.nn.functional.silu(a) * torch.randn(tokens, width, generator=g))
        for mode in ("span", "dense"):
            if mode == "dense" and width > dense_max_inputs:
                continue
            stats = []
            for x in xs:
                gram = None
                if mode == "dense":
                    x64 = x.double()
                    gram = x64.T @ x64 / tokens
                stats.append(
                    TaskStatistics(
                        gram=gram,
                        mean=x.double().mean(0),
                        count=tokens,
                        second_moment=x.double().square().mean(0),
                        rows=x if mode == "span" else None,
                    )
                )
            group = LinearGroup(
                name=label,
                weights=[f"{label}.weight"],
                base={f"{label}.weight": base},
                experts=[{f"{label}.weight": w} for w in weights],
                task_names=[f"t{k}" for k in range(experts)],
                expert_stats=stats,
                merged_stats=None,
            )
            start = time.perf_counter()
            _, diagnostics = merge_group_least_squares(
                group,
                LeastSquaresSettings(
                    method="regmean",
                    reduce_non_diagonal=1.0,
                    ridge="auto",
                    solver="pinv",
                    use_merged_path=False,
                    use_normalized_gram=False,
                ),
            )
            seconds = time.perf_counter() - start
            out.append(
                {
                    "group": label,
                    "mode": mode,
                    "out": rows_out,
                    "inputs": width,
                    "tokens": experts * tokens,
                    "seconds": seconds,
                    "solver": diagnostics["solver"],
                    "condition_number": diagnostics["condition_number"],
                    "condition_number_method": diagnostics["condition_number_method"],
                }
            )
            print(json.dumps(out[-1]), flush=True)
            del group, stats
    return out


def _method_parameters(settings: list[str]) -> dict[str, dict[str, Any]]:
    """``--set METHOD.KEY=VALUE`` lines as ``{method: {key: value}}``."""
    import yaml

    parameters: dict[str, dict[str, Any]] = {}
    for item in settings:
        name, sep, value = item.partition("=")
        method, dot, key = name.partition(".")
        if not (sep and dot and method and key):
            raise SystemExit(f"--set {item!r}: write METHOD.KEY=VALUE")
        parameters.setdefault(method, {})[key] = yaml.safe_load(value)
    return parameters


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models-dir", default=None, help=f"default {DEFAULT_MODELS_DIR}")
    parser.add_argument(
        "--small", action="store_true", help="a tiny Llama instead of the 8B widths (a check)"
    )
    parser.add_argument("--experts", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--threads", type=int, nargs="*", default=[2, 1])
    parser.add_argument(
        "--methods", nargs="*", default=["chain_of_merges", "regmean"], help="methods to run"
    )
    parser.add_argument("--min-available-gb", type=float, default=14.0)
    parser.add_argument(
        "--wait-memory-s", type=float, default=600.0, help="wait this long for the memory"
    )
    parser.add_argument("--json", default=None, help="also write the raw results here")
    parser.add_argument("--cleanup", action="store_true", help="delete --models-dir and exit")
    parser.add_argument(
        "--solve-only",
        action="store_true",
        help="time merge_group_least_squares on synthetic 8B-shaped groups (no model)",
    )
    parser.add_argument("--tokens", type=int, default=2000, help="--solve-only: tokens per task")
    parser.add_argument(
        "--dense-max-inputs", type=int, default=4096, help="--solve-only: dense solve up to this"
    )
    parser.add_argument(
        "--compute-dtype",
        nargs="*",
        default=["float32", "bfloat16"],
        help="compute_dtype settings to run side by side (auto | float32 | bfloat16)",
    )
    parser.add_argument(
        "--device", default="cpu", help="where the merges run: cpu | cuda[:n] (the executor's)"
    )
    parser.add_argument(
        "--roofline",
        action="store_true",
        help="count each phase's FLOPs, measure the GEMM rates before each block and group, "
        "and print time / floor per phase (benchmarks/roofline.py)",
    )
    parser.add_argument(
        "--setting",
        nargs="*",
        default=["native"],
        help="kernel settings to run in turn: native (this CPU's own), avx512-no-amx, avx2 "
        "(benchmarks/cpu_kernels.py's variables; each caps only what this CPU has)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="METHOD.KEY=VALUE",
        help="a method parameter in that method's YAML (VALUE read as YAML), e.g. "
        "block_distillation.distill_steps=4; repeatable",
    )
    parser.add_argument("--parameters-json", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.models_dir is None:
        args.models_dir = DEFAULT_MODELS_DIR + ("_small" if args.small else "")
    if args.cleanup:
        shutil.rmtree(args.models_dir, ignore_errors=True)
        return 0
    if args.solve_only:
        import torch

        torch.set_num_threads(args.threads[0])
        print(f"torch threads: {torch.get_num_threads()}", flush=True)
        solve_only(args.experts[0], args.tokens, args.dense_max_inputs)
        return 0
    if args.child:
        _child(
            args.child,
            _folder(args.models_dir),
            args.experts[0],
            args.out,
            args.threads[0],
            args.compute_dtype[0],
            args.device,
            args.roofline,
            json.loads(args.parameters_json) if args.parameters_json else None,
        )
        return 0
    method_parameters = _method_parameters(args.set)
    results = []
    folder = _folder(args.models_dir)
    # built in a subprocess so the children's ru_maxrss is their own
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"from benchmarks.probes.llm_width import _build; _build({folder!r}, {max(args.experts)}, {args.small})",
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        check=True,
    )
    runs = [
        (experts, threads, method, compute, setting)
        for experts in args.experts
        for threads in args.threads
        for method in args.methods
        for compute in args.compute_dtype
        for setting in args.setting
    ]
    for experts, threads, method, compute, setting in runs:
        available = _available_gb()
        deadline = time.monotonic() + args.wait_memory_s
        while available < args.min_available_gb and time.monotonic() < deadline:
            time.sleep(10)  # other processes share the machine: wait for memory
            available = _available_gb()
        if available < args.min_available_gb:
            print(
                f"skipped {method} {compute} K={experts} threads={threads}: "
                f"{available:.1f} GiB available < {args.min_available_gb}",
                flush=True,
            )
            continue
        load_before = os.getloadavg()[0]
        r = _run_child(
            method,
            folder,
            experts,
            threads,
            compute,
            args.device,
            args.roofline,
            setting,
            method_parameters.get(method),
        )
        r["load_before"] = load_before
        results.append(r)
        print(report([r]).split("\n")[4], flush=True)
        if "roofline" in r:
            print(roofline_report(r), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    print(report(results))
    return 0


def roofline_report(r: dict[str, Any]) -> str:
    """One run's roofline table (``benchmarks/roofline.py``), per block."""
    from benchmarks.roofline import table

    blocks = max(len(r["block_s"]), 1)
    title = (
        f"roofline: {r['method']} K={r['experts']} compute {r.get('compute')} threads "
        f"{r['threads']} setting {r.get('setting', 'native')}: "
        f"{sum(r['block_s']) / blocks:.1f} s / block, load average "
        f"{r.get('load_before', float('nan')):.1f} before, {r.get('load', float('nan')):.1f} after"
    )
    return table(r["roofline"], blocks, title)


def _folder(models_dir: str) -> str:
    return models_dir


if __name__ == "__main__":
    sys.exit(main())
