"""What the models say about their inputs: modality, tokenizer, image processor."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import torch

from mergekit_ext.calibration.config import CalibrationSpec
from mergekit_ext.errors import CalibrationError, ModelInputError

if TYPE_CHECKING:
    import PIL.Image

from mergekit_ext.calibration.sources.base import (
    IMAGE_MODEL_TYPES,
    Modality,
)
from mergekit_ext.calibration.sources.sampling import (
    _jsonable,
)

LOG = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------
# Models: modality, tokenizer, image processor


def _model_folder(model_path: str) -> str:
    """The folder whose config/tokenizer/processor describe ``model_path``.

    mergekit's ``base+lora`` syntax and PEFT adapter folders resolve to the base model.
    """
    if "+" in model_path and not os.path.exists(model_path):
        model_path = model_path.split("+", 1)[0]
    adapter = os.path.join(model_path, "adapter_config.json")
    if not os.path.isfile(os.path.join(model_path, "config.json")) and os.path.isfile(adapter):
        with open(adapter, encoding="utf-8") as fp:
            base = json.load(fp).get("base_model_name_or_path")
        if base:
            return _model_folder(base)
    return model_path


def _model_config(model_path: str, trust_remote_code: bool = False) -> dict[str, Any]:
    folder = _model_folder(model_path)
    config_file = os.path.join(folder, "config.json")
    if os.path.isfile(config_file):
        with open(config_file, encoding="utf-8") as fp:
            return json.load(fp)
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code).to_dict()
    except Exception as e:
        raise ModelInputError(f"cannot read the config of model {model_path!r}: {e}") from e


def detect_modality(model_path: str) -> Modality:
    """``image`` for vision checkpoints (ViT, CLIP, DeiT, ... by ``model_type``), else ``text``.

    A whole CLIP model counts as ``image`` (its vision tower is what gets merged); pass
    ``modality="text"`` to :func:`load_calibration` for its text tower.
    """
    config = _model_config(model_path)
    model_type = str(config.get("model_type", "")).lower()
    if model_type in IMAGE_MODEL_TYPES:
        return "image"
    architectures = " ".join(config.get("architectures") or [])
    if "ImageClassification" in architectures or "VisionModel" in architectures:
        return "image"
    if "vocab_size" not in config and "num_channels" in config and "image_size" in config:
        return "image"
    return "text"


def _load_tokenizer(model_path: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    from mergekit_ext.models.model_paths import is_config_only

    folder = _model_folder(model_path)
    if is_config_only(folder) and not _has_tokenizer_files(folder):
        # A dry run of a folder with only config.json: name what to download, not the
        # tokenizer class's own error about a missing vocabulary file.
        raise CalibrationError(
            f"model {model_path!r} has no weights and no tokenizer (only config.json); the "
            "calibration text is tokenized with the model's tokenizer: download its tokenizer "
            'files too (`hf download ORG/NAME --include "*.json" "*.model" --local-dir '
            f"{folder}` fetches config and tokenizer, no weights), or give pre-tokenized "
            "calibration data (a .safetensors file of input_ids)"
        )
    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception as e:
        present = [n for n in _TOKENIZER_NAMES if os.path.isfile(os.path.join(folder, n))]
        advice = (
            f"its tokenizer files in {folder} ({', '.join(present)}) are there but cannot be "
            "read: replace them with good copies from where the model came from"
            if present
            else "save the tokenizer next to the weights"
        )
        raise CalibrationError(
            f"cannot load the tokenizer of model {model_path!r} ({type(e).__name__}: {e}); {advice}"
        ) from e


_TOKENIZER_NAMES = ("tokenizer.json", "tokenizer.model", "vocab.txt", "vocab.json", "spiece.model")


def _has_tokenizer_files(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, n)) for n in _TOKENIZER_NAMES)


def check_tokenizers_match(model_paths: Sequence[str]) -> None:
    """Raise a :class:`CalibrationError` naming two models whose vocabularies differ.

    Data-aware merging tokenizes every task once and runs the tokens through base, experts
    and the merged model, so all of them must share one vocabulary.
    """
    reference_path: Optional[str] = None
    reference_vocab: dict[str, int] = {}
    for path in dict.fromkeys(model_paths):
        vocab = _load_tokenizer(path).get_vocab()
        if reference_path is None:
            reference_path, reference_vocab = path, vocab
            continue
        if vocab == reference_vocab:
            continue
        example = next(
            (t for t in sorted(reference_vocab) if vocab.get(t) != reference_vocab[t]), None
        )
        if example is None:
            example = next(t for t in sorted(vocab) if t not in reference_vocab)
        detail = (
            f"token {example!r} is id {reference_vocab.get(example)} in {reference_path!r} "
            f"and id {vocab.get(example)} in {path!r}"
        )
        raise CalibrationError(
            f"the tokenizers of {reference_path!r} and {path!r} have different vocabularies "
            f"({len(reference_vocab)} vs {len(vocab)} tokens; {detail}); data-aware merging "
            "needs models that share one tokenizer"
        )


class _ImagePreprocessor:
    """The model's own image processor, or the explicit ``image_size/mean/std`` of the spec.

    With any explicit override: resize to ``image_size x image_size`` (bicubic), scale to
    [0, 1], normalize with ``image_mean/image_std``; values not given come from the model's
    image processor config (size: the model config's ``image_size``).
    """

    def __init__(self, spec: CalibrationSpec, model_path: str, task: str) -> None:
        self.processor: Any = None
        folder = _model_folder(model_path)
        try:
            from transformers import AutoImageProcessor

            self.processor = AutoImageProcessor.from_pretrained(folder)
        except Exception as e:
            processor_error: Optional[Exception] = e
        else:
            processor_error = None
        self.explicit = (
            spec.image_size is not None or spec.image_mean is not None or spec.image_std is not None
        )
        if not self.explicit:
            if self.processor is None:
                raise CalibrationError(
                    f"model {task}: cannot load the image processor of {model_path!r} "
                    f"({processor_error}); save it next to the weights or give image_size, "
                    "image_mean and image_std in the calibration section"
                )
            self.settings: dict[str, Any] = {"image_processor": _jsonable(self.processor.to_dict())}
            return
        config = _model_config(model_path)
        vision = config.get("vision_config") or {}
        size = spec.image_size or config.get("image_size") or vision.get("image_size")
        mean = spec.image_mean or getattr(self.processor, "image_mean", None)
        std = spec.image_std or getattr(self.processor, "image_std", None)
        if size is None or mean is None or std is None:
            raise CalibrationError(
                f"model {task}: explicit image preprocessing needs image_size, image_mean and "
                f"image_std (got {size}, {mean}, {std}) and {model_path!r} has no image processor "
                "to take the missing ones from"
            )
        if len(mean) != len(std) or len(mean) not in (1, 3):
            raise CalibrationError(
                f"model {task}: image_mean and image_std need 1 or 3 values each (got {mean}, {std})"
            )
        self.size, self.mean, self.std = (
            int(size),
            [float(v) for v in mean],
            [float(v) for v in std],
        )
        self.settings = {"image_size": self.size, "image_mean": self.mean, "image_std": self.std}

    def __call__(self, images: list[PIL.Image.Image]) -> torch.Tensor:
        if not self.explicit:
            return self.processor(images=images, return_tensors="pt")["pixel_values"].to(
                torch.float32
            )
        import numpy as np
        from PIL import Image

        mode = "L" if len(self.mean) == 1 else "RGB"
        mean = np.asarray(self.mean, dtype=np.float32)
        std = np.asarray(self.std, dtype=np.float32)
        arrays = []
        for image in images:
            resized = image.convert(mode).resize((self.size, self.size), Image.Resampling.BICUBIC)
            array = np.asarray(resized, dtype=np.float32).reshape(self.size, self.size, -1) / 255.0
            arrays.append(((array - mean) / std).transpose(2, 0, 1))
        return torch.from_numpy(np.stack(arrays)).to(torch.float32)


def _patches_per_image(model_path: str, height: int, width: int) -> int:
    config = _model_config(model_path)
    patch = config.get("patch_size") or (config.get("vision_config") or {}).get("patch_size")
    if isinstance(patch, (list, tuple)):
        return (height // int(patch[0])) * (width // int(patch[1]))
    return (height // int(patch)) * (width // int(patch)) if patch else 1
