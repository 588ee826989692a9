"""mergekit-ext: new model-merging methods for mergekit.

Importing this package registers every mergekit-ext method with mergekit's registry.
"""

__version__ = "0.1.0"

from mergekit_ext import (
    architectures as architectures,  # noqa: E402,F401  (registers architectures)
)
from mergekit_ext import methods as methods  # noqa: E402  (registers the methods)

__all__ = ["__version__", "methods"]
