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
from collections.abc import Iterator, Mapping, Sequence

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


# Every weight file a merge may write: safetensors, and with ``--no-safe-serialization``
# mergekit's ``pytorch_model*.bin`` (torch.save pickles; ``*.pt``/``*.pth`` alike).
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def weight_files(folder: str, recursive: bool = False) -> list[str]:
    """Every weight file in ``folder`` (and below it with ``recursive``), sorted."""
    # escaped: a folder named like "row[x=1]" is a path, not a pattern
    where = glob.escape(folder)
    where = os.path.join(where, "**") if recursive else where
    found = {
        f
        for pattern in WEIGHT_PATTERNS
        for f in glob.glob(os.path.join(where, pattern), recursive=recursive)
    }
    return sorted(f for f in found if os.path.isfile(f))


def _tensors(file: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of one weight file, one tensor at a time for safetensors.

    Pickles are read with ``weights_only=True`` (no code runs) and memory-mapped where the
    file's format allows it.
    """
    if file.endswith(".safetensors"):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
        return
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
        state = torch.load(file, map_location="cpu", weights_only=True)
    if not isinstance(state, Mapping):
        raise TensorError(f"{file} holds no tensors by name (a {type(state).__name__})")
    for name, tensor in state.items():
        if isinstance(tensor, torch.Tensor):
            yield str(name), tensor


def _nonfinite_inputs(name: str, inputs: Sequence[tuple[str, str]]) -> list[str]:
    """The inputs (label, folder) whose tensor ``name`` (up to a prefix) holds NaN/Inf."""
    wanted = _short(name)
    found = []
    for label, folder in inputs:
        for file in weight_files(folder):
            if any(not is_finite(t) for k, t in _tensors(file) if k == name or _short(k) == wanted):
                found.append(label)
                break
    return found


def check_output_finite(out_dir: str, inputs: Sequence[tuple[str, str]] = ()) -> int:
    """Raise :class:`TensorError` when any tensor written under ``out_dir`` is not finite.

    Args:
        out_dir: the (temporary) output folder; every weight file below it
            (:data:`WEIGHT_PATTERNS`: safetensors and pickles) is read, one tensor at a time.
        inputs: (label, local folder) of each input model, searched only on failure for the
            tensor of the same name to say where the NaN/Inf came from.

    Returns:
        The number of tensors checked.
    """
    checked = 0
    for file in weight_files(out_dir, recursive=True):
        for name, tensor in _tensors(file):
            checked += 1
            if is_finite(tensor):
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
