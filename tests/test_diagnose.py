"""``mergekit-ext diagnose`` against whole-model computations with transformers."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import pytest
import torch
import transformers
import yaml
from click.testing import CliRunner
from PIL import Image

from mergekit_ext.calibration.sources import load_calibration
from mergekit_ext.cli import main
from mergekit_ext.config import ExtMergeConfig, parse_config
from mergekit_ext.diagnose import (
    chunked_kl_top1,
    diagnose,
    kl_and_agreement,
    plan_diagnosis,
)
from mergekit_ext.errors import CalibrationError, ConfigError, ModelInputError
from mergekit_ext.models.checkpoint import ModelSource
from mergekit_ext.models.lora import LoraModelSource

TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see conftest.py


def _write_texts(path: str, seed: int, n: int = 6) -> str:
    import tiny_models

    rng = np.random.RandomState(seed)
    with open(path, "w", encoding="utf-8") as fp:
        for _ in range(n):
            words = rng.choice(tiny_models.WORDS, size=rng.randint(2, 12))
            fp.write(json.dumps({"text": " ".join(words)}) + "\n")
    return path


def _write_images(folder: str, seed: int, n: int = 5) -> str:
    os.makedirs(folder, exist_ok=True)
    rng = np.random.RandomState(seed)
    for i in range(n):
        pixels = (rng.rand(20, 20, 3) * 255).astype("uint8")
        Image.fromarray(pixels).save(os.path.join(folder, f"{i}.png"))
    return folder


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("diagnose_data")
    for k in range(3):
        _write_texts(str(root / f"text{k}.jsonl"), seed=10 + k)
        _write_images(str(root / f"images{k}"), seed=10 + k)
    return str(root)


def _config(
    base: Optional[str],
    experts: Sequence[str],
    data: Sequence[Optional[str]],
    method: str = "ties",
) -> ExtMergeConfig:
    models: list[dict[str, Any]] = []
    for i, (e, d) in enumerate(zip(experts, data)):
        entry: dict[str, Any] = {"model": e, "name": f"task{i}"}
        if d is not None:
            entry["calibration"] = {"path": d, "samples": 5, "batch_size": 2}
        models.append(entry)
    raw: dict[str, Any] = {"merge_method": method, "models": models}
    if base is not None:
        raw["base_model"] = base
    return parse_config(yaml.safe_dump(raw))


def _texts(data_dir: str, n: int) -> list[str]:
    return [os.path.join(data_dir, f"text{k}.jsonl") for k in range(n)]


# ------------------------------------------------------------------------------------------
# Pure functions


def test_chunked_kl_top1_equals_the_full_softmax():
    gen = torch.Generator().manual_seed(0)
    h_ref, h = torch.randn(7, 5, generator=gen), torch.randn(7, 5, generator=gen)
    w_ref, w = torch.randn(23, 5, generator=gen), torch.randn(23, 5, generator=gen)
    b_ref, b = torch.randn(23, generator=gen), torch.randn(23, generator=gen)
    expected_kl, expected_agree = kl_and_agreement(h_ref @ w_ref.T + b_ref, h @ w.T + b)
    for chunk in (1, 7 * 3, 7 * 23, 10**6):  # one column at a time up to the whole vocabulary
        kl, agree = chunked_kl_top1(h_ref, w_ref, h, w, b_ref, b, chunk_elements=chunk)
        torch.testing.assert_close(kl, expected_kl, rtol=1e-6, atol=1e-9)
        assert torch.equal(agree, expected_agree)
    kl, agree = chunked_kl_top1(h_ref, w_ref, h_ref, w_ref, chunk_elements=7 * 4)
    assert float(kl.abs().max()) < 1e-9 and bool(agree.all())


# ------------------------------------------------------------------------------------------
# An expert against itself


def _assert_identical(result: dict[str, Any], has_head: bool) -> None:
    for name, task in result["tasks"].items():
        assert [b["index"] for b in task["blocks"]] == [0, 1], name
        assert all(b["relative_error"] == 0.0 for b in task["blocks"]), name
        if has_head:
            assert task["agreement"] == 1.0, name
            assert abs(task["kl"]) < 1e-12, name
            assert task["head"] == "merged"
        else:
            assert task["agreement"] is None and task["kl"] is None


@pytest.mark.parametrize(
    "fixture,modality,has_head",
    [
        ("tiny_llama_set", "text", True),
        ("tiny_bert_classifier_set", "text", True),
        ("tiny_bert_set", "text", False),
        ("tiny_vit_set", "image", True),
        ("tiny_clip_vision_set", "image", False),
        ("tiny_clip_vision_projection_set", "image", False),
        ("tiny_clip_set", "image", False),
    ],
)
def test_expert_against_itself_agrees_fully(request, fixture, modality, has_head, data_dir):
    models = request.getfixturevalue(fixture)
    expert = models.experts[1]
    data = os.path.join(data_dir, "text1.jsonl" if modality == "text" else "images1")
    cfg = _config(models.base, [expert], [data])
    result = diagnose(cfg, expert)
    _assert_identical(result, has_head)
    task = result["tasks"]["task0"]
    if has_head:
        assert task["output"] == ("next_token" if "llama" in fixture else "class")
        assert task["positions"] > 0


def test_lora_expert_against_its_merged_weights(tiny_llama_set, data_dir, tmp_path):
    """A ``base+adapter`` expert against the adapter merged into the base (PEFT) agrees."""
    import peft

    base = tiny_llama_set.base
    model = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    )
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
    adapter = str(tmp_path / "adapter")
    lora.save_pretrained(adapter)
    merged = str(tmp_path / "merged")
    lora.merge_and_unload().save_pretrained(merged)
    cfg = _config(base, [f"{base}+{adapter}"], _texts(data_dir, 1))
    result = diagnose(cfg, merged)
    task = result["tasks"]["task0"]
    assert task["agreement"] == 1.0
    assert abs(task["kl"]) < 1e-9
    assert all(b["relative_error"] < 1e-5 for b in task["blocks"])
    # ... and the base (without the adapter) does not.
    against_base = diagnose(cfg, base)["tasks"]["task0"]
    assert against_base["blocks"][-1]["relative_error"] > 1e-3


# ------------------------------------------------------------------------------------------
# The base model as "merged" model: the same numbers as whole models in transformers


def _whole_model_reference(
    expert: torch.nn.Module,
    merged: torch.nn.Module,
    layers_of,
    batches: list[dict[str, torch.Tensor]],
    next_token: bool,
) -> dict[str, Any]:
    """Block outputs by forward hooks on whole models; agreement and KL from full logits."""
    outputs: dict[int, list[list[torch.Tensor]]] = {0: [], 1: []}

    def run(model, slot):
        captured: list[torch.Tensor] = []
        handles = [
            layer.register_forward_hook(
                lambda m, a, out: captured.append(out[0] if isinstance(out, tuple) else out)
            )
            for layer in layers_of(model)
        ]
        try:
            logits = model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits
        finally:
            for h in handles:
                h.remove()
        outputs[slot].append(captured)
        return logits.double()

    diff = [0.0] * 2
    norm = [0.0] * 2
    kl_sum, agree, count = 0.0, 0, 0
    with torch.no_grad():
        for batch in batches:
            ref = run(expert, 0)
            new = run(merged, 1)
            mask = batch["attention_mask"].bool()
            for i, (r, v) in enumerate(zip(outputs[0][-1], outputs[1][-1])):
                diff[i] += float(((v[mask].double() - r[mask].double()) ** 2).sum())
                norm[i] += float((r[mask].double() ** 2).sum())
            if next_token:
                ref, new = ref[mask], new[mask]
            log_p, log_q = torch.log_softmax(ref, -1), torch.log_softmax(new, -1)
            kl_sum += float((log_p.exp() * (log_p - log_q)).sum())
            agree += int((ref.argmax(-1) == new.argmax(-1)).sum())
            count += ref.shape[0]
    return {
        "errors": [(d / n) ** 0.5 for d, n in zip(diff, norm)],
        "agreement": agree / count,
        "kl": kl_sum / count,
    }


CASES = {
    "llama": ("tiny_llama_set", transformers.LlamaForCausalLM, lambda m: m.model.layers, True),
    "bert": (
        "tiny_bert_classifier_set",
        transformers.BertForSequenceClassification,
        lambda m: m.bert.encoder.layer,
        False,
    ),
}
# Discovered structure: Conv1D linears; blocks that return tuples (parallel attention). Not
# in the body-only test: their heads are tied to the input embeddings, so "the expert's head
# on the base body" has no whole-model reference there.
DISCOVERED_CASES = {
    "gpt2": ("tiny_gpt2_set", transformers.GPT2LMHeadModel, lambda m: m.transformer.h, True),
    "falcon": (
        "tiny_falcon_set",
        transformers.FalconForCausalLM,
        lambda m: m.transformer.h,
        True,
    ),
}


def _architecture_set(tmp_path_factory, model_type: str):
    import tiny_architectures
    import tiny_models
    from conftest import TinySet

    root = tmp_path_factory.mktemp(model_type)
    base = tiny_architectures.build(model_type, str(root / "base"))
    experts = tiny_models.make_experts(base, [str(root / f"expert{i}") for i in range(2)])
    arch = tiny_architectures.ARCHITECTURES[model_type].model_class
    return TinySet(model_type, arch, base, tuple(experts))


@pytest.fixture(scope="module")
def tiny_gpt2_set(tmp_path_factory):
    return _architecture_set(tmp_path_factory, "gpt2")


@pytest.fixture(scope="module")
def tiny_falcon_set(tmp_path_factory):
    return _architecture_set(tmp_path_factory, "falcon")


def _batches(
    cfg: ExtMergeConfig, index: int, heldout: Optional[bool] = None
) -> list[dict[str, torch.Tensor]]:
    """The batches diagnose runs for task ``index``: by default the examples the merge did
    not read (all of them for a data-free method such as TIES, which reads none)."""
    from mergekit_ext.methods.registry import ext_method_info

    if heldout is None:
        info = ext_method_info(str(cfg.merge.merge_method))
        heldout = info is not None and info.needs_calibration
    entry = cfg.models[index]
    used = [s for e in cfg.models if (s := cfg.calibration_for(e)) is not None]
    return load_calibration(
        cfg.calibration_for(entry),
        entry.model,
        task=entry.name,
        modality="text",
        exclude=used if heldout else (),
    ).batches


@pytest.mark.parametrize("case", [*CASES, *DISCOVERED_CASES])
def test_base_as_merged_matches_whole_model_transformers(request, case, data_dir):
    fixture, cls, layers_of, next_token = {**CASES, **DISCOVERED_CASES}[case]
    models = request.getfixturevalue(fixture)
    experts = list(models.experts[:2])
    cfg = _config(models.base, experts, _texts(data_dir, 2))
    result = diagnose(cfg, models.base)
    merged = cls.from_pretrained(models.base, dtype=torch.float32).eval()
    for k, expert_path in enumerate(experts):
        expert = cls.from_pretrained(expert_path, dtype=torch.float32).eval()
        expected = _whole_model_reference(expert, merged, layers_of, _batches(cfg, k), next_token)
        got = result["tasks"][f"task{k}"]
        assert got["head"] == "merged" and got["expert_tensors_used"] == []
        errors = [b["relative_error"] for b in got["blocks"]]
        np.testing.assert_allclose(errors, expected["errors"], rtol=TOL, atol=TOL)
        assert abs(got["agreement"] - expected["agreement"]) <= TOL
        assert abs(got["kl"] - expected["kl"]) <= TOL, (got["kl"], expected["kl"])
        assert min(errors) > 1e-3  # the base is not the expert: the numbers are not trivial
    assert result["mean_agreement"] == pytest.approx(
        np.mean([t["agreement"] for t in result["tasks"].values()])
    )


# ------------------------------------------------------------------------------------------
# Body-only merges: the expert's head on the merged body


@pytest.mark.parametrize("case", list(CASES))
def test_body_only_merge_uses_the_expert_heads(request, case, data_dir, tmp_path):
    fixture, cls, layers_of, next_token = CASES[case]
    models = request.getfixturevalue(fixture)
    experts = list(models.experts[:2])
    base_model = cls.from_pretrained(models.base, dtype=torch.float32)
    body = str(tmp_path / "body")
    base_model.base_model.save_pretrained(body)  # LlamaModel / BertModel: no head
    with open(os.path.join(body, "config.json"), encoding="utf-8") as fp:
        assert "For" not in json.load(fp)["architectures"][0]
    cfg = _config(models.base, experts, _texts(data_dir, 2))
    result = diagnose(cfg, body)
    for k, expert_path in enumerate(experts):
        got = result["tasks"][f"task{k}"]
        assert got["head"] == "expert"
        head = ["lm_head.weight"] if next_token else ["classifier.weight", "classifier.bias"]
        assert sorted(got["expert_tensors_used"]) == sorted(head)
        # Reference: the expert's class with the base body and the expert's own head.
        expert = cls.from_pretrained(expert_path, dtype=torch.float32).eval()
        hybrid = cls.from_pretrained(expert_path, dtype=torch.float32).eval()
        hybrid.base_model.load_state_dict(base_model.base_model.state_dict())
        expected = _whole_model_reference(expert, hybrid, layers_of, _batches(cfg, k), next_token)
        np.testing.assert_allclose(
            [b["relative_error"] for b in got["blocks"]], expected["errors"], rtol=TOL, atol=TOL
        )
        assert abs(got["agreement"] - expected["agreement"]) <= TOL
        assert abs(got["kl"] - expected["kl"]) <= TOL


# ------------------------------------------------------------------------------------------
# Bad input: clear errors before any weight loads


@pytest.fixture
def no_weights(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a weight was read before the input was checked")

    monkeypatch.setattr(ModelSource, "_read", refuse)
    monkeypatch.setattr(ModelSource, "read_checkpoint_key", refuse)
    monkeypatch.setattr(LoraModelSource, "_adapter_tensor", refuse)


def test_architecture_mismatch_is_refused_before_weights_load(
    tiny_llama_set, tiny_bert_set, data_dir, no_weights
):
    cfg = _config(tiny_llama_set.base, list(tiny_llama_set.experts[:1]), _texts(data_dir, 1))
    with pytest.raises(ModelInputError, match=r"architecture mismatch: the merged model .*bert"):
        diagnose(cfg, tiny_bert_set.base)


def test_depth_mismatch_is_refused_before_weights_load(
    tiny_llama_set, data_dir, tmp_path, no_weights
):
    import tiny_models

    deeper = tiny_models.make_tiny_llama(str(tmp_path / "deep"), layers=3)
    cfg = _config(tiny_llama_set.base, list(tiny_llama_set.experts[:1]), _texts(data_dir, 1))
    with pytest.raises(ModelInputError, match="has 3 blocks but expert"):
        diagnose(cfg, deeper)


def test_missing_calibration_is_refused_before_weights_load(
    tiny_llama_set, tiny_vit_set, data_dir, no_weights
):
    # an image task without data gets no generic probe: it needs --heldout
    experts = list(tiny_vit_set.experts[:2])
    cfg = _config(tiny_vit_set.base, experts, [os.path.join(data_dir, "images0"), None])
    with pytest.raises(CalibrationError, match=r"task 'task1'.*no calibration data.*--heldout"):
        diagnose(cfg, tiny_vit_set.base)
    # a text task without data is measured on the probe (issue #50): planned, not refused
    experts = list(tiny_llama_set.experts[:2])
    cfg = _config(tiny_llama_set.base, experts, [_texts(data_dir, 1)[0], None])
    plan = plan_diagnosis(cfg, [tiny_llama_set.base])
    assert plan.tasks[1].data_info["kind"] == "probe" and plan.tasks[1].data is plan.tasks[1].probe
    with pytest.raises(CalibrationError, match=r"task 'task1'.*--calibration-data"):
        diagnose(cfg, tiny_llama_set.base, data="calibration")
    cfg = _config(tiny_llama_set.base, experts[:1], [os.path.join(data_dir, "missing.jsonl")])
    with pytest.raises(CalibrationError, match="missing.jsonl"):
        diagnose(cfg, tiny_llama_set.base)


def test_configs_without_experts_are_refused(tiny_llama_set, data_dir, no_weights):
    base = tiny_llama_set.base
    only_base = _config(base, [base], _texts(data_dir, 1))
    with pytest.raises(ConfigError, match="no expert besides the base model"):
        plan_diagnosis(only_base, [base])
    slices = parse_config(
        yaml.safe_dump(
            {
                "merge_method": "slerp",
                "base_model": base,
                "slices": [{"sources": [{"model": base, "layer_range": [0, 2]}] * 2}],
                "parameters": {"t": 0.5},
            }
        )
    )
    with pytest.raises(ConfigError, match="`models:` list"):
        plan_diagnosis(slices, [base])


# ------------------------------------------------------------------------------------------
# The command line


def test_cli_writes_table_json_and_plot(tiny_bert_classifier_set, data_dir, tmp_path):
    models = tiny_bert_classifier_set
    raw = {
        "merge_method": "linear",
        "models": [
            {"model": e, "calibration": {"path": p, "samples": 4, "batch_size": 2}}
            for e, p in zip(models.experts[:2], _texts(data_dir, 2))
        ],
        "parameters": {"weight": 1.0},
    }
    raw["models"][0]["name"] = "first"
    config = tmp_path / "merge.yml"
    config.write_text(yaml.safe_dump(raw))
    out_json, plots = tmp_path / "out" / "diag.json", tmp_path / "plots"
    args = ["diagnose", models.experts[0], str(config), "--json", str(out_json)]
    result = CliRunner().invoke(main, [*args, "--plots", str(plots)])
    assert result.exit_code == 0, result.output
    assert "first" in result.output and "agreement" in result.output
    data = json.loads(out_json.read_text())
    assert set(data["tasks"]) == {"first", os.path.basename(models.experts[1])}
    first = data["tasks"]["first"]
    assert first["agreement"] == 1.0 and first["kl"] == 0.0
    assert [b["index"] for b in first["blocks"]] == [0, 1]
    assert all(isinstance(b["relative_error"], float) for b in first["blocks"])
    assert (plots / "diagnose_block_errors.png").stat().st_size > 1000

    # a text task without data (a data-free merge): measured on the generic probe
    raw["models"][1].pop("calibration")
    config.write_text(yaml.safe_dump(raw))
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    second = os.path.basename(models.experts[1])
    assert json.loads(out_json.read_text())["data"][second]["kind"] == "probe"
    # bad input: one line, exit 1, nothing written
    raw["models"][1]["calibration"] = {"path": str(tmp_path / "missing.jsonl")}
    config.write_text(yaml.safe_dump(raw))
    out_json.unlink()
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    assert "missing.jsonl" in result.output and not out_json.exists()
    # the output may not overwrite an input
    result = CliRunner().invoke(
        main, ["diagnose", models.experts[0], str(config), "--json", str(config)]
    )
    assert result.exit_code == 1 and "it is the input" in result.output


def test_card_diagnose_section(tiny_llama_set, data_dir, tmp_path):
    """``mergekit-ext card OUT --diagnose CONFIG`` adds the agreement section and the plot."""
    experts = list(tiny_llama_set.experts[:2])
    raw = {
        "merge_method": "linear",
        "models": [
            {
                "model": e,
                "name": f"task{i}",
                "parameters": {"weight": 1.0},
                "calibration": {"path": p, "samples": 4, "batch_size": 2},
            }
            for i, (e, p) in enumerate(zip(experts, _texts(data_dir, 2)))
        ],
    }
    config = tmp_path / "merge.yml"
    config.write_text(yaml.safe_dump(raw))
    out = tmp_path / "merged"
    result = CliRunner().invoke(main, ["run", str(config), str(out)])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["card", str(out), "--diagnose", str(config)])
    assert result.exit_code == 0, result.output
    card = (out / "README.md").read_text()
    assert "## Agreement with the experts" in card
    saved = json.loads((out / "mergekit_ext_diagnose.json").read_text())
    assert set(saved["tasks"]) == {"task0", "task1"}
    for task, values in saved["tasks"].items():
        assert 0.0 <= values["agreement"] <= 1.0 and values["kl"] > 0.0
        assert not os.path.isabs(values["model"])  # no machine path in the published folder
        section = card.split("## Agreement with the experts", 1)[1]
        row = next(line for line in section.splitlines() if line.startswith(f"| {task} |"))
        assert "this model's" in row
    assert "images/diagnose_block_errors.png" in card
    assert (out / "images" / "diagnose_block_errors.png").stat().st_size > 1000
    # the verdict against the base model, on the data the card names; no machine path
    assert f"**Verdict:** this model {saved['verdict']}." in card
    assert "held-out data (examples the merge did not read)" in card
    refs = saved["references"]
    assert refs["base"] is None and "names no base model" in saved["verdict"]  # linear: none
    assert "KL(expert ‖ base model)" not in card
    for row in refs["experts"].values():
        assert not os.path.isabs(row["model"])
        assert all(not os.path.isabs(t["model"]) for t in row["tasks"].values())
    assert all(not os.path.isabs(d["source"]) for d in saved["data"].values())
    # a later rebuild without --diagnose keeps the saved result's section, and so does the
    # copy publish renders for a repository, without touching the folder
    result = CliRunner().invoke(main, ["card", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "README.md").read_text() == card
    from mergekit_ext.hub.card import render_card_for_repo

    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    uploaded = render_card_for_repo(str(out), "user/merged")
    assert (
        "## Agreement with the experts" in uploaded
        and "images/diagnose_block_errors.png" in uploaded
    )
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    # without a saved result there is no such section
    (out / "mergekit_ext_diagnose.json").unlink()
    result = CliRunner().invoke(main, ["card", str(out)])
    assert result.exit_code == 0
    assert "Agreement with the experts" not in (out / "README.md").read_text()


def test_tied_lm_head_matches_whole_model_transformers(tiny_llama_set, data_dir, tmp_path):
    """A causal LM whose head is tied to its embeddings (saved once) reads it as transformers."""
    import shutil

    import tiny_models

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=tiny_models.VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    base = str(tmp_path / "tied")
    transformers.LlamaForCausalLM(config).save_pretrained(base)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny_llama_set.base, f), os.path.join(base, f))
    (expert_path,) = tiny_models.make_experts(base, [str(tmp_path / "e0")], scale=0.2)
    from safetensors import safe_open

    with safe_open(os.path.join(expert_path, "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())  # stored once, as the embeddings
    cfg = _config(base, [expert_path], _texts(data_dir, 1))
    got = diagnose(cfg, base)["tasks"]["task0"]
    cls = transformers.LlamaForCausalLM
    expert = cls.from_pretrained(expert_path, dtype=torch.float32).eval()
    merged = cls.from_pretrained(base, dtype=torch.float32).eval()
    expected = _whole_model_reference(
        expert, merged, lambda m: m.model.layers, _batches(cfg, 0), True
    )
    assert got["head"] == "merged"
    np.testing.assert_allclose(
        [b["relative_error"] for b in got["blocks"]], expected["errors"], rtol=TOL, atol=TOL
    )
    assert abs(got["agreement"] - expected["agreement"]) <= TOL
    assert abs(got["kl"] - expected["kl"]) <= TOL and got["kl"] > 1e-4


def test_one_block_of_weights_at_a_time(tiny_llama_set, data_dir, monkeypatch):
    """Streaming: never more than one block's tensors alive, never two blocks at once."""
    import weakref

    live: list[tuple[weakref.ref, str]] = []
    peaks = {"block": 0, "blocks_at_once": 0}
    original = ModelSource.load

    def counting_load(self, canonical, device="cpu", cache=None):
        tensor = original(self, canonical, device, cache)
        live.append((weakref.ref(tensor), canonical))
        live[:] = [(ref, name) for ref, name in live if ref() is not None]
        in_blocks = [name for _, name in live if name.startswith("layers.")]
        peaks["block"] = max(peaks["block"], len(in_blocks))
        peaks["blocks_at_once"] = max(
            peaks["blocks_at_once"], len({n.split(".")[1] for n in in_blocks})
        )
        return tensor

    monkeypatch.setattr(ModelSource, "load", counting_load)
    experts = list(tiny_llama_set.experts)
    cfg = _config(tiny_llama_set.base, experts, _texts(data_dir, 3))
    diagnose(cfg, [experts[0], tiny_llama_set.base])  # two merged models, three experts
    assert peaks["block"] == 9  # the 9 tensors of one Llama block, of one model
    assert peaks["blocks_at_once"] == 1
