"""Finiteness guards: no NaN or Inf reaches a written checkpoint unnoticed.

mergekit's own methods pass a NaN of an expert straight into the output, and the
data-aware methods only notice one as a non-finite Gram matrix long after it loaded. Two
checks close that gap: :func:`check_loaded_finite` as the sequential executor loads a
block's tensors (naming model, task and layer), and :func:`check_output_finite` over every
tensor a merge wrote, whichever method produced it (naming the tensor and the inputs that
hold NaN/Inf in it).
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Mapping, Sequence

import torch
from safetensors import safe_open

from mergekit_ext.errors import TensorError

LOG = logging.getLogger(__name__)

# Checkpoint prefixes that differ between a bare backbone and a model with a head.
_PREFIXES = ("model.", "bert.", "roberta.", "vit.", "transformer.", "base_model.model.")


def is_finite(tensor: torch.Tensor) -> bool:
    """True for non-floating tensors and floating tensors without NaN/Inf.

    A NaN or Inf anywhere makes the sum NaN or Inf, so a finite sum (one pass, no boolean
    tensor) proves the tensor finite; only a non-finite sum, which a huge finite tensor can
    also give, needs the element-wise test.
    """
    if not tensor.dtype.is_floating_point:
        return True
    wide = torch.float32 if tensor.dtype == torch.float16 else tensor.dtype  # 65504 is near
    return bool(torch.isfinite(tensor.sum(dtype=wide))) or bool(torch.isfinite(tensor).all())


def check_loaded_finite(
    tensors: Mapping[str, torch.Tensor], *, model: str, task: str, where: str
) -> None:
    """Raise when a tensor just loaded from an input holds NaN or Inf.

    Args:
        tensors: canonical name -> tensor, as loaded.
        model: the input as written in the YAML.
        task: the task (expert) name, or "base".
        where: the layer or block being merged, e.g. "block 3".
    """
    for name, tensor in tensors.items():
        if not is_finite(tensor):
            raise TensorError(
                f"model {model} (task {task}): tensor {name}, loaded for {where}, contains "
                "NaN or Inf values; fix or drop that checkpoint"
            )


def _short(name: str) -> str:
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def _nonfinite_inputs(name: str, inputs: Sequence[tuple[str, str]]) -> list[str]:
    """The inputs (label, folder) whose tensor ``name`` (up to a prefix) holds NaN/Inf."""
    wanted = _short(name)
    found = []
    for label, folder in inputs:
        for file in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
            with safe_open(file, framework="pt") as f:
                keys = [k for k in f.keys() if k == name or _short(k) == wanted]
                if any(not is_finite(f.get_tensor(k)) for k in keys):
                    found.append(label)
                    break
    return found


def check_output_finite(out_dir: str, inputs: Sequence[tuple[str, str]] = ()) -> int:
    """Raise :class:`TensorError` when any tensor written under ``out_dir`` is not finite.

    Args:
        out_dir: the (temporary) output folder; every ``*.safetensors`` below it is read,
            one tensor at a time.
        inputs: (label, local folder) of each input model, searched only on failure for the
            tensor of the same name to say where the NaN/Inf came from.

    Returns:
        The number of tensors checked.
    """
    checked = 0
    files = sorted(glob.glob(os.path.join(out_dir, "**", "*.safetensors"), recursive=True))
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                checked += 1
                if is_finite(f.get_tensor(name)):
                    continue
                where = os.path.relpath(file, out_dir)
                sources = _nonfinite_inputs(name, inputs)
                origin = (
                    f"it comes from {', '.join(sources)}, which hold(s) NaN/Inf in that tensor: "
                    "fix or drop that input"
                    if sources
                    else "no input holds NaN/Inf in it, so the merge produced them: try "
                    "`dtype: float32` or other method parameters"
                )
                raise TensorError(
                    f"tensor {name} of the merged model ({where}) contains NaN or Inf values; "
                    f"nothing was written. {origin}"
                )
    LOG.debug("checked %d output tensors for NaN/Inf", checked)
    return checked
