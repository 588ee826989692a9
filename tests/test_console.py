"""What the command line prints (issue #32, items 13 and 14): warnings through progress bars,
one ``warning:``/``error:`` style, ``-v/--verbose`` everywhere, phase lines, the +LoRA copies
beside OUT_DIR, the token and offline mode read through huggingface_hub."""

from __future__ import annotations

import logging
import os
import shutil

import click
import pytest
import transformers
import yaml
from click.testing import CliRunner
from huggingface_hub import constants as hf_constants
from tiny_models import make_experts, make_lora_experts, make_tiny_llama
from tqdm.auto import tqdm

from mergekit_ext import checks, offline
from mergekit_ext.cli import main
from mergekit_ext.config import load_config
from mergekit_ext.console import cli_errors
from mergekit_ext.hub.publish import resolve_token


def _last_segment(line: str) -> str:
    """What a terminal shows of a line that carriage returns redraw."""
    return line.rsplit("\r", 1)[-1]


def test_warning_during_a_progress_bar_is_printed_once_on_its_own_line() -> None:
    @click.command()
    @click.option("-v", "--verbose", count=True)
    @cli_errors(lambda kwargs: kwargs.get("verbose", 0))
    def work(verbose: int) -> None:
        for i in tqdm(range(10), desc="blocks", mininterval=0):
            if i == 5:
                logging.getLogger("mergekit_ext.executor.sequential").warning("boom in block 5")

    result = CliRunner().invoke(work, [], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    lines = [_last_segment(line) for line in result.output.split("\n")]
    assert lines.count("warning: boom in block 5") == 1, repr(result.output)
    assert "10/10" in result.output  # the bar went on after the warning


def test_every_command_accepts_verbose() -> None:
    runner = CliRunner()
    for name in main.commands:
        out = runner.invoke(main, [name, "--help"], catch_exceptions=False).output
        assert "-v, --verbose" in out, (name, out)
    assert runner.invoke(main, ["methods", "--verbose", "linear"]).exit_code == 0
    assert runner.invoke(main, ["methods", "-v", "linear"]).exit_code == 0


def test_one_error_style_across_commands(tmp_path) -> None:
    runner = CliRunner()
    methods = runner.invoke(main, ["methods", "no_such_method"])
    assert methods.exit_code == 1
    assert methods.output.startswith("error: unknown merge_method"), methods.output
    empty = tmp_path / "empty"
    empty.mkdir()
    for args in (["card", str(empty)], ["publish", str(empty), "--repo-id", "a/b", "--dry-run"]):
        result = runner.invoke(main, args)
        assert result.exit_code == 1, (args, result.output)
        assert result.output.startswith("error: "), (args, result.output)
        assert "Error:" not in result.output and "Traceback" not in result.output


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    root = tmp_path_factory.mktemp("console_models")
    base = make_tiny_llama(str(root / "base"), seed=0)
    experts = make_experts(base, [str(root / f"e{i}") for i in range(2)], scale=0.05, seed=3)
    return root, base, experts


def test_tokenizer_warning_absent_when_tokenizer_source_is_set(llamas, tmp_path) -> None:
    root, base, experts = llamas
    other = tmp_path / "other_tokenizer"
    shutil.copytree(experts[1], other)
    with open(other / "tokenizer.json", "a", encoding="utf-8") as fp:
        fp.write("\n")  # another file: another digest

    def config(**extra) -> str:
        path = tmp_path / f"c{len(extra)}.yml"
        models = [{"model": experts[0]}, {"model": str(other)}]
        cfg = {"merge_method": "linear", "models": models, "dtype": "float32", **extra}
        for m in models:
            m["parameters"] = {"weight": 0.5}
        path.write_text(yaml.safe_dump(cfg))
        return str(path)

    assert checks.warn_tokenizers_differ(load_config(config()))  # the warning exists
    assert checks.warn_tokenizers_differ(load_config(config(tokenizer_source="base"))) == []


def test_lora_copies_beside_out_dir_and_phase_lines(llamas, tmp_path, monkeypatch) -> None:
    """``model+adapter`` with no --lora-merge-cache: mergekit's full-size merged copy is
    written inside the hidden partial output (not $TMPDIR) and removed; the phases after
    the merge are each announced on one line without -v."""
    import mergekit.merge

    root, base, experts = llamas
    adapters, _ = make_lora_experts(
        base, str(tmp_path / "lora"), transformers.LlamaForCausalLM, ["q_proj", "v_proj"]
    )
    seen = {}
    original = mergekit.merge.run_merge

    def recording_run_merge(config, out_path, options, **kw):
        original(config, out_path, options, **kw)
        seen["cache"] = options.lora_merge_cache
        seen["out"] = out_path
        seen["contents"] = os.listdir(options.lora_merge_cache)

    monkeypatch.setattr(mergekit.merge, "run_merge", recording_run_merge)
    cfg = {
        "merge_method": "ties",
        "base_model": base,
        "models": [
            {"model": f"{base}+{adapters[0]}", "parameters": {"weight": 0.5, "density": 0.5}},
            {"model": experts[0], "parameters": {"weight": 0.5, "density": 0.5}},
        ],
        "dtype": "float32",
    }
    config = tmp_path / "ties.yml"
    config.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["run", str(config), str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert os.path.dirname(seen["cache"]) == seen["out"]  # inside the partial output
    assert ".partial-" in os.path.basename(seen["out"]) and seen["contents"], seen
    assert not os.path.exists(seen["cache"])  # removed after the merge
    assert ".lora-merge-cache" not in os.listdir(out)
    assert [n for n in os.listdir(tmp_path) if ".partial-" in n] == []
    lines = [_last_segment(line) for line in result.output.splitlines()]
    for phase in (
        "checking every written tensor is finite",
        "checking the checkpoint is complete, in the base model's layout",
        "writing mergekit_config.yml, the diagnostics and the model card",
    ):
        assert lines.count(phase) == 1, (phase, result.output)


def test_token_precedence(tmp_path, monkeypatch) -> None:
    token_file = tmp_path / "hf" / "token"
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(token_file))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    assert resolve_token(None) == (None, "")
    token_file.parent.mkdir()
    token_file.write_text("hf_cachedlogin000000000000000000000")
    assert resolve_token(None) == (
        "hf_cachedlogin000000000000000000000",
        "the cached login (hf auth login)",
    )
    monkeypatch.setenv("HF_TOKEN", "hf_environment0000000000000000000000")
    assert resolve_token(None) == ("hf_environment0000000000000000000000", "HF_TOKEN")
    assert resolve_token("hf_flag") == ("hf_flag", "--token")


def test_offline_mode_has_one_source(monkeypatch) -> None:
    """``hub_offline`` answers what huggingface_hub acts on, and publishing asks it."""
    from mergekit_ext.errors import PublishError
    from mergekit_ext.hub.publish import check_can_publish

    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    assert not offline.hub_offline()
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    assert offline.hub_offline()
    with pytest.raises(PublishError, match="HF_HUB_OFFLINE"):
        check_can_publish("alice/x", token="hf_flag")


def test_dry_run_prints_each_plan_warning_once(tiny_llama_set, tmp_path) -> None:
    """Too few calibration tokens for the groups' width: the plan lists the rank warnings
    (``warning: ...``) and the planner's log of the same warnings is not printed again."""
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "a b c"}\n{"text": "d e"}\n')
    base, experts = tiny_llama_set.base, tiny_llama_set.experts[:2]
    models = [
        {"model": e, "name": f"t{k}", "calibration": {"path": str(data), "samples": 2}}
        for k, e in enumerate(experts)
    ]
    config = tmp_path / "com.yml"
    config.write_text(
        yaml.safe_dump({"merge_method": "chain_of_merges", "base_model": base, "models": models})
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["run", str(config), str(out), "--dry-run"])
    assert result.exit_code == 0, result.output
    warned = [line for line in result.output.splitlines() if line.startswith("warning: ")]
    ranks = [line for line in warned if "ranks from" in line]
    assert ranks, result.output
    assert len(ranks) == len(set(ranks)), result.output  # each once
    assert not out.exists()


def test_data_aware_merge_announces_writing_the_last_shard(llamas, tmp_path) -> None:
    """The layer-wise executor says when it writes the last shard and the index (the step
    after the last block's progress bar), once, without ``-v``."""
    from mergekit_ext.testing import WORDS

    root, base, experts = llamas
    data = tmp_path / "calibration.jsonl"
    data.write_text(
        "".join(
            f'{{"text": "{" ".join(WORDS[i % len(WORDS) :] + WORDS[:3])}"}}\n' for i in range(8)
        )
    )
    cfg = {
        "merge_method": "regmean",
        "base_model": base,
        "models": [
            {"model": e, "name": f"t{k}", "calibration": {"path": str(data), "samples": 8}}
            for k, e in enumerate(experts)
        ],
    }
    config = tmp_path / "regmean.yml"
    config.write_text(yaml.safe_dump(cfg))
    result = CliRunner().invoke(
        main, ["run", str(config), str(tmp_path / "out")], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    lines = [_last_segment(line) for line in result.output.splitlines()]
    assert lines.count("writing the last checkpoint shard and the shard index") == 1, result.output
