"""wide_sums.add_widened: a float32 product into a float64 sum, the bits of ``add_``."""

from __future__ import annotations

import torch

from mergekit_ext.wide_sums import add_widened


def test_add_widened_equals_mixed_dtype_add():
    g = torch.Generator().manual_seed(0)
    total = torch.randn(700, 300, generator=g, dtype=torch.float64)
    part = torch.randn(700, 300, generator=g)
    expected = total.clone().add_(part)
    assert add_widened(total, part) is total
    assert torch.equal(total, expected)


def test_add_widened_into_a_block_view_leaves_the_rest():
    """A block of a larger sum (the Gram's upper block triangle): only the block changes."""
    g = torch.Generator().manual_seed(1)
    total = torch.randn(1200, 1200, generator=g, dtype=torch.float64)
    before = total.clone()
    part = torch.randn(900, 300, generator=g)
    add_widened(total[:900, 600:900], part)
    expected = before.clone()
    expected[:900, 600:900].add_(part)
    assert torch.equal(total, expected)


def test_add_widened_same_dtype_and_transposed_parts():
    total = torch.zeros(5, 7)
    add_widened(total, torch.ones(5, 7))
    assert torch.equal(total, torch.ones(5, 7))
    wide = torch.zeros(7, 5, dtype=torch.float64)
    part = torch.randn(5, 7)
    add_widened(wide, part.T)
    assert torch.equal(wide, part.T.double())
