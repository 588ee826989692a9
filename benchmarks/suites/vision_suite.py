"""Suite 3: image classification with a small ViT pretrained inside the benchmark.

No pretrained ViT ships in a package, so the benchmark makes its own: a
``ViTForImageClassification`` (28x28 RGB inputs, 7x7 patches, 4 layers of width 128) trained from scratch on
Fashion-MNIST's training file (Debian ``dataset-fashion-mnist``). Its body
(``ViTModel`` without pooler) is the base. Experts are full fine-tunes on other image
tasks (MNIST-5k, scikit-learn digits upsampled to 28x28, Fashion-MNIST's test file with
4 grouped labels), each with its own head, saved like the text suite's experts (body /
head / full). Grayscale images are replicated to 3 channels, so that calibration images
are ordinary RGB PNG files read with the checkpoint's own image processor.
"""

from __future__ import annotations

import hashlib
import logging
import os
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
    write_marker,
)
from benchmarks.suites.tasks import IMAGE_SIZE
from benchmarks.suites.text_suite import load_head, save_head
from mergekit_ext.evaluate.scoring import batched_accuracy

LOG = logging.getLogger(__name__)

PRETRAIN_TASK = "fashion_mnist"
IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class VisionSettings:
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 512
    patch_size: int = 7  # 16 patches of 7x7 (+ CLS): cheap enough for a 2-core CPU
    pretrain_steps: int = 1000
    pretrain_batch_size: int = 128
    pretrain_lr: float = 1e-3
    steps: int = 300
    batch_size: int = 64
    lr: float = 5e-4
    test_examples: int = 1000
    calibration_samples: int = 128
    eval_batch_size: int = 256
    seed: int = 0


SMOKE_VISION = VisionSettings(
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    intermediate_size=64,
    patch_size=7,
    pretrain_steps=10,
    pretrain_batch_size=32,
    steps=4,
    batch_size=16,
    lr=1e-3,
    test_examples=64,
    calibration_samples=8,
    eval_batch_size=64,
)


def to_pixel_values(images: np.ndarray) -> torch.Tensor:
    """``uint8 [N, 28, 28]`` grayscale -> normalized ``float32 [N, 3, 28, 28]``.

    The same as the saved ``ViTImageProcessor`` does to an RGB image of the same pixels
    (rescale by 1/255, normalize with mean 0.5 and std 0.5, no resize at 28x28).
    """
    x = torch.as_tensor(images, dtype=torch.float32).div(255.0)[:, None]
    mean = torch.tensor(IMAGE_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGE_STD).view(1, 3, 1, 1)
    return (x.expand(-1, 3, -1, -1) - mean) / std


def image_processor() -> Any:
    import transformers

    return transformers.ViTImageProcessor(
        do_resize=True,
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        image_mean=list(IMAGE_MEAN),
        image_std=list(IMAGE_STD),
    )


class VisionSuite(Suite):
    name = "vision"
    metric = "accuracy"
    variants = ("full",)
    default_tasks = ("mnist", "digits", "fashion_grouped")

    def make_settings(self, smoke: bool) -> VisionSettings:
        return SMOKE_VISION if smoke else VisionSettings()

    def _config(self, num_labels: int) -> Any:
        import transformers

        s = self.settings
        return transformers.ViTConfig(
            image_size=IMAGE_SIZE,
            patch_size=s.patch_size,
            num_channels=3,
            hidden_size=s.hidden_size,
            num_hidden_layers=s.num_layers,
            num_attention_heads=s.num_heads,
            intermediate_size=s.intermediate_size,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=num_labels,
        )

    def _train_classifier(
        self, model: torch.nn.Module, task: str, steps: int, batch_size: int, lr: float, desc: str
    ) -> dict[str, Any]:
        data = self.task(task)
        images, labels = data.train_inputs, torch.as_tensor(data.train_labels)

        def loss_of_batch(idx: np.ndarray) -> torch.Tensor:
            return model(pixel_values=to_pixel_values(images[idx]), labels=labels[idx]).loss

        return train_loop(
            model,
            loss_of_batch,
            seeded_batches(len(images), batch_size, steps, self.settings.seed),
            steps,
            lr,
            weight_decay=0.05,
            desc=desc,
        )

    # -- base -----------------------------------------------------------------------
    @memoized
    def base(self) -> tuple[str, dict[str, Any]]:
        s = self.settings
        data = self.task(PRETRAIN_TASK)
        pretrain_fields = (
            "hidden_size", "num_layers", "num_heads", "intermediate_size", "patch_size",
            "pretrain_steps", "pretrain_batch_size", "pretrain_lr", "seed",
        )  # fmt: skip
        recipe = {
            "kind": "vision-base",
            "data": data.fingerprint,
            "settings": {k: v for k, v in self.settings_dict().items() if k in pretrain_fields},
        }

        def build(out: str) -> dict[str, Any]:
            import transformers

            torch.manual_seed(s.seed)
            model = transformers.ViTForImageClassification(self._config(data.num_labels))
            summary = self._train_classifier(
                model,
                PRETRAIN_TASK,
                s.pretrain_steps,
                s.pretrain_batch_size,
                s.pretrain_lr,
                "vision/pretrain",
            )
            summary["pretrain_test_accuracy"] = self._accuracy(
                lambda px: model(pixel_values=px).logits, PRETRAIN_TASK
            )
            model.vit.save_pretrained(out)
            image_processor().save_pretrained(out)
            return summary

        folder = os.path.join(self.root, "base")
        return folder, cached_build(folder, recipe, build)

    # -- experts ----------------------------------------------------------------------
    def expert(self, variant: str, task: str) -> Expert:
        if variant != "full":
            raise ValueError(f"vision suite: unknown variant {variant!r}; use 'full'")
        base_dir, base_record = self.base()
        data = self.task(task)
        s = self.settings
        recipe = {
            "kind": "vision-expert",
            "task": task,
            "data": data.fingerprint,
            "base": base_record["hash"],
            "settings": self.recipe_settings(),
        }

        def build(out: str) -> dict[str, Any]:
            import transformers

            torch.manual_seed(s.seed)
            model = transformers.ViTForImageClassification.from_pretrained(
                base_dir,
                num_labels=data.num_labels,
                id2label=dict(enumerate(data.label_names)),
                label2id={n: i for i, n in enumerate(data.label_names)},
            )
            summary = self._train_classifier(
                model, task, s.steps, s.batch_size, s.lr, f"vision/{task}"
            )
            for sub, module in (("full", model), ("body", model.vit)):
                module.save_pretrained(os.path.join(out, sub))
                image_processor().save_pretrained(os.path.join(out, sub))
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
        """A folder of ``samples`` RGB PNG training images of ``task`` (seeded)."""
        from PIL import Image

        data = self.task(task)
        n = self.settings.calibration_samples
        folder = os.path.join(self.root, "calibration", task)
        digest = hashlib.sha256(f"{data.fingerprint}:{n}".encode()).hexdigest()[:16]
        marker = folder + ".recipe"
        if not (os.path.isdir(folder) and read_marker(marker) == digest):
            os.makedirs(folder, exist_ok=True)
            for old in os.listdir(folder):
                os.remove(os.path.join(folder, old))
            order = np.random.default_rng(self.settings.seed).permutation(len(data.train_inputs))
            for i, idx in enumerate(order[:n]):
                Image.fromarray(data.train_inputs[idx]).convert("RGB").save(
                    os.path.join(folder, f"{i:05d}.png")
                )
            write_marker(marker, digest)
        return {"path": folder, "samples": n}

    # -- scoring --------------------------------------------------------------------
    def _accuracy(self, logits_of, task: str) -> float:
        data = self.task(task)
        n = self.settings.test_examples
        images, labels = data.test_inputs[:n], np.asarray(data.test_labels[:n])
        return batched_accuracy(
            logits_of,
            lambda start, stop: to_pixel_values(images[start:stop]),
            labels,
            batch_size=self.settings.eval_batch_size,
        )

    def evaluate_body(self, body: str, experts: dict[str, Expert]) -> dict[str, float]:
        import transformers

        model = transformers.ViTModel.from_pretrained(body, add_pooling_layer=False).eval()
        scores = {}
        for task, expert in experts.items():
            head = load_head(expert.head)
            scores[task] = self._accuracy(
                lambda px, head=head: head(model(pixel_values=px).last_hidden_state[:, 0]), task
            )
        return scores

    def evaluate_full(self, folder: str, task: str) -> float:
        import transformers

        model = transformers.ViTForImageClassification.from_pretrained(folder).eval()
        return self._accuracy(lambda px: model(pixel_values=px).logits, task)
