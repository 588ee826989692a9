"""Issue #32 (items 9-12, 15): calibration data in the forms community mergers have
(ShareGPT, sliced splits), mergekit's parameter values checked before anything loads, cached
Hub ids offline with mergekit's methods, and the Python API's options and result.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file

import mergekit_ext
from mergekit_ext.cli import main
from mergekit_ext.errors import ConfigError
from mergekit_ext.testing import make_experts, make_tiny_llama

# Role markers are words of the tiny vocabulary, so a rendered sample reads back exactly.
CHAT_TEMPLATE = (
    "{% for m in messages %}<s> "
    "{% if m['role'] == 'user' %}vote{% elif m['role'] == 'assistant' %}party{% else %}law{% endif %}"
    " {{ m['content'] }} </s> {% endfor %}"
)
CONVERSATIONS = [
    [("system", "the law is good"), ("user", "the news of the market"), ("assistant", "good news")],
    [("user", "a film review"), ("assistant", "a great film")],
    [("user", "tea and coffee"), ("assistant", "coffee")],
    [("user", "the weather"), ("assistant", "rain and sun")],
]
SHAREGPT_FROM = {"system": "system", "user": "human", "assistant": "gpt"}


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("community")
    base = make_tiny_llama(str(root / "base"), seed=0)
    experts = make_experts(base, [str(root / "a"), str(root / "b")], scale=0.05, seed=1)
    for folder in (base, *experts):
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(folder)
    words = "the news of the market is good and the team will win the game".split()
    texts = root / "texts.jsonl"
    texts.write_text(
        "".join(json.dumps({"text": " ".join(words[i : i + 5])}) + "\n" for i in range(10))
    )
    messages = root / "messages.jsonl"
    messages.write_text(
        "".join(
            json.dumps({"id": k, "messages": [{"role": r, "content": c} for r, c in conv]}) + "\n"
            for k, conv in enumerate(CONVERSATIONS)
        )
    )
    sharegpt = root / "sharegpt.jsonl"
    sharegpt.write_text(
        "".join(
            json.dumps(
                {
                    "id": k,
                    "conversations": [{"from": SHAREGPT_FROM[r], "value": c} for r, c in conv],
                }
            )
            + "\n"
            for k, conv in enumerate(CONVERSATIONS)
        )
    )
    return {
        "root": root,
        "base": base,
        "experts": experts,
        "texts": str(texts),
        "messages": str(messages),
        "sharegpt": str(sharegpt),
    }


def _write(path, cfg) -> str:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return str(path)


def _run(args):
    return CliRunner().invoke(main, args, catch_exceptions=False)


def _ties(llamas, **params) -> dict:
    a, b = llamas["experts"]
    return {
        "merge_method": "ties",
        "base_model": llamas["base"],
        "models": [
            {"model": a, "parameters": {"weight": 0.5, "density": params.get("density", 0.5)}},
            {"model": b, "parameters": {"weight": 0.5, "density": 0.5}},
        ],
        "dtype": "float32",
    }


# ------------------------------------------------------------------------------ item 11


@pytest.mark.parametrize(
    ("density", "expected"),
    [
        ("high", r"models\[0\] \(.*/a\)\.parameters: density: 'high' is not a valid value"),
        (1.7, r"models\[0\] \(.*/a\)\.parameters: density is 1\.7, outside \[0, 1\]"),
        (float("nan"), r"density is nan; ties needs a finite number"),
        ([0.2, "x"], r"density: 'x' is not a valid value"),
    ],
)
def test_mergekit_parameter_values_refused_before_anything_loads(
    llamas, tmp_path, density, expected
):
    config = _write(tmp_path / "ties.yml", _ties(llamas, density=density))
    for extra in (["--dry-run"], []):
        result = _run(["run", config, str(tmp_path / "out"), *extra])
        assert result.exit_code == 1, result.output
        assert re.search(expected, result.output), result.output
        assert "validation error" not in result.output  # not pydantic's raw text
    assert not os.path.exists(tmp_path / "out")


def test_mergekit_parameter_values_in_range_and_gradients_pass(llamas, tmp_path):
    cfg = _ties(llamas)
    cfg["models"][0]["parameters"]["density"] = [0.2, 0.9]
    cfg["models"][1]["parameters"]["density"] = [{"filter": "mlp", "value": 0.3}, {"value": 1}]
    result = _run(["run", _write(tmp_path / "ok.yml", cfg), str(tmp_path / "out"), "--dry-run"])
    assert result.exit_code == 0, result.output


def test_della_density_epsilon_checked_together(llamas, tmp_path):
    cfg = _ties(llamas, density=0.9)
    cfg["merge_method"] = "della"
    cfg["parameters"] = {"epsilon": 0.2}
    result = _run(["run", _write(tmp_path / "d.yml", cfg), str(tmp_path / "out"), "--dry-run"])
    assert result.exit_code == 1
    assert "density ± epsilon inside (0, 1)" in result.output
    assert "density 0.9 with epsilon 0.2" in result.output


def test_unknown_top_level_and_model_keys_warn_with_the_nearest(llamas, tmp_path, caplog):
    cfg = _ties(llamas)
    cfg["dtyp"] = cfg.pop("dtype")
    cfg["models"][1]["paramters"] = cfg["models"][1].pop("parameters")
    config = _write(tmp_path / "typo.yml", cfg)
    with caplog.at_level(logging.WARNING):
        mergekit_ext.parse_config(open(config).read(), config)
    text = caplog.text
    assert "unknown key 'dtyp' is ignored (did you mean 'dtype'?)" in text
    assert (
        "models[1]" in text
        and "unknown key 'paramters' is ignored (did you mean 'parameters'?)" in text
    )


# ------------------------------------------------------------------------------ item 12

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cache(hf_home: str, repo_id: str, folder: str) -> None:
    """``folder`` as huggingface_hub lays out a cached snapshot: refs/main names a commit."""
    repo = os.path.join(hf_home, "hub", "models--" + repo_id.replace("/", "--"))
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as fp:
        fp.write(COMMIT)
    shutil.copytree(folder, os.path.join(repo, "snapshots", COMMIT))


def test_cached_hub_ids_work_offline_with_mergekit_methods(llamas, tmp_path):
    hf_home = str(tmp_path / "hf_home")
    a, b = llamas["experts"]
    for repo_id, folder in (("org/base", llamas["base"]), ("org/a", a), ("org/b", b)):
        _cache(hf_home, repo_id, folder)
    hub_cfg = _ties(llamas)
    hub_cfg["base_model"] = "org/base"
    hub_cfg["models"][0]["model"] = "org/a"
    hub_cfg["models"][1]["model"] = "org/b@main"
    hub_cfg["models"][1]["parameters"]["density"] = 0.3  # per-model values still bind
    config = _write(tmp_path / "hub.yml", hub_cfg)
    env = dict(os.environ, HF_HOME=hf_home, HF_HUB_OFFLINE="1", PYTHONPATH=REPO_ROOT)
    env.pop("HF_HUB_CACHE", None)
    out = tmp_path / "from_hub"
    proc = subprocess.run(
        [sys.executable, "-m", "mergekit_ext", "run", config, str(out), "--no-write-model-card"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "OfflineModeIsEnabled" not in proc.stderr
    local_cfg = _ties(llamas)
    local_cfg["models"][1]["parameters"]["density"] = 0.3
    local = tmp_path / "local"
    mergekit_ext.run_merge(local_cfg, local, {"write_model_card": False})
    hub_tensors, local_tensors = (
        load_file(str(out / "model.safetensors")),
        load_file(str(local / "model.safetensors")),
    )
    assert sorted(hub_tensors) == sorted(local_tensors)
    for name, tensor in hub_tensors.items():
        assert torch.equal(tensor, local_tensors[name]), name
    # the written config keeps the Hub ids, never the snapshot folders
    written = (out / "mergekit_config.yml").read_text()
    assert "org/a" in written and "snapshots" not in written


# ------------------------------------------------------------------------------ item 15


def test_api_returns_a_result_with_path_diagnostics_and_plan(llamas, tmp_path):
    cfg = _ties(llamas)
    out = tmp_path / "out"
    result = mergekit_ext.run_merge(cfg, out, {"random_seed": 0, "write_model_card": False})
    assert isinstance(result, mergekit_ext.MergeResult)
    assert result.path == str(out) and not result.dry_run
    # it still works where the old return value (the path) was used
    assert result == str(out) and os.fspath(result) == str(out) and str(result) == str(out)
    assert os.path.exists(os.path.join(result, "model.safetensors"))
    on_disk = json.loads((out / "mergekit_ext_diagnostics.json").read_text())
    assert result.diagnostics == on_disk and result.diagnostics["method"] == "ties"

    dry = mergekit_ext.run_merge(cfg, tmp_path / "dry", run_options={"dry_run": True})
    assert dry.dry_run and dry.path is None and dry.diagnostics == {}
    assert "method: ties" in dry.plan and llamas["base"] in dry.plan
    assert not os.path.exists(tmp_path / "dry")
    with pytest.raises(TypeError, match="dry run writes nothing"):
        os.fspath(dry)


def test_api_rejects_unknown_option_keys_naming_the_nearest(llamas, tmp_path):
    cfg = _ties(llamas)
    with pytest.raises(
        ConfigError, match=r"unknown options key 'random_sed'; did you mean 'random_seed'\?"
    ):
        mergekit_ext.run_merge(cfg, tmp_path / "out", {"random_sed": 0})
    with pytest.raises(
        ConfigError, match=r"unknown run_options key 'overwite'; did you mean 'overwrite'\?"
    ):
        mergekit_ext.run_merge(cfg, tmp_path / "out", run_options={"overwite": True})
    with pytest.raises(
        ConfigError, match=r"'dry_run' is one of mergekit-ext's own options.*run_options"
    ):
        mergekit_ext.run_merge(cfg, tmp_path / "out", {"dry_run": True})
    assert not os.path.exists(tmp_path / "out")


def test_api_refuses_model_objects_with_what_to_do(llamas, tmp_path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(llamas["experts"][0])
    cfg = _ties(llamas)
    cfg["models"][0]["model"] = model
    hint = "pass folders or Hub ids; save in-memory models with save_pretrained first"
    with pytest.raises(
        ConfigError, match=r"config\.models\[0\]\.model is a LlamaForCausalLM; " + hint
    ):
        mergekit_ext.run_merge(cfg, tmp_path / "out")
    with pytest.raises(ConfigError, match="config is a LlamaForCausalLM; " + hint):
        mergekit_ext.run_merge(model, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")


# ------------------------------------------------------------------------------ item 9


def _regmean(llamas, calibration: dict) -> dict:
    a, b = llamas["experts"]
    return {
        "merge_method": "regmean",
        "base_model": llamas["base"],
        "models": [{"model": a, "name": "a"}, {"model": b, "name": "b"}],
        "calibration": {"samples": 4, "max_length": 64, **calibration},
        "dtype": "float32",
    }


def _rendered(conv) -> str:
    markers = {"system": "law", "user": "vote", "assistant": "party"}
    return " ".join(f"<s> {markers[role]} {content} </s>" for role, content in conv)


def _rows(data) -> list[list[int]]:
    out = []
    for batch in data.batches:
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
            out.append(ids[mask.bool()].tolist())
    return out


def test_sharegpt_conversations_render_as_the_same_messages(llamas):
    import transformers

    from mergekit_ext.calibration import CalibrationSpec, load_calibration

    model = llamas["experts"][0]
    sharegpt = load_calibration(
        CalibrationSpec(path=llamas["sharegpt"], apply_chat_template=True, max_length=64),
        model,
        task="t",
    )
    openai = load_calibration(
        CalibrationSpec(path=llamas["messages"], apply_chat_template=True, max_length=64),
        model,
        task="t",
    )
    # human -> user, gpt -> assistant, system -> system: the very same tokens
    assert _rows(sharegpt) == _rows(openai) and sharegpt.num_samples == 4
    # what the template made of the roles (law: system, vote: user, party: assistant)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    decoded = sorted(tokenizer.decode(row) for row in _rows(sharegpt))
    assert decoded == sorted(_rendered(conv) for conv in CONVERSATIONS)


def test_sharegpt_dry_run_shows_the_rendered_sample(llamas, tmp_path):
    cfg = _regmean(llamas, {"path": llamas["sharegpt"], "apply_chat_template": True})
    result = _run(["run", _write(tmp_path / "c.yml", cfg), str(tmp_path / "out"), "--dry-run"])
    assert result.exit_code == 0, result.output
    first = next(line for line in result.output.splitlines() if "first sample" in line)
    sample = first.split("first sample: ", 1)[1].strip("'")
    assert sample in [_rendered(conv) for conv in CONVERSATIONS]
    assert result.output.count("first sample") == 2  # one per task
    assert not os.path.exists(tmp_path / "out")


def test_unknown_conversation_shapes_name_the_file_and_row(llamas, tmp_path):
    from mergekit_ext.calibration import CalibrationSpec, load_calibration
    from mergekit_ext.errors import CalibrationError

    rows = [{"conversations": [{"from": "human", "value": "the news"}]} for _ in range(3)]
    rows.append({"conversations": [{"speaker": "human", "text": "the news"}]})
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = CalibrationSpec(path=str(bad), apply_chat_template=True, samples=4)
    with pytest.raises(CalibrationError) as e:
        load_calibration(spec, llamas["experts"][0], task="t")
    message = str(e.value)
    assert f"row 3 of calibration data {str(bad)!r}" in message
    assert "message 0 has the keys speaker, text" in message
    assert "{role, content}" in message and "{from, value}" in message
    rows[3] = {"conversations": [{"from": "bot", "value": "the news"}]}
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(
        CalibrationError, match=r"row 3 .*from: 'bot'; ShareGPT roles are human, gpt"
    ):
        load_calibration(spec, llamas["experts"][0], task="t")


def test_messages_column_without_the_chat_flag_says_to_set_it(llamas, tmp_path):
    for data, column in ((llamas["messages"], "messages"), (llamas["sharegpt"], "conversations")):
        cfg = _regmean(llamas, {"path": data})
        result = _run(["run", _write(tmp_path / "m.yml", cfg), str(tmp_path / "out"), "--dry-run"])
        assert result.exit_code == 1
        assert f"has a '{column}' column of chat messages: set `apply_chat_template: true`" in (
            result.output
        )


def test_old_chat_template_flag_is_read_with_a_deprecation_warning(llamas, tmp_path, caplog):
    from mergekit_ext.calibration import load_calibration

    old = _regmean(llamas, {"path": llamas["messages"], "chat_template": True})
    new = _regmean(llamas, {"path": llamas["messages"], "apply_chat_template": True})
    with caplog.at_level(logging.WARNING):
        old_cfg = mergekit_ext.parse_config(yaml.safe_dump(old), "old.yml")
    assert "old.yml: calibration: `chat_template:` is deprecated" in caplog.text
    assert "write `apply_chat_template: true`" in caplog.text
    new_cfg = mergekit_ext.parse_config(yaml.safe_dump(new), "new.yml")
    model = llamas["experts"][0]
    a = load_calibration(old_cfg.calibration_for(old_cfg.models[0]), model, task="a")
    b = load_calibration(new_cfg.calibration_for(new_cfg.models[0]), model, task="a")
    assert _rows(a) == _rows(b) and a.sha256 == b.sha256
    # the top-level `chat_template: chatml` (mergekit's) is no calibration field
    both = dict(new, chat_template="chatml")
    assert mergekit_ext.parse_config(yaml.safe_dump(both)).merge.chat_template == "chatml"
    clash = _regmean(
        llamas, {"path": llamas["messages"], "chat_template": True, "apply_chat_template": False}
    )
    with pytest.raises(ConfigError, match="disagree; keep only apply_chat_template"):
        mergekit_ext.parse_config(yaml.safe_dump(clash))


# ------------------------------------------------------------------------------ item 10


@pytest.mark.parametrize(
    ("split", "rows"),
    [("train[:4]", range(0, 4)), ("train[3:7]", range(3, 7)), ("train[50%:]", range(5, 10))],
)
def test_split_slices_read_only_their_rows(llamas, split, rows):
    from mergekit_ext.calibration import CalibrationSpec, load_calibration

    spec = CalibrationSpec(path=llamas["texts"], split=split, samples=10, max_length=64)
    data = load_calibration(spec, llamas["experts"][0], task="t")
    # row indices are the whole file's: the slice's rows, every one of them
    assert sorted(data.rows_read) == list(rows) and data.num_samples == len(rows)
    assert data.split == f"{split}: rows {rows[0]}-{rows[-1]} of 10"
    whole = load_calibration(
        spec.model_copy(update={"split": None}), llamas["experts"][0], task="t"
    )
    assert whole.split == "all 10 rows" and sorted(whole.rows_read) == list(range(10))
    # held-out data of another slice of the file leaves out exactly the rows the merge read
    heldout = load_calibration(
        spec.model_copy(update={"split": "train"}), llamas["experts"][0], task="t", exclude=[spec]
    )
    assert sorted(heldout.rows_read) == sorted(set(range(10)) - set(rows))
    assert heldout.rows_excluded == len(rows)


@pytest.mark.parametrize(
    ("split", "message"),
    [
        ("train[:x]", r"split 'train\[:x\]' is not valid"),
        ("validation", r"this calibration source has one split, 'train'; take a part of it"),
        ("train[:3]+train[5:]", r"joins splits"),
        ("train[8:2]", r"selects no rows of .* \(10 rows\)"),
    ],
)
def test_bad_splits_are_refused_in_a_dry_run(llamas, tmp_path, split, message):
    cfg = _regmean(llamas, {"path": llamas["texts"], "split": split})
    result = _run(["run", _write(tmp_path / "s.yml", cfg), str(tmp_path / "out"), "--dry-run"])
    assert result.exit_code == 1
    assert re.search(message, result.output), result.output


def test_dry_run_shows_split_and_sample_and_writes_nothing(llamas, tmp_path):
    hf_home = tmp_path / "hf_home"
    hf_home.mkdir()
    cfg = _regmean(llamas, {"path": llamas["texts"], "split": "train[:4]"})
    config = _write(tmp_path / "dry.yml", cfg)
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", PYTHONPATH=REPO_ROOT)
    for key in ("HF_HUB_CACHE", "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE"):
        env.pop(key, None)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "mergekit_ext", "run", config, str(out), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.strip() for line in proc.stdout.splitlines() if "first sample" in line]
    assert len(lines) == 2  # one per task
    for line in lines:
        assert line.startswith("split train[:4]: rows 0-3 of 10; first sample: '<s> ")
    written = [os.path.join(root, f) for root, _, files in os.walk(hf_home) for f in files]
    assert written == [] and os.listdir(hf_home) == []
    assert not out.exists()


def test_symerge_dry_run_shows_each_tasks_calibration(llamas, tmp_path):
    cfg = _regmean(llamas, {"path": llamas["texts"], "split": "train[2:6]", "max_length": 16})
    cfg["merge_method"] = "symerge"
    result = _run(["run", _write(tmp_path / "sy.yml", cfg), str(tmp_path / "out"), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "  - a: " in result.output and "  - b: " in result.output
    assert result.output.count("split train[2:6]: rows 2-5 of 10; first sample: '<s> ") == 2
    assert not os.path.exists(tmp_path / "out")
