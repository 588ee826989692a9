"""WUDI (mergekit_ext.methods.wudi) against the authors' loss and a hand-written Adam.

The reference throughout is a literal transcription of the authors' per-weight loop
(``get_redundant_task_vector`` in their ``wudi_main.py``): stack the task vectors,
``loss = Σ (((τ − τ_k) τ_kᵀ)² / ‖τ_k‖²)``, ``torch.optim.Adam`` on ``τ`` from ``Σ_k τ_k``.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import yaml
from click.testing import CliRunner
from mergekit.merge_methods import TensorGroup
from PIL import Image
from safetensors.torch import load_file

from mergekit_ext import merge_record
from mergekit_ext.cli import main
from mergekit_ext.errors import ConfigError, TensorError
from mergekit_ext.methods import ext_method_info
from mergekit_ext.methods.ace import is_linear_weight
from mergekit_ext.methods.wudi import (
    adam_minimise,
    interference_quadratic,
    summarize_wudi,
    wudi_merge,
    wudi_merge_simple,
    wudi_merge_tensor,
)
from mergekit_ext.testing import make_experts, make_tiny_llama

F64 = torch.float64


def authors_loss(merged: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """The authors' loss, as written in their code (vectors: K x out x in)."""
    l2_norms = torch.square(torch.norm(vectors.reshape(vectors.shape[0], -1), p=2, dim=-1))
    disturbing_vectors = merged.unsqueeze(0) - vectors
    inner_product = torch.matmul(disturbing_vectors, vectors.transpose(1, 2))
    return torch.sum(torch.square(inner_product) / l2_norms.unsqueeze(-1).unsqueeze(-1))


def authors_loop(vectors: torch.Tensor, steps: int, lr: float) -> torch.Tensor:
    """The authors' optimisation: Adam (weight_decay 0) on τ from the sum of the vectors."""
    merging_vector = torch.nn.Parameter(torch.sum(vectors, dim=0))
    optimizer = torch.optim.Adam([merging_vector], lr=lr, weight_decay=0, foreach=False)
    for _ in range(steps):
        loss = authors_loss(merging_vector, vectors)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return merging_vector.detach()


def _task_vectors(shape: tuple[int, int], k: int = 3, seed: int = 0, scale: float = 0.1):
    g = torch.Generator().manual_seed(seed)
    return [scale * (i + 1) * torch.randn(*shape, generator=g, dtype=F64) for i in range(k)]


# ----------------------------------------------------------------------------- the loss


@pytest.mark.parametrize("shape", [(6, 6), (4, 9), (9, 4)])
def test_quadratic_equals_the_authors_loss_and_its_gradient(shape) -> None:
    taus = _task_vectors(shape)
    quadratic = interference_quadratic(taus)
    g = torch.Generator().manual_seed(7)
    for tau in (torch.stack(taus).sum(0), torch.randn(*shape, generator=g, dtype=F64)):
        reference = authors_loss(tau, torch.stack(taus))
        assert quadratic.loss(tau) == pytest.approx(float(reference), rel=1e-12)
        t = tau.clone().requires_grad_(True)
        authors_loss(t, torch.stack(taus)).backward()
        closed_form = 2 * (tau @ quadratic.a - quadratic.b)
        torch.testing.assert_close(closed_form, t.grad, rtol=1e-10, atol=1e-12)
    # at τ = τ_k for a single task the loss is 0, and it is never negative
    single = interference_quadratic(taus[:1])
    assert single.loss(taus[0]) == pytest.approx(0.0, abs=1e-12)


def test_one_step_equals_a_hand_written_adam_step() -> None:
    taus = _task_vectors((5, 7))
    quadratic = interference_quadratic(taus)
    tau0 = torch.stack(taus).sum(0)
    lr, b1, b2, eps = 1e-3, 0.9, 0.999, 1e-8
    got, _, _ = adam_minimise(
        quadratic, tau0, steps=1, lr=lr, beta1=b1, beta2=b2, eps=eps, dtype=F64
    )
    # Adam, step 1, by hand: m = (1-β₁) g, v = (1-β₂) g², bias-corrected m̂ = g, v̂ = g²
    t = tau0.clone().requires_grad_(True)
    authors_loss(t, torch.stack(taus)).backward()
    g = t.grad
    m_hat = ((1 - b1) * g) / (1 - b1)
    v_hat = ((1 - b2) * g * g) / (1 - b2)
    expected = tau0 - lr * m_hat / (v_hat.sqrt() + eps)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    assert not torch.equal(got, tau0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_many_steps_equal_the_authors_loop(dtype) -> None:
    taus = [t.to(dtype) for t in _task_vectors((8, 6), seed=3)]
    steps, lr = 40, 1e-3
    reference = authors_loop(torch.stack(taus), steps, lr)
    got, _ = wudi_merge_tensor(
        torch.zeros(8, 6, dtype=dtype),
        taus,
        steps=steps,
        lr=lr,
        dtype="float64" if dtype == torch.float64 else "float32",
    )
    tol = dict(rtol=1e-9, atol=1e-11) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-6)
    torch.testing.assert_close(got, reference, **tol)


def test_loss_decreases_and_the_curve_is_the_loss_of_the_iterates() -> None:
    taus = _task_vectors((12, 10), k=4, seed=5)
    base = torch.randn(12, 10, dtype=F64)
    merged, d = wudi_merge_tensor(base, [base + t for t in taus], steps=200, lr=1e-3)
    vectors = torch.stack(taus)
    assert d.initial_loss == pytest.approx(float(authors_loss(vectors.sum(0), vectors)), rel=1e-10)
    final = float(authors_loss(merged.double() - base, vectors))
    assert d.final_loss == pytest.approx(final, rel=1e-8)
    assert d.final_loss < 0.7 * d.initial_loss
    assert d.relative_reduction == pytest.approx(1 - d.final_loss / d.initial_loss)
    assert d.curve_steps[0] == 0 and d.curve_steps[-1] == 200 and len(d.curve_steps) == 21
    assert d.curve[0] == pytest.approx(1.0) and d.curve[-1] == pytest.approx(
        1 - d.relative_reduction
    )
    assert d.curve[-1] < d.curve[len(d.curve) // 2] < d.curve[0]
    assert d.rank == 10 and d.steps == 200
    assert d.norm_ratio == pytest.approx(
        float((merged.double() - base).norm() / vectors.sum(0).norm()), rel=1e-6
    )


def test_low_rank_factor_gives_the_dense_result() -> None:
    """LoRA-like task vectors (rank 2 each, 3 tasks): A has rank 6 of 16, the factor is used."""
    g = torch.Generator().manual_seed(11)
    taus = [
        0.1
        * torch.randn(10, 2, generator=g, dtype=F64)
        @ torch.randn(2, 16, generator=g, dtype=F64)
        for _ in range(3)
    ]
    quadratic = interference_quadratic(taus)
    assert quadratic.rank == 6 and quadratic.factor is not None
    torch.testing.assert_close(quadratic.factor @ quadratic.factor.T, quadratic.a)
    tau0 = torch.stack(taus).sum(0)
    fast, _, _ = adam_minimise(quadratic, tau0, steps=30, lr=1e-3, dtype=F64)
    dense = authors_loop(torch.stack(taus), 30, 1e-3)
    torch.testing.assert_close(fast, dense, rtol=1e-9, atol=1e-12)
    # stored in float32, the same experts carry rounding noise: A is numerically full-rank in
    # float64, and the float32 iterations still find rank 6 (their own ε as tolerance)
    base = torch.randn(10, 16)
    experts = [(base.double() + t).float() for t in taus]
    _, d32 = wudi_merge_tensor(base, experts, steps=5)
    _, d64 = wudi_merge_tensor(base, experts, steps=5, dtype="float64")
    assert d32.rank == 6 and d64.rank > 6


def test_mean_start_scaling_and_determinism() -> None:
    taus = _task_vectors((6, 5), seed=2)
    base = torch.randn(6, 5, dtype=F64)
    experts = [base + t for t in taus]
    m_sum, d_sum = wudi_merge_tensor(base, experts, steps=1, lr=1e-12, dtype="float64")
    torch.testing.assert_close(m_sum, base + torch.stack(taus).sum(0), rtol=1e-9, atol=1e-9)
    m_mean, d_mean = wudi_merge_tensor(
        base, experts, steps=1, lr=1e-12, init="mean", dtype="float64"
    )
    torch.testing.assert_close(m_mean, base + torch.stack(taus).mean(0), rtol=1e-9, atol=1e-9)
    assert d_mean.initial_loss != pytest.approx(d_sum.initial_loss)
    m1, _ = wudi_merge_tensor(base, experts, steps=50, lr=1e-3)
    m2, _ = wudi_merge_tensor(base, experts, steps=50, lr=1e-3, scaling=0.5)
    torch.testing.assert_close(m2 - base, 0.5 * (m1 - base))
    b32, e32 = base.float(), [e.float() for e in experts]
    first, _ = wudi_merge_tensor(b32, e32, steps=50, lr=1e-3)
    again, _ = wudi_merge_tensor(b32, e32, steps=50, lr=1e-3)
    assert first.dtype == torch.float32
    assert first.numpy().tobytes() == again.numpy().tobytes()


def test_zero_task_vectors() -> None:
    base = torch.randn(4, 4, dtype=F64)
    taus = _task_vectors((4, 4))
    # a zero task vector has no term (no 0/0): the same result as without it
    with_zero, _ = wudi_merge_tensor(
        base, [base + taus[0], base + taus[1], base.clone()], steps=20, lr=1e-3
    )
    quadratic = interference_quadratic([taus[0], taus[1], torch.zeros(4, 4, dtype=F64)])
    assert quadratic.tasks == 2
    expected, _, _ = adam_minimise(quadratic, taus[0] + taus[1], steps=20, lr=1e-3, dtype=F64)
    torch.testing.assert_close(with_zero, base + expected.float().double(), rtol=1e-5, atol=1e-6)
    merged, d = wudi_merge_tensor(base, [base.clone(), base.clone()], steps=5)
    assert torch.equal(merged, base) and d.initial_loss == 0.0 and math.isnan(d.relative_reduction)


def test_bad_input_names_the_tensor() -> None:
    base = torch.zeros(3, 3)
    with pytest.raises(TensorError, match="at least two experts.*layers.0.q"):
        wudi_merge_tensor(base, [base + 1], name="layers.0.q")
    with pytest.raises(TensorError, match=r"shape mismatch for w: expert 2 has \(3, 2\)"):
        wudi_merge_tensor(base, [base, torch.zeros(3, 2)], name="w")
    bad = base.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(TensorError, match="w of expert 1 contains NaN"):
        wudi_merge_tensor(base, [bad, base], name="w")
    with pytest.raises(TensorError, match="needs a 2-D weight; b is 1-D"):
        wudi_merge_tensor(torch.zeros(3), [torch.ones(3), torch.ones(3)], name="b")


# ----------------------------------------------------------------------------- parameters


@pytest.mark.parametrize(
    "values, field, allowed",
    [
        ({"steps": 0}, "steps", "[1, 100000]"),
        ({"lr": 0.0}, "lr", "(0, 1]"),
        ({"lr": 5.0}, "lr", "(0, 1]"),
        ({"beta2": 1.0}, "beta2", "[0, 1)"),
        ({"init": "median"}, "init", "sum | mean"),
        ({"other_tensors": "zero"}, "other_tensors", "mean | base"),
        ({"scaling": float("nan")}, "scaling", ""),
    ],
)
def test_parameters_out_of_range_are_refused(values, field, allowed) -> None:
    info = ext_method_info("wudi")
    with pytest.raises(ConfigError, match=rf"^wudi: parameters\.{field} = ") as e:
        info.parse_parameters(values)
    assert allowed in str(e.value) and "fix it in the YAML" in str(e.value)


def test_parameter_defaults_are_the_authors() -> None:
    p = ext_method_info("wudi").parse_parameters({})
    assert (p.steps, p.lr, p.beta1, p.beta2, p.adam_eps, p.init) == (
        300,
        1e-5,
        0.9,
        0.999,
        1e-8,
        "sum",
    )
    assert (p.scaling, p.other_tensors, p.dtype) == (1.0, "mean", "float32")


# ----------------------------------------------------------------------------- mergekit side


def _group(name: str, base: torch.Tensor, experts, vocabulary_axis=None) -> TensorGroup:
    return TensorGroup.from_tensors(
        [base, *experts], base_index=0, name=name, vocabulary_axis=vocabulary_axis
    )


def test_kernel_records_diagnostics_and_treats_other_tensors_as_asked() -> None:
    info = ext_method_info("wudi")
    params = info.parse_parameters({"steps": 10, "lr": 1e-3})
    base = torch.randn(6, 4)
    experts = [base + 0.1 * torch.randn(6, 4) for _ in range(2)]
    kernel = wudi_merge.merge_group
    with merge_record.collecting() as recorder:
        merged = kernel(_group("layers.0.q.weight", base, experts), steps=10, lr=1e-3)
        emb = kernel(_group("embed_tokens.weight", base, experts, vocabulary_axis=0), steps=10)
        norm = kernel(_group("layers.0.norm.weight", base[0], [e[0] for e in experts]), steps=10)
    expected, d = wudi_merge_tensor(base, experts, steps=params.steps, lr=params.lr)
    torch.testing.assert_close(merged, expected)
    torch.testing.assert_close(emb, wudi_merge_simple(base, experts))
    torch.testing.assert_close(
        norm, base[0] + (experts[0][0] - base[0] + experts[1][0] - base[0]) / 2
    )
    recorded = recorder.sections["wudi"]["tensors"]
    assert list(recorded) == ["layers.0.q.weight"]
    assert recorded["layers.0.q.weight"]["final_loss"] == pytest.approx(d.final_loss)
    kept = wudi_merge_simple(base, experts, other_tensors="base")
    assert torch.equal(kept, base)


def test_summary_numbers() -> None:
    section = {
        "tensors": {
            "a": {
                "initial_loss": 4.0,
                "final_loss": 1.0,
                "relative_reduction": 0.75,
                "norm_ratio": 0.8,
            },
            "b": {
                "initial_loss": 4.0,
                "final_loss": 3.0,
                "relative_reduction": 0.25,
                "norm_ratio": 0.9,
            },
        }
    }
    s = summarize_wudi(section, ext_method_info("wudi").parse_parameters({"steps": 7}))
    assert s["linear weights optimised"] == 2 and s["Adam steps"] == 7
    assert s["median loss reduction"] == pytest.approx(0.5)
    assert s["total loss reduction"] == pytest.approx(0.5)
    assert s["least reduced weight"] == "b"


# ----------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("wudi_models")
    base = make_tiny_llama(str(root / "base"), seed=0)
    experts = make_experts(base, [str(root / f"e{i}") for i in range(3)], scale=0.05, seed=3)
    return base, experts


def _config(path, base, experts, parameters):
    cfg = {
        "merge_method": "wudi",
        "base_model": base,
        "models": [{"model": e} for e in experts],
        "parameters": parameters,
        "dtype": "float32",
    }
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_run_writes_a_loadable_checkpoint_card_section_and_plots(tiny, tmp_path) -> None:
    import transformers

    base, experts = tiny
    params = {"steps": 30, "lr": 1e-3}
    config = _config(tmp_path / "wudi.yml", base, experts, params)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["run", config, str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    merged = load_file(str(out / "model.safetensors"))
    base_sd = load_file(os.path.join(base, "model.safetensors"))
    expert_sds = [load_file(os.path.join(e, "model.safetensors")) for e in experts]
    assert set(merged) == set(base_sd)
    recorded = json.loads((out / "mergekit_ext_diagnostics.json").read_text())
    assert recorded["method"] == "wudi"
    tensors = recorded["sections"]["wudi"]["tensors"]
    n_linear = 0
    for name, w0 in base_sd.items():
        ws = [sd[name] for sd in expert_sds]
        if is_linear_weight(name, w0, None):
            n_linear += 1
            expected, d = wudi_merge_tensor(w0, ws, **params, name=name)
            assert tensors[name]["relative_reduction"] == pytest.approx(d.relative_reduction)
            assert tensors[name]["final_loss"] < tensors[name]["initial_loss"]
        else:
            expected = wudi_merge_simple(w0, ws, name=name)
            assert name not in tensors
        torch.testing.assert_close(merged[name], expected, rtol=1e-5, atol=1e-6)
    assert len(tensors) == n_linear > 0
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()
    card = (out / "README.md").read_text()
    assert "### WUDI" in card and "linear weights optimised" in card
    assert f"| {n_linear} |" in card
    for image in ("wudi_loss.png", "wudi_reduction.png"):
        assert f"(images/{image})" in card
        with Image.open(out / "images" / image) as im:
            assert im.format == "PNG" and im.size[0] > 200
    # same config, same bytes
    again = tmp_path / "again"
    assert CliRunner().invoke(main, ["run", config, str(again)]).exit_code == 0
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_run_refuses_out_of_range_parameters_before_writing(tiny, tmp_path) -> None:
    base, experts = tiny
    config = _config(tmp_path / "bad.yml", base, experts, {"steps": 0})
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["run", config, str(out)])
    assert result.exit_code == 1
    assert "wudi: parameters.steps = 0 is not valid" in result.output
    assert "[1, 100000]" in result.output
    assert not out.exists()
