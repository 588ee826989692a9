"""float32 matrix products at bfloat16 speed, where that loses nothing.

A bfloat16 value times a bfloat16 value is exact in float32 (8 + 8 significant bits fit in
24), so a product whose operands both hold bfloat16 values exactly (activations of a
bfloat16 pass, bfloat16 checkpoints' weights) can run on the bfloat16 units with float32
sums and a float32 result and give what a float32 GEMM gives: nothing rounds but the sums,
in float32 either way. torch exposes such a GEMM on CUDA (``torch.mm(..., out_dtype=...)``);
on the CPU it has no kernel for a bfloat16 GEMM with a float32 result, but oneDNN's
"bf16" fpmath mode for float32 GEMMs (``torch.backends.mkldnn.matmul.fp32_precision``)
lets it convert float32 operands to bfloat16 internally and keep float32 accumulation and
output. That conversion is exact for these operands, so the mode changes speed, not
precision (docs/methods.md, "Compute dtype"). It is never applied to an operand that is not
exactly bfloat16: how the mode rounds such operands depends on the CPU (an AMX machine
rounds them to bfloat16).
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator

import torch

LOG = logging.getLogger(__name__)

# The low 16 bits of a float32 that holds a bfloat16 value are zero.
_LOW_BITS = 0xFFFF


def holds_bfloat16(tensor: torch.Tensor) -> bool:
    """Whether every entry of ``tensor`` is a bfloat16 value exactly (any bfloat16 tensor;
    a float32 one whose low 16 mantissa bits are all zero)."""
    if tensor.dtype == torch.bfloat16:
        return True
    if tensor.dtype != torch.float32:
        return False
    if not tensor.is_contiguous() and tensor.mT.is_contiguous():
        tensor = tensor.mT  # a transposed view holds the same values: no copy
    tensor = tensor.contiguous()
    if sys.byteorder == "little" and tensor.numel() > 0:
        # the low 16 bits as a strided int16 view: no int32 temporary the size of the
        # tensor (a 28672 x 4096 weight: 0.05 s against 0.18 s, measured)
        low = tensor.reshape(-1).view(torch.int16)[0::2]
        return bool(torch.equal(low, low.new_zeros(()).expand_as(low)))
    bits = tensor.view(torch.int32)
    return not bool(torch.bitwise_and(bits, _LOW_BITS).any())


@contextlib.contextmanager
def bfloat16_fpmath() -> Iterator[None]:
    """float32 GEMMs on the CPU may run on the bfloat16 units (oneDNN's "bf16" fpmath mode)
    inside the block; the previous setting is restored after it. Where the CPU has no fast
    bfloat16, torch keeps its float32 kernels."""
    matmul = torch.backends.mkldnn.matmul
    previous = matmul.fp32_precision
    matmul.fp32_precision = "bf16"
    try:
        yield
    finally:
        matmul.fp32_precision = previous


def float32_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with float32 sums and a float32 result, at bfloat16 speed where exact.

    Args:
        a: ``[m, k]`` float32 or bfloat16.
        b: ``[k, n]`` float32 or bfloat16.

    Returns:
        ``[m, n]`` float32. When both operands hold bfloat16 values exactly: on CUDA one
        bfloat16 GEMM with a float32 result, on the CPU a float32 GEMM in oneDNN's bf16
        fpmath mode, the same sums as a float32 GEMM's. Otherwise a float32 GEMM.
    """
    if not (holds_bfloat16(a) and holds_bfloat16(b)):
        return a.float() @ b.float()
    if a.device.type == "cuda":
        return torch.mm(a.bfloat16(), b.bfloat16(), out_dtype=torch.float32)
    if a.device.type != "cpu":
        return a.float() @ b.float()
    with bfloat16_fpmath():
        return a.float() @ b.float()
