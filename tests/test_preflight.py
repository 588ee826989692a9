"""preflight (mergekit_ext/preflight.py): the one pass of checks before a weight loads, what
it runs in which order, the world check and the plan it hands on (issue #53)."""

from __future__ import annotations

import pytest
import yaml
from click.testing import CliRunner
from mergekit.options import MergeOptions

from mergekit_ext import checks, preflight
from mergekit_ext.cli import main
from mergekit_ext.config import parse_config
from mergekit_ext.errors import ExecutionError

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see conftest.py

#: the main path's checks, in the order preflight runs them (its docstring)
ORDER = [
    "check_world",
    "check_method",
    "check_parameter_values",
    "check_models_list",
    "check_model_paths",
    "check_adapters",
    "check_compatible",
    "check_layer_counts",
    "check_checkpoint_classes",
    "check_parameter_names",
    "warn_tokenizers_differ",
    "check_calibration_present",
]


def _config(tiny_llama_set, tmp_path, method="chain_of_merges", **parameters):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a b c"}\n{"text": "d e"}\n')
    models = [
        {"model": e, "name": f"t{k}", "calibration": {"path": str(data), "samples": 2}}
        for k, e in enumerate(tiny_llama_set.experts[:2])
    ]
    raw = {"merge_method": method, "base_model": tiny_llama_set.base, "models": models}
    if parameters:
        raw["parameters"] = parameters
    path = tmp_path / "c.yml"
    path.write_text(yaml.safe_dump(raw))
    return str(path), parse_config(path.read_text())


def _recorded(monkeypatch) -> list[str]:
    """Every check preflight runs, by name, in call order."""
    calls: list[str] = []
    for name in ORDER:
        owner = preflight if name == "check_world" else checks
        original = getattr(owner, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, spy)
    return calls


def test_preflight_runs_every_check_once_in_order(tiny_llama_set, tmp_path, monkeypatch):
    _, cfg = _config(tiny_llama_set, tmp_path)
    calls = _recorded(monkeypatch)
    plan = preflight.preflight(cfg, MergeOptions(), preflight.World())
    assert calls == ORDER
    assert plan.kind.data_aware and plan.world == preflight.World(1)
    layerwise = plan.layerwise()
    assert plan.layerwise() is layerwise  # built once, from the plan that passed
    assert layerwise.rank_warnings  # two short texts: least squares warns


def test_a_dry_run_checks_through_preflight_alone(tiny_llama_set, tmp_path, monkeypatch):
    """`run --dry-run --world-size 2`: the CLI's early world check (before a launcher's
    processes meet) and one preflight; the runner checks nothing on its own."""
    config, _ = _config(tiny_llama_set, tmp_path)
    calls = _recorded(monkeypatch)
    out = str(tmp_path / "out")
    result = CliRunner().invoke(main, ["run", config, out, "--dry-run", "--world-size", "2"])
    assert result.exit_code == 0, result.output
    assert calls == ["check_world", *ORDER]
    assert "rank 1 (tasks t1): peak" in result.output


def test_world_check_refuses_and_accepts(tiny_llama_set, tmp_path):
    _, symerge = _config(tiny_llama_set, tmp_path, method="symerge")
    _, com = _config(tiny_llama_set, tmp_path)
    _, distilled = _config(tiny_llama_set, tmp_path, method="block_distillation")
    with pytest.raises(ExecutionError, match="--world-size 2 cannot plan it; drop --world-size"):
        preflight.check_world(symerge, preflight.World(2, planned=True))
    with pytest.raises(ExecutionError, match=r"without torchrun/accelerate \(WORLD_SIZE is 2\)"):
        preflight.check_world(symerge, preflight.World(2))
    with pytest.raises(ExecutionError, match=r"at most as many processes as tasks \(2\), not 3"):
        preflight.check_world(distilled, preflight.World(3))
    for cfg, world in ((symerge, 1), (com, 4), (distilled, 2)):
        preflight.check_world(cfg, preflight.World(world))  # accepted


def test_world_of_a_run(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert preflight.World.of_run(None) == preflight.World(3)
    assert preflight.World.of_run(2) == preflight.World(2, planned=True)
