"""Completeness and layout of a written checkpoint: nothing missing, nothing in a foreign layout.

A merge can exit 0 and still write a checkpoint transformers cannot use as intended: before
mergekit-ext described the checkpoint layout of DeepSeek-V3 to mergekit, a tensor-wise merge
wrote none of its routed experts (transformers then loads them randomly initialised), and
mergekit 0.1.5 under transformers 5 writes no tensor of LLaVA's language model.
:func:`check_output_complete` runs before the final rename, whatever method ran, and stops
the merge when ``from_pretrained`` of the output's class would not load it completely. The
verdict is transformers' own: its loading runs on the meta device over the written names
and shapes (:func:`mergekit_ext.models.model_class.load_report`, with the class's key
renames and conversions), so an output transformers loads completely is never refused,
whichever of the layouts transformers reads it is in:

- **missing**: a tensor of the class that loading leaves missing (transformers would
  initialise it randomly). A tied ``lm_head`` and non-persistent buffers are never missing.
  One that loading the base checkpoint leaves missing too (ViTModel's pooler, for a
  checkpoint saved without it) is as the base has it, and only logged;
- **wrong shape**: a tensor the class loads has another shape, or a conversion of
  transformers (fused experts) fails on the written pieces;
- **foreign**: a written tensor the class does not load and the base checkpoint does not
  hold (a buffer an old base checkpoint holds, such as ``rotary_emb.inv_freq``, is its own
  layout, not a foreign one).

The class is built from the output's own ``config.json`` as the merge wrote it. mergekit's
``unsafe_truncate_embeddings`` writes embeddings cut to the smallest vocabulary while the
output's config keeps the donor's ``vocab_size`` (mergekit's own tests assert both): with
that option (``truncated_vocabulary``), an input or output embedding with fewer rows along
its vocabulary axis, and nothing else different, is what the user asked for, and is only
logged (``from_pretrained`` needs ``ignore_mismatched_sizes``, or the config edited).

When transformers has no class for the output (remote code), the base checkpoint itself
is the reference, less the tensors mergekit's architecture definition marks optional.
See docs/methods.md, "Output completeness".
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Optional

import torch
import transformers

from mergekit_ext.errors import TensorError
from mergekit_ext.models import model_class
from mergekit_ext.models.model_paths import tensor_shapes

LOG = logging.getLogger(__name__)

Shapes = dict[str, tuple[int, ...]]

_SHOWN = 8  # names listed per kind of problem; the count says how many more


def written_shapes(folder: str) -> Shapes:
    """Names and shapes of the checkpoint in ``folder`` (its own files, not subfolders).

    Args:
        folder: a model folder: safetensors are read from their headers, pickled ``*.bin``
            weights (written by the merge itself) with ``weights_only`` on the meta device.

    Returns:
        ``{tensor name: shape}``.
    """
    shapes = tensor_shapes(folder)
    for file in sorted(glob.glob(os.path.join(glob.escape(folder), "*.bin"))):
        state = torch.load(file, map_location="meta", weights_only=True, mmap=True)
        shapes.update({k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)})
    return shapes


def _config(config_folder: str) -> tuple[Optional[transformers.PretrainedConfig], str]:
    """The config in ``config_folder`` when transformers has a class for it, else ``(None, why)``."""
    try:
        config = transformers.AutoConfig.from_pretrained(config_folder, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - remote code, an unknown model_type
        return None, f"transformers cannot read its config.json ({type(e).__name__})"
    cls = model_class.model_class(config)
    if cls is None:
        return None, f"transformers has no class {config.architectures}"
    return config, cls.__name__


def class_load_reports(
    config_folder: str, written: Shapes, base: Shapes
) -> tuple[Optional[tuple[model_class.LoadReport, model_class.LoadReport]], str]:
    """What ``from_pretrained`` of the class in ``config_folder/config.json`` reports for the
    output's and the base checkpoint's names and shapes (on the meta device).

    Returns:
        ``((output report, base report), class name)``, or ``(None, why)`` when transformers
        has no class for it or cannot build it on the meta device.
    """
    config, name = _config(config_folder)
    if config is None:
        return None, name
    try:
        report = model_class.load_report(config, written)
        # the base's names are usually the output's (the same layout): one report then
        same = dict(base) == dict(written)
        reports = (report, report if same else model_class.load_report(config, base))
    except Exception as e:  # noqa: BLE001 - whatever the class raises for this config
        LOG.debug("loading into %s on the meta device failed", name, exc_info=True)
        return None, f"{name} cannot be loaded on the meta device ({type(e).__name__}: {e})"
    return reports, name


def _listed(names: Sequence[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def compare_layout(
    written: Mapping[str, tuple[int, ...]],
    expected: Mapping[str, tuple[int, ...]],
    base: Collection[str] = (),
) -> tuple[list[str], list[str], list[str]]:
    """The three kinds of problems of a written checkpoint (pure: names and shapes only).

    Args:
        written: ``{name: shape}`` of the output.
        expected: ``{name: shape}`` the output must hold.
        base: the base checkpoint's names (a tensor it holds is never foreign).

    Returns:
        ``(missing, wrong shape as "name [got] (expected [want])", foreign)``, sorted.
    """
    missing = sorted(n for n in expected if n not in written)
    wrong = sorted(
        f"{n} {list(written[n])} (expected {list(expected[n])})"
        for n in expected
        if n in written and tuple(written[n]) != tuple(expected[n])
    )
    foreign = sorted(n for n in written if n not in expected and n not in base)
    return missing, wrong, foreign


def _vocabulary_axes(config_folder: str) -> dict[str, int]:
    """The class's input/output embeddings, ``{name: vocabulary axis}`` (mergekit's rule)."""
    from mergekit.architecture.auto import infer_vocabulary_axes

    config = transformers.AutoConfig.from_pretrained(config_folder, trust_remote_code=False)
    return infer_vocabulary_axes(model_class.meta_model(config))


def truncated_along_vocabulary(
    got: Sequence[int], want: Sequence[int], axis: Optional[int]
) -> bool:
    """Whether shape ``got`` is ``want`` with fewer rows on vocabulary ``axis`` only."""
    if axis is None or len(got) != len(want) or not 0 <= axis < len(want):
        return False
    others = all(g == w for i, (g, w) in enumerate(zip(got, want)) if i != axis)
    return others and 0 < got[axis] < want[axis]


def check_output_complete(
    out_dir: str,
    base: Optional[tuple[str, str]] = None,
    optional: Optional[Callable[[], Collection[str]]] = None,
    truncated_vocabulary: bool = False,
) -> int:
    """Raise :class:`TensorError` when the checkpoint in ``out_dir`` is incomplete or foreign.

    Args:
        out_dir: the (temporary) output folder, with the merged ``config.json`` and weights.
        base: (label, local folder) of the base model (mergekit's donor: ``base_model``, or
            the first model); its names are never foreign, a tensor it lacks as well is
            only logged, and it is the reference when transformers has no class for the
            output.
        optional: the names mergekit's architecture definition marks optional, asked for
            only when transformers has no class for the output: they are not required then.
        truncated_vocabulary: the merge ran with mergekit's ``unsafe_truncate_embeddings``:
            embeddings with fewer vocabulary rows than the output's config says are
            accepted (logged), nothing else is.

    Returns:
        The number of written tensors checked.
    """
    written = written_shapes(out_dir)
    base_shapes: Shapes = tensor_shapes(base[1]) if base and os.path.isdir(base[1]) else {}
    config_folder = out_dir if os.path.isfile(os.path.join(out_dir, "config.json")) else None
    if config_folder is None and base and os.path.isfile(os.path.join(base[1], "config.json")):
        config_folder = base[1]
    label = base[0] if base else "the base model"
    reports, why = (None, "it has no config.json")
    if config_folder is not None:
        reports, why = class_load_reports(config_folder, written, base_shapes)
    if reports is None:
        return _check_against_base(written, base_shapes, label, why, optional)
    report, base_report = reports
    # why is the class name when the reports are known
    holder = (f"{why} loads", f"neither {why} loads nor the base checkpoint holds")
    missing = sorted(report.missing)
    as_base = [n for n in missing if n in base_report.missing] if base_shapes else []
    if as_base:
        # e.g. ViTModel's pooler, absent from checkpoints saved without it: transformers
        # initialises it for the base model too, so the output is as complete as the base
        LOG.info(
            "not written, as loading the base checkpoint leaves them missing too: %s",
            _listed(as_base),
        )
        missing = [n for n in missing if n not in base_report.missing]
    mismatched = dict(report.mismatched)
    if truncated_vocabulary and mismatched:
        axes = _vocabulary_axes(config_folder)
        cut = [
            n
            for n, (got, want) in mismatched.items()
            if truncated_along_vocabulary(got, want, axes.get(n))
        ]
        if cut:
            LOG.warning(
                "unsafe_truncate_embeddings: %s hold fewer vocabulary rows than config.json's "
                "vocabulary size; load with ignore_mismatched_sizes=True or edit config.json",
                _listed(sorted(f"{n} {list(mismatched[n][0])}" for n in cut)),
            )
        mismatched = {n: v for n, v in mismatched.items() if n not in cut}
    wrong = sorted(
        f"{n} {list(got)} (expected {list(want)})" for n, (got, want) in mismatched.items()
    ) + sorted(
        f"{n} (transformers cannot convert it: {e})" for n, e in report.conversion_errors.items()
    )
    foreign = sorted(
        n for n in report.unexpected if n not in base_shapes and n not in base_report.unexpected
    )
    _raise_problems(label, holder, missing, wrong, foreign)
    LOG.debug("%s loads every tensor of the output (%d written)", why, len(written))
    return len(written)


def _check_against_base(
    written: Shapes,
    base_shapes: Shapes,
    label: str,
    why: str,
    optional: Optional[Callable[[], Collection[str]]],
) -> int:
    """No class to load with (remote code): the base checkpoint's names and shapes are the
    reference, less what mergekit's definition marks optional."""
    if not base_shapes:
        LOG.warning(
            "the merged model's tensors were not checked for completeness: %s, and the base "
            "model has no safetensors to compare with",
            why,
        )
        return 0
    LOG.info("completeness checked against the base checkpoint: %s", why)
    skip = set(optional() if optional else ())
    expected = {k: v for k, v in base_shapes.items() if k not in skip}
    missing, wrong, foreign = compare_layout(written, expected, base_shapes)
    holder = f"the base checkpoint {label}"
    _raise_problems(label, (f"{holder} holds", f"{holder} does not hold"), missing, wrong, foreign)
    return len(expected)


def _raise_problems(
    label: str,
    holder: tuple[str, str],
    missing: Sequence[str],
    wrong: Sequence[str],
    foreign: Sequence[str],
) -> None:
    """One :class:`TensorError` naming every problem (``holder``: what expects the missing
    tensors, and what does not know the foreign ones, in words)."""
    if not (missing or wrong or foreign):
        return
    problems = []
    if missing:
        problems.append(
            f"{len(missing)} tensor(s) that {holder[0]} are missing: {_listed(missing)}"
        )
    if wrong:
        problems.append(
            f"{len(wrong)} tensor(s) have another shape or do not convert: {_listed(wrong)}"
        )
    if foreign:
        problems.append(
            f"{len(foreign)} tensor(s) are in a layout that {holder[1]}: {_listed(foreign)}"
        )
    raise TensorError(
        f"the merged model is not a complete checkpoint in the layout of {label}: "
        + "; ".join(problems)
        + ". Nothing was written. The merge's description of this architecture does not name "
        "these tensors as its checkpoints store them (see docs/methods.md, Output "
        "completeness); please report it with your config"
    )


def mergekit_optional_names(merge, options) -> set[str]:
    """The weights mergekit's architecture definition of a merge marks optional.

    Args:
        merge: mergekit's ``MergeConfiguration``.
        options: mergekit's ``MergeOptions``.

    Returns:
        Their names for the base model's config (empty when mergekit cannot tell).
    """
    from mergekit.architecture import get_architecture_info

    try:
        arch = get_architecture_info(merge, options)
        ref = merge.base_model or merge.referenced_models()[0]
        config = ref.config(trust_remote_code=options.trust_remote_code)
        return {w.name for w in arch.all_weights(config) if w.optional}
    except Exception as e:  # noqa: BLE001 - then every base tensor is required
        LOG.info("mergekit's optional weights are unknown (%s: %s)", type(e).__name__, e)
        return set()
