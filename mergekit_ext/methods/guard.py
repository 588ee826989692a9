"""The result guard of the layer-wise least-squares merges (RegMean, CoM, QP's layer objective).

A least-squares solve fits the calibration inputs; in the directions they barely span (a few
distinct tokens repeated, a chat template) it may return a weight far outside the experts'
range, which fits the calibration data and breaks the model on any other text. After each
group's solve the merged weights are compared with the experts': the Frobenius norm of each
merged linear over the largest expert's (``norm_ratio``), and, where the method measured it,
the relative output error on the calibration inputs. Beyond :data:`NORM_RATIO_WARN` (or
:data:`OUTPUT_ERROR_WARN`) a warning names the linear and the fixes; beyond the
``max_norm_ratio`` parameter (``.inf``: never) the merge stops before anything is written. The limits and the
measurements behind them are in ``docs/methods.md`` ("The result guard").

Pure tensor arithmetic: nothing here loads files or writes output.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from pydantic import Field

from mergekit_ext.errors import TensorError
from mergekit_ext.wide_sums import frobenius64

LOG = logging.getLogger(__name__)

# Healthy merges keep every linear within about 1.5x of the largest expert's norm (a
# least-squares merge is close to a data-weighted average of the experts); the broken merges
# of issue #27 reached 16x to 742x (docs/methods.md, "The result guard").
NORM_RATIO_WARN = 2.0
DEFAULT_MAX_NORM_RATIO = 10.0
# ‖W X − W_k X‖ / ‖W_k X‖ above 1: the merged layer's output on the calibration inputs is
# further from the expert's than zero is.
OUTPUT_ERROR_WARN = 1.0

FIXES = (
    "more varied calibration data (different texts, not one template repeated), a larger "
    "ridge (e.g. ridge: 0.01), or reduce_non_diagonal < 1 (e.g. 0.9)"
)


def max_norm_ratio_field() -> Any:
    """The ``max_norm_ratio`` parameter of the least-squares methods (one declaration)."""
    return Field(
        DEFAULT_MAX_NORM_RATIO,
        ge=1.0,
        description="the merge stops before writing when a merged linear's Frobenius norm "
        "exceeds this multiple of the largest expert's (a solve that left the experts' range; "
        f"healthy merges stay below ~1.5x); a warning from {NORM_RATIO_WARN:g}x; .inf: never "
        "stop (the warning stays)",
    )


def expert_norms(
    experts: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[str]
) -> dict[str, float]:
    """``max_k ‖W_k‖_F`` per weight name, in float64.

    Args:
        experts: one ``{weight name: W_k}`` per task.
        weights: the names to measure.

    Returns:
        ``{weight name: largest expert norm}``.
    """
    return {w: max(frobenius64(e[w]) for e in experts) for w in weights}


def norm_ratios(
    merged: Mapping[str, torch.Tensor], reference: Mapping[str, float]
) -> dict[str, float]:
    """``‖W‖_F / reference`` per weight, in float64 (inf for a non-zero weight over a zero
    reference, NaN for a weight with NaN entries).

    Args:
        merged: ``{weight name: merged weight}`` (as written).
        reference: ``{weight name: max_k ‖W_k‖_F}`` (:func:`expert_norms`).

    Returns:
        ``{weight name: ratio}``.
    """
    ratios = {}
    for name, w in merged.items():
        norm = frobenius64(w)
        ref = reference[name]
        ratios[name] = norm / ref if ref > 0.0 else (0.0 if norm == 0.0 else math.inf)
    return ratios


def guard_group(
    method: str,
    group: str,
    ratios: Mapping[str, float],
    max_norm_ratio: float,
) -> dict[str, Any]:
    """Check one group's merged weights against the experts' norms; warn or stop.

    Args:
        method: the method's name (for the message).
        group: the linear group's name.
        ratios: :func:`norm_ratios` of the group's merged weights (as written).
        max_norm_ratio: the hard limit (inf: never stop).

    Returns:
        The record for the group's diagnostics: ``norm_ratio`` (per weight),
        ``max_norm_ratio`` (the largest) and ``guard``: ``ok``, ``warned`` (above
        :data:`NORM_RATIO_WARN`) or ``allowed`` (above :data:`DEFAULT_MAX_NORM_RATIO`, let
        through by a larger ``max_norm_ratio``).

    Raises:
        TensorError: a ratio above ``max_norm_ratio`` (or NaN), naming the linear and the
            fixes; the runner then removes its unfinished output folder.
    """
    worst_name = max(ratios, key=lambda n: _order(ratios[n]))
    worst = ratios[worst_name]
    record: dict[str, Any] = {"norm_ratio": dict(ratios), "max_norm_ratio": worst, "guard": "ok"}
    if not worst <= max_norm_ratio:
        raise TensorError(
            f"{method}: the merged {worst_name} (linear group {group}) has {_x(worst)} the norm "
            f"of the largest expert's, above max_norm_ratio = {max_norm_ratio:g}: the solve "
            "left the experts' range (the calibration inputs span too few directions) and the "
            f"merged model would be broken, so nothing was written. Fix: {FIXES}; or set "
            'max_norm_ratio: .inf to write it anyway (docs/methods.md, "The result guard")'
        )
    if worst <= NORM_RATIO_WARN:
        return record
    LOG.warning(
        "%s: linear group %s is outside the experts' range: the merged %s has %s the norm of "
        'the largest expert\'s. Fix: %s (docs/methods.md, "The result guard")',
        method,
        group,
        worst_name,
        _x(worst),
        FIXES,
    )
    allowed = not worst <= DEFAULT_MAX_NORM_RATIO
    record["guard"] = "allowed" if allowed else "warned"
    return record


def warn_output_errors(method: str, group: str, errors: Mapping[str, float]) -> bool:
    """Warn when a task's relative output error on its calibration inputs is above
    :data:`OUTPUT_ERROR_WARN` (or not finite); returns whether it warned.

    Args:
        method: the method's name.
        group: the linear group's name.
        errors: ``{task: ‖W X − W_k X‖ / ‖W_k X‖}`` measured on the weights as written.
    """
    if not errors:
        return False
    task = max(errors, key=lambda t: _order(errors[t]))
    if errors[task] <= OUTPUT_ERROR_WARN:
        return False
    LOG.warning(
        "%s: linear group %s: on task %r's calibration inputs the merged output is off by %s "
        "of the expert's (more than the expert's output itself). Fix: %s "
        '(docs/methods.md, "The result guard")',
        method,
        group,
        task,
        f"{errors[task]:.3g}x",
        FIXES,
    )
    return True


def _order(value: float) -> float:
    """NaN sorts above everything (the worst)."""
    return math.inf if math.isnan(value) else value


def _x(ratio: float) -> str:
    return f"{ratio:.3g}x" if math.isfinite(ratio) else f"{ratio}x"
