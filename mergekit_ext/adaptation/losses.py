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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F

OutputKind = Literal["classification", "token_classification", "causal_lm", "dense"]
Target = Literal["hard", "soft"]


def rows(
    output: torch.Tensor, attention_mask: Optional[torch.Tensor], kind: OutputKind
) -> torch.Tensor:
    """``(N, C)`` logits: per sample, or per non-padding position for per-token outputs."""
    if kind == "classification":
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


def kl_to_teacher(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Mean over rows of ``KL(softmax(teacher) ‖ softmax(student))``."""
    if student_logits.shape[0] == 0:
        return student_logits.sum() * 0.0
    return F.kl_div(
        student_logits.log_softmax(-1),
        teacher_logits.log_softmax(-1),
        log_target=True,
        reduction="batchmean",
    )


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


# ------------------------------------------------------------- causal LMs in bounded memory


@dataclass
class TopKLogProbs:
    """A causal-LM teacher's next-token distributions, compressed (one entry per position).

    - ``logprobs``, ``indices``: ``(..., k)`` log-probabilities and token ids of the ``k``
      most likely tokens, most likely first;
    - ``rest``: ``(...)`` the log of the probability mass of all other tokens together
      (``-inf`` when ``k`` is the vocabulary size).

    Indexing (``teacher[index]``, ``teacher[mask]``) selects along the leading dimensions,
    as for a logits tensor.
    """

    logprobs: torch.Tensor
    indices: torch.Tensor
    rest: torch.Tensor

    def __getitem__(self, index: Any) -> TopKLogProbs:
        return TopKLogProbs(self.logprobs[index], self.indices[index], self.rest[index])

    def reshape(self, *shape: int) -> TopKLogProbs:
        """Reshape as the logits it stands for (``shape`` ends with ``k``)."""
        return TopKLogProbs(
            self.logprobs.reshape(*shape),
            self.indices.reshape(*shape),
            self.rest.reshape(*shape[:-1]),
        )

    def to(self, device: Any) -> TopKLogProbs:
        return TopKLogProbs(self.logprobs.to(device), self.indices.to(device), self.rest.to(device))

    @property
    def shape(self) -> torch.Size:
        """The shape of the logits this stands for, with ``k`` as the last dimension."""
        return self.logprobs.shape

    @property
    def ndim(self) -> int:
        return self.logprobs.ndim

    @property
    def device(self) -> torch.device:
        return self.logprobs.device

    def argmax(self) -> torch.Tensor:
        return self.indices[..., 0]

    @staticmethod
    def cat(parts: Sequence[TopKLogProbs]) -> TopKLogProbs:
        return TopKLogProbs(
            torch.cat([p.logprobs for p in parts]),
            torch.cat([p.indices for p in parts]),
            torch.cat([p.rest for p in parts]),
        )


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 − exp(x))`` for ``x ≤ 0``, accurate at both ends (Mächler 2012)."""
    x = x.clamp(max=0.0)
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def top_k_log_probs(logits: torch.Tensor, k: int) -> TopKLogProbs:
    """Compress ``(..., V)`` logits into the top-``k`` log-probabilities and the rest's mass.

    Computed in float32 (float64 for float64 logits); ``k`` is clipped to ``V``.
    """
    logits = logits.float() if logits.dtype != torch.float64 else logits
    logp = logits.log_softmax(-1)
    k = min(int(k), logp.shape[-1])
    top, indices = logp.topk(k, dim=-1, sorted=True)
    if k == logp.shape[-1]:
        rest = torch.full(top.shape[:-1], -math.inf, dtype=top.dtype, device=top.device)
    else:
        rest = log1mexp(top.logsumexp(-1))
    return TopKLogProbs(top, indices, rest)


def kl_to_top_k_teacher(student_logits: torch.Tensor, teacher: TopKLogProbs) -> torch.Tensor:
    """Sum over rows of ``KL(p ‖ q)`` with the teacher ``p`` kept as its top-k tokens plus one
    bucket for the rest of the vocabulary, and the student ``q = softmax(student_logits)``
    lumped the same way::

        KL = Σ_{i ∈ top-k} p_i (log p_i − log q_i) + p_rest (log p_rest − log q_rest),
        q_rest = 1 − Σ_{i ∈ top-k} q_i

    This is the KL between the two distributions coarsened onto k + 1 outcomes: it is ≤ the
    full KL and equal to it when ``k`` is the vocabulary size (the bucket is then empty).

    Args:
        student_logits: ``(N, V)`` logits (differentiable).
        teacher: the teacher's :class:`TopKLogProbs` for the same ``N`` rows.

    Returns:
        A scalar: the sum (not the mean) over the ``N`` rows, so that chunks add up.
    """
    wide = student_logits if student_logits.dtype == torch.float64 else student_logits.float()
    log_q = wide.log_softmax(-1)
    log_q_top = log_q.gather(-1, teacher.indices)
    p_top = teacher.logprobs.exp()
    kl = (p_top * (teacher.logprobs - log_q_top)).sum(-1)
    has_rest = torch.isfinite(teacher.rest)
    if bool(has_rest.any()):
        log_q_rest = log1mexp(log_q_top.logsumexp(-1))
        rest = torch.where(has_rest, teacher.rest, torch.zeros_like(teacher.rest))
        kl = kl + torch.where(has_rest, rest.exp() * (rest - log_q_rest), torch.zeros_like(rest))
    return kl.sum()
