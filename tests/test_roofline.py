"""The roofline meter of the LLM-width probe (benchmarks/roofline.py, issue #47): FLOPs per
phase and GEMM class, and eigvalsh kept off the dispatch mode (which would make it compute
eigenvectors too)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.roofline import Roofline, table
from mergekit_ext.bf16_products import bfloat16_fpmath


def test_products_and_factorisations_are_counted_per_phase_and_class(monkeypatch):
    monkeypatch.setattr("benchmarks.roofline.RATE_SHAPE", (32, 64, 48))
    meter = Roofline()
    rates = meter.measure_rates(repeats=1)
    assert set(rates) == {"float64", "float32", "bf16"} and all(r > 0 for r in rates.values())
    a = torch.randn(30, 40)
    with meter:
        with meter.phase("gemms"):
            a @ torch.randn(40, 50)  # 2·30·40·50 float32
            torch.addmm(
                torch.zeros(30, 50, dtype=torch.float64), a.double(), torch.randn(40, 50).double()
            )
            with bfloat16_fpmath():
                a @ torch.randn(40, 50)  # float32 in the bf16 fpmath mode
        with meter.phase("lapack"):
            spd = (a.T @ a).double() + 40 * torch.eye(40, dtype=torch.float64)
            factor = torch.linalg.cholesky_ex(spd).L
            torch.cholesky_solve(torch.randn(40, 7, dtype=torch.float64), factor)
            values = torch.linalg.eigvalsh(spd)
    phases = meter.record()["phases"]
    assert phases["gemms"]["flops"] == pytest.approx(
        {"float32": 120_000, "float64": 120_000, "bf16": 120_000}
    )
    lapack = phases["lapack"]["flops"]
    # a.T @ a (float32), the factor n³/3, the solve 2n²·7, eigvalsh 4n³/3 (values only)
    assert lapack["float32"] == pytest.approx(2 * 40 * 40 * 30)
    assert lapack["float64"] == pytest.approx(40**3 / 3 + 2 * 40 * 40 * 7 + 4 / 3 * 40**3)
    assert phases["gemms"]["floor_s"] > 0 and phases["lapack"]["seconds"] > 0
    torch.testing.assert_close(values, torch.linalg.eigvalsh(spd))
    assert "| gemms |" in table(meter.record(), 1)
