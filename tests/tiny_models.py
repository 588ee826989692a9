"""Re-export of :mod:`mergekit_ext.testing` (the tiny checkpoint builders) for the tests."""

from mergekit_ext.testing import *  # noqa: F403
from mergekit_ext.testing import (  # noqa: F401
    SPECIAL,
    VOCAB_SIZE,
    WORDS,
    make_experts,
    make_tiny_bert,
    make_tiny_clip,
    make_tiny_clip_vision,
    make_tiny_llama,
    make_tiny_vit,
)
