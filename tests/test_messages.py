"""Every bad input of issue #49 (5b, 6, 9) gets one message naming the file, field or
option and the fix; each refusal is also run on an input it must accept. Real files and the
real CLI (click's runner), the models of ``test_safety``'s working folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import test_safety
import yaml
from test_safety import _env, _invoke

import mergekit_ext
from mergekit_ext import finite
from mergekit_ext.errors import MergekitExtError

work = test_safety.work


def _config(work, name: str, **changes) -> str:
    config = yaml.safe_load((work / "ace.yml").read_text())
    config.update(changes)
    (work / name).write_text(yaml.safe_dump(config))
    return name


def _ties(work, name: str = "ties.yml", **changes) -> str:
    params = {"weight": 0.5, "density": 0.5}
    return _config(
        work,
        name,
        merge_method="ties",
        models=[
            {"model": "m/expert_a", "parameters": params},
            {"model": "m/expert_b", "parameters": params},
        ],
        **changes,
    )


def _fails(args, *expected):
    result = _invoke(args)
    assert result.exit_code != 0, result.output
    for text in expected:
        assert text in result.output, result.output
    assert "Traceback" not in result.output
    return result.output


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--out-shard-size", "-5"], "'-5' is not a size: give a positive number"),
        (["--out-shard-size", "abc"], "'abc' is not a size"),
        (["--out-shard-size", "0"], "'0': give a positive number of parameters per shard"),
        (["--device", "tpu9"], "'--device': 'tpu9' is not a device torch knows"),
        (["-j", "-3"], "'-j': -3: give a whole number of threads, 1 or more"),
        (["--random-seed", "-1"], "'--random-seed': -1: give a whole number from 0"),
    ],
)
def test_mergekit_options_are_checked_as_parsed(work, monkeypatch, args, expected):
    """5b: were a 42-line traceback (ValueError: -5), torch's "Invalid device string", and
    "set_num_threads expects a positive integer" naming no option."""
    monkeypatch.chdir(work)
    _fails(["run", _ties(work), "out", *args], expected)
    assert not (work / "out").exists()


def test_mergekit_options_accepted(work, monkeypatch):
    monkeypatch.chdir(work)
    for args in (["--out-shard-size", "5M"], ["--device", "cpu"], ["-j", "1"]):
        result = _invoke(["run", _ties(work), "out", "--dry-run", *args])
        assert result.exit_code == 0, result.output


def test_chat_template_is_checked_for_every_method(work, monkeypatch):
    """6: ties with an unknown template merged (exit 0) with mergekit's traceback printed
    and no tokenizer written."""
    monkeypatch.chdir(work)
    _fails(
        ["run", _ties(work, chat_template="nonexistent_template_name"), "out"],
        "chat_template: Invalid chat template: nonexistent_template_name",
        "give a template name (",
    )
    assert not (work / "out").exists()
    result = _invoke(["run", _ties(work, chat_template="chatml"), "out"])
    assert result.exit_code == 0, result.output
    assert (work / "out" / "tokenizer.json").is_file()
    assert "im_start" in (work / "out" / "chat_template.jinja").read_text()


def test_calibration_file_messages(work, monkeypatch):
    monkeypatch.chdir(work)
    (work / "data" / "bad.jsonl").write_text('{"text": "hello world"}\n{"text": "trunc\n')
    cfg = _config(work, "reg.yml", merge_method="regmean", calibration={"path": "data/bad.jsonl"})
    _fails(
        ["run", cfg, "out"],
        "cannot load calibration file 'data/bad.jsonl' as json: line 2 is not valid JSON",
        "fix or remove that line",
    )
    big = 99999999999999999999
    cfg = _config(work, "seed.yml", calibration={"path": "data/texts.jsonl", "seed": big})
    _fails(["run", cfg, "out"], "calibration: field 'seed'", "less than 9223372036854775808")


def test_damaged_tokenizer_and_layer_count(work, monkeypatch):
    monkeypatch.chdir(work)
    tokenizer = work / "m" / "expert_b" / "tokenizer.json"
    good = tokenizer.read_text()
    tokenizer.write_text('{"broken')
    _fails(["run", "ace.yml", "out"], "m/expert_b/tokenizer.json is damaged: it is not JSON")
    tokenizer.write_text(good)
    config = work / "m" / "expert_b" / "config.json"
    values = json.loads(config.read_text())
    config.write_text(json.dumps({**values, "num_hidden_layers": "four"}))
    _fails(
        ["run", "ace.yml", "out"],
        "m/expert_b/config.json: num_hidden_layers is 'four', not a whole number of layers",
    )
    config.write_text(json.dumps(values))
    assert _invoke(["run", "ace.yml", "out"]).exit_code == 0


def test_config_file_messages(work, monkeypatch, caplog):
    monkeypatch.chdir(work)
    (work / "bin.yml").write_bytes((work / "m" / "base" / "model.safetensors").read_bytes()[:200])
    _fails(["run", "bin.yml", "out"], "bin.yml: not a YAML text file")
    (work / "bin2.yml").write_bytes(b"\xff\xfe\x00garbage")
    _fails(["run", "bin2.yml", "out"], "bin2.yml is not a YAML text file (byte 0 is not UTF-8)")
    _fails(
        ["run", _ties(work, "d.yml", dtype="float33"), "out"],
        "d.yml: dtype: 'float33' is not a dtype",
    )
    text = (work / _ties(work)).read_text() + "dtype: bfloat16\n"
    (work / "dup.yml").write_text(text)
    result = _invoke(["run", "dup.yml", "out", "--dry-run"])
    assert result.exit_code == 0
    assert "the key 'dtype' is given twice" in caplog.text


def test_config_from_a_stream_is_read_once(work):
    """/dev/stdin from a pipe and <(...) were "config file not found"."""
    text = (work / _ties(work)).read_text()
    cli = [sys.executable, "-m", "mergekit_ext", "run"]
    piped = subprocess.run(
        [*cli, "/dev/stdin", "out", "--dry-run"],
        input=text,
        cwd=work,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert piped.returncode == 0, piped.stderr
    substituted = subprocess.run(
        ["bash", "-c", f"{sys.executable} -m mergekit_ext run <(cat ties.yml) out --dry-run"],
        cwd=work,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert substituted.returncode == 0, substituted.stderr


@pytest.mark.parametrize("ridge", [-1, float("nan"), "abc", True])
def test_ridge_messages(work, monkeypatch, ridge):
    monkeypatch.chdir(work)
    cfg = _config(work, "r.yml", merge_method="regmean", parameters={"ridge": ridge})
    _fails(["run", cfg, "out", "--dry-run"], "parameters.ridge", "auto | [0, inf)")


def test_ridge_and_compute_dtype_accepted_and_null_refused(work, monkeypatch):
    monkeypatch.chdir(work)
    for ridge in (0.5, 0, "auto"):
        cfg = _config(work, "r.yml", merge_method="regmean", parameters={"ridge": ridge})
        assert _invoke(["run", cfg, "out", "--dry-run"]).exit_code == 0
    cfg = _config(work, "n.yml", merge_method="regmean", parameters={"compute_dtype": None})
    _fails(["run", cfg, "out", "--dry-run"], "n.yml: parameters.compute_dtype has no value (null)")


def test_heldout_messages(work, monkeypatch):
    monkeypatch.chdir(work)
    assert _invoke(["run", "ace.yml", "out"]).exit_code == 0
    (work / "ho.yml").write_text("expert_a: {path: data/texts.jsonl}\n")
    _fails(
        ["diagnose", "out", "ace.yml", "--heldout", "ho.yml"],
        "--heldout ho.yml: unknown field 'expert_a'; per-task fields go under `tasks:`",
    )
    _fails(
        ["diagnose", "out", "ace.yml", "--heldout", "{samples: -3}"],
        "--heldout {samples: -3}: samples = -3: input should be greater than or equal to 1",
    )


SOURCE = """
from mergekit_ext.calibration import register_source


@register_source("boomsrc")
def boomsrc(spec):
    raise RuntimeError("boom")
"""

LATE = """
import mergekit_ext.finite as finite


def _boom(*args, **kwargs):
    raise RuntimeError("boom")


finite.check_output_finite = _boom
"""


def test_raising_user_code_is_named(work, monkeypatch):
    monkeypatch.chdir(work)
    # the plugins run in this process: what late.py replaces is put back after the test
    monkeypatch.setattr(finite, "check_output_finite", finite.check_output_finite)
    (work / "plugins" / "boom.py").write_text('raise RuntimeError("boom")\n')
    (work / "plugins" / "src.py").write_text(SOURCE)
    (work / "plugins" / "late.py").write_text(LATE)
    _fails(
        ["run", "ace.yml", "out", "--plugin", "plugins/boom.py"],
        "--plugin plugins/boom.py failed while imported: RuntimeError: boom",
        "boom.py:1)",
    )
    _fails(
        ["run", "ace.yml", "out", "--plugin", "plugins/late.py"],
        "--plugin plugins/late.py raised RuntimeError: boom",
    )
    cfg = _config(work, "src.yml", merge_method="regmean", calibration={"source": "boomsrc"})
    _fails(
        ["run", cfg, "out", "--plugin", "plugins/src.py"],
        "calibration source 'boomsrc'",
        "failed: RuntimeError: boom",
    )
    assert not (work / "out").exists()


def test_missing_mergekit_parameter_names_model_and_tensor(work, monkeypatch):
    monkeypatch.chdir(work)
    cfg = _config(
        work,
        "lin.yml",
        merge_method="linear",
        models=[{"model": "m/base"}, {"model": "m/expert_a", "parameters": {"weight": 0.5}}],
    )
    _fails(
        ["run", cfg, "out"],
        "linear: parameter 'weight' is missing for the model m/base (first needed by the tensor "
        "model.embed_tokens.weight)",
    )


def test_foreign_folder_says_overwrite_would_not_help(work, monkeypatch):
    monkeypatch.chdir(work)
    _fails(["run", "ace.yml", "notes"], "was not written by mergekit-ext", "--overwrite would not")


def test_python_api_messages(work, monkeypatch):
    """run_merge: TypeError, RuntimeError and a pydantic ValidationError where the README
    promises MergekitExtError; 'yes please' taken as True; "pass --overwrite"."""
    monkeypatch.chdir(work)
    cases = [
        (dict(out_path=None), "out_path must be the output folder"),
        (dict(options={"device": "tpu9"}), "options['device'] 'tpu9' is not a device"),
        (dict(options={"random_seed": "abc"}), "options['random_seed'] 'abc': give a whole"),
        (dict(options={"out_shard_size": -5}), "options['out_shard_size']"),
        (dict(run_options={"overwrite": "yes please"}), "run_options['overwrite'] must be True"),
    ]
    for kwargs, expected in cases:
        kwargs = {"out_path": "out", **kwargs}
        with pytest.raises(MergekitExtError, match=None) as caught:
            mergekit_ext.run_merge("ace.yml", **kwargs)
        assert expected in str(caught.value), str(caught.value)
    assert not os.path.exists(work / "out")
    mergekit_ext.run_merge("ace.yml", "out")
    with pytest.raises(MergekitExtError) as caught:
        mergekit_ext.run_merge("ace.yml", "out")
    assert "pass run_options={'overwrite': True}" in str(caught.value)
    assert "--overwrite" not in str(caught.value)
    mergekit_ext.run_merge("ace.yml", "out", run_options={"overwrite": True})


def _unshare_works() -> bool:
    import shutil

    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount --make-rprivate / && mount -t tmpfs none /mnt"],
        capture_output=True,
    )
    return probe.returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="needs root and mount namespaces (unshare -m)")
def test_read_only_datasets_cache_is_named(work):
    """A read-only HF_HOME with a local .jsonl: "[Errno 30] Read-only file system: .../datasets"."""
    (work / "hf").mkdir()
    _config(work, "reg.yml", merge_method="regmean")
    script = (
        "mount --make-rprivate / && mount --bind hf hf && mount -o remount,ro,bind hf && "
        f"HF_HOME={work / 'hf'} {sys.executable} -m mergekit_ext run reg.yml out; "
        f"HF_HOME={work / 'hf'} HF_DATASETS_CACHE={work / 'cache'} "
        f"{sys.executable} -m mergekit_ext run reg.yml out2"
    )
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script],
        cwd=work,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "its cache folder cannot be written (Read-only file system" in proc.stderr
    assert "set HF_DATASETS_CACHE (or HF_HOME) to a writable folder" in proc.stderr
    assert not (work / "out").exists() and (work / "out2" / "model.safetensors").is_file()
