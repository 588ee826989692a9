"""SyMerge's memory estimate, computed from checkpoint headers before any weight is loaded.

Float32 throughout (adaptation accumulates in float32 whatever the checkpoint dtype):

- the base θ_0 (P floats), K task vectors (K·P for full checkpoints; a LoRA expert keeps
  its factors and the tensors it saves whole), one merged copy and its gradient (2·P; with
  adapters only, of the tensors that are not a linear's LoRA update, which the layer adds to
  its output from the factors);
- the task layers with Adam (value, gradient, two moments, the expert's copy: 5 per float);
- training activations: per layer ``34·s·b·h + 5·a·s²·b`` bytes in 16-bit (Korthikanti et
  al., "Reducing Activation Recomputation in Large Transformer Models", 2022, eq. 1),
  doubled for float32, plus the output logits for language models;
- the cached teacher outputs (or one reconstructed expert when they are not cached).

It is an estimate (allocator overhead and framework buffers are not counted), used to refuse
clearly instead of swapping or being killed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from mergekit_ext.errors import MergekitExtError
from mergekit_ext.memory_model import (  # noqa: F401  (re-exported: SyMerge's estimate uses them)
    FLOAT32,
    GIB,
    MemoryParts,
    _config_value,
    activation_bytes,
    available_memory_bytes,
)
from mergekit_ext.models.model_paths import checkpoint_shapes

LOG = logging.getLogger(__name__)


class AdaptationMemoryError(MergekitExtError, MemoryError):
    """The adaptation would not fit the machine's available memory."""


def checkpoint_parameter_count(path: str) -> int:
    """Number of parameters in a checkpoint folder (safetensors headers, or the class of a
    folder with only a config.json)."""
    return sum(math.prod(shape) for shape in checkpoint_shapes(path).values())


def tokens_per_sample(config: Mapping[str, Any], modality: str, max_length: int) -> int:
    """Sequence length the model sees: text truncated to ``max_length``; ViT patches + CLS."""
    if modality == "image":
        image = _config_value(config, "image_size", 224)
        patch = _config_value(config, "patch_size", 16)
        return (image // max(patch, 1)) ** 2 + 1
    return min(max_length, _config_value(config, "max_position_embeddings", max_length))


class AdaptationMemory(MemoryParts):
    """SyMerge's peak memory by part (see the module docstring)."""


def adapter_floats(source: Any) -> int:
    """Floats a LoRA expert's task vector keeps: the factors ``r·(out + in)`` of each
    adapted weight and each tensor it saves whole (``LoraModelSource``, headers only)."""
    total = 0
    for canonical, delta in source.deltas.items():
        if canonical not in source.replacements:
            rows, cols = source.shape(canonical)
            total += delta.rank * (rows + cols)
    return total + sum(math.prod(source.shape(c)) for c in source.replacements)


def changed_parameters(base_parameters: int, adapters: Sequence[Any]) -> int:
    """Parameters whose merged value is formed (a copy and a gradient each): all of them with
    any full checkpoint; with adapters only, the tensors some adapter saves whole and its
    embedding / ``fan_in_fan_out`` updates. A linear's LoRA update is added to its output
    from the factors instead (``TaskVectors.apply``)."""
    if any(source is None for source in adapters):
        return base_parameters
    changed = {
        c: math.prod(s.shape(c))
        for s in adapters
        for c in (
            *s.replacements,
            *(c for c, d in s.deltas.items() if d.module_type == "embedding" or d.fan_in_fan_out),
        )
    }
    return sum(changed.values())


def estimate_adaptation_memory(
    *,
    base_parameters: int,
    expert_parameters: Sequence[int],
    config: Mapping[str, Any],
    seq_len: int,
    batch_size: int,
    causal_lm: bool,
    teacher_cache_bytes: Optional[int],
    logit_rows: Optional[int] = None,
    task_vector_floats: Optional[Sequence[int]] = None,
    changed_parameters: Optional[int] = None,
) -> AdaptationMemory:
    """The peak memory of a SyMerge run (see the module docstring for the terms).

    ``teacher_cache_bytes`` None means the teacher runs per batch (one reconstructed expert).
    ``task_vector_floats`` (per expert) and ``changed_parameters`` default to full
    checkpoints' (``base_parameters`` each).
    """
    k = len(expert_parameters)
    layers = max(1, _config_value(config, "num_hidden_layers", 12))
    largest = max(expert_parameters, default=base_parameters)
    task_layer = max(largest - base_parameters, base_parameters // layers)
    parts = {
        "base": FLOAT32 * base_parameters,
        "task_vectors": FLOAT32
        * (k * base_parameters if task_vector_floats is None else sum(task_vector_floats)),
        "merged_copy_and_gradient": 2
        * FLOAT32
        * (base_parameters if changed_parameters is None else changed_parameters),
        "task_layers_adam": 5 * FLOAT32 * k * task_layer,
        "activations": activation_bytes(config, seq_len, batch_size, causal_lm, logit_rows),
        "teacher": teacher_cache_bytes if teacher_cache_bytes is not None else FLOAT32 * largest,
    }
    return AdaptationMemory(parts)


def check_memory(estimate: AdaptationMemory, available: int, *, force: bool, device: str) -> None:
    """Refuse (unless ``force``) when the estimate exceeds the available memory."""
    if estimate.total <= available:
        LOG.info(
            "SyMerge memory estimate %s; %.2f GiB available", estimate.describe(), available / GIB
        )
        return
    message = (
        f"symerge needs about {estimate.describe()} on {device} but only "
        f"{available / GIB:.2f} GiB is available"
    )
    if force:
        LOG.warning("%s; continuing because force=True", message)
        return
    raise AdaptationMemoryError(
        message + ": use fewer or smaller experts, a smaller batch_size or max_length, another "
        "device (--device cuda), or pass --force (force=True) to try anyway"
    )
