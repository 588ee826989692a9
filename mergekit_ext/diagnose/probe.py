"""What ``diagnose`` checks beyond the held-out rows: generic text, the data's diversity, the
merge's own record.

A merge fitted on one chat template can look fine on held-out rows of the same template and
be broken on any other text (issue #50). Three checks catch it:

- **the off-distribution probe**: a few dozen short English paragraphs on unrelated topics,
  shipped with the package (``data/generic_prose.jsonl``, written for this purpose and under
  the package's license), run through each task's expert and every compared model like the
  task's own data. Text models only: a vision model has no generic image set here, and the
  result says the probe was not run;
- **the data's diversity**: few distinct tokens, or samples that are mostly one template
  (a prefix and suffix every sample shares), give a warning;
- **the merge's record**: the guard warnings a least-squares merge wrote into
  ``mergekit_ext_diagnostics.json`` (a linear outside the experts' range, an output error above
  the expert's output) are read back, and a merge that has one never gets a positive verdict.

Thresholds and what they mean: ``docs/methods.md``, "Diagnose".
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any, Optional

import torch

from mergekit_ext import merge_record
from mergekit_ext.calibration.config import CalibrationSpec
from mergekit_ext.calibration.sources import CalibrationData, load_calibration
from mergekit_ext.methods.guard import NORM_RATIO_WARN, OUTPUT_ERROR_WARN

PROBE_PATH = os.path.join(os.path.dirname(__file__), "data", "generic_prose.jsonl")
PROBE_NAME = "generic English prose (shipped with mergekit-ext)"
PROBE_SAMPLES = 48  # every paragraph of the file
PROBE_MAX_LENGTH = 96  # the longest paragraph is shorter in any common tokenizer

# A merged model whose mean KL to the experts on the probe is more than 1 / PROBE_REJECT times
# the base model's is broken outside its data: no positive verdict.
PROBE_REJECT = 0.5

# Diversity warnings: fewer distinct tokens than FEW_DISTINCT * sqrt(tokens) (natural text
# grows its vocabulary roughly as Heaps' law ~ K n^0.5-0.7 with K well above 2: 32k tokens of
# web text hold thousands of distinct tokens, the floor is 362; 60 texts of one template over
# six words hold 13 in 660 tokens, the floor 51), or a prefix + suffix common to every
# sample covering TEMPLATE_SHARE of the tokens (one template with a few words changed).
FEW_DISTINCT = 2.0
TEMPLATE_SHARE = 0.4


def probe_spec(batch_size: int = 8) -> CalibrationSpec:
    """The probe as calibration fields: every paragraph, plain text (no chat template)."""
    return CalibrationSpec(
        path=PROBE_PATH,
        field="text",
        samples=PROBE_SAMPLES,
        max_length=PROBE_MAX_LENGTH,
        batch_size=batch_size,
    )


def load_probe(
    task: str, tokenizer_path: str, batch_size: int, trust_remote_code: bool
) -> CalibrationData:
    """The probe tokenized with the task's tokenizer."""
    return load_calibration(
        probe_spec(batch_size),
        tokenizer_path,
        task=task,
        modality="text",
        trust_remote_code=trust_remote_code,
    )


def _rows(data: CalibrationData) -> list[list[int]]:
    rows = []
    for batch in data.batches:
        ids, mask = batch.get("input_ids"), batch.get("attention_mask")
        if ids is None:
            return []
        for r, m in zip(ids, mask if mask is not None else torch.ones_like(ids)):
            rows.append(r[m.bool()].tolist())
    return rows


def _common_prefix(rows: Sequence[Sequence[int]]) -> int:
    n = min(len(r) for r in rows)
    for i in range(n):
        if any(r[i] != rows[0][i] for r in rows):
            return i
    return n


def diversity_warnings(data: CalibrationData, what: str) -> list[str]:
    """Warnings when the samples have few distinct tokens or are mostly one template.

    Args:
        data: tokenized text data (other modalities: no warning).
        what: how the data is named in the warning, e.g. "task t0's calibration data".
    """
    rows = [r for r in _rows(data) if r]
    if len(rows) < 2:
        return []
    tokens = sum(len(r) for r in rows)
    distinct = len({t for r in rows for t in r})
    out = []
    if distinct < FEW_DISTINCT * math.sqrt(tokens):
        out.append(
            f"{what} has only {distinct} distinct tokens in {tokens}: a least-squares merge "
            "(RegMean, Chain of Merges, QP) fitted on it spans few directions and may break on "
            "other text; check the probe row, and use more varied data"
        )
    prefix = _common_prefix(rows)
    suffix = _common_prefix([r[::-1] for r in rows])
    shared = min(prefix + suffix, min(len(r) for r in rows))
    if len(rows) >= 4 and shared * len(rows) >= TEMPLATE_SHARE * tokens:
        out.append(
            f"{what} is mostly one template: every sample shares its first {prefix} and last "
            f"{suffix} tokens ({100 * shared * len(rows) / tokens:.0f} % of the tokens); "
            "held-out rows of the same template flatter a merge fitted on it, the probe does not"
        )
    return out


def record_warnings(folder: str) -> list[str]:
    """The guard warnings in a merged folder's own record (``mergekit_ext_diagnostics.json``):
    linears outside the experts' range and layers whose output error on the calibration
    inputs was above the expert's output. Empty for a folder without a record."""
    try:
        record = merge_record.load(folder)
    except (OSError, ValueError):
        return []
    out = []
    for name, section in (record.get("sections") or {}).items():
        layers = section.get("layers") if isinstance(section, dict) else None
        if not isinstance(layers, list):
            continue
        ranged = [
            (layer.get("layer"), _float(layer.get("max_norm_ratio")))
            for layer in layers
            if isinstance(layer, dict) and layer.get("guard") in ("warned", "allowed")
        ]
        if ranged:
            worst = max(ranged, key=lambda r: _order(r[1]))
            out.append(
                f"its merge record ({name}) has {len(ranged)} linear group(s) outside the "
                f"experts' range (norm above {NORM_RATIO_WARN:g}× the largest expert's; worst "
                f"{worst[0]} at {_x(worst[1])})"
            )
        errors = []
        for layer in layers:
            for task, rec in ((layer or {}).get("tasks") or {}).items():
                value = _float((rec or {}).get("relative_output_error"))
                if value is not None and not value <= OUTPUT_ERROR_WARN:
                    errors.append((layer.get("layer"), task, value))
        if errors:
            worst_e = max(errors, key=lambda r: _order(r[2]))
            out.append(
                f"its merge record ({name}) has {len(errors)} layer output(s) further from the "
                f"expert's than the expert's output itself on the calibration inputs (worst "
                f"{worst_e[0]}, task {worst_e[1]}: {_x(worst_e[2])})"
            )
    return out


def _float(value: Any) -> Optional[float]:
    if value is None:
        return None
    try:
        return float(value)  # "inf" / "nan" as written by merge_record.jsonable
    except (TypeError, ValueError):
        return None


def _order(value: Optional[float]) -> float:
    if value is None:
        return -math.inf
    return math.inf if math.isnan(value) else value


def _x(value: Optional[float]) -> str:
    if value is None:
        return "?"
    return f"{value:.3g}×" if math.isfinite(value) else f"{value}×"
