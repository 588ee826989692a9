"""Hub model ids with the data-aware methods: resolved from the Hugging Face cache offline
(the cache layout built in a temporary ``HF_HOME``), ``base+lora`` ids included; a clear
error when offline and not cached.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import peft
import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file

import mergekit_ext
from mergekit_ext.errors import ModelInputError
from mergekit_ext.testing import make_experts, make_tiny_llama

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cache(hf_home: str, repo_id: str, folder: str) -> None:
    """Put ``folder`` into the hub cache of ``hf_home`` as huggingface_hub lays it out."""
    repo = os.path.join(hf_home, "hub", "models--" + repo_id.replace("/", "--"))
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as fp:
        fp.write(COMMIT)
    shutil.copytree(folder, os.path.join(repo, "snapshots", COMMIT))


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    transformers.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("hub_ids")
    base = make_tiny_llama(str(root / "base"), seed=0)
    expert = make_experts(base, [str(root / "expert")], scale=0.05, seed=2)[0]
    model = transformers.LlamaForCausalLM.from_pretrained(base)
    lora = peft.get_peft_model(
        model,
        peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
        ),
    )
    lora.save_pretrained(str(root / "lora"))
    data = root / "data.jsonl"
    data.write_text(
        "".join(json.dumps({"text": f"the news of {w} is good"}) + "\n" for w in "abcdefgh")
    )
    hf_home = str(root / "hf_home")
    for repo_id, folder in (
        ("org/base", base),
        ("org/expert", expert),
        ("org/lora", str(root / "lora")),
    ):
        _cache(hf_home, repo_id, folder)
    return {
        "root": root,
        "base": base,
        "expert": expert,
        "lora": str(root / "lora"),
        "data": str(data),
        "hf_home": hf_home,
    }


def _config(base: str, expert: str, lora: str, data: str) -> dict:
    calibration = {"path": data, "samples": 8, "max_length": 16}
    return {
        "merge_method": "chain_of_merges",
        "base_model": base,
        "models": [
            {"model": expert, "name": "full", "calibration": calibration},
            {"model": f"{base}+{lora}", "name": "lora", "calibration": calibration},
        ],
        "dtype": "float32",
    }


def test_hub_ids_resolve_from_the_cache_offline(hub, tmp_path):
    config = tmp_path / "hub.yml"
    config.write_text(yaml.safe_dump(_config("org/base", "org/expert", "org/lora", hub["data"])))
    env = dict(os.environ, HF_HOME=hub["hf_home"], HF_HUB_OFFLINE="1", PYTHONPATH=REPO_ROOT)
    env.pop("HF_HUB_CACHE", None)
    # The same thread count as the in-process merge below: float sums are then bit-identical.
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())
    out = tmp_path / "from_hub"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mergekit_ext",
            "run",
            str(config),
            str(out),
            "--no-write-model-card",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    local = mergekit_ext.run_merge(
        _config(hub["base"], hub["expert"], hub["lora"], hub["data"]),
        tmp_path / "local",
        {"write_model_card": False},
    )
    a, b = (
        load_file(str(out / "model.safetensors")),
        load_file(os.path.join(local, "model.safetensors")),
    )
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert os.path.exists(out / "tokenizer.json")


def test_uncached_hub_id_offline_is_a_clear_error(hub, tmp_path):
    cfg = _config(hub["base"], "nobody/not-cached", hub["lora"], hub["data"])
    with pytest.raises(
        ModelInputError, match=r"'nobody/not-cached'.*Hugging Face cache.*HF_HUB_OFFLINE"
    ):
        mergekit_ext.run_merge(cfg, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")
