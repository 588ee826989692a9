"""Issue #50.7: `card` and `publish` take the outputs of `mergekit-moe` and
`mergekit-extract-lora`, built by mergekit 0.1.5's own command-line tools (run as
subprocesses, as a user runs them) from tiny Llamas. Two inputs are local copies of Hub
models as ``hf download --local-dir`` leaves them (download metadata, the commit's snapshot
in a Hugging Face cache built in a temporary ``HF_HOME``): mergekit's tools cannot resolve a
Hub id offline (``list_repo_files``), and the card must name those copies by their Hub id
while keeping every local path out. The card is built from the tools' own files, read back
with ``huggingface_hub.ModelCard``, and uploaded to the stand-in Hub of
``tests/hub_server.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants as hf_constants
import pytest
from click.testing import CliRunner
from huggingface_hub import ModelCard

# the stand-in Hub and its guards (loopback only, no token printed), as test_publish uses them
from test_publish import (  # noqa: F401 - fixtures
    WRITE_TOKEN,
    client_env,
    hub,
    loopback_only,
    token_never_printed,
)

from mergekit_ext.api import write_card
from mergekit_ext.cli_hub import card_command, publish_command
from mergekit_ext.errors import ConfigError, ModelNotFoundError
from mergekit_ext.hub.card import CardError
from mergekit_ext.hub.card.tools import card_source, extraction_command
from mergekit_ext.hub.publish import publish_folder
from mergekit_ext.testing import make_tiny_llama

BIN = os.path.dirname(sys.executable)  # the venv's console scripts


def _local_copy(hf_home: Path, repo_id: str, folder: str) -> str:
    """``folder`` made a local copy of ``repo_id`` as ``hf download --local-dir`` leaves one:
    download metadata naming the commit, and that commit's snapshot in the Hub cache."""
    commit = hashlib.sha1(repo_id.encode()).hexdigest()  # each repository its own commit
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(folder, repo / "snapshots" / commit)
    meta = Path(folder, ".cache", "huggingface", "download")
    meta.mkdir(parents=True)
    (meta / "config.json.metadata").write_text(f"{commit}\netag\n1700000000.0\n")
    return folder


def _tool(args: list[str], root: Path, hf_home: Path) -> None:
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        args, cwd=root, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A MoE from `mergekit-moe` (base and one expert local copies of Hub models, one local
    expert) and a LoRA from `mergekit-extract-lora` (the same base, the local expert as the
    fine-tune), each in its own output folder."""
    root = tmp_path_factory.mktemp("card_tools")
    base = make_tiny_llama(str(root / "models" / "base"), seed=0)
    local_expert = make_tiny_llama(str(root / "models" / "ex0"), seed=1)
    hub_expert = make_tiny_llama(str(root / "models" / "ex1"), seed=2)
    hf_home = root / "hf_home"
    _local_copy(hf_home, "org/base", base)
    _local_copy(hf_home, "org/ex1", hub_expert)
    (root / "moe.yml").write_text(
        f"base_model: {base}\ngate_mode: cheap_embed\ndtype: float32\nexperts:\n"
        f"  - source_model: {local_expert}\n    positive_prompts: [coffee tea chocolate]\n"
        f"  - source_model: {hub_expert}\n    positive_prompts: [dog cat bird]\n"
        "    negative_prompts: [court law]\n"
    )
    _tool([os.path.join(BIN, "mergekit-moe"), "moe.yml", str(root / "moe")], root, hf_home)
    lora = [os.path.join(BIN, "mergekit-extract-lora"), "--model", local_expert]
    lora += ["--base-model", base, "--out-path", str(root / "lora"), "--max-rank", "4"]
    _tool(lora, root, hf_home)
    return {"root": root, "hf_home": hf_home, "moe": root / "moe", "lora": root / "lora"}


@pytest.fixture
def work(built: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Private copies of the outputs; the card reads the same Hub cache the tools read."""
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(built["hf_home"] / "hub"))
    monkeypatch.chdir(tmp_path)
    return {
        "moe": Path(shutil.copytree(built["moe"], tmp_path / "moe")),
        "lora": Path(shutil.copytree(built["lora"], tmp_path / "lora")),
        "local": str(built["root"].parent),  # pytest's base folder: names the user
    }


def _no_local_path(text: str, local: str) -> None:
    assert local not in text and "/tmp/" not in text and "pytest-" not in text


def test_the_tools_write_what_the_card_reads(built: dict) -> None:
    """What mergekit 0.1.5 writes, which the card relies on: the MoE's config copy and no
    README; the adapter, and a README whose command names the fine-tuned model."""
    moe = sorted(os.listdir(built["moe"]))
    assert "mergekit_moe_config.yml" in moe and "README.md" not in moe
    assert card_source(str(built["moe"])) == "moe"
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md"} <= set(
        os.listdir(built["lora"])
    )
    assert card_source(str(built["lora"])) == "lora"
    command = extraction_command(str(built["lora"]))
    assert command is not None
    assert command["model"] == str(built["root"] / "models" / "ex0")
    assert command["base_model"] == str(built["root"] / "models" / "base")
    assert command["max_rank"] == 4


def test_moe_card(work: dict) -> None:
    result = CliRunner().invoke(card_command, [str(work["moe"])])
    assert result.exit_code == 0, result.output
    text = (work["moe"] / "README.md").read_text(encoding="utf-8")
    card = ModelCard(text)
    assert card.data.base_model == ["org/base", "org/ex1"]  # the Hub ids only
    assert card.data.base_model_relation == "merge"
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert {"mergekit", "moe"} <= set(card.data.tags)
    assert "`cheap_embed`" in text and "2 experts per layer, 2 active per token" in text
    assert "| expert 0 | `./ex0` | coffee tea chocolate | — |" in text
    copy_of = "(local copy of [org/{0}](https://huggingface.co/org/{0}), id read from the Hub "
    assert f"| expert 1 | [./ex1](https://huggingface.co/org/ex1) {copy_of.format('ex1')}" in text
    assert "dog cat bird | court law |" in text
    assert (
        f"**Base model:** [./base](https://huggingface.co/org/base) {copy_of.format('base')}"
        in text
    )
    assert "source_model: ex0" in text  # the config as built, its local path shortened
    _no_local_path(text, work["local"])
    # rebuilt while unedited: the same card
    assert CliRunner().invoke(card_command, [str(work["moe"])]).exit_code == 0
    assert (work["moe"] / "README.md").read_text(encoding="utf-8") == text


def test_lora_card(work: dict) -> None:
    folder = str(work["lora"])
    theirs = (work["lora"] / "README.md").read_text(encoding="utf-8")
    with pytest.raises(CardError, match="--force"):  # mergekit's own card is not lost silently
        write_card(folder)
    result = write_card(folder, force=True)
    assert result.backup and Path(result.backup).read_text(encoding="utf-8") == theirs
    text = Path(result.path).read_text(encoding="utf-8")
    card = ModelCard(text)
    assert card.data.base_model == ["org/base"]  # the adapter applies to the base
    assert card.data.base_model_relation == "adapter"
    assert card.data.library_name == "peft" and card.data.pipeline_tag == "text-generation"
    assert {"mergekit", "lora", "peft"} <= set(card.data.tags)
    adapter = json.loads((work["lora"] / "adapter_config.json").read_text())
    assert f"**Rank:** {adapter['r']} (`lora_alpha` {adapter['lora_alpha']})" in text
    assert "**Extracted from:** `./ex0`" in text  # read from the command mergekit recorded
    assert "| `--max-rank` | `4` |" in text
    assert 'PeftModel.from_pretrained(base, "./lora")' in text
    assert 'AutoModelForCausalLM.from_pretrained("org/base"' in text
    _no_local_path(text, work["local"])
    # rebuilt from our own card: the fine-tuned model is read from the kept README.md.bak
    again = write_card(folder)
    assert Path(again.path).read_text(encoding="utf-8") == text
    with pytest.raises(ConfigError, match="mergekit-extract-lora"):  # before any diagnosis
        write_card(folder, diagnose_config="missing.yml")


def test_publish_moe(hub, work: dict) -> None:  # noqa: F811 - the fixture imported above
    folder = work["moe"]
    args = [str(folder), "--repo-id", "alice/moe", "--endpoint", hub.url, "--token", WRITE_TOKEN]
    result = CliRunner().invoke(publish_command, args)  # no card yet: the way is told
    assert result.exit_code == 1 and "run `mergekit-ext card OUT_DIR`" in result.output
    write_card(str(folder))
    result = CliRunner().invoke(publish_command, args)
    assert result.exit_code == 0, result.output
    commit = hub.commits("alice/moe")[-1]
    assert commit.summary == "Upload MoE model built with mergekit-moe"
    assert {"README.md", "mergekit_moe_config.yml", "config.json", "model.safetensors"} <= set(
        commit.files
    )
    card = commit.files["README.md"].decode()
    assert ModelCard(card).data.base_model == ["org/base", "org/ex1"]
    assert 'model_id = "alice/moe"' in card and "# moe\n" in card
    for path, data in commit.files.items():  # no local path leaves the machine
        if not path.endswith(".safetensors"):
            _no_local_path(data.decode(), work["local"])


def test_publish_lora(hub, work: dict) -> None:  # noqa: F811 - the fixture imported above
    folder = str(work["lora"])
    publish_folder(folder, "alice/lora", token=WRITE_TOKEN, endpoint=hub.url)
    commit = hub.commits("alice/lora")[-1]
    assert commit.summary == "Upload LoRA adapter extracted with mergekit-extract-lora"
    assert {"README.md", "adapter_config.json", "adapter_model.safetensors"} <= set(commit.files)
    # mergekit's own card goes as it is (paths redacted) unless --replace-card
    assert "This is a LoRA extracted from a language model" in commit.files["README.md"].decode()
    args = [folder, "--repo-id", "alice/lora", "--endpoint", hub.url, "--token", WRITE_TOKEN]
    result = CliRunner().invoke(publish_command, [*args, "--replace-card"])
    assert result.exit_code == 0, result.output
    commit = hub.commits("alice/lora")[-1]
    card = commit.files["README.md"].decode()
    assert ModelCard(card).data.library_name == "peft" and "**Extracted from:** `./ex0`" in card
    assert 'PeftModel.from_pretrained(base, "alice/lora")' in card
    assert json.loads(commit.files["adapter_config.json"])["base_model_name_or_path"] == "org/base"
    for path, data in commit.files.items():
        if not path.endswith(".safetensors"):
            _no_local_path(data.decode(), work["local"])
    assert "README.md.bak" not in commit.files


def test_a_folder_of_none_of_them_is_refused(work: dict, tmp_path: Path) -> None:
    """A model folder with no config of any tool: both commands say what it lacks."""
    folder = tmp_path / "bare"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(work["moe"] / name, folder / name)
    with pytest.raises(ModelNotFoundError) as caught:
        write_card(str(folder))
    message = str(caught.value)
    for needed in ("mergekit_config.yml", "mergekit_moe_config.yml", "adapter_config.json"):
        assert needed in message
    result = CliRunner().invoke(publish_command, [str(folder), "--repo-id", "a/b", "--dry-run"])
    assert result.exit_code == 1
    assert "cannot be built" in result.output and "write README.md yourself" in result.output
    assert "run `mergekit-ext card" not in result.output  # it would only refuse again
