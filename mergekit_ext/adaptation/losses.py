"""SyMerge's expert-guided self-labelling losses: pure tensor functions.

"From Non-Interference to Synergistic Merging via Single-Layer Adaptation", arXiv 2412.19098
(ICML 2026). The expert (teacher) labels the unlabeled adaptation data; the merged model
(student) learns from those labels. ``hard`` follows the public reference code: cross-entropy
against the teacher's argmax on the samples where the student already agrees with the teacher
or the teacher is at least as confident as the student.

Logits are ``(N, C)`` here: one row per sample (sequence/image classification) or per
non-padding position (token classification, causal LMs); see :func:`rows`.
"""

from __future__ import annotations

import math
from typing import Literal, Optional

import torch
import torch.nn.functional as F

from mergekit_ext.kl import (  # the KL helpers' home; re-exported for existing importers
    TopKLogProbs,
    kl_to_teacher,
    kl_to_top_k_teacher,
    top_k_log_probs,
)
from mergekit_ext.models.head_kind import HeadKind  # re-exported for existing importers

Target = Literal["hard", "soft"]


def rows(
    output: torch.Tensor, attention_mask: Optional[torch.Tensor], head_kind: HeadKind
) -> torch.Tensor:
    """``(N, C)`` logits: per sample, or per non-padding position for per-token outputs."""
    if head_kind == "classification":
        return output
    if attention_mask is None:
        return output.reshape(-1, output.shape[-1])
    return output[attention_mask.bool()]


def hard_label_keep(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Rows the hard-label loss learns from (the reference code's filter).

    Keep row i when ``argmax student_i == argmax teacher_i`` or
    ``max softmax(teacher_i) >= max softmax(student_i)``.
    """
    teacher_prob, teacher_label = teacher_logits.detach().softmax(-1).max(-1)
    student_prob, student_label = student_logits.detach().softmax(-1).max(-1)
    return (student_label == teacher_label) | (teacher_prob >= student_prob)


def confidence_keep(teacher_logits: torch.Tensor, top_p: Optional[float]) -> torch.Tensor:
    """The ``ceil(top_p · N)`` rows where the teacher is most confident (all when None)."""
    n = teacher_logits.shape[0]
    keep = torch.zeros(n, dtype=torch.bool, device=teacher_logits.device)
    if top_p is None or top_p >= 1.0:
        keep[:] = True
        return keep
    confidence = teacher_logits.detach().softmax(-1).amax(-1)
    order = torch.sort(confidence, descending=True, stable=True).indices
    keep[order[: max(1, math.ceil(top_p * n))]] = True
    return keep


def self_labelling_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    target: Target = "hard",
    top_p: Optional[float] = None,
) -> tuple[torch.Tensor, int]:
    """The classification loss and the number of rows it used.

    ``hard``: cross-entropy to the teacher's argmax over the rows kept by
    :func:`confidence_keep` and :func:`hard_label_keep`; ``soft``: KL to the teacher's
    softmax over the rows kept by :func:`confidence_keep`. A batch where nothing is kept
    gives a zero loss (the reference code would produce NaN).
    """
    keep = confidence_keep(teacher_logits, top_p)
    if target == "hard":
        keep &= hard_label_keep(student_logits, teacher_logits)
        if not bool(keep.any()):
            return student_logits.sum() * 0.0, 0
        labels = teacher_logits[keep].argmax(-1)
        return F.cross_entropy(student_logits[keep], labels), int(keep.sum())
    if target == "soft":
        return kl_to_teacher(student_logits[keep], teacher_logits[keep]), int(keep.sum())
    raise ValueError(f"unknown target {target!r}: use hard or soft")


def l1_to_teacher(
    student: torch.Tensor, teacher: torch.Tensor, attention_mask: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Mean absolute difference; per-token outputs ``(B, T, D)`` skip padding positions."""
    if (
        attention_mask is not None
        and student.ndim == 3
        and student.shape[:2] == attention_mask.shape
    ):
        mask = attention_mask.bool()
        return (student[mask] - teacher[mask]).abs().mean()
    return (student - teacher).abs().mean()


def agreement(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> float:
    """Share of rows on which the student's argmax equals the teacher's."""
    if student_logits.shape[0] == 0:
        return float("nan")
    same = student_logits.argmax(-1) == teacher_logits.argmax(-1)
    return float(same.float().mean())


__all__ = [
    "HeadKind",
    "Target",
    "TopKLogProbs",
    "agreement",
    "confidence_keep",
    "hard_label_keep",
    "kl_to_teacher",
    "kl_to_top_k_teacher",
    "l1_to_teacher",
    "rows",
    "self_labelling_loss",
    "top_k_log_probs",
]
