"""Completeness and layout of a written checkpoint: nothing missing, nothing in a foreign layout.

A merge can exit 0 and still write a checkpoint transformers cannot use as intended: before
mergekit-ext described the checkpoint layout of DeepSeek-V3 to mergekit, a tensor-wise merge
wrote none of its routed experts (transformers then loads them randomly initialised); for
Mixtral and Qwen-MoE it wrote transformers 5's fused in-memory tensors
(``mlp.experts.gate_up_proj``) instead of the per-expert tensors their checkpoints hold.
:func:`check_output_complete` runs before the final rename, whatever method ran, and stops
the merge when the output is not what ``save_pretrained`` of the model's class would write:

- **missing**: a tensor the class writes for the output's ``config.json`` is not in the
  output (a tied ``lm_head`` is not written by the class, so it is never asked for). A
  tensor the base checkpoint lacks too (ViTModel's pooler, for a checkpoint saved without
  it) may be absent when mergekit's architecture definition marks it optional;
- **wrong shape**: such a tensor has another shape;
- **foreign**: the output holds a tensor the class does not write and the base checkpoint
  does not hold (a buffer an old base checkpoint holds, such as ``rotary_emb.inv_freq``,
  is its own layout, not a foreign one).

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


def class_checkpoint_shapes(config_folder: str) -> tuple[Optional[Shapes], str]:
    """What ``save_pretrained`` of the class named in ``config_folder/config.json`` writes.

    Args:
        config_folder: a folder with a ``config.json``.

    Returns:
        ``({checkpoint name: shape}, class name)``, or ``(None, why)`` when transformers
        has no class for it or cannot build it on the meta device.
    """
    try:
        config = transformers.AutoConfig.from_pretrained(config_folder, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - remote code, an unknown model_type
        return None, f"transformers cannot read its config.json ({type(e).__name__})"
    cls = model_class.model_class(config)
    if cls is None:
        return None, f"transformers has no class {config.architectures}"
    try:
        model = model_class.meta_model(config)
        state = model_class.saved_state_dict(model)
    except Exception as e:  # noqa: BLE001 - whatever the class raises for this config
        return None, f"{cls.__name__} cannot be built on the meta device ({type(e).__name__})"
    return {k: tuple(v.shape) for k, v in state.items()}, cls.__name__


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


def check_output_complete(
    out_dir: str,
    base: Optional[tuple[str, str]] = None,
    optional: Optional[Callable[[], Collection[str]]] = None,
) -> int:
    """Raise :class:`TensorError` when the checkpoint in ``out_dir`` is incomplete or foreign.

    Args:
        out_dir: the (temporary) output folder, with the merged ``config.json`` and weights.
        base: (label, local folder) of the base model (mergekit's donor: ``base_model``, or
            the first model); its names are never foreign, and it is the reference when
            transformers has no class for the output.
        optional: the names mergekit's architecture definition marks optional, asked for
            only when needed: they may be absent when the base checkpoint lacks them too,
            and, when transformers has no class for the output, they are not required.

    Returns:
        The number of tensors the output was compared with.
    """
    written = written_shapes(out_dir)
    base_shapes: Shapes = tensor_shapes(base[1]) if base and os.path.isdir(base[1]) else {}
    config_folder = out_dir if os.path.isfile(os.path.join(out_dir, "config.json")) else None
    if config_folder is None and base and os.path.isfile(os.path.join(base[1], "config.json")):
        config_folder = base[1]
    label = base[0] if base else "the base model"
    expected, why = (None, "it has no config.json")
    if config_folder is not None:
        expected, why = class_checkpoint_shapes(config_folder)
    holder = f"a {why} checkpoint"  # why is the class name when expected is known
    if expected is None:
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
        holder = f"the base checkpoint {label}"
    missing, wrong, foreign = compare_layout(written, expected, base_shapes)
    lacking = [n for n in missing if n not in base_shapes]
    if lacking and base_shapes and optional is not None:
        # e.g. ViTModel's pooler, absent from checkpoints saved without it: the base lacks it
        # and mergekit's definition lets a merge omit it, so the output is as the base is
        excused = set(lacking) & set(optional())
        if excused:
            LOG.info(
                "not written, as the base checkpoint lacks them (optional): %s",
                _listed(sorted(excused)),
            )
            missing = [n for n in missing if n not in excused]
    if not (missing or wrong or foreign):
        LOG.debug("the output holds every tensor %s holds (%d)", holder, len(expected))
        return len(expected)
    problems = []
    if missing:
        lacking = [n for n in missing if n not in base_shapes]
        problems.append(
            f"{len(missing)} tensor(s) that {holder} holds are missing: {_listed(missing)}"
            + (
                f" (the base checkpoint lacks {_listed(lacking)} too)"
                if lacking and base_shapes
                else ""
            )
        )
    if wrong:
        problems.append(f"{len(wrong)} tensor(s) have another shape: {_listed(wrong)}")
    if foreign:
        problems.append(
            f"{len(foreign)} tensor(s) are in a layout that neither {holder} nor the base "
            f"checkpoint uses: {_listed(foreign)}"
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
