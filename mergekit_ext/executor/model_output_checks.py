"""What the whole-model path needs checked before anything loads: support and memory.

The plan (:mod:`mergekit_ext.executor.plan`) asks these when a method's request carries
``model_output``; the whole-model executor (:mod:`mergekit_ext.executor.model_output`) runs
after them. Kept apart from both so that the plan does not import the executor that runs it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from mergekit_ext.errors import MergekitExtError, NotSupportedError
from mergekit_ext.memory_model import (
    GIB,
    MemoryParts,
    activation_bytes,
    available_memory_bytes,
)
from mergekit_ext.methods.layerwise import LayerwiseMethod, ModelOutputRequest, StatisticsRequest
from mergekit_ext.models.checkpoint import HEAD_PREFIX
from mergekit_ext.models.families import ModelFamily

LOG = logging.getLogger(__name__)

# Sketch rows whose vector-Jacobian products run as one batched backward pass.
VJP_CHUNK = 32


class ModelOutputMemoryError(MergekitExtError, MemoryError):
    """The whole-model path would not fit the available memory."""


def check_model_output_supported(
    family: ModelFamily, method: str, request: ModelOutputRequest
) -> None:
    """Refuse what the whole-model path does not implement, before anything loads."""
    if family.fused_experts:
        raise NotSupportedError(
            f"{method}: objective: model_output does not fit mixture-of-experts experts "
            f"({family.name}): the whole-model fit walks linear layers one at a time and the "
            "routed experts are one 3-D tensor per block; use objective: layer_output (each "
            "expert solved on the tokens routed to it), regmean or chain_of_merges"
        )
    if family.table_readers:
        raise NotSupportedError(
            f"{method}: objective: model_output does not fit {', '.join(family.table_readers)} "
            f"({family.name}): each also reads the relative position table that every block "
            "shares (DeBERTa-v3's relative attention), whose perturbation mixes the samples of "
            "a batch, and the model-output fit needs each sample's own Jacobian; use "
            "objective: layer_output, regmean or chain_of_merges (docs/methods.md, "
            "'Relative position tables')"
        )
    if family.causal_lm and request.sketch_rows == 0:
        raise NotSupportedError(
            f"{method}: output_sketch: 0 (every output coordinate) is not available for causal "
            f"language models ({family.name} family): it would take one backward pass per "
            "vocabulary entry; use output_sketch >= 1 (next tokens sampled per position)"
        )


# ------------------------------------------------------------------------------------------
# Memory


class ModelOutputMemory(MemoryParts):
    """The whole-model path's peak memory by part."""


class MergePlan(Protocol):
    """What the estimates below read of :class:`mergekit_ext.executor.plan.MergePlan`, named
    here because the plan calls them: importing it back, even for its type, would close a
    circle (tests/test_architecture_rules.py)."""

    method: LayerwiseMethod
    request: StatisticsRequest
    family: ModelFamily
    base: Any  # a ModelSource or LoraModelSource: shapes, config
    experts: Sequence[Any]  # plan.Expert: the loaded calibration data
    blocks: Sequence[Any]  # plan.BlockLayout: the linear shapes
    hidden_size: int


def _output_width(plan: MergePlan, tokens: str, positions: int) -> int:
    return plan.hidden_size * (1 if tokens == "first" else positions)


def estimate_model_output_memory(plan: MergePlan) -> ModelOutputMemory:
    """Peak bytes of the whole-model path, from the plan (checkpoint headers, data).

    - ``merged_model``, ``expert_model``: the backbone in float32, twice (the merged model,
      and one expert's while its targets are computed);
    - ``targets``: every task's expert outputs (float32);
    - ``batch_graph``: one batch's forward graph (Korthikanti et al. 2022, as SyMerge's
      estimate) and its vector-Jacobian products (``P x B x T x m``, float32 and float64);
    - ``solve``: the widest linear's base, updates and dense ``mK x mK`` system (float64:
      the sums, the regularised copy and the factorisation/eigenvalue work, ≈ 4 copies).
    """
    request = plan.request.model_output
    assert request is not None
    base = plan.base
    backbone = sum(
        math.prod(int(d) for d in s)
        for n, s in base.shapes.items()
        if not n.startswith(HEAD_PREFIX)
    )
    k = len(plan.experts)
    widest = (0, 0)  # (out, in) of the linear with the largest m
    for block in plan.blocks[:1]:
        for group in block.groups:
            for module in group.modules:
                widest = max(widest, block.linear_shape(group, module, base.shapes))
    out_dim, in_dim = widest
    samples = positions = batch = 0
    for e in plan.experts:
        if e.data is None:
            continue
        for b in e.data.batches:
            key = "input_ids" if "input_ids" in b else "pixel_values"
            samples += int(b[key].shape[0])
            batch = max(batch, int(b[key].shape[0]))
        positions = max(positions, int(e.data.num_tokens / max(e.data.num_samples, 1)) + 1)
    causal = plan.family.causal_lm
    config = base.config.to_dict()
    if causal:  # every position's next-token log-probabilities; P sampled rows + the gradient
        width = positions * int(config.get("vocab_size") or 32000)
        rows = request.sketch_rows + 1
    else:
        width = _output_width(plan, request.tokens, positions)
        rows = request.sketch_rows or width
    graph = activation_bytes(config, positions, batch, causal_lm=causal)
    vjp = min(rows, VJP_CHUNK) * batch * positions * max(out_dim, plan.hidden_size) * 4 * 3
    design = batch * rows * out_dim * k * 8 * 2
    parts = {
        "merged_model": 4 * backbone,
        "expert_model": 4 * backbone,
        "targets": 4 * samples * width,
        "batch_graph": graph + vjp + design,
        "solve": 8 * ((k + 1) * out_dim * in_dim + 4 * (out_dim * k) ** 2),
    }
    return ModelOutputMemory(parts)


def check_model_output_memory(plan: MergePlan, device: torch.device) -> ModelOutputMemory:
    """Refuse when the estimate exceeds the memory available on ``device``."""
    estimate = estimate_model_output_memory(plan)
    available = available_memory_bytes(str(device))
    if estimate.total > available:
        raise ModelOutputMemoryError(
            f"{plan.method.name} with the model-output objective holds the whole model: it "
            f"needs about {estimate.describe()} on {device} but only {available / GIB:.2f} GiB "
            "is available; use fewer calibration samples, a smaller output_sketch, another "
            "device (--device cuda), or objective: layer_output (streamed block by block)"
        )
    LOG.info(
        "model-output memory estimate %s; %.2f GiB available", estimate.describe(), available / GIB
    )
    return estimate
