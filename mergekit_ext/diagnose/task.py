"""One task of ``mergekit-ext diagnose``: its expert, its data, what was measured on.

Apart from :mod:`~mergekit_ext.diagnose.diagnoser` so that the modules the diagnoser uses
(:mod:`~mergekit_ext.diagnose.heldout`) can name it without importing the diagnoser back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from mergekit_ext.calibration.config import CalibrationSpec
from mergekit_ext.calibration.sources import CalibrationData
from mergekit_ext.executor.plan import Source


@dataclass
class DiagnosisTask:
    """One task: its expert, calibration data and (once loaded) its evaluation batches."""

    name: str
    label: str  # the model as written in the YAML
    source: Source
    data_path: str
    calibration: CalibrationSpec  # what the merge read
    evaluation: Optional[CalibrationSpec] = None  # what diagnose runs (None: calibration)
    data: Optional[CalibrationData] = None
    data_info: dict[str, Any] = field(default_factory=dict)  # which data, for the output
    probe: Optional[CalibrationData] = None  # the off-distribution probe (text models)
    probe_info: dict[str, Any] = field(default_factory=dict)
