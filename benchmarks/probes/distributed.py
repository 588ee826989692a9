"""Wall time and peak RSS per rank of one Chain of Merges merge on W = 1, 2, ... processes.

The synthetic Llama of ``benchmarks/probes/executor_memory.py`` (0.43B parameters at full size:
hidden 1024, intermediate 3584, 24 blocks, vocab 32000, float32) with K = 4 experts and 32
random calibration sequences of 128 tokens per task, merged with CoM's defaults:

- W = 1: ``python -m mergekit_ext run CONFIG OUT`` as one process;
- W = 2: ``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 -m mergekit_ext run CONFIG
  OUT`` (gloo), rank r owning tasks ``k mod 2 = r``;
- ``--worlds 1,2,4 --tasks 2``: also W > K, where the ranks of a task share its batches
  (``--batch-size`` small enough that each rank gets a batch).

Each process runs with one torch thread (``OMP_NUM_THREADS=1``) and reports its own wall
time (from the start of ``mergekit-ext run`` to its end, the imports excluded) and its
``ru_maxrss``. The two outputs are compared tensor by tensor. Target: W = 2 wall time at
most 0.65x that of W = 1 (which needs two idle cores).

    python -m benchmarks.probes.distributed            # full size (~0.43B, K = 4): long on 2 cores
    python -m benchmarks.probes.distributed --probe    # full widths, 4 blocks
    python -m benchmarks.probes.distributed --small    # a quick check
    python -m benchmarks.probes.distributed --small --tasks 2 --worlds 1,2,4 --batch-size 2
    python -m benchmarks.probes.distributed --medium --tasks 2 --worlds 1,2,4
    python -m benchmarks.probes.distributed --llm-width [DIR]   # memory probe at Llama-3-8B widths

``--llm-width``: the two-block Llama-3-8B-width model of ``benchmarks/probes/llm_width.py`` (bf16,
built there under DIR, default its ``--models-dir``) with K = 4 experts: peak RSS per rank for
W = 1 and W = 2 next to the plan's estimate for that rank (``--dry-run``'s numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks.probes.executor_memory import SIZES, _llama_config, _tensor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUM_EXPERTS = 4
# between --small and --probe: where the passes and Grams outweigh a process's fixed costs
MEDIUM = dict(
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    vocab_size=8000,
    sequences=32,
    seq_len=128,
)


def _build_models(folder: str, size: dict[str, int]) -> dict[str, Any]:
    import torch
    from accelerate import init_empty_weights
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    config = _llama_config(size)
    with init_empty_weights():
        skeleton = LlamaForCausalLM(config)
    shapes = {name: tuple(p.shape) for name, p in skeleton.state_dict().items()}
    for index, label in enumerate(["base", *[f"expert{k}" for k in range(NUM_EXPERTS)]]):
        out = os.path.join(folder, label)
        os.makedirs(out)
        state = {name: _tensor(name, shape, index - 1) for name, shape in shapes.items()}
        save_torch_state_dict(state, out, max_shard_size="1GB")
        config.save_pretrained(out)
        del state
    rng = torch.Generator().manual_seed(4321)
    for k in range(NUM_EXPERTS):
        ids = torch.randint(
            5, size["vocab_size"], (size["sequences"], size["seq_len"]), generator=rng
        )
        save_file(
            {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
            os.path.join(folder, f"calibration{k}.safetensors"),
        )
    return {"parameters": sum(int(torch.Size(s).numel()) for s in shapes.values())}


def build(cache_dir: str, size_name: str) -> tuple[str, dict[str, Any]]:
    from benchmarks.suites.cache import cached_build

    size = MEDIUM if size_name == "medium" else SIZES[size_name]
    folder = os.path.join(cache_dir, f"distributed_{size_name}")
    recipe = {"bench": "distributed", "experts": NUM_EXPERTS, **size}
    return folder, cached_build(folder, recipe, lambda tmp: _build_models(tmp, size))


def _config(
    folder: str, size: dict[str, int], tasks: int = NUM_EXPERTS, batch_size: int = 8
) -> str:
    import yaml

    models = [
        {
            "model": os.path.join(folder, f"expert{k}"),
            "name": f"task{k}",
            "calibration": {
                "path": os.path.join(folder, f"calibration{k}.safetensors"),
                "samples": size["sequences"],
                "max_length": size["seq_len"],
                "batch_size": batch_size,
            },
        }
        for k in range(tasks)
    ]
    config = {
        "merge_method": "chain_of_merges",
        "base_model": os.path.join(folder, "base"),
        "models": models,
        "dtype": "float32",
    }
    path = os.path.join(folder, f"chain_of_merges_k{tasks}_b{batch_size}.yml")
    with open(path, "w", encoding="utf-8") as fp:
        yaml.safe_dump(config, fp)
    return path


def _child(config: str, out: str) -> None:
    """One process of the merge (under torchrun or alone): ``mergekit-ext run`` in-process."""
    import torch

    torch.set_num_threads(1)
    from mergekit_ext.cli import main as cli

    start = time.perf_counter()
    try:
        cli(["run", config, out, "--no-write-model-card", "--quiet"], standalone_mode=False)
    finally:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        record = {
            "rank": int(os.environ.get("RANK", "0")),
            "wall_s": time.perf_counter() - start,
            "cpu_s": usage.ru_utime + usage.ru_stime,  # includes the imports
            "peak_rss": usage.ru_maxrss * 1024,
        }
        print("RESULT " + json.dumps(record), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(command: list[str]) -> tuple[float, list[dict[str, Any]]]:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": ROOT,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    outer = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{(done.stdout + done.stderr)[-4000:]}")
    records = [
        json.loads(line[len("RESULT ") :])
        for line in done.stdout.splitlines()
        if line.startswith("RESULT ")
    ]
    return outer, sorted(records, key=lambda r: r["rank"])


def _compare(a: str, b: str) -> tuple[float, int, int]:
    """(max relative error over tensors, identical tensors, tensors) between two outputs."""
    from safetensors import safe_open

    def index(folder: str) -> dict[str, str]:
        found = {}
        for f in sorted(os.listdir(folder)):
            if f.endswith(".safetensors"):
                with safe_open(os.path.join(folder, f), "pt") as st:
                    found.update({k: os.path.join(folder, f) for k in st.keys()})
        return found

    ia, ib = index(a), index(b)
    assert set(ia) == set(ib), "the two outputs hold different tensors"
    worst, same = 0.0, 0
    for name in ia:
        with safe_open(ia[name], "pt") as fa, safe_open(ib[name], "pt") as fb:
            ta, tb = fa.get_tensor(name).double(), fb.get_tensor(name).double()
        scale = float(ta.abs().max()) or 1.0
        worst = max(worst, float((ta - tb).abs().max()) / scale)
        same += bool((ta == tb).all())
    return worst, same, len(ia)


# What --dry-run says the process itself holds besides the plan (torch, transformers)
PROCESS_BASELINE = int(0.4e9)


def _parameters(folder: str) -> int:
    from mergekit_ext.models.model_paths import tensor_shapes

    total = 0
    for shape in tensor_shapes(folder).values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def _estimates(config: str, worlds: tuple[int, ...] = (1, 2)) -> dict[tuple[int, int], int]:
    """The plan's peak memory for each rank of each W: ``{(W, rank): bytes}``."""
    from mergekit.options import MergeOptions

    import mergekit_ext  # noqa: F401  (registers the methods)
    from mergekit_ext.config import load_config
    from mergekit_ext.executor import plan_layerwise_merge
    from mergekit_ext.executor.plan import estimate_memory
    from mergekit_ext.methods.registry import ext_method_info

    cfg = load_config(config)
    info = ext_method_info(cfg.method)
    assert info is not None
    plan = plan_layerwise_merge(cfg, MergeOptions(quiet=True), info.implementation, cfg.parameters)
    found = {(1, 0): estimate_memory(plan).peak}
    for w in worlds:
        for rank in range(w if w > 1 else 0):
            found[(w, rank)] = estimate_memory(plan, w, rank).peak
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a tiny model for a quick check")
    parser.add_argument("--probe", action="store_true", help="full widths, 4 blocks")
    parser.add_argument(
        "--medium", action="store_true", help="hidden 512, 4 blocks, 32 x 128 tokens per task"
    )
    parser.add_argument("--cache", default=None, help="cache folder for the synthetic models")
    parser.add_argument(
        "--llm-width",
        nargs="?",
        const="",
        default=None,
        metavar="DIR",
        help="memory probe at Llama-3-8B widths (benchmarks/probes/llm_width.py's model, K = 4)",
    )
    parser.add_argument("--tasks", type=int, default=NUM_EXPERTS, help="K (at most 4)")
    parser.add_argument("--worlds", default="1,2", help="process counts W, comma-separated")
    parser.add_argument("--batch-size", type=int, default=8, help="calibration batch size")
    parser.add_argument("--child", nargs=2, metavar=("CONFIG", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(*args.child)
        return 0

    from benchmarks.suites.cache import default_cache_dir

    worlds = tuple(sorted({1, *(int(w) for w in args.worlds.split(","))}))

    estimates: dict[tuple[int, int], int] = {}
    if args.llm_width is not None:
        from benchmarks import llm_width

        folder = args.llm_width or llm_width.DEFAULT_MODELS_DIR
        llm_width._build(folder, NUM_EXPERTS)
        size_name, size = "llm-width", {**llm_width.SIZE}
        record = {"parameters": _parameters(os.path.join(folder, "base"))}
        config = os.path.join(folder, "chain_of_merges_k4.yml")
        with open(config, "w", encoding="utf-8") as fp:
            fp.write(llm_width._yaml("chain_of_merges", folder, NUM_EXPERTS))
        estimates = _estimates(config, worlds)
    else:
        size_name = (
            "small"
            if args.small
            else "probe"
            if args.probe
            else "medium"
            if args.medium
            else "full"
        )
        size = MEDIUM if size_name == "medium" else SIZES[size_name]
        folder, record = build(args.cache or default_cache_dir(), size_name)
        config = _config(folder, size, args.tasks, args.batch_size)
        estimates = _estimates(config, worlds)
    work = tempfile.mkdtemp(prefix="distributed-bench-")
    me = ["-m", "benchmarks.probes.distributed", "--child", config]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    runs: dict[int, tuple[float, list[dict[str, Any]]]] = {}
    compared: dict[int, tuple[float, int, int]] = {}
    try:
        for w in worlds:
            out = os.path.join(work, f"w{w}")
            launcher = (
                []
                if w == 1
                else [
                    torchrun,
                    "--nnodes",
                    "1",
                    "--nproc-per-node",
                    str(w),
                    "--master-addr",
                    "127.0.0.1",
                    "--master-port",
                    str(_free_port()),
                ]
            )
            runs[w] = _run([*(launcher or [sys.executable]), *me, out])
            if w > 1:
                compared[w] = _compare(os.path.join(work, "w1"), out)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    gb = 1e9
    print(
        f"synthetic Llama ({size_name}): {record['parameters'] / 1e9:.3f}B parameters, "
        f"{size['num_hidden_layers']} blocks, hidden {size['hidden_size']}, intermediate "
        f"{size['intermediate_size']}, vocab {size['vocab_size']}; {args.tasks} experts; "
        f"calibration {size['sequences']} x {size['seq_len']} tokens per task; chain_of_merges "
        "defaults; one torch thread per process"
    )
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{os.cpu_count()} CPUs; load average (1 min) at the end: {load:.1f}")
    header = f"{'W':<4}{'rank':<6}{'wall s':>10}{'CPU s':>10}{'peak RSS GB':>14}"
    header += f"{'launch-to-exit s':>18}"
    if estimates:
        header += f"{'estimate GB':>13}{'estimate / peak':>17}"
    print(header)
    for w, (outer, records) in runs.items():
        for r in records:
            line = (
                f"{w:<4}{r['rank']:<6}{r['wall_s']:>10.1f}{r['cpu_s']:>10.1f}"
                f"{r['peak_rss'] / gb:>14.3f}{outer:>18.1f}"
            )
            if estimates:
                # the plan's figure is on top of the Python process (torch, transformers)
                estimate = estimates[(w, r["rank"])] + PROCESS_BASELINE
                line += f"{estimate / gb:>13.2f}{estimate / r['peak_rss']:>17.2f}"
            print(line)
    if estimates:
        print(
            f"(estimate = the plan's peak for that rank + {PROCESS_BASELINE / gb:.1f} GB for the "
            "Python process with torch and transformers, as --dry-run states)"
        )
    one = runs[1][1]
    wall1 = max(r["wall_s"] for r in one)
    for w in worlds[1:]:
        many = runs[w][1]
        ratio = max(r["wall_s"] for r in many) / wall1
        target = "  (target <= 0.65)" if w == 2 else ""
        print(f"W={w} / W=1 wall time (slowest rank): {ratio:.2f}{target}")
        cpu_ratio = max(r["cpu_s"] for r in many) / max(r["cpu_s"] for r in one)
        print(
            f"W={w} / W=1 CPU time (busiest rank; what the wall time would be on idle cores): "
            f"{cpu_ratio:.2f}"
        )
        worst, same, total = compared[w]
        print(
            f"W={w} vs W=1 output: max relative error {worst:.3g}; {same}/{total} tensors identical"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
