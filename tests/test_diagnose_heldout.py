"""``mergekit-ext diagnose`` as a merger uses it: held-out data, reference rows, verdicts,
several merged folders in one call, the plot (issue #27)."""

from __future__ import annotations

import json
import math
import os
import shutil
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import mergekit_ext.diagnose.diagnoser as diagnose_module
import mergekit_ext.diagnose.heldout as heldout_module
import mergekit_ext.executor.plan as plan_module
from mergekit_ext.calibration.config import CalibrationSpec
from mergekit_ext.calibration.sources import (
    NoUnusedCalibrationData,
    load_calibration,
)
from mergekit_ext.cli import main
from mergekit_ext.config import load_config
from mergekit_ext.diagnose import diagnose, format_table, verdict
from mergekit_ext.diagnose.probe import PROBE_REJECT
from mergekit_ext.errors import ConfigError
from mergekit_ext.plots import as_float, block_error_figure

SAMPLES = 6


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see conftest.py


def _write_unique_texts(path: str, seed: int, n: int) -> str:
    """``n`` distinct texts (each starts with its own number): equal token rows = same text."""
    import tiny_models

    rng = np.random.RandomState(seed)
    with open(path, "w", encoding="utf-8") as fp:
        for i in range(n):
            words = rng.choice(tiny_models.WORDS, size=rng.randint(3, 10))
            fp.write(json.dumps({"text": f"{i} " + " ".join(words)}) + "\n")
    return path


def _write_config(path: str, base: str, experts: list[str], data: list[str], **extra) -> str:
    raw: dict[str, Any] = {
        "merge_method": "regmean",
        "base_model": base,
        "models": [
            {
                "model": e,
                "name": f"task{k}",
                "calibration": {"path": d, "samples": SAMPLES, "batch_size": 3, **extra},
            }
            for k, (e, d) in enumerate(zip(experts, data))
        ],
    }
    with open(path, "w", encoding="utf-8") as fp:
        yaml.safe_dump(raw, fp)
    return path


def _rows(batches: list[dict[str, torch.Tensor]]) -> list[tuple[int, ...]]:
    """The token rows of padded batches (padding dropped)."""
    return [
        tuple(ids[mask.bool()].tolist())
        for b in batches
        for ids, mask in zip(b["input_ids"], b["attention_mask"])
    ]


@pytest.fixture(scope="module")
def merge(tiny_llama_set, tmp_path_factory):
    """A regmean merge of two tiny Llama experts, with the rows the merge read, per task."""
    root = tmp_path_factory.mktemp("heldout")
    experts = list(tiny_llama_set.experts[:2])
    data = [_write_unique_texts(str(root / f"t{k}.jsonl"), 20 + k, 15) for k in range(2)]
    config = _write_config(str(root / "merge.yml"), tiny_llama_set.base, experts, data)
    read: dict[str, Any] = {}
    original = plan_module.load_calibration

    def spy(spec, path, *, task, **kw):
        loaded = original(spec, path, task=task, **kw)
        read[task] = loaded
        return loaded

    out = str(root / "merged")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan_module, "load_calibration", spy)
        result = CliRunner().invoke(main, ["run", config, out])
    assert result.exit_code == 0, result.output
    assert set(read) == {"task0", "task1"}  # the spy saw the merge's data
    return {"config": config, "out": out, "read": read, "root": root, "data": data}


def _spy_diagnose_data(monkeypatch) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    original = heldout_module.load_calibration

    def spy(spec, path, *, task, **kw):
        loaded = original(spec, path, task=task, **kw)
        seen[task] = loaded  # the last load of a task is what diagnose runs
        return loaded

    monkeypatch.setattr(heldout_module, "load_calibration", spy)
    return seen


# ------------------------------------------------------------------------------------------
# Held-out data


def test_default_data_is_what_the_merge_did_not_read(merge, monkeypatch):
    seen = _spy_diagnose_data(monkeypatch)
    result = diagnose(load_config(merge["config"]), merge["out"])
    assert result["evaluated_on"] == "held-out"
    for task in ("task0", "task1"):
        used, held = merge["read"][task], seen[task]
        assert used.num_samples == SAMPLES and held.num_samples == SAMPLES
        assert set(used.rows_read).isdisjoint(held.rows_read)
        assert set(_rows(used.batches)).isdisjoint(_rows(held.batches))  # not one text seen
        info = result["data"][task]
        assert info["kind"] == "held-out" and info["heldout"] is True
        assert info["samples"] == SAMPLES and info["tokens"] == held.num_tokens > 0
        assert info["excluded_examples"] == SAMPLES
        assert "did not read" in info["note"]
        assert result["tasks"][task]["samples"] == SAMPLES
        assert result["tasks"][task]["data"] == "held-out"
    # --calibration-data measures on exactly what the merge read
    seen.clear()
    on_seen = diagnose(load_config(merge["config"]), merge["out"], data="calibration")
    for task in ("task0", "task1"):
        assert _rows(seen[task].batches) == _rows(merge["read"][task].batches)
        assert on_seen["data"][task]["kind"] == "calibration"
    assert "calibration data the merge read, which flatters it" in on_seen["verdict"]


@pytest.mark.parametrize("pack", [False, True])
def test_heldout_leaves_out_every_example_read(tiny_llama_set, tmp_path, pack):
    """Packing reads part of the last example: it is left out too."""
    data = _write_unique_texts(str(tmp_path / "t.jsonl"), 3, 40)
    spec = CalibrationSpec(path=data, samples=5, max_length=7, pack=pack)
    used = load_calibration(spec, tiny_llama_set.base, task="t", modality="text")
    held = load_calibration(spec, tiny_llama_set.base, task="t", modality="text", exclude=[spec])
    assert held.rows_excluded == len(used.rows_read) >= 5
    assert set(used.rows_read).isdisjoint(held.rows_read)
    other_seed = spec.model_copy(update={"seed": 1})  # another order, still disjoint
    held = load_calibration(
        other_seed, tiny_llama_set.base, task="t", modality="text", exclude=[spec]
    )
    assert set(used.rows_read).isdisjoint(held.rows_read) and held.num_samples == 5
    # another file cannot overlap: nothing is left out
    other = _write_unique_texts(str(tmp_path / "o.jsonl"), 4, 40)
    held = load_calibration(
        spec.model_copy(update={"path": other}), tiny_llama_set.base, task="t", exclude=[spec]
    )
    assert held.rows_excluded == 0


def test_no_unused_example_falls_back_loudly(tiny_llama_set, tmp_path, caplog):
    experts = list(tiny_llama_set.experts[:2])
    data = [
        _write_unique_texts(str(tmp_path / "small.jsonl"), 5, SAMPLES),  # all read by the merge
        _write_unique_texts(str(tmp_path / "large.jsonl"), 6, 3 * SAMPLES),
    ]
    config = _write_config(str(tmp_path / "m.yml"), tiny_llama_set.base, experts, data)
    spec = load_config(config).calibration_for(load_config(config).models[0])
    with pytest.raises(NoUnusedCalibrationData, match="did not read"):
        load_calibration(spec, experts[0], task="task0", exclude=[spec])
    result = diagnose(load_config(config), tiny_llama_set.base)
    small, large = result["data"]["task0"], result["data"]["task1"]
    assert small["kind"] == "calibration" and small["heldout"] is False
    assert small["note"].startswith("SEEN DATA") and "flatter" in small["note"]
    assert small["samples"] == SAMPLES
    assert large["kind"] == "held-out"
    assert result["evaluated_on"] == "mixed"
    assert "seen calibration data for task0" in result["verdict"]
    assert any("SEEN DATA" in r.getMessage() for r in caplog.records)
    report = format_table(result)
    assert "SEEN DATA" in report


def test_heldout_file_and_mapping(merge, tmp_path, monkeypatch):
    """``--heldout`` a file for every task, ``TASK=PATH`` for one, an inline mapping."""
    other = _write_unique_texts(str(tmp_path / "other.jsonl"), 99, 8)
    config = load_config(merge["config"])
    seen = _spy_diagnose_data(monkeypatch)
    got = diagnose(config, merge["out"], heldout=[f"task1={other}"])
    assert got["data"]["task1"]["source"] == other and got["data"]["task1"]["heldout"]
    assert got["data"]["task1"]["samples"] == SAMPLES  # the task's `samples`
    assert "--heldout" in got["data"]["task1"]["note"]
    assert got["data"]["task0"]["excluded_examples"] == SAMPLES  # the default for task0
    # the same numbers as a diagnosis whose calibration data is that file, measured on it
    as_calibration = _write_config(
        str(tmp_path / "c.yml"),
        str(config.merge.base_model),
        [m.model for m in config.models],
        [merge["data"][0], other],
    )
    expected = diagnose(load_config(as_calibration), merge["out"], data="calibration")
    for key in ("agreement", "kl"):
        assert got["tasks"]["task1"][key] == expected["tasks"]["task1"][key]
    assert _rows(seen["task1"].batches) == _rows(
        load_calibration(
            CalibrationSpec(path=other, samples=SAMPLES, batch_size=3), merge["out"], task="x"
        ).batches
    )
    # an inline mapping without data fields: the merge's own source, the unread examples
    got = diagnose(config, merge["out"], heldout=["{samples: 4}"])
    for task in ("task0", "task1"):
        assert got["data"][task]["samples"] == 4
        assert got["data"][task]["excluded_examples"] == SAMPLES
        assert set(seen[task].rows_read).isdisjoint(merge["read"][task].rows_read)
    with pytest.raises(ConfigError, match="task 'nope'"):
        diagnose(config, merge["out"], heldout=[f"nope={other}"])
    with pytest.raises(ConfigError, match="--heldout"):
        diagnose(config, merge["out"], heldout=["{sample: 4}"])


# ------------------------------------------------------------------------------------------
# Reference rows and the verdict


def test_reference_rows_and_verdict(merge, tiny_llama_set):
    config = load_config(merge["config"])
    result = diagnose(config, merge["out"])
    refs = result["references"]
    base, experts = refs["base"], refs["experts"]
    assert set(experts) == {"task0", "task1"}
    for task in ("task0", "task1"):
        b = base["tasks"][task]
        assert 0.0 <= b["agreement"] <= 1.0 and b["kl"] > 1e-6
        assert len(b["blocks"]) == 2 and all(x["relative_error"] > 0 for x in b["blocks"])
        itself = experts[task]["tasks"][task]
        assert itself["itself"] and itself["agreement"] == 1.0 and itself["kl"] == 0.0
        other = experts["task1" if task == "task0" else "task0"]["tasks"][task]
        assert other["kl"] > 1e-6 and other["blocks"][-1]["relative_error"] > 0
    # the base row is the base model diagnosed as if it were the merge
    as_merge = diagnose(config, str(config.merge.base_model), references=False)
    for task in ("task0", "task1"):
        assert base["tasks"][task]["kl"] == as_merge["tasks"][task]["kl"]
        assert base["tasks"][task]["agreement"] == as_merge["tasks"][task]["agreement"]
    assert as_merge["references"]["base"] is None and as_merge["references"]["skipped"]
    assert "reference rows skipped" in as_merge["verdict"]
    ratio = result["base_ratio"]
    assert ratio == pytest.approx(base["mean_kl"] / result["mean_kl"], rel=1e-12)
    probe = result.get("probe_ratio")
    if ratio > 1 and (probe is None or probe >= PROBE_REJECT):
        assert result["verdict"].startswith("keeps ") and "× more" in result["verdict"]
    elif ratio > 1:  # better on held-out rows, but it breaks on generic text (the probe)
        assert "on generic text (the probe)" in result["verdict"]
        assert result["verdict"].endswith("do not publish")
    else:
        assert "worse than the base model" in result["verdict"]


def test_broken_merge_is_worse_than_the_base(merge, tmp_path):
    broken = str(tmp_path / "broken")
    shutil.copytree(merge["out"], broken)
    weights = os.path.join(broken, "model.safetensors")
    tensors = load_file(weights)
    tensors["model.layers.0.mlp.down_proj.weight"] *= 100
    save_file(tensors, weights, metadata={"format": "pt"})
    out_json = tmp_path / "d.json"
    result = CliRunner().invoke(
        main, ["diagnose", broken, merge["config"], "--json", str(out_json)]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out_json.read_text())
    assert data["base_ratio"] < 1.0
    assert data["verdict"].startswith("is worse than the base model on held-out data")
    assert data["verdict"].endswith("do not publish")
    assert set(data["worse_than_base_on"]) == {"task0", "task1"}
    assert f"{broken} is worse than the base model" in result.output
    assert "(base)" in result.output and "(expert task0 alone)" in result.output


def test_verdict_words_and_non_finite_json(tmp_path):
    held = {"t": {"kind": "held-out"}}
    assert verdict(2.2, 0.1, 0.22, "kl", "held-out", held).startswith(
        "keeps 2.2× more of the experts' behaviour than the base model on held-out data"
    )
    assert verdict(0.5, 0.2, 0.1, "kl", "held-out", held).endswith("do not publish")
    assert verdict(math.inf, 0.0, 0.1, "kl", "held-out", held).startswith("matches the experts")
    assert verdict(math.nan, math.nan, 0.1, "kl", "held-out", held).startswith("is broken")
    text = verdict(1.5, 0.1, 0.15, "kl", "held-out", held, ["t"], [("t", 0.05)])
    assert "worse than the base model on t" in text and "the t expert alone" in text
    # inf and NaN are written as such, not dropped
    from mergekit_ext.cli import write_diagnosis_json

    path = str(tmp_path / "d.json")
    write_diagnosis_json({"base_ratio": math.inf, "mean_kl": math.nan, "x": [-math.inf]}, path)
    saved = json.loads(open(path, encoding="utf-8").read())
    assert saved == {"base_ratio": "inf", "mean_kl": "nan", "x": ["-inf"]}
    assert math.isinf(as_float(saved["base_ratio"])) and math.isnan(as_float(saved["mean_kl"]))


def test_expert_as_merge_matches_exactly(tiny_llama_set, tmp_path):
    """One task, the merged folder is its expert: KL 0, base_ratio inf in the JSON."""
    expert = tiny_llama_set.experts[0]
    data = _write_unique_texts(str(tmp_path / "t.jsonl"), 1, 3 * SAMPLES)
    config = _write_config(str(tmp_path / "m.yml"), tiny_llama_set.base, [expert], [data])
    out_json = tmp_path / "d.json"
    result = CliRunner().invoke(main, ["diagnose", expert, config, "--json", str(out_json)])
    assert result.exit_code == 0, result.output
    saved = json.loads(out_json.read_text())
    assert saved["base_ratio"] == "inf" and saved["mean_kl"] == 0.0
    assert saved["verdict"].startswith("matches the experts exactly on held-out data")


# ------------------------------------------------------------------------------------------
# Several merged folders in one call


def test_several_folders_share_the_expert_passes(merge, tiny_llama_set, monkeypatch):
    config = load_config(merge["config"])
    folders = [merge["out"], tiny_llama_set.experts[2]]
    calls: Counter[str] = Counter()
    original = diagnose_module._Walker.run_block

    def counting(self, index, params, hidden, call):
        calls[os.path.realpath(self.source.path)] += 1
        return original(self, index, params, hidden, call)

    monkeypatch.setattr(diagnose_module._Walker, "run_block", counting)
    # without the probe: its passes share the same way (counted in the probe's own test)
    together = diagnose(config, folders, probe=False)
    joint = dict(calls)
    singles = []
    per_call = []
    for folder in folders:
        calls.clear()
        singles.append(diagnose(config, folder, probe=False))
        per_call.append(dict(calls))
    for got, alone in zip(together, singles):
        assert got["merged"] == alone["merged"]
        for task in ("task0", "task1"):
            a, b = got["tasks"][task], alone["tasks"][task]
            assert a["kl"] == b["kl"] and a["agreement"] == b["agreement"]
            assert [x["relative_error"] for x in a["blocks"]] == [
                x["relative_error"] for x in b["blocks"]
            ]
        assert got["verdict"] == alone["verdict"] and got["base_ratio"] == alone["base_ratio"]
    # experts and base: as many block passes as one single-folder call, not one per folder
    references = [os.path.realpath(p) for p in [tiny_llama_set.base, *tiny_llama_set.experts[:2]]]
    for ref in references:
        assert joint[ref] == per_call[0][ref] == per_call[1][ref] > 0
    # task expert (1 pass) + the other expert alone (1 pass) per task and batch
    batches = 2  # SAMPLES / batch_size
    expert0 = os.path.realpath(tiny_llama_set.experts[0])
    assert joint[expert0] == 2 * 2 * batches  # 2 blocks; its own task and the other one
    for folder in folders:
        assert (
            joint[os.path.realpath(folder)]
            == per_call[folders.index(folder)][os.path.realpath(folder)]
        )


def test_cli_several_folders_json_and_plot(merge, tiny_llama_set, tmp_path):
    folders = [merge["out"], tiny_llama_set.experts[2]]
    out_json, plots = tmp_path / "d.json", tmp_path / "plots"
    args = ["diagnose", *folders, merge["config"], "--json", str(out_json), "--plots", str(plots)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    saved = json.loads(out_json.read_text())
    assert [r["merged"] for r in saved] == folders
    assert all(r["verdict"] and r["references"]["base"] for r in saved)
    assert result.output.count("(merged)") == 2 and result.output.count("(base)") == 1
    assert (plots / "diagnose_block_errors.png").stat().st_size > 1000
    # --no-references: no reference rows, no verdict against the base
    result = CliRunner().invoke(main, ["diagnose", folders[0], merge["config"], "--no-references"])
    assert result.exit_code == 0, result.output
    assert "(base)" not in result.output and "reference rows skipped" in result.output


def test_plot_block_ticks_are_integers(merge):
    result = diagnose(load_config(merge["config"]), merge["out"])
    fig = block_error_figure([result])
    assert len(fig.axes) == 2  # one panel per task
    for ax in fig.axes:
        ticks = [t for t in ax.get_xticks()]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
        labels = {line.get_label() for line in ax.get_lines()}
        assert "base model" in labels and any("alone" in label for label in labels)


def test_card_shows_the_base_model_and_the_verdict(merge, tmp_path):
    out = str(tmp_path / "merged")
    shutil.copytree(merge["out"], out)
    result = CliRunner().invoke(main, ["card", out, "--diagnose", merge["config"]])
    assert result.exit_code == 0, result.output
    card = open(os.path.join(out, "README.md"), encoding="utf-8").read()
    saved = json.loads(open(os.path.join(out, "mergekit_ext_diagnose.json")).read())
    assert f"**Verdict:** this model {saved['verdict']}." in card
    header = next(line for line in card.splitlines() if line.startswith("| Task | Agreement"))
    assert "KL(expert ‖ base model)" in header
    section = card.split("## Agreement with the experts", 1)[1]
    row = next(line for line in section.splitlines() if line.startswith("| task0 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    base_kl = saved["references"]["base"]["tasks"]["task0"]["kl"]
    assert float(cells[3]) == pytest.approx(base_kl, rel=5e-3)  # 3 significant digits


def test_missing_base_model_names_the_way_out(tiny_llama_set, tmp_path):
    data = _write_unique_texts(str(tmp_path / "t.jsonl"), 1, 3 * SAMPLES)
    missing = str(tmp_path / "no_such_base")
    config = _write_config(str(tmp_path / "m.yml"), missing, [tiny_llama_set.experts[0]], [data])
    result = CliRunner().invoke(main, ["diagnose", tiny_llama_set.experts[1], config])
    assert result.exit_code == 1 and "no_such_base" in result.output
    assert "--no-references" in result.output
    result = CliRunner().invoke(
        main, ["diagnose", tiny_llama_set.experts[1], config, "--no-references"]
    )
    assert result.exit_code == 0, result.output
