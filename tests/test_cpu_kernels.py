"""benchmarks/cpu_kernels.py: what it reads from the libraries' verbose output, and that the
variables CI uses to take other CPUs' kernels take effect on this machine (issue #47)."""

from __future__ import annotations

import platform

import pytest
import torch

from benchmarks import cpu_kernels

# First lines as the libraries print them (MKL 2024.2 and oneDNN 3.x in torch 2.13's wheel).
AMD_MKL = (
    "MKL_VERBOSE oneMKL 2024.0 Update 2 Product build 20240605 for Intel(R) 64 architecture "
    "Intel(R) Architecture processors, Lnx 2.45GHz lp64 gnu_thread"
)
AMX_MKL = (
    "MKL_VERBOSE oneMKL 2024.0 Update 2 Product build 20240605 for Intel(R) 64 architecture "
    "Intel(R) Advanced Vector Extensions 512 (Intel(R) AVX-512) with support for INT8, BF16, "
    "FP16 (limited) instructions, and Intel(R) Advanced Matrix Extensions (Intel(R) AMX) with "
    "INT8 and BF16, Lnx 2.00GHz lp64 gnu_thread"
)
AVX2_MKL = (
    "MKL_VERBOSE oneMKL 2024.0 Update 2 Product build 20240605 for Intel(R) 64 architecture "
    "Intel(R) Advanced Vector Extensions 2 (Intel(R) AVX2) enabled processors, Lnx 2.00GHz "
    "lp64 gnu_thread"
)
SGEMM = "MKL_VERBOSE SGEMM(N,N,64,64,64,0x1,0x2,64,0x3,64,0x4,0x5,64) 9us CNR:OFF Dyn:0 TID:0"
AVX2_DNNL = [
    "onednn_verbose,v1,info,cpu,isa:Intel AVX2",
    "onednn_verbose,v1,primitive,exec,cpu,convolution,jit:avx2,forward_training,src:f32,,mb1,0.01",
]
AMX_DNNL = [
    "onednn_verbose,v1,info,cpu,isa:Intel AVX-512 with float16, Intel DL Boost and bfloat16 "
    "support and Intel AMX with bfloat16 and 8-bit integer support",
    "onednn_verbose,v1,primitive,exec,cpu,matmul,brg_matmul:avx512_core_amx,undef,src:bf16,,"
    "64x64:64x64,0.02",
]


def _lines(*groups) -> str:
    return "\n".join(line for g in groups for line in ([g] if isinstance(g, str) else g))


def test_an_amd_or_avx2_machine_passes_the_avx2_check():
    kernels = cpu_kernels.parse(_lines("aten capability: AVX2", AMD_MKL, SGEMM, AVX2_DNNL))
    assert kernels.aten == "AVX2"
    assert kernels.mkl_path == "Intel(R) Architecture processors"
    assert kernels.mkl_calls == ["SGEMM"]
    assert kernels.onednn_isa == "Intel AVX2"
    assert kernels.onednn_kernels == ["convolution jit:avx2"]
    assert kernels.forbidden(cpu_kernels.FORBIDDEN["avx2"]) == []
    capped = cpu_kernels.parse(_lines("aten capability: AVX2", AVX2_MKL, AVX2_DNNL))
    assert capped.forbidden(cpu_kernels.FORBIDDEN["avx2"]) == []


def test_an_amx_machine_fails_the_avx2_check_naming_each_library(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    kernels = cpu_kernels.parse(_lines("aten capability: AVX512", AMX_MKL, SGEMM, AMX_DNNL))
    assert kernels.onednn_kernels == ["matmul brg_matmul:avx512_core_amx"]
    problems = kernels.forbidden(cpu_kernels.FORBIDDEN["avx2"])
    assert [p.split(" ")[0] for p in problems] == ["ATen", "MKL", "oneDNN"]
    assert "ATEN_CPU_CAPABILITY=avx2 did not take effect" in problems[0]
    assert "set MKL_ENABLE_INSTRUCTIONS to cap it" in problems[1]
    # without AMX, AVX-512 is what the other setting allows
    no_amx = kernels.forbidden(cpu_kernels.FORBIDDEN["avx512-no-amx"])
    assert [p.split(" ")[0] for p in no_amx] == ["MKL", "oneDNN"]


# MKL and oneDNN's x86 kernels: what CI runs on
x86 = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 only")


@x86
def test_the_probe_reports_this_process_kernels():
    kernels = cpu_kernels.probe()
    assert kernels.aten == torch.backends.cpu.get_cpu_capability()
    assert {"SGEMM", "DPOTRF", "DSYEVD"} <= set(kernels.mkl_calls)  # torch's BLAS/LAPACK: MKL
    assert kernels.onednn_isa and any(k.startswith("convolution ") for k in kernels.onednn_kernels)


@x86
def test_the_avx2_setting_takes_effect_here():
    """What CI's second pass (Makefile, test-avx2) relies on, on whatever CPU runs the tests."""
    kernels = cpu_kernels.probe(cpu_kernels.SETTINGS["avx2"])
    assert kernels.forbidden(cpu_kernels.FORBIDDEN["avx2"]) == []
    assert kernels.aten == "AVX2"


@x86
def test_the_variables_are_read_below_avx2():
    """Caps below every x86-64 CPU CI runs on change the kernels: each variable is read
    (a cap at or above the CPU's own ISA changes nothing, so cannot show it)."""
    kernels = cpu_kernels.probe({"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"})
    assert kernels.aten == "DEFAULT"
    assert kernels.onednn_isa == "Intel SSE4.1"
    assert "convolution jit:sse41" in kernels.onednn_kernels
