"""pytest plugin (``-p mksuite_results``): one outcome per test, written as JSON.

``run.py`` loads it in every mode and compares the files. The JSON (path in the
``MKSUITE_RESULTS`` environment variable) holds ``tests``: node id -> ``{"outcome", "reason"}``
with outcome ``passed``, ``failed`` (the test body), ``error`` (set-up, tear-down or
collection), ``skipped``, ``xfailed`` or ``xpassed``; and what the mode really did:
``mergekit_ext_imported`` and ``merges_routed`` (None unless the routed plugin is loaded).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import pytest

_RESULTS: dict[str, dict[str, str]] = {}
# a failure outranks everything; an error in tear-down after a pass is still an error
_RANK = {"passed": 0, "skipped": 1, "xfailed": 1, "xpassed": 1, "failed": 2, "error": 3}


def _reason(report: Any) -> str:
    """One line: the exception and its message (pytest's crash line), else the skip reason."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (file, line, reason)
        return str(longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(longrepr or "")
    line = " ".join(text.split())
    return line[:300]


def _record(nodeid: str, outcome: str, reason: str) -> None:
    old = _RESULTS.get(nodeid)
    if old is None or _RANK[outcome] > _RANK[old["outcome"]]:
        _RESULTS[nodeid] = {"outcome": outcome, "reason": reason}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if hasattr(report, "wasxfail"):
        _record(report.nodeid, "xfailed" if report.skipped else "xpassed", str(report.wasxfail))
    elif report.failed:
        _record(report.nodeid, "failed" if report.when == "call" else "error", _reason(report))
    elif report.skipped:
        _record(report.nodeid, "skipped", _reason(report))
    elif report.when == "call":
        _record(report.nodeid, "passed", "")


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:  # a module that does not import: every mode must agree on that too
        lines = [line for line in str(report.longrepr).splitlines() if line.strip()]
        _record(report.nodeid, "error", (lines[-1] if lines else "collection failed")[:300])


def pytest_sessionfinish(session: pytest.Session) -> None:
    path = os.environ.get("MKSUITE_RESULTS")
    if not path:
        return
    routed = sys.modules.get("mksuite_routed")
    data = {
        "tests": _RESULTS,
        "mergekit_ext_imported": "mergekit_ext" in sys.modules,
        "merges_routed": getattr(routed, "CALLS", None),
    }
    with open(path, "w", encoding="utf-8") as fp:
        json.dump(data, fp, indent=1, sort_keys=True)
