"""The dtype of the block forward passes (``compute_dtype``; docs/methods.md, "Compute dtype").

``auto`` runs the passes in bfloat16 where the checkpoints are bfloat16 and the device
multiplies bfloat16 fast, float32 otherwise. In a low-precision pass the block's tensors
are loaded in it where stored in it (:func:`kept_dtype`), else cast once per block
(:class:`LowPrecisionParams`), and the block runs under
``torch.autocast``: the linears and attention multiply in bfloat16 / float16 with float32
accumulation, while the residual stream, the norms and the hidden states carried from block
to block stay float32 (the block's input is float32, and the sums of float32 and bfloat16
tensors are float32).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

import torch

LOG = logging.getLogger(__name__)

_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ComputeChoice:
    """The resolved ``compute_dtype``: the dtype and why."""

    dtype: torch.dtype
    setting: str  # as configured: auto | float32 | bfloat16 | float16
    reason: str
    # every block linear of the base and the experts is stored in ``dtype``
    stored: bool = False

    @property
    def name(self) -> str:
        return str(self.dtype).replace("torch.", "")

    @property
    def low_precision(self) -> bool:
        return self.dtype != torch.float32

    @property
    def rounds_inputs(self) -> bool:
        """Whether the statistics are of the linears' inputs rounded to ``dtype``, as a
        low-precision pass multiplies them (``calibration.statistics.multiplied_input``).

        Only where the checkpoints store their linears in ``dtype``: the merged model then
        runs in it and multiplies those rounded values. A float32 checkpoint merged with
        low-precision passes runs in float32, where its linears see the unrounded inputs,
        which the statistics then approximate as closely as the pass allows.
        """
        return self.low_precision and self.stored

    def describe(self) -> str:
        text = f"compute dtype: {self.name} ({self.reason})"
        if self.rounds_inputs:
            text += f"; input statistics of the values the {self.name} linears multiply"
        return text

    def record(self) -> dict[str, Any]:
        return {
            "compute_dtype": self.name,
            "setting": self.setting,
            "reason": self.reason,
            "rounds_inputs": self.rounds_inputs,
        }


def fast_bf16(device_type: str) -> tuple[bool, str]:
    """Whether ``device_type`` (``cpu`` | ``cuda``) multiplies bfloat16 fast, and what says so.

    CPU: the AVX512-BF16 or AMX instructions (``torch.cpu``'s probes, the ``lscpu`` flags
    ``avx512_bf16`` / ``amx_bf16``); CUDA: ``torch.cuda.is_bf16_supported()``.
    """
    if device_type == "cuda":
        if not torch.cuda.is_available():
            return False, "CUDA is not available here"
        ok = bool(torch.cuda.is_bf16_supported())
        return ok, f"torch.cuda.is_bf16_supported() is {ok}"
    if device_type == "cpu":
        flags = [
            name
            for name, probe in (
                ("amx_bf16", getattr(torch.cpu, "_is_amx_tile_supported", None)),
                ("avx512_bf16", getattr(torch.cpu, "_is_avx512_bf16_supported", None)),
            )
            if probe is not None and bool(probe())
        ]
        cap = onednn_isa_cap()
        if flags and cap is not None and cap not in _BF16_ISAS:
            # the CPU has the instructions but oneDNN was told not to use them: its bfloat16
            # GEMMs then fall back to ATen's scalar loops (~0.3 GFLOP/s on one core, measured
            # on an AVX2 CPU), so float32 is the fast dtype, as on a CPU without them
            return False, f"CPU has {' and '.join(flags)} but ONEDNN_MAX_CPU_ISA={cap} caps it"
        if flags:
            return True, f"CPU has {' and '.join(flags)}"
        return False, (
            f"CPU has neither avx512_bf16 nor amx_bf16 (capability "
            f"{torch.backends.cpu.get_cpu_capability()})"
        )
    return False, f"device type {device_type!r}"


# oneDNN's ISA caps (``ONEDNN_MAX_CPU_ISA``) that keep its bfloat16 GEMM kernels: AVX512-BF16
# and every level above it (AMX, AVX10); ``ALL`` / ``DEFAULT``: no cap.
_BF16_ISAS = frozenset(
    {
        "AVX512_CORE_BF16",
        "AVX512_CORE_FP16",
        "AVX512_CORE_AMX",
        "AVX512_CORE_AMX_FP16",
        "AVX10_1_512",
        "AVX10_1_512_AMX",
        "AVX10_1_512_AMX_FP16",
        "AVX10_2_512",
        "AVX10_2_512_AMX_2",
        "ALL",
        "DEFAULT",
    }
)


def onednn_isa_cap() -> Optional[str]:
    """The ISA cap oneDNN reads at load (``ONEDNN_MAX_CPU_ISA``, or its older name
    ``DNNL_MAX_CPU_ISA``), upper-cased; None when neither is set."""
    for variable in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        value = os.environ.get(variable, "").strip()
        if value:
            return value.upper()
    return None


def resolve_compute_dtype(
    setting: str, checkpoint_dtypes: Iterable[torch.dtype], device_type: str
) -> ComputeChoice:
    """The dtype of the block passes from the ``compute_dtype`` setting.

    Args:
        setting: ``auto`` | ``float32`` | ``bfloat16`` | ``float16``.
        checkpoint_dtypes: the stored dtypes of the block linears of the base and experts.
        device_type: ``cpu`` or ``cuda``.

    Returns:
        The choice with its reason (printed in the plan, recorded in the diagnostics).
    """
    stored = set(checkpoint_dtypes)
    if setting != "auto":
        if setting not in _NAMES:
            raise ValueError(
                f"compute_dtype must be auto, float32, bfloat16 or float16; got {setting!r}"
            )
        dtype = _NAMES[setting]
        return ComputeChoice(dtype, setting, "as set", stored=stored == {dtype})
    if stored != {torch.bfloat16}:
        kinds = ", ".join(sorted(str(d).replace("torch.", "") for d in stored)) or "none"
        return ComputeChoice(
            torch.float32, setting, f"auto: checkpoints are {kinds}, not all bfloat16"
        )
    fast, why = fast_bf16(device_type)
    if not fast:
        return ComputeChoice(torch.float32, setting, f"auto: bfloat16 checkpoints but {why}")
    return ComputeChoice(
        torch.bfloat16, setting, f"auto: bfloat16 checkpoints and {why}", stored=True
    )


def kept_dtype(compute: ComputeChoice, has_experts_module: bool) -> Optional[torch.dtype]:
    """The dtype a block's matrices are loaded and held in (None: float32).

    A low-precision pass multiplies in its compute dtype; a matrix stored in that dtype is
    kept in it (:func:`~mergekit_ext.models.checkpoint.compute_tensor`) instead of a float32
    copy and a cast of it, half the block weights' memory. The merge methods read it
    widened (:func:`widened`, exact), so the merged bytes are the same. Not in a block with an
    experts module: its routed-statistics hook multiplies each expert's rows by the float32
    weights it is handed, which kept weights would change.
    """
    if not compute.low_precision or has_experts_module:
        return None
    return compute.dtype


def widened(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the merge methods read it: float32, a matrix kept in a 16-bit dtype
    (:func:`kept_dtype`) widened (exactly: every bfloat16 / float16 value is a float32 one)."""
    if tensor.dtype in (torch.bfloat16, torch.float16):
        return tensor.float()
    return tensor


class LowPrecisionParams:
    """Each block matrix cast once to the compute dtype, however many passes read it.

    Only tensors of two or more dimensions (linear and convolution weights) are cast: the
    vectors (norm weights, biases) stay float32, as the norms run in float32, and
    ``torch.layer_norm`` on CPU refuses a float32 input with bfloat16 parameters (autocast
    runs it in float32). Keyed by the float32 tensor's identity (kept alive alongside, so the key is never
    reused); :meth:`clear` at the end of every block.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._cast: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for name, tensor in params.items():
            if not tensor.dtype.is_floating_point or tensor.dtype == self.dtype or tensor.dim() < 2:
                out[name] = tensor
                continue
            hit = self._cast.get(id(tensor))
            if hit is None or hit[0] is not tensor:
                hit = (tensor, tensor.to(self.dtype))
                self._cast[id(tensor)] = hit
            out[name] = hit[1]
        return out

    def clear(self) -> None:
        self._cast.clear()


@contextlib.contextmanager
def compute_in(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """``torch.autocast`` in ``dtype`` on ``device`` (nothing for float32)."""
    if dtype == torch.float32:
        yield
        return
    with torch.autocast(device_type=device.type, dtype=dtype):
        yield


def carried(hidden: torch.Tensor, dtype: Optional[torch.dtype] = torch.float32) -> torch.Tensor:
    """The hidden states as carried to the next block (float32: docs/methods.md,
    "Compute dtype", measures why)."""
    return hidden if dtype is None or hidden.dtype == dtype else hidden.to(dtype)
