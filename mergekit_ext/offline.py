"""Whether the Hugging Face Hub is offline: the one place mergekit-ext asks.

A module of its own in the lowest layer because every layer asks it (the model readers, the
checks, publishing), and the answer must be the one huggingface_hub itself acts on.
"""

from __future__ import annotations


def hub_offline() -> bool:
    """Whether the Hub is offline (``HF_HUB_OFFLINE`` as huggingface_hub read it,
    ``is_offline_mode()``)."""
    from huggingface_hub import constants

    return constants.is_offline_mode()
