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
    OutputKind,
    Target,
    agreement,
    kl_to_teacher,
    l1_to_teacher,
    rows,
    self_labelling_loss,
)
from mergekit_ext.adaptation.problem import SyMergeProblem
from mergekit_ext.errors import CalibrationError

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
    teacher: Optional[torch.Tensor] = None  # (N, ...) outputs of the expert on every sample


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


def output_kind(module: torch.nn.Module, output: torch.Tensor) -> OutputKind:
    """classification | token_classification | causal_lm | dense (regression, features).

    Multi-label classifiers count as dense (their logits are not one softmax).
    """
    name = type(module).__name__
    problem_type = getattr(getattr(module, "config", None), "problem_type", None)
    if name.endswith("ForCausalLM"):
        return "causal_lm"
    if problem_type in ("regression", "multi_label_classification") or output.shape[-1] == 1:
        return "dense"
    if name.endswith("ForTokenClassification") and output.ndim == 3:
        return "token_classification"
    if name.endswith("Classification") and output.ndim == 2:
        return "classification"
    return "dense"


@torch.no_grad()
def teacher_outputs(
    forward: Any, inputs: Mapping[str, torch.Tensor], batch_size: int, device: str
) -> torch.Tensor:
    """The teacher's outputs for every sample, in chunks, under ``no_grad``."""
    n = num_samples(inputs)
    chunks = []
    for start in range(0, n, batch_size):
        index = torch.arange(start, min(n, start + batch_size))
        batch = {k: v.to(device) for k, v in select(inputs, index).items()}
        chunks.append(output_tensor(forward(batch)).detach().float())
    return torch.cat(chunks, dim=0)


# ---------------------------------------------------------------------------- loss


def task_loss(
    kind: OutputKind,
    student: torch.Tensor,
    teacher: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    target: Target,
    top_p: Optional[float],
) -> tuple[torch.Tensor, float]:
    """The loss for one batch and the student's agreement with the teacher on it."""
    if kind == "dense":
        loss = l1_to_teacher(student, teacher, attention_mask)
        return loss, float("nan")
    s_rows, t_rows = rows(student, attention_mask, kind), rows(teacher, attention_mask, kind)
    if kind == "causal_lm":
        loss = kl_to_teacher(s_rows, t_rows)
    else:
        loss, _ = self_labelling_loss(s_rows, t_rows, target, top_p)
    return loss, agreement(s_rows.detach(), t_rows)


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
) -> torch.Tensor:
    if data.teacher is not None:
        return data.teacher[index.to(data.teacher.device)]
    with torch.no_grad():
        return output_tensor(problem.teacher_forward(k, batch)).detach().float()


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
        if task.kind is None:
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
            batch = {key: v.to(device) for key, v in select(d.inputs, index).items()}
            teacher = _teacher_batch(problem, k, d, index, batch)
            optimizer.zero_grad(set_to_none=True)
            student = output_tensor(problem.forward(k, batch)).float()
            mask = batch.get("attention_mask") if task.kind != "classification" else None
            loss, agree = task_loss(
                task.kind, student, teacher, mask, settings.target, settings.confidence_top_p
            )
            if not torch.isfinite(loss):
                raise FloatingPointError(
                    f"symerge: the loss of task {task.name} became {float(loss)}; lower lr"
                )
            loss.backward()
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
) -> dict[str, dict[str, Optional[float]]]:
    """Per task: agreement with the teacher (``accuracy``) or L1 to it (``l1``) on a split.

    Uses the problem's current λ and task layers; a task with no samples in the split gives
    None.
    """
    merged = problem.merged_tensors()
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
            teacher = _teacher_batch(problem, k, d, chunk, batch)
            student = output_tensor(problem.forward(k, batch, merged)).float()
            mask = batch.get("attention_mask") if task.kind != "classification" else None
            if task.kind == "dense":
                l1_sum += float(l1_to_teacher(student, teacher, mask)) * len(chunk)
                total += len(chunk)
                continue
            s_rows, t_rows = rows(student, mask, task.kind), rows(teacher, mask, task.kind)
            same += int((s_rows.argmax(-1) == t_rows.argmax(-1)).sum())
            total += s_rows.shape[0]
        if task.kind == "dense":
            result[task.name] = {"accuracy": None, "l1": l1_sum / max(total, 1)}
        else:
            result[task.name] = {"accuracy": same / max(total, 1), "l1": None}
    return result
