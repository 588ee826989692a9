"""SyMerge's adaptation loop: data per task, cached teacher outputs, Adam over λ and the task layers.

Schedule as in the public reference code (github AIM-SKKU/SyMerge): each epoch visits the
tasks in a shuffled order and takes one optimiser step per task on one batch of that task's
unlabeled data (batches cycle through a reshuffled permutation). λ is clamped to [0, 1]
after every step unless ``clamp`` is off. Everything is seeded by ``seed``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from mergekit_ext.adaptation.losses import (
    Target,
    TopKLogProbs,
    agreement,
    kl_to_teacher,
    kl_to_top_k_teacher,
    l1_to_teacher,
    rows,
    self_labelling_loss,
    top_k_log_probs,
)
from mergekit_ext.adaptation.problem import SyMergeProblem
from mergekit_ext.errors import CalibrationError
from mergekit_ext.models.head_kind import HeadKind

LOG = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- data


def stack_batches(
    batches: Sequence[Mapping[str, torch.Tensor]], pad_token_id: int = 0
) -> dict[str, torch.Tensor]:
    """Concatenate calibration batches into one ``(N, ...)`` tensor per key.

    Text batches (those with an ``attention_mask``) are right padded to the longest one:
    ``input_ids`` with ``pad_token_id``, every other key with 0 (masked positions).
    """
    if not batches:
        return {}
    text = "attention_mask" in batches[0]
    width = max(b["attention_mask"].shape[1] for b in batches) if text else 0
    out = {}
    for key in batches[0]:
        parts = [b[key] for b in batches]
        if text and key != "pixel_values":
            fill = pad_token_id if key == "input_ids" else 0
            parts = [
                F.pad(p, (0, width - p.shape[1]), value=fill) if p.shape[1] < width else p
                for p in parts
            ]
        out[key] = torch.cat(parts, dim=0)
    return out


def num_samples(inputs: Mapping[str, torch.Tensor]) -> int:
    return int(next(iter(inputs.values())).shape[0]) if inputs else 0


def split_heldout(
    n: int, fraction: float, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """A seeded split of ``range(n)`` into (adaptation, held-out) indices.

    ``round(fraction · n)`` samples are held out, at least one when ``fraction > 0`` and
    at most ``n − 1`` (adaptation needs data).
    """
    order = torch.randperm(n, generator=generator)
    held = 0 if fraction <= 0 else min(n - 1, max(1, round(fraction * n)))
    return order[held:].sort().values, order[:held].sort().values


class BatchCycler:
    """Batches of indices from a pool, reshuffled (seeded) every time it runs out."""

    def __init__(self, pool: torch.Tensor, batch_size: int, generator: torch.Generator) -> None:
        self.pool = pool
        self.batch_size = batch_size
        self.generator = generator
        self._order = torch.empty(0, dtype=torch.long)
        self._pos = 0

    def next(self) -> torch.Tensor:
        if self._pos >= len(self._order):
            self._order = self.pool[torch.randperm(len(self.pool), generator=self.generator)]
            self._pos = 0
        batch = self._order[self._pos : self._pos + self.batch_size]
        self._pos += self.batch_size
        return batch


def select(inputs: Mapping[str, torch.Tensor], index: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v[index.to(v.device)] for k, v in inputs.items()}


@dataclass
class TaskData:
    """One task's unlabeled samples, its split, and (when cached) the teacher's outputs."""

    name: str
    inputs: dict[str, torch.Tensor]
    adapt_index: torch.Tensor
    heldout_index: torch.Tensor
    # (N, ...) outputs of the expert on every sample; a causal LM's as top-k log-probabilities
    teacher: Optional[torch.Tensor | TopKLogProbs] = None


# ---------------------------------------------------------------------------- outputs


def output_tensor(outputs: Any) -> torch.Tensor:
    """The prediction of a transformers output: logits, else embeddings, else hidden states."""
    for name in ("logits", "image_embeds", "text_embeds", "last_hidden_state"):
        value = getattr(outputs, name, None)
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(outputs, torch.Tensor):
        return outputs
    return outputs[0]


# A causal LM teacher's logits are compressed batch by batch; this bounds one batch's
# (B, T, V) float32 logits (the batch is split below it). Their log-softmax and top-k take
# about as much again, so at 256 MiB the teacher pass alone peaked above the LM suite's
# 3 GB target; smaller batches cost nothing measurable here (one forward pass per sample).
TEACHER_LOGITS_BYTES = 64 * 2**20


@torch.no_grad()
def teacher_outputs(
    forward: Any,
    inputs: Mapping[str, torch.Tensor],
    batch_size: int,
    device: str,
    *,
    top_k: Optional[int] = None,
    vocab_size: Optional[int] = None,
) -> torch.Tensor | TopKLogProbs:
    """The teacher's outputs for every sample, in chunks, under ``no_grad``.

    With ``top_k`` (causal LMs), each chunk's logits are compressed at once into
    :class:`TopKLogProbs`, and chunks are small enough that their ``(B, T, V)`` logits stay
    under ``TEACHER_LOGITS_BYTES`` (``vocab_size`` sizes them): the cache then grows with
    ``k``, not with the vocabulary.
    """
    n = num_samples(inputs)
    if top_k is not None and vocab_size and "input_ids" in inputs:
        per_sample = 4 * vocab_size * int(inputs["input_ids"].shape[-1])
        batch_size = max(1, min(batch_size, TEACHER_LOGITS_BYTES // max(per_sample, 1)))
    chunks: list[Any] = []
    for start in range(0, n, batch_size):
        index = torch.arange(start, min(n, start + batch_size))
        batch = {k: v.to(device) for k, v in select(inputs, index).items()}
        out = output_tensor(forward(batch)).detach()
        chunks.append(top_k_log_probs(out, top_k) if top_k is not None else out.float())
    if top_k is not None:
        return TopKLogProbs.cat(chunks)
    return torch.cat(chunks, dim=0)


# ---------------------------------------------------------------------------- loss


def task_loss(
    head_kind: HeadKind,
    student: torch.Tensor,
    teacher: torch.Tensor | TopKLogProbs,
    attention_mask: Optional[torch.Tensor],
    target: Target,
    top_p: Optional[float],
) -> tuple[torch.Tensor, float]:
    """The loss for one batch and the student's agreement with the teacher on it."""
    if head_kind == "dense":
        loss = l1_to_teacher(student, teacher, attention_mask)  # type: ignore[arg-type]
        return loss, float("nan")
    s_rows, t_rows = (
        rows(student, attention_mask, head_kind),
        rows(teacher, attention_mask, head_kind),
    )
    if isinstance(t_rows, TopKLogProbs):
        n = max(int(s_rows.shape[0]), 1)
        same = s_rows.detach().argmax(-1) == t_rows.argmax()
        agree = float(same.float().mean()) if s_rows.shape[0] else float("nan")
        return kl_to_top_k_teacher(s_rows, t_rows) / n, agree
    if head_kind == "causal_lm":
        loss = kl_to_teacher(s_rows, t_rows)
    else:
        loss, _ = self_labelling_loss(s_rows, t_rows, target, top_p)
    return loss, agreement(s_rows.detach(), t_rows)


def _chunk_kl(
    hidden: torch.Tensor,
    head: torch.Tensor,
    logprobs: torch.Tensor,
    indices: torch.Tensor,
    rest: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = hidden @ head.T
    loss = kl_to_top_k_teacher(logits, TopKLogProbs(logprobs, indices, rest))
    return loss, logits.detach().argmax(-1)


def causal_lm_chunked_loss(
    hidden: torch.Tensor,
    head: torch.Tensor,
    teacher: TopKLogProbs,
    attention_mask: Optional[torch.Tensor],
    chunk_tokens: int,
) -> tuple[torch.Tensor, float]:
    """A causal LM's mean top-k KL over non-padding positions, ``chunk_tokens`` at a time.

    Each chunk's logits ``hidden[c] @ headᵀ`` are recomputed in the backward pass
    (activation checkpointing) instead of kept, so memory grows with ``chunk_tokens × V``,
    not with ``B × T × V``. The value and gradients equal :func:`task_loss` on the full
    logits.

    Args:
        hidden: ``(B, T, d)`` last hidden states (differentiable); ``head``: ``(V, d)``.
        teacher: the teacher's ``(B, T, k)`` :class:`TopKLogProbs` for the same batch.
        attention_mask: ``(B, T)``; None: every position counts.
        chunk_tokens: positions per chunk.

    Returns:
        ``(mean KL over positions, top-1 agreement with the teacher)``.
    """
    h = rows(hidden, attention_mask, "causal_lm")
    t = rows(teacher, attention_mask, "causal_lm")
    n = int(h.shape[0])
    if n == 0:
        return hidden.sum() * 0.0, float("nan")
    total = hidden.new_zeros((), dtype=torch.float32)
    same = 0
    for start in range(0, n, chunk_tokens):
        part = slice(start, min(n, start + chunk_tokens))
        tp = t[part]
        args = (h[part], head, tp.logprobs, tp.indices, tp.rest)
        if torch.is_grad_enabled() and (h.requires_grad or head.requires_grad):
            loss, top1 = torch.utils.checkpoint.checkpoint(_chunk_kl, *args, use_reentrant=False)
        else:
            loss, top1 = _chunk_kl(*args)
        total = total + loss
        same += int((top1 == tp.argmax()).sum())
    return total / n, same / n


# ---------------------------------------------------------------------------- loop


@dataclass
class AdaptationSettings:
    epochs: int = 100
    lr: float = 1e-2
    task_layer_lr: Optional[float] = None  # None: ``lr``
    batch_size: int = 32
    clamp: bool = True
    target: Target = "hard"
    confidence_top_p: Optional[float] = None
    seed: int = 0
    teacher_top_k: Optional[int] = 256  # causal LMs: None keeps the full distribution
    logit_chunk_tokens: int = 512
    micro_batch_size: Optional[int] = None  # causal LMs: samples per forward/backward


def optimizer_groups(problem: Any, settings: AdaptationSettings) -> list[dict[str, Any]]:
    """Adam's parameter groups: λ at ``lr``, the task layers at ``task_layer_lr`` (or ``lr``)."""
    layers = [p for t in problem.tasks for p in t.layer.values()]
    lr_layers = settings.lr if settings.task_layer_lr is None else settings.task_layer_lr
    groups: list[dict[str, Any]] = [{"params": [problem.lambdas], "lr": settings.lr}]
    if layers:
        groups.append({"params": layers, "lr": lr_layers})
    return groups


@dataclass
class AdaptationLog:
    loss: list[float] = field(default_factory=list)
    loss_task: list[str] = field(default_factory=list)
    agreement: dict[str, list[float]] = field(default_factory=dict)
    seconds: float = 0.0


def _teacher_batch(
    problem: SyMergeProblem,
    k: int,
    data: TaskData,
    index: torch.Tensor,
    batch: Mapping[str, torch.Tensor],
    top_k: Optional[int] = None,
) -> torch.Tensor | TopKLogProbs:
    if data.teacher is not None:
        return data.teacher[index.to(data.teacher.device)]
    with torch.no_grad():
        out = output_tensor(problem.teacher_forward(k, batch)).detach()
        if top_k is not None and problem.tasks[k].head_kind == "causal_lm":
            return top_k_log_probs(out, top_k)
        return out.float()


def _student_loss(
    problem: SyMergeProblem,
    k: int,
    batch: Mapping[str, torch.Tensor],
    teacher: torch.Tensor | TopKLogProbs,
    settings: AdaptationSettings,
    merged: Optional[Mapping[str, torch.Tensor]] = None,
) -> tuple[torch.Tensor, float]:
    """Task k's loss on one batch and the student's agreement with its teacher.

    A causal LM with a top-k teacher never forms its ``(B, T, V)`` logits: the head runs on
    ``logit_chunk_tokens`` positions at a time (:func:`causal_lm_chunked_loss`).
    """
    task = problem.tasks[k]
    mask = batch.get("attention_mask") if task.head_kind != "classification" else None
    if isinstance(teacher, TopKLogProbs):
        split = problem.hidden_and_head(k, batch, merged)
        if split is not None:
            hidden, head = split
            return causal_lm_chunked_loss(
                hidden.float(), head.float(), teacher, mask, settings.logit_chunk_tokens
            )
    student = output_tensor(problem.forward(k, batch, merged)).float()
    assert task.head_kind is not None
    return task_loss(
        task.head_kind, student, teacher, mask, settings.target, settings.confidence_top_p
    )


def _positions(batch: Mapping[str, torch.Tensor]) -> int:
    mask = batch.get("attention_mask")
    if mask is not None:
        return int(mask.sum())
    return int(next(iter(batch.values())).shape[:2].numel())


def _accumulate_step(
    problem: SyMergeProblem,
    k: int,
    data: TaskData,
    index: torch.Tensor,
    settings: AdaptationSettings,
    device: str,
) -> tuple[torch.Tensor, float]:
    """One optimiser step's gradients for task k's batch ``index``; returns (loss, agreement).

    A causal LM's loss is a mean over positions, so its batch can run in micro-batches of
    ``settings.micro_batch_size`` samples whose position-weighted gradients add up to the
    whole batch's: activations then grow with the micro-batch. Other losses (the hard-label
    filter and ``confidence_top_p`` look at the whole batch) run the batch at once.
    """
    task = problem.tasks[k]
    micro = settings.micro_batch_size
    parts = [index]
    if task.head_kind == "causal_lm" and micro is not None and micro < len(index):
        parts = list(index.split(micro))
    batches = [
        {key: v.to(device) for key, v in select(data.inputs, part).items()} for part in parts
    ]
    total = sum(_positions(b) for b in batches) if len(parts) > 1 else 1
    loss_sum = torch.zeros(())
    same = 0.0
    for part, batch in zip(parts, batches):
        teacher = _teacher_batch(problem, k, data, part, batch, settings.teacher_top_k)
        loss, agree = _student_loss(problem, k, batch, teacher, settings)
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"symerge: the loss of task {task.name} became {float(loss)}; lower lr"
            )
        share = _positions(batch) / total if len(parts) > 1 else 1.0
        (loss * share).backward()
        loss_sum = loss_sum + loss.detach() * share
        same += agree * share if not math.isnan(agree) else math.nan
    return loss_sum, same


def adapt(
    problem: SyMergeProblem,
    data: Sequence[TaskData],
    settings: AdaptationSettings,
    *,
    device: str = "cpu",
    progress: bool = True,
) -> AdaptationLog:
    """Run the adaptation; updates ``problem.lambdas`` and the task layers in place."""
    for task, d in zip(problem.tasks, data):
        if len(d.adapt_index) == 0:
            raise CalibrationError(f"symerge: task {task.name} has no adaptation samples left")
        if task.head_kind is None:
            raise ValueError(f"task {task.name}: output kind unknown (compute the teacher first)")
    order_generator = torch.Generator().manual_seed(settings.seed)
    cyclers = [
        BatchCycler(
            d.adapt_index, settings.batch_size, torch.Generator().manual_seed(settings.seed + 1 + k)
        )
        for k, d in enumerate(data)
    ]
    optimizer = torch.optim.Adam(optimizer_groups(problem, settings), betas=(0.9, 0.999))
    log = AdaptationLog(agreement={t.name: [] for t in problem.tasks})
    start = time.perf_counter()
    bar = tqdm(
        range(settings.epochs), desc="SyMerge", unit="epoch", disable=not progress, leave=False
    )
    for _epoch in bar:
        epoch_agreement = []
        for k in torch.randperm(len(problem.tasks), generator=order_generator).tolist():
            task, d = problem.tasks[k], data[k]
            index = cyclers[k].next()
            optimizer.zero_grad(set_to_none=True)
            loss, agree = _accumulate_step(problem, k, d, index, settings, device)
            optimizer.step()
            if settings.clamp:
                problem.clamp_()
            log.loss.append(float(loss.detach()))
            log.loss_task.append(task.name)
            log.agreement[task.name].append(agree)
            if not math.isnan(agree):
                epoch_agreement.append(agree)
        if epoch_agreement:
            bar.set_postfix(
                loss=f"{log.loss[-1]:.4f}",
                agreement=f"{sum(epoch_agreement) / len(epoch_agreement):.3f}",
            )
    log.seconds = time.perf_counter() - start
    return log


@torch.no_grad()
def evaluate(
    problem: SyMergeProblem,
    data: Sequence[TaskData],
    which: str = "heldout",
    *,
    batch_size: int = 32,
    device: str = "cpu",
    settings: Optional[AdaptationSettings] = None,
) -> dict[str, dict[str, Optional[float]]]:
    """Per task: agreement with the teacher (``accuracy``) or L1 to it (``l1``) on a split.

    Uses the problem's current λ and task layers; a task with no samples in the split gives
    None. ``settings`` gives the causal-LM teacher compression and logit chunking
    (default: :class:`AdaptationSettings`'s).
    """
    settings = settings or AdaptationSettings()
    merged = problem.merged_tensors(factored=True)
    result = {}
    for k, (task, d) in enumerate(zip(problem.tasks, data)):
        index = d.heldout_index if which == "heldout" else d.adapt_index
        if len(index) == 0:
            result[task.name] = {"accuracy": None, "l1": None}
            continue
        same, total, l1_sum = 0, 0, 0.0
        for start in range(0, len(index), batch_size):
            chunk = index[start : start + batch_size]
            batch = {key: v.to(device) for key, v in select(d.inputs, chunk).items()}
            teacher = _teacher_batch(problem, k, d, chunk, batch, settings.teacher_top_k)
            mask = batch.get("attention_mask") if task.head_kind != "classification" else None
            if task.head_kind == "dense":
                student = output_tensor(problem.forward(k, batch, merged)).float()
                l1_sum += float(l1_to_teacher(student, teacher, mask)) * len(chunk)
                total += len(chunk)
                continue
            n_rows = (
                int(mask.sum()) if mask is not None and task.head_kind != "classification" else 0
            )
            _, agree = _student_loss(problem, k, batch, teacher, settings, merged)
            if not n_rows:
                n_rows = rows(teacher, mask, task.head_kind).shape[0]
            if not math.isnan(agree):
                same += round(agree * n_rows)
                total += n_rows
        if task.head_kind == "dense":
            result[task.name] = {"accuracy": None, "l1": l1_sum / max(total, 1)}
        else:
            result[task.name] = {"accuracy": same / max(total, 1), "l1": None}
    return result
