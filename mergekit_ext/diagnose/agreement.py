"""Output agreement of two models: KL and top-1 / argmax agreement (pure tensor functions).

Used by :mod:`mergekit_ext.diagnose.diagnoser` on each task's evaluation data
(``docs/methods.md``, "Diagnose").
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from mergekit_ext.kl import kl_from_log_probs

# Elements of one logits chunk (rows x vocabulary slice) in chunked_kl_top1: 2M float64
# values = 16 MB per array, a handful of arrays alive at once.
LOGIT_CHUNK_ELEMENTS = 2**21


def kl_and_agreement(
    reference_logits: torch.Tensor, logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row ``KL(softmax(reference) ‖ softmax(logits))`` and argmax agreement, float64.

    Args:
        reference_logits: ``[N, C]`` logits of the expert.
        logits: ``[N, C]`` logits of the merged model.

    Returns:
        ``(kl [N] float64, agree [N] bool)``; ``KL = Σ_c p_c (log p_c − log q_c)``.
    """
    log_p = torch.log_softmax(reference_logits.double(), dim=-1)
    log_q = torch.log_softmax(logits.double(), dim=-1)
    kl = kl_from_log_probs(log_p, log_q)
    agree = reference_logits.argmax(-1) == logits.argmax(-1)
    return kl, agree


def chunked_kl_top1(
    reference_hidden: torch.Tensor,
    reference_weight: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    reference_bias: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    chunk_elements: int = LOGIT_CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL and top-1 agreement of two LM heads without materializing ``[N, V]`` logits.

    With ``z = h_ref W_refᵀ + b_ref`` and ``y = h W ᵀ + b`` (rows: positions, columns: the
    vocabulary) and ``log Z = logsumexp``::

        KL(softmax z ‖ softmax y) = Σ_v p_v (z_v − y_v) − log Z_z + log Z_y,
        Σ_v p_v (z_v − y_v) = Σ_v e^{z_v − m} (z_v − y_v) / Σ_v e^{z_v − m}

    for any shift ``m``. The vocabulary is walked in slices; the running maximum ``m`` of
    each row and the two sums are rescaled by ``e^{m_old − m_new}`` when it grows (the
    online softmax of Milakov & Gimelshein, 2018). The argmax keeps the first maximum, as
    ``torch.argmax``. Products in float32 (the weights' compute dtype), sums in float64.

    Args:
        reference_hidden / hidden: ``[N, D]`` inputs of the expert's / merged model's head.
        reference_weight / weight: ``[V, D]`` head weights; ``*_bias``: ``[V]`` or None.
        chunk_elements: at most this many logits (N x slice) per slice.

    Returns:
        ``(kl [N] float64, agree [N] bool)``.
    """
    n, vocab = reference_hidden.shape[0], reference_weight.shape[0]
    device = reference_hidden.device
    step = max(1, min(vocab, chunk_elements // max(n, 1)))
    neg_inf = torch.full((n,), -math.inf, dtype=torch.float64, device=device)
    m_ref, m_new = neg_inf.clone(), neg_inf.clone()
    s_ref = torch.zeros(n, dtype=torch.float64, device=device)
    s_new = torch.zeros_like(s_ref)
    cross = torch.zeros_like(s_ref)  # Σ e^{z − m_ref} (z − y)
    best_ref, best_new = neg_inf.clone(), neg_inf.clone()
    arg_ref = torch.zeros(n, dtype=torch.long, device=device)
    arg_new = torch.zeros_like(arg_ref)
    for start in range(0, vocab, step):
        stop = min(vocab, start + step)
        z = reference_hidden @ reference_weight[start:stop].T
        y = hidden @ weight[start:stop].T
        if reference_bias is not None:
            z = z + reference_bias[start:stop]
        if bias is not None:
            y = y + bias[start:stop]
        z, y = z.double(), y.double()
        z_max, z_arg = z.max(-1)
        y_max, y_arg = y.max(-1)
        grown = torch.maximum(m_ref, z_max)
        scale = torch.exp(m_ref - grown)
        e = torch.exp(z - grown[:, None])
        s_ref = s_ref * scale + e.sum(-1)
        cross = cross * scale + (e * (z - y)).sum(-1)
        m_ref = grown
        grown = torch.maximum(m_new, y_max)
        s_new = s_new * torch.exp(m_new - grown) + torch.exp(y - grown[:, None]).sum(-1)
        m_new = grown
        better = z_max > best_ref
        best_ref = torch.where(better, z_max, best_ref)
        arg_ref = torch.where(better, z_arg + start, arg_ref)
        better = y_max > best_new
        best_new = torch.where(better, y_max, best_new)
        arg_new = torch.where(better, y_arg + start, arg_new)
        del z, y, e
    log_z_ref = m_ref + torch.log(s_ref)
    log_z_new = m_new + torch.log(s_new)
    kl = cross / s_ref - log_z_ref + log_z_new
    return kl, arg_ref == arg_new
