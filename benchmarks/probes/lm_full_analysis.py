"""Why data-aware merges fall behind summing on full fine-tunes (issue #51, lm_full suite).

    python -m benchmarks.probes.lm_full_analysis --threads 1 [--cache-dir DIR] [--losses] [--smoke]

Reads the lm_full suite's base and experts (built or reused as the suite builds them) and
prints, as Markdown:

1. the task vectors' geometry per tensor group (embeddings, norms, each projection): the
   group's share of the update energy, the mean pairwise cosine between experts, and the
   shared share ``||Σ τ_k||² / (K Σ ||τ_k||²)`` (1: one common direction, 1/K: orthogonal
   updates of equal size), and the mean pairwise cosine per block;
2. with ``--losses``, held-out losses (the suite's scoring, kept share of each expert's
   gain) of merges built here tensor by tensor, to tell which tensors carry the gap:
   summing the projections with the experts' mean on everything else (what RegMean and CoM
   do with ``fallback: mean``) and the reverse, and each expert's own task vector scaled
   by 2 (whether the experts are short of their optimum along their own update).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import sys
from collections import defaultdict
from collections.abc import Callable
from typing import Optional

import torch
from safetensors.torch import load_file

from benchmarks.suites.cache import default_cache_dir
from benchmarks.suites.lm_full_suite import LMFullSuite
from benchmarks.suites.lm_suite import _tokenizer
from benchmarks.suites.run import configure_process, reference_scores

GROUPS = (
    ("embed_tokens", r"embed_tokens|lm_head"),
    ("norms", r"norm\.weight$"),
    ("q_proj", r"q_proj"),
    ("k_proj", r"k_proj"),
    ("v_proj", r"v_proj"),
    ("o_proj", r"o_proj"),
    ("gate_proj", r"gate_proj"),
    ("up_proj", r"up_proj"),
    ("down_proj", r"down_proj"),
)
PROJECTION = re.compile(r"(q|k|v|o|gate|up|down)_proj\.weight$")


def group_of(name: str) -> str:
    return next((g for g, pattern in GROUPS if re.search(pattern, name)), "other")


def geometry(base: dict[str, torch.Tensor], experts: list[dict[str, torch.Tensor]]) -> str:
    k = len(experts)
    energy: dict[str, float] = defaultdict(float)
    summed: dict[str, float] = defaultdict(float)
    dots: dict[tuple[str, int, int], float] = defaultdict(float)
    norms: dict[str, list[float]] = defaultdict(lambda: [0.0] * k)
    per_block: dict[int, list[float]] = defaultdict(list)
    for name, b in base.items():
        taus = [e[name].double() - b.double() for e in experts]
        g = group_of(name)
        for i, t in enumerate(taus):
            sq = float(t.pow(2).sum())
            energy[g] += sq
            norms[g][i] += sq
        summed[g] += float(torch.stack(taus).sum(0).pow(2).sum())
        for i, j in itertools.combinations(range(k), 2):
            dots[(g, i, j)] += float((taus[i] * taus[j]).sum())
        block = re.search(r"layers\.(\d+)\.", name)
        if block and PROJECTION.search(name):
            flat = [t.flatten() for t in taus]
            cos = [
                float(torch.nn.functional.cosine_similarity(flat[i], flat[j], dim=0))
                for i, j in itertools.combinations(range(k), 2)
            ]
            per_block[int(block.group(1))].append(sum(cos) / len(cos))
    total = sum(energy.values())
    lines = [
        "| tensors | share of update energy % | mean pairwise cosine | shared share "
        f"(1/K = {1 / k:.2f}: orthogonal) |",
        "|---|---|---|---|",
    ]
    for g in [*dict(GROUPS), "other"]:
        if energy.get(g, 0.0) == 0.0:
            continue
        pairs = list(itertools.combinations(range(k), 2))
        cosine = sum(dots[(g, i, j)] / (norms[g][i] * norms[g][j]) ** 0.5 for i, j in pairs)
        lines.append(
            f"| {g} | {100 * energy[g] / total:.1f} | {cosine / len(pairs):.3f} | "
            f"{summed[g] / (k * energy[g]):.3f} |"
        )
    lines += ["", "| block | mean pairwise cosine of the projections' task vectors |", "|---|---|"]
    for block in sorted(per_block):
        values = per_block[block]
        lines.append(f"| {block} | {sum(values) / len(values):.3f} |")
    return "\n".join(lines)


def merged_state(
    base: dict[str, torch.Tensor],
    experts: list[dict[str, torch.Tensor]],
    rule: Callable[[str], str],
) -> dict[str, torch.Tensor]:
    """Per tensor: ``rule(name)`` in ``sum`` (base + Σ τ) or ``mean``; rounded to bfloat16
    as the suite's merges are written."""
    out = {}
    for name, b in base.items():
        taus = torch.stack([e[name].float() - b.float() for e in experts])
        delta = taus.sum(0) if rule(name) == "sum" else taus.mean(0)
        out[name] = (b.float() + delta).to(torch.bfloat16)
    return out


def losses(suite: LMFullSuite, base_dir: str, state: dict[str, torch.Tensor], tasks) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    model.tie_weights()
    tok = _tokenizer(base_dir)
    return {t: suite._loss(model.eval(), tok, t) for t in tasks}


def solve_records(node: object) -> list[dict]:
    """Every least-squares group record (``layer`` and ``ridge`` fields) in a diagnostics JSON."""
    if isinstance(node, dict):
        if "layer" in node and "ridge" in node and "tasks" in node:
            return [node]
        return [r for v in node.values() for r in solve_records(v)]
    if isinstance(node, list):
        return [r for v in node for r in solve_records(v)]
    return []


def diagnostics_table(label: str, path: str) -> str:
    """Per projection kind: the ridge ``auto`` chose (and why, counted), and the mean relative
    output error over the blocks and tasks, from a merge's ``mergekit_ext_diagnostics.json``."""
    with open(path, encoding="utf-8") as fp:
        records = solve_records(json.load(fp))
    kinds: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        kinds[r["layer"].split(".")[-1]].append(r)
    lines = [
        f"{label}: {len(records)} solves",
        "",
        "| linears | ridge > 0 (of) | ridge reasons | condition number (median) | "
        "relative output error (mean over blocks and tasks) |",
        "|---|---|---|---|---|",
    ]
    for kind, recs in sorted(kinds.items()):
        reasons: dict[str, int] = defaultdict(int)
        for r in recs:
            reasons[re.sub(r"\d[\d.e+-]*", "#", str(r.get("ridge_reason")))[:90]] += 1
        errors = [
            t["relative_output_error"]
            for r in recs
            for t in r["tasks"].values()
            if t.get("relative_output_error") is not None
        ]
        conds = sorted(r["condition_number"] for r in recs if r.get("condition_number"))
        lines.append(
            f"| {kind} | {sum(1 for r in recs if (r.get('ridge') or 0) > 0)} ({len(recs)}) | "
            + "; ".join(f"{n}x {why}" for why, n in reasons.items())
            + f" | {conds[len(conds) // 2] if conds else float('nan'):.3g} | "
            + f"{sum(errors) / max(1, len(errors)):.4f} |"
        )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default=default_cache_dir())
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--losses", action="store_true", help="also score merges (minutes)")
    parser.add_argument("--smoke", action="store_true", help="the tiny random Llama suite")
    parser.add_argument(
        "--diagnostics",
        nargs="*",
        default=[],
        help="LABEL=MERGED_FOLDER: summarize a kept merge's least-squares solves (ridge, errors)",
    )
    args = parser.parse_args(argv)
    configure_process(args.threads)
    for item in args.diagnostics:
        label, folder = item.split("=", 1)
        print(diagnostics_table(label, os.path.join(folder, "mergekit_ext_diagnostics.json")))
        print()
    if args.diagnostics and not args.losses:
        return 0
    suite = LMFullSuite(args.cache_dir, smoke=args.smoke)
    base_dir, base_record = suite.base()
    experts = {t: suite.expert("full", t) for t in suite.tasks}
    base = load_file(os.path.join(base_dir, "model.safetensors"))
    states = [load_file(os.path.join(e.body, "model.safetensors")) for e in experts.values()]
    print("## Task vectors of the lm_full experts\n")
    print(geometry(base, states), flush=True)
    if not args.losses:
        return 0
    tasks = list(experts)
    # the references as run.py scores them (kept beside its runs: scored once)
    pre, exp, _ = reference_scores(
        suite, os.path.join(suite.root, "runs", "full"), base_dir, base_record, experts
    )

    def kept(scores: dict[str, float]) -> str:
        shares = [(pre[t] - scores[t]) / (pre[t] - exp[t]) for t in scores]
        cells = " | ".join(f"{scores[t]:.3f} ({100 * s:.1f})" for t, s in zip(scores, shares))
        return f"{cells} | {100 * sum(shares) / len(shares):.1f}"

    print("\n## Held-out loss (kept share of the expert's gain %)\n")
    print("| merge | " + " | ".join(tasks) + " | avg |\n" + "|---" * (len(tasks) + 2) + "|")
    # (summing or averaging everything: the table's task arithmetic λ=1 and linear rows)
    variants = {
        "sum projections, mean embeddings and norms": lambda n: (
            "sum" if PROJECTION.search(n) else "mean"
        ),
        "mean projections, sum embeddings and norms": lambda n: (
            "mean" if PROJECTION.search(n) else "sum"
        ),
    }
    for label, rule in variants.items():
        print(f"| {label} | {kept(losses(suite, base_dir, merged_state(base, states, rule), tasks))} |", flush=True)  # fmt: skip
    own = {}
    for (task, _), state in zip(experts.items(), states):
        scaled = {n: (b.float() + 2 * (state[n].float() - b.float())).to(torch.bfloat16) for n, b in base.items()}  # fmt: skip
        own[task] = losses(suite, base_dir, scaled, [task])[task]
    print(f"| each expert alone, its task vector x2 | {kept(own)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
