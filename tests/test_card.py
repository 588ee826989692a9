"""Model cards: templates per architecture, front matter, diagnostics summaries and plots.

The ACE diagnostics come from real tiny merges (mergekit's ``run_merge`` inside
``merge_record.collecting``); RegMean, Chain of Merges and QP records come from the methods'
own ``merge_linear_group`` on random linear groups; SyMerge's section is built from the
documented schema. Every test runs with sockets blocked: building a card must never touch
the network.

About validation: ``huggingface_hub.ModelCard.validate`` posts the card to the Hub's
``/api/validate-yaml`` endpoint, which these machines cannot reach. Instead each card's
front matter is checked offline: it parses with ``ModelCard`` / ``metadata_load``, and
re-serialising it through ``ModelCardData`` gives back the same mapping (the round trip
that ``ModelCard`` itself performs when it saves a card), with exactly the keys expected.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import socket
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner
from huggingface_hub import ModelCard, ModelCardData, metadata_load
from mergekit.merge import run_merge
from mergekit.options import MergeOptions
from PIL import Image
from safetensors.numpy import load_file

from mergekit_ext import merge_record
from mergekit_ext.cli_hub import card_command
from mergekit_ext.config import parse_config
from mergekit_ext.errors import ConfigError, MergekitExtError
from mergekit_ext.hub import card as card_mod
from mergekit_ext.hub.card import (
    architecture_info,
    display_path,
    is_hub_model_id,
    write_model_card,
)
from mergekit_ext.methods.layerwise import LinearGroup, TaskStatistics
from mergekit_ext.models.mergekit_definitions import layout_tensor_names, our_architectures

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
EMBEDDING_MARKERS = ("embed", "lm_head", "word_embeddings", "position_embedding")


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any connection attempt fails the test: cards are built offline."""

    def refuse(self: socket.socket, address: object) -> None:
        raise AssertionError(f"the model card tried to open a connection to {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)


# ----------------------------------------------------------------------------- helpers


def ace_merge(base: str, experts: list[str], out_dir: Path, *, extra_yaml: str = "") -> str:
    """A real ACE merge with diagnostics, laid out like ``mergekit-ext run`` leaves it."""
    models = "".join(f"  - model: {e}\n    name: task{i}\n" for i, e in enumerate(experts))
    yaml_text = (
        f"merge_method: ace\nbase_model: {base}\nmodels:\n{models}"
        f"parameters:\n  gamma_threshold: 0.2\ndtype: float32\n{extra_yaml}"
    )
    cfg = parse_config(yaml_text)
    # with the architecture definitions mergekit-ext's runner gives mergekit
    with merge_record.collecting() as collector, our_architectures(layout_tensor_names(base)):
        run_merge(
            cfg.merge,
            str(out_dir),
            options=MergeOptions(write_model_card=False, quiet=True, random_seed=0),
            config_source=yaml_text,
        )
    (out_dir / "mergekit_config.yml").write_text(yaml_text, encoding="utf-8")
    merge_record.MergeRecord(cfg.method, sections=collector.sections).write(
        str(out_dir),
        parameters=cfg.parameters,
        seed=0,
        config_sha256=cfg.sha256,
        inputs=card_mod.input_records(cfg),  # as the runner records them
    )
    return yaml_text


def front_matter_text(readme: str) -> str:
    match = re.match(r"^---\n(.*?)\n---\n", Path(readme).read_text(encoding="utf-8"), re.S)
    assert match, "the card has no YAML front matter"
    return match.group(1)


def check_round_trip(readme: str) -> dict:
    """Front matter parses, and ModelCardData gives back exactly the same mapping."""
    meta = metadata_load(readme)
    assert isinstance(meta, dict) and meta
    assert ModelCardData(**meta).to_dict() == meta
    card = ModelCard.load(readme)
    assert card.data.to_dict() == meta
    assert yaml.safe_load(front_matter_text(readme)) == meta
    return meta


def check_images(out_dir: Path, readme: str) -> list[str]:
    """Every image linked from the card exists, is a real PNG and opens with PIL."""
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", Path(readme).read_text(encoding="utf-8"))
    for link in links:
        assert not os.path.isabs(link) and link.startswith("images/"), link
        path = out_dir / link
        data = path.read_bytes()
        assert data[:8] == PNG_MAGIC, link
        with Image.open(path) as image:
            image.verify()
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size[0] > 200 and image.size[1] > 100
    return sorted(os.path.basename(link) for link in links)


def reference_gamma(base: dict, experts: list[dict], name: str) -> float:
    """γ = Var_k(l_k) / (Mean_k(l_k)² + 1e-12), l_k = log(‖Δ_k‖² + 1e-12), in numpy."""
    w0 = base[name].astype(np.float64)
    logs = np.array(
        [np.log(((e[name].astype(np.float64) - w0) ** 2).sum() + 1e-12) for e in experts]
    )
    return float(logs.var(ddof=1) / (logs.mean() ** 2 + 1e-12))


def linear_weight_names(checkpoint: dict) -> set[str]:
    return {
        name
        for name, value in checkpoint.items()
        if value.ndim == 2 and not any(m in name.lower() for m in EMBEDDING_MARKERS)
    }


@pytest.fixture(scope="module")
def llama_merge(tiny_llama_set, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("card_llama") / "merged-llama"
    ace_merge(tiny_llama_set.base, list(tiny_llama_set.experts), out)
    return out


# ------------------------------------------------------------------- real ACE merges


def test_ace_llama_card_from_real_diagnostics(llama_merge: Path, tiny_llama_set) -> None:
    out = llama_merge
    readme = write_model_card(str(out))
    assert readme == os.path.join(str(out), "README.md")
    text = Path(readme).read_text(encoding="utf-8")

    meta = check_round_trip(readme)
    assert meta == {
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["mergekit", "merge", "mergekit-ext", "ace"],
    }  # every input is a local folder: no base_model, no license, no datasets

    # The recorded γ are those of the checkpoints (independent numpy computation).
    base = load_file(os.path.join(tiny_llama_set.base, "model.safetensors"))
    experts = [load_file(os.path.join(e, "model.safetensors")) for e in tiny_llama_set.experts]
    tensors = merge_record.load(str(out))["sections"]["ace"]["tensors"]
    assert set(tensors) == linear_weight_names(base) and len(tensors) == 14
    gammas = {name: reference_gamma(base, experts, name) for name in tensors}
    for name, record in tensors.items():
        assert record["gamma"] == pytest.approx(gammas[name], rel=1e-9)
        assert record["normalized"] == (gammas[name] > 0.2)
    n_norm = sum(g > 0.2 for g in gammas.values())
    assert 0 < n_norm < len(gammas)  # both branches of ACE are exercised
    assert f"{n_norm} ({100 * n_norm / 14:.1f}%) had heterogeneity γ above the threshold" in text
    values = sorted(gammas.values())
    assert f"| γ | {values[0]:.3g} | {statistics.median(values):.3g} | {values[-1]:.3g} |" in text
    conds = {n: r["condition_number"] for n, r in tensors.items()}
    assert f"Worst-conditioned weight: `{max(conds, key=conds.get)}`." in text

    # Template and body.
    assert "AutoModelForCausalLM.from_pretrained" in text and "AutoTokenizer" in text
    assert "# merged-llama" in text and "`ace`" in text
    assert "https://arxiv.org/abs/2603.02945" in text
    # Parameters as given: gamma_threshold set in the YAML (beside its default), eps not set.
    assert "| `gamma_threshold` | `0.2` | `0.3` |" in text
    assert "| `eps` | — | `0.01` |" in text
    assert "(default)" not in text and "Per-model parameters" not in text  # ACE has none
    assert f"`{merge_record.load(str(out))['config_sha256']}`" in text
    for pkg in ("mergekit-ext", "mergekit", "torch", "transformers"):
        assert f"| {pkg} | " in text
    assert "None: `ace` is data-free." in text

    # Local inputs are named by folder, never by absolute path, anywhere in the card.
    for path in (tiny_llama_set.base, *tiny_llama_set.experts):
        assert path not in text
        assert f"`./{os.path.basename(path)}`" in text  # ./: never read as a Hub id
    assert str(out.parent) not in text
    assert not re.search(r"(^|\s)/(tmp|home|root|Users)/", front_matter_text(readme))

    assert check_images(out, readme) == ["ace_gamma.png", "ace_normalization.png"]


def test_card_is_deterministic(llama_merge: Path) -> None:
    first = write_model_card(str(llama_merge))
    text = Path(first).read_text(encoding="utf-8")
    images = {p.name: p.read_bytes() for p in (llama_merge / "images").iterdir()}
    write_model_card(str(llama_merge))
    assert Path(first).read_text(encoding="utf-8") == text
    assert {p.name: p.read_bytes() for p in (llama_merge / "images").iterdir()} == images


def test_ace_bert_classifier_uses_encoder_template(tiny_bert_classifier_set, tmp_path) -> None:
    out = tmp_path / "merged-bert"
    ace_merge(tiny_bert_classifier_set.base, list(tiny_bert_classifier_set.experts), out)
    readme = write_model_card(str(out))
    text = Path(readme).read_text(encoding="utf-8")
    meta = check_round_trip(readme)
    assert meta["pipeline_tag"] == "text-classification"
    assert "AutoModelForSequenceClassification.from_pretrained" in text
    assert "predictions = outputs.logits.argmax(-1)" in text
    assert "No tokenizer was saved" not in text  # mergekit copied the tokenizer
    base = load_file(os.path.join(tiny_bert_classifier_set.base, "model.safetensors"))
    tensors = merge_record.load(str(out))["sections"]["ace"]["tensors"]
    assert set(tensors) == linear_weight_names(base)
    assert f"{len(tensors)} linear weights were merged" in text
    assert check_images(out, readme) == ["ace_gamma.png", "ace_normalization.png"]


def test_ace_vit_uses_vision_template(tiny_vit_set, tmp_path) -> None:
    out = tmp_path / "merged-vit"
    ace_merge(tiny_vit_set.base, list(tiny_vit_set.experts), out)
    readme = write_model_card(str(out))
    text = Path(readme).read_text(encoding="utf-8")
    meta = check_round_trip(readme)
    assert meta["pipeline_tag"] == "image-classification"
    assert "AutoModelForImageClassification.from_pretrained" in text
    assert "AutoImageProcessor" in text and "model.config.id2label" in text
    assert "No image processor was saved" not in text  # preprocessor_config.json came along
    assert check_images(out, readme) == ["ace_gamma.png", "ace_normalization.png"]


# ----------------------------------------------------------- architecture → template


@pytest.mark.parametrize(
    ("config", "template", "tag", "auto"),
    [
        (
            {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
            "causal_lm",
            "text-generation",
            "AutoModelForCausalLM",
        ),
        (
            {"architectures": ["GPT2LMHeadModel"]},
            "causal_lm",
            "text-generation",
            "AutoModelForCausalLM",
        ),
        (
            {"architectures": ["LlamaModel"], "model_type": "llama"},
            "causal_lm",
            "feature-extraction",
            "AutoModel",
        ),
        (
            {"architectures": ["BertModel"], "model_type": "bert"},
            "encoder",
            "feature-extraction",
            "AutoModel",
        ),
        ({"model_type": "bert"}, "encoder", "feature-extraction", "AutoModel"),
        (
            {"architectures": ["BertForSequenceClassification"]},
            "encoder",
            "text-classification",
            "AutoModelForSequenceClassification",
        ),
        ({"architectures": ["BertForMaskedLM"]}, "encoder", "fill-mask", "AutoModelForMaskedLM"),
        (
            {"architectures": ["ViTForImageClassification"], "model_type": "vit"},
            "vision",
            "image-classification",
            "AutoModelForImageClassification",
        ),
        (
            {"architectures": ["ViTModel"], "model_type": "vit", "image_size": 16, "patch_size": 4},
            "vision",
            "image-feature-extraction",
            "AutoModel",
        ),
        ({"architectures": ["CLIPModel"]}, "vision", "zero-shot-image-classification", "AutoModel"),
        (
            {"architectures": ["CLIPVisionModel"]},
            "vision",
            "image-feature-extraction",
            "CLIPVisionModel",
        ),
        (
            {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5"},
            "causal_lm",
            "text2text-generation",
            "AutoModelForSeq2SeqLM",
        ),
        (
            {
                "architectures": ["LlavaForConditionalGeneration"],
                "vision_config": {},
                "text_config": {},
            },
            "causal_lm",
            "image-text-to-text",
            "AutoModelForImageTextToText",
        ),
    ],
)
def test_architecture_picks_template(config, template, tag, auto) -> None:
    info = architecture_info(config)
    assert (info.template, info.pipeline_tag, info.auto_class) == (template, tag, auto)


# --------------------------------------------------- Hub ids, licenses and datasets


def _fake_cached_readme(cache: Path, repo_id: str, license_id: str) -> None:
    """A README in the layout of the local Hugging Face cache (no download involved)."""
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "README.md").write_text(f"---\nlicense: {license_id}\n---\n# model\n")
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)


def _local_model(folder: Path, license_id: str | None) -> None:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    if license_id:
        (folder / "README.md").write_text(f"---\nlicense: {license_id}\ntags: [x]\n---\n# m\n")


@pytest.fixture
def hub_workspace(tmp_path: Path, llama_merge: Path, monkeypatch: pytest.MonkeyPatch):
    """A CWD with local models, a fake HF cache, and an output folder with Hub inputs."""
    import huggingface_hub.constants as hf_constants

    work = tmp_path / "work"
    work.mkdir()
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(work)
    elsewhere = tmp_path / "elsewhere" / "abs-expert"
    out = work / "merged"
    out.mkdir()
    shutil.copy(llama_merge / "config.json", out / "config.json")

    def setup(local_license, abs_license, cached_license, recorded: bool = True) -> Path:
        _local_model(work / "local" / "finetuned", local_license)  # looks like owner/name
        _local_model(elsewhere, abs_license)
        if cached_license:
            _fake_cached_readme(cache, "org-b/expert-one", cached_license)
        yaml_text = (
            "merge_method: linear\n"
            "base_model: org-a/base-model\n"
            "models:\n"
            "  - model: org-a/base-model\n    parameters: {weight: 0.2}\n"
            "  - model: org-b/expert-one\n    name: hub-expert\n    parameters: {weight: 0.4}\n"
            "  - model: local/finetuned\n    parameters: {weight: 0.2}\n"
            f"  - model: {elsewhere}\n    parameters: {{weight: 0.2}}\n"
            "calibration:\n  dataset: org-c/calib-text\n  samples: 8\n"
            "dtype: float32\n"
        )
        if recorded:
            record_merge_metadata(out, yaml_text)
        else:  # an output written before mergekit-ext recorded its inputs
            (out / "mergekit_config.yml").write_text(yaml_text, encoding="utf-8")
        return out

    return setup


def record_merge_metadata(out: Path, yaml_text: str) -> None:
    """What the runner writes after a merge, in the CWD of the merge: the diagnostics with
    the inputs' record and the config copy, both with absolute paths shortened."""
    cfg = parse_config(yaml_text)
    redact = card_mod.local_path_redactor(cfg.raw)
    published = redact(yaml_text)
    merge_record.MergeRecord(cfg.method).write(
        str(out),
        redact=redact,
        parameters=cfg.parameters,
        config_sha256=cfg.sha256,
        config_written_sha256=hashlib.sha256(published.encode()).hexdigest(),
        inputs=card_mod.input_records(cfg),
    )
    (out / "mergekit_config.yml").write_text(published, encoding="utf-8")


def test_hub_ids_license_agreement_and_datasets(hub_workspace) -> None:
    out = hub_workspace("apache-2.0", "apache-2.0", "apache-2.0")
    readme = write_model_card(str(out))
    meta = check_round_trip(readme)
    assert meta["base_model"] == ["org-a/base-model", "org-b/expert-one"]
    assert meta["base_model_relation"] == "merge"
    # org-a/base-model (not cached) declares no license: none is set (issue #50.2)
    assert "license" not in meta
    assert meta["datasets"] == ["org-c/calib-text"]
    assert meta["tags"] == ["mergekit", "merge", "mergekit-ext", "linear"]
    text = Path(readme).read_text(encoding="utf-8")
    assert "[org-b/expert-one](https://huggingface.co/org-b/expert-one)" in text
    assert "| model | finetuned | `./local/finetuned` | local folder | apache-2.0 |" in text
    assert "| model | abs-expert | `./abs-expert` | local folder | apache-2.0 |" in text
    assert "Inputs that declare no license: base-model; the others use `apache-2.0`" in text
    assert str(out.parent.parent) not in text  # the absolute input is shown by folder name
    assert "The method recorded no diagnostics for this merge." in text


def test_card_rebuilt_elsewhere_keeps_the_recorded_sources(
    hub_workspace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #14 item 7: Hub or local is what the merge recorded, whatever the CWD now."""
    out = hub_workspace("apache-2.0", "apache-2.0", "apache-2.0")
    first = Path(write_model_card(str(out))).read_bytes()
    other = tmp_path / "somewhere-else"
    other.mkdir()
    monkeypatch.chdir(other)  # `local/finetuned` does not exist here: it looks like owner/name
    readme = write_model_card(str(out))
    assert Path(readme).read_bytes() == first
    meta = check_round_trip(readme)
    assert meta["base_model"] == ["org-a/base-model", "org-b/expert-one"]
    # the licenses recorded with the merge, not looked up again (base-model declares none,
    # so the merge gets none: issue #50.2)
    assert "license" not in meta
    assert "| `./local/finetuned` | local folder | apache-2.0 |" in Path(readme).read_text()
    text = Path(readme).read_text(encoding="utf-8")
    assert "| model | finetuned | `./local/finetuned` | local folder | apache-2.0 |" in text
    assert "(commit `0123456789ab`)" in text  # the cached commit the merge read
    recorded = {r["model"]: r for r in merge_record.load(str(out))["inputs"]}
    assert recorded["local/finetuned"]["source"] == "local"
    assert recorded["abs-expert"]["source"] == "local"  # the absolute path, shortened
    assert recorded["org-b/expert-one"]["source"] == "hub"
    assert recorded["org-b/expert-one"]["commit"] == "0123456789abcdef0123456789abcdef01234567"
    assert recorded["org-a/base-model"] == {
        "role": "base",
        "model": "org-a/base-model",
        "revision": None,
        "source": "hub",
        "commit": None,  # not in the cache when the record was made
        "lora": None,
        "lora_source": None,
        "license": None,
        "hub_id": None,  # a Hub input: no id to read back from a local folder
        "hub_id_origin": None,
        "download_commit": None,
    }


def test_card_without_inputs_record_uses_the_hub_cache_only(hub_workspace, tmp_path: Path) -> None:
    """Older outputs: an owner/name is a Hub model only when the local Hub cache has it."""
    out = hub_workspace("apache-2.0", "apache-2.0", "apache-2.0", recorded=False)
    meta = check_round_trip(write_model_card(str(out)))
    assert meta["base_model"] == ["org-b/expert-one"]  # org-a/base-model is not cached
    text = (out / "README.md").read_text(encoding="utf-8")
    assert "| base | base-model | `./org-a/base-model` | local folder |" in text
    assert "do not record where its inputs came from" in text
    assert "No diagnostics file" in text


def test_license_disagreement_sets_none(hub_workspace) -> None:
    out = hub_workspace("apache-2.0", "apache-2.0", "mit")
    readme = write_model_card(str(out))
    meta = check_round_trip(readme)
    assert "license" not in meta
    text = Path(readme).read_text(encoding="utf-8")
    assert "declare different licenses" in text
    assert "hub-expert: mit" in text and "finetuned: apache-2.0" in text


def test_no_declared_license(hub_workspace) -> None:
    out = hub_workspace(None, None, None)
    meta = check_round_trip(write_model_card(str(out)))
    assert "license" not in meta
    assert "None of the input models declares a license" in (out / "README.md").read_text()


def test_hub_id_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "team" / "model").mkdir(parents=True)
    assert is_hub_model_id("meta-llama/Llama-3.1-8B")
    assert not is_hub_model_id("team/model")  # exists locally
    assert not is_hub_model_id("./team/model")
    assert not is_hub_model_id("/abs/path")
    assert not is_hub_model_id("a/b/c")
    assert not is_hub_model_id("plain-name")
    assert not is_hub_model_id("org/bad..name")
    assert display_path("/somewhere/else/model-x", str(tmp_path)) == "model-x"
    assert display_path(str(tmp_path / "team" / "model"), str(tmp_path)) == "team/model"
    assert display_path("relative/dir", str(tmp_path)) == "relative/dir"
    assert display_path("~/models/mine", str(tmp_path)) == "mine"


# --------------------------------------- data-aware sections: real records and schema


def _statistics(x: torch.Tensor) -> TaskStatistics:
    x = x.double()
    unit = x / x.norm(dim=1, keepdim=True)
    return TaskStatistics(
        gram=x.T @ x / len(x),
        mean=x.mean(0),
        count=len(x),
        gram_normalized=unit.T @ unit / len(x),
    )


def _linear_groups(n_layers: int, tasks: list[str]) -> list[LinearGroup]:
    gen = torch.Generator().manual_seed(7)
    groups = []
    for layer in range(n_layers):
        names = [
            f"model.layers.{layer}.mlp.up_proj.weight",
            f"model.layers.{layer}.mlp.gate_proj.weight",
        ]
        base = {n: torch.randn(6, 8, generator=gen) for n in names}
        experts = [
            {n: w + 0.1 * (k + 1) * torch.randn(6, 8, generator=gen) for n, w in base.items()}
            for k in range(len(tasks))
        ]
        expert_x = [torch.randn(64, 8, generator=gen) * (1 + k) for k in range(len(tasks))]
        merged_x = [x + 0.3 * (layer + 1) * torch.randn(64, 8, generator=gen) for x in expert_x]
        groups.append(
            LinearGroup(
                name=f"model.layers.{layer}.mlp.gate_up",
                weights=names,
                base=base,
                experts=experts,
                task_names=tasks,
                expert_stats=[_statistics(x) for x in expert_x],
                merged_stats=[_statistics(x) for x in merged_x],
            )
        )
    return groups


def _symerge_section(tasks: list[str]) -> dict:
    rng = np.random.default_rng(3)
    steps = np.arange(60)
    return {
        "loss": (2.0 * np.exp(-steps / 15) + 0.05 * rng.random(60)).tolist(),
        "agreement": {
            t: np.clip(0.4 + 0.01 * k + 0.008 * steps[:30], 0, 1).tolist()
            for k, t in enumerate(tasks)
        },
        "lambda": rng.uniform(0, 1, size=(len(tasks), 12)).tolist(),  # K x P, as symerge writes it
        "lambda_tensors": [f"model.layers.{i // 4}.w{i}" for i in range(12)],
        "tasks": tasks,
        "heldout_accuracy": {t: 0.7 + 0.05 * k for k, t in enumerate(tasks)},
    }


def test_data_aware_sections_summaries_and_plots(llama_merge: Path, tmp_path: Path) -> None:
    from mergekit_ext.methods.chain_of_merges import ChainOfMergesMethod
    from mergekit_ext.methods.qp_projection import QPProjectionMethod
    from mergekit_ext.methods.regmean import RegMeanMethod

    out = tmp_path / "merged"
    shutil.copytree(llama_merge, out)
    tasks = ["math", "code"]
    groups = _linear_groups(3, tasks)
    # RegMean asks for the experts' own path only (statistics_request: propagate=False).
    regmean = [
        RegMeanMethod().merge_linear_group(dataclasses.replace(g, merged_stats=None), {})[1]
        for g in groups
    ]
    com = [
        ChainOfMergesMethod().merge_linear_group(
            g, {"propagate": True, "task_weighting": "correlation"}
        )[1]
        for g in groups
    ]
    qp = [
        QPProjectionMethod().merge_linear_group(
            g,
            # the plain QP (prior 0, tiny ridge): its optimum beats every feasible point
            {
                "propagate": True,
                "diagnose_both_bases": True,
                "basis": "residual_eigen",
                "prior": 0.0,
                "ridge": 1e-6,
            },
        )[1]
        for g in groups
    ]
    recorded = merge_record.load(str(out))
    sections = {
        "ace": recorded["sections"]["ace"],
        "regmean": {"layers": regmean},
        "chain_of_merges": {"layers": com},
        "qp_projection": {"layers": qp},
        "symerge": _symerge_section(tasks),
    }
    merge_record.MergeRecord(
        "ace",
        sections=sections,
        calibration={
            "math": {
                "source": "/data/secret/math.jsonl",
                "samples": 64,
                "tokens": 4096,
                "sha256": "a" * 64,
                "modality": "text",
            },
            "code": {
                "source": "data/code.jsonl",
                "samples": 32,
                "tokens": 2048,
                "sha256": "b" * 64,
                "modality": "text",
            },
        },
    ).write(
        str(out), parameters=recorded["parameters"], seed=0, config_sha256=recorded["config_sha256"]
    )
    (out / "tasks" / "math").mkdir(parents=True)
    (out / "tasks" / "code").mkdir()
    # math: a complete checkpoint of the expert's class; code: a PEFT adapter (--task-layers-only)
    (out / "tasks" / "math" / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForSequenceClassification"]})
    )
    (out / "tasks" / "code" / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"]})
    )
    (out / "tasks" / "code" / "adapter_config.json").write_text("{}")

    readme = write_model_card(str(out), name="merged-many")
    text = Path(readme).read_text(encoding="utf-8")
    check_round_trip(readme)

    for title in (
        "### ACE",
        "### Chain of Merges",
        "### RegMean",
        "### QP output-space projection",
        "### SyMerge",
    ):
        assert title in text

    # CoM: each task's mean share of ω and max covariate shift, recomputed here.
    for task in tasks:
        shares = [
            layer["tasks"][task]["weight"] / sum(t["weight"] for t in layer["tasks"].values())
            for layer in com
        ]
        shifts = [layer["tasks"][task]["covariate_shift_w2"] for layer in com]
        worst = com[int(np.argmax(shifts))]["layer"]
        row = f"| {task} | {100 * statistics.fmean(shares):.1f}% | {statistics.fmean(shifts):.3g} | {max(shifts):.3g} (`{worst}`) |"
        assert row in text
    assert all(layer["tasks"][t]["covariate_shift_w2"] > 0 for layer in com for t in tasks)
    # RegMean has no merged path: the shift is not measured and the card says so.
    assert "The covariate shift was not measured" in text

    # QP: total captured energy = 1 − ΣJ(d*)/ΣJ(0) over all weights of all layers.
    weights = [w for layer in qp for w in layer["weights"].values()]
    total = 1 - sum(w["J_opt"] for w in weights) / sum(w["J0"] for w in weights)
    assert f"| QP optimum d* (residual_eigen) | {100 * total:.1f}% |" in text
    ta = 1 - sum(w["J_task_arithmetic"]["1/K"] for w in weights) / sum(w["J0"] for w in weights)
    assert f"| task arithmetic, λ=1/K | {100 * ta:.1f}% |" in text
    assert total >= ta - 1e-9  # the optimum is at least as good as a feasible point

    # SyMerge: agreement first → last, held-out accuracy, λ column means.
    sym = _symerge_section(tasks)
    for k, task in enumerate(tasks):
        curve = sym["agreement"][task]
        lam_mean = statistics.fmean(sym["lambda"][k])
        assert (
            f"| {task} | {100 * curve[0]:.1f}% → {100 * curve[-1]:.1f}% | "
            f"{100 * sym['heldout_accuracy'][task]:.1f}% | {lam_mean:.3g} |" in text
        )
    assert 'subfolder="tasks/math"' in text and 'subfolder="tasks/code"' in text
    assert 'LlamaForSequenceClassification.from_pretrained("' in text
    assert "PeftModel.from_pretrained(" in text and "LlamaForCausalLM.from_pretrained(" in text

    # Calibration summary: source, samples, tokens, hash; never an absolute path.
    # (a task the config does not name: no max length / chat template to show)
    assert "| math | `math.jsonl` | — | 64 | 4,096 | — | — | text | `" + "a" * 64 + "` |" in text
    assert "/data/secret" not in text

    assert check_images(out, readme) == sorted(
        [
            "ace_gamma.png",
            "ace_normalization.png",
            "chain_of_merges_covariate_shift.png",
            "chain_of_merges_task_weights.png",
            "regmean_covariate_shift.png",
            "regmean_task_weights.png",
            "qp_captured_energy.png",
            "symerge_loss.png",
            "symerge_agreement.png",
            "symerge_lambda.png",
        ]
    )


# ------------------------------------------------------------------ eval results + CLI


EVAL = [
    {
        "task": "text-generation",
        "task_name": "Language modelling",
        "dataset": {"name": "WikiText-2", "type": "Salesforce/wikitext", "split": "test"},
        "metrics": [{"type": "perplexity", "value": 23.5}, {"type": "accuracy", "value": 0.41}],
    }
]


def test_eval_results_become_model_index(llama_merge: Path, tmp_path: Path) -> None:
    out = tmp_path / "merged"
    shutil.copytree(llama_merge, out)
    readme = write_model_card(str(out), eval_results=EVAL, name="my-merge")
    meta = check_round_trip(readme)
    index = meta["model-index"]
    assert index[0]["name"] == "my-merge"
    results = index[0]["results"]
    assert results[0]["dataset"] == {
        "name": "WikiText-2",
        "type": "Salesforce/wikitext",
        "split": "test",
    }
    assert [m["value"] for r in results for m in r["metrics"]] == [23.5, 0.41]
    card = ModelCard.load(readme)
    assert [r.metric_value for r in card.data.eval_results] == [23.5, 0.41]
    assert (
        "| Language modelling | WikiText-2 | test | perplexity | 23.5 |" in Path(readme).read_text()
    )


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ({"task": "x"}, "expected a JSON list"),
        ([{"dataset": "d", "metrics": [{"type": "a", "value": 1}]}], "entry 0: 'task'"),
        ([{"task": "t", "metrics": [{"type": "a", "value": 1}]}], "entry 0: 'dataset'"),
        ([{"task": "t", "dataset": "d", "metrics": []}], "'metrics' must be a non-empty list"),
        (
            [{"task": "t", "dataset": "d", "metrics": [{"type": "acc", "value": "high"}]}],
            "numeric 'value'",
        ),
    ],
)
def test_eval_results_schema_errors(bad, needle) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)):
        card_mod.eval_results_to_card(bad, "m")


def test_card_command_rebuilds_card(llama_merge: Path, tmp_path: Path) -> None:
    out = tmp_path / "merged"
    shutil.copytree(llama_merge, out)
    (out / "README.md").unlink()
    shutil.rmtree(out / "images")
    eval_path = tmp_path / "results.json"
    eval_path.write_text(json.dumps(EVAL))
    result = CliRunner().invoke(card_command, [str(out), "--eval", str(eval_path)])
    assert result.exit_code == 0, result.output
    meta = check_round_trip(str(out / "README.md"))
    assert meta["model-index"][0]["name"] == "merged"
    assert (out / "images" / "ace_gamma.png").read_bytes()[:8] == PNG_MAGIC

    bad = tmp_path / "bad.json"
    bad.write_text("[{]")
    result = CliRunner().invoke(card_command, [str(out), "--eval", str(bad)])
    assert result.exit_code == 1 and "invalid JSON" in result.output

    empty = tmp_path / "empty"
    empty.mkdir()
    result = CliRunner().invoke(card_command, [str(empty)])
    assert result.exit_code == 1 and "not the output of a finished merge" in result.output


def test_run_card_is_the_card_of_the_folder_and_names_no_local_path(
    tiny_llama_set, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run`` renders the card in memory from the config copy and the diagnostics it
    writes; ``card OUT`` reads them back later. Same text, and no absolute local path, not
    even one in a YAML comment (the copy beside the card shortens it too)."""
    from mergekit_ext.cli import main

    monkeypatch.chdir(tmp_path)
    experts = "".join(f"  - model: {e}\n" for e in tiny_llama_set.experts)
    config = tmp_path / "c.yml"
    config.write_text(
        f"# experts built in {tmp_path}/models\nmerge_method: ace\n"
        f"base_model: {tiny_llama_set.base}\nmodels:\n{experts}dtype: float32\n",
        encoding="utf-8",
    )
    result = CliRunner().invoke(main, ["run", str(config), "merged"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    readme = tmp_path / "merged" / "README.md"
    written = readme.read_text(encoding="utf-8")
    assert str(tmp_path) not in written
    assert str(tmp_path) not in (tmp_path / "merged" / "mergekit_config.yml").read_text()
    assert "absolute local paths are shortened" in written
    write_model_card(str(tmp_path / "merged"))
    assert readme.read_text(encoding="utf-8") == written


def test_a_failing_card_costs_the_card_never_the_merge(
    tiny_llama_set, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A card that cannot be rendered (a template error, say) after a merge that may have
    taken hours: the merge is written without README.md and images/, the warning says how
    to write the card later, and ``card OUT`` then writes it."""
    from mergekit_ext.cli import main

    def broken(*args, **kwargs):
        os.makedirs(os.path.join(args[0], "images"), exist_ok=True)  # half-written plots
        raise RuntimeError("'dict object' has no attribute 'limited'")

    monkeypatch.chdir(tmp_path)
    experts = "".join(f"  - model: {e}\n" for e in tiny_llama_set.experts)
    config = tmp_path / "c.yml"
    config.write_text(
        f"merge_method: ace\nbase_model: {tiny_llama_set.base}\nmodels:\n{experts}dtype: float32\n",
        encoding="utf-8",
    )
    monkeypatch.setattr(card_mod, "write_model_card", broken)
    result = CliRunner().invoke(main, ["run", str(config), "merged"])
    assert result.exit_code == 0, result.output
    assert "writing the model card failed (RuntimeError" in result.output
    assert "mergekit-ext card OUT" in result.output
    out = tmp_path / "merged"
    assert (out / "model.safetensors").is_file() and (out / "mergekit_config.yml").is_file()
    assert not (out / "README.md").exists() and not (out / "images").exists()
    monkeypatch.undo()
    result = CliRunner().invoke(card_command, [str(out)])
    assert result.exit_code == 0, result.output
    assert "mergekit-ext" in (out / "README.md").read_text(encoding="utf-8")


def test_runner_temporary_folder_name(llama_merge: Path, tmp_path: Path) -> None:
    out = tmp_path / ".final-name.partial-abc123"
    shutil.copytree(llama_merge, out)
    text = Path(write_model_card(str(out))).read_text(encoding="utf-8")
    assert "# final-name" in text and 'model_id = "./final-name"' in text
    text = Path(write_model_card(str(out), repo_id="alice/merged")).read_text(encoding="utf-8")
    assert 'model_id = "alice/merged"' in text


def test_missing_config_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(MergekitExtError, match="mergekit_config.yml"):
        write_model_card(str(tmp_path))


# ------------------------------------------------------------------------- packaging


def test_templates_ship_inside_the_package() -> None:
    """One source of truth: mergekit_ext/hub/templates (package data); model_cards/ points at it."""
    import importlib.resources

    tomllib = pytest.importorskip("tomllib")

    package_templates = importlib.resources.files("mergekit_ext.hub").joinpath("templates")
    names = {"_base.md.j2", "causal_lm.md.j2", "vision.md.j2", "encoder.md.j2"}
    for name in names:
        assert package_templates.joinpath(name).is_file(), name
    root = Path(__file__).resolve().parent.parent
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["mergekit_ext"]
    shipped = {
        p.name
        for pattern in patterns
        for p in (root / "mergekit_ext").glob(pattern)
        if p.parent.name == "templates"
    }
    assert names <= shipped
    documented = root / "model_cards"
    if documented.exists():  # a checkout without symlink support has a plain file here
        for name in names:
            assert (documented / name).read_bytes() == package_templates.joinpath(name).read_bytes()
