"""Issue #50, items 10, 13-15: the command starts fast, the library leaves logging alone, the
Python API has diagnose/card/publish, and the smaller output fixes (one typo warning, no
torch_dtype notice, the ACE plot and text, multi-document YAML)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml
from click.testing import CliRunner

import mergekit_ext
from mergekit_ext.cli import main
from mergekit_ext.config import parse_config
from mergekit_ext.errors import ConfigError, MergekitExtError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("torch", "transformers", "mergekit", "peft", "safetensors")


def _python(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see conftest.py


# ------------------------------------------------------------------------------------------
# Start-up (item 13)


def test_version_loads_no_heavy_module():
    done = _python("-X", "importtime", "-m", "mergekit_ext", "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"mergekit-ext, version {mergekit_ext.__version__}"
    imported = {line.split("|")[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    loaded = sorted(m for m in imported if m.split(".")[0] in HEAVY)
    assert loaded == [], loaded[:5]


def test_version_is_the_one_pyproject_declares():
    """``mergekit_ext/_version.py`` holds the version every module reads; it is the
    distribution's (``pyproject.toml``), so the card and the diagnostics name the release."""
    import re

    from mergekit_ext._version import __version__

    root = os.path.dirname(os.path.dirname(mergekit_ext.__file__))
    with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as fp:
        declared = re.search(r'^version = "([^"]+)"', fp.read(), re.MULTILINE)
    assert declared is not None and declared.group(1) == __version__ == mergekit_ext.__version__


def test_import_still_registers_every_method():
    script = (
        "import logging, mergekit_ext\n"
        "from mergekit_ext.methods.registry import mergekit_method\n"
        "for name in ('regmean', 'chain_of_merges', 'ace', 'qp_projection', 'symerge', 'wudi'):\n"
        "    mergekit_method(name)\n"
        "assert logging.getLogger().handlers == [], logging.getLogger().handlers\n"
        "print(sorted(type(h).__name__ for h in logging.getLogger('mergekit_ext').handlers))\n"
        "logging.basicConfig()\n"  # a script's own setup, at WARNING
        "from mergekit_ext.console import phase\n"
        "phase('a phase line')\n"
        "logging.getLogger('mergekit_ext.diagnose').warning('a warning')\n"
    )
    done = _python("-c", script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['NullHandler']"
    assert "a phase line" not in done.stderr  # INFO: the script's setup shows WARNING only
    assert "WARNING:mergekit_ext.diagnose:a warning" in done.stderr


def test_methods_lists_ours_and_ridge_range():
    result = CliRunner().invoke(main, ["methods", "regmean"])
    assert result.exit_code == 0, result.output
    assert "ridge (default 'auto', in auto | [0, inf))" in result.output
    listed = CliRunner().invoke(main, ["methods"])
    assert "symerge  (" in listed.output and "chain_of_merges  (" in listed.output


# ------------------------------------------------------------------------------------------
# Messages (items 14, 15)


def test_multi_document_yaml_names_mergekit_multi():
    text = (
        "name: a\nmerge_method: linear\nmodels: [{model: x}]\n---\nname: b\nmerge_method: linear\n"
    )
    with pytest.raises(ConfigError) as info:
        parse_config(text, "multi.yml")
    message = str(info.value)
    assert "multi.yml holds several YAML documents" in message and "line 4" in message
    assert "mergekit-multi" in message and "mergekit-ext run PART.yml" in message
    with pytest.raises(ConfigError, match="invalid YAML"):  # other errors are as before
        parse_config("a: [1,\n", "bad.yml")


def _tiny_config(tmp_path, base, experts, method="task_arithmetic", **extra) -> str:
    raw = {
        "merge_method": method,
        "base_model": base,
        "models": [{"model": e, "parameters": {"weight": 0.5}} for e in experts],
        **extra,
    }
    path = tmp_path / f"{method}.yml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_typo_warned_once_and_no_torch_dtype_notice(tiny_llama_set, tmp_path):
    # `dtype:` set: mergekit sets config.torch_dtype on the output (the notice's source,
    # checked by hand to print before this fix); `dtyp:` a typo beside it
    config = _tiny_config(
        tmp_path,
        tiny_llama_set.base,
        tiny_llama_set.experts[:2],
        dtype="float32",
        dtyp="float32",
    )
    result = CliRunner().invoke(main, ["run", config, str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert result.output.count("unknown key 'dtyp'") == 1, result.output
    assert ".partial" not in result.output
    assert "torch_dtype" not in result.output


def test_ace_card_explains_ace_and_the_threshold_is_a_bin_edge(tiny_llama_set, tmp_path):
    from mergekit_ext.methods.card_sections.ace import threshold_bins

    # 24 of 28 weights near 0.01, the threshold 0.3: log bins, the threshold an edge
    values = [0.01 + 0.001 * i for i in range(24)] + [0.5, 0.9, 1.4, 2.0]
    bins, log_axis = threshold_bins(values, 0.3)
    assert log_axis and any(abs(b - 0.3) < 1e-12 for b in bins)
    assert bins[0] <= min(values) and bins[-1] >= max(values)
    low = [v for v in values if v < 0.3]
    assert len({next(i for i, b in enumerate(bins) if b > v) for v in low}) > 5  # spread out
    linear, log_axis = threshold_bins([0.0, 0.1, 0.5], 0.0)  # a threshold of 0: linear
    assert not log_axis and 0.0 in linear and linear[-1] >= 0.5

    config = _tiny_config(tmp_path, tiny_llama_set.base, tiny_llama_set.experts[:2], "ace")
    out = tmp_path / "ace"
    result = CliRunner().invoke(main, ["run", config, str(out)])
    assert result.exit_code == 0, result.output
    card = (out / "README.md").read_text(encoding="utf-8")
    how = card.split("How to read the numbers below:", 1)[1].split("####", 1)[0]
    assert "ACE reads no data" in how and "covariate shift" not in how
    assert (out / "images" / "ace_gamma.png").stat().st_size > 1000


# ------------------------------------------------------------------------------------------
# The Python API (item 15) and the progress bar (item 10)


def _texts(path, n=12) -> str:
    import random

    from mergekit_ext.testing import WORDS

    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as fp:
        for _ in range(n):
            fp.write(json.dumps({"text": " ".join(rng.sample(WORDS, 8))}) + "\n")
    return str(path)


def test_api_diagnose_card_and_publish(tiny_llama_set, tmp_path, monkeypatch):
    import mergekit_ext.diagnose.diagnoser as diagnoser

    data = _texts(tmp_path / "t.jsonl")
    raw = {
        "merge_method": "task_arithmetic",
        "base_model": tiny_llama_set.base,
        "models": [
            {"model": e, "parameters": {"weight": 0.5}, "calibration": {"path": data, "samples": 4}}
            for e in tiny_llama_set.experts[:2]
        ],
    }
    out = tmp_path / "merged"
    mergekit_ext.run_merge(raw, out)
    config = tmp_path / "m.yml"
    config.write_text(yaml.safe_dump(raw))

    bars = []
    real = diagnoser.tqdm

    def spy(*args, **kwargs):
        bar = real(*args, **kwargs)
        bars.append(bar)
        return bar

    monkeypatch.setattr(diagnoser, "tqdm", spy)
    result = mergekit_ext.diagnose_merge(str(out), str(config), json_path=str(tmp_path / "d.json"))
    assert result["verdict"] and json.loads((tmp_path / "d.json").read_text())["verdict"]
    # one bar: a step per block of each pass (2 tasks x (held-out + probe) x 2 blocks)
    assert len(bars) == 1 and bars[0].total == 2 * 2 * 2 and bars[0].n == bars[0].total
    with pytest.raises(MergekitExtError, match="--json"):  # never into an input
        mergekit_ext.diagnose_merge(str(out), str(config), json_path=str(out / "d.json"))

    card = mergekit_ext.write_card(str(out), diagnose_config=str(config))
    text = open(card.path, encoding="utf-8").read()
    assert card.diagnosis is not None and f"this model {card.diagnosis['verdict']}." in text

    calls = []
    monkeypatch.setattr(
        "mergekit_ext.hub.publish.publish_folder",
        lambda *a, **k: calls.append((a, k)) or "https://hub/commit/1",
    )
    assert mergekit_ext.publish(out, "me/model", dry_run=True) == "https://hub/commit/1"
    assert calls == [((str(out), "me/model"), {"dry_run": True})]
