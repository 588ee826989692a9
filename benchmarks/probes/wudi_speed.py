"""Speed of WUDI's per-weight optimisation, ours against a transcription of the authors' loop.

Times, on one ``out x in`` weight with K random task vectors and the same Adam settings:

- ``ours``: :func:`mergekit_ext.methods.wudi.wudi_merge_tensor` (float64 ``A, B, c`` once, then
  one ``(out x in)(in x in)`` product per step, or two thin ones when ``A`` is low-rank);
- ``authors``: their loop, ``torch.optim.Adam`` with autograd through the ``K`` products
  ``(τ − τ_k) τ_kᵀ`` (``out x out`` each) per step;

for full-rank task vectors and for LoRA-like ones (rank ``--lora-rank`` each), and prints the
largest difference between the two results. Wall times on a shared machine include other
jobs; the CPU times (``process_time``, one thread) are this process's own. Usage::

    OMP_NUM_THREADS=1 python -m benchmarks.probes.wudi_speed            # 384 x 384, K=3, 1000 steps
    OMP_NUM_THREADS=1 python -m benchmarks.probes.wudi_speed --out 1536 --in 384 --steps 300
"""

from __future__ import annotations

import argparse
import time

import torch

from mergekit_ext.methods.wudi import wudi_merge_tensor


def authors_loop(vectors: torch.Tensor, steps: int, lr: float) -> torch.Tensor:
    """The authors' per-weight loop (``get_redundant_task_vector``), on the CPU."""
    merging_vector = torch.nn.Parameter(torch.sum(vectors, dim=0))
    optimizer = torch.optim.Adam([merging_vector], lr=lr, weight_decay=0)
    l2_norms = torch.square(torch.norm(vectors.reshape(vectors.shape[0], -1), p=2, dim=-1))
    for _ in range(steps):
        disturbing_vectors = merging_vector.unsqueeze(0) - vectors
        inner_product = torch.matmul(disturbing_vectors, vectors.transpose(1, 2))
        loss = torch.sum(torch.square(inner_product) / l2_norms.unsqueeze(-1).unsqueeze(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return merging_vector.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=int, default=384, dest="out_dim")
    parser.add_argument("--in", type=int, default=384, dest="in_dim")
    parser.add_argument("--experts", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(args.seed)
    shape = (args.out_dim, args.in_dim)
    base = torch.randn(*shape, generator=g)
    cases = {
        "full-rank": [0.01 * torch.randn(*shape, generator=g) for _ in range(args.experts)],
        f"LoRA rank {args.lora_rank}": [
            0.01
            * torch.randn(args.out_dim, args.lora_rank, generator=g)
            @ torch.randn(args.lora_rank, args.in_dim, generator=g)
            / args.lora_rank**0.5
            for _ in range(args.experts)
        ],
    }
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), weight {shape}, "
        f"K={args.experts}, {args.steps} Adam steps at lr {args.lr}, float32"
    )
    for label, taus in cases.items():
        experts = [base + t for t in taus]
        start, cpu = time.perf_counter(), time.process_time()
        merged, diag = wudi_merge_tensor(base, experts, steps=args.steps, lr=args.lr)
        ours, ours_cpu = time.perf_counter() - start, time.process_time() - cpu
        vectors = torch.stack([e - base for e in experts])
        start, cpu = time.perf_counter(), time.process_time()
        reference = base + authors_loop(vectors, args.steps, args.lr)
        theirs, theirs_cpu = time.perf_counter() - start, time.process_time() - cpu
        diff = float((merged - reference).abs().max())
        scale = float((merged - base).abs().max())
        print(
            f"{label:>14}: ours {ours:6.2f} s wall / {ours_cpu:6.2f} s CPU (rank of A {diag.rank}, "
            f"loss reduction {diag.relative_reduction:.3f}) | authors' loop {theirs:6.2f} s wall / "
            f"{theirs_cpu:6.2f} s CPU | speed-up (CPU) {theirs_cpu / ours_cpu:5.1f}x | "
            f"max |difference| {diff:.2e} (max |τ| {scale:.2e})"
        )


if __name__ == "__main__":
    main()
