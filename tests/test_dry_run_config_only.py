"""``mergekit-ext run --dry-run`` from a large model's ``config.json`` alone.

Model folders hold what ``hf download ORG/NAME --include "*.json"`` fetches (config,
tokenizer, the safetensors index) and no weights; the shapes come from the class built on
the meta device. The expected numbers are derived here from the Llama shapes, independently
of the estimator. No weight is allocated: the tests take seconds.
"""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
import yaml
from click.testing import CliRunner

from mergekit_ext.cli import main
from mergekit_ext.models.model_paths import config_shapes
from mergekit_ext.testing import WORDS, save_tiny_tokenizer

LLAMA3_8B = dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8)
LLAMA3_70B = dict(hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8)
VOCAB = 128256


@pytest.fixture(autouse=True)
def _no_fast_bf16(monkeypatch):
    """The figures below are float32 passes; with ``compute_dtype: auto`` a machine with fast
    bfloat16 would also hold bfloat16 copies of the blocks (tested on its own below)."""
    from mergekit_ext.executor import compute

    monkeypatch.setattr(compute, "fast_bf16", lambda device_type: (False, "test: pinned"))


def _write_llama_folder(
    path: str, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int
) -> str:
    """A Llama-3-shaped folder: config.json (bf16), a tokenizer and the index, no weights."""
    os.makedirs(path, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": VOCAB,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    }
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as fp:
        json.dump(config, fp)
    # `--include "*.json"` also fetches the index: it names shards that are not there.
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}
    with open(os.path.join(path, "model.safetensors.index.json"), "w", encoding="utf-8") as fp:
        json.dump(index, fp)
    save_tiny_tokenizer(path)  # stands in for Llama-3's tokenizer.json
    return path


def _block_params(hidden: int, intermediate: int, heads: int, kv_heads: int, **_: int) -> int:
    """Parameters of one Llama decoder layer: q/o, k/v (GQA), gate/up/down, two RMSNorms."""
    kv_dim = hidden // heads * kv_heads
    return 2 * hidden * hidden + 2 * kv_dim * hidden + 3 * hidden * intermediate + 2 * hidden


def _model_params(shape: dict[str, int]) -> int:
    """Untied embeddings and lm_head, the layers, the final norm."""
    return 2 * VOCAB * shape["hidden"] + shape["layers"] * _block_params(**shape) + shape["hidden"]


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB"


def _setup(tmp_path, shape: dict[str, int], experts: int, tokenizer: bool = True) -> str:
    base = _write_llama_folder(str(tmp_path / "base"), **shape)
    models = []
    for k in range(experts):
        folder = _write_llama_folder(str(tmp_path / f"expert{k}"), **shape)
        data = tmp_path / f"t{k}.jsonl"
        with open(data, "w", encoding="utf-8") as fp:
            for i in range(8):
                words = [WORDS[(i * 7 + j * 3 + k) % len(WORDS)] for j in range(12)]
                fp.write(json.dumps({"text": " ".join(words)}) + "\n")
        models.append({"model": folder, "name": f"task{k}", "calibration": {"path": str(data)}})
    if not tokenizer:
        for folder in [base, *(m["model"] for m in models)]:
            for name in os.listdir(folder):
                if name.startswith(("tokenizer", "special_tokens")):
                    os.remove(os.path.join(folder, name))
    config = {
        "merge_method": "chain_of_merges",
        "base_model": base,
        "models": models,
        "calibration": {"samples": 8, "max_length": 16, "batch_size": 4, "field": "text"},
    }
    path = str(tmp_path / "config.yml")
    with open(path, "w", encoding="utf-8") as fp:
        yaml.safe_dump(config, fp)
    return path


def _dry_run(config: str, out: str, *extra: str):
    return CliRunner().invoke(main, ["run", config, out, "--dry-run", *extra])


def test_config_shapes_are_what_save_pretrained_writes(tmp_path):
    """Names, shapes and dtypes of the state_dict: no tied head, no rotary inv_freq buffer."""
    folder = _write_llama_folder(str(tmp_path / "m"), **LLAMA3_8B)
    shapes, dtypes = config_shapes(folder)
    h, i = LLAMA3_8B["hidden"], LLAMA3_8B["intermediate"]
    assert shapes["model.embed_tokens.weight"] == (VOCAB, h)
    assert shapes["lm_head.weight"] == (VOCAB, h)
    assert shapes["model.layers.31.self_attn.k_proj.weight"] == (1024, h)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (h, i)
    assert not any("inv_freq" in k or "rotary" in k for k in shapes)  # non-persistent
    assert len(shapes) == 2 + 1 + 32 * 9 and set(dtypes.values()) == {"BF16"}
    assert sum(_numel(s) for s in shapes.values()) == _model_params(LLAMA3_8B)

    with open(os.path.join(folder, "config.json"), encoding="utf-8") as fp:
        config = json.load(fp)
    config.update(tie_word_embeddings=True)
    del config["torch_dtype"]
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as fp:
        json.dump(config, fp)
    shapes, dtypes = config_shapes(folder)
    assert "lm_head.weight" not in shapes  # tied: save_pretrained writes it once
    assert set(dtypes.values()) == {"F32"}  # no dtype in the config: float32


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@pytest.mark.parametrize("experts", [2, 4])
def test_dry_run_of_llama3_8b_from_config_json(tmp_path, experts, caplog):
    config = _setup(tmp_path, LLAMA3_8B, experts)
    out = tmp_path / "out"
    with caplog.at_level("WARNING"):
        result = _dry_run(config, str(out))
    assert result.exit_code == 0, result.output
    text = result.output
    noted = [r.getMessage() for r in caplog.records if "shapes from config.json" in r.message]
    assert len(noted) == experts + 1  # one line per model
    assert all(m.endswith(": shapes from config.json (no weights): dry run only") for m in noted)
    assert "blocks: 32 (layers.{i}), 4 linear groups per block" in text
    assert "config.json only: no weights" in text and f"tasks ({experts}):" in text
    block = _block_params(**LLAMA3_8B) * 4  # float32
    assert block == 872_448_000
    assert f"block weights ({experts + 2} blocks, float32): {_gb((experts + 2) * block)}" in text
    model_bytes = _model_params(LLAMA3_8B) * 2  # bfloat16 on disk
    assert model_bytes == 16_060_522_496
    assert f"one model ≈ {_gb(model_bytes)}" in text
    assert "processes:" not in text
    assert not out.exists() and not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_dry_run_of_llama3_8b_estimate_exactly(tmp_path):
    """The plan's block weights are (K + 2) float32 blocks of the config's shapes, exactly."""
    from mergekit.options import MergeOptions

    from mergekit_ext.config import load_config
    from mergekit_ext.executor import plan_layerwise_merge
    from mergekit_ext.methods.chain_of_merges import ChainOfMergesMethod

    cfg = load_config(_setup(tmp_path, LLAMA3_8B, 3))
    plan = plan_layerwise_merge(cfg, MergeOptions(quiet=True), ChainOfMergesMethod(), {})
    assert len(plan.blocks) == 32 and len(plan.weightless) == 4
    assert plan.memory.block_weights == 5 * _block_params(**LLAMA3_8B) * 4
    assert plan.memory.model_bytes == _model_params(LLAMA3_8B) * 2
    tokens = sum(e.data.num_tokens for e in plan.experts)
    assert plan.memory.activations == tokens * LLAMA3_8B["hidden"] * 4 * 2  # two paths
    with pytest.raises(Exception, match="no weights"):
        plan.check_weights()


def test_dry_run_of_llama3_8b_with_bfloat16_passes_counts_the_kept_blocks(tmp_path, monkeypatch):
    """On hardware with fast bfloat16, ``compute_dtype: auto`` runs the passes of these bf16
    checkpoints in bfloat16: the plan says so and holds the block matrices in bfloat16 as
    stored (norms float32), each group's weights widened to float32 for its solve."""
    from mergekit.options import MergeOptions

    from mergekit_ext.config import load_config
    from mergekit_ext.executor import compute, plan_layerwise_merge
    from mergekit_ext.methods.chain_of_merges import ChainOfMergesMethod

    monkeypatch.setattr(compute, "fast_bf16", lambda device_type: (True, "test: fast"))
    cfg = load_config(_setup(tmp_path, LLAMA3_8B, 3))
    plan = plan_layerwise_merge(cfg, MergeOptions(quiet=True), ChainOfMergesMethod(), {})
    assert plan.compute is not None and plan.compute.dtype == torch.bfloat16
    norms = 2 * LLAMA3_8B["hidden"]  # per block, float32
    matrices = _block_params(**LLAMA3_8B) - norms
    assert plan.memory.block_weights == 5 * (matrices * 2 + norms * 4)
    assert plan.memory.kept_matrices == matrices * 2
    # After a bf16 pass the span solve's out x in buffers are float32 (W₀ is the result):
    # 4 + 4 bytes per entry instead of 8 + 8 + 4, on the largest group, gate_up; its base
    # and three experts widened to float32 add 4 x 4
    monkeypatch.setattr(compute, "fast_bf16", lambda device_type: (False, "test: slow"))
    float32 = plan_layerwise_merge(cfg, MergeOptions(quiet=True), ChainOfMergesMethod(), {})
    assert float32.compute is not None and float32.compute.dtype == torch.float32
    assert float32.memory.kept_matrices == 0
    gate_up = 2 * LLAMA3_8B["intermediate"] * LLAMA3_8B["hidden"]
    assert float32.memory.solver - plan.memory.solver == 12 * gate_up - 16 * gate_up
    assert float32.memory.block_weights - plan.memory.block_weights == 5 * matrices * 2


def _rank_lines(text: str) -> dict[int, str]:
    return {
        int(m.group(1)): m.group(0)
        for m in re.finditer(r"  rank (\d+) \(tasks [^)]*\): peak ≈ .*\n    .*", text)
    }


def test_dry_run_of_llama3_70b_per_rank(tmp_path, monkeypatch):
    experts = 4
    config = _setup(tmp_path, LLAMA3_70B, experts)
    out = str(tmp_path / "out")
    block = _block_params(**LLAMA3_70B) * 4
    assert block == 3_422_617_600
    norms = 2 * LLAMA3_70B["hidden"] * 4  # a block's tensors outside its linear groups

    one = _dry_run(config, out)
    assert one.exit_code == 0, one.output
    assert "blocks: 80 (layers.{i})" in one.output
    assert f"block weights (6 blocks, float32): {_gb(6 * block)}" in one.output
    assert f"one model ≈ {_gb(_model_params(LLAMA3_70B) * 2)}" in one.output  # 141.1 GB

    two = _dry_run(config, out, "--world-size", "2")
    assert two.exit_code == 0, two.output
    ranks = _rank_lines(two.output)
    assert "processes: 2" in two.output and sorted(ranks) == [0, 1]
    # rank r owns tasks k mod 2 = r: two each; Chain of Merges passes sums along, so rank 0
    # also holds the other experts' non-linear tensors (the norms) that it merges.
    assert "(tasks task0, task2)" in ranks[0] and "(tasks task1, task3)" in ranks[1]
    assert f"block weights {_gb(4 * block + 2 * norms)}," in ranks[0]
    assert f"block weights {_gb(4 * block)}," in ranks[1]
    assert not os.path.exists(out)

    # the same plan under a launcher's environment (rank 0 prints every rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    launched = _dry_run(config, out)
    assert launched.exit_code == 0, launched.output
    assert _rank_lines(launched.output) == ranks


def test_without_dry_run_a_weightless_model_is_refused(tmp_path):
    config = _setup(tmp_path, LLAMA3_8B, 2)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["run", config, str(out)])
    assert result.exit_code == 1, result.output
    message = result.output
    assert "have no weights (only config.json)" in message and "--dry-run" in message
    assert all(str(tmp_path / m) in message for m in ("base", "expert0", "expert1"))
    assert not out.exists() and not [n for n in os.listdir(tmp_path) if n.startswith(".")]
    planned = CliRunner().invoke(main, ["run", config, str(out), "--world-size", "2"])
    assert planned.exit_code == 2 and "--world-size plans a merge" in planned.output


def test_dry_run_without_a_tokenizer_says_what_to_download(tmp_path):
    config = _setup(tmp_path, LLAMA3_8B, 2, tokenizer=False)
    result = _dry_run(config, str(tmp_path / "out"))
    assert result.exit_code == 1
    assert "has no weights and no tokenizer (only config.json)" in result.output
    assert 'hf download ORG/NAME --include "*.json"' in result.output
