"""The ``mergekit-ext`` console script: ``--version`` answers before torch, mergekit or
transformers load (seconds on a cold disk); every other call runs :mod:`mergekit_ext.cli`,
which registers the methods first."""

from __future__ import annotations

import sys


def main() -> None:
    if sys.argv[1:] == ["--version"]:
        from mergekit_ext._version import __version__

        print(f"mergekit-ext, version {__version__}")  # click's version_option wording
        return
    from mergekit_ext.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
