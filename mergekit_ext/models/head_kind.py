"""What a model's head produces: the one place that decides it from the model's class and
config (named the *head* kind so that "output" means the output folder only, issue #53;
SyMerge's record keeps its ``output_kinds`` key).

SyMerge's losses, ``diagnose``'s output comparison and the families' ``causal_lm`` flag (the
model-output objective's next-token KL) all ask this module; each maps the kind to what it
needs (``diagnose`` only tells next-token, class and no output apart).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal, Optional

import torch
from torch import nn

HeadKind = Literal["causal_lm", "classification", "token_classification", "dense", "none"]
"""``causal_lm``: next-token logits over the vocabulary from a linear output embedding;
``classification``: one softmax over classes per sample (sequence or image);
``token_classification``: one softmax over classes per position; ``dense``: any other head
(regression, multi-label, span or feature outputs); ``none``: a bare body (hidden states)."""

# Causal LMs outside transformers' auto mapping (remote code) still follow these names.
_CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")


@lru_cache(maxsize=1)
def _causal_lm_class_names() -> frozenset[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else value)
    return frozenset(names)


def is_causal_lm_class(cls: type) -> bool:
    """A causal-LM class by name (before any weight loads): transformers' ``AutoModelForCausalLM``
    classes and any ``…ForCausalLM`` / ``…LMHeadModel``.

    Args:
        cls: the model class.

    Returns:
        True for a causal-LM class.
    """
    name = cls.__name__
    return name.endswith(_CAUSAL_LM_SUFFIXES) or name in _causal_lm_class_names()


def is_causal_lm(model: nn.Module) -> bool:
    """A causal LM: a causal-LM class whose output embedding is a linear vocabulary projection."""
    get = getattr(model, "get_output_embeddings", None)
    return is_causal_lm_class(type(model)) and get is not None and isinstance(get(), nn.Linear)


def head_kind(model: nn.Module) -> HeadKind:
    """The model's output kind, from its class name and config (no forward pass).

    Args:
        model: a transformers model (a skeleton on the meta device will do).

    Returns:
        The :data:`HeadKind`. Single-output (``num_labels == 1``), regression and
        multi-label classifiers are ``dense``: their logits are not one softmax.
    """
    if is_causal_lm(model):
        return "causal_lm"
    name = type(model).__name__
    if "For" not in name:
        return "none"
    config = getattr(model, "config", None)
    problem_type: Optional[str] = getattr(config, "problem_type", None)
    if problem_type in ("regression", "multi_label_classification"):
        return "dense"
    if getattr(config, "num_labels", None) == 1:
        return "dense"
    if name.endswith("ForTokenClassification"):
        return "token_classification"
    if name.endswith("Classification"):
        return "classification"
    return "dense"


def observed_head_kind(model: nn.Module, output: torch.Tensor) -> HeadKind:
    """:func:`head_kind` confirmed against one forward pass's ``output`` (what SyMerge learns).

    A class head is kept only when its output has the shape a softmax over classes needs
    (``(B, C)`` per sample, ``(B, T, C)`` per token, ``C > 1``); a head that returns something
    else (a remote-code class named like a classifier) and a bare body are learned as ``dense``
    features. Never returns ``none``.

    Args:
        model: the model that produced ``output``.
        output: its main output tensor (logits, embeddings or hidden states).

    Returns:
        ``causal_lm``, ``classification``, ``token_classification`` or ``dense``.
    """
    kind = head_kind(model)
    if kind == "causal_lm":
        return kind
    if output.shape[-1] == 1:
        return "dense"
    if kind == "token_classification" and output.ndim == 3:
        return kind
    if kind == "classification" and output.ndim == 2:
        return kind
    return "dense"


__all__ = [
    "HeadKind",
    "is_causal_lm",
    "is_causal_lm_class",
    "observed_head_kind",
    "head_kind",
]
