"""ACE (mergekit_ext.methods.ace) against hand-derived closed forms, following docs/methods.md § ACE.

The hand case used throughout (K = 2 experts, 2x2 weights):

    Δ_1 = [[1, 0], [-1, 0]]      Δ_2 = [[0, 2], [0, -2]]

Both have zero row means, so the row-centred C_k = Δ_k, and their input covariances are
diagonal: S_1 = C_1ᵀC_1 = diag(2, 0), S_2 = diag(0, 8). Energies τ_1 = ‖Δ_1‖² = 2, τ_2 = 8.
"""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
import torch
from mergekit.merge_methods import TensorGroup

from mergekit_ext import merge_record
from mergekit_ext.errors import TensorError
from mergekit_ext.methods.ace import (
    ace_merge,
    ace_merge_simple,
    ace_merge_tensor,
    heterogeneity,
    log_energy_spread,
    top_energy_share,
)

F64 = torch.float64
W0 = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=F64)
DELTA_1 = torch.tensor([[1.0, 0.0], [-1.0, 0.0]], dtype=F64)
DELTA_2 = torch.tensor([[0.0, 2.0], [0.0, -2.0]], dtype=F64)
EXPERTS = [W0 + DELTA_1, W0 + DELTA_2]


def _rows(first_row: list[Fraction]) -> torch.Tensor:
    """[[r], [-r]]: every M of the hand case has this shape (B's rows are r and -r)."""
    row = torch.tensor([float(x) for x in first_row], dtype=F64)
    return torch.stack([row, -row])


# ---- hand-derived results -------------------------------------------------------------
#
# Step 1, heterogeneity: l_1 = log 2, l_2 = log 8 = 3 log 2; mean 2 log 2;
#   unbiased variance ((-log 2)² + (log 2)²) / (2 - 1) = 2 (log 2)²;
#   γ = 2 (log 2)² / (2 log 2)² = 1/2.
GAMMA = 0.5
#
# Not normalizing, eps = 1 (so ε_k = 1):
#   Σ_1 + I = diag(3, 1), Σ_2 + I = diag(1, 9); their sum = diag(4, 10).
#   C_agg is the row of column means of the SUM of the covariances: Σ_1 + Σ_2 = diag(2, 8),
#   column means [(2+0)/2, (0+8)/2] = [1, 4], added to every row: A = [[5, 4], [1, 14]],
#   det A = 70 - 4 = 66, A⁻¹ = (1/66) [[14, -4], [-1, 5]].
#   B = C_1 diag(3, 1) + C_2 diag(1, 9) = [[3, 0], [-3, 0]] + [[0, 18], [0, -18]] = [[3, 18], [-3, -18]].
#   M row 1 = [3, 18] A⁻¹ = [3·14 - 18·1, -3·4 + 18·5] / 66 = [24, 78] / 66 = [4/11, 13/11].
M_PLAIN = _rows([Fraction(4, 11), Fraction(13, 11)])
A_PLAIN = torch.tensor([[5.0, 4.0], [1.0, 14.0]], dtype=F64)
#
# Normalizing, eps = 1: t_1 = tr S_1 = 2, t_2 = 8.
#   Σ_1 = diag(1, 0), Σ_2 = diag(0, 1); ε_1 = 1/2, ε_2 = 1/8.
#   Σ_1 + ε_1 I = diag(3/2, 1/2), Σ_2 + ε_2 I = diag(1/8, 9/8); their sum = diag(13/8, 13/8).
#   Σ_1 + Σ_2 = I; column means [1/2, 1/2]; divided by mean τ = (2 + 8)/2 = 5: C_agg = [1/10, 1/10].
#   A = [[13/8 + 1/10, 1/10], [1/10, 13/8 + 1/10]] = (1/40) [[69, 4], [4, 69]];
#   eigenvalues (69 ± 4)/40, so cond(A) = 73/65; A⁻¹ = 40/(69² - 16) [[69, -4], [-4, 69]] = (40/4745) [...].
#   B = C_1 diag(3/2, 1/2) + C_2 diag(1/8, 9/8) = [[3/2, 9/4], [-3/2, -9/4]].
#   M row 1 = [3/2·69 - 9/4·4, -3/2·4 + 9/4·69] · 40/4745 = [189/2, 597/4] · 40/4745
#           = [3780, 5970] / 4745 = [756/949, 1194/949].
M_NORM = _rows([Fraction(756, 949), Fraction(1194, 949)])
COND_NORM = 73 / 65
#
# Step 5, spectral refinement (normalizing only):
#   Σ̄ = ½ (diag(3/2, 1/2) + diag(1/8, 9/8)) = diag(13/16, 13/16).
#   R = Δ_1 (Σ_1 - Σ̄) + Δ_2 (Σ_2 - Σ̄) = Δ_1 diag(3/16, -13/16) + Δ_2 diag(-13/16, 3/16)
#     = [[3/16, 0], [-3/16, 0]] + [[0, 3/8], [0, -3/8]] = [[3/16, 3/8], [-3/16, -3/8]].
#   R + M = [[r], [-r]] has rank one: its SVD is s·u vᵀ with s = √2‖r‖, u = [1, -1]/√2, v = r/‖r‖.
#   k = floor(k_frac · 2): k_frac = 0.3 gives k = 0 (no change);
#   k_frac = 0.5 gives k = 1 and M += s·u vᵀ = R + M, so M_refined = 2 M + R.
R_HAND = _rows([Fraction(3, 16), Fraction(3, 8)])
M_REFINED = 2 * M_NORM + R_HAND


def _merge(**kwargs) -> tuple[torch.Tensor, object]:
    return ace_merge_tensor(W0, EXPERTS, eps=1.0, **kwargs)


def test_heterogeneity_closed_forms() -> None:
    # ‖Δ‖² = e², e⁴ → l = (2, 4): mean 3, unbiased variance 2, γ = 2/9.
    two = [torch.tensor([math.e], dtype=F64), torch.tensor([math.e**2], dtype=F64)]
    assert heterogeneity(two) == pytest.approx(2 / 9, rel=1e-9)
    # ‖Δ‖² = e, e², e³ → l = (1, 2, 3): mean 2, unbiased variance 1, γ = 1/4.
    three = [torch.tensor([math.e**p], dtype=F64) for p in (0.5, 1.0, 1.5)]
    assert heterogeneity(three) == pytest.approx(1 / 4, rel=1e-9)
    # Equal energies: no spread at all.
    assert heterogeneity([torch.ones(3, 2), -torch.ones(3, 2)]) == pytest.approx(0.0, abs=1e-15)
    assert heterogeneity([DELTA_1, DELTA_2]) == pytest.approx(GAMMA, rel=1e-9)


def test_top_energy_share() -> None:
    # Singular values 1..20: the top 5% is one value, 20² / Σ i² = 400 / 2870.
    matrix = torch.diag(torch.arange(1.0, 21.0))
    assert top_energy_share(matrix) == pytest.approx(400 / 2870, rel=1e-12)
    # 10% of 20 values: the top two.
    assert top_energy_share(matrix, 0.1) == pytest.approx((400 + 361) / 2870, rel=1e-12)
    # Fewer than 20 values still keeps at least one (ceil).
    assert top_energy_share(torch.diag(torch.tensor([3.0, 4.0]))) == pytest.approx(16 / 25)
    assert top_energy_share(torch.zeros(3, 4)) == 0.0


def test_never_normalize_matches_hand_derivation() -> None:
    merged, diag = _merge(normalize="never")
    torch.testing.assert_close(merged, W0 + M_PLAIN, rtol=0, atol=1e-12)
    assert not diag.normalized
    assert diag.gamma == pytest.approx(GAMMA, rel=1e-9)
    assert diag.condition_number == pytest.approx(float(torch.linalg.cond(A_PLAIN)), rel=1e-9)
    # M has rows r and -r: rank one, all of its energy in the top singular value.
    assert diag.top5_energy_share == pytest.approx(1.0)


def test_always_normalize_matches_hand_derivation_without_refinement() -> None:
    # k_frac = 0.3 on a 2x2 weight: k = floor(0.6) = 0, so step 5 changes nothing.
    merged, diag = _merge(normalize="always", k_frac=0.3)
    torch.testing.assert_close(merged, W0 + M_NORM, rtol=0, atol=1e-12)
    assert diag.normalized
    assert diag.condition_number == pytest.approx(COND_NORM, rel=1e-9)


def test_spectral_refinement_matches_hand_derivation() -> None:
    merged, diag = _merge(normalize="always", k_frac=0.5)
    torch.testing.assert_close(merged, W0 + M_REFINED, rtol=0, atol=1e-12)
    # The diagnostic is taken before refinement: still the rank-one M.
    assert diag.top5_energy_share == pytest.approx(1.0)


def test_scale_multiplies_the_update() -> None:
    merged, _ = _merge(normalize="never", scale=0.25)
    torch.testing.assert_close(merged, W0 + 0.25 * M_PLAIN, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("threshold", "expected", "normalized"),
    [(0.3, W0 + M_NORM, True), (0.6, W0 + M_PLAIN, False)],
    ids=["gamma-above-threshold", "gamma-below-threshold"],
)
def test_auto_normalize_follows_gamma(threshold: float, expected, normalized: bool) -> None:
    # γ = 1/2 for the hand case: above 0.3 → the normalized branch, below 0.6 → the plain one.
    merged, diag = _merge(normalize="auto", gamma_threshold=threshold, k_frac=0.3)
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-12)
    assert diag.normalized is normalized


def test_auto_with_refinement_equals_always() -> None:
    auto, _ = _merge(normalize="auto", gamma_threshold=0.3, k_frac=0.5)
    torch.testing.assert_close(auto, W0 + M_REFINED, rtol=0, atol=1e-12)


def test_centring_is_over_rows() -> None:
    # Adding the same row vector v to every row of Δ_k leaves C_k, S_k, B and (unnormalized) A
    # unchanged, so the plain merge is unchanged. Centring over the other axis would not be.
    shift = torch.tensor([[0.3, -0.7], [0.3, -0.7]], dtype=F64)
    shifted = [W0 + DELTA_1 + shift, W0 + DELTA_2 - 2 * shift]
    merged, _ = ace_merge_tensor(W0, shifted, eps=1.0, normalize="never")
    torch.testing.assert_close(merged, W0 + M_PLAIN, rtol=0, atol=1e-12)


def test_singular_system_falls_back_to_pseudo_inverse() -> None:
    # eps = 0, both task vectors only in input column 0: Δ_1 = [[1,0],[-1,0]], Δ_2 = 2 Δ_1.
    # S_1 = diag(2, 0), S_2 = diag(8, 0); Σ S_k = diag(10, 0) → C_agg = [5, 0].
    # A = [[15, 0], [5, 0]] is singular (zero column). B = C_1 S_1 + C_2 S_2 = [[18, 0], [-18, 0]].
    # A⁺ = (1/(15² + 5²)) [[15, 5], [0, 0]] = (1/250) [...]; M row 1 = [18·15, 18·5] / 250
    #    = [27/25, 9/25].
    experts = [W0 + DELTA_1, W0 + 2 * DELTA_1]
    merged, diag = ace_merge_tensor(W0, experts, eps=0.0, normalize="never")
    expected = W0 + _rows([Fraction(27, 25), Fraction(9, 25)])
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-12)
    assert torch.isfinite(merged).all()
    assert diag.condition_number > 1e12


def _reference_ace(base, experts, eps, k_frac, normalizing):
    """docs/methods.md § ACE transcribed literally, one loop per formula (no shared code with ace.py)."""
    n_in = base.shape[1]
    deltas = [e - base for e in experts]
    taus = [float((d * d).sum()) for d in deltas]
    sigmas, eps_k, centred = [], [], []
    for d in deltas:
        c = d - d.mean(dim=0, keepdim=True)
        s = c.T @ c
        t = float(torch.trace(s)) + 1e-12
        centred.append(c)
        sigmas.append(s / t if normalizing else s)
        eps_k.append(eps / t if normalizing else eps)
    eye = torch.eye(n_in, dtype=F64)
    a = sum(s + e * eye for s, e in zip(sigmas, eps_k))
    c_agg = sum(sigmas).mean(dim=0, keepdim=True)  # column means of the sum of covariances
    if normalizing:
        c_agg = c_agg / (sum(taus) / len(taus))
    a = a + c_agg
    b = sum(c @ (s + e * eye) for c, s, e in zip(centred, sigmas, eps_k))
    m = b @ torch.linalg.inv(a)
    if normalizing:
        sigma_bar = sum(s + e * eye for s, e in zip(sigmas, eps_k)) / len(sigmas)
        r = sum(d @ (s - sigma_bar) for d, s in zip(deltas, sigmas))
        u, sv, vh = torch.linalg.svd(r + m)
        k = math.floor(k_frac * min(m.shape))
        m = m + sv[:k].mean() * (u[:, :k] @ vh[:k, :])
    return base + m


@pytest.mark.parametrize("normalize", ["never", "always"])
def test_matches_literal_transcription_on_uncentred_task_vectors(normalize: str) -> None:
    # Random task vectors with large row means (so centring and the uncentred R both matter).
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(7, 5, generator=gen, dtype=F64)
    experts = [
        base + s * torch.randn(7, 5, generator=gen, dtype=F64) + torch.randn(1, 5, generator=gen)
        for s in (0.2, 1.0, 3.0)
    ]
    merged, _ = ace_merge_tensor(base, experts, eps=0.05, k_frac=0.5, normalize=normalize)
    expected = _reference_ace(base, experts, 0.05, 0.5, normalize == "always")
    torch.testing.assert_close(merged, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("normalize", ["never", "always"])
def test_permuting_experts_changes_nothing(normalize: str) -> None:
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=gen, dtype=F64)
    experts = [base + s * torch.randn(6, 5, generator=gen, dtype=F64) for s in (0.1, 0.5, 2.0)]
    reference, ref_diag = ace_merge_tensor(base, experts, normalize=normalize, k_frac=0.5)
    for order in itertools.permutations(range(3)):
        merged, diag = ace_merge_tensor(
            base, [experts[i] for i in order], normalize=normalize, k_frac=0.5
        )
        torch.testing.assert_close(merged, reference, rtol=1e-10, atol=1e-10)
        assert diag.gamma == pytest.approx(ref_diag.gamma, rel=1e-12)
    simple = ace_merge_simple(base, experts)
    torch.testing.assert_close(ace_merge_simple(base, experts[::-1]), simple)


def test_deterministic_and_low_precision_inputs_use_float64_math() -> None:
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(8, 4, generator=gen)
    experts = [base + 0.05 * torch.randn(8, 4, generator=gen) for _ in range(3)]
    first, _ = ace_merge_tensor(base, experts)
    second, _ = ace_merge_tensor(base, experts)
    assert torch.equal(first, second)
    # bfloat16 in → bfloat16 out, computed in float64 from the bfloat16 values.
    base_bf, experts_bf = base.bfloat16(), [e.bfloat16() for e in experts]
    merged_bf, _ = ace_merge_tensor(base_bf, experts_bf)
    assert merged_bf.dtype == torch.bfloat16
    reference, _ = ace_merge_tensor(base_bf.double(), [e.double() for e in experts_bf])
    assert torch.equal(merged_bf, reference.bfloat16())


def test_simple_merge_is_base_plus_scaled_mean_delta() -> None:
    # W_0 = [1, 2, 3]; Δ_1 = [1, 0, 0], Δ_2 = [0, 2, 3]; mean Δ = [0.5, 1, 1.5]; scale 2 → [2, 4, 6].
    base = torch.tensor([1.0, 2.0, 3.0])
    experts = [torch.tensor([2.0, 2.0, 3.0]), torch.tensor([1.0, 4.0, 6.0])]
    assert torch.equal(ace_merge_simple(base, experts, scale=2.0), torch.tensor([2.0, 4.0, 6.0]))
    assert torch.equal(ace_merge_simple(base, experts), torch.tensor([1.5, 3.0, 4.5]))


# ---- bad input -----------------------------------------------------------------------


def test_mismatched_shapes_name_the_tensor() -> None:
    with pytest.raises(TensorError, match=r"layers\.0\.q\.weight.*expert 2.*\(2, 3\)"):
        ace_merge_tensor(W0, [EXPERTS[0], torch.zeros(2, 3, dtype=F64)], name="layers.0.q.weight")
    with pytest.raises(TensorError, match="norm.weight"):
        ace_merge_simple(torch.zeros(3), [torch.zeros(3), torch.zeros(4)], name="norm.weight")


def test_single_expert_is_rejected() -> None:
    with pytest.raises(TensorError, match=r"at least two experts.*mlp\.up\.weight"):
        ace_merge_tensor(W0, [EXPERTS[0]], name="mlp.up.weight")
    with pytest.raises(TensorError, match="at least two experts"):
        ace_merge_simple(torch.zeros(3), [torch.ones(3)], name="bias")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weight_names_tensor_and_model(bad: float) -> None:
    broken = EXPERTS[1].clone()
    broken[0, 1] = bad
    with pytest.raises(TensorError, match=r"attn\.o\.weight of expert 2 contains NaN or Inf"):
        ace_merge_tensor(W0, [EXPERTS[0], broken], name="attn.o.weight")
    base = W0.clone()
    base[1, 1] = bad
    with pytest.raises(TensorError, match=r"attn\.o\.weight of the base model"):
        ace_merge_tensor(base, EXPERTS, name="attn.o.weight")


def test_other_bad_input() -> None:
    with pytest.raises(TensorError, match="normalize must be auto, always or never"):
        ace_merge_tensor(W0, EXPERTS, normalize="sometimes")  # type: ignore[arg-type]
    with pytest.raises(TensorError, match="2-D weight.*ln.weight is 1-D"):
        ace_merge_tensor(torch.zeros(3), [torch.ones(3), torch.ones(3)], name="ln.weight")


# ---- the mergekit adapter ------------------------------------------------------------


def _group(name: str, base: torch.Tensor, experts, vocabulary_axis=None) -> TensorGroup:
    return TensorGroup.from_tensors(
        [base, *experts], base_index=0, name=name, vocabulary_axis=vocabulary_axis
    )


def test_adapter_merges_linear_weights_with_ace_and_records_diagnostics() -> None:
    name = "model.layers.0.mlp.up_proj.weight"
    with merge_record.collecting() as recorder:
        merged = ace_merge.merge_group(
            _group(name, W0, EXPERTS),
            eps=1.0,
            k_frac=0.5,
            gamma_threshold=0.3,
            normalize="auto",
            scale=1.0,
        )
    torch.testing.assert_close(merged, W0 + M_REFINED, rtol=0, atol=1e-12)
    record = recorder.sections["ace"]["tensors"][name]
    assert record["normalized"] is True
    assert record["gamma"] == pytest.approx(GAMMA, rel=1e-9)
    assert record["condition_number"] == pytest.approx(COND_NORM, rel=1e-9)
    assert record["top5_energy_share"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("name", "vocabulary_axis"),
    [
        ("model.embed_tokens.weight", 0),  # token embedding (vocabulary axis)
        ("lm_head.weight", 0),  # vocabulary head
        ("embeddings.position_embeddings.weight", None),  # lookup table, no vocabulary
        ("vision_model.embeddings.position_embedding.weight", None),
    ],
)
def test_adapter_uses_mean_delta_for_embedding_tables(name: str, vocabulary_axis) -> None:
    merged = ace_merge.merge_group(_group(name, W0, EXPERTS, vocabulary_axis), eps=1.0, scale=2.0)
    # W_0 + 2 · ½ (Δ_1 + Δ_2) = W_0 + Δ_1 + Δ_2.
    torch.testing.assert_close(merged, W0 + DELTA_1 + DELTA_2, rtol=0, atol=1e-12)


def test_adapter_uses_mean_delta_for_1d_and_0d_tensors() -> None:
    base = torch.tensor([1.0, 2.0, 3.0])
    experts = [torch.tensor([2.0, 2.0, 3.0]), torch.tensor([1.0, 4.0, 6.0])]
    merged = ace_merge.merge_group(_group("model.norm.weight", base, experts))
    assert torch.equal(merged, torch.tensor([1.5, 3.0, 4.5]))
    scalar = ace_merge.merge_group(
        _group("logit_scale", torch.tensor(2.0), [torch.tensor(3.0), torch.tensor(5.0)])
    )
    assert scalar.shape == () and scalar.item() == pytest.approx(4.0)


def test_adapter_requires_a_base_model() -> None:
    group = TensorGroup.from_tensors(EXPERTS, name="layers.1.v.weight")
    with pytest.raises(TensorError, match=r"base_model.*layers\.1\.v\.weight"):
        ace_merge.merge_group(group)


# ---- the scale-invariant heterogeneity rule ----------------------------------------------


def test_log_energy_spread_is_scale_invariant_and_gamma_is_not() -> None:
    gen = torch.Generator().manual_seed(1)
    deltas = [s * torch.randn(6, 4, generator=gen, dtype=F64) for s in (0.01, 0.05, 0.2)]
    spread = log_energy_spread(deltas)
    for c in (1e-3, 0.5, 7.0):
        assert log_energy_spread([c * d for d in deltas]) == pytest.approx(spread, rel=1e-10)
    # γ moves with the absolute size: that is why the paper's rule never fires on real experts
    assert heterogeneity([1e-3 * d for d in deltas]) < heterogeneity(deltas) / 2
    # hand case: ‖Δ_1‖² = 2, ‖Δ_2‖² = 8 → l = (log 2, 3 log 2), unbiased variance 2 (log 2)²
    assert log_energy_spread([DELTA_1, DELTA_2]) == pytest.approx(2 * math.log(2) ** 2, rel=1e-12)


@pytest.mark.parametrize(("threshold", "normalized"), [(0.9, True), (1.0, False)])
def test_scale_invariant_rule_decides_normalization(threshold: float, normalized: bool) -> None:
    # spread of the hand case: 2 (log 2)² ≈ 0.961
    for c in (1e-4, 1.0):  # the decision does not change with the task vectors' size
        experts = [W0 + c * DELTA_1, W0 + c * DELTA_2]
        _, diag = ace_merge_tensor(
            W0, experts, eps=1.0, heterogeneity_rule="scale_invariant", spread_threshold=threshold
        )
        assert diag.normalized is normalized
        assert diag.as_dict()["heterogeneity"] == "scale_invariant"
        assert diag.as_dict()["log_energy_spread"] == pytest.approx(2 * math.log(2) ** 2)
    # the paper's rule on the small copies: γ ≈ 0.004 never exceeds its 0.3 threshold
    _, paper = ace_merge_tensor(W0, [W0 + 1e-4 * DELTA_1, W0 + 1e-4 * DELTA_2], eps=1.0)
    assert paper.normalized is False and paper.gamma < 0.01


def test_scale_invariant_normalized_merge_equals_always() -> None:
    merged, _ = ace_merge_tensor(
        W0, EXPERTS, eps=1.0, heterogeneity_rule="scale_invariant", spread_threshold=0.5
    )
    torch.testing.assert_close(merged, W0 + M_NORM, rtol=0, atol=1e-12)
