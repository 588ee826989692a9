"""Where a merged causal LM's block-output error sits: by block, by token position (issue #51).

For each block ``l`` and task ``k`` it runs the merged model and expert ``k`` on task ``k``'s
texts, each on its own path (the residual stream after block ``l``: transformers'
``hidden_states[l + 1]``), and prints the relative error
``Σ ‖h_merged − h_k‖² / Σ ‖h_k‖²`` over the tokens, as the block-distillation record's
``error_before`` / ``error_after`` measure it (expert-path targets), split into the first
position (where causal LMs keep their "attention sink", a hidden state many times the norm
of the others) and the rest: whether an error that a block's steps cannot lower is carried by
one token or by all. Texts one at a time (no padding), float32. It reads the first
``--samples`` lines of each file, not the merge's seeded sample: the same texts where the file
holds no more lines than the merge's ``samples`` (the benchmark suites' calibration files:
64 lines, ``samples: 64``).

    python -m benchmarks.probes.block_error_by_position MERGED \\
        --expert TASK=DIR --texts TASK=FILE.jsonl [--field text] [--samples 64] \\
        [--max-length 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
from typing import Any


def _pairs(values: list[str], what: str) -> dict[str, str]:
    out = {}
    for v in values:
        name, sep, path = v.partition("=")
        if not sep:
            raise SystemExit(f"--{what} {v!r}: write TASK=PATH")
        out[name] = path
    return out


def _texts(path: str, field: str, samples: int) -> list[str]:
    texts = []
    with open(path, encoding="utf-8") as fp:
        for line in fp:
            if line.strip():
                texts.append(json.loads(line)[field])
            if len(texts) == samples:
                break
    return texts


def _states(model: Any, ids: Any) -> list[Any]:
    import torch

    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    return [h[0].double() for h in out.hidden_states[1:]]  # [T, H] per block output


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("merged")
    ap.add_argument("--expert", nargs="+", required=True, metavar="TASK=DIR")
    ap.add_argument("--texts", nargs="+", required=True, metavar="TASK=FILE")
    ap.add_argument("--field", default="text")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    experts, files = _pairs(args.expert, "expert"), _pairs(args.texts, "texts")
    if set(experts) != set(files):
        raise SystemExit(
            f"--expert names {sorted(experts)} and --texts names {sorted(files)} differ"
        )
    tokenizer = AutoTokenizer.from_pretrained(args.merged)
    load = dict(dtype=torch.float32)
    merged = AutoModelForCausalLM.from_pretrained(args.merged, **load).eval()
    n_blocks = merged.config.num_hidden_layers
    # per task and block: [Σ err² at position 0, Σ ‖h‖² at 0, Σ err² after 0, Σ ‖h‖² after 0]
    sums: dict[str, list[list[float]]] = {}
    for task, folder in experts.items():
        expert = AutoModelForCausalLM.from_pretrained(folder, **load).eval()
        acc = [[0.0] * 4 for _ in range(n_blocks)]
        for text in _texts(files[task], args.field, args.samples):
            ids = tokenizer(text, truncation=True, max_length=args.max_length, return_tensors="pt")
            hm, he = _states(merged, ids["input_ids"]), _states(expert, ids["input_ids"])
            for b, (m, e) in enumerate(zip(hm, he)):
                err, ref = (m - e).pow(2).sum(-1), e.pow(2).sum(-1)
                acc[b][0] += float(err[0])
                acc[b][1] += float(ref[0])
                acc[b][2] += float(err[1:].sum())
                acc[b][3] += float(ref[1:].sum())
        sums[task] = acc
        del expert
    rows = []
    print(
        "block | error (all tokens) | error, first position | error, the others | first "
        "position's share of ‖h‖² | its share of the error"
    )
    for b in range(n_blocks):
        per = [sums[t][b] for t in experts]
        total = sum((e0 + e1) / (r0 + r1) for e0, r0, e1, r1 in per) / len(per)
        first = sum(e0 / r0 for e0, r0, _, _ in per) / len(per)
        rest = sum(e1 / r1 for _, _, e1, r1 in per) / len(per)
        share_h = sum(r0 / (r0 + r1) for _, r0, _, r1 in per) / len(per)
        share_e = sum(e0 / max(e0 + e1, 1e-300) for e0, _, e1, _ in per) / len(per)
        rows.append(
            dict(
                block=b,
                error=total,
                first=first,
                rest=rest,
                first_share_h=share_h,
                first_share_error=share_e,
            )
        )
        print(f"{b} | {total:.4f} | {first:.4f} | {rest:.4f} | {share_h:.3f} | {share_e:.3f}")
    result = {
        "merged": args.merged,
        "samples": args.samples,
        "max_length": args.max_length,
        "blocks": rows,
    }
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fp:
            json.dump(result, fp, indent=1)
    return result


if __name__ == "__main__":
    main()
