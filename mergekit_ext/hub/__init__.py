"""Model cards and Hub publishing for finished merges.

- :func:`write_model_card` (``hub/card.py``): README.md with metadata, diagnostics and plots,
  offline; templates in ``hub/templates/`` (also ``model_cards/`` in a source checkout).
- :func:`publish_folder` (``hub/publish.py``): checks and uploads a folder in one commit.
- :class:`~mergekit_ext.hub.actions.HubActions` (``hub/actions.py``): the card and the upload
  of a merge, handed to the runner by the entry points.
- the ``card`` and ``publish`` click commands live with the entry points
  (``mergekit_ext/cli_hub.py``).

Imports are lazy so that ``import mergekit_ext`` does not pull in matplotlib.
"""

from __future__ import annotations

from typing import Any

__all__ = ["publish_folder", "write_model_card"]


def __getattr__(name: str) -> Any:
    if name == "write_model_card":
        from mergekit_ext.hub.card import write_model_card

        return write_model_card
    if name == "publish_folder":
        from mergekit_ext.hub.publish import publish_folder

        return publish_folder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
