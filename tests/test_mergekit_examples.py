"""`mergekit-ext run` is a strict superset of `mergekit-yaml`: mergekit's six example configs
(adapted to tiny Llama models, in ``tests/mergekit_examples/``) give the same files and
bit-identical tensors through both.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner
from mergekit.scripts.run_yaml import main as mergekit_yaml
from safetensors.torch import load_file

from mergekit_ext.cli import main
from mergekit_ext.testing import make_experts, make_tiny_llama

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mergekit_examples")
# written by mergekit-ext only (its record of the merge), not by mergekit-yaml
OURS_ONLY = {"mergekit_config.yml", "mergekit_ext_diagnostics.json", "mergekit_ext_manifest.json"}


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    root = tmp_path_factory.mktemp("examples")
    base = make_tiny_llama(str(root / "base"), seed=0, layers=4)
    experts = make_experts(base, [str(root / f"m{i}") for i in range(3)], scale=0.05, seed=5)
    return {"BASE": base, "MODEL_A": experts[0], "MODEL_B": experts[1], "MODEL_C": experts[2]}


def _tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


@pytest.mark.parametrize(
    "example",
    sorted(f for f in os.listdir(EXAMPLES) if f.endswith(".yml")),
)
def test_example_identical_through_mergekit_yaml_and_mergekit_ext(llamas, tmp_path, example):
    with open(os.path.join(EXAMPLES, example), encoding="utf-8") as fp:
        text = fp.read()
    for key in sorted(llamas, key=len, reverse=True):
        text = text.replace(key, llamas[key])
    config = tmp_path / example
    config.write_text(text)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    args = ["--no-write-model-card", "--random-seed", "0"]
    result = CliRunner().invoke(mergekit_yaml, [str(config), str(theirs), *args])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["run", str(config), str(ours), *args])
    assert result.exit_code == 0, result.output

    assert set(os.listdir(ours)) - OURS_ONLY == set(os.listdir(theirs))
    ta, tb = _tensors(ours), _tensors(theirs)
    assert ta and sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype, name
        assert torch.equal(ta[name], tb[name]), name
    with open(ours / "config.json") as a, open(theirs / "config.json") as b:
        assert json.load(a) == json.load(b)
