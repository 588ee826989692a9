"""Importing mergekit-ext changes nothing of mergekit but adds our method names (issue #48).

A program that imports both gets mergekit's own architectures, methods and functions: each
check compares a fresh interpreter without ``import mergekit_ext`` with one that imports it
first. mergekit's own tests for the same behaviour (``tests/test_architecture_conversion.py``
of mergekit 0.1.5: ``test_mixtral_architecture_uses_json_v5_layout``,
``test_qwen3_moe_architecture_uses_json_v5_layout``) are repeated here after the import.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers
from mergekit.architecture import arch_info_for_config

import mergekit_ext  # noqa: F401  (the import under test, in this process too)
from mergekit_ext.models.mergekit_definitions import our_architectures

# Exactly the names `import mergekit_ext` adds to mergekit's method registry: the methods that
# merge one tensor group at a time, as mergekit's contract for a registered method says (its own
# suite runs every registered method on state dicts). The data-aware ones stay in ours.
OUR_METHODS = {"ace", "wudi"}
DATA_AWARE = {"chain_of_merges", "qp_projection", "regmean", "symerge"}

_SNAPSHOT = r"""
import json, re, sys
if sys.argv[1] == "with":
    import mergekit_ext  # first, as a program that imports both may do
import mergekit.merge  # noqa: F401  (loads the planner, the executor, the tokenizer code)
import mergekit.merge_methods as mm
from mergekit.architecture import json_definitions as j


def arch(a):
    return json.dumps(a.model_dump(mode="json"), sort_keys=True, default=repr)


def spec(m):  # a sentinel default prints its address: the only part that differs by run
    kind = f"{type(m).__module__}.{type(m).__qualname__}"
    return kind + " " + re.sub(r" at 0x[0-9a-f]+", "", repr(m.spec))


print(json.dumps({
    "name_to_arch": {n: [arch(a) for a in c] for n, c in j.NAME_TO_ARCH.items()},
    "json_architectures": [arch(a) for a in j.JSON_ARCHITECTURES],
    "methods": {m.spec.name: spec(m) for m in mm.registered_methods()},
}))
"""

# Every attribute of every loaded mergekit module, and of the transformers modules a merge
# goes through, by identity, before and after the import: a monkeypatch rebinds one.
_REBINDS = r"""
import json, sys, types
import mergekit.merge, mergekit.scripts.run_yaml  # noqa: F401
import transformers, transformers.modeling_utils, transformers.configuration_utils  # noqa: F401


def watched():
    return {
        name: m for name, m in sys.modules.items()
        if isinstance(m, types.ModuleType) and (
            name == "mergekit" or name.startswith("mergekit.")
            or name in ("transformers.modeling_utils", "transformers.configuration_utils")
        )
    }


before = {name: dict(vars(m)) for name, m in watched().items()}
import mergekit_ext  # noqa: E402,F401
changed = []
for name, attrs in before.items():
    now = vars(sys.modules[name])
    for attr, value in attrs.items():
        if attr not in now or now[attr] is not value:
            changed.append(f"{name}.{attr}")
    for attr in set(now) - set(attrs):
        value = now[attr]
        is_submodule = isinstance(value, types.ModuleType) and value.__name__ == f"{name}.{attr}"
        if not is_submodule and not attr.startswith("__"):
            changed.append(f"{name}.{attr} (added)")
print(json.dumps(changed))
"""


def _run(script: str, *args: str) -> object:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def snapshots() -> tuple[dict, dict]:
    return _run(_SNAPSHOT, "without"), _run(_SNAPSHOT, "with")


def test_import_leaves_mergekits_architectures_as_they_are(snapshots) -> None:
    without, with_ext = snapshots
    assert with_ext["name_to_arch"] == without["name_to_arch"]
    assert with_ext["json_architectures"] == without["json_architectures"]


def test_import_adds_only_our_method_names(snapshots) -> None:
    without, with_ext = snapshots
    added = set(with_ext["methods"]) - set(without["methods"])
    assert added == OUR_METHODS
    assert not OUR_METHODS & set(without["methods"])
    assert not DATA_AWARE & set(with_ext["methods"])
    # every mergekit method keeps its entry: same class, same spec
    assert {k: with_ext["methods"][k] for k in without["methods"]} == without["methods"]


def test_data_aware_methods_are_known_to_us_and_run_only_on_our_executor() -> None:
    from mergekit_ext.errors import ConfigError
    from mergekit_ext.methods.registry import all_method_names, mergekit_method

    for name in DATA_AWARE:
        assert name in all_method_names()
        face = mergekit_method(name)
        assert face.spec.name == name
        with pytest.raises(ConfigError, match="mergekit-ext run"):
            face.validate_inputs()


def test_import_rebinds_nothing_in_mergekit_or_transformers() -> None:
    assert _run(_REBINDS) == []


def _mixtral_config() -> transformers.PretrainedConfig:
    # as mergekit 0.1.5's test_mixtral_architecture_uses_json_v5_layout builds it
    cfg = transformers.MixtralConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_local_experts=2,
        num_experts_per_tok=1,
    )
    cfg.architectures = ["MixtralForCausalLM"]
    return cfg


def _qwen3_moe_config() -> transformers.PretrainedConfig:
    # as mergekit 0.1.5's test_qwen3_moe_architecture_uses_json_v5_layout builds it
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        num_experts=2,
        num_experts_per_tok=1,
    )
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    return cfg


MOE_CASES = [
    (_mixtral_config, "model.layers.0.block_sparse_moe.experts.0.w1.weight"),
    (_qwen3_moe_config, "model.layers.0.mlp.experts.0.gate_proj.weight"),
]


@pytest.mark.parametrize(("make_config", "per_expert"), MOE_CASES)
def test_mergekits_own_moe_tests_pass_after_the_import(make_config, per_expert: str) -> None:
    cfg = make_config()
    names = {w.name for w in arch_info_for_config(cfg).all_weights(cfg)}
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert "model.layers.0.mlp.experts.down_proj" in names
    assert per_expert not in names


@pytest.mark.parametrize(("make_config", "per_expert"), MOE_CASES)
def test_our_runs_see_the_per_expert_layout_only_inside(make_config, per_expert: str) -> None:
    cfg = make_config()
    with our_architectures({per_expert}):
        inside = {w.name for w in arch_info_for_config(cfg).all_weights(cfg)}
    assert per_expert in inside
    assert "model.layers.0.mlp.experts.gate_up_proj" not in inside
    after = {w.name for w in arch_info_for_config(cfg).all_weights(cfg)}
    assert per_expert not in after and "model.layers.0.mlp.experts.gate_up_proj" in after


def test_the_layout_follows_the_checkpoint_on_disk(tmp_path, tiny_llama_set) -> None:
    """save_pretrained writes experts one matrix each; a state_dict saved as it is (mergekit's
    own output) holds them fused, and then mergekit's definition applies."""
    from safetensors.torch import save_file

    from mergekit_ext.models.mergekit_definitions import (
        layout_tensor_names,
        our_definitions,
        stores_experts_separately,
    )

    cfg = _mixtral_config()
    model = transformers.MixtralForCausalLM(cfg)
    per_expert, fused, sharded = (str(tmp_path / n) for n in ("per_expert", "fused", "sharded"))
    model.save_pretrained(per_expert)
    model.save_pretrained(sharded, max_shard_size="20KB")
    cfg.save_pretrained(fused)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        os.path.join(fused, "model.safetensors"),
        metadata={"format": "pt"},
    )
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    for folder, separate in ((per_expert, True), (sharded, True), (fused, False)):
        names = layout_tensor_names(folder)
        assert names, folder
        assert stores_experts_separately(names) is separate, folder
        assert ("MixtralForCausalLM" in our_definitions(names)) is separate, folder
    # classes whose layout does not depend on the checkpoint, and unreadable models: no probe
    assert layout_tensor_names(tiny_llama_set.base) == frozenset()
    assert layout_tensor_names(str(tmp_path / "missing")) == frozenset()


def test_registering_never_replaces_one_of_mergekits_methods() -> None:
    import mergekit.merge_methods as mk_methods

    from mergekit_ext.methods.ace import INFO as ACE
    from mergekit_ext.methods.registry import (
        data_aware_method,
        method_kind,
        register_method,
    )

    ties = mk_methods.get("ties")
    info = dataclasses.replace(ACE, name="ties")
    with pytest.raises(ValueError, match="'ties' is one of mergekit's own"):
        register_method(info, data_aware_method(info))
    assert mk_methods.get("ties") is ties
    assert not method_kind("ties").data_aware  # still mergekit's tensor-wise ties
    register_method(ACE, mk_methods.get("ace"))  # ours again: idempotent


def test_our_run_writes_the_per_expert_layout_and_restores_mergekit(tmp_path) -> None:
    from mergekit.architecture import json_definitions
    from safetensors import safe_open

    before = dict(json_definitions.NAME_TO_ARCH)
    cfg = _mixtral_config()
    folders = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        folders.append(str(tmp_path / f"m{seed}"))
        transformers.MixtralForCausalLM(cfg).save_pretrained(folders[-1])
    config = {
        "merge_method": "linear",
        "base_model": folders[0],
        "models": [{"model": f, "parameters": {"weight": 0.5}} for f in folders],
        "dtype": "float32",
    }
    mergekit_ext.run_merge(config, str(tmp_path / "out"))
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        written = set(f.keys())
    with safe_open(os.path.join(folders[0], "model.safetensors"), "pt") as f:
        assert written == set(f.keys())  # per expert, as the base stores them
    with pytest.raises(ValueError):  # a failing run restores mergekit too
        mergekit_ext.run_merge(
            {**config, "merge_method": "della", "parameters": {"epsilon": 1.35}},
            str(tmp_path / "out2"),
        )
    assert json_definitions.NAME_TO_ARCH.keys() == before.keys()
    assert all(json_definitions.NAME_TO_ARCH[k] is v for k, v in before.items())
