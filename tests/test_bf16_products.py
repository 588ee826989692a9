"""float32 products at bfloat16 speed (mergekit_ext/bf16_products.py): exact operands only,
float32-accurate sums, the fpmath setting restored, and Grams from kept rows bit for bit
those of the running accumulator."""

from __future__ import annotations

import pytest
import torch

from mergekit_ext.bf16_products import bfloat16_fpmath, float32_product, holds_bfloat16
from mergekit_ext.calibration.statistics import ActivationStatistics, gram_product


def _rows(n: int, dim: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, dim, generator=g) * torch.rand(dim, generator=g) * 3).bfloat16()


def test_holds_bfloat16_reads_the_low_mantissa_bits():
    x = _rows(64, 48)
    assert holds_bfloat16(x)
    assert holds_bfloat16(x.float())
    assert holds_bfloat16(x.float().T)  # a transposed view, no copy needed
    assert holds_bfloat16(x.float()[:, ::2])  # a strided view (copied for the check)
    wide = x.float()
    wide[3, 5] = wide[3, 5] + wide[3, 5].abs() * 2**-12  # one entry off the bfloat16 grid
    assert not holds_bfloat16(wide)
    assert not holds_bfloat16(x.double())
    assert not holds_bfloat16(x.half())


def test_exact_operands_give_float32_accurate_products_and_restore_the_setting():
    before = torch.backends.mkldnn.matmul.fp32_precision
    a, b = _rows(300, 256, 1).float(), _rows(256, 200, 2).float()
    product = float32_product(a, b)
    assert product.dtype == torch.float32
    reference = a.double() @ b.double()
    assert float((product.double() - reference).norm() / reference.norm()) < 2e-6
    # a bfloat16 result would be off by ~1e-3: these are float32 sums
    low = (a.bfloat16() @ b.bfloat16()).double()
    assert float((low - reference).norm() / reference.norm()) > 1e-4
    assert torch.backends.mkldnn.matmul.fp32_precision == before
    with bfloat16_fpmath():
        assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"
    assert torch.backends.mkldnn.matmul.fp32_precision == before


def test_an_inexact_operand_takes_the_plain_float32_product():
    g = torch.Generator().manual_seed(3)
    a = torch.randn(64, 96, generator=g)  # float32 values, not bfloat16 ones
    b = _rows(96, 32, 4).float()
    assert torch.equal(float32_product(a, b), a @ b)


def test_kept_rows_give_the_accumulators_gram_bit_for_bit():
    """A task that kept its bfloat16 rows (fewer tokens than inputs) forms the Gram the
    running accumulator would have, in the same chunks and the same GEMM mode."""
    x = _rows(90, 128, 5)
    kept = ActivationStatistics(128, keep_rows=True)
    summed = ActivationStatistics(128)
    for chunk in torch.split(x, 32):
        kept.update(chunk)
        summed.update(chunk)
    from_rows = kept.finalize()
    assert from_rows.gram is None and from_rows.rows is not None
    assert torch.equal(from_rows.gram_from_rows(), summed.finalize().gram)
    # and the accumulator's chunk product is the fast one: gram_product of the chunk
    assert torch.equal(
        gram_product(x[:32].float()), float32_product(x[:32].float().T, x[:32].float())
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_exact_operands_on_cuda_take_one_bfloat16_gemm_with_a_float32_result():
    a, b = _rows(512, 256, 6).float().cuda(), _rows(256, 384, 7).float().cuda()
    product = float32_product(a, b)
    assert product.dtype == torch.float32 and product.is_cuda
    reference = a.double() @ b.double()
    assert float((product.double() - reference).norm() / reference.norm()) < 2e-6


def test_output_errors_summed_over_row_chunks_match_one_sum(monkeypatch):
    """The output errors sum their traces over chunks of output rows (no out x in
    temporaries): the same ratios as one chunk, whatever the chunk size; the dense solve's
    reference (a number from its product W_k G_k) gives the ratio the Gram gives."""
    from mergekit_ext import wide_sums
    from mergekit_ext.methods.least_squares import measures, solve

    g = torch.Generator().manual_seed(8)
    expert = torch.randn(37, 24, generator=g)
    merged = expert + 0.1 * torch.randn(37, 24, generator=g)
    rows = torch.randn(50, 24, generator=g)
    gram = rows.double().T @ rows.double() / 50
    reference = solve.trace_product((expert.double() @ gram).float(), expert)

    def errors() -> list[float]:
        return [
            measures.relative_output_error(merged, expert, gram),
            measures.relative_output_error(merged, expert, gram, reference),
            measures.relative_output_error_rows(merged, expert, rows),
            measures.relative_output_error_rows(merged, expert, rows, reference),
            measures.relative_output_error_rows(
                merged.bfloat16(), expert.bfloat16(), rows, None, torch.bfloat16
            ),
        ]

    whole = errors()
    monkeypatch.setattr(wide_sums, "_CHUNK_ENTRIES", 24 * 5)  # 5 rows per chunk, 8 chunks
    assert len(wide_sums.row_chunks(37, 24)) == 8
    assert solve.trace_product((expert.double() @ gram).float(), expert) == pytest.approx(
        reference, rel=1e-12
    )
    chunked = errors()
    for a, b in zip(whole, chunked):
        assert 0.0 < a and abs(a - b) <= 1e-6 * a, (a, b)
    assert whole[1] == pytest.approx(whole[0], rel=1e-6)
    assert whole[3] == pytest.approx(whole[2], rel=1e-5)


def test_wide_sums_follow_the_logical_order_in_float64():
    """dot64 and frobenius64 sum in float64 in the tensor's logical order: a transposed view
    and its contiguous copy give the same bits (one process and several record the same
    norms), and a float32 tensor's norm matches the float64 one where a float32 sum drifts."""
    from mergekit_ext import wide_sums

    g = torch.Generator().manual_seed(3)
    w = torch.randn(700, 3000, generator=g) + 3.0
    exact = float(torch.linalg.vector_norm(w.double()))
    assert wide_sums.frobenius64(w) == pytest.approx(exact, rel=1e-12)
    view = torch.randn(3000, 700, generator=g).T
    assert wide_sums.frobenius64(view) == wide_sums.frobenius64(view.contiguous())
    assert wide_sums.dot64(view, w) == wide_sums.dot64(view.contiguous(), w)
    assert wide_sums.dot64(w[0], w[0]) == pytest.approx(float(w[0].double().square().sum()))
    # The same bits whatever the thread count (a BLAS dot or a whole-tensor sum() differs):
    # a distributed run's ranks use one thread each, a single process several.
    big = torch.randn(300, 20000, generator=g, dtype=torch.float64)
    threads = torch.get_num_threads()
    try:
        found = set()
        for n in (1, 2, 3, 4):
            torch.set_num_threads(n)
            found.add((wide_sums.frobenius64(big), wide_sums.dot64(big, big.flip(0))))
    finally:
        torch.set_num_threads(threads)
    assert len(found) == 1, found
