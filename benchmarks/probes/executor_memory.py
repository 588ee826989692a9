"""Peak memory and wall time of the sequential executor (Chain of Merges) vs mergekit's TIES.

A synthetic Llama of ~0.5B parameters (hidden 1024, intermediate 3584, 24 blocks, vocab
32000, untied head; random float32 weights) is built once in a cache folder with three
experts (base + seeded random task vectors), plus 32 random calibration sequences of 128
tokens per task (token ids in a safetensors file). Then, each in its own subprocess so that
peak RSS is measured per method:

- ``chain_of_merges`` through mergekit-ext's sequential executor (default parameters:
  propagate on, expert path on for the covariate-shift diagnostic);
- mergekit's ``ties`` through ``mergekit.merge.run_merge`` on the same models.

Peak RSS is the child's ``ru_maxrss`` (``resource.getrusage(RUSAGE_SELF)``, one process, no
grandchildren) and, as a cross-check, the parent's psutil polling of the child. Both
merges write with the same shard size (mergekit's default 5B bytes), so each holds the
merged model in memory until the shard is written.

Targets: CoM peak RSS below the size of two models; CoM time at most 2x TIES (issue
#31; it was 4x before).

    python -m benchmarks.probes.executor_memory            # ~0.5B, a few minutes on 2 cores
    python -m benchmarks.probes.executor_memory --small    # quick check
    python -m benchmarks.probes.executor_memory --probe    # full widths, 4 blocks: timing probe
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import zlib
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NUM_EXPERTS = 3
SIZES: dict[str, dict[str, int]] = {
    "full": dict(
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=32000,
        sequences=32,
        seq_len=128,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=4000,
        sequences=8,
        seq_len=64,
    ),
}
# the full widths with 4 blocks: a timing probe (a few minutes)
SIZES["probe"] = {**SIZES["full"], "num_hidden_layers": 4}


# ------------------------------------------------------------------------------------------
# Building the synthetic models and data (once, cached)


def _llama_config(size: dict[str, int]):
    import transformers

    return transformers.LlamaConfig(
        hidden_size=size["hidden_size"],
        intermediate_size=size["intermediate_size"],
        num_hidden_layers=size["num_hidden_layers"],
        num_attention_heads=size["num_attention_heads"],
        num_key_value_heads=size["num_key_value_heads"],
        vocab_size=size["vocab_size"],
        max_position_embeddings=max(256, size["seq_len"]),
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
        dtype="float32",
    )


def _tensor(name: str, shape: tuple[int, ...], expert: int) -> Any:
    """Seeded random tensor: base weights N(0, 0.02²), norms 1; expert k adds its own delta."""
    import torch

    seed = zlib.crc32(name.encode())
    if name.endswith("norm.weight"):
        base = torch.ones(shape)
    else:
        base = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 0.02
    if expert < 0:
        return base
    gen = torch.Generator().manual_seed(seed + 1000003 * (expert + 1))
    return base + torch.randn(shape, generator=gen) * 0.002 * (1.0 + 0.5 * expert)


def _build_models(folder: str, size: dict[str, int]) -> dict[str, Any]:
    import torch
    from accelerate import init_empty_weights
    from huggingface_hub import save_torch_state_dict
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
    write_calibration(folder, NUM_EXPERTS, size)
    params = sum(int(torch.Size(s).numel()) for s in shapes.values())
    return {"parameters": params}


def write_calibration(folder: str, experts: int, size: dict[str, int]) -> None:
    """``calibration{k}.safetensors`` in ``folder`` for each task: ``size["sequences"] x
    size["seq_len"]`` seeded random token ids (one generator over the tasks, so task k's ids
    are the same whatever the probe); a file already there is kept."""
    import torch
    from safetensors.torch import save_file

    rng = torch.Generator().manual_seed(1234)
    for k in range(experts):
        path = os.path.join(folder, f"calibration{k}.safetensors")
        ids = torch.randint(
            5, size["vocab_size"], (size["sequences"], size["seq_len"]), generator=rng
        )
        if not os.path.isfile(path):
            save_file({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, path)


def build(cache_dir: str, size_name: str) -> tuple[str, dict[str, Any]]:
    from benchmarks.suites.cache import cached_build

    size = SIZES[size_name]
    folder = os.path.join(cache_dir, f"executor_memory_{size_name}")
    record = cached_build(
        folder, {"bench": "executor_memory", **size}, lambda tmp: _build_models(tmp, size)
    )
    return folder, record


def model_bytes(folder: str) -> int:
    return sum(
        os.path.getsize(os.path.join(folder, f))
        for f in os.listdir(folder)
        if f.endswith(".safetensors")
    )


# ------------------------------------------------------------------------------------------
# The two merges (run in child processes)


def _yaml(method: str, folder: str, size: dict[str, int], compute: str | None = None) -> str:
    import yaml

    models = []
    for k in range(NUM_EXPERTS):
        entry: dict[str, Any] = {"model": os.path.join(folder, f"expert{k}")}
        if method == "ties":
            entry["parameters"] = {"weight": 1.0, "density": 0.5}
        else:
            entry["name"] = f"task{k}"
            entry["calibration"] = {
                "path": os.path.join(folder, f"calibration{k}.safetensors"),
                "samples": size["sequences"],
                "max_length": size["seq_len"],
                "batch_size": 8,
            }
        models.append(entry)
    config: dict[str, Any] = {
        "merge_method": method,
        "base_model": os.path.join(folder, "base"),
        "models": models,
        "dtype": "float32",
    }
    if method == "ties":
        config["parameters"] = {"normalize": True}
    elif compute:
        config["parameters"] = {"compute_dtype": compute}
    return yaml.safe_dump(config)


def _child(
    method: str, folder: str, out: str, size_name: str, threads: int | None, compute: str | None
) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)
    from mergekit.options import MergeOptions

    import mergekit_ext  # noqa: F401  (registers the methods)
    from mergekit_ext.config import parse_config

    size = SIZES[size_name]
    cfg = parse_config(_yaml(method, folder, size, compute))
    options = MergeOptions(quiet=True, write_model_card=False, copy_tokenizer=False)
    import psutil

    baseline = psutil.Process().memory_info().rss  # after the imports, before the merge
    timings: dict[str, float] = {}
    start = time.perf_counter()
    if method == "ties":
        from mergekit.merge import run_merge

        run_merge(cfg.merge, out, options=options, config_source=cfg.source_text)
    else:
        from mergekit_ext.executor import run_layerwise_merge
        from mergekit_ext.methods.registry import ext_method_info

        info = ext_method_info(method)
        assert info is not None
        timed = _timed(info.implementation, timings)
        run_layerwise_merge(cfg, out, options, timed, cfg.parameters, device="cpu")
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = {
        "method": method,
        "wall_s": wall,
        "peak_rss": peak,
        "baseline_rss": baseline,
        "threads": torch.get_num_threads(),
        **timings,
    }
    print("RESULT " + json.dumps(result), flush=True)


def _timed(method: Any, timings: dict[str, float]) -> Any:
    """Wrap a LayerwiseMethod to time the method's own work apart from the executor's."""
    from mergekit_ext.methods.layerwise import LayerwiseMethod

    class TimedMethod(LayerwiseMethod):
        name = method.name
        # the plan parses the parameters with the wrapper's model: it must be the method's
        parameters_model = method.parameters_model

        def statistics_request(self, parameters):
            return method.statistics_request(parameters)

        def merge_linear_group(self, group, parameters):
            start = time.perf_counter()
            try:
                return method.merge_linear_group(group, parameters)
            finally:
                elapsed = time.perf_counter() - start
                timings["method_linear_s"] = timings.get("method_linear_s", 0.0) + elapsed

        def merge_other(self, name, base, experts, parameters):
            return method.merge_other(name, base, experts, parameters)

        # the plan's estimate and warnings are the method's (methods/layerwise.py)
        def solve_in_span(self, parameters, group):
            return method.solve_in_span(parameters, group)

        def solve_bytes(self, parameters, group, tasks, **how):
            return method.solve_bytes(parameters, group, tasks, **how)

        def plan_warnings(self, parameters, groups):
            return method.plan_warnings(parameters, groups)

    return TimedMethod()


def _self_command() -> list[str]:
    return [sys.executable, "-m", "benchmarks.probes.executor_memory"]


def _run_json(cmd: list[str], env_extra: dict[str, str]) -> dict[str, Any]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT, **env_extra}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def run_polled(cmd: list[str], env: dict[str, str], interval: float) -> tuple[int, str, str, int]:
    """Run ``cmd`` from the repository root, polling its RSS with psutil every ``interval``
    seconds: ``(return code, stdout, stderr, largest RSS seen)``. Output goes through files,
    not pipes, so a chatty child never blocks on a full pipe while we poll."""
    import tempfile

    import psutil

    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=stdout, stderr=stderr, text=True)
        watched = psutil.Process(proc.pid)
        polled = 0
        while proc.poll() is None:
            try:
                polled = max(polled, watched.memory_info().rss)
            except psutil.Error:
                pass
            time.sleep(interval)
        stdout.seek(0)
        stderr.seek(0)
        return proc.returncode, stdout.read(), stderr.read(), polled


def run_child(
    method: str,
    folder: str,
    out: str,
    size_name: str,
    threads: int | None,
    compute: str | None = None,
) -> dict[str, Any]:
    """Run one merge in a subprocess: its own ru_maxrss, plus psutil polling of its RSS."""

    cmd = [*_self_command(), "--child", method, "--models", folder, "--out", out]
    cmd += ["--size", size_name]
    if compute:
        cmd += ["--compute-dtype", compute]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ROOT}
    if threads:
        cmd += ["--threads", str(threads)]
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    returncode, output, errors, polled = run_polled(cmd, env, 0.1)
    if returncode != 0:
        raise RuntimeError(f"{method} failed ({returncode}):\n{errors[-4000:]}")
    line = next(line for line in output.splitlines() if line.startswith("RESULT "))
    result = json.loads(line[len("RESULT ") :])
    result["polled_rss"] = polled
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="a tiny model for a quick check")
    parser.add_argument(
        "--probe", action="store_true", help="the full widths with only 4 blocks (timing probe)"
    )
    parser.add_argument("--cache", default=None, help="cache folder for the synthetic models")
    parser.add_argument(
        "--work", default=None, help="folder for the merge outputs (default: a temp folder)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads of both merges (default: torch's); 1 is faster on a busy machine",
    )
    parser.add_argument(
        "--compute-dtype",
        default=None,
        help="Chain of Merges' compute_dtype (default: its own, auto; the checkpoints are "
        "float32, so auto runs float32 passes)",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--models", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--size", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child, args.models, args.out, args.size, args.threads, args.compute_dtype)
        return 0
    if args.build_only:
        folder, record = build(args.cache, args.size)
        print("RESULT " + json.dumps({"folder": folder, "record": record}), flush=True)
        return 0

    import shutil
    import tempfile

    from benchmarks.suites.cache import default_cache_dir

    size_name = "small" if args.small else "probe" if args.probe else "full"
    # Built in a subprocess: a child inherits its parent's peak RSS (ru_maxrss) at fork, so
    # the parent must stay small for the children's ru_maxrss to be their own.
    built = _run_json(
        [
            *_self_command(),
            "--build-only",
            "--cache",
            args.cache or default_cache_dir(),
            "--size",
            size_name,
        ],
        {},
    )
    folder, record = built["folder"], built["record"]
    size = SIZES[size_name]
    one_model = model_bytes(os.path.join(folder, "base"))
    work = args.work or tempfile.mkdtemp(prefix="executor-memory-")
    results = {}
    try:
        for method in ("ties", "chain_of_merges"):
            out = os.path.join(work, method)
            shutil.rmtree(out, ignore_errors=True)
            results[method] = run_child(
                method, folder, out, size_name, args.threads, args.compute_dtype
            )
            shutil.rmtree(out, ignore_errors=True)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)

    gb = 1e9
    print(
        f"synthetic Llama: {record['parameters'] / 1e9:.3f}B parameters, {size['num_hidden_layers']} blocks, "
        f"hidden {size['hidden_size']}, intermediate {size['intermediate_size']}, vocab {size['vocab_size']}; "
        f"{NUM_EXPERTS} experts; calibration {size['sequences']} x {size['seq_len']} tokens per task"
    )
    print(f"one model: {one_model / gb:.3f} GB (float32 safetensors)")
    print(f"chain_of_merges compute_dtype: {args.compute_dtype or 'auto (float32 checkpoints)'}")
    print(
        f"{'method':<18}{'wall s':>10}{'peak RSS GB':>14}{'polled GB':>12}{'after imports GB':>18}"
    )
    for method, r in results.items():
        print(
            f"{method:<18}{r['wall_s']:>10.1f}{r['peak_rss'] / gb:>14.3f}{r['polled_rss'] / gb:>12.3f}"
            f"{r['baseline_rss'] / gb:>18.3f}"
        )
    com, ties = results["chain_of_merges"], results["ties"]
    rss_ratio = com["peak_rss"] / one_model
    time_ratio = com["wall_s"] / ties["wall_s"]
    print(
        f"CoM peak RSS / model size: {rss_ratio:.2f}  (target < 2)  {'OK' if rss_ratio < 2 else 'MISSED'}"
    )
    increment = (com["peak_rss"] - com["baseline_rss"]) / one_model
    print(f"  (CoM peak RSS above its RSS after imports / model size: {increment:.2f})")
    print(
        f"CoM time / TIES time:      {time_ratio:.2f}  (target ≤ 2)  {'OK' if time_ratio <= 2 else 'MISSED'}"
    )
    if "method_linear_s" in com:
        print(
            f"CoM time inside the method's merge_linear_group (solves, diagnostics): "
            f"{com['method_linear_s']:.1f} s of {com['wall_s']:.1f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
