"""The package's version, in a module of its own: every module that names the version
imports it from here, never from the package's ``__init__`` (which wires the API and the
method registration, the top layer; docs/architecture.md). Kept equal to
``pyproject.toml``'s ``version`` (tests/test_startup_and_api.py)."""

__version__ = "0.1.0"
