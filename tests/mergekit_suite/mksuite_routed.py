"""pytest plugin (``-p mksuite_routed``): every merge of mergekit's suite runs through
``mergekit_ext.run_merge`` (as ``mergekit-ext run`` runs it), mergekit's assertions unchanged.

mergekit's tests call ``mergekit.merge.run_merge(config, out_path, options)``, directly or
through ``tests/common.py``, and some bind it with ``from mergekit.merge import run_merge``.
The swap happens on ``mergekit.merge`` when this plugin loads (before any test module is
imported), and again on every module that still holds mergekit's function once collection
is done. ``CALLS`` counts the merges routed; ``run.py`` refuses a routed run that routed none.

``mergekit_ext`` itself runs mergekit's methods with ``mergekit.merge.run_merge`` (imported at
call time, so it finds the swapped function): inside a routed merge the call goes to
mergekit's function.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import mergekit.merge
import pytest
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions

import mergekit_ext

MERGEKIT_RUN_MERGE = mergekit.merge.run_merge
CALLS = 0
_inside = False  # a routed merge is running (mergekit's tests merge one at a time)


def run_merge_via_ext(
    merge_config: MergeConfiguration,
    out_path: str,
    options: Optional[MergeOptions] = None,
    config_source: Optional[str] = None,
) -> None:
    """mergekit's ``run_merge`` signature, merging with ``mergekit_ext.run_merge``.

    ``config_source`` (the YAML text for mergekit's README) has no counterpart: our card is
    written from the config itself. mergekit returns None, so this does too."""
    global CALLS, _inside
    if _inside:  # mergekit_ext running a mergekit method: mergekit's own executor
        MERGEKIT_RUN_MERGE(merge_config, out_path, options, config_source=config_source)
        return
    CALLS += 1
    _inside = True
    try:
        mergekit_ext.run_merge(merge_config, os.fspath(out_path), options)
    finally:
        _inside = False


def _swap_everywhere() -> None:
    for module in list(sys.modules.values()):
        if module is sys.modules[__name__]:
            continue
        for name, value in list(getattr(module, "__dict__", {}).items()):
            if value is MERGEKIT_RUN_MERGE:
                setattr(module, name, run_merge_via_ext)


_swap_everywhere()


def pytest_collection_finish(session: pytest.Session) -> None:
    # a module imported mergekit's function before this plugin loaded: swap it there too
    _swap_everywhere()


def pytest_report_header() -> str:
    return f"mksuite: merges routed through mergekit_ext.run_merge ({mergekit_ext.__file__})"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    terminalreporter.write_line(f"mksuite: {CALLS} merges went through mergekit_ext.run_merge")
