"""Cost of the NaN/Inf check over a written merge, next to the cost of writing it.

``mergekit_ext.finite.check_output_finite`` reads every tensor a merge wrote once more. This
writes a synthetic checkpoint (float32 and bfloat16 shards of 2-D tensors) with
``safetensors`` and times, in one run and side by side, the write and the check; it prints
the ratio check / write.

    python -m benchmarks.probes.finite_check_cost [--mb 512] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from safetensors.torch import save_file

from mergekit_ext.finite import check_output_finite


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=512, help="checkpoint size in MB")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {args.mb} MB checkpoint, best of {args.repeats}")
    for dtype in (torch.float32, torch.bfloat16):
        element = torch.tensor([], dtype=dtype).element_size()
        side = 1024
        count = max(1, args.mb * 2**20 // (side * side * element))
        tensors = {
            f"layers.{i}.weight": torch.randn(side, side, generator=gen).to(dtype)
            for i in range(count)
        }
        writes, checks = [], []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as folder:
                started = time.perf_counter()
                save_file(tensors, os.path.join(folder, "model.safetensors"))
                writes.append(time.perf_counter() - started)
                started = time.perf_counter()
                checked = check_output_finite(folder)
                checks.append(time.perf_counter() - started)
        assert checked == count
        write, check = min(writes), min(checks)
        print(
            f"{str(dtype).removeprefix('torch.'):>9}: {count} tensors, write {write:.2f} s, "
            f"check {check:.2f} s, check/write = {check / write:.2f}"
        )


if __name__ == "__main__":
    main()
