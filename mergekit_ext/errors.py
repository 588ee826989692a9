"""User-facing errors.

Every error a user can cause (bad YAML, a missing model, an unknown method, ...) is raised
as :class:`MergekitExtError`. The CLI prints its message on one line and exits non-zero;
the traceback is shown only with ``-v``.
"""

from __future__ import annotations


class MergekitExtError(Exception):
    """An error caused by the user's input, with a message that says what to do."""


class ConfigError(MergekitExtError):
    """The merge configuration (YAML) is invalid."""


class CalibrationError(MergekitExtError):
    """Calibration data is missing, empty or does not fit the models."""


class ModelInputError(MergekitExtError):
    """An input checkpoint is missing, unsafe or incompatible with the others."""


class PublishError(MergekitExtError):
    """Publishing to the Hugging Face Hub failed."""


class TensorError(MergekitExtError, ValueError):
    """A tensor cannot be merged (NaN, shape mismatch, too few experts): names the tensor."""


class NotSupportedError(MergekitExtError, NotImplementedError):
    """A documented option that is not implemented for this input (says what is missing)."""
