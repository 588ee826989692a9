"""The public Python API: one call merges a YAML config with any method, ours or mergekit's.

mergekit's ``mergekit.merge.run_merge`` takes a ``MergeConfiguration``, which drops
mergekit-ext's additions (``calibration:``, ``name:``) and can only run tensor-wise methods.
:func:`run_merge` takes the same YAML as ``mergekit-ext run`` and runs it exactly as the
command does (the same checks, executors, atomic output folder, diagnostics and card)::

    import mergekit_ext
    from mergekit.options import MergeOptions

    mergekit_ext.run_merge("chain_of_merges.yml", "./merged", MergeOptions(random_seed=0))
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Optional, Union

import yaml
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions

from mergekit_ext.config import ExtMergeConfig, load_config, parse_config
from mergekit_ext.errors import ConfigError
from mergekit_ext.runner import RunOptions, run_merge_config

ConfigLike = Union[str, "os.PathLike[str]", Mapping[str, Any], ExtMergeConfig, MergeConfiguration]


def as_config(config: ConfigLike) -> ExtMergeConfig:
    """An :class:`ExtMergeConfig` from a YAML file path, a parsed YAML mapping or a config object.

    Args:
        config: the path of a YAML file; a mapping as ``yaml.safe_load`` returns it; an
            :class:`ExtMergeConfig`; or mergekit's ``MergeConfiguration`` (which holds no
            calibration data: a data-aware method then asks for it).

    Returns:
        The parsed config.
    """
    if isinstance(config, ExtMergeConfig):
        return config
    if isinstance(config, MergeConfiguration):
        return parse_config(config.to_yaml(), "<MergeConfiguration>")
    if isinstance(config, Mapping):
        return parse_config(yaml.safe_dump(dict(config), sort_keys=False), "<mapping>")
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if "\n" in path:
            raise ConfigError(
                "run_merge takes the path of a YAML file; for YAML text use "
                "mergekit_ext.parse_config(text)"
            )
        return load_config(path)
    raise ConfigError(
        f"run_merge: config must be a YAML path, a mapping, an ExtMergeConfig or a "
        f"MergeConfiguration, not {type(config).__name__}"
    )


def run_merge(
    config: ConfigLike,
    out_path: Union[str, os.PathLike[str]],
    options: Optional[Union[MergeOptions, Mapping[str, Any]]] = None,
    run_options: Optional[RunOptions] = None,
) -> Optional[str]:
    """Merge ``config`` into ``out_path``, as ``mergekit-ext run CONFIG OUT`` does.

    Args:
        config: see :func:`as_config`; calibration data and task names included.
        out_path: the output folder; it must not exist unless ``run_options.overwrite``.
        options: mergekit's options (``MergeOptions`` or a mapping of its fields:
            ``device``, ``random_seed``, ``out_shard_size``, ``allow_crimes`` ...).
        run_options: mergekit-ext's own options (overwrite, dry_run, allow_pickle, SyMerge's
            force / task_layers_only, push_to_hub ...).

    Returns:
        The absolute path of the output folder, or None for a dry run.

    Raises:
        MergekitExtError: bad input (the message says what to do); nothing is written.
    """
    if options is None:
        options = MergeOptions()
    elif not isinstance(options, MergeOptions):
        options = MergeOptions.model_validate(dict(options))
    return run_merge_config(as_config(config), os.fspath(out_path), options, run_options)
