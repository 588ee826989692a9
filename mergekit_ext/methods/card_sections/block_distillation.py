"""Block-wise distillation's card section: CoM's per-group summary (the start) and the
per-block errors before and after the distillation steps."""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import partial
from typing import Any

from mergekit_ext.methods.card_sections.least_squares import plot_layerwise, summarize_layerwise
from mergekit_ext.methods.registry import MethodReport
from mergekit_ext.plots import as_float


def summarize_distillation(section: Mapping[str, Any], parameters: Any = None) -> dict[str, Any]:
    summary = summarize_layerwise(section, parameters)
    blocks = [b for b in section.get("blocks") or [] if isinstance(b, Mapping)]
    before = [as_float(b.get("error_before")) for b in blocks]
    after = [as_float(b.get("error_after")) for b in blocks]
    worst = max(
        (b for b in blocks if math.isfinite(as_float(b.get("error_after")))),
        key=lambda b: as_float(b.get("error_after")),
        default=None,
    )
    summary["distillation"] = {
        "blocks": len(blocks),
        "refined": sum(1 for b in blocks if b.get("kept") == "refined"),
        # the later blocks' steps (the first may take more: distill_first_block_factor)
        "steps": int(blocks[-1].get("steps") or 0) if blocks else 0,
        "first_steps": int(blocks[0].get("steps") or 0) if blocks else 0,
        # the tensors before the first block trained with it (distill_embeddings)
        "embeddings": sorted((blocks[0].get("pre_block") or {}) if blocks else []),
        # older records have no target: theirs was the merged path's
        "target": next((b.get("target") for b in blocks if b.get("target")), "merged_path"),
        # older records have no token weight: theirs weighed tokens by their energy
        "token_weight": next(
            (b.get("token_weight") for b in blocks if b.get("token_weight")), "energy"
        ),
        # tensors the norm limit (distill_max_norm_ratio) held back in a kept block
        "limited": sum(
            len(b.get("norm_limited") or {}) for b in blocks if b.get("kept") == "refined"
        ),
        # kept blocks whose result is a measured point before the last step (distill_checkpoints)
        "earlier": sum(
            1
            for b in blocks
            if b.get("kept") == "refined"
            and int(b.get("best_step", b.get("steps")) or 0) < int(b.get("steps") or 0)
        ),
        "error_before": sum(before) / len(before) if before else math.nan,
        "error_after": sum(after) / len(after) if after else math.nan,
        "worst": (
            {"layer": worst.get("layer"), "error": as_float(worst.get("error_after"))}
            if worst is not None
            else None
        ),
    }
    return summary


def distillation_report(section_name: str, title: str) -> MethodReport:
    return MethodReport(
        title,
        summarize_distillation,
        partial(plot_layerwise, section_name, title),
        template="block_distillation",
    )
