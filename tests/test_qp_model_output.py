"""``qp_projection`` with ``objective: model_output``: each linear fitted to the model's output.

The design rows are checked against autograd Jacobians taken with respect to the QP
coefficients themselves (a toy network in float64, and the executor against a whole
transformers ViT), the solve against its objective, and the option end to end.
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
import torch
import transformers
import yaml
from click.testing import CliRunner
from mergekit.options import MergeOptions
from PIL import Image
from safetensors.torch import load_file

from mergekit_ext.calibration.sources import load_calibration
from mergekit_ext.cli import main
from mergekit_ext.config import parse_config
from mergekit_ext.errors import ConfigError, NotSupportedError
from mergekit_ext.executor import model_output_checks, run_layerwise_merge
from mergekit_ext.methods import qp_projection as qp
from mergekit_ext.methods.qp_model_output import (
    OutputNormalEquations,
    QPModelOutputFit,
    output_design,
)
from mergekit_ext.methods.registry import ext_method_info
from mergekit_ext.models.checkpoint import ModelSource
from mergekit_ext.testing import WORDS

OPTIONS = MergeOptions(quiet=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see conftest.py


# ------------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize(
    "parameters, words",
    [
        ({"objective": "model_output", "basis": "residual_eigen"}, "basis"),
        ({"objective": "model_output", "energy_floor": 0.5}, "energy_floor"),
        ({"objective": "model_output", "task_weighting": "energy"}, "task_weighting"),
        ({"objective": "model_output", "propagate": False}, "propagate"),
        ({"objective": "model_output", "diagnose_both_bases": True}, "diagnose_both_bases"),
        ({"output_sketch": 8}, "output_sketch"),
        ({"objective": "layer_output", "output_tokens": "all"}, "output_tokens"),
        ({"objective": "model_output", "output_sketch": -1}, "output_sketch"),
        ({"objective": "model_output", "output_tokens": "last"}, "output_tokens"),
        ({"objective": "model"}, "objective"),
    ],
)
def test_the_option_and_its_parameters_are_validated(parameters, words):
    with pytest.raises(ConfigError, match=words):
        qp.QPParameters.parse(parameters, "qp_projection")


def test_each_objective_has_its_own_parameters_and_implementation():
    """``objective`` chooses one of two implementations, each with its own parameter model; a
    parameter only the other objective reads is refused naming it and both objectives, and
    one given at its default (which changes nothing) is accepted."""
    layer = qp.QPParameters.parse({"basis": "residual_eigen"}, "qp_projection")
    model = qp.QPParameters.parse(
        {"objective": "model_output", "output_sketch": 4, "basis": "diagonal", "propagate": True},
        "qp_projection",
    )
    assert type(layer) is qp.QPLayerOutputParameters and layer.basis == "residual_eigen"
    assert type(model) is qp.QPModelOutputParameters and model.output_sketch == 4
    assert not hasattr(model, "basis") and not hasattr(layer, "output_sketch")
    method = ext_method_info("qp_projection").kind.method
    assert isinstance(method.implementation_for(layer), qp.QPLayerOutputMethod)
    assert isinstance(method.implementation_for(model), qp.QPModelOutputMethod)
    with pytest.raises(ConfigError, match=r"statistics_dtype = 'float32'.*objective: layer_output"):
        qp.QPParameters.parse(
            {"objective": "model_output", "statistics_dtype": "float32"}, "qp_projection"
        )
    with pytest.raises(ConfigError, match=r"output_seed = 3.*objective: model_output"):
        qp.QPParameters.parse({"output_seed": 3}, "qp_projection")


def test_model_output_defaults_and_request():
    method = ext_method_info("qp_projection").implementation
    default = method.parse({})
    assert default.objective == "layer_output"
    assert method.statistics_request(default).model_output is None
    request = method.statistics_request({"objective": "model_output", "output_sketch": 0})
    assert request.model_output is not None and request.model_output.sketch_rows == 0
    assert request.model_output.tokens == "first"
    assert not request.propagate and not request.expert_path


# ------------------------------------------------------------------------------------------
# The design against autograd (toy network, float64)


def _toy(seed: int = 0, k: int = 3, m: int = 5, width: int = 4, tokens: int = 3):
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(m, width, generator=gen, dtype=torch.float64)
    deltas = [0.3 * torch.randn(m, width, generator=gen, dtype=torch.float64) for _ in range(k)]
    head = torch.randn(6, m, generator=gen, dtype=torch.float64)
    x = torch.randn(2, tokens, width, generator=gen, dtype=torch.float64)  # [B, T, in]
    return w0, deltas, head, x


def _toy_output(weight, head, x):
    """A network after the linear: tanh, then a token mix and a head (output [B, 6])."""
    z = x @ weight.T  # [B, T, m]
    return torch.tanh(z).mean(1) @ head.T + (z[:, 0] ** 2) @ head.T


def _coefficient_jacobian(w0, deltas, head, x):
    """``∂f/∂d`` at d = 0 with ``W(d) = W_0 + Σ_k diag(d_k) Δ_k`` ([B, O, m·K], column r·K+k)."""
    m, k = w0.shape[0], len(deltas)

    def f(d_flat):
        d = d_flat.reshape(m, k)
        weight = w0 + sum(d[:, i : i + 1] * deltas[i] for i in range(k))
        return _toy_output(weight, head, x)

    return torch.autograd.functional.jacobian(f, torch.zeros(m * k, dtype=torch.float64))


def test_output_design_with_identity_sketch_equals_the_coefficient_jacobian():
    w0, deltas, head, x = _toy()
    eps = torch.zeros(x.shape[0], x.shape[1], w0.shape[0], dtype=torch.float64, requires_grad=True)
    out = _toy_output_from_z(x @ w0.T + eps, head)
    rows = torch.eye(out.shape[1], dtype=torch.float64)[:, None, :].expand(-1, out.shape[0], -1)
    grads = torch.stack(
        [torch.autograd.grad(out, eps, grad_outputs=r, retain_graph=True)[0] for r in rows]
    )
    projected = torch.stack([x @ d.T for d in deltas])
    design = output_design(grads, projected)  # [B, O, m·K]
    reference = _coefficient_jacobian(w0, deltas, head, x)
    assert design.shape == reference.shape
    torch.testing.assert_close(design, reference, rtol=0, atol=1e-10)


def _toy_output_from_z(z, head):
    return torch.tanh(z).mean(1) @ head.T + (z[:, 0] ** 2) @ head.T


def test_the_fit_minimises_the_linearised_output_objective():
    """``J(d) = Σ_j w ‖A_j d + b_j‖²`` from the sums equals the direct sum; d* beats d = 0
    (prior 0) and d = prior (prior 1), and the box holds."""
    w0, deltas, head, x = _toy(seed=3)
    experts = [(w0 + d).float() for d in deltas]
    jac = _coefficient_jacobian(w0, deltas, head, x)  # [B, O, mK]
    residual = torch.randn(jac.shape[:2], generator=torch.Generator().manual_seed(4)).double()
    for prior, bounds in ((0.0, None), (1.0, None), (0.0, (0.0, 1.0))):
        fit = QPModelOutputFit(
            "w", w0.float(), experts, ["a", "b", "c"], ridge=1e-3, prior=prior, bounds=bounds
        )
        fit.sums.add(jac, residual, 0.5)
        equations = fit.sums.equations(len(deltas))
        d = torch.randn(jac.shape[-1], dtype=torch.float64)
        direct = 0.5 * float(((jac @ d) + residual).pow(2).sum())
        assert qp.qp_objective(equations, d) == pytest.approx(direct, rel=1e-10)
        merged, diag = fit.solve()
        assert diag["objective"] == "model_output"
        if prior == 0.0:
            assert diag["J_opt"] < diag["J0"]
        else:
            assert diag["J_opt"] < diag["J_task_arithmetic"]["1"]
        if bounds is not None:
            for stats in diag["d_stats"].values():
                assert 0.0 <= stats["min"] and stats["max"] <= 1.0
        assert merged.shape == w0.shape and merged.dtype == torch.float32


def test_normal_equation_sums_check_their_inputs():
    sums = OutputNormalEquations(4)
    with pytest.raises(Exception, match="coefficients"):
        sums.add(torch.zeros(2, 3, 5), torch.zeros(2, 3), 1.0)
    with pytest.raises(Exception, match="weights"):
        sums.add(torch.zeros(2, 3, 4), torch.zeros(2, 3), 0.0)


# ------------------------------------------------------------------------------------------
# The executor's whole-model path


def _images(root, k: int, n: int = 4) -> str:
    folder = os.path.join(root, f"images{k}")
    os.makedirs(folder, exist_ok=True)
    rng = np.random.RandomState(k)
    for i in range(n):
        pixels = (rng.rand(20, 20, 3) * 255).astype("uint8")
        Image.fromarray(pixels).save(os.path.join(folder, f"{i}.png"))
    return folder


def _texts(root, k: int, n: int = 4) -> str:
    path = os.path.join(root, f"texts{k}.jsonl")
    rng = np.random.RandomState(k)
    with open(path, "w", encoding="utf-8") as fp:
        for _ in range(n):
            fp.write(
                json.dumps({"text": " ".join(rng.choice(WORDS, size=rng.randint(3, 9)))}) + "\n"
            )
    return path


def _config(tiny, data, parameters):
    models = [
        {"model": e, "name": f"task{i}", "calibration": {"path": d, "samples": 4, "batch_size": 2}}
        for i, (e, d) in enumerate(zip(tiny.experts, data))
    ]
    return parse_config(
        yaml.safe_dump(
            {
                "merge_method": "qp_projection",
                "base_model": tiny.base,
                "models": models,
                "parameters": parameters,
            }
        )
    )


def _merge(cfg, out):
    method = ext_method_info("qp_projection").implementation
    return run_layerwise_merge(cfg, str(out), OPTIONS, method, cfg.parameters)


def _sha(folder) -> str:
    with open(os.path.join(folder, "model.safetensors"), "rb") as fp:
        return hashlib.sha256(fp.read()).hexdigest()


@pytest.fixture(scope="module")
def vit_data(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("qp_mo_images"))
    return [_images(root, k) for k in range(3)]


def test_executor_design_equals_a_whole_model_jacobian(
    tiny_vit_set, vit_data, tmp_path, recorded_fits
):
    """Exact sketch (identity), first linear: the executor's sums N, h, e equal those formed
    from ``torch.func.jacrev`` of the whole transformers ViT with respect to the coefficients
    (non-linear tensors at the experts' mean, the fallback; linears at the base)."""
    cfg = _config(tiny_vit_set, vit_data, {"objective": "model_output", "output_sketch": 0})
    result = _merge(cfg, tmp_path / "out")
    first = recorded_fits[0]
    assert first.name == "vit.encoder.layer.0.attention.attention.query.weight"

    cls = transformers.ViTForImageClassification
    base = cls.from_pretrained(tiny_vit_set.base).eval().vit
    experts = [cls.from_pretrained(e).eval().vit for e in tiny_vit_set.experts]
    linears = [n for n, mod in base.named_modules() if isinstance(mod, torch.nn.Linear)]
    states = [e.state_dict() for e in experts]
    params = {
        name: tensor
        if name.removesuffix(".weight") in linears or not tensor.is_floating_point()
        else torch.stack([s[name] for s in states]).mean(0)  # the fallback: experts' mean
        for name, tensor in base.state_dict().items()
    }
    key = linears[0] + ".weight"  # block 0's query, the first linear of the family's order
    w0 = params[key].double()
    deltas = [s[key].double() - w0 for s in states]
    m, k = w0.shape[0], len(deltas)

    def output(weight: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
        local = {**params, key: weight.float()}
        out = torch.func.functional_call(base, local, args=(), kwargs={"pixel_values": pixels})
        return out.last_hidden_state[:, 0].double()

    def output_of_coefficients(d_flat: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
        d = d_flat.reshape(m, k)  # column r·K + k is d[r, k]
        return output(w0 + sum(d[:, i : i + 1] * deltas[i] for i in range(k)), pixels)

    normal = torch.zeros(m * k, m * k, dtype=torch.float64)
    rhs = torch.zeros(m * k, dtype=torch.float64)
    energy = 0.0
    for t, entry in enumerate(cfg.models):
        data = load_calibration(
            cfg.calibration_for(entry), entry.model, task=entry.name, modality="image"
        )
        pixels = torch.cat([b["pixel_values"] for b in data.batches])
        with torch.no_grad():
            target = experts[t](pixel_values=pixels).last_hidden_state[:, 0].double()
            b = output(w0, pixels) - target
        jac = torch.func.jacrev(output_of_coefficients)(torch.zeros(m * k).double(), pixels)
        weight = 1.0 / pixels.shape[0]
        normal += weight * torch.einsum("bor,bos->rs", jac, jac)
        rhs -= weight * torch.einsum("bor,bo->r", jac, b)
        energy += weight * float(b.pow(2).sum())
    scale = float(normal.abs().max())
    torch.testing.assert_close(first.sums.normal, normal, rtol=0, atol=1e-5 * scale)
    torch.testing.assert_close(first.sums.rhs, rhs, rtol=0, atol=1e-5 * float(rhs.abs().max()))
    assert float(first.sums.energy) == pytest.approx(energy, rel=1e-6)
    record = result.diagnostics["layers"][0]["weights"][first.name]
    assert record["output_error_before"] == pytest.approx(energy, rel=1e-6)
    assert result.diagnostics["model_output"]["output_error_initial"] == pytest.approx(
        energy, rel=1e-6
    )


def test_the_solve_lowers_the_linearised_error_of_every_linear(tiny_vit_set, vit_data, tmp_path):
    """Prior 0: J(d*) <= J(0) (the linear at the base); the default prior 1: J(d*) <= J(1)."""
    for prior in (0.0, 1.0):
        cfg = _config(
            tiny_vit_set,
            vit_data,
            {"objective": "model_output", "prior": prior, "output_sketch": 4},
        )
        result = _merge(cfg, tmp_path / f"prior{prior}")
        assert len(result.diagnostics["layers"]) == 12  # 2 blocks x 6 linears, one at a time
        for layer in result.diagnostics["layers"]:
            (record,) = layer["weights"].values()
            assert record["objective"] == "model_output"
            reference = record["J0"] if prior == 0.0 else record["J_task_arithmetic"]["1"]
            assert record["J_opt"] <= reference * (1 + 1e-9)
        assert result.diagnostics["model_output"]["output_sketch"] == 4


def test_default_objective_is_unchanged_and_model_output_is_deterministic(
    tiny_vit_set, vit_data, tmp_path
):
    default = _config(tiny_vit_set, vit_data, {})
    explicit = _config(tiny_vit_set, vit_data, {"objective": "layer_output"})
    _merge(default, tmp_path / "default")
    _merge(explicit, tmp_path / "explicit")
    assert _sha(tmp_path / "default") == _sha(tmp_path / "explicit")

    shas = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        cfg = _config(
            tiny_vit_set,
            vit_data,
            {"objective": "model_output", "output_sketch": 3, "output_seed": seed},
        )
        _merge(cfg, tmp_path / name)
        shas.append(_sha(tmp_path / name))
    assert shas[0] == shas[1], "same config and seed: same bytes"
    assert shas[0] != shas[2], "another sketch seed: another merge"
    assert shas[0] != _sha(tmp_path / "default")


def test_causal_lm_and_too_little_memory_are_refused_before_any_weight_loads(
    tiny_llama_set, tiny_vit_set, vit_data, tmp_path, monkeypatch
):
    def no_weights(*args, **kwargs):
        raise AssertionError("a weight was loaded")

    monkeypatch.setattr(ModelSource, "load", no_weights)
    texts = [_texts(str(tmp_path), k) for k in range(3)]
    cfg = _config(tiny_llama_set, texts, {"objective": "model_output", "output_sketch": 0})
    with pytest.raises(NotSupportedError, match="output_sketch: 0.*causal language models"):
        _merge(cfg, tmp_path / "llama")
    assert isinstance(NotSupportedError("x"), NotImplementedError)

    monkeypatch.setattr(model_output_checks, "available_memory_bytes", lambda device: 1000)
    cfg = _config(tiny_vit_set, vit_data, {"objective": "model_output"})
    with pytest.raises(model_output_checks.ModelOutputMemoryError, match=r"merged_model .*GiB"):
        _merge(cfg, tmp_path / "vit")


def test_mergekit_ext_run_with_model_output_on_bert(tiny_bert_set, tmp_path):
    """The CLI end to end: a checkpoint transformers loads, the objective in the
    diagnostics and on the card."""
    config = {
        "merge_method": "qp_projection",
        "base_model": tiny_bert_set.base,
        "models": [
            {"model": e, "calibration": {"path": _texts(str(tmp_path), k), "field": "text"}}
            for k, e in enumerate(tiny_bert_set.experts)
        ],
        "calibration": {"samples": 4, "max_length": 16, "batch_size": 2},
        "parameters": {"objective": "model_output", "output_tokens": "all", "bounds": [0, 1]},
        "dtype": "float32",
    }
    (tmp_path / "c.yml").write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    dry = CliRunner().invoke(
        main, ["run", str(tmp_path / "c.yml"), str(out), "--dry-run"], catch_exceptions=False
    )
    assert dry.exit_code == 0, dry.output
    assert "objective: model output" in dry.output and "merged_model" in dry.output
    result = CliRunner().invoke(
        main, ["run", str(tmp_path / "c.yml"), str(out)], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    merged = load_file(str(out / "model.safetensors"))
    assert set(merged) == set(load_file(os.path.join(tiny_bert_set.base, "model.safetensors")))
    diag = json.loads((out / "mergekit_ext_diagnostics.json").read_text())
    section = diag["sections"]["qp_projection"]
    assert section["model_output"]["output_tokens"] == "all"
    assert len(section["layers"]) == 12
    for layer in section["layers"]:
        for record in layer["weights"].values():
            assert record["objective"] == "model_output"
            assert all(0.0 <= s["min"] and s["max"] <= 1.0 for s in record["d_stats"].values())
    card = (out / "README.md").read_text()
    assert "model_output" in card
    model = transformers.BertModel.from_pretrained(str(out))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_fit_that_leaves_the_experts_is_reported(caplog):
    """Few rows, a large residual: unbounded coefficients far beyond 1 get a warning naming
    the linear and the remedy; with bounds [0, 1] they stay in the box, without a warning."""
    base = torch.zeros(2, 3)
    experts = [torch.ones(2, 3), -torch.ones(2, 3)]
    for bounds in (None, (0.0, 1.0)):
        fit = QPModelOutputFit("w", base, experts, ["a", "b"], ridge=1.0, prior=0.0, bounds=bounds)
        fit.add_batch(torch.ones(1, 1, 3), torch.ones(1, 1, 1, 2), torch.full((1, 1), 1e3), 1.0)
        caplog.clear()
        with caplog.at_level("WARNING", logger="mergekit_ext.methods.qp_model_output"):
            _, record = fit.solve()
        extremes = [abs(v) for s in record["d_stats"].values() for v in (s["min"], s["max"])]
        if bounds is None:
            assert max(extremes) > 10
            assert "w: model-output coefficients up to" in caplog.text
            assert "bounds: [0, 1]" in caplog.text
        else:
            assert max(extremes) <= 1.0 and not caplog.text
