"""The first linears of a QP model-output merge: the exact output error after each one.

    python -m benchmarks.probes.qp_model_output_probe CONFIG.yml --linears 8 \\
        --variant exact sketched --out benchmarks/results/qp_model_output_lm_probe.md

A whole merge of a causal LM with ``objective: model_output`` takes an hour on a CPU; this
runs the merge of CONFIG (a ``qp_projection`` YAML, e.g. one the LM sweep wrote) over its
first ``--linears`` linears only (the rest stay at the base; the output is discarded) and
tabulates, per linear, the exact error of the model before it is merged (the per-token KL to
the experts for a causal LM) and the range of its coefficients ``d``, so that a variant that
drifts away from the experts shows within minutes. Variants:

- ``exact``: the objective as shipped (the linear term is the KL's exact gradient);
- ``sketched``: the linear term from the sampled residuals ``1 − p_t(y)/p(y)`` as well
  (consistent with the sketched matrix, but heavy-tailed);
- ``box``: ``exact`` with ``bounds: [0, 1]``.

One torch thread (``--threads``); variants run one after the other.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from typing import Any, Optional

import torch
import yaml

VARIANTS = ("exact", "sketched", "box")


def run_variant(config: dict[str, Any], variant: str, linears: int) -> dict[str, Any]:
    from mergekit.options import MergeOptions

    from mergekit_ext.config import parse_config
    from mergekit_ext.executor import model_output, run_layerwise_merge
    from mergekit_ext.methods.registry import ext_method_info

    config = yaml.safe_load(yaml.safe_dump(config))
    if variant == "box":
        config.setdefault("parameters", {})["bounds"] = [0, 1]
    sketch = model_output.next_token_sketch
    merge_linear = model_output.ModelOutputExecutor._merge_linear

    def first_linears_only(self, index, *args, **kwargs):
        if index < linears:  # the later linears stay at the base
            merge_linear(self, index, *args, **kwargs)

    try:
        if variant == "sketched":
            model_output.next_token_sketch = lambda *a, **k: (*sketch(*a, **k)[:2], None)
        model_output.ModelOutputExecutor._merge_linear = first_linears_only
        cfg = parse_config(yaml.safe_dump(config))
        method = ext_method_info("qp_projection").implementation
        with tempfile.TemporaryDirectory() as out:
            return run_layerwise_merge(
                cfg, os.path.join(out, "merged"), MergeOptions(quiet=True), method, cfg.parameters
            ).diagnostics
    finally:
        model_output.next_token_sketch = sketch
        model_output.ModelOutputExecutor._merge_linear = merge_linear


def table(results: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| variant | linear | error before | d min | d mean | d max |",
        "|---|---|---|---|---|---|",
    ]
    for variant, result in results.items():
        for layer in result["layers"]:
            for name, record in layer["weights"].items():
                stats = record["d_stats"].values()
                lines.append(
                    f"| {variant} | {name} | {record['output_error_before']:.2f} | "
                    f"{min(s['min'] for s in stats):.2f} | "
                    f"{sum(s['mean'] for s in stats) / len(stats):.3f} | "
                    f"{max(s['max'] for s in stats):.2f} |"
                )
        section = result["model_output"]
        lines.append(
            f"| {variant} | (after the last fitted linear) | {section['output_error_final']:.2f} "
            "| | | |"
        )
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a qp_projection YAML with objective: model_output")
    parser.add_argument("--linears", type=int, default=8)
    parser.add_argument("--variant", nargs="+", choices=VARIANTS, default=["exact"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="Markdown file to write (default: print)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with open(args.config, encoding="utf-8") as fp:
        config = yaml.safe_load(fp)
    results = {v: run_variant(config, v, args.linears) for v in args.variant}
    import mergekit_ext

    lines = [
        f"### QP model output: the first {args.linears} linears",
        "",
        "Error before: the exact output error of the model before that linear is merged "
        "(causal LM: Σ_t (1/N_t) Σ_j Σ_τ KL(p_t ‖ p)); d: that linear's coefficients over its "
        "rows and tasks.",
        "",
        *table(results),
        "",
        "Command: `python -m benchmarks.probes.qp_model_output_probe "
        + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
        + "`  ",
        f"Versions: mergekit-ext {mergekit_ext.__version__}, torch {torch.__version__}",
        "",
    ]
    text = "\n".join(lines)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fp:
            fp.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
