"""Suite 2b: the LM suite with full fine-tunes as experts (issue #51).

Community LLM merges are mostly of full fine-tunes saved in bfloat16, not of LoRA adapters.
This suite keeps the LM suite's base (SmolLM2-135M-Instruct), domains, calibration files and
scoring (share of the expert's next-token loss gain a merge keeps), and changes the experts:

- the base is the LM suite's float32 base saved in bfloat16 (``save_pretrained``), as the
  checkpoints users merge ship;
- each expert trains every weight (embeddings, norms, all projections) from that base with
  AdamW in float32 (master weights), then is saved in bfloat16 with ``save_pretrained``;
- the merges write bfloat16.

Its tables are ``lm_full`` (``--suite lm_full``). The base and experts live in the LM suite's
cache folder (``<cache>/full/lm/base_bfloat16``, ``.../full/<task>``), beside the LoRA ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.suites.cache import cached_build
from benchmarks.suites.lm_suite import LMSuite, _tokenizer, lm_loss_of_batch
from benchmarks.suites.suite_base import Expert, memoized, seeded_batches, train_loop


@dataclass(frozen=True)
class LMFullSettings:
    base: str = "smollm2-135m-gguf"  # or "tiny-random-llama" (smoke)
    checkpoint_dtype: str = "bfloat16"  # the base's and the experts' saved dtype
    # One AdamW step over all 135M weights costs ~1.5 CPU-seconds at one text of 32 tokens,
    # and the 2-core machine, shared by many jobs, gave each of the three training processes
    # 8-10% of a core (measured): 100 steps per expert was what fit in ~40 minutes there.
    # The step count matters more than the tokens: the first experts (7-9 steps)
    # updated along one common direction.
    train_max_length: int = 32
    batch_size: int = 1
    steps: int = 100
    lr: float = 1e-4
    weight_decay: float = 0.0
    # scoring and calibration: the LM suite's (same held-out texts and windows, same files)
    max_length: int = 64
    test_examples: int = 32
    calibration_samples: int = 64
    eval_batch_size: int = 8
    seed: int = 0


SMOKE_LM_FULL = LMFullSettings(
    base="tiny-random-llama",
    train_max_length=32,
    max_length=32,
    batch_size=4,
    steps=4,
    lr=1e-2,  # large enough that every weight (norms at 1.0 too) moves by a bfloat16 step
    test_examples=16,
    calibration_samples=8,
)


class LMFullSuite(LMSuite):
    # the LM suite's name and cache folder: its float32 base and calibration files are shared,
    # and the table id is ``lm_full``
    name = "lm"
    variants = ("full",)
    merge_dtype = "bfloat16"

    def make_settings(self, smoke: bool) -> LMFullSettings:
        return SMOKE_LM_FULL if smoke else LMFullSettings()

    def title(self, variant: str) -> str:
        return "lm suite (full fine-tunes, bfloat16 checkpoints)"

    @property
    def _dtype(self) -> torch.dtype:
        return getattr(torch, self.settings.checkpoint_dtype)

    # -- base -----------------------------------------------------------------------
    def base(self) -> tuple[str, dict[str, Any]]:
        return self._checkpoint_base()

    @memoized
    def _checkpoint_base(self) -> tuple[str, dict[str, Any]]:
        """The LM suite's float32 base saved in the checkpoint dtype (built once)."""
        source, source_record = LMSuite.base(self)
        dtype = self._dtype
        recipe = {"kind": "lm-base-copy", "source": source_record["hash"], "dtype": str(dtype)}

        def build(out: str) -> None:
            import transformers

            model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
            model.to(dtype).save_pretrained(out)
            _tokenizer(source).save_pretrained(out)

        folder = os.path.join(self.root, f"base_{self.settings.checkpoint_dtype}")
        return folder, cached_build(folder, recipe, build)

    # -- experts ----------------------------------------------------------------------
    def expert(self, variant: str, task: str) -> Expert:
        if variant != "full":
            raise ValueError(f"lm full suite: unknown variant {variant!r}; use 'full'")
        base_dir, base_record = self.base()
        data = self.task(task)
        s = self.settings
        recipe = {
            "kind": "lm-full-expert",
            "task": task,
            "data": data.fingerprint,
            "base": base_record["hash"],
            "settings": self.recipe_settings(),
        }

        def build(out: str) -> dict[str, Any]:
            import transformers

            torch.manual_seed(s.seed)
            tok = _tokenizer(base_dir)
            # float32 master weights: the bfloat16 base loads exactly, the small AdamW steps
            # accumulate without rounding, and only the saved checkpoint is rounded
            model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
            for p in model.parameters():
                p.requires_grad_(True)
            summary = train_loop(
                model,
                lm_loss_of_batch(model, tok, data.train_inputs, s.train_max_length),
                seeded_batches(len(data.train_inputs), s.batch_size, s.steps, s.seed),
                s.steps,
                s.lr,
                weight_decay=s.weight_decay,
                desc=f"lm_full/{task}",
            )
            model.eval().to(self._dtype).save_pretrained(out)
            tok.save_pretrained(out)
            return summary

        folder = os.path.join(self.root, variant, task)
        record = cached_build(folder, recipe, build)
        return Expert(task=task, body=folder, full=folder, head=None, record=record)
