"""Data-aware merging across the model types the community merges (docs/coverage.md).

Tiny random checkpoints (hidden 64, 2 layers; :mod:`tiny_architectures`) of each model
type, a base and two perturbed experts, merged with ``regmean``, ``chain_of_merges`` and
``qp_projection`` (layer objective) through the sequential executor, whose blocks and linear
groups are discovered from the model (no family file). Each supported type: the merge loads
with transformers and gives finite outputs; each refused type: the plan refuses it, before
any weight loads, naming the reason and what works instead. For gemma2, phi3, gpt2 and bert,
RegMean equals a whole-model closed-form reference.

``EXPECTED`` is the coverage table: docs/coverage.md is generated from it
(``python tests/tiny_architectures.py``), and :func:`test_coverage_doc_is_current` fails
when the two differ, so the published table is the one these tests check.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import numpy as np
import pytest
import tiny_architectures
import torch
import transformers
import yaml
from mergekit.options import MergeOptions
from PIL import Image
from safetensors.torch import load_file

from mergekit_ext import testing
from mergekit_ext.calibration.sources import load_calibration
from mergekit_ext.config import parse_config
from mergekit_ext.errors import ModelInputError
from mergekit_ext.executor import plan_layerwise_merge, run_layerwise_merge
from mergekit_ext.methods.registry import ext_method_info
from mergekit_ext.models.checkpoint import ModelSource
from mergekit_ext.models.families.discovery import is_linear_like, is_transposed_linear

EXPECTED = tiny_architectures.EXPECTED
METHODS = tiny_architectures.METHODS
SAMPLES = 12  # text samples per task: > 64 tokens per task (widest input: 128, 2 tasks)
OPTIONS = MergeOptions(quiet=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see conftest.py


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("architectures"))


@pytest.fixture(scope="module")
def data(root) -> dict[str, list[str]]:
    """Calibration data per modality: one file (folder) per task."""
    rng = np.random.RandomState(0)
    out: dict[str, list[str]] = {"text": [], "image": []}
    for k in range(2):
        path = os.path.join(root, f"text{k}.jsonl")
        with open(path, "w", encoding="utf-8") as fp:
            for _ in range(SAMPLES):
                words = rng.choice(testing.WORDS, size=rng.randint(8, 14))
                fp.write(json.dumps({"text": " ".join(words)}) + "\n")
        out["text"].append(path)
        folder = os.path.join(root, f"images{k}")
        os.makedirs(folder)
        for i in range(4):
            pixels = (rng.rand(16, 16, 3) * 255).astype("uint8")
            Image.fromarray(pixels).save(os.path.join(folder, f"{i}.png"))
        out["image"].append(folder)
    return out


_BUILT: dict[str, tuple[str, list[str]]] = {}


@pytest.fixture(scope="module")
def checkpoints(root):
    """``checkpoints(model_type)`` -> (base, [expert0, expert1]), built once per module."""
    _BUILT.clear()

    def get(model_type: str) -> tuple[str, list[str]]:
        if model_type not in _BUILT:
            folder = os.path.join(root, model_type)
            base = tiny_architectures.build(model_type, os.path.join(folder, "base"))
            experts = testing.make_experts(
                base, [os.path.join(folder, f"expert{i}") for i in range(2)]
            )
            _BUILT[model_type] = (base, list(experts))
        return _BUILT[model_type]

    yield get
    _BUILT.clear()


def _config(method: str, base: str, experts: list[str], data: list[str], **params: Any):
    samples = SAMPLES if data[0].endswith(".jsonl") else 4
    models = [
        {"model": e, "name": f"task{k}", "calibration": {"path": d, "samples": samples}}
        for k, (e, d) in enumerate(zip(experts, data))
    ]
    merge = {"merge_method": method, "base_model": base, "models": models}
    # This test checks structure (what merges, loads and runs), not quality: its experts are
    # random task vectors 2.5x the initialisation's scale on random tiny models, on which
    # Chain of Merges leaves the experts' range on a few types (10-19x their norm) and the
    # result guard would stop it. The guard has its own tests (test_low_diversity_calibration).
    if params.get("objective") != "model_output":
        params.setdefault("max_norm_ratio", float("inf"))
    if params:
        merge["parameters"] = params
    return parse_config(yaml.safe_dump(merge))


def _method(name: str):
    info = ext_method_info(name)
    assert info is not None
    return info.implementation


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("model_type", list(EXPECTED))
def test_merges_or_refuses(model_type, method, checkpoints, data, tmp_path, monkeypatch):
    arch = tiny_architectures.ARCHITECTURES[model_type]
    base, experts = checkpoints(model_type)
    cfg = _config(method, base, experts, data[arch.modality])
    refusal = EXPECTED[model_type]
    if refusal is not None:

        def no_weights(*args, **kwargs):  # pragma: no cover - the refusal comes first
            raise AssertionError("a weight was read before the refusal")

        monkeypatch.setattr(ModelSource, "load", no_weights)
        with pytest.raises(ModelInputError, match=refusal) as raised:
            plan_layerwise_merge(cfg, OPTIONS, _method(method), cfg.parameters)
        assert all(f"{m}" in str(raised.value) for m in ("ties", "ace", "symerge"))
        return
    out = str(tmp_path / "out")
    result = run_layerwise_merge(cfg, out, OPTIONS, _method(method), cfg.parameters)
    assert result.diagnostics["layers"], "no linear group was merged with data"
    model = getattr(transformers, arch.model_class).from_pretrained(out, dtype=torch.float32)
    # every tensor of the base is written, none left at random initialisation
    merged = load_file(os.path.join(out, "model.safetensors"))
    assert set(merged) == set(load_file(os.path.join(base, "model.safetensors")))
    batch = load_calibration(
        cfg.calibration_for(cfg.models[0]), base, task="task0", modality=arch.modality
    ).batches[0]
    with torch.no_grad():
        assert torch.isfinite(tiny_architectures.outputs(model.eval(), batch)).all()


# ------------------------------------------------------------------------------------------
# RegMean against a whole-model closed form


# The executor forms its Gram products in float32 from float32 activations: the system it
# solves is known to about float32's relative precision ε, whatever CPU rounds it.
EPS32 = torch.finfo(torch.float32).eps


def _solve_error(got: torch.Tensor, expected: torch.Tensor, system: torch.Tensor):
    """The relative data-norm error ``‖(W − W_ref) G^½‖ / ‖W_ref G^½‖`` of a merged weight
    (the error of the merged linear's outputs on the calibration inputs), and the tolerance
    the system's conditioning allows it: ``κ·ε``, κ = λmax / λmin over the eigenvalues of ``G``
    that the (pseudo-)inverse keeps (``torch.linalg.pinv``'s cut-off, n·ε64·λmax; all of them
    for a nonsingular system).

    A solve amplifies the system's relative error by up to κ (the standard forward bound),
    so how the directions the data barely spans come out depends on the CPU's rounding: a
    fixed 1e-4 held on the CPU it was set on, while ridge 0 Mixtral down_projs gave 2.6e-4
    (κ 1.5e4) on an AMD EPYC with AVX2 and 2.0e-3 (κ 7.7e5) on another CPU (issue #47).
    Measured: at most 0.15·κ·ε, under four kernel settings of the AMD machine (torch's
    AVX2 and default kernels, MKL's default and COMPATIBLE branches); on well-conditioned
    linears (κ ~ 50: 6e-6) that is tighter than the 1e-4 it replaces. Routing weights
    applied unsquared give 29-505·κ·ε (:func:`test_regmean_mixtral_equals_per_expert_reference`).
    """
    delta = got.detach().double() - expected
    error = torch.trace(delta @ system @ delta.T) / torch.trace(expected @ system @ expected.T)
    eigenvalues = torch.linalg.eigvalsh(system).abs()
    kept = eigenvalues[
        eigenvalues > system.shape[0] * torch.finfo(system.dtype).eps * eigenvalues.max()
    ]
    return float(error) ** 0.5, float(kept.max() / kept.min()) * EPS32


def _block_linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every linear-like module inside the model's block list (whole-model module names)."""
    out = {}
    for name, module in model.named_modules():
        if is_linear_like(module) and any(
            f".{part}." in f".{name}." for part in ("layers", "layer", "h")
        ):
            out[name] = module
    return out


def _input_grams(model, modules, batches) -> dict[str, torch.Tensor]:
    """``(1/N) Σ x xᵀ`` of each module's input over the non-padding tokens, float64.

    A call on a table instead of the tokens (DeBERTa-v3's ``query_proj``/``key_proj`` on the
    relative position embeddings ``[1, R, D]``) adds every row of it, once per forward call,
    and its rows count in ``N`` (docs/methods.md, "Relative position tables")."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    mask: list[Any] = [None]

    def hook(name):
        def fn(module, args):
            x = args[0].double()
            if mask[0] is None:
                rows = x.reshape(-1, x.shape[-1])
            elif x.dim() == 2:  # a MoE router reads the tokens flattened to [B·T, D]
                rows = x[mask[0].reshape(-1).bool()]
            elif tuple(x.shape[:2]) != tuple(mask[0].shape):  # a table: all of its rows
                rows = x.reshape(-1, x.shape[-1])
            else:
                rows = x[mask[0].bool()]
            sums[name] = sums.get(name, 0) + rows.T @ rows
            counts[name] = counts.get(name, 0) + rows.shape[0]

        return fn

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in modules.items()]
    try:
        with torch.no_grad():
            for batch in batches:
                mask[0] = batch.get("attention_mask")
                if "pixel_values" in batch:
                    model(pixel_values=batch["pixel_values"])
                else:
                    model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    finally:
        for h in handles:
            h.remove()
    return {n: sums[n] / counts[n] for n in modules}


@pytest.mark.parametrize("model_type", ["gemma2", "phi3", "gpt2", "bert", "deberta-v2"])
def test_regmean_equals_whole_model_reference(model_type, checkpoints, data, tmp_path):
    """Per linear: ``W = (Σ_k W_k G_k)(Σ_k G_k)⁻¹`` with ``G_k`` from expert k's own forward
    passes (hooks on each whole expert model), to κ·ε in the relative data-norm error
    ``‖(W − W_ref) G^½‖ / ‖W_ref G^½‖`` with ``G = Σ_k G_k`` (:func:`_solve_error`)."""
    arch = tiny_architectures.ARCHITECTURES[model_type]
    base, experts = checkpoints(model_type)
    cfg = _config("regmean", base, experts, data[arch.modality], ridge=0.0)
    out = str(tmp_path / "out")
    run_layerwise_merge(cfg, out, OPTIONS, _method("regmean"), cfg.parameters)
    merged = getattr(transformers, arch.model_class).from_pretrained(out, dtype=torch.float32)
    merged_linears = _block_linears(merged)
    assert len(merged_linears) >= 8
    cls = getattr(transformers, arch.model_class)
    weights, grams = [], []
    for k, path in enumerate(experts):
        model = cls.from_pretrained(path, dtype=torch.float32).eval()
        batches = load_calibration(
            cfg.calibration_for(cfg.models[k]), path, task=f"task{k}", modality=arch.modality
        ).batches
        linears = _block_linears(model)
        grams.append(_input_grams(model, linears, batches))
        # out x in: a Conv1D stores its weight in x out
        weights.append(
            {
                n: (m.weight.T if is_transposed_linear(m) else m.weight).double()
                for n, m in linears.items()
            }
        )
    worst = 0.0
    for name, module in merged_linears.items():
        system = sum(g[name] for g in grams)
        rhs = sum(w[name] @ g[name] for w, g in zip(weights, grams))
        expected = torch.linalg.solve(system, rhs.T).T
        got = module.weight.T if is_transposed_linear(module) else module.weight
        error, tolerance = _solve_error(got, expected, system)
        worst = max(worst, error / tolerance)
        assert error <= tolerance, (
            f"{model_type} {name}: relative data-norm error {error:.2e} > κ·ε = {tolerance:.2e}"
        )
    print(f"{model_type}: worst relative data-norm error {worst:.3f} κ·ε")


def test_coverage_doc_is_current():
    """docs/coverage.md is the table these tests check (regenerate it with
    ``python tests/tiny_architectures.py``)."""
    path = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "coverage.md")
    with open(path, encoding="utf-8") as fp:
        assert fp.read() == tiny_architectures.coverage_markdown(), (
            "docs/coverage.md is out of date: run `python tests/tiny_architectures.py`"
        )


@pytest.mark.parametrize("model_type", ["phi3", "gpt2"])
def test_dry_run_from_config_json_alone(model_type, checkpoints, data, tmp_path):
    """A folder with config.json and the tokenizer only: the plan discovers the same blocks
    and groups from the class and estimates memory from the config's shapes."""
    import shutil

    base, experts = checkpoints(model_type)
    folders = []
    for i, source in enumerate([base, *experts]):
        folder = tmp_path / f"m{i}"
        folder.mkdir()
        for f in os.listdir(source):
            if not f.endswith(".safetensors"):
                shutil.copy(os.path.join(source, f), folder / f)
        folders.append(str(folder))
    method = _method("chain_of_merges")
    full = plan_layerwise_merge(
        _config("chain_of_merges", base, experts, data["text"]), OPTIONS, method, {}
    )
    weightless = plan_layerwise_merge(
        _config("chain_of_merges", folders[0], folders[1:], data["text"]), OPTIONS, method, {}
    )
    assert weightless.weightless and not full.weightless
    assert [b.groups for b in weightless.blocks] == [b.groups for b in full.blocks]
    assert weightless.memory == full.memory
    text = weightless.describe()
    expected = {
        "phi3": "qkv_proj: self_attn.qkv_proj",
        "gpt2": "c_attn: attn.c_attn",
    }[model_type]
    assert expected in text and "blocks: 2" in text


def test_model_output_objective_on_conv1d_weights(checkpoints, data, tmp_path):
    """QP's model-output fit on GPT-2: each Conv1D weight is fitted as ``out x in`` and
    written back as stored; the merge loads, its KL to the experts falls, and it differs from
    the base in every fitted weight."""
    base, experts = checkpoints("gpt2")
    cfg = _config(
        "qp_projection",
        base,
        experts,
        data["text"],
        objective="model_output",
        output_sketch=2,
        prior=0.0,
    )
    out = str(tmp_path / "out")
    result = run_layerwise_merge(cfg, out, OPTIONS, _method("qp_projection"), cfg.parameters)
    summary = result.diagnostics["model_output"]
    assert summary["output_error_final"] < summary["output_error_initial"]
    merged = load_file(os.path.join(out, "model.safetensors"))
    original = load_file(os.path.join(base, "model.safetensors"))
    name = "transformer.h.1.attn.c_attn.weight"
    assert merged[name].shape == original[name].shape == (64, 192)
    assert not torch.equal(merged[name], original[name])
    model = transformers.GPT2LMHeadModel.from_pretrained(out, dtype=torch.float32).eval()
    batch = load_calibration(
        cfg.calibration_for(cfg.models[0]), base, task="task0", modality="text"
    ).batches[0]
    with torch.no_grad():
        assert torch.isfinite(tiny_architectures.outputs(model, batch)).all()


def test_model_types_of_one_structure_plan_together(checkpoints, data):
    """A Mistral expert of a Llama base (the runner allows it with --allow-crimes) walks
    alike: the executor compares the discovered structures, not the model type names; a
    BERT expert of a Llama base is refused, naming both."""
    llama, _ = checkpoints("llama")
    _, mistral = checkpoints("mistral")
    _, bert = checkpoints("bert")
    method = _method("regmean")
    plan = plan_layerwise_merge(
        _config("regmean", llama, mistral, data["text"]), OPTIONS, method, {}
    )
    assert [g.label for g in plan.blocks[0].groups] == ["qkv", "o_proj", "gate_up", "down_proj"]
    with pytest.raises(ModelInputError, match=r"'bert' model \(bert family\) but the base model"):
        plan_layerwise_merge(_config("regmean", llama, bert, data["text"]), OPTIONS, method, {})


def test_lora_experts_on_conv1d_equal_premerged_checkpoints(checkpoints, data, tmp_path):
    """PEFT LoRA adapters on GPT-2's Conv1D layers (``fan_in_fan_out``), applied block by block,
    merge as the same experts saved as full checkpoints."""
    import tiny_models

    base, _ = checkpoints("gpt2")
    adapters, full = tiny_models.make_lora_experts(
        base,
        str(tmp_path),
        transformers.GPT2LMHeadModel,
        ["c_attn", "c_proj", "c_fc"],
        fan_in_fan_out=True,
    )
    outputs = {}
    for label, experts in {"plus": [f"{base}+{a}" for a in adapters], "full": full}.items():
        cfg = _config("chain_of_merges", base, experts, data["text"])
        out = str(tmp_path / label)
        run_layerwise_merge(cfg, out, OPTIONS, _method("chain_of_merges"), cfg.parameters)
        outputs[label] = load_file(os.path.join(out, "model.safetensors"))
    assert set(outputs["plus"]) == set(outputs["full"])
    for name, tensor in outputs["full"].items():
        torch.testing.assert_close(outputs["plus"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    original = load_file(os.path.join(base, "model.safetensors"))
    name = "transformer.h.1.mlp.c_fc.weight"
    assert not torch.allclose(outputs["plus"][name], original[name])


# ------------------------------------------------------------------------------------------
# Mixture-of-experts: per-expert RegMean against a whole-model closed form


def _routed_grams(model, batches, power: int = 2) -> dict[tuple[int, int, str], torch.Tensor]:
    """Per (block, expert, "gate_up" | "down"): ``(1/N) Σ r² x xᵀ`` over the tokens the
    model's own router sends to the expert (N: the task's non-padding tokens), from a forward
    hook on each block's experts module; the intermediate rows ``silu(gate x) * up x`` by hand.
    ``power``: the routing weight's exponent (1: the wrong statistics the test must reject)."""
    sums: dict[tuple[int, int, str], torch.Tensor] = {}
    tokens = [0]
    mask: list[Any] = [None]

    def hook(block):
        def fn(module, args):
            hidden, index, weights = (a.double() for a in args[:3])
            index = index.long()
            keep = mask[0].reshape(-1).bool()
            hidden, index, weights = hidden[keep], index[keep], weights[keep] ** (power / 2)
            for e in range(module.gate_up_proj.shape[0]):
                token, slot = torch.where(index == e)
                x, r = hidden[token], weights[token, slot][:, None]
                g, u = (x @ module.gate_up_proj[e].double().T).chunk(2, dim=-1)
                h = torch.nn.functional.silu(g) * u
                for part, rows in (("gate_up", x), ("down", h)):
                    key = (block, e, part)
                    sums[key] = sums.get(key, 0) + (r * rows).T @ (r * rows)

        return fn

    handles = [
        layer.mlp.experts.register_forward_pre_hook(hook(i))
        for i, layer in enumerate(model.model.layers)
    ]
    try:
        with torch.no_grad():
            for batch in batches:
                mask[0] = batch["attention_mask"]
                tokens[0] += int(batch["attention_mask"].sum())
                model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    finally:
        for h in handles:
            h.remove()
    return {k: v / tokens[0] for k, v in sums.items()}


def test_regmean_mixtral_equals_per_expert_reference(checkpoints, data, tmp_path):
    """Each routed expert's ``gate_up`` and ``down``: ``(Σ_k W_k G_k)(Σ_k G_k)⁺`` with
    ``G_k`` from the tokens expert model k's own router sends to it, rows weighted by the
    squared routing weight; to κ·ε in the relative data-norm error (:func:`_solve_error`: a
    down_proj sees fewer routed tokens than its 128 inputs, so its system is singular and
    the directions it barely spans depend on the CPU's rounding). The same comparison with
    rows weighted by the routing weight itself (not squared) fails on every gate_up, by
    ~30-500 κ·ε (a down_proj with fewer routed tokens than inputs fits each of them exactly
    whatever the rows' weights, so no weighting shows there). The router is an ordinary
    linear group (the same closed form on the block's normed input)."""
    arch = tiny_architectures.ARCHITECTURES["mixtral"]
    base, experts = checkpoints("mixtral")
    # ridge 0: the exact solve; a down_proj (128 inputs) of an expert sees fewer routed
    # tokens than inputs here, so its pseudo-inverse solve may leave the experts' norm range
    # in the unseen directions (the guard's business, not this comparison's)
    cfg = _config("regmean", base, experts, data["text"], ridge=0.0, max_norm_ratio=float("inf"))
    out = str(tmp_path / "out")
    result = run_layerwise_merge(cfg, out, OPTIONS, _method("regmean"), cfg.parameters)
    cls = getattr(transformers, arch.model_class)
    merged = cls.from_pretrained(out, dtype=torch.float32)
    grams, weights = [], []
    router_grams, unsquared = [], []
    for k, path in enumerate(experts):
        model = cls.from_pretrained(path, dtype=torch.float32).eval()
        batches = load_calibration(
            cfg.calibration_for(cfg.models[k]), path, task=f"task{k}", modality="text"
        ).batches
        grams.append(_routed_grams(model, batches))
        unsquared.append(_routed_grams(model, batches, power=1))
        routers = {
            f"model.layers.{i}.mlp.gate": layer.mlp.gate
            for i, layer in enumerate(model.model.layers)
        }
        router_grams.append(_input_grams(model, routers, batches))
        weights.append(
            {
                **{
                    (i, e, part): getattr(layer.mlp.experts, f"{part}_proj")[e].detach().double()
                    for i, layer in enumerate(model.model.layers)
                    for e in range(layer.mlp.experts.gate_up_proj.shape[0])
                    for part in ("gate_up", "down")
                },
                **{n: m.weight.detach().double() for n, m in routers.items()},
            }
        )
    assert set(grams[0]) == set(grams[1]) and len(grams[0]) == 2 * 2 * 4  # every expert reached

    def error(got, key, task_grams):
        system = sum(g[key] for g in task_grams)
        expected = sum(w[key] @ g[key] for w, g in zip(weights, task_grams)) @ torch.linalg.pinv(
            system, hermitian=True
        )
        return _solve_error(got, expected, system)

    worst, nearest_wrong = 0.0, float("inf")
    for i, layer in enumerate(merged.model.layers):
        for e in range(layer.mlp.experts.gate_up_proj.shape[0]):
            for part in ("gate_up", "down"):
                got = getattr(layer.mlp.experts, f"{part}_proj")[e]
                err, tol = error(got, (i, e, part), grams)
                worst = max(worst, err / tol)
                assert err <= tol, f"layer {i} expert {e} {part}: {err:.2e} > κ·ε = {tol:.2e}"
                if part == "gate_up":  # a bug in the routed statistics fails by far
                    wrong, wrong_tol = error(got, (i, e, part), unsquared)
                    nearest_wrong = min(nearest_wrong, wrong / wrong_tol)
        name = f"model.layers.{i}.mlp.gate"
        err, tol = error(layer.mlp.gate.weight, name, router_grams)
        assert err <= tol, f"{name}: {err:.2e} > κ·ε = {tol:.2e}"
    print(
        f"mixtral: worst error {worst:.3f} κ·ε; unsquared routing weights {nearest_wrong:.0f} κ·ε"
    )
    assert nearest_wrong > 10.0
    assert result.diagnostics["moe"]["experts_without_tokens"] == {
        i: {"module": "mlp.experts", "count": 0, "experts": []} for i in range(2)
    }
    records = [r for r in result.diagnostics["layers"] if r.get("group") == "experts"]
    assert len(records) == 2 * 4 * 2 and all(r["tokens"] > 0 for r in records)


def test_expert_without_routed_tokens_takes_the_fallback(checkpoints, data, tmp_path):
    """DeepSeek-V3: a routing bias of -1e4 on expert 3 of block 1 (in the base and in both
    experts) keeps every token from it; it takes the fallback (the experts' mean), and the
    diagnostics count it for that block; the other experts are solved."""
    from safetensors.torch import save_file

    arch = tiny_architectures.ARCHITECTURES["deepseek_v3"]
    base, experts = checkpoints("deepseek_v3")
    folders = []
    for i, source in enumerate([base, *experts]):
        folder = tmp_path / f"m{i}"
        shutil.copytree(source, folder)
        tensors = load_file(str(folder / "model.safetensors"))
        tensors["model.layers.1.mlp.gate.e_score_correction_bias"][3] = -1e4
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        folders.append(str(folder))
    cfg = _config("regmean", folders[0], folders[1:], data["text"], fallback="mean")
    out = str(tmp_path / "out")
    result = run_layerwise_merge(cfg, out, OPTIONS, _method("regmean"), cfg.parameters)
    assert result.diagnostics["moe"]["experts_without_tokens"] == {
        1: {"module": "mlp.experts", "count": 1, "experts": [3]}
    }
    merged = load_file(os.path.join(out, "model.safetensors"))
    inputs = [load_file(os.path.join(f, "model.safetensors")) for f in folders[1:]]
    for part in ("gate_proj", "up_proj", "down_proj"):
        key = f"model.layers.1.mlp.experts.3.{part}.weight"
        mean = (inputs[0][key] + inputs[1][key]) / 2
        assert torch.allclose(merged[key], mean, atol=1e-6), key
        solved = f"model.layers.1.mlp.experts.0.{part}.weight"
        assert not torch.allclose(
            merged[solved], (inputs[0][solved] + inputs[1][solved]) / 2, atol=1e-4
        )
    solved_experts = {
        r["expert"] for r in result.diagnostics["layers"] if r.get("group") == "experts"
    }
    assert solved_experts == {0, 1, 2}
    model = getattr(transformers, arch.model_class).from_pretrained(out, dtype=torch.float32)
    batch = load_calibration(
        cfg.calibration_for(cfg.models[0]), folders[0], task="task0", modality="text"
    ).batches[0]
    with torch.no_grad():
        assert torch.isfinite(tiny_architectures.outputs(model.eval(), batch)).all()


def test_moe_model_output_objective_is_refused_before_weights(checkpoints, data, monkeypatch):
    """QP's whole-model fit walks linears one at a time; an experts module is refused while
    planning, naming what works (the layer objective, regmean, chain_of_merges)."""
    from mergekit_ext.errors import NotSupportedError

    base, experts = checkpoints("qwen2_moe")
    cfg = _config("qp_projection", base, experts, data["text"], objective="model_output")

    def no_weights(*args, **kwargs):  # pragma: no cover - the refusal comes first
        raise AssertionError("a weight was read before the refusal")

    monkeypatch.setattr(ModelSource, "load", no_weights)
    with pytest.raises(NotSupportedError, match="mixture-of-experts.*layer_output"):
        plan_layerwise_merge(cfg, OPTIONS, _method("qp_projection"), cfg.parameters)


def test_deberta_relative_attention_groups(checkpoints, data):
    """DeBERTa-v3's relative attention: ``query_proj`` and ``key_proj`` read the tokens and
    the relative-position table (one group, ``reads`` in call order), ``value_proj`` the
    tokens only; the table's tensors are pre-block tensors (fallback merge)."""
    base, experts = checkpoints("deberta-v2")
    plan = plan_layerwise_merge(
        _config("regmean", base, experts, data["text"]), OPTIONS, _method("regmean"), {}
    )
    groups = {g.label: g for g in plan.blocks[0].groups}
    assert list(groups) == [
        "query_key",
        "value_proj",
        "attention_output",
        "intermediate",
        "output",
    ]
    assert groups["query_key"].modules == ("attention.self.query_proj", "attention.self.key_proj")
    assert groups["query_key"].reads == ("tokens", "table")
    assert groups["value_proj"].reads == ()
    assert (
        "query_key: attention.self.query_proj, attention.self.key_proj (each forward reads: "
        "tokens, table)" in plan.describe()
    )
    assert {"encoder.rel_embeddings.weight", "encoder.LayerNorm.weight"} <= {
        n.split("deberta.", 1)[-1] for n in plan.pre_block
    }


@pytest.mark.parametrize("method", METHODS)
def test_t5_refused_by_the_cli_before_any_weight(method, checkpoints, data, tmp_path, monkeypatch):
    """``mergekit-ext run`` on T5 (encoder-decoder): exit 1 before any weight is read, saying
    why (the decoder's cross-attention reads the merged encoder's output) and what works
    instead (ties, ace, symerge); nothing is written."""
    import re

    from click.testing import CliRunner

    from mergekit_ext.cli import main

    base, experts = checkpoints("t5")
    merge = {
        "merge_method": method,
        "base_model": base,
        "models": [
            {"model": e, "name": f"task{k}", "calibration": {"path": d, "samples": SAMPLES}}
            for k, (e, d) in enumerate(zip(experts, data["text"]))
        ],
    }
    config = tmp_path / "merge.yml"
    config.write_text(yaml.safe_dump(merge))

    def no_weights(*args, **kwargs):  # pragma: no cover - the refusal comes first
        raise AssertionError("a weight was read before the refusal")

    reads = []
    monkeypatch.setattr(ModelSource, "load", no_weights)
    monkeypatch.setattr(
        "safetensors.torch.load_file", lambda *a, **k: reads.append(a) or no_weights()
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["run", str(config), str(out)])
    assert result.exit_code == 1, result.output
    message = " ".join(result.output.split())
    assert "encoder-decoder" in message and "cross-attention" in message
    for alternative in ("ties", "ace", "symerge"):
        assert re.search(rf"\b{alternative}\b", message), message
    assert not out.exists() and not reads


def _statistics_bytes(stats: Any) -> int:
    """Bytes of every tensor in a block's statistics (TaskStatistics, per-expert tuples)."""
    if stats is None:
        return 0
    if isinstance(stats, dict):
        return sum(_statistics_bytes(v) for v in stats.values())
    if isinstance(stats, (list, tuple)):
        return sum(_statistics_bytes(v) for v in stats)
    return sum(
        t.numel() * t.element_size() for t in vars(stats).values() if isinstance(t, torch.Tensor)
    )


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_moe_memory_plan_counts_routed_statistics(
    model_type, checkpoints, data, tmp_path, monkeypatch
):
    """The plan's statistics estimate for a MoE model (E · (H² + I²) per experts module and
    task, the largest block layout: DeepSeek-V3's first block is dense) is the bytes of the
    statistics the executor actually holds for a block, within 10% (the estimate counts the
    Grams, not the mean vectors); the same from config.json alone."""
    from mergekit_ext.executor.sequential import SequentialExecutor

    base, experts = checkpoints(model_type)
    cfg = _config("regmean", base, experts, data["text"])
    method = _method("regmean")
    plan = plan_layerwise_merge(cfg, OPTIONS, method, cfg.parameters)
    held: list[int] = []
    original = SequentialExecutor._expert_path_statistics

    def measured(self, block, expert_blocks):
        stats = original(self, block, expert_blocks)
        held.append(_statistics_bytes(stats))
        return stats

    monkeypatch.setattr(SequentialExecutor, "_expert_path_statistics", measured)
    run_layerwise_merge(cfg, str(tmp_path / "out"), OPTIONS, method, cfg.parameters)
    assert len(held) == 2
    estimate = plan.memory.statistics
    assert 0.9 <= estimate / max(held) <= 1.1, (estimate, held)
    # config.json (and tokenizer) only: the same estimate from the class's shapes
    folders = []
    for i, source in enumerate([base, *experts]):
        folder = tmp_path / f"m{i}"
        folder.mkdir()
        for f in os.listdir(source):
            if not f.endswith(".safetensors"):
                shutil.copy(os.path.join(source, f), folder / f)
        folders.append(str(folder))
    weightless = plan_layerwise_merge(
        _config("regmean", folders[0], folders[1:], data["text"]), OPTIONS, method, {}
    )
    assert weightless.weightless and weightless.memory.statistics == estimate


# ------------------------------------------------------------------------------------------
# diagnose and QP's model-output objective over the supported types (issue #30 item 6)

SUPPORTED = [t for t, refusal in EXPECTED.items() if refusal is None]
MODEL_OUTPUT_REFUSED = tiny_architectures.MODEL_OUTPUT_REFUSED


@pytest.mark.parametrize("model_type", SUPPORTED)
def test_diagnose_every_supported_type(model_type, checkpoints, data, tmp_path):
    """``diagnose`` on a RegMean merge of each supported type: every block of the walked
    stack gets a finite, nonzero relative error against each expert, and the output
    measures (KL, agreement) are finite where the model has a head."""
    import math

    from mergekit_ext.diagnose import diagnose

    arch = tiny_architectures.ARCHITECTURES[model_type]
    base, experts = checkpoints(model_type)
    cfg = _config("regmean", base, experts, data[arch.modality])
    out = str(tmp_path / "out")
    run_layerwise_merge(cfg, out, OPTIONS, _method("regmean"), cfg.parameters)
    result = diagnose(cfg, out, data="calibration", references=False)
    assert set(result["tasks"]) == {"task0", "task1"}
    for name, task in result["tasks"].items():
        errors = [b["relative_error"] for b in task["blocks"]]
        assert len(errors) == tiny_architectures.LAYERS, (name, task["blocks"])
        assert all(math.isfinite(e) and e > 0 for e in errors), (name, errors)
        for measure in ("kl", "agreement"):
            value = task.get(measure)
            assert value is None or math.isfinite(value), (name, measure, value)


MODEL_OUTPUT_TYPES = tiny_architectures.MODEL_OUTPUT_TYPES


@pytest.mark.parametrize("model_type", MODEL_OUTPUT_TYPES)
def test_model_output_objective_across_types(model_type, checkpoints, data, tmp_path):
    """QP with ``objective: model_output`` on a type of each structure: the merge loads with
    transformers, gives finite outputs, and its output error is finite; the types of
    ``MODEL_OUTPUT_REFUSED`` are refused while planning, saying why."""
    import math

    from mergekit_ext.errors import NotSupportedError

    arch = tiny_architectures.ARCHITECTURES[model_type]
    base, experts = checkpoints(model_type)
    cfg = _config(
        "qp_projection",
        base,
        experts,
        data[arch.modality],
        objective="model_output",
        output_sketch=2,
    )
    out = str(tmp_path / "out")
    method = _method("qp_projection")
    refusal = MODEL_OUTPUT_REFUSED.get(model_type)
    if refusal is not None:
        with pytest.raises(NotSupportedError, match=refusal):
            plan_layerwise_merge(cfg, OPTIONS, method, cfg.parameters)
        return
    result = run_layerwise_merge(cfg, out, OPTIONS, method, cfg.parameters)
    summary = result.diagnostics["model_output"]
    assert math.isfinite(summary["output_error_final"])
    assert len(result.diagnostics["layers"]) >= 2 * 3
    model = getattr(transformers, arch.model_class).from_pretrained(out, dtype=torch.float32)
    batch = load_calibration(
        cfg.calibration_for(cfg.models[0]), base, task="task0", modality=arch.modality
    ).batches[0]
    with torch.no_grad():
        assert torch.isfinite(tiny_architectures.outputs(model.eval(), batch)).all()


def test_next_token_log_probs_with_a_head_bias(checkpoints, data):
    """Phi's output embedding has a bias: the model-output objective's next-token
    log-probabilities are those of transformers' PhiForCausalLM."""
    from mergekit_ext.executor.model_output import next_token_log_probs

    base, experts = checkpoints("phi")
    model = transformers.PhiForCausalLM.from_pretrained(experts[0], dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.bias.normal_(0, 1, generator=torch.Generator().manual_seed(0))
    cfg = _config("regmean", base, experts, data["text"])
    batch = load_calibration(
        cfg.calibration_for(cfg.models[0]), base, task="task0", modality="text"
    ).batches[0]
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True)
        hidden = out.hidden_states[-1]
        got = next_token_log_probs(hidden, model.lm_head.weight, model.lm_head.bias)
        unbiased = next_token_log_probs(hidden, model.lm_head.weight)
    torch.testing.assert_close(got, torch.log_softmax(out.logits, dim=-1), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unbiased, got, atol=1e-3)


def test_deberta_expert_path_reads_each_experts_own_table(checkpoints, data, tmp_path, monkeypatch):
    """Chain of Merges on DeBERTa-v3: the merged path runs the merged relative-position
    table, and the expert path each expert's own (``LayerNorm_k(rel_embeddings_k)``): the
    expert-path statistics of ``query_key`` in every block equal those of hooks on the whole
    expert model (tokens and table rows)."""
    from mergekit_ext.executor.sequential import SequentialExecutor

    arch = tiny_architectures.ARCHITECTURES["deberta-v2"]
    base, experts = checkpoints("deberta-v2")
    cfg = _config("chain_of_merges", base, experts, data["text"])
    captured: dict[int, list[Any]] = {}
    original = SequentialExecutor._expert_path_statistics

    def capture(self, block, expert_blocks):
        stats = original(self, block, expert_blocks)
        assert all(s.expert_calls is not None for s in self.states)  # tables differ
        captured[block.index] = list(stats["query_key"])
        return stats

    monkeypatch.setattr(SequentialExecutor, "_expert_path_statistics", capture)
    out = str(tmp_path / "out")
    run_layerwise_merge(cfg, out, OPTIONS, _method("chain_of_merges"), cfg.parameters)
    assert sorted(captured) == [0, 1]
    cls = getattr(transformers, arch.model_class)
    for k, path in enumerate(experts):
        model = cls.from_pretrained(path, dtype=torch.float32).eval()
        batches = load_calibration(
            cfg.calibration_for(cfg.models[k]), path, task=f"task{k}", modality="text"
        ).batches
        names = {f"deberta.encoder.layer.{i}.attention.self.query_proj": i for i in range(2)}
        modules = {n: model.get_submodule(n) for n in names}
        reference = _input_grams(model, modules, batches)
        for name, i in names.items():
            got = captured[i][k]
            expected = reference[name]
            if got.gram is not None:
                torch.testing.assert_close(got.gram.double(), expected, rtol=1e-4, atol=1e-6)
            else:
                torch.testing.assert_close(
                    got.second_moment.double(), torch.diagonal(expected), rtol=1e-4, atol=1e-6
                )
