"""QP / output-space projection (arXiv 2605.29101): the Gram-based batched solver against
independent raw-activation references, optimality, the box QP, the energy diagnostic, and the
executor-facing method."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from mergekit_ext.errors import ConfigError, TensorError
from mergekit_ext.methods import qp_projection as qp
from mergekit_ext.methods.kinds import Layerwise
from mergekit_ext.methods.layerwise import LinearGroup, StatisticsRequest, TaskStatistics
from mergekit_ext.methods.registry import describe_method, ext_method_info

F64 = torch.float64


def _problem(seed: int, out_dim: int = 5, in_dim: int = 4, k: int = 3, scale: float = 0.3):
    """Base, experts and raw per-task activations (different sample counts per task)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(out_dim, in_dim, generator=g, dtype=F64)
    experts = [
        base + scale * torch.randn(out_dim, in_dim, generator=g, dtype=F64) for _ in range(k)
    ]
    activations = [
        torch.randn(6 + 3 * t, in_dim, generator=g, dtype=F64) * (1 + t) for t in range(k)
    ]
    return base, experts, activations


def _grams(activations):
    return [x.T @ x / x.shape[0] for x in activations]


def _raw_objective(delta, base, experts, activations):
    """J = Σ_t (1/N_t) Σ_{j∈t} ‖δ x_j + (W_0 − W_t) x_j‖², straight from the activations."""
    total = 0.0
    for expert, x in zip(experts, activations):
        residual = x @ (delta + base - expert).T  # rows: δ x_j + b_j
        total += float(residual.pow(2).sum()) / x.shape[0]
    return total


def _raw_energy_basis(base, experts, activations):
    """Eigenvectors (descending) of S = Σ_t (1/N_t) Σ_j b_j b_jᵀ from the raw residuals."""
    s = sum(
        (x @ (base - e).T).T @ (x @ (base - e).T) / x.shape[0] for e, x in zip(experts, activations)
    )
    _, vectors = torch.linalg.eigh(s)
    return vectors.flip(-1)


def _dense_reference(base, experts, activations, basis=None):
    """Independent solve: unknowns d ∈ R^{R·K} (d[r,k] at index r·K+k), one weighted residual
    row per (sample, output coordinate), torch.linalg.lstsq over the flattened problem."""
    out_dim = base.shape[0]
    u = torch.eye(out_dim, dtype=F64) if basis is None else basis
    k = len(experts)
    task_vectors = [e - base for e in experts]
    blocks, targets = [], []
    for expert, x in zip(experts, activations):
        w = 1.0 / math.sqrt(x.shape[0])
        for sample in x:
            # δ(d) x = Σ_r u_r Σ_k d[r,k] (u_rᵀ Δ_k x): column (r,k) is u_r · (u_rᵀ Δ_k x)
            design = torch.zeros(out_dim, out_dim * k, dtype=F64)
            for r in range(u.shape[1]):
                for kk, tv in enumerate(task_vectors):
                    design[:, r * k + kk] = u[:, r] * (u[:, r] @ (tv @ sample)) * w
            blocks.append(design)
            targets.append(-((base - expert) @ sample) * w)
    solution = torch.linalg.lstsq(torch.cat(blocks), torch.cat(targets).unsqueeze(-1)).solution
    return solution.squeeze(-1).reshape(u.shape[1], k)


def _solve(base, experts, grams, kind, ridge=0.0, bounds=None):
    task_vectors = [e - base for e in experts]
    basis = qp.output_basis(kind, task_vectors, grams)
    eq = qp.qp_normal_equations(task_vectors, grams, basis=basis, basis_kind=kind)
    return task_vectors, eq, qp.solve_qp(eq, ridge=ridge, bounds=bounds)


# ---------------------------------------------------------------- solver vs references


@pytest.mark.parametrize("kind", ["diagonal", "residual_eigen"])
def test_batched_qp_matches_dense_least_squares_on_raw_activations(kind):
    base, experts, acts = _problem(0)
    basis = None if kind == "diagonal" else _raw_energy_basis(base, experts, acts)
    reference = _dense_reference(base, experts, acts, basis)
    _, eq, sol = _solve(base, experts, _grams(acts), kind)
    torch.testing.assert_close(sol.d, reference, rtol=1e-9, atol=1e-9)
    assert sol.fallback_rows == 0


@pytest.mark.parametrize("kind", ["diagonal", "residual_eigen"])
def test_gram_objective_equals_raw_activation_objective(kind):
    base, experts, acts = _problem(1)
    task_vectors, eq, sol = _solve(base, experts, _grams(acts), kind)
    g = torch.Generator().manual_seed(7)
    candidates = [sol.d, torch.zeros_like(sol.d), torch.randn(sol.d.shape, generator=g, dtype=F64)]
    for d in candidates:
        delta = qp.merged_update(task_vectors, d, eq.basis)
        assert qp.qp_objective(eq, d) == pytest.approx(
            _raw_objective(delta, base, experts, acts), rel=1e-10
        )
    # J(0) = Σ_t tr(R_t G_t R_tᵀ) and task arithmetic (basis independent: δ = λ Σ Δ_k)
    assert qp.base_energy(eq) == pytest.approx(
        _raw_objective(0 * base, base, experts, acts), rel=1e-12
    )
    for lam in (1 / 3, 1.0):
        ta = qp.qp_objective(eq, qp.task_arithmetic_coefficients(3, lam))
        assert ta == pytest.approx(
            _raw_objective(lam * sum(task_vectors), base, experts, acts), rel=1e-10
        )


def test_merged_update_is_sum_of_projected_task_vectors():
    base, experts, acts = _problem(2)
    task_vectors, eq, sol = _solve(base, experts, _grams(acts), "residual_eigen")
    u = eq.basis
    explicit = sum(u @ torch.diag(sol.d[:, k]) @ u.T @ tv for k, tv in enumerate(task_vectors))
    torch.testing.assert_close(qp.merged_update(task_vectors, sol.d, u), explicit)
    diag = qp.merged_update(task_vectors, sol.d, None)
    torch.testing.assert_close(
        diag, sum(torch.diag(sol.d[:, k]) @ tv for k, tv in enumerate(task_vectors))
    )


def test_chunked_build_equals_one_block():
    base, experts, acts = _problem(3, out_dim=7)
    tvs = [e - base for e in experts]
    grams = _grams(acts)
    u = qp.output_basis("residual_eigen", tvs, grams)
    whole = qp.qp_normal_equations(tvs, grams, basis=u)
    chunked = qp.qp_normal_equations(tvs, grams, basis=u, chunk_rows=2)
    for a, b in [
        (whole.normal, chunked.normal),
        (whole.rhs, chunked.rhs),
        (whole.energy, chunked.energy),
    ]:
        torch.testing.assert_close(a, b)


# ---------------------------------------------------------------- optimality


@pytest.mark.parametrize("seed", [4, 5, 6])
@pytest.mark.parametrize("kind", ["diagonal", "residual_eigen"])
def test_optimum_beats_task_arithmetic_and_random_coefficients(seed, kind):
    base, experts, acts = _problem(seed, out_dim=6, in_dim=5, k=4)
    _, eq, sol = _solve(base, experts, _grams(acts), kind)
    j_opt = qp.qp_objective(eq, sol.d)
    for lam in (0.25, 1.0):
        assert j_opt <= qp.qp_objective(eq, qp.task_arithmetic_coefficients(4, lam)) + 1e-12
    g = torch.Generator().manual_seed(seed)
    for _ in range(50):
        d = sol.d + torch.randn(sol.d.shape, generator=g, dtype=F64) * torch.rand(
            1, generator=g, dtype=F64
        )
        assert j_opt <= qp.qp_objective(eq, d) + 1e-12


def test_residual_eigen_beats_diagonal_on_shared_low_rank_residuals():
    """All task vectors are Δ_k = Σ_s m[k,s] u_s c_sᵀ with orthonormal, non-axis-aligned u_s
    (a shared rank-4 output subspace) and G_t-orthogonal c_s (coordinate axes, diagonal G_t).
    Then S is diagonal in the u_s, the eigen basis separates the components, and its optimum
    is Σ_s min_d Σ_t n[t,s] (m[:,s]·d − m[t,s])², n[t,s] = c_sᵀ G_t c_s. A diagonal row mixes
    the components with one coefficient per expert, so its J is a weighted sum of the
    per-component J's at one shared d: at least the eigen optimum, and strictly more here
    (4 components, only K = 2 coefficients per row)."""
    g = torch.Generator().manual_seed(11)
    out_dim, in_dim, k, comps = 9, 6, 2, 4
    u = torch.linalg.qr(torch.randn(out_dim, comps, generator=g, dtype=F64))[0]
    m = torch.randn(k, comps, generator=g, dtype=F64)
    base = torch.randn(out_dim, in_dim, generator=g, dtype=F64)
    c = torch.eye(in_dim, dtype=F64)[:comps]  # c_s = e_s
    experts = [
        base + sum(m[kk, s] * torch.outer(u[:, s], c[s]) for s in range(comps)) for kk in range(k)
    ]
    variances = torch.rand(k, in_dim, generator=g, dtype=F64) * 3 + 0.1
    grams = [torch.diag(v) for v in variances]

    captured = {}
    for kind in qp.BASES:
        _, eq, sol = _solve(base, experts, grams, kind)
        captured[kind] = qp.captured_energy_fraction(qp.qp_objective(eq, sol.d), qp.base_energy(eq))
        if kind == "residual_eigen":
            expected = 0.0
            for s in range(comps):
                n = variances[:, s]  # n[t,s]
                design = n.sqrt()[:, None] * m[:, s][None, :]  # rows t: sqrt(n_t) m[:,s]ᵀ
                target = n.sqrt() * m[:, s]
                d_s = torch.linalg.lstsq(design, target.unsqueeze(-1)).solution.squeeze(-1)
                expected += float((design @ d_s - target).pow(2).sum())
            assert qp.qp_objective(eq, sol.d) == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert captured["residual_eigen"] >= captured["diagonal"] + 0.01


# ---------------------------------------------------------------- box-constrained QP


def _enumerate_box_qp(matrix, rhs, lo, hi):
    """Exact reference: every (lo | hi | free) assignment, free part solved, best feasible."""
    k = rhs.shape[0]
    best_value, best = math.inf, None
    for assignment in itertools.product((0, 1, 2), repeat=k):
        d = torch.tensor([lo if a == 0 else hi if a == 1 else 0.0 for a in assignment], dtype=F64)
        free = [i for i, a in enumerate(assignment) if a == 2]
        fixed = [i for i, a in enumerate(assignment) if a != 2]
        if free:
            sub_rhs = rhs[free] - matrix[free][:, fixed] @ d[fixed]
            d[free] = torch.linalg.solve(matrix[free][:, free], sub_rhs)
        if (d < lo - 1e-12).any() or (d > hi + 1e-12).any():
            continue
        value = float(0.5 * d @ matrix @ d - rhs @ d)
        if value < best_value:
            best_value, best = value, d
    return best


@pytest.mark.parametrize("kind", ["diagonal", "residual_eigen"])
def test_box_qp_is_exact_stays_in_box_and_beats_feasible_points(kind):
    base, experts, acts = _problem(8, out_dim=6, k=3, scale=0.5)
    lo, hi = 0.0, 0.6
    _, eq, sol = _solve(base, experts, _grams(acts), kind, bounds=[lo, hi])
    d = sol.d
    assert (d >= lo).all() and (d <= hi).all()
    assert sol.box is not None and sol.box.unconverged == 0
    unconstrained = qp.solve_qp(eq, ridge=0.0).d
    assert ((unconstrained < lo) | (unconstrained > hi)).any()  # the box is active somewhere
    for r in range(eq.num_directions):
        torch.testing.assert_close(
            d[r], _enumerate_box_qp(eq.normal[r], eq.rhs[r], lo, hi), rtol=1e-8, atol=1e-10
        )
    j_box = qp.qp_objective(eq, d)
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        feasible = lo + (hi - lo) * torch.rand(d.shape, generator=g, dtype=F64)
        assert j_box <= qp.qp_objective(eq, feasible) + 1e-12
    for vertex in (lo, hi):
        assert j_box <= qp.qp_objective(eq, torch.full_like(d, vertex)) + 1e-12


def test_box_qp_equals_unconstrained_when_inside():
    base, experts, acts = _problem(9)
    _, eq, free = _solve(base, experts, _grams(acts), "diagonal", ridge=1e-6)
    lo, hi = float(free.d.min()) - 0.1, float(free.d.max()) + 0.1
    boxed = qp.solve_qp(eq, ridge=1e-6, bounds=[lo, hi])
    assert torch.equal(boxed.d, free.d)
    assert boxed.box is not None and boxed.box.iterations == 0


def test_box_qp_on_random_spd_batch_matches_enumeration():
    g = torch.Generator().manual_seed(21)
    a = torch.randn(40, 4, 4, generator=g, dtype=F64)
    matrices = a @ a.transpose(-1, -2) + 0.05 * torch.eye(4, dtype=F64)
    rhs = 3 * torch.randn(40, 4, generator=g, dtype=F64)
    d, info = qp.solve_box_qp(matrices, rhs, -1.0, 0.5)
    assert info.unconverged == 0
    expected = torch.stack([_enumerate_box_qp(matrices[b], rhs[b], -1.0, 0.5) for b in range(40)])
    torch.testing.assert_close(d, expected, rtol=1e-8, atol=1e-10)


# ---------------------------------------------------------------- captured energy


@pytest.mark.parametrize("seed", [10, 11, 12])
def test_captured_energy_is_a_fraction(seed):
    base, experts, acts = _problem(seed)
    for kind in qp.BASES:
        _, eq, sol = _solve(base, experts, _grams(acts), kind, ridge=1e-6)
        fraction = qp.captured_energy_fraction(qp.qp_objective(eq, sol.d), qp.base_energy(eq))
        assert 0.0 < fraction < 1.0


def test_captured_energy_is_one_when_one_update_reproduces_all_residuals():
    """Every task's inputs live in the first 3 input coordinates, where all experts agree with
    expert 0; they differ only on unseen coordinates. δ = Δ_0 removes every residual."""
    g = torch.Generator().manual_seed(13)
    base = torch.randn(5, 6, generator=g, dtype=F64)
    shared = torch.randn(5, 6, generator=g, dtype=F64)
    experts = []
    for kk in range(3):
        tv = shared.clone()
        if kk:
            tv[:, 3:] = torch.randn(5, 3, generator=g, dtype=F64)
        experts.append(base + tv)
    acts = [
        torch.cat([torch.randn(8, 3, generator=g, dtype=F64), torch.zeros(8, 3, dtype=F64)], 1)
        for _ in range(3)
    ]
    for kind in qp.BASES:
        _, eq, sol = _solve(base, experts, _grams(acts), kind)
        assert sol.fallback_rows > 0  # the normal matrices are rank one: pseudo-inverse path
        j_opt = qp.qp_objective(eq, sol.d)
        assert j_opt <= 1e-10 * qp.base_energy(eq)
        assert qp.captured_energy_fraction(j_opt, qp.base_energy(eq)) == pytest.approx(
            1.0, abs=1e-10
        )


def test_captured_energy_is_zero_when_updates_are_orthogonal_to_residuals():
    """Updates write only output rows 0-2, the residuals only rows 3-5: nothing to capture."""
    g = torch.Generator().manual_seed(14)
    acts = [torch.randn(10, 4, generator=g, dtype=F64) for _ in range(2)]
    grams = _grams(acts)
    updates = [
        torch.cat([torch.randn(3, 4, generator=g, dtype=F64), torch.zeros(3, 4, dtype=F64)])
        for _ in range(2)
    ]
    residuals = [
        torch.cat([torch.zeros(3, 4, dtype=F64), torch.randn(3, 4, generator=g, dtype=F64)])
        for _ in range(2)
    ]
    for kind in qp.BASES:
        basis = qp.output_basis(kind, residuals, grams)
        eq = qp.qp_normal_equations(updates, grams, residual_maps=residuals, basis=basis)
        sol = qp.solve_qp(eq)
        j_zero = qp.base_energy(eq)
        assert j_zero > 0
        assert qp.captured_energy_fraction(qp.qp_objective(eq, sol.d), j_zero) == pytest.approx(
            0.0, abs=1e-12
        )
    assert qp.captured_energy_fraction(0.0, 0.0) == 0.0  # defined as 0 when J(0) = 0


def test_captured_energy_clamps_only_round_off():
    assert qp.captured_energy_fraction(-1e-18, 1.0) == 1.0
    assert qp.captured_energy_fraction(1.0 + 1e-15, 1.0) == 0.0
    assert qp.captured_energy_fraction(2.0, 1.0, zero_feasible=False) == -1.0


def test_singular_batch_falls_back_to_pseudo_inverse():
    matrices = torch.stack([torch.eye(2, dtype=F64) * 2, torch.ones(2, 2, dtype=F64)])
    rhs = torch.tensor([[2.0, 4.0], [2.0, 2.0]], dtype=F64)
    x, n_fallback = qp.solve_symmetric_batched(matrices, rhs)
    assert n_fallback == 1
    torch.testing.assert_close(x, torch.tensor([[1.0, 2.0], [1.0, 1.0]], dtype=F64))  # min-norm


def test_ridge_is_relative_to_the_normal_matrices():
    base, experts, acts = _problem(15)
    _, eq, _ = _solve(base, experts, _grams(acts), "diagonal")
    mean_diag = float(eq.normal.diagonal(dim1=-2, dim2=-1).mean())
    assert qp.ridge_strength(eq.normal, 1e-3) == pytest.approx(1e-3 * mean_diag)
    scaled = qp.QPNormalEquations(eq.normal * 100, eq.rhs * 100, eq.energy * 100, None, "diagonal")
    torch.testing.assert_close(qp.solve_qp(scaled, ridge=1e-3).d, qp.solve_qp(eq, ridge=1e-3).d)


# ---------------------------------------------------------------- the method


def _stats(acts):
    return [
        TaskStatistics(gram=x.T @ x / x.shape[0], mean=x.mean(0), count=x.shape[0]) for x in acts
    ]


def _group(seed: int = 16):
    g = torch.Generator().manual_seed(seed)
    names = ["layers.0.attn.q_proj.weight", "layers.0.attn.k_proj.weight"]
    shapes = {names[0]: (6, 4), names[1]: (3, 4)}
    base = {n: torch.randn(*s, generator=g) for n, s in shapes.items()}
    experts = [
        {n: base[n] + 0.2 * torch.randn(*s, generator=g) for n, s in shapes.items()}
        for _ in range(2)
    ]
    merged_acts = [torch.randn(12, 4, generator=g, dtype=F64) for _ in range(2)]
    expert_acts = [2 * torch.randn(9, 4, generator=g, dtype=F64) for _ in range(2)]
    group = LinearGroup(
        name="layers.0.attn.qk",
        weights=names,
        base=base,
        experts=experts,
        task_names=["news", "sport"],
        expert_stats=_stats(expert_acts),
        merged_stats=_stats(merged_acts),
    )
    return group, merged_acts, expert_acts


def test_method_merges_each_weight_of_a_group_separately():
    method = qp.INFO.implementation
    assert isinstance(method, qp.QPProjectionMethod)
    group, merged_acts, _ = _group()
    params = {"basis": "diagonal", "ridge": 0.0, "diagnose_both_bases": True}
    assert method.statistics_request(params) == StatisticsRequest(
        propagate=True, expert_path=False, compute_dtype="auto"
    )
    merged, diag = method.merge_linear_group(group, params)
    json.dumps(diag)  # JSON-friendly
    assert diag["layer"] == group.name and set(diag["weights"]) == set(group.weights)
    for name in group.weights:
        base = group.base[name].double()
        experts = [e[name].double() for e in group.experts]
        # independent reference on the merged-path activations (propagate: true)
        d_ref = _dense_reference(base, experts, merged_acts)
        expected = base + sum(d_ref[:, k : k + 1] * (e - base) for k, e in enumerate(experts))
        assert merged[name].dtype == torch.float32 and merged[name].shape == base.shape
        torch.testing.assert_close(merged[name].double(), expected, rtol=1e-5, atol=1e-6)
        w = diag["weights"][name]
        assert w["basis"] == "diagonal" and w["other_basis"]["basis"] == "residual_eigen"
        assert w["J0"] == pytest.approx(
            _raw_objective(0 * base, base, experts, merged_acts), rel=1e-9
        )
        delta = expected - base
        assert w["J_opt"] == pytest.approx(
            _raw_objective(delta, base, experts, merged_acts), rel=1e-6
        )
        assert w["J_opt"] <= min(w["J_task_arithmetic"].values())
        assert w["J_task_arithmetic"]["1"] == pytest.approx(
            _raw_objective(sum(e - base for e in experts), base, experts, merged_acts), rel=1e-9
        )
        assert w["captured_energy"] == pytest.approx(1 - w["J_opt"] / w["J0"])
        assert set(w["d_stats"]) == {"news", "sport"}
        assert w["d_stats"]["news"]["mean"] == pytest.approx(float(d_ref[:, 0].mean()), abs=1e-6)


def test_method_without_propagation_uses_expert_statistics():
    method = qp.QPProjectionMethod()
    group, _, expert_acts = _group()
    params = {"propagate": False, "basis": "residual_eigen"}
    assert method.statistics_request(params).propagate is False
    merged, _ = method.merge_linear_group(group, params)
    group.merged_stats = None  # not consulted
    again, diag = method.merge_linear_group(group, params)
    name = group.weights[0]
    torch.testing.assert_close(merged[name], again[name])
    reference, _ = qp.qp_merge_weight(
        group.base[name],
        [e[name] for e in group.experts],
        [s.gram for s in _stats(expert_acts)],
        basis="residual_eigen",
    )
    torch.testing.assert_close(merged[name], reference)
    assert diag["weights"][name]["other_basis"] is None


def test_defaults_are_the_benchmarked_ones_and_agree_with_the_pure_function():
    defaults = qp.QPProjectionMethod().parse({})
    assert (defaults.basis, defaults.prior, defaults.ridge) == ("diagonal", 1.0, 1.0)
    assert (defaults.energy_floor, defaults.task_weighting, defaults.bounds) == (
        0.0,
        "samples",
        None,
    )
    group, merged_acts, _ = _group()
    merged, diag = qp.QPProjectionMethod().merge_linear_group(group, {})
    name = group.weights[0]
    reference, _ = qp.qp_merge_weight(
        group.base[name], [e[name] for e in group.experts], [s.gram for s in _stats(merged_acts)]
    )
    torch.testing.assert_close(merged[name], reference)
    w = diag["weights"][name]
    # with the prior at 1: J(d*) + μ‖d* − 1‖² <= J(1), so J(d*) never exceeds task arithmetic's
    assert w["J_opt"] <= w["J_task_arithmetic"]["1"] + 1e-12


def test_method_rejects_bad_input():
    method = qp.QPProjectionMethod()
    group, _, _ = _group()
    with pytest.raises(ConfigError, match="bounds"):
        method.merge_linear_group(group, {"bounds": [1.0, 0.0]})
    with pytest.raises(ConfigError, match="basis"):
        method.merge_linear_group(group, {"basis": "pca"})
    with pytest.raises(ConfigError, match="fallback"):
        method.merge_other("norm.weight", None, [torch.ones(2)] * 2, {"fallback": "median"})
    group.merged_stats = None
    with pytest.raises(TensorError, match="merged-path statistics"):
        method.merge_linear_group(group, {})
    group, _, _ = _group()
    group.merged_stats = [TaskStatistics(torch.eye(5, dtype=F64), torch.zeros(5, dtype=F64), 3)] * 2
    with pytest.raises(TensorError, match="q_proj"):
        method.merge_linear_group(group, {})


def test_method_with_bounds_stays_in_box_and_falls_back_on_other_tensors():
    method = qp.QPProjectionMethod()
    group, _, _ = _group()
    _, diag = method.merge_linear_group(group, {"bounds": [0.0, 0.5], "basis": "diagonal"})
    for w in diag["weights"].values():
        assert all(0.0 <= s["min"] <= s["max"] <= 0.5 for s in w["d_stats"].values())
        assert w["box_qp"]["unconverged_directions"] == 0
    experts = [torch.tensor([1.0, 3.0]), torch.tensor([3.0, 5.0])]
    torch.testing.assert_close(
        method.merge_other("b", torch.zeros(2), experts, {}), torch.tensor([2.0, 4.0])
    )


def test_registered_with_mergekit_and_mergekit_ext():
    info = ext_method_info("qp_projection")
    assert info is not None and isinstance(info.kind, Layerwise) and info.needs_calibration
    described = describe_method("qp_projection")
    assert {p["name"] for p in described["parameters"]} >= {
        "basis",
        "ridge",
        "bounds",
        "propagate",
        "diagnose_both_bases",
        "fallback",
    }
    assert described["paper_url"] == "https://arxiv.org/abs/2605.29101"


# ---------------------------------------------------------------- prior, energy floor, weighting


@pytest.mark.parametrize("kind", ["diagonal", "residual_eigen"])
def test_prior_ridge_is_the_plain_solution_at_zero_and_task_arithmetic_at_infinity(kind):
    base, experts, acts = _problem(11)
    _, eq, plain = _solve(base, experts, _grams(acts), kind, ridge=0.0)
    at_zero = qp.solve_qp(eq, ridge=0.0, prior=1.0)
    torch.testing.assert_close(at_zero.d, plain.d, rtol=0, atol=0)
    # closed form per direction: (N_r + μI) d_r = h_r + μ·1
    ridge = 0.7
    sol = qp.solve_qp(eq, ridge=ridge, prior=1.0)
    mu = qp.ridge_strength(eq.normal, ridge)
    eye = torch.eye(eq.num_updates, dtype=F64)
    expected = torch.linalg.solve(eq.normal + mu * eye, eq.rhs + mu)
    torch.testing.assert_close(sol.d, expected, rtol=1e-10, atol=1e-12)
    assert sol.mu == pytest.approx(mu)
    gaps = [float((qp.solve_qp(eq, ridge=r, prior=1.0).d - 1.0).abs().max()) for r in (1, 1e2, 1e4)]
    assert gaps[0] > gaps[1] > gaps[2] and gaps[2] < 1e-3  # d → 1 as μ → ∞
    # the default prior 0 shrinks toward the base instead
    assert float(qp.solve_qp(eq, ridge=1e4).d.abs().max()) < 1e-3


def test_prior_ridge_with_bounds_and_the_objective_it_minimises():
    base, experts, acts = _problem(12)
    _, eq, _ = _solve(base, experts, _grams(acts), "diagonal")
    mu_ridge = 0.3
    sol = qp.solve_qp(eq, ridge=mu_ridge, prior=1.0, bounds=[0.0, 1.0])
    mu = sol.mu
    assert float(sol.d.min()) >= 0.0 and float(sol.d.max()) <= 1.0

    def penalised(d):
        return qp.qp_objective(eq, d) + mu * float((d - 1.0).pow(2).sum())

    best = penalised(sol.d)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):  # no feasible perturbation improves J + μ‖d − 1‖²
        trial = (sol.d + 0.05 * torch.randn(sol.d.shape, generator=g, dtype=F64)).clamp(0, 1)
        assert penalised(trial) >= best - 1e-12


@pytest.mark.parametrize("kind", ["diagonal", "residual_eigen"])
def test_energy_floor_leaves_exactly_the_low_energy_directions_at_the_prior(kind):
    base, experts, acts = _problem(13, out_dim=7)
    _, eq, plain = _solve(base, experts, _grams(acts), kind, ridge=0.0)
    energy = eq.energy
    floor = 0.8
    low = energy < floor * energy.mean()
    assert 0 < int(low.sum()) < energy.numel()  # the test problem has both kinds
    for prior in (0.0, 1.0):
        sol = qp.solve_qp(eq, ridge=0.0, prior=prior, energy_floor=floor)
        assert sol.floored_directions == int(low.sum())
        torch.testing.assert_close(sol.d[low], torch.full_like(sol.d[low], prior))
        torch.testing.assert_close(sol.d[~low], plain.d[~low], rtol=0, atol=0)
    torch.testing.assert_close(qp.low_energy_directions(energy, floor), low)
    assert not bool(qp.low_energy_directions(energy, 0.0).any())
    # with a box the prior is clipped into it
    boxed = qp.solve_qp(eq, ridge=0.0, prior=2.0, energy_floor=floor, bounds=[0.0, 1.5])
    torch.testing.assert_close(boxed.d[low], torch.full_like(boxed.d[low], 1.5))
    with pytest.raises(ConfigError, match="energy_floor"):
        qp.solve_qp(eq, energy_floor=-1.0)


def test_energy_floor_zeroes_the_update_in_a_dropped_direction_of_the_merge():
    base, experts, acts = _problem(14, out_dim=6)
    grams = _grams(acts)
    # make output row 2 nearly unchanged by every expert: tiny residual energy there
    experts = [e.clone() for e in experts]
    for e in experts:
        e[2] = base[2] + 1e-4 * (e[2] - base[2])
    merged, diag = qp.qp_merge_weight(
        base, experts, grams, basis="diagonal", ridge=0.0, prior=0.0, energy_floor=0.01
    )
    assert diag["floored_directions"] == 1
    torch.testing.assert_close(merged[2], base[2], rtol=0, atol=0)
    assert diag["captured_energy"] == pytest.approx(1 - diag["J_opt"] / diag["J0"])


def test_energy_task_weighting_equalises_the_tasks_residual_energy():
    base, experts, acts = _problem(15)
    grams = _grams(acts)
    task_vectors = [e - base for e in experts]
    weights = qp.task_energy_weights(task_vectors, grams)
    energies = [float(((tv @ g) * tv).sum()) for tv, g in zip(task_vectors, grams)]
    weighted = [e * float(w) for e, w in zip(energies, weights)]
    assert weighted == pytest.approx([sum(energies) / len(energies)] * len(energies), rel=1e-12)
    # the method with energy weighting is the plain method on the rescaled Grams
    scaled = [g * float(w) for g, w in zip(grams, weights)]
    for kind in ("diagonal", "residual_eigen"):
        got, diag = qp.qp_merge_weight(
            base, experts, grams, basis=kind, ridge=0.0, task_weighting="energy"
        )
        expected, _ = qp.qp_merge_weight(base, experts, scaled, basis=kind, ridge=0.0)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    # a task with no update keeps weight 1
    zero = qp.task_energy_weights([task_vectors[0], 0 * task_vectors[1]], grams[:2])
    assert float(zero[1]) == 1.0 and float(zero[0]) == pytest.approx(1.0)
    with pytest.raises(ConfigError, match="task_weighting"):
        qp.qp_merge_weight(base, experts, grams, task_weighting="uniform")


def test_method_passes_the_new_options_through():
    method = qp.QPProjectionMethod()
    group, merged_acts, _ = _group()
    params = {"basis": "diagonal", "prior": 1.0, "ridge": 1e6, "energy_floor": 1.0}
    merged, diag = method.merge_linear_group(group, params)
    for name in group.weights:
        base = group.base[name].double()
        ta = base + sum(e[name].double() - base for e in group.experts)
        torch.testing.assert_close(merged[name].double(), ta, rtol=1e-4, atol=1e-5)
        assert diag["weights"][name]["floored_directions"] > 0
    with pytest.raises(ConfigError, match="energy_floor"):
        method.parse({"energy_floor": -0.1})
