"""No merge destroys what it did not create (issue #11), end to end with real folders.

The data-loss cases run the real CLI: in subprocesses where a process boundary matters
(the working directory, SIGKILL, SIGTERM, two merges at once), through click's runner
otherwise. A merge is held at a known point by a ``--plugin`` file that wraps the final
NaN/Inf check (it runs inside the temporary folder, after every weight is written) and waits
for a file the test creates.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import mergekit_ext
from mergekit_ext.cli import main
from mergekit_ext.testing import WORDS, make_tiny_llama

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(mergekit_ext.__file__)))

PAUSE_PLUGIN = """
import os
import time

import mergekit_ext.finite as finite

_check = finite.check_output_finite


def _paused(out_dir, inputs=()):
    with open(os.environ["MKX_TEST_READY"], "w") as fp:
        fp.write(out_dir)
    deadline = time.time() + 180
    while not os.path.exists(os.environ["MKX_TEST_GO"]) and time.time() < deadline:
        time.sleep(0.05)
    return _check(out_dir, inputs)


finite.check_output_finite = _paused
"""


@pytest.fixture
def work(user_work):
    """A user's working folder: models under m/, calibration data, notes, a plugin, the YAML."""
    w = user_work
    (w / "data").mkdir()
    (w / "data" / "texts.jsonl").write_text(json.dumps({"text": "hello world"}) + "\n")
    (w / "notes").mkdir()
    (w / "notes" / "todo.txt").write_text("my notes\n")
    (w / "plugins").mkdir()
    (w / "plugins" / "noop.py").write_text("X = 1\n")
    (w / "plugins" / "pause.py").write_text(PAUSE_PLUGIN)
    config = {
        "merge_method": "ace",
        "base_model": "m/base",
        "models": [{"model": "m/expert_a"}, {"model": "m/expert_b"}],
        "calibration": {"path": "data/texts.jsonl"},
        "dtype": "float32",
    }
    (w / "ace.yml").write_text(yaml.safe_dump(config))
    return w


def _snapshot(root) -> dict[str, str]:
    """Every file and folder under ``root`` with its content hash."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for d in dirs:
            found[os.path.relpath(os.path.join(folder, d), root)] = "dir"
        for f in files:
            path = os.path.join(folder, f)
            with open(path, "rb") as fp:
                found[os.path.relpath(path, root)] = hashlib.sha256(fp.read()).hexdigest()
    return found


def _leftovers(parent) -> list[str]:
    return sorted(n for n in os.listdir(parent) if ".partial-" in n or ".old-" in n)


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO_ROOT, env.get("PYTHONPATH", "")])
    env["HF_HUB_OFFLINE"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _cli(*args: str, cwd, **popen) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "mergekit_ext", *args],
        cwd=str(cwd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen,
    )


def _finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out + err


def _wait_for(path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise AssertionError(f"merge ended before the pause point: {_finish(proc)}")
        assert time.time() < deadline, "merge did not reach the pause point"
        time.sleep(0.05)


def _invoke(args, monkeypatch=None, cwd=None):
    if cwd is not None:
        monkeypatch.chdir(cwd)
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


# ----------------------------------------------------------------- 1. --overwrite and inputs


@pytest.mark.parametrize(
    "out, expected",
    [
        (".", "current directory"),
        ("m/expert_a", "is the input m/expert_a"),
        ("m", "contains the input m/"),
    ],
)
@pytest.mark.slow
def test_overwrite_never_deletes_inputs_or_the_working_folder(work, out, expected):
    """The three reported data-loss commands, as a user types them, in a subprocess."""
    before = _snapshot(work)
    code, output = _finish(_cli("run", "ace.yml", out, "--overwrite", cwd=work, env=_env()))
    assert code == 1, output
    assert expected in output and "refusing" in output
    assert "Traceback" not in output
    assert _snapshot(work) == before


def test_output_location_refusals(work, monkeypatch, tmp_path):
    before = _snapshot(work)
    home = work / "notes"
    monkeypatch.setenv("HOME", str(home))
    cases = [
        (["m/expert_a/merged"], "lies inside the input m/expert_a"),
        (["data", "--overwrite"], "contains the input data/texts.jsonl"),
        (["plugins", "--overwrite", "--plugin", "plugins/noop.py"], "plugins/noop.py"),
        (["notes", "--overwrite"], "home directory"),
        (["/", "--overwrite"], "refusing"),
    ]
    for extra, expected in cases:
        result = _invoke(["run", "ace.yml", *extra], monkeypatch, cwd=work)
        assert result.exit_code == 1, (extra, result.output)
        assert expected in result.output, (extra, result.output)
    assert _snapshot(work) == before
    assert _leftovers(work) == []
    # A failed merge into new nested folders leaves none of them behind.
    config = yaml.safe_load((work / "ace.yml").read_text())
    config["parameters"] = {"k_frac": -0.5}
    (work / "ace.yml").write_text(yaml.safe_dump(config))
    result = _invoke(["run", "ace.yml", "new/deeper/out"])
    assert result.exit_code == 1 and "k_frac = -0.5" in result.output
    assert not (work / "new").exists()


def test_overwrite_replaces_only_mergekit_ext_outputs(work, monkeypatch):
    # A folder of the user's: refused even with --overwrite, left untouched.
    (work / "results").mkdir()
    (work / "results" / "table.csv").write_text("a,b\n")
    result = _invoke(["run", "ace.yml", "results", "--overwrite"], monkeypatch, cwd=work)
    assert result.exit_code == 1
    assert "not written by mergekit-ext" in result.output
    assert "mergekit_ext_diagnostics.json" in result.output
    assert (work / "results" / "table.csv").read_text() == "a,b\n"

    # Our own output and an empty folder are replaced.
    (work / "empty").mkdir()
    assert _invoke(["run", "ace.yml", "empty", "--overwrite"]).exit_code == 0
    assert (work / "empty" / "mergekit_ext_diagnostics.json").exists()
    first = (work / "empty" / "model.safetensors").read_bytes()
    result = _invoke(["run", "ace.yml", "empty", "--overwrite"])
    assert result.exit_code == 0, result.output
    assert (work / "empty" / "model.safetensors").read_bytes() == first
    assert _leftovers(work) == []


# --------------------------------------------------------------------- 2. task names


@pytest.mark.parametrize("name", ["../../evil", "/tmp/abs", "..", ".", "a/b", "sp ace", ""])
def test_task_name_must_be_one_safe_path_component(work, monkeypatch, name):
    config = yaml.safe_load((work / "ace.yml").read_text())
    config["merge_method"] = "symerge"
    config["models"][0]["name"] = name
    (work / "sy.yml").write_text(yaml.safe_dump(config))
    before = _snapshot(work.parent)
    result = _invoke(["run", "sy.yml", "out"], monkeypatch, cwd=work)
    assert result.exit_code == 1
    assert "models[0] (m/expert_a).name" in result.output
    assert "task name" in result.output and "letters, digits" in result.output
    after = _snapshot(work.parent)
    assert after == before  # nothing written anywhere, not even outside OUT


def test_default_task_names_are_made_safe(work, monkeypatch):
    shutil.copytree(work / "m" / "expert_b", work / "m" / "expert b (v2)")
    config = yaml.safe_load((work / "ace.yml").read_text())
    config["models"][1]["model"] = "m/expert b (v2)"
    (work / "ace.yml").write_text(yaml.safe_dump(config))
    from mergekit_ext.config import load_config

    monkeypatch.chdir(work)
    assert [e.name for e in load_config("ace.yml").models] == ["expert_a", "expert_b__v2_"]


# ------------------------------------------------------- 3. one merge per OUT_DIR at a time


@pytest.mark.slow
def test_two_merges_into_one_out_dir(work):
    env = _env(MKX_TEST_READY=str(work / "ready"), MKX_TEST_GO=str(work / "go"))
    first = _cli("run", "ace.yml", "out", "--plugin", "plugins/pause.py", cwd=work, env=env)
    try:
        _wait_for(work / "ready", first)
        started = time.time()
        code, output = _finish(_cli("run", "ace.yml", "out", cwd=work, env=_env()))
        assert code == 1, output
        assert f"another mergekit-ext merge (pid {first.pid}) is writing out" in output
        assert time.time() - started < 60  # fails at once, no waiting for the lock
        # A folder the user creates at OUT_DIR meanwhile survives the first merge's end.
        (work / "out").mkdir()
        (work / "out" / "mine.txt").write_text("keep me\n")
        (work / "go").touch()
        code, output = _finish(first)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert code == 1, output
    assert "appeared while the merge ran" in output and "--overwrite" in output
    assert os.listdir(work / "out") == ["mine.txt"]
    assert (work / "out" / "mine.txt").read_text() == "keep me\n"
    assert _leftovers(work) == []
    assert not (work / ".out.lock").exists()


def test_lock_is_released_after_a_failed_merge(work, monkeypatch):
    config = yaml.safe_load((work / "ace.yml").read_text())
    config["parameters"] = {"k_frac": 7.5}
    (work / "bad.yml").write_text(yaml.safe_dump(config))
    result = _invoke(["run", "bad.yml", "out"], monkeypatch, cwd=work)
    assert result.exit_code == 1
    assert "parameters.k_frac = 7.5 is not valid" in result.output
    assert "(allowed: [0, 1])" in result.output
    assert not (work / "out").exists() and not (work / ".out.lock").exists()
    assert _invoke(["run", "ace.yml", "out"]).exit_code == 0


# --------------------------------------------------------------- 4. killed merges


@pytest.mark.slow
def test_sigkilled_merge_is_cleaned_up_by_the_next_run(work):
    env = _env(MKX_TEST_READY=str(work / "ready"), MKX_TEST_GO=str(work / "go"))
    killed = _cli("run", "ace.yml", "out", "--plugin", "plugins/pause.py", cwd=work, env=env)
    try:
        _wait_for(work / "ready", killed)
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    partials = _leftovers(work)
    assert len(partials) == 1 and partials[0].startswith(f".out.partial-{killed.pid}-")
    assert (work / partials[0] / "model.safetensors").exists()  # what a kill leaves

    code, output = _finish(_cli("run", "ace.yml", "out", cwd=work, env=_env()))
    assert code == 0, output
    assert f"removed {work / partials[0]}, left by a killed merge (pid {killed.pid})" in output
    assert _leftovers(work) == []
    assert load_file(str(work / "out" / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_and_sighup_are_handled_like_ctrl_c(work, signum):
    """SIGHUP (the terminal was closed) cleans up like SIGTERM (issue #28, 12)."""
    env = _env(MKX_TEST_READY=str(work / "ready"), MKX_TEST_GO=str(work / "go"))
    # as a terminal starts it: SIGHUP at its default, even when this test runs under nohup
    # (whose ignored SIGHUP the merge keeps, by design)
    proc = _cli(
        "run",
        "ace.yml",
        "out",
        "--plugin",
        "plugins/pause.py",
        cwd=work,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),
    )
    try:
        _wait_for(work / "ready", proc)
        assert _leftovers(work) and (work / ".out.lock").exists()  # the state a kill leaves
        proc.send_signal(signum)
        code, output = _finish(proc, timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == 128 + signum, output
    assert f"terminated ({signal.Signals(signum).name}); no output was written" in output
    assert not (work / "out").exists()
    assert _leftovers(work) == [] and not (work / ".out.lock").exists()


# ------------------------------------------------------------ 5. NaN/Inf in any method


def _with_nan(src: str, dst, tensor: str) -> str:
    shutil.copytree(src, dst)
    sd = load_file(os.path.join(dst, "model.safetensors"))
    sd[tensor][0, 0] = float("nan")
    save_file(sd, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


@pytest.mark.parametrize("serialization", [[], ["--no-safe-serialization"]], ids=["st", "bin"])
def test_nan_through_mergekit_method_is_caught_and_traced(llama_pair, tmp_path, serialization):
    """Also with ``--no-safe-serialization`` (pytorch_model.bin) (issue #28, 5)."""
    base, experts = llama_pair
    bad = _with_nan(experts[0], tmp_path / "bad", "model.layers.1.mlp.up_proj.weight")
    config = {
        "merge_method": "ties",
        "base_model": base,
        "models": [
            {"model": m, "parameters": {"weight": 0.5, "density": 0.5}} for m in (bad, experts[1])
        ],
        "dtype": "float32",
    }
    (tmp_path / "ties.yml").write_text(yaml.safe_dump(config))
    result = _invoke(["run", tmp_path / "ties.yml", tmp_path / "out", *serialization])
    assert result.exit_code == 1, result.output
    written = "pytorch_model.bin" if serialization else "model.safetensors"
    assert (
        f"tensor model.layers.1.mlp.up_proj.weight of the merged model ({written})" in result.output
    )
    assert f"it comes from {bad}" in result.output
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_nan_in_chain_of_merges_names_model_task_and_layer(tiny_llama_set, tmp_path):
    bad = _with_nan(
        tiny_llama_set.experts[1], tmp_path / "sick", "model.layers.1.self_attn.q_proj.weight"
    )
    experts = [tiny_llama_set.experts[0], bad]
    rng = random.Random(0)
    data = tmp_path / "texts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(8))}) + "\n"
            for _ in range(8)
        )
    )
    config = {
        "merge_method": "chain_of_merges",
        "base_model": tiny_llama_set.base,
        "models": [{"model": e} for e in experts],
        "calibration": {"path": str(data), "samples": 4, "max_length": 8, "batch_size": 4},
        "dtype": "float32",
    }
    (tmp_path / "com.yml").write_text(yaml.safe_dump(config))
    result = _invoke(["run", tmp_path / "com.yml", tmp_path / "out"])
    assert result.exit_code == 1, result.output
    assert f"model {bad} (task sick)" in result.output
    assert "layers.1.self_attn.q_proj.weight" in result.output and "layer 1" in result.output
    assert "Gram" not in result.output
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


# --------------------------------------------------------------- 8. symlinked OUT_DIR


def test_overwrite_through_a_symlink_writes_into_its_target(work, monkeypatch):
    assert _invoke(["run", "ace.yml", "real"], monkeypatch, cwd=work).exit_code == 0
    os.symlink("real", work / "link")
    config = yaml.safe_load((work / "ace.yml").read_text())
    config["parameters"] = {"scale": 0.5}
    (work / "half.yml").write_text(yaml.safe_dump(config))
    result = _invoke(["run", "half.yml", "link", "--overwrite"])
    assert result.exit_code == 0, result.output
    assert os.path.islink(work / "link") and os.readlink(work / "link") == "real"
    diag = json.loads((work / "real" / "mergekit_ext_diagnostics.json").read_text())
    assert diag["parameters"] == {"scale": 0.5}
    assert _leftovers(work) == []

    os.symlink("missing", work / "dangling")
    result = _invoke(["run", "ace.yml", "dangling", "--overwrite"])
    assert result.exit_code == 1 and "does not exist" in result.output
    assert not (work / "missing").exists()


# --------------------------------------------------------------- 9. the umask applies


@pytest.mark.parametrize("umask, mode", [(0o022, 0o755), (0o027, 0o750)])
def test_output_folder_follows_the_umask(work, monkeypatch, umask, mode):
    old = os.umask(umask)
    try:
        assert _invoke(["run", "ace.yml", "out"], monkeypatch, cwd=work).exit_code == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(work / "out").st_mode) == mode


# ----------------------------------------------------------------------- 11. messages


def test_empty_models_list(tmp_path):
    (tmp_path / "c.yml").write_text("merge_method: ties\nmodels: []\n")
    result = _invoke(["run", tmp_path / "c.yml", tmp_path / "out"])
    assert result.exit_code == 1
    assert "the `models:` list is empty" in result.output
    assert "Exactly one of" not in result.output


def test_layer_count_mismatch_names_models(llama_pair, tmp_path):
    base, experts = llama_pair
    deep = make_tiny_llama(str(tmp_path / "deep"), seed=1, layers=3)
    config = {
        "merge_method": "ace",
        "base_model": base,
        "models": [{"model": experts[0]}, {"model": deep}],
    }
    (tmp_path / "c.yml").write_text(yaml.safe_dump(config))
    result = _invoke(["run", tmp_path / "c.yml", tmp_path / "out"])
    assert result.exit_code == 1, result.output
    assert "different numbers of layers" in result.output
    assert f"{deep}: num_hidden_layers=3" in result.output
    assert f"{base}: num_hidden_layers=2" in result.output
    assert not (tmp_path / "out").exists()


def test_differing_tokenizers_warn(llama_pair, tmp_path, caplog):
    base, experts = llama_pair
    other = tmp_path / "other"
    shutil.copytree(experts[0], other)
    tok = other / "tokenizer.json"
    spec = json.loads(tok.read_text())
    vocab = spec["model"]["vocab"]
    first = next(iter(vocab))
    vocab["zz" + first] = vocab.pop(first)
    tok.write_text(json.dumps(spec))
    config = {
        "merge_method": "ace",
        "base_model": base,
        "models": [{"model": experts[0]}, {"model": str(other)}],
        "dtype": "float32",
    }
    (tmp_path / "c.yml").write_text(yaml.safe_dump(config))
    result = _invoke(["run", tmp_path / "c.yml", tmp_path / "out", "--dry-run"])
    assert result.exit_code == 0, result.output
    warned = [r.message for r in caplog.records if "tokenizers differ" in r.message]
    assert len(warned) == 1 and str(other) in warned[0]
    caplog.clear()
    config["models"][1]["model"] = experts[1]  # same tokenizer: no warning
    (tmp_path / "c.yml").write_text(yaml.safe_dump(config))
    assert _invoke(["run", tmp_path / "c.yml", tmp_path / "out", "--dry-run"]).exit_code == 0
    assert not [r for r in caplog.records if "tokenizers differ" in r.message]


def _out_of_range_values(field) -> list[float]:
    """Values just outside each bound the field declares (empty for an unbounded field)."""
    bad = []
    for m in field.metadata:
        for attr, step in (("ge", -0.5), ("gt", 0.0), ("le", 0.5), ("lt", 0.0)):
            bound = getattr(m, attr, None)
            if bound is not None:
                bad.append(bound + step if step else bound)
    return bad


def test_every_numeric_parameter_of_every_method_is_range_checked():
    from mergekit_ext.errors import ConfigError
    from mergekit_ext.methods import ext_methods

    checked = 0
    for info in ext_methods():
        for name, field in info.parameters_model.model_fields.items():
            for value in _out_of_range_values(field):
                with pytest.raises(ConfigError, match=rf"{info.name}: parameters\.{name} = "):
                    info.parse_parameters({name: value})
                checked += 1
            if field.annotation in (int, float):  # a string is never a number
                with pytest.raises(ConfigError, match=rf"parameters\.{name} = 'x'"):
                    info.parse_parameters({name: "x"})
    assert checked >= 10  # k_frac, eps, ridge (three methods), lr, epochs, batch_size ...


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"k_frac": -0.5}, r"ace: parameters\.k_frac = -0\.5 is not valid.*\(allowed: \[0, 1\]\)"),
        ({"eps": 0}, r"parameters\.eps = 0 .*\(allowed: \(0, inf\)\)"),
        (
            {"normalize": "sometimes"},
            r"parameters\.normalize = 'sometimes'.*auto \| always \| never",
        ),
    ],
)
def test_ace_parameters_are_checked_before_anything_loads(work, monkeypatch, parameters, message):
    import re

    config = yaml.safe_load((work / "ace.yml").read_text())
    config["parameters"] = parameters
    config["base_model"] = str(work / "missing-model")  # would fail later if loading started
    (work / "bad.yml").write_text(yaml.safe_dump(config))
    result = _invoke(["run", "bad.yml", "out"], monkeypatch, cwd=work)
    assert result.exit_code == 1
    assert re.search(message, result.output), result.output


# --------------------------------------------- 10. local calibration files: no network


def test_local_calibration_files_make_no_network_call(llama_pair, tmp_path, monkeypatch):
    import socket

    import datasets
    import huggingface_hub.constants as hf_constants

    from mergekit_ext.calibration.config import CalibrationSpec
    from mergekit_ext.calibration.sources import load_calibration

    base, _ = llama_pair
    # As with HF_HUB_OFFLINE unset: datasets would ping the Hub for its download counts.
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", True)
    attempts = []

    def refuse(self, address):
        attempts.append(address)
        raise ConnectionRefusedError(f"test blocked a connection to {address}")

    def resolve(host, *args, **kwargs):
        attempts.append(host)
        raise socket.gaierror(f"test blocked a name lookup of {host}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    (tmp_path / "t.jsonl").write_text("".join(f'{{"text": "a b {i}"}}\n' for i in range(4)))
    (tmp_path / "t.csv").write_text("text\n" + "".join(f"c d {i}\n" for i in range(4)))
    datasets.Dataset.from_dict({"text": ["e f", "g h"]}).save_to_disk(str(tmp_path / "disk"))
    for path in ("t.jsonl", "t.csv", "disk"):
        spec = CalibrationSpec(path=str(tmp_path / path), samples=2, max_length=8)
        data = load_calibration(spec, base, task="t")
        assert data.num_samples == 2
    assert attempts == []
    assert datasets.config.HF_HUB_OFFLINE is False  # restored after each local read


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_is_finite_fast_path_is_exact(dtype):
    from mergekit_ext.finite import is_finite

    big = torch.full((64, 64), torch.finfo(dtype).max / 2, dtype=dtype)  # the sum overflows
    assert is_finite(big) and is_finite(torch.zeros(3, dtype=dtype))
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = torch.ones(8, 8, dtype=dtype)
        t[3, 5] = bad
        assert not is_finite(t)
    both = torch.ones(4, dtype=dtype)
    both[0], both[1] = float("inf"), float("-inf")  # sums to NaN
    assert not is_finite(both)
    assert is_finite(torch.tensor([1, 2], dtype=torch.int64))
