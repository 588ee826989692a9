"""The `mergekit-ext` CLI: run (tensor-wise path), atomic output, bad input, methods."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from mergekit_ext.cli import main
from mergekit_ext.methods.ace import ace_merge_simple, ace_merge_tensor, is_linear_weight
from mergekit_ext.testing import make_experts, make_tiny_bert, make_tiny_llama


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_models")
    base = make_tiny_llama(str(root / "base"), seed=0)
    experts = make_experts(base, [str(root / f"e{i}") for i in range(3)], scale=0.05, seed=3)
    return base, experts


def _write_config(path, method, base, experts, parameters=None, model_parameters=None):
    cfg = {
        "merge_method": method,
        "base_model": base,
        "models": [
            {"model": e, **({"parameters": model_parameters} if model_parameters else {})}
            for e in experts
        ],
        "dtype": "float32",
    }
    if parameters:
        cfg["parameters"] = parameters
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _run(args):
    return CliRunner().invoke(main, args, catch_exceptions=False)


def _no_partials(parent):
    return [n for n in os.listdir(parent) if ".partial-" in n or ".old-" in n]


def test_run_ace_writes_expected_merge_and_diagnostics(models, tmp_path):
    base, experts = models
    config = _write_config(tmp_path / "ace.yml", "ace", base, experts)
    out = tmp_path / "out"
    result = _run(["run", config, str(out), "--no-write-model-card"])
    assert result.exit_code == 0, result.output
    assert f"merged model written to {out}" in result.output
    merged = load_file(str(out / "model.safetensors"))
    base_sd = load_file(os.path.join(base, "model.safetensors"))
    expert_sds = [load_file(os.path.join(e, "model.safetensors")) for e in experts]
    assert set(merged) == set(base_sd)
    diag = json.loads((out / "mergekit_ext_diagnostics.json").read_text())
    assert diag["method"] == "ace" and diag["schema_version"] == 1
    recorded = diag["sections"]["ace"]["tensors"]
    for name, w0 in base_sd.items():
        ws = [sd[name] for sd in expert_sds]
        if is_linear_weight(name, w0, None):
            expected, d = ace_merge_tensor(w0, ws, name=name)
            assert recorded[name]["normalized"] == d.normalized
            assert recorded[name]["gamma"] == pytest.approx(d.gamma)
        else:
            expected = ace_merge_simple(w0, ws, name=name)
            assert name not in recorded
        torch.testing.assert_close(merged[name], expected, rtol=1e-5, atol=1e-6)
    # The copy keeps the YAML but no machine path: absolute paths show as their folder names,
    # written ./NAME so that none reads as a Hub id (issue #32, 8).
    copied = (out / "mergekit_config.yml").read_text()
    assert os.path.dirname(base) not in copied
    assert yaml.safe_load(copied)["base_model"] == "./base"
    assert [m["model"] for m in yaml.safe_load(copied)["models"]] == ["./e0", "./e1", "./e2"]
    assert diag["config_sha256"] == hashlib.sha256(open(config, "rb").read()).hexdigest()
    assert _no_partials(tmp_path) == []
    # A card rebuilt from the shortened copy says so, and does not call it edited.
    assert _run(["card", str(out)]).exit_code == 0
    card = (out / "README.md").read_text()
    assert "absolute local paths are shortened" in card and "was edited" not in card
    assert os.path.dirname(base) not in card


def test_run_is_deterministic_and_refuses_existing_output(models, tmp_path):
    base, experts = models
    config = _write_config(
        tmp_path / "ties.yml",
        "ties",
        base,
        experts,
        model_parameters={"weight": 1.0, "density": 0.5},
    )
    out = tmp_path / "out"
    assert _run(["run", config, str(out), "--no-write-model-card"]).exit_code == 0
    first = (out / "model.safetensors").read_bytes()
    again = _run(["run", config, str(out), "--no-write-model-card"])
    assert again.exit_code == 1
    assert "already exists" in again.output and "--overwrite" in again.output
    assert (out / "model.safetensors").read_bytes() == first
    over = _run(["run", config, str(out), "--no-write-model-card", "--overwrite"])
    assert over.exit_code == 0, over.output
    assert (out / "model.safetensors").read_bytes() == first  # same config → same bytes
    assert _no_partials(tmp_path) == []


def test_failed_merge_leaves_nothing(models, tmp_path):
    base, experts = models
    bad = tmp_path / "bad_expert"
    bad.mkdir()
    for f in os.listdir(experts[0]):
        (bad / f).write_bytes(open(os.path.join(experts[0], f), "rb").read())
    sd = load_file(str(bad / "model.safetensors"))
    sd["model.layers.1.mlp.up_proj.weight"][0, 0] = float("nan")
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    config = _write_config(tmp_path / "nan.yml", "ace", base, [str(bad), *experts[1:]])
    out = tmp_path / "out"
    result = _run(["run", config, str(out), "--no-write-model-card"])
    assert result.exit_code == 1
    assert "model.layers.1.mlp.up_proj.weight" in result.output
    assert "NaN" in result.output
    assert "Traceback" not in result.output
    assert not out.exists()
    assert _no_partials(tmp_path) == []


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda c: c.update(merge_method="acee"), "did you mean ace"),
        (lambda c: c["models"].append({"model": "./no/such/model"}), "model path not found"),
    ],
)
def test_bad_config_one_line_error(models, tmp_path, mutate, expected):
    base, experts = models
    cfg = yaml.safe_load(open(_write_config(tmp_path / "c.yml", "ace", base, experts)))
    mutate(cfg)
    (tmp_path / "c.yml").write_text(yaml.safe_dump(cfg))
    result = _run(["run", str(tmp_path / "c.yml"), str(tmp_path / "out")])
    assert result.exit_code == 1
    assert expected in result.output
    assert "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_invalid_yaml_and_missing_field(tmp_path):
    (tmp_path / "broken.yml").write_text("merge_method: ace\nmodels: [\n")
    result = _run(["run", str(tmp_path / "broken.yml"), str(tmp_path / "out")])
    assert result.exit_code == 1 and "invalid YAML" in result.output
    (tmp_path / "nomethod.yml").write_text("models: []\n")
    result = _run(["run", str(tmp_path / "nomethod.yml"), str(tmp_path / "out")])
    assert result.exit_code == 1 and "merge_method" in result.output


def test_different_architectures_refused(models, tmp_path):
    base, experts = models
    bert = make_tiny_bert(str(tmp_path / "bert"))
    config = _write_config(tmp_path / "mix.yml", "ace", base, [experts[0], bert])
    result = _run(["run", config, str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "different architectures" in result.output and "bert" in result.output


def test_shape_mismatch_names_tensor(models, tmp_path):
    base, experts = models
    other = tmp_path / "wide"
    os.makedirs(other)
    for f in os.listdir(experts[0]):
        (other / f).write_bytes(open(os.path.join(experts[0], f), "rb").read())
    sd = load_file(str(other / "model.safetensors"))
    sd["model.layers.0.mlp.down_proj.weight"] = torch.zeros(32, 65)
    save_file(sd, str(other / "model.safetensors"), metadata={"format": "pt"})
    config = _write_config(tmp_path / "shape.yml", "ace", base, [experts[0], str(other)])
    result = _run(["run", config, str(tmp_path / "out")])
    # a tensor-wise method goes to mergekit, whose own check names the tensor (the data-aware
    # methods' shape pre-check: tests/test_dropin.py)
    assert result.exit_code == 1
    assert "layers.0.mlp.down_proj.weight" in result.output and "size mismatch" in result.output
    assert not os.path.exists(tmp_path / "out") and not _no_partials(tmp_path)


def test_pickle_checkpoint_refused_unless_allowed(models, tmp_path):
    base, experts = models
    pickled = tmp_path / "pickled"
    os.makedirs(pickled)
    for f in os.listdir(experts[0]):
        if not f.endswith(".safetensors"):
            (pickled / f).write_bytes(open(os.path.join(experts[0], f), "rb").read())
    torch.save(
        load_file(os.path.join(experts[0], "model.safetensors")), pickled / "pytorch_model.bin"
    )
    config = _write_config(
        tmp_path / "p.yml",
        "task_arithmetic",
        base,
        [str(pickled), experts[1]],
        model_parameters={"weight": 0.5},
    )
    result = _run(["run", config, str(tmp_path / "out"), "--no-write-model-card"])
    assert result.exit_code == 1 and "--allow-pickle" in result.output
    result = _run(["run", config, str(tmp_path / "out"), "--no-write-model-card", "--allow-pickle"])
    assert result.exit_code == 0, result.output
    merged = load_file(str(tmp_path / "out" / "model.safetensors"))
    w0 = load_file(os.path.join(base, "model.safetensors"))
    e = [load_file(os.path.join(p, "model.safetensors")) for p in experts[:2]]
    name = "model.layers.0.self_attn.q_proj.weight"
    expected = w0[name] + 0.5 * (e[0][name] - w0[name]) + 0.5 * (e[1][name] - w0[name])
    torch.testing.assert_close(merged[name], expected)


def test_unknown_parameter_warns(models, tmp_path, caplog):
    base, experts = models
    config = _write_config(
        tmp_path / "typo.yml", "ace", base, experts, parameters={"k_fraction": 0.2}
    )
    result = _run(["run", config, str(tmp_path / "out"), "--no-write-model-card", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert any("k_fraction" in r.message and "k_frac" in r.message for r in caplog.records)


def test_dry_run_writes_nothing(models, tmp_path):
    base, experts = models
    config = _write_config(tmp_path / "ace.yml", "ace", base, experts)
    result = _run(["run", config, str(tmp_path / "out"), "--dry-run"])
    assert result.exit_code == 0
    assert "method: ace" in result.output
    assert not (tmp_path / "out").exists()


def test_methods_lists_mergekit_and_ours():
    result = _run(["methods", "--json"])
    assert result.exit_code == 0
    described = {m["name"]: m for m in json.loads(result.output)}
    assert {"ace", "ties", "task_arithmetic", "linear"} <= set(described)
    ace = described["ace"]
    assert ace["source"] == "mergekit-ext" and ace["needs_calibration"] is False
    assert {p["name"]: p["default"] for p in ace["parameters"]} == {
        "eps": 0.01,
        "k_frac": 0.3,
        "gamma_threshold": 0.3,
        "heterogeneity": "paper",
        "spread_threshold": 0.1,
        "normalize": "auto",
        "scale": 1.0,
    }
    assert "arxiv.org/abs/2603.02945" in ace["paper_url"]
    text = _run(["methods", "ace"]).output
    assert "k_frac (default 0.3, in [0, 1])" in text
    assert _run(["methods", "acee"]).exit_code != 0


def test_python_dash_m_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "mergekit_ext", "methods"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0
    assert "ace" in proc.stdout and "ties" in proc.stdout


@pytest.mark.parametrize(
    "set_name",
    ["tiny_llama_set", "tiny_bert_set", "tiny_vit_set", "tiny_clip_vision_set", "tiny_clip_set"],
)
@pytest.mark.parametrize("method", ["ace", "ties", "task_arithmetic"])
def test_cli_merges_every_family_offline(request, tmp_path, set_name, method):
    """`mergekit-ext run` end to end (card included) for Llama, BERT, ViT and CLIP."""
    import transformers

    tiny = request.getfixturevalue(set_name)
    params = {"weight": 0.5, "density": 0.6} if method != "ace" else None
    config = _write_config(
        tmp_path / "c.yml", method, tiny.base, tiny.experts, model_parameters=params
    )
    out = tmp_path / "out"
    result = _run(["run", config, str(out)])
    assert result.exit_code == 0, result.output
    merged = load_file(str(out / "model.safetensors"))
    base_sd = load_file(os.path.join(tiny.base, "model.safetensors"))
    assert set(merged) == set(base_sd)
    changed = [
        n
        for n in base_sd
        if base_sd[n].is_floating_point() and not torch.equal(merged[n], base_sd[n])
    ]
    assert len(changed) >= len([n for n in base_sd if base_sd[n].is_floating_point()]) - 1
    assert (out / "README.md").read_text().startswith("---\n")
    assert (out / "mergekit_ext_diagnostics.json").exists()
    cls = getattr(transformers, tiny.architecture)
    model = cls.from_pretrained(str(out))
    assert all(torch.isfinite(p).all() for p in model.parameters())
