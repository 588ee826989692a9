"""Which CPU kernels torch runs on this machine, and whether the variables that steer them took effect.

    python -m benchmarks.cpu_kernels                  # what runs here
    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        python -m benchmarks.cpu_kernels --expect avx2   # exit 1 if a kernel above AVX2 ran

torch's CPU wheel (2.13) rounds with three kernel libraries, each choosing its code per CPU:

- ATen's vectorised kernels (elementwise ops, reductions, softmax, norms):
  ``ATEN_CPU_CAPABILITY`` (``default``, ``avx2``, ``avx512``); torch reports the one in use.
- MKL (``BLAS_INFO=mkl``, ``LAPACK_INFO=mkl``: float32/float64 GEMMs, cholesky, solve, eigh):
  ``MKL_ENABLE_INSTRUCTIONS`` steers it on Intel CPUs only (MKL documents it as unavailable
  on other CPUs; on an AMD EPYC it changed no byte, while ``MKL_CBWR=COMPATIBLE`` did). The
  first ``MKL_VERBOSE=1`` line names the code path: its ISA on an Intel CPU, "Intel(R)
  Architecture processors" on AMD. No OpenBLAS: ``OPENBLAS_CORETYPE`` does nothing.
- oneDNN (float32 convolutions, as in ViT/CLIP patch embeddings; bfloat16 GEMMs and float32
  GEMMs in bf16 fpmath mode where the CPU has AVX-512 bf16 or AMX, else MKL's float32 GEMM):
  ``ONEDNN_MAX_CPU_ISA``; ``ONEDNN_VERBOSE=1`` prints the ISA and each primitive's kernel.
  torch asks oneDNN whether bf16 is fast (``mayiuse(avx512_core)``), which honours the cap,
  so under ``AVX2`` the bf16 GEMMs leave oneDNN as on an AVX2-only CPU.

:data:`SETTINGS` are the variable sets CI uses to run the numerically sensitive tests on
other CPUs' kernels (Makefile, ``test-avx2``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field

#: name -> the environment that makes this CPU take another CPU family's kernels
SETTINGS: dict[str, dict[str, str]] = {
    # AMD CPUs and Intel CPUs without AVX-512: ATen's AVX2 kernels, MKL's AVX2 path (on an
    # Intel CPU; on AMD, MKL takes its own path whatever the variable says), oneDNN at AVX2
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    },
    # AVX-512 with bf16 but no AMX (AMD Zen 4, Intel Cooper Lake) on an Intel AMX machine
    "avx512-no-amx": {
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
    },
}

#: name -> words none of the kernels in use may name (case-insensitive)
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "avx2": ("avx512", "avx-512", "amx"),
    "avx512-no-amx": ("amx",),
}

# One product of each kind the merges run: a float32 and a float64 GEMM, the LAPACK calls of
# the least-squares solves, a float32 convolution, a bfloat16 GEMM and a float32 GEMM in
# oneDNN's bf16 fpmath mode (mergekit_ext.bf16_products).
_PROBE = """
import torch
torch.set_num_threads(1)
print("aten capability:", torch.backends.cpu.get_cpu_capability(), flush=True)
a, b = torch.randn(64, 64), torch.randn(64, 64)
a @ b
s = (a @ a.T).double() + 64 * torch.eye(64, dtype=torch.float64)
torch.linalg.cholesky(s); torch.linalg.solve(s, b.double()); torch.linalg.eigh(s)
torch.nn.functional.conv2d(torch.randn(1, 3, 16, 16), torch.randn(8, 3, 4, 4), stride=4)
a.bfloat16() @ b.bfloat16()
torch.backends.mkldnn.matmul.fp32_precision = "bf16"
a.bfloat16().float() @ b.bfloat16().float()
"""


@dataclass
class Kernels:
    """What one run of :data:`_PROBE` used."""

    aten: str = ""  # torch.backends.cpu.get_cpu_capability()
    mkl_path: str = ""  # the code path MKL_VERBOSE names ("" if no MKL call was seen)
    mkl_calls: list[str] = field(default_factory=list)  # e.g. SGEMM, DPOTRF
    onednn_isa: str = ""  # e.g. "Intel AVX2"
    onednn_kernels: list[str] = field(default_factory=list)  # e.g. "convolution jit:avx2"

    def forbidden(self, words: tuple[str, ...]) -> list[str]:
        """One line per library whose kernels name one of ``words``."""
        found = []
        for library, variable, text in (
            ("ATen", "ATEN_CPU_CAPABILITY", self.aten),
            ("MKL", "MKL_ENABLE_INSTRUCTIONS", self.mkl_path),
            ("oneDNN", "ONEDNN_MAX_CPU_ISA", " ".join([self.onednn_isa, *self.onednn_kernels])),
        ):
            hits = [w for w in words if w in text.lower()]
            if hits:
                setting = os.environ.get(variable)
                found.append(
                    f"{library} runs {'/'.join(hits)} kernels ({text!r}): "
                    + (
                        f"{variable}={setting} did not take effect"
                        if setting
                        else f"set {variable} to cap it"
                    )
                )
        return found


def parse(output: str) -> Kernels:
    """The kernels named in a probe's output (its ``MKL_VERBOSE``/``ONEDNN_VERBOSE`` lines)."""
    kernels = Kernels()
    for line in output.splitlines():
        if line.startswith("aten capability:"):
            kernels.aten = line.split(":", 1)[1].strip()
        elif line.startswith("MKL_VERBOSE") and " for " in line and "architecture" in line:
            # "MKL_VERBOSE oneMKL 2024.0 ... for Intel(R) 64 architecture <path>, Lnx ..."
            path = line.split("architecture", 1)[1]
            kernels.mkl_path = re.split(r",\s*Lnx|,\s*Win|,\s*Mac", path)[0].strip()
        elif line.startswith("MKL_VERBOSE"):
            match = re.match(r"MKL_VERBOSE\s+([A-Z0-9_]+)\(", line)
            if match and match.group(1) not in kernels.mkl_calls:
                kernels.mkl_calls.append(match.group(1))
        elif line.startswith("onednn_verbose"):
            fields = line.split(",")
            if "info" in fields and any(f.startswith("isa:") for f in fields):
                kernels.onednn_isa = next(f for f in fields if f.startswith("isa:"))[4:]
            elif len(fields) > 6 and fields[2:4] == ["primitive", "exec"]:
                kernel = f"{fields[5]} {fields[6]}"  # primitive kind, implementation
                if kernel not in kernels.onednn_kernels:
                    kernels.onednn_kernels.append(kernel)
    return kernels


def probe(extra_env: dict[str, str] | None = None) -> Kernels:
    """Run the probe in a fresh process (the libraries read their variables once, at load)."""
    env = {**os.environ, **(extra_env or {}), "MKL_VERBOSE": "1", "ONEDNN_VERBOSE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        raise RuntimeError(f"the kernel probe failed:\n{done.stdout}\n{done.stderr}")
    return parse(done.stdout + "\n" + done.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--expect",
        choices=sorted(FORBIDDEN),
        help="exit 1 unless every library runs kernels this setting allows",
    )
    args = parser.parse_args(argv)
    kernels = probe()
    steering = {k: os.environ[k] for s in SETTINGS.values() for k in s if k in os.environ}
    print(json.dumps({"variables": steering, **asdict(kernels)}, indent=1))
    if args.expect:
        problems = kernels.forbidden(FORBIDDEN[args.expect])
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
        if problems:
            return 1
        print(f"every library runs {args.expect} kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
