"""The least-squares solve when a group has fewer calibration tokens than inputs (issue #18).

Tiny widths, float64, against dense closed forms computed here: ``ridge: auto`` is exactly 0
(same bytes) with at least as many tokens as inputs; below, both the dense regularised
Cholesky solve and the span (Woodbury) solve on the kept rows equal the ridge-regularised
closed form; the diagnostics stay finite and the plan warns with the numbers.
"""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch

from mergekit_ext.calibration.statistics import ActivationStatistics
from mergekit_ext.executor.plan import method_warnings
from mergekit_ext.methods import least_squares
from mergekit_ext.methods.chain_of_merges import ChainOfMergesMethod
from mergekit_ext.methods.layerwise import LinearGroup, StatisticsRequest, TaskStatistics
from mergekit_ext.methods.least_squares import (
    AUTO_RIDGE,
    RegMeanParameters,
    regmean_solve,
    relative_output_error,
    relative_output_error_rows,
    resolve_ridge,
)
from mergekit_ext.methods.regmean import RegMeanMethod

DIM = 24


def inputs(seed: int, n: int, dim: int = DIM) -> torch.Tensor:
    """N x dim correlated inputs with a non-zero mean and one outlier feature (float64)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g, dtype=torch.float64) @ torch.randn(
        dim, dim, generator=g, dtype=torch.float64
    )
    x += torch.randn(dim, generator=g, dtype=torch.float64)
    x[:, 0] *= 20.0
    return x


def expert_weights(k: int, out: int, dim: int = DIM) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(77)
    base = torch.randn(out, dim, generator=g, dtype=torch.float64)
    return [base + 0.1 * torch.randn(out, dim, generator=g, dtype=torch.float64) for _ in range(k)]


def closed_form(ws, xs, alpha, omegas, ridge):
    """``(Σ ω W_k G̃_k + λ/Σω Σ ω W_k)(Σ ω G̃_k + λ I)⁻¹``, λ = ridge · mean diag: dense float64."""
    grams = [x.T @ x / x.shape[0] for x in xs]
    shrunk = [alpha * g + (1 - alpha) * torch.diag(torch.diag(g)) for g in grams]
    system = sum(o * g for o, g in zip(omegas, shrunk))
    lam = ridge * float(torch.diag(system).mean())
    numerator = sum(o * w @ g for o, w, g in zip(omegas, ws, shrunk))
    numerator = numerator + lam / sum(omegas) * sum(o * w for o, w in zip(omegas, ws))
    system = system + lam * torch.eye(system.shape[0], dtype=torch.float64)
    return torch.linalg.solve(system, numerator.T).T


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_resolve_ridge():
    assert resolve_ridge("auto", 100, 99) == AUTO_RIDGE
    assert resolve_ridge("auto", 100, 100) == 0.0
    assert resolve_ridge("auto", 100, None) == 0.0
    assert resolve_ridge(0.25, 100, 3) == 0.25
    with pytest.raises(ValueError, match="auto"):
        resolve_ridge("sometimes", 100, 3)
    assert RegMeanParameters().ridge == "auto"
    assert RegMeanParameters(ridge=0.5).ridge == 0.5
    with pytest.raises(ValueError):
        RegMeanParameters(ridge=-1.0)


@pytest.mark.parametrize("alpha", [1.0, 0.9])
def test_full_rank_auto_is_bytes_identical_and_exact(alpha):
    xs = [inputs(1, 30), inputs(2, 18)]  # 48 tokens >= 24 inputs
    ws = expert_weights(2, 7)
    grams = [x.T @ x / x.shape[0] for x in xs]
    auto = regmean_solve(ws, grams, alpha, ridge="auto", tokens=48, rows=xs)
    zero = regmean_solve(ws, grams, alpha, ridge=0.0)
    assert torch.equal(auto.merged_weight, zero.merged_weight)
    assert auto.solver == zero.solver == "pinv" and auto.ridge == 0.0
    assert rel(auto.merged_weight, closed_form(ws, xs, alpha, [1.0, 1.0], 0.0)) < 1e-9


@pytest.mark.parametrize("alpha", [1.0, 0.8])
@pytest.mark.parametrize("out", [5, 60])  # out ≤ 2 in and out > 2 in take different solve orders
def test_fewer_tokens_than_inputs_equals_ridge_closed_form(alpha, out):
    xs = [inputs(3, 6), inputs(4, 5), inputs(5, 4)]  # 15 tokens < 24 inputs
    ws = expert_weights(3, out)
    omegas = [1.0, 0.5, 2.0]
    grams = [x.T @ x / x.shape[0] for x in xs]
    expected = closed_form(ws, xs, alpha, omegas, AUTO_RIDGE)
    dense = regmean_solve(ws, grams, alpha, task_weights=omegas, ridge="auto", tokens=15)
    span = regmean_solve(ws, grams, alpha, task_weights=omegas, ridge="auto", tokens=15, rows=xs)
    assert dense.ridge == span.ridge == AUTO_RIDGE
    assert span.solver == "cholesky in the span of 15 tokens" and dense.solver == "pinv"
    assert rel(dense.merged_weight, expected) < 1e-9
    assert rel(span.merged_weight, expected) < 1e-9
    assert span.condition_number == pytest.approx(dense.condition_number, rel=1e-6)
    if alpha == 1.0:
        # directions no token spans keep the ω-mean of the experts (pinv would give 0 there)
        basis = torch.linalg.svd(torch.cat(xs), full_matrices=True).Vh[15:]  # ⊥ the tokens
        mean = sum(o * w for o, w in zip(omegas, ws)) / sum(omegas)
        torch.testing.assert_close(span.merged_weight @ basis.T, mean @ basis.T)


def test_span_solve_float32_and_condition_estimate(monkeypatch):
    xs = [inputs(6, 8), inputs(7, 9)]
    ws = [w.float() for w in expert_weights(2, 10)]
    grams = [x.T @ x / x.shape[0] for x in xs]
    exact = regmean_solve(ws, grams, 1.0, ridge="auto", tokens=17, rows=[x.float() for x in xs])
    assert exact.merged_weight.dtype == torch.float32 and exact.condition_number_method == "exact"
    expected = closed_form([w.double() for w in ws], xs, 1.0, [1.0, 1.0], AUTO_RIDGE)
    assert rel(exact.merged_weight, expected) < 1e-5
    # above EXACT_CONDITION_MAX_DIM the condition number comes from the T x T matrix
    monkeypatch.setattr(least_squares.solve, "EXACT_CONDITION_MAX_DIM", 8)
    for alpha in (1.0, 0.7):
        est = regmean_solve(ws, grams, alpha, ridge="auto", tokens=17, rows=xs)
        dense = regmean_solve(ws, grams, alpha, ridge="auto", tokens=17)
        assert est.condition_number_method == "estimate"
        assert 0.0 < est.condition_number <= dense.condition_number * (1 + 1e-9)
        assert est.condition_number == pytest.approx(dense.condition_number, rel=1e-3)


def test_span_products_are_float32_where_the_merge_is_written_in_bfloat16(monkeypatch):
    # issue #47: after a float32 pass, bf16-written weights take float32 out x in x T
    # products; float32-written ones keep float64 (their bytes); float64 weights always do
    f32, f64, bf16 = torch.float32, torch.float64, torch.bfloat16
    assert least_squares.solve.span_product_dtype(f32, f32) == f64
    assert least_squares.solve.span_product_dtype(f32, f32, f32) == f64
    assert least_squares.solve.span_product_dtype(f32, f32, bf16) == f32
    assert least_squares.solve.span_product_dtype(f32, f32, torch.float16) == f32
    assert least_squares.solve.span_product_dtype(bf16, f32) == f32
    assert least_squares.solve.span_product_dtype(f32, f64, bf16) == f64
    seen = []
    span_solve = least_squares.solve.span_solve

    def spy(*args, **kwargs):
        seen.append(kwargs["product_dtype"])
        return span_solve(*args, **kwargs)

    monkeypatch.setattr(least_squares.solve, "span_solve", spy)
    g = torch.Generator().manual_seed(47)
    xs = [torch.randn(40, 96, generator=g) for _ in range(2)]
    ws = [torch.randn(128, 96, generator=g).bfloat16().float() for _ in range(2)]
    solved = {
        written: regmean_solve(
            ws, [None, None], 1.0, ridge="auto", tokens=80, rows=xs, written_dtype=written
        ).merged_weight
        for written in (None, bf16)
    }
    assert seen == [f64, f32]
    # the same solution as far as float32 products reach, and nearly every bf16 entry alike
    assert rel(solved[bf16], solved[None]) < 1e-5
    differ = (solved[bf16].bfloat16() != solved[None].bfloat16()).float().mean()
    assert float(differ) <= 1e-3


def test_output_error_from_rows_equals_gram_form():
    x = inputs(8, 9)
    w, w_k = expert_weights(2, 6)
    gram = x.T @ x / x.shape[0]
    assert relative_output_error_rows(w, w_k, x) == pytest.approx(
        relative_output_error(w, w_k, gram), rel=1e-6
    )


def test_output_error_from_float32_rows_is_the_float64_ratio():
    # float32 weights and rows take a float32 GEMM of the float64 difference (issue #47):
    # the ratio stays that of the float64 products far below the record's three digits
    g = torch.Generator().manual_seed(47)
    expert = torch.randn(96, 2048, generator=g).bfloat16().float()
    merged = (expert + 0.03 * torch.randn(96, 2048, generator=g)).bfloat16().float()
    rows = torch.randn(300, 2048, generator=g)
    fast = relative_output_error_rows(merged, expert, rows)
    exact = relative_output_error_rows(merged.double(), expert.double(), rows.double())
    assert fast == pytest.approx(exact, rel=1e-6) and fast != exact


def test_activation_statistics_keep_rows_below_the_width():
    acc = ActivationStatistics(DIM, keep_rows=True)
    x = inputs(9, 30).float()
    acc.update(x[:10])
    acc.update(x[10:20])
    st = acc.finalize()
    assert st.rows is not None and st.rows.shape == (20, DIM) and st.gram is None
    torch.testing.assert_close(st.rows, x[:20])
    reference = x[:20].double().T @ x[:20].double() / 20
    torch.testing.assert_close(st.gram_from_rows(), reference, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(st.second_moment, torch.diagonal(reference), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(st.mean, x[:20].double().mean(0), rtol=1e-5, atol=1e-5)
    # bit for bit the Gram an accumulator without rows returns
    plain_acc = ActivationStatistics(DIM)
    plain_acc.update(x[:10])
    plain_acc.update(x[10:20])
    assert torch.equal(st.gram_from_rows(), plain_acc.finalize().gram)
    # crossing the width: the Gram sum is formed from the kept rows, which are dropped
    full = ActivationStatistics(DIM, keep_rows=True)
    full.update(x[:20])
    full.update(x[20:])
    done = full.finalize()
    assert done.rows is None and done.gram is not None
    plain_acc = ActivationStatistics(DIM)
    plain_acc.update(x[:20])
    plain_acc.update(x[20:])
    assert torch.equal(done.gram, plain_acc.finalize().gram)
    plain = ActivationStatistics(DIM)
    plain.update(x[:5])
    assert plain.finalize().rows is None


def _stats(x: torch.Tensor, keep_rows: bool) -> TaskStatistics:
    unit = x / x.norm(dim=1, keepdim=True)
    n = x.shape[0]
    return TaskStatistics(
        gram=None if keep_rows else x.T @ x / n,
        second_moment=x.square().mean(0),
        mean=x.mean(0),
        count=n,
        gram_normalized=unit.T @ unit / n,
        rows=x if keep_rows else None,
    )


def _group(xs, ws, keep_rows: bool, merged: bool, dtype=torch.float32) -> LinearGroup:
    """One linear group of ``dtype`` weights; bfloat16: rows as a bfloat16 pass gives them."""
    experts = [{"blk.fc.weight": w.to(dtype)} for w in ws]
    low = dtype == torch.bfloat16
    if low:
        xs = [x.to(torch.bfloat16).double() for x in xs]
    stats = [_stats(x, keep_rows) for x in xs]
    return LinearGroup(
        name="blk.fc",
        weights=["blk.fc.weight"],
        base={"blk.fc.weight": torch.zeros_like(experts[0]["blk.fc.weight"])},
        experts=experts,
        task_names=[f"t{k}" for k in range(len(ws))],
        expert_stats=stats,
        merged_stats=[_stats(x + 0.1, keep_rows) for x in xs] if merged else None,
        compute_dtype=torch.bfloat16 if low else torch.float32,
    )


@pytest.mark.parametrize("method", [RegMeanMethod(), ChainOfMergesMethod()])
def test_group_merge_below_width_span_equals_dense_and_diagnostics_finite(method):
    xs = [inputs(10, 7), inputs(11, 6)]  # 13 tokens < 24 inputs
    ws = expert_weights(2, 9)
    merged = isinstance(method, ChainOfMergesMethod)
    span_w, span_d = method.merge_linear_group(_group(xs, ws, True, merged), {})
    dense_w, dense_d = method.merge_linear_group(_group(xs, ws, False, merged), {})
    used = [x + 0.1 for x in xs] if merged else xs  # CoM solves on the merged path
    expected = closed_form([w.float().double() for w in ws], used, 1.0, [1.0, 1.0], AUTO_RIDGE)
    # float32 weights: the span solve's products are out x in x T, the dense ones out x in x in
    assert rel(span_w["blk.fc.weight"], expected) < 1e-5
    assert rel(dense_w["blk.fc.weight"], expected) < 1e-2
    assert span_d["solver"] == "cholesky in the span of 13 tokens"
    for d in (span_d, dense_d):
        assert d["ridge"] == AUTO_RIDGE and d["ridge_setting"] == "auto"
        assert d["tokens"] == 13 and d["input_width"] == DIM
        assert 1.0 < d["condition_number"] < float("inf")
    for k, task in enumerate(span_d["tasks"]):
        a = span_d["tasks"][task]["relative_output_error"]
        b = dense_d["tasks"][task]["relative_output_error"]
        x = used[k]
        merged_w = span_w["blk.fc.weight"].double()
        exact = relative_output_error(merged_w, ws[k].float().double(), x.T @ x / x.shape[0])
        assert a == pytest.approx(exact, rel=2e-2)  # float32 products of a 2e-4 error
        assert 0.0 < b < float("inf")


def test_rows_that_do_not_match_the_count_are_ignored():
    xs = [inputs(12, 7), inputs(13, 6)]
    ws = expert_weights(2, 5)
    group = _group(xs, ws, False, False)
    group.expert_stats[0].rows = xs[0][:3]  # e.g. statistics summed over several processes
    group.expert_stats[1].rows = xs[1]
    _, diagnostics = RegMeanMethod().merge_linear_group(group, {})
    assert diagnostics["solver"] == "pinv"


def test_full_rank_group_merge_bytes_unchanged_by_the_new_defaults():
    xs = [inputs(14, 30), inputs(15, 28)]
    ws = expert_weights(2, 5)
    auto_w, auto_d = RegMeanMethod().merge_linear_group(_group(xs, ws, True, False), {})
    zero_w, _ = RegMeanMethod().merge_linear_group(_group(xs, ws, False, False), {"ridge": 0.0})
    assert torch.equal(auto_w["blk.fc.weight"], zero_w["blk.fc.weight"])
    assert auto_d["ridge"] == 0.0 and auto_d["solver"] == "pinv"


def test_mixed_rows_and_grams_and_full_w2_from_rows():
    xs = [inputs(16, 7), inputs(17, 30)]  # task 1 has more tokens than inputs: a Gram
    ws = expert_weights(2, 5)
    group = _group(xs, ws, False, True)
    group.merged_stats[0] = _stats(xs[0] + 0.1, True)  # rows instead of the Gram
    reference = _group(xs, ws, False, True)
    w, d = ChainOfMergesMethod().merge_linear_group(group, {})
    w_ref, d_ref = ChainOfMergesMethod().merge_linear_group(reference, {})
    assert rel(w["blk.fc.weight"], w_ref["blk.fc.weight"]) < 1e-6  # 37 tokens: ridge 0
    assert d["covariate_shift_covariance"] == "full"
    for task in d["tasks"]:
        assert d["tasks"][task]["covariate_shift_w2"] == pytest.approx(
            d_ref["tasks"][task]["covariate_shift_w2"], rel=1e-6
        )


def _plan(tokens: list[int], ridge, keep_rows: bool = True):
    shapes = {"layers.0.mlp.up_proj.weight": (64, 16), "layers.0.mlp.down_proj.weight": (16, 64)}
    from mergekit_ext.executor.plan import BlockLayout
    from mergekit_ext.models.families import GroupSpec

    block = BlockLayout(
        index=0,
        prefix="layers.0.",
        groups=(
            GroupSpec("mlp.up", ("mlp.up_proj",)),
            GroupSpec("mlp.down_proj", ("mlp.down_proj",)),
        ),
        tensors=list(shapes),
    )
    return SimpleNamespace(
        request=StatisticsRequest(propagate=True, keep_rows=keep_rows),
        experts=[SimpleNamespace(data=SimpleNamespace(num_tokens=t)) for t in tokens],
        parameters=SimpleNamespace(ridge=ridge),
        blocks=[block],
        base=SimpleNamespace(shapes=shapes),
        method=ChainOfMergesMethod(),  # the warning is the least-squares method's
        compute=None,
    )


def test_plan_warns_when_tokens_are_fewer_than_inputs():
    warnings = method_warnings(_plan([20, 21], "auto"))
    assert len(warnings) == 1  # 41 tokens: only the 64-input group
    assert (
        "the Gram of mlp.down_proj (64 inputs) has at most 41 ranks from 41 calibration tokens"
        in warnings[0]
    )
    assert "ridge: auto" in warnings[0]
    zero = method_warnings(_plan([20, 21], 0.0))
    assert "sets the merged weight to 0" in zero[0] and "64 x 64" in zero[0]
    assert method_warnings(_plan([40, 40], "auto")) == []
    assert method_warnings(_plan([5, 5], "auto", keep_rows=False)) == []
    assert len(method_warnings(_plan([5, 5], "auto"))) == 2


def test_plan_warning_is_logged_by_a_real_plan(tiny_llama_set, tmp_path, caplog):
    import yaml
    from mergekit.options import MergeOptions

    from mergekit_ext.config import parse_config
    from mergekit_ext.executor import plan_layerwise_merge

    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a b c"}\n{"text": "d e"}\n')
    base, experts = tiny_llama_set.base, tiny_llama_set.experts[:2]
    models = [
        {"model": e, "name": f"t{k}", "calibration": {"path": str(data), "samples": 2}}
        for k, e in enumerate(experts)
    ]
    cfg = parse_config(
        yaml.safe_dump({"merge_method": "chain_of_merges", "base_model": base, "models": models})
    )
    with caplog.at_level(logging.WARNING, logger="mergekit_ext"):
        plan = plan_layerwise_merge(cfg, MergeOptions(quiet=True), ChainOfMergesMethod(), {})
    assert plan.rank_warnings and all("ranks from" in w for w in plan.rank_warnings)
    assert any("ranks from" in r.getMessage() for r in caplog.records)
    assert "warning: " + plan.rank_warnings[0] in plan.describe()


def test_the_plan_asks_the_method_for_its_solve_and_warnings(tiny_llama_set, tmp_path):
    """The executor's estimate takes the solve's bytes, the span decision and the warnings
    from the method (methods/layerwise.py), never from least squares' parameters: a method
    that says otherwise changes the plan (issue #53)."""
    import yaml
    from mergekit.options import MergeOptions

    from mergekit_ext.config import parse_config
    from mergekit_ext.executor import plan_layerwise_merge
    from mergekit_ext.executor.plan import estimate_memory
    from mergekit_ext.methods.layerwise import LayerwiseMethod, SpanSolve, dense_solve_bytes

    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a b c"}\n{"text": "d e"}\n')
    models = [
        {"model": e, "name": f"t{k}", "calibration": {"path": str(data), "samples": 2}}
        for k, e in enumerate(tiny_llama_set.experts[:2])
    ]
    cfg = parse_config(
        yaml.safe_dump(
            {"merge_method": "chain_of_merges", "base_model": tiny_llama_set.base, "models": models}
        )
    )
    options = MergeOptions(quiet=True)
    com = plan_layerwise_merge(cfg, options, ChainOfMergesMethod(), {})
    assert com.rank_warnings  # few tokens: least squares warns and solves in the span

    class Other(ChainOfMergesMethod):
        """The same statistics; a solve that holds 1 MB more and never takes the span."""

        def solve_in_span(self, parameters, group):
            return SpanSolve()

        def solve_bytes(self, parameters, group, tasks, **how):
            return dense_solve_bytes(group.width, group.out, tasks) + 10**6

        def plan_warnings(self, parameters, groups):
            return [f"{len(groups)} groups"]

    class Plain(LayerwiseMethod):
        """The interface's defaults: a dense solve on the Grams, no warning."""

        name = "chain_of_merges"
        statistics_request = ChainOfMergesMethod.statistics_request
        parameters_model = ChainOfMergesMethod.parameters_model
        merge_linear_group = ChainOfMergesMethod.merge_linear_group

    other = plan_layerwise_merge(cfg, options, Other(), {})
    plain = plan_layerwise_merge(cfg, options, Plain(), {})
    assert other.rank_warnings == [f"{len(other.blocks[0].groups)} groups"]
    assert plain.rank_warnings == []
    assert other.memory.solver > plain.memory.solver  # the extra MB
    assert other.memory.solver - plain.memory.solver == 10**6
    assert com.memory.solver != plain.memory.solver  # the span solve's own bytes
    # several processes: a span group is gathered to rank 0 (rank 1 solves nothing) only
    # where the method says so; otherwise the solves take turns over the ranks
    assert estimate_memory(com, 2, 1).solver == 0
    assert estimate_memory(other, 2, 1).solver > 0


@pytest.mark.parametrize("alpha", [1.0, 0.8])
@pytest.mark.parametrize("omegas", [[1.0, 1.0], [0.4, 1.7]])
def test_two_tasks_wider_out_than_in_regroup_the_span_correction(alpha, omegas):
    """Two tasks, out > in, T < in: the span solve regroups its correction into one
    out x in x in product; the result is still the ridge closed form, in float64 and with
    float32 products (a bfloat16 pass)."""
    xs = [inputs(16, 9), inputs(17, 11)]  # 20 tokens < 24 inputs
    ws = expert_weights(2, 200)  # in · (T + out) < 2 · out · T: regrouped
    assert least_squares.solve._regroups(200, DIM, 20, 2)
    assert not least_squares.solve._regroups(20, DIM, 20, 2)
    assert not least_squares.solve._regroups(200, DIM, 20, 3)
    grams = [x.T @ x / x.shape[0] for x in xs]
    expected = closed_form(ws, xs, alpha, omegas, AUTO_RIDGE)
    span = regmean_solve(ws, grams, alpha, task_weights=omegas, ridge="auto", tokens=20, rows=xs)
    assert span.solver == "cholesky in the span of 20 tokens"
    assert rel(span.merged_weight, expected) < 1e-9
    low = regmean_solve(
        [w.float() for w in ws],
        grams,
        alpha,
        task_weights=omegas,
        ridge="auto",
        tokens=20,
        rows=[x.float() for x in xs],
        compute_dtype=torch.bfloat16,
    )
    assert low.merged_weight.dtype == torch.float32
    assert rel(low.merged_weight, expected) < 1e-5


@pytest.mark.parametrize(
    "alpha,ridge,by_rows", [(1.0, 0.0, True), (1.0, 0.1, False), (0.9, 0.0, False)]
)
def test_dense_solve_task_by_task_from_the_rows(monkeypatch, alpha, ridge, by_rows):
    """α = 1, no ridge, fewer tokens than outputs, every task's rows: the dense solve forms
    Σ_k ω_k (W_k X_kᵀ)(X_k A⁻¹) / N_k (row_term) instead of solving the numerator; the same
    solution, the references of the output errors included. With a ridge or α < 1 it
    solves the numerator."""
    xs = [inputs(20, 14), inputs(21, 12), inputs(22, 13)]  # 39 tokens >= 24 inputs: dense
    ws = expert_weights(3, 60)  # 60 outputs > 39 tokens
    omegas = [1.0, 0.0, 2.5]
    grams = [x.T @ x / x.shape[0] for x in xs]
    calls: list = []
    original = least_squares.solve.row_term

    def counting(weight, rows, cholesky):
        calls.append(tuple(rows.shape))
        return original(weight, rows, cholesky)

    monkeypatch.setattr(least_squares.solve, "row_term", counting)
    kwargs = dict(task_weights=omegas, ridge=ridge, solver="pinv", keep_references=True)
    got = regmean_solve(ws, grams, alpha, gram_rows=xs, **kwargs)
    assert calls == ([(14, DIM), (13, DIM)] if by_rows else [])  # ω = 0 adds no term
    plain = regmean_solve(ws, grams, alpha, **kwargs)  # no rows: the numerator's solve
    assert rel(got.merged_weight, closed_form(ws, xs, alpha, omegas, ridge)) < 1e-9
    assert rel(got.merged_weight, plain.merged_weight) < 1e-9
    assert got.ridge == plain.ridge == ridge and got.solver == plain.solver
    assert got.condition_number == plain.condition_number
    assert got.references == pytest.approx(plain.references, rel=1e-9)
    # a first task of weight zero, no references asked for
    first_zero = [0.0, 1.0, 2.5]
    bare = regmean_solve(ws, grams, alpha, task_weights=first_zero, ridge=ridge, gram_rows=xs)
    assert bare.references is None
    assert rel(bare.merged_weight, closed_form(ws, xs, alpha, first_zero, ridge)) < 1e-9


def test_regrouped_span_correction_leaves_out_a_task_of_weight_zero():
    """Three tasks, one with ω = 0: the two weighted ones regroup; still the closed form."""
    xs = [inputs(23, 9), inputs(24, 5), inputs(25, 11)]  # 20 weighted tokens < 24 inputs
    ws = expert_weights(3, 200)
    omegas = [0.7, 0.0, 1.3]
    grams = [x.T @ x / x.shape[0] for x in xs]
    got = regmean_solve(ws, grams, 0.9, task_weights=omegas, ridge="auto", tokens=20, rows=xs)
    assert got.solver == "cholesky in the span of 20 tokens"
    assert rel(got.merged_weight, closed_form(ws, xs, 0.9, omegas, AUTO_RIDGE)) < 1e-9


@pytest.mark.parametrize("out, span", [(200, True), (16, False)])
def test_more_tokens_than_inputs_solve_in_the_span_where_a_ridge_makes_it_pay(out, span):
    """T ≥ in, each task's rows kept and a ridge: the same solution, in the tokens' span where
    that does less work (wide outputs) and densely otherwise."""
    xs = [inputs(60, 14), inputs(61, 16)]  # 30 tokens >= 24 inputs, each task fewer
    ws = expert_weights(2, out)
    grams = [x.T @ x / x.shape[0] for x in xs]
    assert least_squares.span_solve_pays(out, DIM, [14, 16]) == span
    got = regmean_solve(ws, grams, 1.0, ridge=0.1, tokens=30, rows=xs)
    assert got.solver == ("cholesky in the span of 30 tokens" if span else "pinv")
    assert rel(got.merged_weight, closed_form(ws, xs, 1.0, [1.0, 1.0], 0.1)) < 1e-9
    dense = regmean_solve(ws, grams, 1.0, ridge=0.1, tokens=30)  # no rows: the dense solve
    assert (got.condition_number, got.ridge) == (dense.condition_number, dense.ridge)


def test_auto_ridge_on_an_ill_conditioned_system_then_solves_in_the_span():
    """As many tokens as inputs (2 x 2,048 for 4,096 at 8B widths): auto finds Σ ω G̃
    ill-conditioned, adds its ridge, and the wide group is then solved in the span; the
    record keeps why, and the condition number before the ridge."""
    xs = [inputs(62, 12), inputs(63, 12)]  # 24 tokens for 24 inputs: condition ~4e6
    ws = expert_weights(2, 200)
    grams = [x.T @ x / x.shape[0] for x in xs]
    got = regmean_solve(ws, grams, 1.0, ridge="auto", tokens=24, rows=xs)
    dense = regmean_solve(ws, grams, 1.0, ridge="auto", tokens=24)
    assert got.solver == "cholesky in the span of 24 tokens" and dense.solver == "pinv"
    assert got.ridge == dense.ridge == AUTO_RIDGE
    assert got.ridge_reason == dense.ridge_reason and "condition number" in got.ridge_reason
    assert got.condition_number_unregularized == dense.condition_number_unregularized
    assert (
        math.isfinite(got.condition_number_unregularized)
        and got.condition_number_unregularized > 1e6
    )
    assert rel(got.merged_weight, closed_form(ws, xs, 1.0, [1.0, 1.0], AUTO_RIDGE)) < 1e-9


def test_range_rule_after_an_ill_conditioned_system_re_solves_in_the_span_like_dense():
    """The same group as above with a range its 1e-2 solution leaves (a tight limit here): the
    span solve re-solves at larger ridges and the dense solve bisects on its eigenvalues;
    both bring the group within the limit at the smallest ridge (to their precisions), the
    closed form's at that ridge, and record the same first ratio and why."""
    xs = [inputs(62, 12), inputs(63, 12)]
    ws = expert_weights(2, 200)
    grams = [x.T @ x / x.shape[0] for x in xs]
    largest = max(float(w.double().norm()) for w in ws)
    first = regmean_solve(ws, grams, 1.0, ridge="auto", tokens=24)
    at_floor = float(first.merged_weight.double().norm()) / largest
    mean = float(sum(w.double() for w in ws).norm()) / 2 / largest  # a huge ridge's ratio
    assert mean < at_floor
    target = least_squares.NormRange(
        (200,), (largest,), lambda m: [float(m.double().norm()) / largest], (mean + at_floor) / 2
    )
    got = regmean_solve(ws, grams, 1.0, ridge="auto", tokens=24, rows=xs, norm_range=target)
    dense = regmean_solve(ws, grams, 1.0, ridge="auto", tokens=24, norm_range=target)
    assert got.solver == "cholesky in the span of 24 tokens"
    assert dense.solver.startswith("pinv, ridge from the eigendecomposition")
    for solution in (got, dense):
        assert solution.ridge > AUTO_RIDGE
        assert float(solution.merged_weight.double().norm()) / largest <= target.limit
        expected = closed_form(ws, xs, 1.0, [1.0, 1.0], solution.ridge)
        assert rel(solution.merged_weight, expected) < 1e-6  # float32 weights
        assert solution.norm_ratio_before_ridge == pytest.approx(at_floor, rel=1e-6)
        assert "above 1e+06; the solution at ridge 0.01 had" in solution.ridge_reason
        assert solution.condition_number_unregularized == first.condition_number_unregularized
    assert got.ridge == pytest.approx(dense.ridge, rel=0.02)  # 7 re-solves: within 2 %
