"""pytest plugin (``-p mksuite_imported``): mergekit's suite with ``mergekit_ext`` imported
first, before any test module, as in a program that imports both."""

from __future__ import annotations

import mergekit_ext  # noqa: F401 (the import is the point)


def pytest_report_header() -> str:
    return f"mksuite: imported mergekit_ext from {mergekit_ext.__file__}"
