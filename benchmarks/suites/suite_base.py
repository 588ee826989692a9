"""What every benchmark suite provides, and the training loop they share.

A suite owns a base model, one expert per (variant, task), the calibration files of its
tasks and a scorer. The harness (``benchmarks/suites/run.py``) asks it for those and runs the
merges; it never knows how a suite trains or scores.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import numpy as np
import torch

from benchmarks.suites.tasks import TaskData, load_task

LOG = logging.getLogger(__name__)

Metric = Literal["accuracy", "loss"]
# settings fields that only affect scoring and calibration files, never training
SCORING_FIELDS = ("test_examples", "calibration_samples", "eval_batch_size")


@dataclass
class Expert:
    """One task's fine-tuned model, in the layouts the merge methods need.

    - ``body``: the merge input, with exactly the base's tensor names (``BertModel``,
      ``ViTModel``, or the whole ``LlamaForCausalLM``);
    - ``full``: the expert with its head (``...ForSequenceClassification``), for SyMerge;
    - ``head``: ``head.safetensors`` (``weight``, ``bias``) for classifiers, else None;
    - ``adapter``: the PEFT LoRA adapter folder the expert was merged from, when the suite
      keeps it (its ``adapter_config.json`` names the base), else None.
    """

    task: str
    body: str
    full: str
    head: Optional[str]
    adapter: Optional[str] = None
    record: dict[str, Any] = field(default_factory=dict)


class Suite(ABC):
    """A benchmark suite. ``settings`` is a dataclass of its training/eval settings."""

    name: str
    metric: Metric
    variants: tuple[str, ...]
    default_tasks: tuple[str, ...]
    # the merges' output ``dtype:`` (a suite of bfloat16 checkpoints writes bfloat16)
    merge_dtype: str = "float32"

    def __init__(self, cache_dir: str, smoke: bool, tasks: Optional[Sequence[str]] = None):
        self.smoke = smoke
        self.root = os.path.join(cache_dir, "smoke" if smoke else "full", self.name)
        os.makedirs(self.root, exist_ok=True)
        self.tasks = tuple(tasks or self.default_tasks)
        self.settings = self.make_settings(smoke)

    # -- building -----------------------------------------------------------------
    @abstractmethod
    def make_settings(self, smoke: bool) -> Any: ...

    @abstractmethod
    def base(self) -> tuple[str, dict[str, Any]]:
        """The base body folder and its cache record (built on first use)."""

    @abstractmethod
    def expert(self, variant: str, task: str) -> Expert: ...

    @abstractmethod
    def calibration(self, task: str) -> dict[str, Any]:
        """The ``calibration:`` entry for ``task`` (written to the cache on first use)."""

    # -- scoring --------------------------------------------------------------------
    @abstractmethod
    def evaluate_body(self, body: str, experts: dict[str, Expert]) -> dict[str, float]:
        """Score a body (merged, base or expert) on each task with that task's expert head."""

    @abstractmethod
    def evaluate_full(self, folder: str, task: str) -> float:
        """Score a complete model (body + head, or a whole LM) on ``task``."""

    def title(self, variant: str) -> str:
        """The tables' title for ``variant``'s experts."""
        return f"{self.name} suite" + (f" ({variant} experts)" if len(self.variants) > 1 else "")

    # -- helpers ----------------------------------------------------------------------
    def task(self, name: str) -> TaskData:
        return load_task(name)

    def settings_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self.settings)

    def recipe_settings(self, drop: Sequence[str] = ()) -> dict[str, Any]:
        """The settings that shape a trained model: scoring/calibration sizes and ``drop``
        are left out, so that changing them never retrains anything."""
        return {k: v for k, v in self.settings_dict().items() if k not in (*SCORING_FIELDS, *drop)}


def memoized(method: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Cache a no-argument method's result on the instance (``base()`` hashes files)."""
    attr = f"_memo_{method.__name__}"

    def wrapper(self: Any) -> Any:
        if not hasattr(self, attr):
            setattr(self, attr, method(self))
        return getattr(self, attr)

    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    return wrapper


def read_marker(path: str) -> Optional[str]:
    """The recipe digest stored beside a calibration file or folder, if any."""
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fp:
        return fp.read().strip()


def write_marker(path: str, digest: str) -> None:
    with open(path, "w", encoding="utf-8") as fp:
        fp.write(digest)


def write_calibration_texts(path: str, texts: Sequence[str]) -> None:
    """A jsonl file with one ``{"text": ...}`` per line."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fp:
        for text in texts:
            fp.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def seeded_batches(n_examples: int, batch_size: int, steps: int, seed: int) -> Iterator[np.ndarray]:
    """``steps`` index batches that walk seeded permutations of ``range(n_examples)``."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(n_examples)
    pos = 0
    for _ in range(steps):
        if pos + batch_size > n_examples:
            order = rng.permutation(n_examples)
            pos = 0
        yield order[pos : pos + batch_size]
        pos += batch_size


def train_loop(
    model: torch.nn.Module,
    loss_of_batch: Callable[[np.ndarray], torch.Tensor],
    batches: Iterator[np.ndarray],
    steps: int,
    lr: float,
    *,
    weight_decay: float = 0.01,
    warmup_fraction: float = 0.1,
    desc: str = "",
) -> dict[str, Any]:
    """AdamW with linear warm-up and linear decay; returns the loss curve summary."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    warmup = max(1, int(warmup_fraction * steps))

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (steps - step) / max(1, steps - warmup))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    model.train()
    losses: list[float] = []
    for step, idx in enumerate(batches):
        loss = loss_of_batch(idx)
        if not math.isfinite(loss.item()):
            raise RuntimeError(f"{desc}: loss is {loss.item()} at step {step}")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % max(1, steps // 5) == 0:
            window = losses[-max(1, steps // 5) :]
            LOG.info("%s step %d/%d loss %.4f", desc, step + 1, steps, sum(window) / len(window))
    model.eval()
    tail = losses[-max(1, len(losses) // 10) :]
    return {
        "train_loss_first": losses[0] if losses else None,
        "train_loss_last": sum(tail) / len(tail) if tail else None,
        "steps": len(losses),
    }
