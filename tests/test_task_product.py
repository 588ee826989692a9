"""The dense solve's per-task product ``W_k G_k`` (solve.task_product, issue #31): from the
rows on the bfloat16 units where they and the weight hold bfloat16 values, float32-accurate,
and one process and several forming it alike."""

from __future__ import annotations

import pytest
import torch

from mergekit_ext.methods.least_squares import solve


def _operands(out: int, n_in: int, tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out, n_in, generator=g) * 0.02).bfloat16().float()
    rows = (torch.randn(tokens, n_in, generator=g) * torch.rand(n_in, generator=g) * 3).bfloat16()
    rows = rows.float()  # kept as the statistics keep them: float32 holding bfloat16 values
    gram = rows.double().T @ rows.double() / tokens
    return weight, rows, gram


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


def test_rows_of_bfloat16_values_give_a_float32_accurate_product(fast_products):
    weight, rows, gram = _operands(96, 128, 64)
    reference = weight.double() @ gram
    from_rows = solve.task_product(weight, gram, rows)
    assert fast_products == [((96, 128), (128, 64))]  # W_k X_kᵀ with exact operands
    assert from_rows.dtype == torch.float32
    from_gram = solve.task_product(weight, gram)
    assert len(fast_products) == 1
    assert torch.equal(from_gram, weight @ gram.float())
    # both float32-accurate: the same order of error against the float64 product
    assert _relative(from_rows, reference) < 1e-6
    assert _relative(from_rows, reference) < 2 * _relative(from_gram, reference)
    # into a caller's buffer
    buffer = torch.empty(96, 128)
    assert solve.task_product(weight, gram, rows, out=buffer) is buffer
    assert torch.equal(buffer, from_rows)


def test_the_gram_form_where_the_rows_do_not_pay_or_are_not_bfloat16(fast_products):
    weight, rows, gram = _operands(40, 64, 40)  # 40 tokens > 64 / 2 inputs
    assert torch.equal(solve.task_product(weight, gram, rows), weight @ gram.float())
    weight, rows, gram = _operands(40, 64, 20)
    wide_rows = rows + rows.abs() * 2**-12  # float32 values off the bfloat16 grid
    assert torch.equal(solve.task_product(weight, gram, wide_rows), weight @ gram.float())
    double = solve.task_product(weight.double(), gram, rows)
    assert double.dtype == torch.float64 and torch.equal(double, weight.double() @ gram)
    assert fast_products == []


def test_regmean_solve_takes_the_row_form_only_for_tasks_that_kept_rows(fast_products):
    """Per task, as the distributed reduction decides it: the same merged bits when the
    tasks' products are formed one by one through regmean_add_task."""
    ops = [_operands(48, 96, n, seed) for seed, n in enumerate((30, 40, 60))]
    weights = [w for w, _, _ in ops]
    grams = [g for _, _, g in ops]
    kept = [r if r.shape[0] <= 48 else None for _, r, _ in ops]
    solution = solve.regmean_solve(weights, grams, 1.0, ridge=0.0, gram_rows=kept)
    assert len(fast_products) == 2  # the third task has 60 tokens > 96 / 2
    sums = solve.regmean_zero_sums((48, 96))
    for w, g, r in zip(weights, grams, kept):
        solve.regmean_add_task(sums, w, g, 1.0, 1.0, solve.task_product(w, g, r))
    summed = solve.solve_regmean_sums(sums, name="g", out_dtype=torch.float32)
    assert torch.equal(solution.merged_weight, summed.merged_weight)
    plain = solve.regmean_solve(weights, grams, 1.0, ridge=0.0)
    assert not torch.equal(plain.merged_weight, solution.merged_weight)
    assert _relative(solution.merged_weight, plain.merged_weight.double()) < 1e-5
    with pytest.raises(solve.TensorError, match="row sets"):
        solve.regmean_solve(weights, grams, 1.0, gram_rows=kept[:2])
