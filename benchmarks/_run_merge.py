"""Stand-in for ``mergekit-ext run CONFIG OUT`` while ``mergekit_ext.cli`` is not there.

Parses the YAML with mergekit-ext's config parser (which strips the ``calibration:`` and
``name:`` additions) and runs mergekit's own ``run_merge`` after ``import mergekit_ext``
(which registers our tensor-at-a-time methods). Layerwise/adaptation methods need the
sequential executor behind ``mergekit-ext run`` and are refused with NotImplementedError.
"""

from __future__ import annotations

import sys

from mergekit.merge import run_merge
from mergekit.options import MergeOptions

import mergekit_ext  # noqa: F401  (registers the methods)
from mergekit_ext.config import load_config
from mergekit_ext.methods.registry import ext_method_info


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: _run_merge.py CONFIG OUT", file=sys.stderr)
        return 2
    config_path, out_path = argv
    config = load_config(config_path)
    info = ext_method_info(config.method)
    if info is not None and info.kind != "tensorwise":
        raise NotImplementedError(
            f"{config.method} runs on mergekit-ext's sequential executor; "
            "`mergekit-ext run` is not available yet"
        )
    run_merge(
        config.merge,
        out_path,
        MergeOptions(random_seed=0, quiet=True, lazy_unpickle=False, write_model_card=False),
        config_source=config.source_text,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
