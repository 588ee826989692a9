"""Memory sizes shared by the estimates of the whole-model paths (SyMerge's adaptation,
QP's model-output objective): training activations of a transformer and the memory free
on a device. A low layer: the executor and ``adaptation/`` both import it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

FLOAT32 = 4
GIB = 2**30


def _config_value(config: Mapping[str, Any], key: str, default: int) -> int:
    if config.get(key) is not None:
        return int(config[key])
    for sub in ("text_config", "vision_config"):
        if isinstance(config.get(sub), Mapping) and config[sub].get(key) is not None:
            return int(config[sub][key])
    return default


def activation_bytes(
    config: Mapping[str, Any],
    seq_len: int,
    batch_size: int,
    causal_lm: bool,
    logit_rows: Optional[int] = None,
) -> int:
    """Training activations of one batch (float32), after Korthikanti et al. (2022).

    A causal LM holds its logits, their softmax and gradient for ``batch_size × seq_len``
    positions, or for ``logit_rows`` positions at a time when the loss is chunked.
    """
    hidden = _config_value(config, "hidden_size", 768)
    layers = _config_value(config, "num_hidden_layers", 12)
    heads = _config_value(config, "num_attention_heads", 12)
    per_layer_16bit = 34 * seq_len * batch_size * hidden + 5 * heads * seq_len**2 * batch_size
    total = 2 * layers * per_layer_16bit
    if causal_lm:  # logits, their softmax and gradient
        positions = (
            batch_size * seq_len if logit_rows is None else min(logit_rows, batch_size * seq_len)
        )
        total += 3 * FLOAT32 * positions * _config_value(config, "vocab_size", 32000)
    return total


def available_memory_bytes(device: str = "cpu") -> int:
    """Free memory on ``device``: CUDA's free memory, else psutil (or /proc/meminfo)."""
    if device.startswith("cuda"):
        import torch

        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    if os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo", encoding="utf-8") as fp:
            for line in fp:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return 1 << 62  # unknown: do not refuse


@dataclass
class MemoryParts:
    """A memory estimate as named parts (bytes), summed."""

    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        items = ", ".join(f"{k} {v / GIB:.2f}" for k, v in self.parts.items())
        return f"{self.total / GIB:.2f} GiB ({items})"
