"""What the command line prints on stderr: one ``warning:`` and one ``error:`` style, phase lines.

Every ``mergekit-ext`` command runs inside :func:`cli_errors`, which sets up logging once
(:func:`configure_logging`) and routes it through ``tqdm.contrib.logging.logging_redirect_tqdm``
so that a warning logged while a progress bar is drawn lands on its own line instead of
breaking the bar. Library code only logs; it never prints warnings itself.

Levels: ``LOG.warning`` prints as ``warning: ...`` and ``LOG.error`` as ``error: ...`` at
every verbosity; :func:`phase` lines (the short steps after the last block: finiteness,
completeness, tokenizer, card) are shown without ``-v``; other INFO lines need ``-v``, DEBUG
``-vv``.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from mergekit_ext.errors import MergekitExtError

# Shown without -v by the commands (configure_logging sets its level); library code never
# sets a level or a handler, so a script's own logging setup decides what it sees.
PHASES = logging.getLogger("mergekit_ext.phases")


def phase(message: str) -> None:
    """Log one short status line for a phase of the run (shown without ``-v``)."""
    PHASES.info("%s", message)


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info and record.levelno >= logging.ERROR:
            message += "\n" + self.formatException(record.exc_info)
        if record.levelno >= logging.ERROR:
            return f"error: {message}"
        if record.levelno >= logging.WARNING:
            return f"warning: {message}"
        if record.name == PHASES.name:
            return message
        return f"{record.levelname.lower()}: {record.name}: {message}"


class _StderrHandler(logging.StreamHandler):
    """Writes to the current ``sys.stderr`` (click's test runner replaces it per call)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def configure_logging(verbosity: int) -> None:
    """The root logger's one stderr handler (replacing ours from an earlier command in the
    same process) at WARNING, INFO (``-v``) or DEBUG (``-vv``)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, _StderrHandler):
            root.removeHandler(handler)
    handler = _StderrHandler()
    handler.setFormatter(_Formatter())
    root.addHandler(handler)
    root.setLevel(
        logging.DEBUG if verbosity > 1 else logging.INFO if verbosity == 1 else logging.WARNING
    )
    PHASES.setLevel(logging.DEBUG if verbosity > 1 else logging.INFO)  # a line per phase
    logging.captureWarnings(True)  # Python warnings in the same `warning:` style


def _with_rank(message: str) -> str:
    """Name this process's rank in errors of a merge launched on several processes."""
    world, rank = os.environ.get("WORLD_SIZE", "1"), os.environ.get("RANK", "0")
    if world in ("", "0", "1") or message.startswith("rank "):
        return message
    return f"rank {rank}/{world}: {message}"


def cli_errors(verbose_of: Callable[[dict[str, Any]], int]) -> Callable:
    """Run a click command with logging set up and redirected through tqdm; print an error
    on one ``error: ...`` line and exit 1 (the traceback only with ``-v``).

    Interrupts (``KeyboardInterrupt`` and its subclasses for signals) are left to the caller.
    """
    import click
    from tqdm.contrib.logging import logging_redirect_tqdm

    def decorator(f: Callable) -> Callable:
        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            verbosity = verbose_of(kwargs)
            configure_logging(verbosity)
            try:
                with logging_redirect_tqdm():
                    return f(*args, **kwargs)
            except (click.exceptions.Exit, click.ClickException, click.Abort):
                raise
            except Exception as e:  # noqa: BLE001 - the CLI boundary
                if verbosity > 0:
                    traceback.print_exc()
                prefix = (
                    "error" if isinstance(e, MergekitExtError) else f"error ({type(e).__name__})"
                )
                text = e.message if isinstance(e, MergekitExtError) else str(e)
                message = _with_rank(" ".join(text.split()) or type(e).__name__)
                hint = (
                    ""
                    if verbosity > 0 or isinstance(e, MergekitExtError)
                    else " [run with -v for the traceback]"
                )
                click.echo(f"{prefix}: {message}{hint}", err=True)
                if getattr(e, "details", ""):  # a help block (a file format): as written
                    click.echo(e.details.rstrip("\n"), err=True)  # type: ignore[attr-defined]
                sys.exit(1)

        return wrapper

    return decorator
