"""A whole Llama-3-8B-shaped merge, end to end, as a user runs it (issue #31 item 5).

Three bf16 checkpoints (a base and K = 2 experts) of the Llama-3-8B shape — hidden 4096,
intermediate 14336, 32 heads / 8 KV heads, vocabulary 128256, untied head — written in 5 GB
``model-0000i-of-0000N.safetensors`` shards with a ``model.safetensors.index.json`` (the layout
of the Hub's Llama-3 checkpoints), 16 x 128 random calibration tokens per task, then
``mergekit-ext run`` with ``chain_of_merges`` and its defaults in a fresh process with
``--threads`` torch threads: the ``--dry-run`` estimate, the wall time, the time per block
(the merge's wall divided by the blocks), the peak RSS (``ru_maxrss`` of the child, also polled
with psutil) and the output's size.

Four models of 16 GB need 64 GB of disk; ``--blocks auto`` (the default) takes the most of the
32 blocks that fit in the free space of ``--models-dir`` with ``--margin-gb`` to spare, and the
report says how many it used.

    python -m benchmarks.probes.whole_llm --threads 2                # build (once), dry-run, merge
    python -m benchmarks.probes.whole_llm --blocks 2 --threads 2     # a quick rehearsal
    python -m benchmarks.probes.whole_llm --cleanup

Building writes each shard straight from seeded random tensors (the same generator as
``benchmarks/executor_memory.py``), so the memory it needs is one shard, not one model.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_MODELS_DIR = "/tmp/whole_llm_models"
SIZE: dict[str, int] = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    sequences=16,
    seq_len=128,
)
EXPERTS = 2
SHARD = "5GB"
# Written into --models-dir when this probe creates it: the probe deletes only below a folder
# that carries it, so a --models-dir pointing at the user's own models is refused, not emptied.
MARKER = ".whole_llm_probe"


def own_folder(folder: str) -> str:
    """``folder``, created and marked as this probe's; refuses a non-empty folder it did not make."""
    marker = os.path.join(folder, MARKER)
    if os.path.isdir(folder) and os.listdir(folder) and not os.path.isfile(marker):
        sys.exit(
            f"{folder} is not empty and was not made by this probe ({MARKER} missing); "
            "pass an empty or new --models-dir"
        )
    os.makedirs(folder, exist_ok=True)
    open(marker, "a").close()
    return folder


def _bytes_per_block() -> int:
    h, i = SIZE["hidden_size"], SIZE["intermediate_size"]
    kv = h * SIZE["num_key_value_heads"] // SIZE["num_attention_heads"]
    return 2 * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h)


def _bytes_outside_blocks() -> int:
    return 2 * (2 * SIZE["vocab_size"] * SIZE["hidden_size"] + SIZE["hidden_size"])


def blocks_that_fit(folder: str, margin_gb: float) -> int:
    """The most blocks (≤ 32) for which base, experts and the output fit on ``folder``'s disk."""
    own_folder(folder)
    have = sum(
        os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files
    )
    free = shutil.disk_usage(folder).free + have - margin_gb * 2**30
    models = EXPERTS + 2  # base, experts, output
    blocks = int((free / models - _bytes_outside_blocks()) // _bytes_per_block())
    return max(0, min(SIZE["num_hidden_layers"], blocks))


def _config(blocks: int):
    from benchmarks.probes.executor_memory import _llama_config

    config = _llama_config({**SIZE, "num_hidden_layers": blocks})
    config.dtype = "bfloat16"
    config.max_position_embeddings = 8192
    config.rope_theta = 500000.0
    return config


def build(folder: str, blocks: int) -> None:
    """Base and experts as sharded bf16 checkpoints, and each task's calibration tokens."""
    import torch
    from accelerate import init_empty_weights
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    from benchmarks.probes.executor_memory import _tensor, write_calibration

    config = _config(blocks)
    with init_empty_weights():
        skeleton = LlamaForCausalLM(config)
    meta = {n: p.to(torch.bfloat16) for n, p in skeleton.state_dict().items()}
    split = split_torch_state_dict_into_shards(
        meta, max_shard_size=SHARD, filename_pattern="model{suffix}.safetensors"
    )
    for index, label in enumerate(["base", *[f"expert{k}" for k in range(EXPERTS)]]):
        out = os.path.join(folder, label)
        if os.path.isfile(os.path.join(out, "config.json")):
            with open(os.path.join(out, "config.json")) as f:
                if json.load(f)["num_hidden_layers"] == blocks:
                    continue
            shutil.rmtree(out)
        tmp = out + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        for filename, names in split.filename_to_tensors.items():
            shard = {
                n: _tensor(n, tuple(meta[n].shape), index - 1).to(torch.bfloat16) for n in names
            }
            save_file(shard, os.path.join(tmp, filename), metadata={"format": "pt"})
            del shard
            print(f"built {label}/{filename}", flush=True)
        if split.is_sharded:
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": split.metadata, "weight_map": split.tensor_to_filename}, f)
        config.save_pretrained(tmp)
        os.rename(tmp, out)
    write_calibration(folder, EXPERTS, SIZE)


def _yaml(folder: str, extra: dict[str, Any]) -> str:
    import yaml

    models = [
        {
            "model": os.path.join(folder, f"expert{k}"),
            "name": f"task{k}",
            "calibration": {
                "path": os.path.join(folder, f"calibration{k}.safetensors"),
                "samples": SIZE["sequences"],
                "max_length": SIZE["seq_len"],
            },
        }
        for k in range(EXPERTS)
    ]
    config: dict[str, Any] = {
        "merge_method": "chain_of_merges",
        "base_model": os.path.join(folder, "base"),
        "models": models,
        "dtype": "bfloat16",
    }
    if extra:
        config["parameters"] = extra
    return yaml.safe_dump(config)


def _run(args: list[str], threads: int) -> tuple[int, str, float, int]:
    from benchmarks.probes.executor_memory import run_polled

    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": ROOT,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
    }
    cmd = [sys.executable, "-m", "mergekit_ext", *args]
    start = time.perf_counter()
    code, out, err, polled = run_polled(cmd, env, 0.5)
    wall = time.perf_counter() - start
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({code}):\n{err[-4000:]}")
    return code, out + err, wall, polled


def merge(folder: str, threads: int, extra: dict[str, Any]) -> dict[str, Any]:
    """Dry run (the estimate), then the merge; the output is deleted afterwards."""
    import re

    config = os.path.join(folder, "chain_of_merges.yml")
    with open(config, "w") as f:
        f.write(_yaml(folder, extra))
    out = os.path.join(folder, "merged")
    shutil.rmtree(out, ignore_errors=True)
    _, plan, _, _ = _run(["run", config, out, "--dry-run"], threads)
    estimate = re.search(r"peak[^\n]*?([0-9.]+) GB", plan)
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    _, log, wall, polled = _run(["run", config, out], threads)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    written = sum(
        os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(out) for f in files
    )
    shutil.rmtree(out, ignore_errors=True)
    with open(os.path.join(folder, "base", "config.json")) as f:
        blocks = json.load(f)["num_hidden_layers"]
    return {
        "blocks": blocks,
        "threads": threads,
        "parameters": extra,
        "wall_s": wall,
        "s_per_block": wall / blocks,
        "peak_rss_gb": peak / 1e9 if peak > before * 1024 else float("nan"),
        "polled_rss_gb": polled / 1e9,
        "estimate_line": plan[estimate.start() : estimate.end()] if estimate else None,
        "plan": plan,
        "output_gb": written / 1e9,
        "load": os.getloadavg()[0],
        "log_tail": log[-2000:],
    }


def report(r: dict[str, Any]) -> str:
    import torch
    import transformers

    return "\n".join(
        [
            f"chain_of_merges, K={EXPERTS}, {r['blocks']} of 32 Llama-3-8B blocks, bf16 "
            f"checkpoints in {SHARD} shards, {SIZE['sequences']}x{SIZE['seq_len']} calibration "
            f"tokens per task, {r['threads']} threads, parameters {r['parameters'] or 'defaults'}",
            f"wall {r['wall_s']:.0f} s ({r['s_per_block']:.1f} s per block, loading and writing "
            f"included); peak RSS {r['peak_rss_gb']:.2f} GB (polled {r['polled_rss_gb']:.2f}); "
            f"dry-run: {r['estimate_line']}; output {r['output_gb']:.1f} GB; "
            f"load average {r['load']:.1f}",
            f"torch {torch.__version__}, transformers {transformers.__version__}, Python "
            f"{platform.python_version()}",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models-dir", default=DEFAULT_MODELS_DIR)
    parser.add_argument("--blocks", default="auto", help="'auto' or a number of blocks (1-32)")
    parser.add_argument("--margin-gb", type=float, default=10.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--parameter", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--build-only", action="store_true")
    parser.add_argument("--cleanup", action="store_true")
    parser.add_argument("--json", help="also write the record here")
    args = parser.parse_args()
    if args.cleanup:
        if os.path.isfile(os.path.join(args.models_dir, MARKER)):
            shutil.rmtree(args.models_dir)
        return
    own_folder(args.models_dir)
    if args.blocks == "auto":
        blocks = blocks_that_fit(args.models_dir, args.margin_gb)
        print(f"blocks that fit on disk: {blocks} of 32", flush=True)
    else:
        blocks = int(args.blocks)
    if blocks < 1:
        sys.exit("not enough free disk for one block; free space or pass --models-dir")
    build(args.models_dir, blocks)
    if args.build_only:
        return
    import yaml

    extra = {k: yaml.safe_load(v) for k, v in (p.split("=", 1) for p in args.parameter)}
    record = merge(args.models_dir, args.threads, extra)
    print(report(record))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
