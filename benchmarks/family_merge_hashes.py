"""SHA-256 of tiny data-aware merges of the four original families (llama, bert, vit, clip).

Run before and after a change of how the executor finds blocks and linear groups: the
merged bytes must not change. Usage::

    PYTHONPATH=$PWD python -m benchmarks.family_merge_hashes
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile

import numpy as np
import torch
import yaml
from mergekit.options import MergeOptions
from PIL import Image

from mergekit_ext import testing
from mergekit_ext.config import parse_config
from mergekit_ext.executor import run_layerwise_merge
from mergekit_ext.methods.registry import ext_method_info

BUILDERS = {
    "llama": (testing.make_tiny_llama, "text"),
    "bert": (testing.make_tiny_bert, "text"),
    "vit": (testing.make_tiny_vit, "image"),
    "clip_vision": (testing.make_tiny_clip_vision, "image"),
    "clip": (testing.make_tiny_clip, "image"),
}
METHODS = ("regmean", "chain_of_merges")


def _data(root: str, modality: str, k: int) -> str:
    rng = np.random.RandomState(k)
    if modality == "text":
        path = os.path.join(root, f"text{k}.jsonl")
        with open(path, "w", encoding="utf-8") as fp:
            for _ in range(6):
                words = rng.choice(testing.WORDS, size=rng.randint(2, 12))
                fp.write(json.dumps({"text": " ".join(words)}) + "\n")
        return path
    folder = os.path.join(root, f"images{k}")
    os.makedirs(folder, exist_ok=True)
    for i in range(6):
        Image.fromarray((rng.rand(20, 20, 3) * 255).astype("uint8")).save(
            os.path.join(folder, f"{i}.png")
        )
    return folder


def main() -> None:
    torch.set_num_threads(1)
    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as root:
        for name, (build, modality) in BUILDERS.items():
            base = build(os.path.join(root, name, "base"))
            experts = testing.make_experts(
                base, [os.path.join(root, name, f"e{i}") for i in range(2)]
            )
            for method in METHODS:
                models = [
                    {
                        "model": e,
                        "name": f"task{k}",
                        "calibration": {
                            "path": _data(root, modality, k),
                            "samples": 6,
                            "batch_size": 3,
                        },
                    }
                    for k, e in enumerate(experts)
                ]
                cfg = parse_config(
                    yaml.safe_dump({"merge_method": method, "base_model": base, "models": models})
                )
                dest = os.path.join(root, name, method)
                info = ext_method_info(method)
                run_layerwise_merge(
                    cfg, dest, MergeOptions(quiet=True), info.implementation, cfg.parameters
                )
                digest = hashlib.sha256()
                for f in sorted(os.listdir(dest)):
                    if f.endswith(".safetensors"):
                        with open(os.path.join(dest, f), "rb") as fp:
                            digest.update(fp.read())
                out[f"{name}/{method}"] = digest.hexdigest()
                print(f"{name}/{method}: {out[f'{name}/{method}']}", flush=True)
    json.dump(out, sys.stdout if len(sys.argv) < 2 else open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
