"""``diagnose`` beyond the calibration template (issue #50): the generic prose probe, the
diversity warnings, the merge's own guard warnings, data-free merges and SLERP endpoints."""

from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import yaml
from click.testing import CliRunner
from test_low_diversity_calibration import _config, _low_rank_expert, _tiny_llama, _write_chat

from mergekit_ext import merge_record
from mergekit_ext.api import run_merge
from mergekit_ext.cli import main
from mergekit_ext.config import load_config
from mergekit_ext.diagnose import diagnose
from mergekit_ext.diagnose.probe import PROBE_PATH, diversity_warnings, load_probe
from mergekit_ext.methods.card_sections.least_squares import summarize_layerwise

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see conftest.py


@pytest.fixture(scope="module")
def template_merges(tmp_path_factory) -> dict:
    """Chain of Merges of two tiny Llama experts fitted on 16 chats of one template: with a
    tiny ridge (broken off the template, no guard warning) and with ``ridge: auto``."""
    root = tmp_path_factory.mktemp("template")
    base = _tiny_llama(str(root / "base"))
    experts = [_low_rank_expert(base, str(root / f"expert{i}"), 10 + i) for i in range(2)]
    data = [_write_chat(str(root / f"chat{i}.jsonl"), seed=i, texts=48) for i in range(2)]
    s = {"base": base, "experts": experts, "data": data}
    configs = {}
    for name, parameters in [("broken", {"ridge": 1e-5}), ("good", {})]:
        config = _config(s, **parameters)
        for m in config["models"]:
            m["calibration"]["samples"] = 16
        run_merge(config, root / name)
        configs[name] = str(root / f"{name}.yml")
        with open(configs[name], "w", encoding="utf-8") as fp:
            yaml.safe_dump(config, fp)
    return {"root": root, "configs": configs, **s}


def test_template_fitted_merge_is_rejected_by_default(template_merges, tmp_path):
    s = template_merges
    broken, good = str(s["root"] / "broken"), str(s["root"] / "good")
    # the broken merge's own record is clean: the guard saw nothing
    assert merge_record.load(broken)["sections"]["chain_of_merges"]["layers"]
    out_json = tmp_path / "d.json"
    args = ["diagnose", broken, good, s["configs"]["broken"], "--json", str(out_json)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    bad, fine = json.loads(out_json.read_text())
    assert bad["merge_warnings"] == []
    # held-out rows of the same template flatter it: better than the base there ...
    assert bad["base_ratio"] > 1.0
    # ... but on generic prose it is far from the experts, and the verdict says so
    assert bad["probe_ratio"] < 0.5
    assert "generic text" in bad["verdict"] and bad["verdict"].endswith("do not publish")
    assert fine["probe_ratio"] > 1.0 and fine["verdict"].startswith("keeps ")
    for task in ("task0", "task1"):
        probe = bad["probe"]["tasks"][task]
        assert probe["data"] == "probe" and probe["samples"] == 48
        assert probe["kl"] > 10 * bad["references"]["base"]["probe"]["tasks"][task]["kl"]
        warnings = bad["data"][task]["warnings"]
        assert any("one template" in w for w in warnings)
        assert any("distinct tokens" in w for w in warnings)
    assert "task0 probe" in result.output and "probe_ratio" in result.output
    assert "WARNING: task task0's calibration source is mostly one template" in result.output
    # more rows of the same template (--heldout '{samples: ...}') change nothing: the probe
    # is counted whatever the held-out data
    again = diagnose(
        load_config(s["configs"]["broken"]), broken, heldout=["{samples: 24}"], progress=False
    )
    assert again["verdict"].endswith("do not publish")
    # without the probe, the held-out rows alone would approve it (the bias of issue #50)
    blind = diagnose(load_config(s["configs"]["broken"]), broken, probe=False, progress=False)
    assert blind["verdict"].startswith("keeps ") and blind["probe_ratio"] is None


def test_card_shows_the_probe_and_the_warnings(template_merges, tmp_path):
    s = template_merges
    out = str(tmp_path / "broken")
    shutil.copytree(s["root"] / "broken", out)
    result = CliRunner().invoke(main, ["card", out, "--diagnose", s["configs"]["broken"]])
    assert result.exit_code == 0, result.output
    card = open(os.path.join(out, "README.md"), encoding="utf-8").read()
    saved = json.loads(open(os.path.join(out, "mergekit_ext_diagnose.json")).read())
    assert f"**Verdict:** this model {saved['verdict']}." in card
    assert saved["verdict"].endswith("do not publish")
    section = card.split("### Agreement with the experts", 1)[1]
    row = next(line for line in section.splitlines() if "task0 (generic prose probe)" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert float(cells[2]) == pytest.approx(saved["probe"]["tasks"]["task0"]["kl"], rel=5e-3)
    base_kl = saved["references"]["base"]["probe"]["tasks"]["task0"]["kl"]
    assert float(cells[3]) == pytest.approx(base_kl, rel=5e-3)
    assert "**Warnings:**" in section and "one template" in section


def test_guard_warnings_in_the_record_block_a_positive_verdict(template_merges, tmp_path):
    """The healthy merge with a norm-ratio warning written into its record (as the guard
    writes it): never "keeps ... more"; the card's worst layer is that layer."""
    s = template_merges
    flagged = str(tmp_path / "flagged")
    shutil.copytree(s["root"] / "good", flagged)
    path = os.path.join(flagged, merge_record.FILENAME)
    record = json.loads(open(path, encoding="utf-8").read())
    layers = record["sections"]["chain_of_merges"]["layers"]
    layers[3].update(guard="warned", max_norm_ratio=4.37)
    layers[5].update(guard="warned", max_norm_ratio=4.79)
    open(path, "w", encoding="utf-8").write(json.dumps(record))
    config = load_config(s["configs"]["good"])
    good, marked = diagnose(config, [str(s["root"] / "good"), flagged], progress=False)
    assert good["merge_warnings"] == [] and good["verdict"].startswith("keeps ")
    assert len(marked["merge_warnings"]) == 1 and "2 linear group(s)" in marked["merge_warnings"][0]
    assert (
        layers[5]["layer"] in marked["merge_warnings"][0] and "4.79×" in marked["merge_warnings"][0]
    )
    assert marked["verdict"].endswith("do not publish")
    assert marked["base_ratio"] == good["base_ratio"]  # the numbers are the same
    # the card's worst layer is the one its warnings list names first
    summary = summarize_layerwise(record["sections"]["chain_of_merges"])
    assert summary["worst"]["layer"] == layers[5]["layer"] and summary["worst"]["out_of_range"]
    assert [r["layer"] for r in summary["out_of_range"]] == [layers[3]["layer"], layers[5]["layer"]]
    result = CliRunner().invoke(main, ["card", flagged])
    assert result.exit_code == 0, result.output
    card = open(os.path.join(flagged, "README.md"), encoding="utf-8").read()
    worst_line = next(line for line in card.splitlines() if line.startswith("**Worst layer:**"))
    assert layers[5]["layer"] in worst_line and "outside the experts' range" in worst_line
    assert "norm 4.79×" in card.replace("\n", " ")
    assert "**2 linear group(s) left the experts' range**" in card


def test_diversity_warnings_only_for_low_diversity(tiny_llama_set, template_merges, tmp_path):
    import random

    from mergekit_ext.calibration.config import CalibrationSpec
    from mergekit_ext.calibration.sources import load_calibration
    from mergekit_ext.testing import WORDS

    # texts over the tiny tokenizer's whole vocabulary (it reads English prose as [UNK])
    rng = random.Random(0)
    with open(tmp_path / "varied.jsonl", "w", encoding="utf-8") as fp:
        for _ in range(16):
            fp.write(json.dumps({"text": " ".join(rng.sample(WORDS, 12))}) + "\n")
    varied = load_calibration(
        CalibrationSpec(path=str(tmp_path / "varied.jsonl"), samples=16),
        template_merges["base"],
        task="t",
    )
    assert diversity_warnings(varied, "varied") == []
    probe = load_probe("t", tiny_llama_set.base, 8, False)
    assert probe.num_samples == 48 and probe.num_tokens > 48 * 10

    chats = load_calibration(
        CalibrationSpec(path=template_merges["data"][0], samples=16),
        template_merges["base"],
        task="t",
    )
    words = diversity_warnings(chats, "chats")
    assert len(words) == 2 and "distinct tokens" in words[0] and "one template" in words[1]
    assert os.path.getsize(PROBE_PATH) < 16_000  # a few KB, shipped with the package


# ------------------------------------------------------------------------------------------
# Data-free merges (issue #50, item 9)


def _write(path, raw) -> str:
    with open(path, "w", encoding="utf-8") as fp:
        yaml.safe_dump(raw, fp)
    return str(path)


def test_slerp_compares_with_its_endpoints(template_merges, tmp_path):
    """SLERP between the base and an expert: both are tasks, no "adds nothing" verdict, no
    "it read N" note; --heldout FILE works without a calibration block."""
    s = template_merges
    raw = {
        "merge_method": "slerp",
        "base_model": s["base"],
        "models": [{"model": s["base"]}, {"model": s["experts"][0]}],
        "parameters": {"t": 0.5},
    }
    config = _write(tmp_path / "slerp.yml", raw)
    out = str(tmp_path / "slerp")
    assert CliRunner().invoke(main, ["run", config, out]).exit_code == 0
    result = diagnose(load_config(config), out, progress=False)
    assert set(result["tasks"]) == {"base", "expert0"}
    assert result["references"]["base"] is None and result["references"]["base_is_input"]
    for task in ("base", "expert0"):
        assert result["data"][task]["kind"] == "probe"
    assert result["best_single_ratio"] is not None
    assert "adds nothing" not in result["verdict"] and "it read" not in json.dumps(result)
    closest = min(r["mean_kl"] for r in result["references"]["experts"].values())
    assert result["best_single_ratio"] == pytest.approx(closest / result["mean_kl"])
    words = "closer to all its input models" if result["best_single_ratio"] > 1 else "would lose"
    assert words in result["verdict"]
    # --heldout FILE alone, without a calibration block: accepted, nothing excluded
    got = CliRunner().invoke(main, ["diagnose", out, config, "--heldout", s["data"][0]])
    assert got.exit_code == 0, got.output
    assert "slerp is data-free" in got.output and "it read" not in got.output


def test_task_arithmetic_without_data_uses_the_probe(template_merges, tmp_path):
    s = template_merges
    raw = {
        "merge_method": "task_arithmetic",
        "base_model": s["base"],
        "models": [
            {"model": e, "name": f"t{i}", "parameters": {"weight": 0.5}}
            for i, e in enumerate(s["experts"])
        ],
    }
    config = _write(tmp_path / "ta.yml", raw)
    out = str(tmp_path / "ta")
    assert CliRunner().invoke(main, ["run", config, out]).exit_code == 0
    result = diagnose(load_config(config), out, progress=False)
    assert result["evaluated_on"] == "probe"
    assert result["references"]["base"] is not None and result["base_ratio"] is not None
    assert result["probe_ratio"] == result["base_ratio"]  # the probe is its only data
    assert "on the generic prose probe" in result["verdict"]
    # a calibration block read by no one: its first rows, with nothing left out
    raw["models"][0]["calibration"] = {"path": s["data"][0], "samples": 8}
    config = _write(tmp_path / "ta2.yml", raw)
    result = diagnose(load_config(config), out, progress=False)
    assert result["data"]["t0"]["excluded_examples"] == 0
    assert "task_arithmetic is data-free" in result["data"]["t0"]["note"]
    assert math.isfinite(result["probe"]["mean_kl"])
