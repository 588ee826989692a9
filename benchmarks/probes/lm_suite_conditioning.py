"""Condition numbers of the LM suite's calibration Grams: would ``ridge: auto`` regularise them?

``ridge: auto`` (docs/methods.md, "ridge: auto") leaves a least-squares group unregularised
when the condition number of ``Σ_k G_k`` is at most 1e6. This script runs the LM suite's base
(SmolLM2-135M-Instruct, all 30 blocks, float32) on the LM suite's calibration texts (64 per
task, 64 tokens, three tasks, as ``benchmarks/suites/lm_suite.py`` builds them) and reports, per
linear group kind, the condition number of the base model's ``Σ_k G_k`` (each task's mean
Gram of the group's inputs, float64): the expert-path Grams of RegMean up to the experts'
small LoRA updates. It does not merge.

    python -m benchmarks.probes.lm_suite_conditioning [--cache-dir DIR] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any, Optional

import torch

from benchmarks.suites.cache import default_cache_dir
from benchmarks.suites.lm_suite import LMSuite

LIMIT = 1e6
GROUPS = {
    "qkv": "self_attn.q_proj",
    "o_proj": "self_attn.o_proj",
    "gate_up": "mlp.gate_proj",
    "down_proj": "mlp.down_proj",
}


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache-dir", default=default_cache_dir())
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    args = parser.parse_args(argv)
    import json

    import transformers

    suite = LMSuite(args.cache_dir, False)
    base, _ = suite.base()
    tok = transformers.AutoTokenizer.from_pretrained(base)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    grams: dict[str, list[torch.Tensor]] = {}
    current: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    mask: list[torch.Tensor] = []

    def hook(name: str) -> Any:
        def record(_m: Any, inputs: tuple[torch.Tensor, ...], _o: Any) -> None:
            x = inputs[0][mask[0]].double()
            current[name] = current.get(name, 0) + x.T @ x
            counts[name] = counts.get(name, 0) + x.shape[0]

        return record

    for i, layer in enumerate(model.model.layers):
        for kind, path in GROUPS.items():
            module = layer.get_submodule(path)
            module.register_forward_hook(hook(f"{i}.{kind}"))
    for task in suite.default_tasks:
        spec = suite.calibration(task)
        texts = [json.loads(line)["text"] for line in open(spec["path"], encoding="utf-8")]
        current.clear()
        counts.clear()
        with torch.no_grad():
            for start in range(0, len(texts), 8):
                enc = tok(
                    texts[start : start + 8],
                    return_tensors="pt",
                    padding=True,
                    truncation=True,
                    max_length=spec["max_length"],
                )
                mask[:] = [enc["attention_mask"].bool()]
                model(**enc)
        for name, g in current.items():
            grams.setdefault(name, []).append(g / counts[name])
    rows = []
    for name, per_task in grams.items():
        total = sum(per_task)
        eigenvalues = torch.linalg.eigvalsh(0.5 * (total + total.T))
        cut = eigenvalues.numel() * torch.finfo(torch.float64).eps * float(eigenvalues.abs().max())
        smallest = float(eigenvalues.abs().min())
        cond = math.inf if smallest <= cut else float(eigenvalues.abs().max()) / smallest
        rows.append((name, cond))
    over = [r for r in rows if not r[1] <= LIMIT]
    lines = [
        "# LM suite: condition numbers of the calibration Grams (base model)",
        "",
        f"Command: `python -m benchmarks.probes.lm_suite_conditioning {' '.join(argv or sys.argv[1:])}`",
        "",
        f"{len(rows)} linear groups (30 blocks x 4); above {LIMIT:g} (where `ridge: auto` "
        f"regularises): {len(over)}.",
        "",
        "| group kind | min | median | max | groups above 1e6 |",
        "|---|---|---|---|---|",
    ]
    for kind in GROUPS:
        conds = sorted(c for n, c in rows if n.endswith("." + kind))
        lines.append(
            f"| {kind} | {conds[0]:.3g} | {conds[len(conds) // 2]:.3g} | {conds[-1]:.3g} | "
            f"{sum(1 for c in conds if not c <= LIMIT)} |"
        )
    if over:
        lines += ["", "Above the limit: " + ", ".join(f"`{n}` ({c:.3g})" for n, c in over)]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "lm_suite_conditioning.md"), "w", encoding="utf-8") as fp:
        fp.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
