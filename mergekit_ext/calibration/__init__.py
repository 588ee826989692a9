"""Calibration data for data-aware merge methods: sources, sampling and activation statistics.

See :mod:`mergekit_ext.calibration.sources` (where the data comes from, how it is sampled,
tokenized and batched) and :mod:`mergekit_ext.calibration.statistics` (hooks and
accumulators of linear-layer input statistics).
"""

from mergekit_ext.calibration.config import CalibrationSpec
from mergekit_ext.calibration.sources import (
    CalibrationData,
    CalibrationSource,
    NoUnusedCalibrationData,
    check_calibration,
    check_tokenizers_match,
    detect_modality,
    get_source,
    load_calibration,
    register_source,
    same_source,
)
from mergekit_ext.calibration.statistics import (
    ActivationStatistics,
    LinearInputCapture,
    flatten_tokens,
)

__all__ = [
    "ActivationStatistics",
    "CalibrationData",
    "CalibrationSource",
    "CalibrationSpec",
    "LinearInputCapture",
    "NoUnusedCalibrationData",
    "check_calibration",
    "check_tokenizers_match",
    "detect_modality",
    "flatten_tokens",
    "get_source",
    "load_calibration",
    "register_source",
    "same_source",
]
