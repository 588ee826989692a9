"""Kullback-Leibler divergences between output distributions: the one home of the KL helpers.

Pure tensor functions used by SyMerge's losses (``adaptation/losses.py``), the model-output
QP objective and ``diagnose`` (both in ``executor/``). ``docs/methods.md`` has the equations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


def kl_from_log_probs(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Per-row ``KL(p ‖ q) = Σ_c p_c (log p_c − log q_c)`` from log-probabilities.

    Args:
        log_p: ``(..., C)`` log-probabilities of the reference distribution ``p``.
        log_q: ``(..., C)`` log-probabilities of ``q``, same shape and dtype.

    Returns:
        ``(...)``: the KL of each row, in the inputs' dtype.
    """
    return (log_p.exp() * (log_p - log_q)).sum(-1)


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


def top_k_log_probs(logits: torch.Tensor, k: int) -> TopKLogProbs:
    """Compress ``(..., V)`` logits into the top-``k`` log-probabilities and the rest's mass.

    Computed in float32 (float64 for float64 logits); ``k`` is clipped to ``V``.
    """
    logits = logits.float() if logits.dtype != torch.float64 else logits
    logp = logits.log_softmax(-1)
    k = min(int(k), logp.shape[-1])
    top, indices = logp.topk(k, dim=-1, sorted=True)
    # the rest's mass summed directly (not 1 − Σ top-k, which is 0 in floating point when
    # the top-k hold nearly all of it); -inf when k is the whole vocabulary
    rest = logp.scatter(-1, indices, -math.inf).logsumexp(-1)
    return TopKLogProbs(top, indices, rest)


def kl_to_top_k_teacher(student_logits: torch.Tensor, teacher: TopKLogProbs) -> torch.Tensor:
    """Sum over rows of ``KL(p ‖ q)`` with the teacher ``p`` kept as its top-k tokens plus one
    bucket for the rest of the vocabulary, and the student ``q = softmax(student_logits)``
    lumped the same way::

        KL = Σ_{i ∈ top-k} p_i (log p_i − log q_i) + p_rest (log p_rest − log q_rest),
        q_rest = Σ_{i ∉ top-k} q_i   (summed in log space, never as 1 − Σ_{top-k} q_i)

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
        # log q_rest as a log-sum-exp over the other tokens: finite even when the student
        # puts all but a float's rounding of its mass on the top-k (1 − Σ q_top is then 0)
        log_q_rest = log_q.scatter(-1, teacher.indices, -math.inf).logsumexp(-1)
        log_q_rest = torch.where(has_rest, log_q_rest, torch.zeros_like(log_q_rest))
        rest = torch.where(has_rest, teacher.rest, torch.zeros_like(teacher.rest))
        kl = kl + torch.where(has_rest, rest.exp() * (rest - log_q_rest), torch.zeros_like(rest))
    return kl.sum()
