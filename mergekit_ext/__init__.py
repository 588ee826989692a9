"""mergekit-ext: new model-merging methods for mergekit.

Importing this package registers every mergekit-ext method (new names only: mergekit's
registry gets the tensor-wise ones, ACE and WUDI) and changes nothing else of mergekit: our
architecture definitions apply inside our own runs
(:func:`mergekit_ext.models.mergekit_definitions.our_architectures`).
:func:`run_merge` merges a mergekit(-ext) YAML with any method, as ``mergekit-ext run``;
:func:`diagnose_merge`, :func:`write_card` and :func:`publish` are ``mergekit-ext diagnose``,
``card`` and ``publish`` (:mod:`mergekit_ext.api`).

Library code never configures logging (``logging.NullHandler`` only): a script sees our
warnings through its own logging setup, and nothing else.

The ``mergekit-ext`` command itself starts without torch: when this package is imported by
it (:mod:`mergekit_ext.entry`), the registration and the API wait for the command that
needs them, so ``mergekit-ext --version`` answers at once.
"""

import logging as _logging
import os as _os
import sys as _sys
from typing import Any as _Any

from mergekit_ext._version import __version__

_logging.getLogger(__name__).addHandler(_logging.NullHandler())

_API = {
    "MergeResult": "mergekit_ext.api",
    "as_config": "mergekit_ext.api",
    "run_merge": "mergekit_ext.api",
    "diagnose_merge": "mergekit_ext.api",
    "write_card": "mergekit_ext.api",
    "publish": "mergekit_ext.api",
    "ExtMergeConfig": "mergekit_ext.config",
    "load_config": "mergekit_ext.config",
    "parse_config": "mergekit_ext.config",
    "RunOptions": "mergekit_ext.runner",
}

__all__ = [
    "ExtMergeConfig",
    "MergeResult",
    "RunOptions",
    "__version__",
    "as_config",
    "diagnose_merge",
    "load_config",
    "methods",
    "parse_config",
    "publish",
    "run_merge",
    "write_card",
]


def _register() -> None:
    """Register SyMerge and our methods (each import registers once; calling this again does
    nothing). Our architecture definitions are not registered: they apply inside our runs."""
    from mergekit_ext import adaptation as adaptation  # noqa: F401  (registers SyMerge)
    from mergekit_ext import methods as methods  # noqa: F401  (registers the methods)


def _started_by_the_command() -> bool:
    """This process is the ``mergekit-ext`` command (the console script or ``python -m
    mergekit_ext``), which registers where a command needs it (:mod:`mergekit_ext.cli`)."""
    if _os.path.basename(_sys.argv[0] if _sys.argv else "") in ("mergekit-ext", "mergekit-ext.exe"):
        return True
    argv = list(getattr(_sys, "orig_argv", ()))
    return any(a == "-m" and b == "mergekit_ext" for a, b in zip(argv, argv[1:]))


def __getattr__(name: str) -> _Any:
    """The API, imported on first use where the import itself did not (the command)."""
    if name in _API:
        import importlib

        _register()
        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value
        return value
    if name == "methods":
        _register()
        from mergekit_ext import methods

        return methods
    raise AttributeError(f"module 'mergekit_ext' has no attribute {name!r}")


if not _started_by_the_command():
    _register()
    from mergekit_ext.api import (  # noqa: E402
        MergeResult,
        as_config,
        diagnose_merge,
        publish,
        run_merge,
        write_card,
    )
    from mergekit_ext.config import ExtMergeConfig, load_config, parse_config  # noqa: E402
    from mergekit_ext.runner import RunOptions  # noqa: E402
