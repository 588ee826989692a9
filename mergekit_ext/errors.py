"""User-facing errors.

Every error a user can cause (bad YAML, a missing model, an unknown method, ...) is raised
as :class:`MergekitExtError`. The CLI prints its message on one line and exits non-zero;
the traceback is shown only with ``-v``.

Each class is also the built-in exception mergekit (or the library it calls) raises in the
same situation, so code written around a mergekit merge keeps catching ours (issue #48):

============================  ===================  ==========================================
class                         built-in             mergekit's own, for comparison
============================  ===================  ==========================================
ConfigError                   ValueError           pydantic ``ValidationError``, a method's
                                                   ``validate_inputs``
ConfigFileNotFoundError       ValueError,          ``open()`` of a missing file
                              FileNotFoundError
CalibrationError              ValueError           (datasets: ``ValueError`` for bad data)
CalibrationFileNotFoundError  ValueError,          ``open()`` of a missing file
                              FileNotFoundError
ModelInputError               RuntimeError         "Tensor ... required but not present",
                                                   "--allow-crimes", "Unable to find model files"
ModelNotFoundError            RuntimeError,        a missing shard (``FileNotFoundError``),
                              FileNotFoundError    a missing model folder (``RuntimeError``)
TensorError                   ValueError           shape and value checks of the methods
NotSupportedError             NotImplementedError
ExecutionError                RuntimeError         torch's device and launch errors
PluginError                   RuntimeError
PublishError                  OSError              huggingface_hub's ``HfHubHTTPError``
============================  ===================  ==========================================

``except MergekitExtError`` still catches every one of them.
"""

from __future__ import annotations


class MergekitExtError(Exception):
    """An error caused by the user's input, with a message that says what to do.

    ``details`` is an optional block of several lines shown after the message as it is
    written (an accepted file format with its ``#`` comments, issue #52): the CLI prints the
    message on its one ``error:`` line and the block below it, never flattened into it.
    """

    def __init__(self, *args: object, details: str = "") -> None:
        super().__init__(*args)
        self.details = details

    @property
    def message(self) -> str:
        """The message without ``details``."""
        return super().__str__()

    def __str__(self) -> str:
        text = super().__str__()
        return f"{text}\n{self.details.rstrip()}" if self.details else text


class ConfigError(MergekitExtError, ValueError):
    """The merge configuration (YAML) is invalid."""


class ConfigFileNotFoundError(ConfigError, FileNotFoundError):
    """A file the configuration or a command line names (the YAML, ``--heldout``, evaluation
    results) does not exist."""


class CalibrationError(MergekitExtError, ValueError):
    """Calibration data is missing, empty or does not fit the models."""


class CalibrationFileNotFoundError(CalibrationError, FileNotFoundError):
    """A calibration file or folder the configuration names does not exist."""


class ModelInputError(MergekitExtError, RuntimeError):
    """An input checkpoint is missing, unsafe or incompatible with the others."""


class ModelNotFoundError(ModelInputError, FileNotFoundError):
    """An input model folder, or a file its checkpoint needs, does not exist."""


class ExecutionError(MergekitExtError, RuntimeError):
    """The merge cannot run as launched or on the device asked for, or a model's forward
    pass did not go through its blocks as the executor expects."""


class PublishError(MergekitExtError, OSError):
    """Publishing to the Hugging Face Hub failed."""


class TensorError(MergekitExtError, ValueError):
    """A tensor cannot be merged (NaN, shape mismatch, too few experts): names the tensor."""


class NotSupportedError(MergekitExtError, NotImplementedError):
    """A documented option that is not implemented for this input (says what is missing)."""


class PluginError(MergekitExtError, RuntimeError):
    """Code the user loaded (``--plugin``, a custom calibration source) failed or exited."""


def plugin_exit_error(exc: SystemExit, who: str) -> PluginError:
    """A ``sys.exit()`` inside ``who`` (user code) as a failure, naming where it was called.

    ``sys.exit(0)`` in a plugin would otherwise end ``run`` with status 0 and no output, as
    if the merge had succeeded.
    """
    tb, where = exc.__traceback__, ""
    while tb is not None:  # the innermost frame: the line that called sys.exit
        where = f" at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return PluginError(
        f"{who} called sys.exit({exc.code!r}){where}; user code must raise an exception, "
        "not exit: the merge stopped and nothing was written"
    )
