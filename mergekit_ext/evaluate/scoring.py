"""Accuracy of a classifier on labelled inputs: the scoring of the benchmark suites
(``benchmarks/suites/text_suite.py``, ``vision_suite.py``) and of ``mergekit-ext eval --data``,
written once. Pure functions over a ``logits_of`` callable, so the caller decides which body
and which head produce the logits."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch


@torch.no_grad()
def text_accuracy(
    logits_of: Callable[[Any], torch.Tensor],
    texts: Sequence[str],
    labels: Sequence[int],
    tokenizer: Any,
    *,
    max_length: int,
    batch_size: int,
) -> float:
    """Share of ``texts`` whose argmax logit is the label. Texts of similar length are
    batched together (less padding); ``logits_of`` gets the tokenizer's batch."""
    order = np.argsort([len(t) for t in texts])
    predictions = np.empty(len(texts), dtype=np.int64)
    for start in range(0, len(texts), batch_size):
        idx = order[start : start + batch_size]
        enc = tokenizer(
            [texts[i] for i in idx],
            truncation=True,
            max_length=max_length,
            padding=True,
            return_tensors="pt",
        )
        predictions[idx] = logits_of(enc).argmax(-1).cpu().numpy()
    return float((predictions == np.asarray(labels)).mean())


@torch.no_grad()
def batched_accuracy(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    inputs_of: Callable[[int, int], torch.Tensor],
    labels: Sequence[int],
    *,
    batch_size: int,
) -> float:
    """Share of inputs whose argmax logit is the label; ``inputs_of(start, stop)`` gives the
    model inputs (pixel values) of examples ``start:stop``."""
    n = len(labels)
    predictions = np.concatenate(
        [
            logits_of(inputs_of(i, min(i + batch_size, n))).argmax(-1).cpu().numpy()
            for i in range(0, n, batch_size)
        ]
    )
    return float((predictions == np.asarray(labels)).mean())
