"""RegMean and Chain of Merges on plain tensors, against independent reference computations."""

from __future__ import annotations

import json
import math

import pytest
import torch

from mergekit_ext import merge_record
from mergekit_ext.errors import CalibrationError, ConfigError, TensorError
from mergekit_ext.methods import least_squares as least_squares_module
from mergekit_ext.methods.chain_of_merges import (
    ChainOfMergesMethod,
    correlation_task_weight,
)
from mergekit_ext.methods.kinds import Layerwise
from mergekit_ext.methods.layerwise import LinearGroup, StatisticsRequest, TaskStatistics
from mergekit_ext.methods.least_squares import (
    FULL_COVARIANCE_W2_MAX_DIM,
    covariate_shift_w2,
    estimate_condition_number,
    gaussian_w2,
    regmean_merge_weights,
    regmean_solve,
    relative_output_error,
    shrink_off_diagonal,
)
from mergekit_ext.methods.registry import ext_method_info
from mergekit_ext.methods.regmean import RegMeanMethod

IN, OUT = 6, 4
TASKS = ("alpha", "beta", "gamma")
COM_OFF = {"propagate": False, "normalize": False, "task_weighting": "uniform"}


def activations(seed: int, n: int, dim: int = IN) -> torch.Tensor:
    """N x in inputs with correlated features and a non-zero mean (float64)."""
    g = torch.Generator().manual_seed(seed)
    mixing = torch.randn(dim, dim, generator=g, dtype=torch.float64)
    shift = torch.randn(dim, generator=g, dtype=torch.float64)
    return torch.randn(n, dim, generator=g, dtype=torch.float64) @ mixing + shift


def stats_of(x: torch.Tensor) -> TaskStatistics:
    unit = x / x.norm(dim=1, keepdim=True)
    n = x.shape[0]
    return TaskStatistics(
        gram=x.T @ x / n, mean=x.mean(0), count=n, gram_normalized=unit.T @ unit / n
    )


def weight(seed: int, out: int = OUT, dim: int = IN) -> torch.Tensor:
    return torch.randn(out, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.fixture
def data():
    counts = (40, 25, 60)
    xs = [activations(10 + k, n) for k, n in enumerate(counts)]
    ws = [weight(100 + k) for k in range(len(counts))]
    return xs, ws


def make_group(xs, ws, merged_xs=None, *, two_weights: bool = False) -> LinearGroup:
    names = ["blk.q.weight", "blk.k.weight"] if two_weights else ["blk.q.weight"]
    experts = []
    for k, w in enumerate(ws):
        entry = {names[0]: w.float()}
        if two_weights:
            entry[names[1]] = weight(200 + k, out=3).float()
        experts.append(entry)
    base = {n: torch.zeros_like(experts[0][n]) for n in names}
    return LinearGroup(
        name="blk.qk",
        weights=names,
        base=base,
        experts=experts,
        task_names=list(TASKS[: len(ws)]),
        expert_stats=[stats_of(x) for x in xs],
        merged_stats=None if merged_xs is None else [stats_of(x) for x in merged_xs],
    )


def least_squares_reference(xs, ws, omegas=None, ridge_lambda=0.0):
    """argmin_W Σ_k ω_k (‖W X_k − W_k X_k‖²/N_k + λ‖W − W_k‖²) by lstsq on stacked rows."""
    omegas = omegas or [1.0] * len(xs)
    rows, targets = [], []
    for x, w, om in zip(xs, ws, omegas):
        scale = math.sqrt(om / x.shape[0])
        rows.append(scale * x)
        targets.append(scale * x @ w.T)
        if ridge_lambda > 0:
            reg = math.sqrt(om * ridge_lambda)
            rows.append(reg * torch.eye(x.shape[1], dtype=torch.float64))
            targets.append(reg * w.T)
    solution = torch.linalg.lstsq(torch.cat(rows), torch.cat(targets)).solution
    return solution.T


# ---------------------------------------------------------------------------- pure math


@pytest.mark.parametrize("solver", ["pinv", "solve"])
def test_regmean_equals_least_squares_on_raw_activations(data, solver):
    xs, ws = data
    grams = [x.T @ x / x.shape[0] for x in xs]
    merged = regmean_merge_weights(ws, grams, 1.0, solver=solver)
    expected = least_squares_reference(xs, ws)
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-9)
    # The merge is a compromise: no expert is reproduced exactly.
    assert all((merged - w).abs().max() > 1e-2 for w in ws)


def test_weighted_ridge_equals_regularised_least_squares(data):
    xs, ws = data
    grams = [x.T @ x / x.shape[0] for x in xs]
    omegas, ridge = [0.5, 2.0, 1.25], 0.3
    merged = regmean_merge_weights(ws, grams, 1.0, task_weights=omegas, ridge=ridge)
    system = sum(om * g for om, g in zip(omegas, grams))
    lam = ridge * float(torch.diagonal(system).mean()) / sum(omegas)
    expected = least_squares_reference(xs, ws, omegas, ridge_lambda=lam)
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-9)
    assert (merged - regmean_merge_weights(ws, grams, 1.0, task_weights=omegas)).abs().max() > 1e-3
    # An overwhelming ridge gives the ω-weighted mean of the experts.
    huge = regmean_merge_weights(ws, grams, 1.0, task_weights=omegas, ridge=1e9)
    weighted_mean = sum(om * w for om, w in zip(omegas, ws)) / sum(omegas)
    torch.testing.assert_close(huge, weighted_mean, rtol=0, atol=1e-6)


def test_shrink_off_diagonal_by_hand():
    gram = torch.tensor([[4.0, 2.0, -1.0], [2.0, 9.0, 3.0], [-1.0, 3.0, 1.0]], dtype=torch.float64)
    expected = torch.tensor(
        [[4.0, 0.5, -0.25], [0.5, 9.0, 0.75], [-0.25, 0.75, 1.0]], dtype=torch.float64
    )
    torch.testing.assert_close(shrink_off_diagonal(gram, 0.25), expected)
    torch.testing.assert_close(shrink_off_diagonal(gram, 1.0), gram)
    with pytest.raises(ValueError, match="reduce_non_diagonal"):
        shrink_off_diagonal(gram, 1.5)


def test_alpha_zero_is_average_weighted_by_diagonal(data):
    xs, ws = data
    grams = [x.T @ x / x.shape[0] for x in xs]
    omegas = [1.0, 3.0, 0.5]
    merged = regmean_merge_weights(ws, grams, 0.0, task_weights=omegas)
    expected = torch.empty(OUT, IN, dtype=torch.float64)
    for j in range(IN):
        num = sum(om * g[j, j] * w[:, j] for om, g, w in zip(omegas, grams, ws))
        den = sum(om * g[j, j] for om, g in zip(omegas, grams))
        expected[:, j] = num / den
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-12)
    # Intermediate α equals α = 1 on hand-shrunk Grams, and differs from both ends.
    half = regmean_merge_weights(ws, grams, 0.5)
    shrunk = [0.5 * g + 0.5 * torch.diag(torch.diagonal(g)) for g in grams]
    torch.testing.assert_close(half, regmean_merge_weights(ws, shrunk, 1.0), rtol=0, atol=1e-12)
    assert (half - regmean_merge_weights(ws, grams, 1.0)).abs().max() > 1e-3
    assert (half - regmean_merge_weights(ws, grams, 0.0)).abs().max() > 1e-3


def test_singular_gram_pinv_and_solve_fallback(data):
    xs, ws = data
    dead = [x.clone() for x in xs]
    for x in dead:
        x[:, 2] = 0.0  # an input feature no task ever uses: Σ G̃ is exactly singular
    grams = [x.T @ x / x.shape[0] for x in dead]
    by_pinv = regmean_solve(ws, grams, 1.0, solver="pinv")
    assert by_pinv.condition_number == math.inf
    assert by_pinv.solver == "pinv"
    # Minimum-norm least squares: the dead column is 0, the rest is the least-squares fit.
    assert by_pinv.merged_weight[:, 2].abs().max() < 1e-12
    live = [0, 1, 3, 4, 5]
    expected = least_squares_reference([x[:, live] for x in dead], [w[:, live] for w in ws])
    torch.testing.assert_close(by_pinv.merged_weight[:, live], expected, rtol=0, atol=1e-9)
    by_solve = regmean_solve(ws, grams, 1.0, solver="solve")
    assert by_solve.solver == "pinv (solve failed: singular)"
    torch.testing.assert_close(by_solve.merged_weight, by_pinv.merged_weight)


def test_condition_number_and_dtype(data):
    xs, ws = data
    grams = [x.T @ x / x.shape[0] for x in xs]
    omegas = [1.0, 2.0, 3.0]
    solution = regmean_solve(ws, grams, 0.7, task_weights=omegas)
    system = sum(om * shrink_off_diagonal(g, 0.7) for om, g in zip(omegas, grams))
    assert solution.condition_number == pytest.approx(float(torch.linalg.cond(system)), rel=1e-8)
    assert solution.condition_number > 1.0
    low = regmean_merge_weights([w.to(torch.bfloat16) for w in ws], grams, 0.7)
    assert low.dtype == torch.bfloat16


def test_correlation_weight_by_hand():
    x = activations(3, 30, dim=4)
    unit = x / x.norm(dim=1, keepdim=True)
    gram = (unit.T @ unit / 30).tolist()
    by_hand = sum(abs(gram[p][q]) for p in range(4) for q in range(4) if p < q)
    assert correlation_task_weight(torch.tensor(gram, dtype=torch.float64)) == pytest.approx(
        by_hand, rel=1e-12
    )
    assert correlation_task_weight(torch.eye(5)) == 0.0
    assert correlation_task_weight(torch.tensor([[1.0, -0.5], [-0.5, 1.0]])) == 0.5


def test_relative_output_error_equals_direct_computation(data):
    xs, ws = data
    grams = [x.T @ x / x.shape[0] for x in xs]
    merged = regmean_merge_weights(ws, grams, 0.9)
    for x, w, g in zip(xs, ws, grams):
        direct = float((merged @ x.T - w @ x.T).norm() / (w @ x.T).norm())
        # float32 products inside (a diagnostic): ~1e-7 relative
        assert relative_output_error(merged, w, g) == pytest.approx(direct, rel=1e-6)
        assert direct > 1e-3
    assert relative_output_error(ws[0], ws[0], grams[0]) == 0.0


def test_output_error_quadratic_form_from_the_upper_block_triangle():
    """tr(D G Dᵀ) from the symmetric G's upper block triangle (issue #47): the full
    product's value to float64 rounding, with a ragged last block and one block only."""
    from mergekit_ext.methods.least_squares import measures

    g = torch.Generator().manual_seed(3)
    for n_in in (700, 100):
        x = torch.randn(900, n_in, generator=g, dtype=torch.float64)
        gram = x.T @ x / 900
        gram = (gram + gram.T) / 2
        diff = torch.randn(50, n_in, generator=g, dtype=torch.float64)
        full = float(((diff @ gram) * diff).sum())
        assert measures._quadratic_form(diff, gram) == pytest.approx(full, rel=1e-12)


def test_w2_closed_forms():
    # 1-D Gaussians: W2² = (μ1 − μ2)² + (σ1 − σ2)², full and diagonal alike.
    f64 = torch.float64
    m1, m2 = torch.tensor([0.3], dtype=f64), torch.tensor([-1.2], dtype=f64)
    v1, v2 = torch.tensor([[4.0]], dtype=f64), torch.tensor([[0.25]], dtype=f64)
    expected = math.sqrt((0.3 + 1.2) ** 2 + (2.0 - 0.5) ** 2)
    assert gaussian_w2(m1, v1, m2, v2) == pytest.approx(expected, rel=1e-10)
    assert gaussian_w2(m1, v1, m2, v2, diagonal=True) == pytest.approx(expected, rel=1e-10)
    # Identical distributions: 0.
    x = activations(5, 50)
    st = stats_of(x)
    assert gaussian_w2(st.mean, st.covariance, st.mean, st.covariance) < 1e-6
    # Commuting covariances Q D Qᵀ: W2² = ‖Δμ‖² + Σ (√d1 − √d2)².
    q, _ = torch.linalg.qr(
        torch.randn(5, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    )
    d1 = torch.tensor([0.5, 1.0, 2.0, 3.0, 0.1], dtype=torch.float64)
    d2 = torch.tensor([1.5, 0.2, 2.0, 0.7, 0.9], dtype=torch.float64)
    mu1, mu2 = torch.zeros(5, dtype=torch.float64), torch.ones(5, dtype=torch.float64)
    closed = math.sqrt(5.0 + float((d1.sqrt() - d2.sqrt()).pow(2).sum()))
    got = gaussian_w2(mu1, q @ torch.diag(d1) @ q.T, mu2, q @ torch.diag(d2) @ q.T)
    assert got == pytest.approx(closed, rel=1e-9)


def test_w2_full_against_scipy_sqrtm_and_diagonal_switch():
    linalg = pytest.importorskip("scipy.linalg")
    a, b = stats_of(activations(7, 80)), stats_of(activations(8, 80))
    ca, cb = a.covariance, b.covariance
    root_b = torch.from_numpy(linalg.sqrtm(cb.numpy()).real)
    cross = torch.from_numpy(linalg.sqrtm((root_b @ ca @ root_b).numpy()).real)
    reference = math.sqrt(
        float(
            (a.mean - b.mean).pow(2).sum()
            + torch.trace(ca)
            + torch.trace(cb)
            - 2 * torch.trace(cross)
        )
    )
    distance, kind = covariate_shift_w2(a, b)
    assert kind == "full"
    assert distance == pytest.approx(reference, rel=1e-8)
    diag_distance, kind = covariate_shift_w2(a, b, full_covariance_max_dim=IN - 1)
    assert kind == "diagonal"
    sd_a, sd_b = torch.diagonal(ca).sqrt(), torch.diagonal(cb).sqrt()
    expected = math.sqrt(float((a.mean - b.mean).pow(2).sum() + (sd_a - sd_b).pow(2).sum()))
    assert diag_distance == pytest.approx(expected, rel=1e-10)
    assert diag_distance != pytest.approx(distance, rel=1e-3)


# ---------------------------------------------------------------------- method objects


def test_statistics_requests():
    # compute_dtype: auto by default (the plan resolves it; docs/methods.md, "Compute dtype")
    assert RegMeanMethod().statistics_request({}) == StatisticsRequest(
        propagate=False, keep_rows=True, compute_dtype="auto"
    )
    assert (
        RegMeanMethod().statistics_request({"compute_dtype": "bfloat16"}).compute_dtype
        == "bfloat16"
    )
    com = ChainOfMergesMethod()
    assert com.statistics_request({}) == StatisticsRequest(
        propagate=True,
        normalized_gram=False,
        reference_gram_max_dim=FULL_COVARIANCE_W2_MAX_DIM,
        keep_rows=True,
        compute_dtype="auto",
    )
    assert com.statistics_request(COM_OFF) == StatisticsRequest(
        propagate=False, keep_rows=True, compute_dtype="auto"
    )
    assert com.statistics_request({"task_weighting": "correlation"}).normalized_gram
    assert com.statistics_request({"normalize": True, "propagate": False}) == StatisticsRequest(
        propagate=False, normalized_gram=True, keep_rows=True, compute_dtype="auto"
    )


@pytest.mark.parametrize(
    "params", [{}, {"reduce_non_diagonal": 0.6, "ridge": 0.05, "solver": "solve"}]
)
def test_com_with_switches_off_equals_regmean(data, params):
    xs, ws = data
    merged_xs = [activations(50 + k, 30) for k in range(3)]
    group = make_group(xs, ws, merged_xs, two_weights=True)
    reg_w, reg_d = RegMeanMethod().merge_linear_group(group, params)
    com_w, com_d = ChainOfMergesMethod().merge_linear_group(group, {**COM_OFF, **params})
    assert set(reg_w) == {"blk.q.weight", "blk.k.weight"}
    for name in reg_w:
        assert reg_w[name].dtype == torch.float32
        torch.testing.assert_close(com_w[name], reg_w[name], rtol=0, atol=1e-6)
    assert com_d["condition_number"] == pytest.approx(reg_d["condition_number"], rel=1e-9)
    # Default CoM (propagate) uses the merged-path Grams instead and gives another merge.
    prop_w, prop_d = ChainOfMergesMethod().merge_linear_group(group, params)
    assert prop_d["statistics"] == "merged_path"
    assert (prop_w["blk.q.weight"] - reg_w["blk.q.weight"]).abs().max() > 1e-3
    expected = regmean_merge_weights(
        ws,
        [x.T @ x / x.shape[0] for x in merged_xs],
        params.get("reduce_non_diagonal", 1.0),
        ridge=params.get("ridge", 0.0),
    )
    torch.testing.assert_close(prop_w["blk.q.weight"].double(), expected, rtol=0, atol=1e-5)


def test_group_merge_is_rowwise_per_weight(data):
    xs, ws = data
    group = make_group(xs, ws, two_weights=True)
    merged, _ = RegMeanMethod().merge_linear_group(group, {"reduce_non_diagonal": 0.8})
    grams = [st.gram for st in group.expert_stats]
    for name in group.weights:
        alone = regmean_merge_weights([e[name] for e in group.experts], grams, 0.8)
        torch.testing.assert_close(merged[name], alone, rtol=0, atol=1e-6)


@pytest.mark.parametrize("normalize", [False, True])
def test_com_correlation_weighting(data, normalize):
    xs, ws = data
    merged_xs = [activations(60 + k, 35) for k in range(3)]
    group = make_group(xs, ws, merged_xs)
    params = {"task_weighting": "correlation", "normalize": normalize, "reduce_non_diagonal": 0.9}
    merged, diag = ChainOfMergesMethod().merge_linear_group(group, params)
    # ω_k by hand from the merged-path normalized Gram of this layer.
    omegas = []
    for x in merged_xs:
        unit = x / x.norm(dim=1, keepdim=True)
        g = unit.T @ unit / x.shape[0]
        omegas.append(sum(abs(float(g[p, q])) for p in range(IN) for q in range(p + 1, IN)))
    for task, om in zip(TASKS, omegas):
        assert diag["tasks"][task]["weight"] == pytest.approx(om, rel=1e-12)
    assert max(omegas) / min(omegas) > 1.05  # the weights are not uniform
    solve_grams = [(st.gram_normalized if normalize else st.gram) for st in group.merged_stats]
    expected = regmean_merge_weights(ws, solve_grams, 0.9, task_weights=omegas)
    torch.testing.assert_close(merged["blk.q.weight"].double(), expected, rtol=0, atol=1e-5)
    uniform, _ = ChainOfMergesMethod().merge_linear_group(
        group, {**params, "task_weighting": "uniform"}
    )
    assert (uniform["blk.q.weight"] - merged["blk.q.weight"]).abs().max() > 1e-4


def test_diagnostics_values_and_json(data):
    xs, ws = data
    merged_xs = [activations(70 + k, 45) for k in range(3)]
    group = make_group(xs, ws, merged_xs)
    merged, diag = ChainOfMergesMethod().merge_linear_group(group, {"solver": "solve"})
    assert diag["layer"] == "blk.qk"
    assert diag["solver"] == "solve" and diag["reduce_non_diagonal"] == 1.0
    assert diag["covariate_shift_covariance"] == "full"
    w = merged["blk.q.weight"].double()
    for task, x, xm, wk in zip(TASKS, xs, merged_xs, ws):
        rec = diag["tasks"][task]
        assert rec["weight"] == 1.0
        direct = float((w @ xm.T - wk @ xm.T).norm() / (wk @ xm.T).norm())  # merged-path inputs
        assert rec["relative_output_error"] == pytest.approx(direct, rel=1e-5)
        w2, _ = covariate_shift_w2(stats_of(xm), stats_of(x))
        assert rec["covariate_shift_w2"] == pytest.approx(w2, rel=1e-9)
        assert rec["covariate_shift_w2"] > 0.1
    json.dumps(merge_record._jsonable(diag), allow_nan=False)
    # RegMean without merged-path statistics: no covariate shift.
    _, reg_diag = RegMeanMethod().merge_linear_group(make_group(xs, ws), {})
    assert all(t["covariate_shift_w2"] is None for t in reg_diag["tasks"].values())
    assert reg_diag["covariate_shift_covariance"] is None


def test_permutation_invariance(data):
    xs, ws = data
    merged_xs = [activations(80 + k, 20) for k in range(3)]
    params = {"task_weighting": "correlation", "ridge": 0.01}
    ref, ref_diag = ChainOfMergesMethod().merge_linear_group(make_group(xs, ws, merged_xs), params)
    # Task order.
    order = [2, 0, 1]
    group = make_group(
        [xs[i] for i in order], [ws[i] for i in order], [merged_xs[i] for i in order]
    )
    group.task_names = [TASKS[i] for i in order]
    permuted, diag = ChainOfMergesMethod().merge_linear_group(group, params)
    torch.testing.assert_close(permuted["blk.q.weight"], ref["blk.q.weight"], rtol=0, atol=1e-6)
    for task in TASKS:
        assert diag["tasks"][task]["relative_output_error"] == pytest.approx(
            ref_diag["tasks"][task]["relative_output_error"], rel=1e-5
        )
    # Input features: W_k P with inputs Pᵀx merges to W P.
    perm = torch.tensor([3, 0, 5, 1, 4, 2])
    grams = [x.T @ x / x.shape[0] for x in xs]
    plain = regmean_merge_weights(ws, grams, 0.9)
    moved = regmean_merge_weights([w[:, perm] for w in ws], [g[perm][:, perm] for g in grams], 0.9)
    torch.testing.assert_close(moved, plain[:, perm], rtol=0, atol=1e-10)


def test_fallback_merge_other():
    experts = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])]
    base = torch.tensor([1.0, 1.0])
    method = RegMeanMethod()
    torch.testing.assert_close(method.merge_other("b", base, experts, {}), torch.tensor([2.0, 4.0]))
    torch.testing.assert_close(
        ChainOfMergesMethod().merge_other("b", base, experts, {"fallback": "task_arithmetic"}),
        torch.tensor([3.0, 7.0]),  # W_0 + Σ Δ = [1, 1] + [0, 1] + [2, 5]
    )
    with pytest.raises(ConfigError, match="fallback"):
        method.merge_other("b", base, experts, {"fallback": "median"})


def test_registration():
    for name, cls in (("regmean", RegMeanMethod), ("chain_of_merges", ChainOfMergesMethod)):
        info = ext_method_info(name)
        assert info is not None and isinstance(info.kind, Layerwise) and info.needs_calibration
        assert isinstance(info.kind.method, cls)
    com = ext_method_info("chain_of_merges")
    defaults = {p.name: p.default for p in com.parameters}
    assert defaults == {
        "propagate": True,
        "normalize": False,
        "task_weighting": "uniform",
        "reduce_non_diagonal": 1.0,
        "ridge": "auto",
        "solver": "pinv",
        "fallback": "mean",
        "statistics_dtype": "float64",
        "compute_dtype": "auto",
        "max_norm_ratio": 10.0,
    }
    docs = {p.name: p.description for p in com.parameters}
    # user-facing text never speaks of internal process
    assert not any("provisional" in d.lower() or "METHODS.md" in d for d in docs.values())
    assert "off-diagonal shrink" in docs["reduce_non_diagonal"]  # why 1: docs/methods.md
    assert "2212.09849" in ext_method_info("regmean").paper_url


# ----------------------------------------------------------------------------- bad input


def test_bad_input_names_the_group(data):
    xs, ws = data
    com, reg = ChainOfMergesMethod(), RegMeanMethod()
    # Propagation without merged-path statistics.
    with pytest.raises(CalibrationError, match=r"merged-path statistics for linear group blk\.qk"):
        com.merge_linear_group(make_group(xs, ws), {})
    # Mismatched expert shapes.
    group = make_group(xs, ws)
    group.experts[1]["blk.q.weight"] = torch.zeros(OUT, IN + 1)
    with pytest.raises(TensorError, match=r"blk\.q\.weight.*'beta'"):
        reg.merge_linear_group(group, {})
    # A missing tensor.
    group = make_group(xs, ws)
    del group.experts[2]["blk.q.weight"]
    with pytest.raises(TensorError, match=r"'gamma' has no tensor blk\.q\.weight"):
        reg.merge_linear_group(group, {})
    # A Gram that does not fit the input width.
    group = make_group(xs, ws)
    group.expert_stats[0] = stats_of(activations(1, 10, dim=IN + 2))
    with pytest.raises(CalibrationError, match=r"'alpha' for linear group blk\.qk.*width 6"):
        reg.merge_linear_group(group, {})
    # Empty statistics and a wrong number of them.
    group = make_group(xs, ws)
    group.expert_stats[1].count = 0
    with pytest.raises(CalibrationError, match=r"'beta'.*0 tokens"):
        reg.merge_linear_group(group, {})
    group = make_group(xs, ws)
    group.expert_stats = group.expert_stats[:2]
    with pytest.raises(CalibrationError, match=r"blk\.qk has 3 tasks but 2"):
        reg.merge_linear_group(group, {})
    # normalize / correlation without the normalized Gram.
    group = make_group(xs, ws)
    group.expert_stats[0].gram_normalized = None
    for params in ({"normalize": True}, {"task_weighting": "correlation"}):
        with pytest.raises(
            CalibrationError, match=r"'alpha' for linear group blk\.qk.*gram_normalized"
        ):
            com.merge_linear_group(group, {**params, "propagate": False})
    # Bad parameters name the field.
    with pytest.raises(ConfigError, match="reduce_non_diagonal"):
        reg.merge_linear_group(make_group(xs, ws), {"reduce_non_diagonal": 2.0})
    with pytest.raises(ConfigError, match="solver"):
        com.statistics_request({"solver": "cholesky"})
    with pytest.raises(ConfigError, match="ridge"):
        reg.merge_linear_group(make_group(xs, ws), {"ridge": -1})
    # Pure function: Gram of the wrong size, mismatched lists.
    with pytest.raises(TensorError, match="input Gram of task 1"):
        regmean_merge_weights(ws, [torch.eye(IN), torch.eye(IN + 1), torch.eye(IN)], 1.0)
    with pytest.raises(TensorError, match="3 expert weights but 2 input Grams"):
        regmean_merge_weights(ws, [torch.eye(IN)] * 2, 1.0)


# ---------------------------------------------------------------------- fast solve paths


def _spd(n: int, seed: int, spread: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    eigenvalues = torch.logspace(0, math.log10(spread), n, dtype=torch.float64)
    return (q * eigenvalues) @ q.T


def test_condition_number_estimate_is_close_and_never_above():
    for seed, spread in ((0, 1e3), (1, 1e6), (2, 30.0)):
        a = _spd(200, seed, spread)
        exact = float(torch.linalg.cond(a))
        estimate = estimate_condition_number(a, torch.linalg.cholesky(a))
        assert estimate <= exact * (1 + 1e-9)
        assert estimate >= 0.9 * exact


def test_pinv_solver_takes_the_cholesky_path_only_when_pinv_equals_the_inverse(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    n, out = 40, 7
    grams = [_spd(n, 10 + k, 1e4) for k in range(3)]
    ws = [torch.randn(out, n, generator=gen, dtype=torch.float64) for _ in range(3)]
    system = sum(shrink_off_diagonal(g, 0.9) for g in grams)
    numerator = sum(w @ shrink_off_diagonal(g, 0.9) for w, g in zip(ws, grams))
    direct = numerator @ torch.linalg.pinv(system, hermitian=True)

    exact = regmean_solve(ws, grams, 0.9)
    assert exact.condition_number_method == "exact" and exact.solver == "pinv"
    torch.testing.assert_close(exact.merged_weight, direct, rtol=1e-9, atol=1e-10)
    assert exact.condition_number == pytest.approx(float(torch.linalg.cond(system)), rel=1e-9)

    monkeypatch.setattr(
        least_squares_module.solve, "EXACT_CONDITION_MAX_DIM", 8
    )  # estimate above 8
    estimated = regmean_solve(ws, grams, 0.9)
    assert estimated.condition_number_method == "estimate" and estimated.solver == "pinv"
    torch.testing.assert_close(estimated.merged_weight, direct, rtol=1e-9, atol=1e-10)
    assert estimated.condition_number == pytest.approx(exact.condition_number, rel=0.1)

    # Singular Σ ω G̃ (a dead input feature in every task): the eigh pseudo-inverse, exact cond.
    dead = [g.clone() for g in grams]
    for g in dead:
        g[0, :] = 0.0
        g[:, 0] = 0.0
    singular = regmean_solve(ws, dead, 0.9)
    assert singular.condition_number == math.inf
    assert singular.condition_number_method == "exact"
    dead_system = sum(shrink_off_diagonal(g, 0.9) for g in dead)
    dead_numerator = sum(w @ shrink_off_diagonal(g, 0.9) for w, g in zip(ws, dead))
    torch.testing.assert_close(
        singular.merged_weight,
        dead_numerator @ torch.linalg.pinv(dead_system, hermitian=True),
        rtol=1e-8,
        atol=1e-10,
    )
    assert torch.all(singular.merged_weight[:, 0] == 0)


@pytest.mark.filterwarnings("ignore::scipy.linalg.LinAlgWarning")
def test_w2_full_with_a_singular_reference_covariance():
    linalg = pytest.importorskip("scipy.linalg")
    a = stats_of(activations(7, 80))
    x = activations(8, 80)
    x[:, 0] = 1.5  # a constant feature: zero variance, singular covariance
    b = stats_of(x)
    ca, cb = a.covariance, b.covariance
    root_b = torch.from_numpy(linalg.sqrtm(cb.numpy()).real)
    cross = torch.from_numpy(linalg.sqrtm((root_b @ ca @ root_b).numpy()).real)
    reference = math.sqrt(
        float((a.mean - b.mean).pow(2).sum() + torch.trace(ca) + torch.trace(cb))
        - 2 * float(torch.trace(cross))
    )
    distance, kind = covariate_shift_w2(a, b)
    assert kind == "full"
    assert distance == pytest.approx(reference, rel=1e-6)


def test_w2_is_diagonal_when_the_reference_kept_moments_only():
    x, y = activations(7, 80), activations(8, 80)
    a = stats_of(x)
    b_full = stats_of(y)
    b = TaskStatistics(
        gram=None, mean=b_full.mean, count=b_full.count, second_moment=b_full.second_moment
    )
    distance, kind = covariate_shift_w2(a, b)
    diagonal, diagonal_kind = covariate_shift_w2(a, b_full, full_covariance_max_dim=0)
    assert kind == diagonal_kind == "diagonal"
    assert distance == pytest.approx(diagonal, rel=1e-12)


# ------------------------------------------------------------- ridge: auto's range rule


def weak_direction(seed: int, tokens: int = 40, dim: int = IN, eps: float = 0.01):
    """Three tasks whose last input is weak (~eps) and correlated with input 0 with a slope
    that differs per task (−2, 0, 2): ``Σ G`` stays well-conditioned enough (~1e3 at
    eps = 0.01) for ``auto``'s exact solution, which follows ``(W_3 − W_1)[:, 0] / eps``
    along that direction, far outside the experts' norms (issue #47's ``o_proj`` groups)."""
    gen = torch.Generator().manual_seed(seed)
    xs, ws = [], []
    for k in range(3):
        x = torch.randn(tokens, dim, generator=gen, dtype=torch.float64)
        x[:, -1] = eps * (x[:, -1] + (k - 1) * 2.0 * x[:, 0])
        xs.append(x)
        ws.append(torch.randn(OUT, dim, generator=gen, dtype=torch.float64))
    return xs, ws


def norm_range_of(ws, limit=least_squares_module.AUTO_MAX_NORM_RATIO):
    """The range of a one-linear group of float64 weights (nothing rounded on writing)."""
    reference = max(float(w.norm()) for w in ws)
    return least_squares_module.NormRange(
        (int(ws[0].shape[0]),),
        (reference,),
        lambda m: [float(m.double().norm()) / reference],
        limit,
    )


def ls_closed_form(ws, xs, alpha, omegas, ridge):
    """``(Σ ω W_k G̃_k + λ/Σω Σ ω W_k)(Σ ω G̃_k + λ I)⁻¹``, λ = ridge · mean diag (float64)."""
    grams = [x.T @ x / x.shape[0] for x in xs]
    shrunk = [alpha * g + (1 - alpha) * torch.diag(torch.diag(g)) for g in grams]
    system = sum(o * g for o, g in zip(omegas, shrunk))
    lam = ridge * float(torch.diag(system).mean())
    numerator = sum(o * w @ g for o, w, g in zip(omegas, ws, shrunk))
    numerator = numerator + lam / sum(omegas) * sum(o * w for o, w in zip(omegas, ws))
    system = system + lam * torch.eye(system.shape[0], dtype=torch.float64)
    return torch.linalg.solve(system, numerator.T).T


@pytest.mark.parametrize("alpha, omegas", [(1.0, [1.0, 1.0, 1.0]), (0.9, [0.5, 2.0, 1.25])])
def test_auto_takes_the_smallest_ridge_that_keeps_the_group_in_range(alpha, omegas):
    xs, ws = weak_direction(0)
    grams = [x.T @ x / x.shape[0] for x in xs]
    target = norm_range_of(ws)
    largest = max(float(w.norm()) for w in ws)
    exact = regmean_solve(ws, grams, alpha, task_weights=omegas, ridge=0.0)
    before = float(exact.merged_weight.norm()) / largest
    assert before > 3.0 and exact.condition_number < 1e6  # below the old threshold: kept exact
    # without a range (the old rule) auto keeps that exact solution
    old = regmean_solve(ws, grams, alpha, task_weights=omegas, ridge="auto")
    assert old.ridge == 0.0 and torch.equal(old.merged_weight, exact.merged_weight)

    auto = regmean_solve(ws, grams, alpha, task_weights=omegas, ridge="auto", norm_range=target)
    ratio = float(auto.merged_weight.norm()) / largest
    assert 0.0 < auto.ridge < 1.0
    assert 0.99 * target.limit < ratio <= target.limit  # at the limit: the smallest such ridge
    # it is the regularised least-squares solution at the ridge it reports ...
    expected = ls_closed_form(ws, xs, alpha, omegas, auto.ridge)
    assert float((auto.merged_weight - expected).norm() / expected.norm()) < 1e-9
    # ... and 2 % less ridge leaves the range
    smaller = regmean_solve(ws, grams, alpha, task_weights=omegas, ridge=0.98 * auto.ridge)
    assert float(smaller.merged_weight.norm()) / largest > target.limit
    assert auto.norm_ratio_before_ridge == pytest.approx(before, rel=1e-9)
    assert auto.condition_number_unregularized == pytest.approx(exact.condition_number)
    assert auto.condition_number < exact.condition_number
    assert f"ridge {auto.ridge:.3g}, the smallest" in auto.ridge_reason
    assert "(exact solution); the solution at ridge 0 had" in auto.ridge_reason


def test_auto_keeps_an_exact_solution_in_range_bit_for_bit(data):
    xs, ws = data
    grams = [x.T @ x / x.shape[0] for x in xs]
    exact = regmean_solve(ws, grams, 1.0, ridge=0.0)
    auto = regmean_solve(ws, grams, 1.0, ridge="auto", norm_range=norm_range_of(ws))
    assert auto.ridge == 0.0 and auto.norm_ratio_before_ridge is None
    assert torch.equal(auto.merged_weight, exact.merged_weight)
    assert auto.ridge_reason.endswith("(exact solution)")


def test_auto_range_rule_on_the_row_terms_equals_the_numerator_path():
    """More outputs than tokens with every task's rows: the exact solve takes the row terms
    (no numerator formed); the range rule then starts from their sum and reaches the same
    ridge and, to float64 rounding, the same weight as from the numerator."""
    xs, _ = weak_direction(1, tokens=8)
    gen = torch.Generator().manual_seed(5)
    ws = [torch.randn(40, IN, generator=gen, dtype=torch.float64) for _ in range(3)]
    grams = [x.T @ x / x.shape[0] for x in xs]
    target = norm_range_of(ws)
    by_rows = regmean_solve(ws, grams, 1.0, ridge="auto", norm_range=target, gram_rows=xs)
    dense = regmean_solve(ws, grams, 1.0, ridge="auto", norm_range=target)
    assert by_rows.norm_ratio_before_ridge is not None and by_rows.ridge > 0.0
    assert by_rows.ridge == pytest.approx(dense.ridge, rel=1e-2)
    expected = ls_closed_form(ws, xs, 1.0, [1.0] * 3, by_rows.ridge)
    assert float((by_rows.merged_weight - expected).norm() / expected.norm()) < 1e-9


def test_auto_range_rule_on_the_span_solve():
    """Fewer tokens than inputs (span solve, floor 1e-2): a solution out of a (here tight)
    range re-solves at larger ridges; the one taken is in range, 3 % less is not."""
    xs, ws = weak_direction(2, tokens=4, dim=16, eps=0.1)
    first = regmean_solve(ws, [None] * 3, 1.0, ridge="auto", rows=xs, tokens=12)
    largest = max(float(w.norm()) for w in ws)
    at_floor = float(first.merged_weight.norm()) / largest
    target = norm_range_of(ws, limit=0.9 * at_floor)
    auto = regmean_solve(ws, [None] * 3, 1.0, ridge="auto", rows=xs, tokens=12, norm_range=target)
    assert auto.solver.startswith("cholesky in the span")
    assert auto.ridge > first.ridge == least_squares_module.AUTO_RIDGE
    assert float(auto.merged_weight.norm()) / largest <= target.limit
    assert (
        float((auto.merged_weight - ls_closed_form(ws, xs, 1.0, [1.0] * 3, auto.ridge)).norm())
        < 1e-9
    )
    smaller = regmean_solve(ws, [None] * 3, 1.0, ridge=0.97 * auto.ridge, rows=xs, tokens=12)
    assert float(smaller.merged_weight.norm()) / largest > target.limit
    assert auto.norm_ratio_before_ridge == pytest.approx(at_floor)
    assert "auto: 12 calibration tokens for 16 inputs" in auto.ridge_reason
    assert "the smallest that keeps every linear" in auto.ridge_reason


@pytest.mark.parametrize("method", [RegMeanMethod(), ChainOfMergesMethod()])
def test_default_merge_of_an_ill_posed_group_stays_in_range_and_ridge_0_stops(method):
    """The group record says which ridge and why; the written weights (bf16 here) are in
    range; an explicit ridge: 0 writes the exact solution only up to the guard's limit."""
    xs, ws = weak_direction(3, eps=0.004)
    group = make_group(xs, ws, merged_xs=xs, two_weights=True)
    group.output_dtypes = {name: torch.bfloat16 for name in group.weights}
    params = {} if isinstance(method, RegMeanMethod) else dict(COM_OFF)
    merged, record = method.merge_linear_group(group, params)
    assert record["guard"] == "ok" and record["ridge_setting"] == "auto"
    assert record["max_norm_ratio"] <= least_squares_module.AUTO_MAX_NORM_RATIO
    assert record["norm_ratio_before_ridge"] > 10.0 and record["ridge"] > 0.0
    assert "the smallest that keeps every linear of the group within 1.5x" in record["ridge_reason"]
    json.dumps(merge_record.jsonable(record))  # the record is written as JSON
    with pytest.raises(TensorError, match="above max_norm_ratio = 10"):
        method.merge_linear_group(group, {**params, "ridge": 0.0})


def test_auto_range_rule_where_no_ridge_reaches_the_limit():
    """A limit below the experts' mean's ratio: the largest ridge (the mean), and the record
    says that no ridge reached the limit (the result guard then judges the group)."""
    xs, ws = weak_direction(0)
    grams = [x.T @ x / x.shape[0] for x in xs]
    mean = float((sum(ws) / 3).norm()) / max(float(w.norm()) for w in ws)
    auto = regmean_solve(ws, grams, 1.0, ridge="auto", norm_range=norm_range_of(ws, 0.5 * mean))
    assert auto.ridge == 1e6 and "no ridge up to 1e+06 brings every linear" in auto.ridge_reason
    assert float((auto.merged_weight - sum(ws) / 3).norm() / (sum(ws) / 3).norm()) < 1e-4
