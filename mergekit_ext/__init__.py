"""mergekit-ext: new model-merging methods for mergekit.

Importing this package registers every mergekit-ext method with mergekit's registry (new
names only) and changes nothing else of mergekit: our architecture definitions apply inside
our own runs (:func:`mergekit_ext.models.mergekit_definitions.our_architectures`).
:func:`run_merge` merges a mergekit(-ext) YAML with any method, as ``mergekit-ext run``.
"""

__version__ = "0.1.0"

from mergekit_ext import adaptation as adaptation  # noqa: E402,F401  (registers SyMerge)
from mergekit_ext import methods as methods  # noqa: E402  (registers the methods)
from mergekit_ext.api import MergeResult, as_config, run_merge  # noqa: E402
from mergekit_ext.config import ExtMergeConfig, load_config, parse_config  # noqa: E402
from mergekit_ext.runner import RunOptions  # noqa: E402

__all__ = [
    "ExtMergeConfig",
    "MergeResult",
    "RunOptions",
    "__version__",
    "as_config",
    "load_config",
    "methods",
    "parse_config",
    "run_merge",
]
