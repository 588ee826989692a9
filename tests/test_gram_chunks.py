"""The Gram sum's chunks of consecutive batches (calibration.statistics.gram_chunks): fewer
float64 additions of ``dim x dim`` products, the same Gram from kept rows bit for bit."""

from __future__ import annotations

import pytest
import torch

from mergekit_ext.calibration import statistics
from mergekit_ext.calibration.statistics import (
    GRAM_CHUNK_MIN_ROWS,
    ActivationStatistics,
    gram_chunk_rows,
    gram_chunks,
)


def test_chunks_join_batches_until_the_minimum():
    assert gram_chunks([125] * 20, 1000) == [1000, 1000, 500]
    assert gram_chunks([300, 800, 50, 2000, 10], 1000) == [1100, 2050, 10]
    assert gram_chunks([5000], 1000) == [5000]
    assert gram_chunks([], 1000) == []
    sizes = [37, 512, 1, 2048, 999, 3000, 7]
    assert sum(gram_chunks(sizes, 1000)) == sum(sizes)
    # at most a quarter of the width, so the pending float32 rows stay below an eighth of
    # the float64 sum
    assert gram_chunk_rows(4096) == 1024 and gram_chunk_rows(14336) == GRAM_CHUNK_MIN_ROWS
    assert gram_chunk_rows(3) == 1


@pytest.fixture
def products(monkeypatch):
    """The row counts of every Gram product the accumulators form, in order."""
    calls: list[int] = []
    original = statistics.gram_product

    def counting(rows):
        calls.append(int(rows.shape[0]))
        return original(rows)

    monkeypatch.setattr(statistics, "gram_product", counting)
    return calls


@pytest.mark.parametrize("bfloat16_values", [False, True])
def test_small_batches_are_multiplied_together(products, bfloat16_values):
    """At 64 inputs (16-row chunks): four small batches make one product (four float64
    additions of the ``dim x dim`` sum before), a long batch is one alone, the rest one more;
    the Gram is as accurate as float32 sums give, and bit for bit the one the same task's kept
    rows give."""
    g = torch.Generator().manual_seed(0)
    dim, sizes = 64, [5, 5, 5, 1, 20, 3]
    assert gram_chunk_rows(dim) == 16
    x = torch.randn(sum(sizes), dim, generator=g)
    if bfloat16_values:
        x = x.bfloat16()
    summed = ActivationStatistics(dim)
    for batch in torch.split(x, sizes):
        summed.update(batch)
    result = summed.finalize()
    assert products == gram_chunks(sizes, 16) == [16, 20, 3]
    reference = x.double().T @ x.double() / x.shape[0]
    torch.testing.assert_close(result.gram, reference, rtol=1e-6, atol=1e-6)
    assert torch.equal(result.gram, summed_gram(x, sizes))


def summed_gram(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The same Gram from kept rows (TaskStatistics.gram_from_rows)."""
    stats = statistics.TaskStatistics(
        gram=None,
        mean=x.double().mean(0),
        count=x.shape[0],
        second_moment=x.double().square().mean(0),
        rows=x.float(),
        row_batches=tuple(sizes),
    )
    return stats.gram_from_rows()


def test_reused_activation_buffer_does_not_change_the_gram():
    """A hook hands the same float32 buffer each batch, overwritten in place: the pending
    rows are copies, so the Gram is that of every batch's values."""
    g = torch.Generator().manual_seed(1)
    dim = 16
    buffer = torch.empty(100, dim)
    seen = []
    acc = ActivationStatistics(dim)
    for _ in range(5):
        buffer.copy_(torch.randn(100, dim, generator=g))
        seen.append(buffer.clone())
        acc.update(buffer)
    x = torch.cat(seen).double()
    torch.testing.assert_close(acc.finalize().gram, x.T @ x / x.shape[0], rtol=1e-6, atol=1e-6)


def _full_product_gram(x: torch.Tensor, sizes: list[int], monkeypatch) -> torch.Tensor:
    """The accumulator's Gram with every chunk's full product (the upper triangle off)."""
    with monkeypatch.context() as m:
        m.setattr(statistics, "HALF_GRAM_MIN_DIM", 10**9)
        acc = ActivationStatistics(int(x.shape[1]))
        for batch in torch.split(x, sizes):
            acc.update(batch)
        return acc.finalize().gram


@pytest.mark.parametrize("dim", [40, 1024])
def test_upper_block_triangle_gives_the_full_products_gram(monkeypatch, dim):
    """Wide float32 Gram sums add only each chunk's upper block triangle and mirror it at the
    end (issue #47: 0.6x the product's FLOPs at 3584 inputs): where the machine's products
    pass the one-time check, the Gram is the full products' bit for bit, with chunks of
    several lengths (joined small batches, a long batch alone, the remainder); else the
    full product is taken. At 40 inputs (column blocks of 16, lowered for the test) the
    mirror covers several blocks and a ragged last one."""
    if dim < statistics.HALF_GRAM_MIN_DIM:
        monkeypatch.setattr(statistics, "HALF_GRAM_MIN_DIM", 8)
        monkeypatch.setattr(statistics, "HALF_GRAM_BLOCK", 16)
    g = torch.Generator().manual_seed(dim)
    sizes = [100, 100, 300, 7, 1200, 90]
    x = torch.randn(sum(sizes), dim, generator=g) * torch.rand(dim, generator=g)
    acc = ActivationStatistics(dim)
    for batch in torch.split(x, sizes):
        acc.update(batch)
    half = acc.finalize().gram
    full = _full_product_gram(x, sizes, monkeypatch)
    reference = x.double().T @ x.double() / x.shape[0]
    torch.testing.assert_close(half, reference, rtol=1e-6, atol=1e-6)
    assert torch.equal(half, half.T)
    if all(
        statistics.upper_gram_is_exact(n, dim) for n in gram_chunks(sizes, gram_chunk_rows(dim))
    ):
        assert acc._upper_only
        assert torch.equal(half, full)
        # and the same bits as the Gram formed from kept rows (span and dense solves)
        assert torch.equal(half, summed_gram(x, sizes))


def test_upper_block_triangle_is_not_taken_for_bfloat16_values_or_float64_rows():
    """bfloat16-valued rows take the bf16 units (gram_product), float64 rows their own
    float64 product: neither the upper triangle path."""
    x = torch.randn(64, 1024)
    assert statistics.takes_upper_gram(x) == statistics.upper_gram_is_exact(64, 1024)
    assert not statistics.takes_upper_gram(x.bfloat16().float())
    assert not statistics.takes_upper_gram(x.double())
    assert not statistics.takes_upper_gram(torch.randn(64, 512))


def test_mirror_upper_copies_the_blocks_above_the_diagonal(monkeypatch):
    """Blocks left of the diagonal blocks are copied from above them; the diagonal blocks,
    formed whole, are kept as they are."""
    monkeypatch.setattr(statistics, "HALF_GRAM_BLOCK", 2)
    m = torch.arange(25.0, dtype=torch.float64).view(5, 5)
    m = m + m.T  # symmetric diagonal blocks
    upper = m.clone()
    upper[2:4, :2] = 0.0
    upper[4:, :4] = 0.0
    assert torch.equal(statistics.mirror_upper(upper), m)


@pytest.mark.parametrize("view", [False, True], ids=["contiguous", "view"])
@pytest.mark.parametrize("exact_rows", [None, 100, 300])
def test_accumulator_and_kept_rows_agree_whatever_the_check_says(monkeypatch, exact_rows, view):
    """The accumulator's Gram and the one formed from kept rows go through the same chunk
    rule (add_gram_chunk), so they are the same bits on a machine where the one-time check
    passes for no chunk shape (None), or for some only (the others take the full product,
    whose lower blocks the mirror then replaces), and for a non-contiguous batch (a
    transposed view) as for its copy. The full products here are made slightly asymmetric,
    as a machine's kernels may make them: then a full-product Gram symmetrised and one
    mirrored differ in their last bits, so only one rule for both sums keeps them equal."""
    monkeypatch.setattr(statistics, "HALF_GRAM_MIN_DIM", 8)
    monkeypatch.setattr(statistics, "HALF_GRAM_BLOCK", 16)
    monkeypatch.setattr(statistics, "upper_gram_is_exact", lambda rows, dim: rows == exact_rows)
    original = statistics.gram_product

    def asymmetric(rows):
        product = original(rows)
        return product + torch.triu(product, 1) * 2.0**-20

    monkeypatch.setattr(statistics, "gram_product", asymmetric)
    dim = 40
    g = torch.Generator().manual_seed(3)
    sizes = [100, 100, 300, 7, 1200, 90]  # chunks of 100 (joined to the minimum) and 1200
    x = torch.randn(sum(sizes), dim, generator=g) * torch.rand(dim, generator=g)
    acc = ActivationStatistics(dim)
    for batch in torch.split(x, sizes):
        acc.update(batch.T.contiguous().T if view else batch)  # a view: strides not row-major
    gram = acc.finalize().gram
    assert torch.equal(gram, summed_gram(x, sizes))
    assert torch.equal(gram, gram.T)
    torch.testing.assert_close(gram, x.double().T @ x.double() / x.shape[0], rtol=1e-5, atol=1e-5)
