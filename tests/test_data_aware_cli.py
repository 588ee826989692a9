"""`mergekit-ext run` end to end with the data-aware methods on tiny Llama, BERT and ViT."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
import transformers
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from mergekit_ext.cli import main
from mergekit_ext.testing import WORDS


def _calibration(tmp_path, tiny, k: int) -> dict:
    """Per-task calibration data: texts for text models, pixel tensors for vision models."""
    if "ViT" in tiny.architecture or "CLIP" in tiny.architecture:
        path = tmp_path / f"pixels{k}.safetensors"
        gen = torch.Generator().manual_seed(k)
        save_file({"pixel_values": torch.randn(12, 3, 16, 16, generator=gen)}, str(path))
        return {"path": str(path)}
    path = tmp_path / f"texts{k}.jsonl"
    rng = random.Random(k)
    with open(path, "w") as fp:
        for _ in range(12):
            fp.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(10))}) + "\n")
    return {"path": str(path), "field": "text"}


CASES = [
    ("regmean", {}),
    ("chain_of_merges", {"propagate": True}),
    ("qp_projection", {"basis": "diagonal", "diagnose_both_bases": True}),
    ("qp_projection", {"basis": "residual_eigen"}),
]


@pytest.mark.parametrize("set_name", ["tiny_llama_set", "tiny_bert_set", "tiny_vit_set"])
@pytest.mark.parametrize("method, parameters", CASES)
def test_data_aware_run(request, tmp_path, set_name, method, parameters):
    tiny = request.getfixturevalue(set_name)
    config = {
        "merge_method": method,
        "base_model": tiny.base,
        "models": [
            {"model": e, "calibration": _calibration(tmp_path, tiny, k)}
            for k, e in enumerate(tiny.experts)
        ],
        "calibration": {"samples": 8, "max_length": 16, "batch_size": 4},
        "parameters": parameters,
        "dtype": "float32",
    }
    (tmp_path / "c.yml").write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    result = CliRunner().invoke(
        main, ["run", str(tmp_path / "c.yml"), str(out)], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    merged = load_file(str(out / "model.safetensors"))
    base_sd = load_file(os.path.join(tiny.base, "model.safetensors"))
    assert set(merged) == set(base_sd)
    diag = json.loads((out / "mergekit_ext_diagnostics.json").read_text())
    layers = diag["sections"][method]["layers"]
    assert len(layers) >= 8  # 2 blocks x 4 groups
    assert set(diag["calibration"]) == {os.path.basename(e) for e in tiny.experts}
    if method == "qp_projection":
        for layer in layers:
            for record in layer["weights"].values():
                assert record["basis"] == parameters["basis"]
                # the default prior 1: J(d*) + μ‖d* − 1‖² <= J(1), so J(d*) <= J at λ = 1
                assert record["captured_energy"] <= 1.0
                assert record["J_opt"] <= record["J_task_arithmetic"]["1"] * (1 + 1e-9) + 1e-12
                if parameters.get("diagnose_both_bases"):
                    assert 0.0 <= record["other_basis"]["captured_energy"] <= 1.0
    else:
        for layer in layers:
            assert (
                layer["condition_number"] is None
                or layer["condition_number"] == "inf"
                or (layer["condition_number"] >= 1.0)
            )
    images = os.listdir(out / "images")
    assert images and all(name.endswith(".png") for name in images)
    model = getattr(transformers, tiny.architecture).from_pretrained(str(out))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_data_aware_method_without_calibration_is_refused(tiny_llama_set, tmp_path):
    config = {
        "merge_method": "chain_of_merges",
        "base_model": tiny_llama_set.base,
        "models": [{"model": e} for e in tiny_llama_set.experts],
    }
    (tmp_path / "c.yml").write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(main, ["run", str(tmp_path / "c.yml"), str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "needs calibration data" in result.output and "calibration:" in result.output
    assert not (tmp_path / "out").exists()
