"""Inputs that are hostile, corrupt or hang (issue #28, items 6, 7, 10, 11, 13, 14, 15).

Each case runs the real CLI in a subprocess, bounded by the test's timeout, on real files:
the error must name the file (model, tensor, port, plugin) at fault and arrive before any
weight is read.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import yaml

import mergekit_ext
from mergekit_ext.testing import make_experts, make_tiny_llama

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(mergekit_ext.__file__)))


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO_ROOT, env.get("PYTHONPATH", "")])
    env["HF_HUB_OFFLINE"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    env.update(extra)
    return env


def _cli(*args: str, cwd, timeout: float = 120, **env: str) -> tuple[int, str, float]:
    """Run ``mergekit-ext ARGS``; (exit code, stdout + stderr, seconds)."""
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "mergekit_ext", *map(str, args)],
        cwd=str(cwd),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(**env),
    )
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("guarded_models")
    base = make_tiny_llama(str(root / "base"), seed=0)
    experts = make_experts(base, [str(root / f"e{i}") for i in range(2)], scale=0.05, seed=3)
    return base, experts


@pytest.fixture
def work(models, tmp_path):
    """Copies of the models under m/ (free to corrupt) and a ``ties`` YAML over them."""
    base, experts = models
    w = tmp_path / "work"
    (w / "m").mkdir(parents=True)
    shutil.copytree(base, w / "m" / "base")
    shutil.copytree(experts[0], w / "m" / "expert_a")
    shutil.copytree(experts[1], w / "m" / "expert_b")
    (w / "data.jsonl").write_text(json.dumps({"text": "hello world"}) + "\n")
    _write_yaml(w / "ties.yml", "ties", ["m/expert_a", "m/expert_b"])
    return w


def _write_yaml(path, method: str, models: list[str], base: str = "m/base", **extra) -> None:
    config = {
        "merge_method": method,
        "base_model": base,
        "models": [{"model": m, "parameters": {"weight": 0.5, "density": 0.5}} for m in models],
        "dtype": "float32",
        **extra,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))


# ------------------------------------------------------------------ 11. YAML alias bomb

BOMB = "".join(
    [
        'x0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n',
        *(f"x{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]\n" for i in range(1, 10)),
        "x_extra: *a9\n",
    ]
)


def test_yaml_alias_bomb_is_refused_when_read(work):
    """9^10 values under an unknown key: refused in the YAML reader, nothing written."""
    (work / "bomb.yml").write_text((work / "ties.yml").read_text() + BOMB)
    assert len(BOMB) < 1000
    rc, out, seconds = _cli("run", "bomb.yml", "out", cwd=work, timeout=90)
    assert rc == 1, out
    assert "bomb.yml" in out and "aliases" in out and "*a9" in out, out
    assert "Traceback" not in out
    assert not (work / "out").exists()
    # the same reader serves `diagnose` (and `card`/`publish` through parse_config)
    rc, out, _ = _cli("diagnose", "m/base", "bomb.yml", cwd=work, timeout=90)
    assert rc == 1 and "aliases" in out, out


def test_yaml_ordinary_aliases_still_work(tmp_path):
    from mergekit_ext.config import load_yaml

    raw = load_yaml("p: &p {weight: 0.5}\nmodels: [{parameters: *p}, {parameters: *p}]\n", "x")
    assert raw["models"][1]["parameters"] == {"weight": 0.5}
    with pytest.raises(mergekit_ext.errors.ConfigError, match="recursive"):
        load_yaml("a: &a [1, *a]\n", "x.yml")


# ------------------------------------------------------------------ 15. sys.exit in plugins

EXITING_SOURCE = """
import sys

from mergekit_ext.calibration import register_source


@register_source("quits")
def quits(spec):
    yield "one text"
    sys.exit(0)
"""


def test_plugin_exiting_at_import_is_a_failure(work):
    (work / "quit.py").write_text("import sys\nsys.exit(0)\n")
    rc, out, _ = _cli("run", "ties.yml", "out", "--plugin", "quit.py", cwd=work)
    assert rc == 1, out
    assert "--plugin quit.py" in out and "sys.exit(0)" in out and "quit.py:2" in out, out
    assert not (work / "out").exists()


def test_calibration_source_exiting_is_a_failure(work):
    (work / "src.py").write_text(EXITING_SOURCE)
    config = {
        "merge_method": "regmean",
        "base_model": "m/base",
        "models": [{"model": "m/expert_a"}, {"model": "m/expert_b"}],
        "calibration": {"source": "quits"},
        "dtype": "float32",
    }
    (work / "rm.yml").write_text(yaml.safe_dump(config))
    rc, out, _ = _cli("run", "rm.yml", "out", "--plugin", "src.py", cwd=work)
    assert rc == 1, out
    assert "calibration source 'quits'" in out and "sys.exit(0)" in out, out
    assert "src.py:10" in out, out
    assert not (work / "out").exists()
    assert not [n for n in os.listdir(work) if ".partial-" in n]


def test_plugin_exiting_during_the_merge_is_a_failure(work):
    """A plugin that patches a step of the merge and exits there: still a failure."""
    (work / "late.py").write_text(
        "import sys\nimport mergekit_ext.finite as finite\n"
        "finite.check_output_finite = lambda *a, **k: sys.exit(0)\n"
    )
    rc, out, _ = _cli("run", "ties.yml", "out", "--plugin", "late.py", cwd=work)
    assert rc == 1, out
    assert "--plugin late.py" in out and "sys.exit(0)" in out, out
    assert not (work / "out").exists()
