"""RegMean and CoM on bfloat16 checkpoints, float32 against bfloat16 passes (issue #31).

The four suites' experts are float32 checkpoints, so their compute-dtype tables measure
bfloat16 passes whose statistics keep the unrounded norm outputs. This probe measures the
other case, ``auto``'s: a suite's base body and full experts saved in bfloat16 (cast from the
suite's cached float32 models, which are built or reused as the suite builds them), merged
with ``compute_dtype: float32`` and ``bfloat16``. With bfloat16 checkpoints a bfloat16 pass
records each linear's input rounded to bfloat16, as the merged model multiplies it
(``ComputeChoice.rounds_inputs``). The merges write bfloat16, and every body (base, experts,
merges) is scored running in bfloat16 with the experts' float32 heads.

    python -m benchmarks.probes.bf16_checkpoints_suite --suite text --threads 1
    python -m benchmarks.probes.bf16_checkpoints_suite --suite vision --threads 1
    python -m benchmarks.probes.bf16_checkpoints_suite --suite lm --threads 1

Writes ``benchmarks/results/sweep_<suite>_<variant>_bf16_checkpoints_compute_dtype.{md,json,png}``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

from benchmarks.suites.cache import cached_build, default_cache_dir
from benchmarks.suites.lm_suite import LMSuite, _tokenizer
from benchmarks.suites.run import configure_process, run_variant, select_rows
from benchmarks.suites.suite_base import Expert, Suite, memoized
from benchmarks.suites.sweep import sweep_rows
from benchmarks.suites.text_suite import TextSuite, load_head
from benchmarks.suites.vision_suite import VisionSuite, image_processor


class Bfloat16Checkpoints:
    """Mixin over a suite class: its base and experts as bfloat16 checkpoints.

    ``source_class`` builds (or reuses) the float32 models; ``body_class`` loads a body
    (``body_kwargs`` beside ``dtype``)."""

    merge_dtype = "bfloat16"
    source_class: type[Suite]
    body_class: str
    body_kwargs: dict[str, Any] = {}
    root: str

    def __init__(self, cache_dir: str, smoke: bool) -> None:
        super().__init__(cache_dir, smoke)  # type: ignore[call-arg]
        self.source = self.source_class(cache_dir, smoke)  # type: ignore[call-arg]

    def _body(self, folder: str, dtype: torch.dtype) -> Any:
        import transformers

        loader = getattr(transformers, self.body_class)
        return loader.from_pretrained(folder, dtype=dtype, **self.body_kwargs)

    def _save_processor(self, source: str, out: str) -> None:
        import transformers

        transformers.AutoTokenizer.from_pretrained(source).save_pretrained(out)

    def _copy(self, source: str, folder: str, source_record: dict[str, Any]) -> tuple[str, dict]:
        """``source`` (a body folder) saved in bfloat16 under ``folder`` (cached)."""

        def build(out: str) -> None:
            self._body(source, torch.float32).to(torch.bfloat16).save_pretrained(out)
            self._save_processor(source, out)

        recipe = {"kind": "bfloat16-copy", "source": source_record["hash"]}
        return folder, cached_build(folder, recipe, build)

    @memoized
    def base(self) -> tuple[str, dict[str, Any]]:
        folder, record = self.source.base()
        return self._copy(folder, os.path.join(self.root, "base"), record)

    def expert(self, variant: str, task: str) -> Expert:
        expert = self.source.expert(variant, task)
        body, record = self._copy(
            expert.body, os.path.join(self.root, variant, task), expert.record
        )
        # a causal LM's body is the whole model; no adapter of the bfloat16 weights is kept
        full = body if expert.full == expert.body else expert.full
        return Expert(task=task, body=body, full=full, head=expert.head, record=record)


class Bfloat16TextSuite(Bfloat16Checkpoints, TextSuite):
    name = "text-bf16"
    variants = ("full",)
    source_class = TextSuite
    body_class = "BertModel"

    def evaluate_body(self, body: str, experts: dict[str, Expert]) -> dict[str, float]:
        import transformers

        model = self._body(body, torch.bfloat16).eval()
        tok = transformers.AutoTokenizer.from_pretrained(body)
        return {
            task: self._accuracy(
                lambda enc, head=load_head(e.head): head(model(**enc).pooler_output.float()),
                task,
                tok,
            )
            for task, e in experts.items()
        }


class Bfloat16VisionSuite(Bfloat16Checkpoints, VisionSuite):
    name = "vision-bf16"
    source_class = VisionSuite
    body_class = "ViTModel"
    body_kwargs = {"add_pooling_layer": False}

    def _save_processor(self, source: str, out: str) -> None:
        image_processor().save_pretrained(out)

    def evaluate_body(self, body: str, experts: dict[str, Expert]) -> dict[str, float]:
        model = self._body(body, torch.bfloat16).eval()
        return {
            task: self._accuracy(
                lambda px, head=load_head(e.head): head(
                    model(pixel_values=px.bfloat16()).last_hidden_state[:, 0].float()
                ),
                task,
            )
            for task, e in experts.items()
        }


class Bfloat16LMSuite(Bfloat16Checkpoints, LMSuite):
    """SmolLM2 and its LoRA experts (merged into full weights) as bfloat16 checkpoints, as
    causal LMs ship; scored by next-token loss running in bfloat16."""

    name = "lm-bf16"
    source_class = LMSuite
    body_class = "AutoModelForCausalLM"

    def evaluate_body(self, body: str, experts: dict[str, Expert]) -> dict[str, float]:
        model = self._body(body, torch.bfloat16).eval()
        tok = _tokenizer(body)
        return {task: self._loss(model, tok, task) for task in experts}


SUITES = {"text": Bfloat16TextSuite, "vision": Bfloat16VisionSuite, "lm": Bfloat16LMSuite}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=sorted(SUITES), default="text")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache-dir", default=default_cache_dir())
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    args = parser.parse_args(argv)
    configure_process(args.threads)
    suite = SUITES[args.suite](args.cache_dir, smoke=False)
    rows = sweep_rows(
        select_rows(["regmean", "row:chain_of_merges"], smoke=False),
        "compute_dtype",
        ["float32", "bfloat16"],
    )
    result = run_variant(
        suite,
        suite.variants[0],
        rows,
        args.out,
        keep_merges=False,
        result_id=f"sweep_{args.suite}_{suite.variants[0]}_bf16_checkpoints_compute_dtype",
        title_suffix=" as bfloat16 checkpoints, sweep of compute_dtype",
    )
    print(result["title"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
