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
from mergekit_ext.testing import make_tiny_llama

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


@pytest.fixture
def work(user_work):
    """Copies of the models under m/ (free to corrupt) and a ``ties`` YAML over them."""
    w = user_work
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
    from mergekit_ext.yaml_input import load_yaml

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


# ------------------------------------------------------- 6. shard index leaving the folder


def _shard_outside(folder, outside_name: str) -> str:
    """Split ``folder``'s weights in two shards, the second saved at ``outside_name``
    (relative to the folder, or absolute), and index them; returns the index entry."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(folder, "model.safetensors"))
    os.remove(os.path.join(folder, "model.safetensors"))
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    save_file(
        {k: tensors[k] for k in first}, os.path.join(folder, "model-00001-of-00002.safetensors")
    )
    outside = os.path.normpath(os.path.join(folder, outside_name))
    save_file({k: tensors[k] for k in second}, outside)
    weight_map = {k: "model-00001-of-00002.safetensors" for k in first}
    weight_map.update({k: outside_name for k in second})
    index = {"metadata": {}, "weight_map": weight_map}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fp:
        json.dump(index, fp)
    return second[0]


@pytest.mark.parametrize("method", ["ties", "chain_of_merges"])
def test_shard_index_naming_a_file_outside_the_folder_is_refused(work, method):
    tensor = _shard_outside(work / "m" / "expert_a", "../other.safetensors")
    config = yaml.safe_load((work / "ties.yml").read_text())
    config["merge_method"] = method
    if method == "chain_of_merges":
        config["calibration"] = {"path": "data.jsonl"}
        for m in config["models"]:
            m.pop("parameters")
    (work / "c.yml").write_text(yaml.safe_dump(config))
    rc, out, _ = _cli("run", "c.yml", "out", cwd=work)
    assert rc == 1, out
    assert "model.safetensors.index.json" in out and "'../other.safetensors'" in out, out
    assert tensor in out and "outside the model folder" in out, out
    assert not (work / "out").exists()


def test_shard_index_with_an_absolute_path_is_refused(work, tmp_path):
    elsewhere = tmp_path / "elsewhere.safetensors"
    _shard_outside(work / "m" / "expert_b", str(elsewhere))
    rc, out, _ = _cli("run", "ties.yml", "out", "--dry-run", cwd=work)
    assert rc == 1, out
    assert "m/expert_b" in out and str(elsewhere) in out and "outside" in out, out


def test_shard_index_inside_the_folder_still_merges(work):
    """The same split with both shards in the folder: a normal sharded model."""
    _shard_outside(work / "m" / "expert_a", "model-00002-of-00002.safetensors")
    rc, out, _ = _cli("run", "ties.yml", "out", cwd=work, timeout=300)
    assert rc == 0, out
    assert os.path.exists(work / "out" / "config.json")


# ---------------------------------------------------------- 13. corrupt or truncated files


def _truncate(path, size: int) -> None:
    with open(path, "r+b") as fp:
        fp.truncate(size)


def _header_length(path, length: int) -> None:
    with open(path, "r+b") as fp:
        fp.write(length.to_bytes(8, "little"))


CORRUPTIONS = {
    "config not JSON": (
        "config.json",
        lambda p: p.write_text('{"model_type": "llama",'),
        "is not valid JSON",
    ),
    "config not an object": ("config.json", lambda p: p.write_text("[1, 2]"), "not an object"),
    "config not UTF-8": ("config.json", lambda p: p.write_bytes(b"\xff\xfe{}"), "not UTF-8"),
    "safetensors shorter than its length field": (
        "model.safetensors",
        lambda p: _truncate(p, 5),
        "is truncated (5 bytes",
    ),
    "safetensors header cut": (
        "model.safetensors",
        lambda p: _truncate(p, 40),
        "header length is",
    ),
    "safetensors header length 2^62": (
        "model.safetensors",
        lambda p: _header_length(p, 2**62),
        f"header length is {2**62} bytes",
    ),
    "safetensors data cut": (
        "model.safetensors",
        lambda p: _truncate(p, os.path.getsize(p) - 100),
        "not a valid safetensors file",
    ),
    "index not JSON": (
        "model.safetensors.index.json",
        lambda p: p.write_text("{"),
        "is not valid JSON",
    ),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupt_input_files_are_named_before_anything_loads(work, case):
    name, corrupt, message = CORRUPTIONS[case]
    target = work / "m" / "expert_b" / name
    corrupt(target)
    rc, out, seconds = _cli("run", "ties.yml", "out", cwd=work)
    assert rc == 1, out
    assert f"m/expert_b/{name}" in out and message in out, out
    assert "Traceback" not in out and "[run with -v" not in out, out  # our error, not a crash
    assert not (work / "out").exists()


def test_corrupt_adapter_config_is_named(work):
    adapter = work / "m" / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{not json")
    (work / "a.yml").write_text(
        yaml.safe_dump(
            {
                "merge_method": "linear",
                "models": [
                    {"model": "m/base+m/adapter", "parameters": {"weight": 0.5}},
                    {"model": "m/expert_a", "parameters": {"weight": 0.5}},
                ],
            }
        )
    )
    rc, out, _ = _cli("run", "a.yml", "out", cwd=work)
    assert rc == 1 and "m/adapter/adapter_config.json is not valid JSON" in out, out


# ------------------------------------------------------------------ 14. distributed launch


class SilentServer:
    """A TCP server on 127.0.0.1 that accepts every connection and never answers."""

    def __init__(self) -> None:
        import socket
        import threading

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.connections: list = []
        self.accepted_at: list[float] = []  # time.monotonic() of each connection
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections.append(conn)
            self.accepted_at.append(time.monotonic())

    def __enter__(self) -> SilentServer:
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.thread.join(timeout=5)
        for conn in self.connections:
            conn.close()
        self.sock.close()


def _com_yaml(work) -> str:
    config = {
        "merge_method": "chain_of_merges",
        "base_model": "m/base",
        "models": [{"model": "m/expert_a"}, {"model": "m/expert_b"}],
        "calibration": {"path": "data.jsonl"},
        "dtype": "float32",
    }
    (work / "com.yml").write_text(yaml.safe_dump(config))
    return "com.yml"


@pytest.mark.parametrize("value", ["0.0001", "nan", "inf", "-5"])
def test_distributed_timeout_must_be_finite_and_at_least_one_second(work, value, monkeypatch):
    from click.testing import CliRunner

    from mergekit_ext.cli import main

    monkeypatch.chdir(work)
    result = CliRunner().invoke(
        main, ["run", _com_yaml(work), "out", "--distributed-timeout", value]
    )
    assert result.exit_code == 2, result.output
    assert "--distributed-timeout" in result.output and ">= 1" in result.output
    assert not (work / "out").exists()


def test_rank_0_refuses_a_busy_master_port(work):
    with SilentServer() as busy:
        rc, out, seconds = _cli(
            "run", _com_yaml(work), "out", cwd=work, timeout=120,
            WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(busy.port),
        )  # fmt: skip
    assert rc == 1, out
    assert f"MASTER_PORT {busy.port}" in out and "in use" in out and "pick a free port" in out
    assert "Traceback" not in out and not (work / "out").exists()


def test_a_rank_pointed_at_a_foreign_port_gives_up_within_the_timeout(work):
    """Something else holds MASTER_PORT: it accepts and never speaks torch's protocol."""
    with SilentServer() as foreign:
        rc, out, seconds = _cli(
            "run", _com_yaml(work), "out", "--distributed-timeout", "3", cwd=work, timeout=120,
            WORLD_SIZE="2", RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(foreign.port),
        )  # fmt: skip
        assert foreign.connections, "the rank never tried the port"
    assert rc == 1, out
    assert f"waiting for the other ranks at 127.0.0.1:{foreign.port}" in out, out
    assert f"no process group at 127.0.0.1:{foreign.port} within 3 s" in out, out
    assert seconds < 90  # imports included; without the bound it waited 1800 s
    assert not (work / "out").exists()


def test_dry_run_refuses_ranks_without_a_batch_like_the_run(work, monkeypatch):
    """More processes than tasks share a task's batches (issue #31); a rank left without a
    batch is refused by the dry run with the launched run's own message (``check_shares``)."""
    from click.testing import CliRunner

    from mergekit_ext.cli import main
    from mergekit_ext.distributed import DistributedError, check_shares

    monkeypatch.chdir(work)
    result = CliRunner().invoke(
        main, ["run", _com_yaml(work), "out", "--dry-run", "--world-size", "5"]
    )
    assert result.exit_code == 1, result.output
    assert "each rank needs a batch at least" in result.output, result.output
    with pytest.raises(DistributedError) as run_refusal:  # what the launched run says
        check_shares(5, [("task", 1), ("task", 1)])
    tail = str(run_refusal.value).split(": each rank", 1)[1]
    assert tail in result.output
    ok = CliRunner().invoke(main, ["run", _com_yaml(work), "out", "--dry-run", "--world-size", "2"])
    assert ok.exit_code == 0 and "processes: 2" in ok.output, ok.output


# ------------------------------------------------------------- 10. a Hub that never answers


def test_publish_and_push_to_hub_give_up_on_a_silent_hub(work, tmp_path):
    """The endpoint accepts TCP and never answers: both commands fail within the bound,
    say what they were waiting for, and the merge stays on disk."""
    hub_env = dict(
        HF_HUB_OFFLINE="0",
        HF_HUB_DISABLE_XET="1",
        HF_HOME=str(tmp_path / "hf_home"),
        HF_TOKEN="hf_test_token_not_real",
    )
    with SilentServer() as silent:
        url = f"http://127.0.0.1:{silent.port}"
        rc, out, _ = _cli(
            "run", "ties.yml", "out", "--push-to-hub", "me/merged", "--hub-timeout", "2",
            cwd=work, timeout=300, HF_ENDPOINT=url, **hub_env,
        )  # fmt: skip
        ended = time.monotonic()
        assert rc == 1, out
        # the token is checked (whoami) before anything merges, within the same bound
        assert "--push-to-hub: checking the token and me/merged" in out, out
        assert f"cannot reach the Hub at {url} (no answer within 2 s" in out, out
        assert "nothing was merged" in out, out
        assert not os.path.exists(work / "out")
        # huggingface_hub first asks for its agent registry (its own 3 s bound, swallowed),
        # then whoami: from the first request to the exit, the bounds (it hung > 175 s)
        assert silent.accepted_at, "the client never reached the endpoint"
        assert ended - silent.accepted_at[0] < 30
        assert "hf_test_token_not_real" not in out

        rc, out, _ = _cli("run", "ties.yml", "out", cwd=work, timeout=300)
        assert rc == 0, out
        rc, out, _ = _cli(
            "publish", "out", "--repo-id", "me/merged", "--endpoint", url, "--hub-timeout", "2",
            cwd=work, timeout=300, **hub_env,
        )  # fmt: skip
        ended = time.monotonic()
        assert rc == 1, out
        assert "publishing: creating (or finding) me/merged" in out, out
        assert f"cannot reach the Hub at {url} (no answer within 2 s" in out, out
        assert ended - silent.accepted_at[-1] < 30


def test_hub_timeout_is_stated_in_help_and_checked(work):
    from click.testing import CliRunner

    from mergekit_ext.cli import main

    for command in (["publish", "--help"], ["run", "--help"]):
        text = " ".join(CliRunner().invoke(main, command).output.split())
        assert "--hub-timeout" in text and "within SECONDS when creating the repository" in text
    bad = CliRunner().invoke(
        main, ["publish", str(work), "--repo-id", "a/b", "--hub-timeout", "inf"]
    )
    assert bad.exit_code == 2 and "finite" in bad.output


# ------------------------------------------------- 7. LoRA adapters trained on another base

LORA_TARGETS = ["q_proj", "v_proj", "up_proj", "down_proj"]


def _adapter_on(base: str, folder: str, seed: int = 10) -> str:
    """A PEFT LoRA adapter trained (randomly initialised) on the checkpoint in ``base``."""
    import peft
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM.from_pretrained(base)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights=False
    )
    peft.get_peft_model(model, config).save_pretrained(folder)
    return folder


def _wider_llama(path: str) -> str:
    import transformers

    from mergekit_ext.testing import VOCAB_SIZE

    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def adapters(llama_pair, tmp_path_factory):
    """Adapters on the base itself, on a copy of it elsewhere, on a deeper and a wider model."""
    base, _ = llama_pair
    root = tmp_path_factory.mktemp("adapters")
    copy = shutil.copytree(base, root / "base_copy")
    deep = make_tiny_llama(str(root / "deep"), seed=0, layers=4)
    wide = _wider_llama(str(root / "wide"))
    return {
        "own": _adapter_on(base, str(root / "own")),
        "copy": _adapter_on(str(copy), str(root / "on_copy"), seed=11),
        "deep": _adapter_on(deep, str(root / "on_deep")),
        "wide": _adapter_on(wide, str(root / "on_wide")),
    }


def _lora_yaml(work, method: str, adapter_ref: str) -> str:
    config: dict = {"merge_method": method, "base_model": "m/base", "dtype": "float32"}
    if method == "ties":
        config["models"] = [
            {"model": adapter_ref, "parameters": {"weight": 0.5, "density": 0.5}},
            {"model": "m/expert_a", "parameters": {"weight": 0.5, "density": 0.5}},
        ]
    else:
        config["models"] = [{"model": "m/base"}, {"model": adapter_ref}, {"model": "m/expert_a"}]
        config["calibration"] = {"path": "data.jsonl"}
    (work / f"{method}.yml").write_text(yaml.safe_dump(config))
    return f"{method}.yml"


@pytest.mark.parametrize(
    "method, form",
    [
        ("ties", "base+adapter"),
        ("chain_of_merges", "base+adapter"),
        ("symerge", "base+adapter"),
        ("ties", "adapter folder"),
    ],
)
@pytest.mark.parametrize(
    "which, message",
    [
        ("deep", "adapts layer 2 of layers, but m/base has 2 layers (layers.0-1)"),
        ("wide", "changes a weight of shape [32, 48], but model.layers.0.mlp.down_proj.weight"),
    ],
)
def test_adapter_for_another_model_is_refused_before_loading(
    work, adapters, method, form, which, message
):
    adapter = adapters[which]
    ref = f"m/base+{adapter}" if form == "base+adapter" else adapter
    config = _lora_yaml(work, method, ref)
    rc, out, _ = _cli("run", config, "out", cwd=work, timeout=180)
    assert rc == 1, out
    assert f"adapter {adapter}" in out and message in out, out
    assert "it names" in out and "as its base" in out, out
    assert "Traceback" not in out and not (work / "out").exists()


def test_adapter_named_for_another_folder_with_matching_shapes_warns(work, adapters):
    """Trained on a copy of the base (another path, same shapes): merged, with a warning."""
    config = _lora_yaml(work, "ties", f"m/base+{adapters['copy']}")
    rc, out, _ = _cli("run", config, "out", cwd=work, timeout=300)
    assert rc == 0, out
    assert f"adapter {adapters['copy']} was trained on" in out and "shapes match" in out, out
    assert os.path.exists(work / "out" / "config.json")
    # its own base, named by the same folder: no warning
    shutil.rmtree(work / "out")
    (work / "m" / "own").symlink_to(adapters["own"])
    config = _lora_yaml(work, "ties", f"{models_base(work)}+m/own")
    rc, out, _ = _cli("run", config, "out", cwd=work, timeout=300)
    assert rc == 0 and "was trained on" not in out, out


def models_base(work) -> str:
    """The base as the adapter names it (its absolute folder, where PEFT read it)."""
    with open(work / "m" / "own" / "adapter_config.json") as fp:
        return json.load(fp)["base_model_name_or_path"]
