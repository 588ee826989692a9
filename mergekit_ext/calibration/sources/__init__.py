"""Calibration data: where a task's examples come from and how they become model inputs.

A :class:`~mergekit_ext.calibration.config.CalibrationSpec` names the data of one task:

- ``path``: a local file (``.jsonl``/``.json``/``.csv``/``.parquet``/``.txt``, read with
  ``datasets.load_dataset``; ``.safetensors`` with pre-tokenized ``input_ids`` [+
  ``attention_mask``] or preprocessed ``pixel_values``) or a folder (saved with
  ``datasets.save_to_disk``, or a folder of images searched recursively);
- ``dataset``: a Hugging Face Hub dataset (only online);
- ``source``: a custom source registered with :func:`register_source`.

Conventions (``docs/methods.md``, "Calibration conventions"): one sample is one text (or
image), tokenized with the tokenizer's defaults (special tokens included) and truncated to
``max_length``; ``pack: true`` instead cuts the concatenated token stream into windows of
``max_length`` and then ``samples`` counts windows. ``samples: N`` takes N samples after a
shuffle seeded by ``seed``; a source with fewer uses all of them with a warning, an empty
source is an error. Batches are right padded with an attention mask; statistics drop the
padded positions (:mod:`mergekit_ext.calibration.statistics`). Loading is deterministic:
the same spec, seed and tokenizer give identical batches and the same ``sha256``.

Held-out data (``mergekit-ext diagnose``): ``load_calibration(spec, ..., exclude=[specs the
merge used])`` leaves out every example that loading those specs reads (same source, same
shuffle, same tokenization), so the result holds only examples the merge never saw; when
none is left it raises :class:`NoUnusedCalibrationData`.
"""

from __future__ import annotations

from mergekit_ext.calibration.sources.base import (
    DATASET_FORMATS,
    IMAGE_COLUMNS,
    IMAGE_EXTENSIONS,
    IMAGE_MODEL_TYPES,
    TEXT_COLUMNS,
    CalibrationData,
    CalibrationSource,
    Modality,
    get_source,
    register_source,
)
from mergekit_ext.calibration.sources.files import (
    check_calibration,
    describe_split,
    in_memory,
)
from mergekit_ext.calibration.sources.heldout import (
    same_source,
)
from mergekit_ext.calibration.sources.load import (
    load_calibration,
)
from mergekit_ext.calibration.sources.models import (
    check_tokenizers_match,
    detect_modality,
)
from mergekit_ext.calibration.sources.sampling import (
    NoUnusedCalibrationData,
)

__all__ = [
    "CalibrationData",
    "CalibrationSource",
    "DATASET_FORMATS",
    "IMAGE_COLUMNS",
    "IMAGE_EXTENSIONS",
    "IMAGE_MODEL_TYPES",
    "Modality",
    "NoUnusedCalibrationData",
    "TEXT_COLUMNS",
    "check_calibration",
    "check_tokenizers_match",
    "describe_split",
    "detect_modality",
    "get_source",
    "in_memory",
    "load_calibration",
    "register_source",
    "same_source",
]
