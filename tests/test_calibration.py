"""Calibration sources, sampling, batching and activation statistics.

Expected token ids are derived from the tiny word-level vocabulary of ``tiny_models`` (one
id per word, ``<s>`` first for Llama, ``[CLS] ... [SEP]`` for BERT), not from the tokenizer
under test; statistics are compared against direct float64 computations on unpadded inputs.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import random
import shutil

import numpy as np
import pytest
import tiny_models  # tests/ is on sys.path (conftest.py)
import torch
import transformers
from PIL import Image

from mergekit_ext.calibration import (
    ActivationStatistics,
    CalibrationSpec,
    LinearInputCapture,
    check_calibration,
    check_tokenizers_match,
    detect_modality,
    flatten_tokens,
    get_source,
    load_calibration,
    register_source,
)
from mergekit_ext.config import parse_config
from mergekit_ext.errors import CalibrationError, ModelInputError, TensorError

VOCAB = {tok: i for i, tok in enumerate(tiny_models.SPECIAL + tiny_models.WORDS)}
BOS, EOS, PAD, CLS, SEP = (
    VOCAB["<s>"],
    VOCAB["</s>"],
    VOCAB["[PAD]"],
    VOCAB["[CLS]"],
    VOCAB["[SEP]"],
)


def word_ids(text: str) -> list[int]:
    return [VOCAB[w] for w in text.split()]


def llama_ids(text: str, max_length: int | None = None) -> list[int]:
    ids = [BOS, *word_ids(text)]
    return ids[:max_length] if max_length else ids


def bert_ids(text: str, max_length: int | None = None) -> list[int]:
    words = word_ids(text)
    if max_length:
        words = words[: max_length - 2]
    return [CLS, *words, SEP]


def make_texts(count: int, seed: int = 0, low: int = 3, high: int = 12) -> list[str]:
    rng = random.Random(seed)
    texts: list[str] = []
    while len(texts) < count:
        text = " ".join(rng.choice(tiny_models.WORDS) for _ in range(rng.randint(low, high)))
        if text not in texts:
            texts.append(text)
    return texts


def rows_of(data, pad_id: int | None = None) -> list[tuple[int, ...]]:
    """The unpadded rows of text batches; checks right padding and the pad id on the way."""
    rows = []
    for batch in data.batches:
        assert (
            batch["input_ids"].dtype == torch.int64 and batch["attention_mask"].dtype == torch.int64
        )
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
            length = int(mask.sum())
            assert mask[:length].eq(1).all() and mask[length:].eq(0).all(), "not right padded"
            if pad_id is not None:
                assert ids[length:].eq(pad_id).all()
            rows.append(tuple(ids[:length].tolist()))
    return rows


@pytest.fixture(scope="module")
def models(
    tmp_path_factory,
    tiny_llama_set,
    tiny_bert_set,
    tiny_vit_set,
    tiny_clip_set,
    tiny_clip_vision_set,
):
    """The shared tiny checkpoints, plus Llama tokenizer variants (config + tokenizer only)."""
    root = tmp_path_factory.mktemp("calibration_tokenizers")
    paths = {
        "llama": tiny_llama_set.base,
        "llama_expert": tiny_llama_set.experts[0],
        "bert": tiny_bert_set.base,
        "vit": tiny_vit_set.base,
        "clip": tiny_clip_set.base,
        "clip_vision": tiny_clip_vision_set.base,
    }

    def tokenizer_variant(name: str, edit) -> str:
        folder = root / name
        folder.mkdir()
        shutil.copy(os.path.join(paths["llama"], "config.json"), folder / "config.json")
        tokenizer = transformers.AutoTokenizer.from_pretrained(paths["llama"])
        edit(tokenizer)
        tokenizer.save_pretrained(str(folder))
        return str(folder)

    def no_pad(tok):
        tok.pad_token = None

    def chat(tok):
        tok.chat_template = "{% for m in messages %}<s> {{ m['content'] }} </s>{% endfor %}"

    paths["llama_nopad"] = tokenizer_variant("llama_nopad", no_pad)
    paths["llama_chat"] = tokenizer_variant("llama_chat", chat)
    paths["llama_other_vocab"] = tokenizer_variant(
        "llama_other_vocab", lambda t: t.add_tokens(["zebra"])
    )
    return paths


def write_jsonl(path, records) -> str:
    with open(path, "w", encoding="utf-8") as fp:
        for record in records:
            fp.write(json.dumps(record) + "\n")
    return str(path)


def write_text_file(path, texts, fmt: str) -> str:
    records = [{"text": t, "label": i % 3} for i, t in enumerate(texts)]
    if fmt == "jsonl":
        return write_jsonl(path, records)
    if fmt == "json":
        with open(path, "w", encoding="utf-8") as fp:
            json.dump(records, fp, indent=2)
    elif fmt == "csv":
        with open(path, "w", encoding="utf-8", newline="") as fp:
            writer = csv.DictWriter(fp, fieldnames=["label", "text"])
            writer.writeheader()
            writer.writerows(records)
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), str(path))
    elif fmt == "txt":
        with open(path, "w", encoding="utf-8") as fp:
            fp.write("\n".join(texts[:5]) + "\n\n" + "\n".join(texts[5:]) + "\n")  # one blank line
    return str(path)


# ----------------------------------------------------------------------------------------
# Sources


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet", "txt"])
def test_text_file_formats(models, tmp_path, fmt):
    texts = make_texts(20)
    path = write_text_file(tmp_path / f"data.{fmt}", texts, fmt)
    spec = CalibrationSpec(path=path, samples=20, batch_size=8, max_length=64)
    data = load_calibration(spec, models["llama"], task="task_a")
    rows = rows_of(data, pad_id=PAD)
    assert sorted(rows) == sorted(tuple(llama_ids(t)) for t in texts)
    assert data.task == "task_a" and data.modality == "text"
    assert data.num_samples == 20 and len(data.batches) == 3
    assert data.num_tokens == sum(len(llama_ids(t)) for t in texts)
    assert data.summary() == {
        "source": path,
        "samples": 20,
        "tokens": data.num_tokens,
        "sha256": data.sha256,
        "modality": "text",
    }
    assert len(data.sha256) == 64


def test_save_to_disk_folders_and_splits(models, tmp_path):
    from datasets import Dataset, DatasetDict

    train, validation = make_texts(6, seed=1), make_texts(4, seed=2)
    Dataset.from_dict({"sentence": train, "label": [0] * 6}).save_to_disk(str(tmp_path / "single"))
    DatasetDict(
        {
            "train": Dataset.from_dict({"sentence": train}),
            "validation": Dataset.from_dict({"sentence": validation}),
        }
    ).save_to_disk(str(tmp_path / "dict"))

    single = CalibrationSpec(path=str(tmp_path / "single"), field="sentence", samples=6)
    assert sorted(rows_of(load_calibration(single, models["bert"], task="t"))) == sorted(
        tuple(bert_ids(t)) for t in train
    )
    chosen = CalibrationSpec(
        path=str(tmp_path / "dict"), split="validation", field="sentence", samples=4
    )
    assert sorted(rows_of(load_calibration(chosen, models["bert"], task="t"))) == sorted(
        tuple(bert_ids(t)) for t in validation
    )
    wrong = CalibrationSpec(path=str(tmp_path / "dict"), split="test", field="sentence")
    with pytest.raises(CalibrationError, match=r"splits \['train', 'validation'\]; set `split:`"):
        check_calibration(wrong, task="t", modality="text")


def test_truncation_keeps_special_tokens(models, tmp_path):
    texts = make_texts(4, low=20, high=30)
    path = write_jsonl(tmp_path / "long.jsonl", [{"text": t} for t in texts])
    llama = load_calibration(
        CalibrationSpec(path=path, samples=4, max_length=8), models["llama"], task="t"
    )
    assert sorted(rows_of(llama)) == sorted(tuple(llama_ids(t, 8)) for t in texts)
    bert = load_calibration(
        CalibrationSpec(path=path, samples=4, max_length=8), models["bert"], task="t"
    )
    bert_rows = rows_of(bert)
    assert all(len(r) == 8 and r[0] == CLS and r[-1] == SEP for r in bert_rows)
    assert sorted(bert_rows) == sorted(tuple(bert_ids(t, 8)) for t in texts)
    assert llama.num_tokens == bert.num_tokens == 32


def test_sampling_is_seeded_and_deterministic(models, tmp_path):
    texts = make_texts(20)
    path = write_jsonl(tmp_path / "data.jsonl", [{"text": t} for t in texts])
    all_rows = {tuple(llama_ids(t)) for t in texts}

    def load(seed):
        return load_calibration(
            CalibrationSpec(path=path, samples=7, seed=seed, batch_size=3),
            models["llama"],
            task="t",
        )

    first, again, other = load(3), load(3), load(4)
    rows = rows_of(first)
    assert len(rows) == 7 == len(set(rows)) == first.num_samples and set(rows) <= all_rows
    assert [b["input_ids"].shape[0] for b in first.batches] == [3, 3, 1]
    assert first.sha256 == again.sha256
    assert all(
        torch.equal(a[k], b[k])
        for a, b in zip(first.batches, again.batches)
        for k in ("input_ids", "attention_mask")
    )
    assert set(rows_of(other)) != set(rows) and other.sha256 != first.sha256
    assert set(rows) != {tuple(llama_ids(t)) for t in texts[:7]}  # shuffled, not the file's head


def test_fewer_samples_than_requested_warns(models, tmp_path, caplog):
    texts = make_texts(20)
    path = write_jsonl(tmp_path / "data.jsonl", [{"text": t} for t in texts])
    with caplog.at_level(logging.WARNING, logger="mergekit_ext.calibration.sources"):
        data = load_calibration(
            CalibrationSpec(path=path, samples=50), models["llama"], task="news_task"
        )
    assert data.num_samples == 20
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        "news_task" in m and "only 20 texts" in m and "50 requested" in m for m in messages
    ), messages


def test_empty_sources_are_errors(models, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.txt").write_text("\n\n  \n")
    (tmp_path / "header.csv").write_text("text,label\n")
    for name in ("empty.jsonl", "blank.txt", "header.csv"):
        with pytest.raises(
            CalibrationError, match=rf"model t: calibration file .*{name}' is empty"
        ):
            check_calibration(CalibrationSpec(path=str(tmp_path / name)), task="t", modality="text")
    only_blank = write_jsonl(tmp_path / "blank_texts.jsonl", [{"text": ""}, {"text": "   "}])
    with pytest.raises(
        CalibrationError, match=r"model t: calibration data .* is empty \(no texts\)"
    ):
        load_calibration(CalibrationSpec(path=only_blank), models["llama"], task="t")


def test_packing_into_windows(models, tmp_path, caplog):
    texts = make_texts(20)
    path = write_jsonl(tmp_path / "data.jsonl", [{"text": t} for t in texts])
    expected = sorted(tuple(llama_ids(t)) for t in texts)
    total = sum(map(len, expected))
    with caplog.at_level(logging.WARNING):
        data = load_calibration(
            CalibrationSpec(path=path, samples=1000, max_length=10, pack=True),
            models["llama"],
            task="t",
        )
    windows = rows_of(data)
    assert len(windows) == data.num_samples == -(-total // 10)
    assert all(len(w) == 10 for w in windows[:-1]) and 0 < len(windows[-1]) <= 10
    assert data.num_tokens == total
    # the stream is the texts' encodings back to back (each starts with <s>), in some order
    stream = [t for w in windows for t in w]
    starts = [i for i, t in enumerate(stream) if t == BOS] + [len(stream)]
    pieces = sorted(tuple(stream[a:b]) for a, b in zip(starts, starts[1:]))
    assert pieces == expected
    assert any("windows" in r.getMessage() for r in caplog.records)

    three = load_calibration(
        CalibrationSpec(path=path, samples=3, max_length=10, pack=True), models["llama"], task="t"
    )
    assert [len(w) for w in rows_of(three)] == [10, 10, 10] and three.num_tokens == 30


def test_pad_token_falls_back_to_eos(models, tmp_path):
    texts = make_texts(6)
    path = write_jsonl(tmp_path / "data.jsonl", [{"text": t} for t in texts])
    data = load_calibration(
        CalibrationSpec(path=path, samples=6, batch_size=6), models["llama_nopad"], task="t"
    )
    assert sorted(rows_of(data, pad_id=EOS)) == sorted(tuple(llama_ids(t)) for t in texts)
    mask = data.batches[0]["attention_mask"]
    assert sorted(mask.sum(1).tolist()) == sorted(len(llama_ids(t)) for t in texts)
    assert (mask == 0).any(), "texts of different lengths must produce padding"


def test_chat_template(models, tmp_path):
    texts = make_texts(5)
    path = write_jsonl(tmp_path / "data.jsonl", [{"text": t} for t in texts])
    spec = CalibrationSpec(path=path, samples=5, apply_chat_template=True)
    data = load_calibration(spec, models["llama_chat"], task="t")
    assert sorted(rows_of(data)) == sorted((BOS, *word_ids(t), EOS) for t in texts)
    plain = load_calibration(
        spec.model_copy(update={"apply_chat_template": False}), models["llama_chat"], task="t"
    )
    assert plain.sha256 != data.sha256
    with pytest.raises(CalibrationError, match="apply_chat_template: true.*has no chat template"):
        load_calibration(spec, models["llama"], task="t")


def test_pretokenized_safetensors(models, tmp_path):
    from safetensors.torch import save_file

    rows = [[BOS, 10, 11, 12], [BOS, 20, 21, 22, 23, 24, 25], [BOS, 30]]
    width = max(map(len, rows))
    input_ids = torch.zeros(3, width, dtype=torch.int64)
    mask = torch.zeros(3, width, dtype=torch.int64)
    for i, row in enumerate(rows):  # left padded on purpose
        input_ids[i, width - len(row) :] = torch.tensor(row)
        mask[i, width - len(row) :] = 1
    path = str(tmp_path / "tokens.safetensors")
    save_file({"input_ids": input_ids, "attention_mask": mask}, path)
    data = load_calibration(
        CalibrationSpec(path=path, samples=3, max_length=5), models["llama"], task="t"
    )
    assert sorted(rows_of(data)) == sorted(tuple(r[:5]) for r in rows)
    assert data.num_tokens == 4 + 5 + 2

    too_big = str(tmp_path / "big.safetensors")
    save_file({"input_ids": torch.tensor([[BOS, 500]])}, too_big)
    with pytest.raises(CalibrationError, match=r"range over \[4, 500\].*128 tokens"):
        load_calibration(CalibrationSpec(path=too_big), models["llama"], task="t")
    with pytest.raises(
        CalibrationError,
        match=r"image model but .* has no 'pixel_values' tensor \(tensors: attention_mask, input_ids\)",
    ):
        check_calibration(CalibrationSpec(path=path), task="vit_task", modality="image")

    pixels = torch.randn(5, 3, 16, 16)
    pixel_path = str(tmp_path / "pixels.safetensors")
    save_file({"pixel_values": pixels}, pixel_path)
    images = load_calibration(
        CalibrationSpec(path=pixel_path, samples=5, batch_size=2), models["vit"], task="v"
    )
    got = torch.cat([b["pixel_values"] for b in images.batches])
    assert got.shape == (5, 3, 16, 16) and got.dtype == torch.float32
    assert sorted(got.sum((1, 2, 3)).tolist()) == pytest.approx(
        sorted(pixels.sum((1, 2, 3)).tolist())
    )
    assert images.num_tokens == 5 * 16  # (16/4)^2 patches per image


def save_images(folder, count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        sub = os.path.join(folder, "a" if i % 2 else "b", "deep" if i % 3 == 0 else "")
        os.makedirs(sub, exist_ok=True)
        size = (int(rng.integers(12, 30)), int(rng.integers(12, 30)))
        array = rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
        path = os.path.join(sub, f"img_{i}.png")
        Image.fromarray(array).save(path)
        paths.append(path)
    with open(os.path.join(folder, "notes.txt"), "w") as fp:
        fp.write("not an image")
    return paths


def vit_reference(path: str) -> torch.Tensor:
    """ViT preprocessing written out: bilinear resize to 16x16, /255, (x - 0.5) / 0.5."""
    image = Image.open(path).convert("RGB").resize((16, 16), Image.Resampling.BILINEAR)
    array = np.asarray(image, dtype=np.float32) / 255.0
    return torch.from_numpy(((array - 0.5) / 0.5).transpose(2, 0, 1))


def match_images(got: torch.Tensor, expected: list[torch.Tensor], atol: float = 1e-4) -> None:
    """Every image of ``got`` equals a distinct one of ``expected``."""
    unused = list(range(len(expected)))
    for image in got:
        hit = next(j for j in unused if torch.allclose(image, expected[j], atol=atol))
        unused.remove(hit)


def test_image_folder(models, tmp_path, caplog):
    paths = save_images(tmp_path / "images", 5)
    assert detect_modality(models["vit"]) == "image"
    spec = CalibrationSpec(path=str(tmp_path / "images"), samples=5, batch_size=4)
    data = load_calibration(spec, models["vit"], task="v")
    assert data.modality == "image" and data.num_samples == 5 and data.num_tokens == 5 * 16
    assert [b["pixel_values"].shape for b in data.batches] == [(4, 3, 16, 16), (1, 3, 16, 16)]
    got = torch.cat([b["pixel_values"] for b in data.batches])
    match_images(got, [vit_reference(p) for p in paths])
    assert load_calibration(spec, models["vit"], task="v").sha256 == data.sha256

    with caplog.at_level(logging.WARNING):
        assert (
            load_calibration(
                spec.model_copy(update={"samples": 9}), models["vit"], task="v"
            ).num_samples
            == 5
        )
    assert any("only 5 images" in r.getMessage() for r in caplog.records)
    with pytest.raises(CalibrationError, match="text model but .* is a folder of images"):
        check_calibration(spec, task="t", modality="text")


def test_image_preprocessing_overrides(models, tmp_path):
    paths = save_images(tmp_path / "images", 3, seed=1)
    mean, std = [0.1, 0.2, 0.3], [0.5, 0.6, 0.7]
    spec = CalibrationSpec(
        path=str(tmp_path / "images"), samples=3, image_size=8, image_mean=mean, image_std=std
    )
    data = load_calibration(spec, models["vit"], task="v")

    def reference(path):
        image = Image.open(path).convert("RGB").resize((8, 8), Image.Resampling.BICUBIC)
        array = np.asarray(image, dtype=np.float32) / 255.0
        return torch.from_numpy(
            ((array - np.array(mean)) / np.array(std)).astype(np.float32).transpose(2, 0, 1)
        )

    got = data.batches[0]["pixel_values"]
    assert got.shape == (3, 3, 8, 8)
    match_images(got, [reference(p) for p in paths], atol=1e-5)
    assert data.num_tokens == 3 * 4  # (8/4)^2 patches


def test_image_columns(models, tmp_path):
    from datasets import Dataset, Features, Value
    from datasets import Image as ImageFeature

    paths = save_images(tmp_path / "images", 4, seed=2)
    expected = [vit_reference(p) for p in paths]
    # a column of PIL images (datasets Image feature) in a save_to_disk folder
    features = Features({"picture": ImageFeature(), "label": Value("int64")})
    Dataset.from_dict({"picture": paths, "label": [0, 1, 0, 1]}, features=features).save_to_disk(
        str(tmp_path / "ds")
    )
    data = load_calibration(
        CalibrationSpec(path=str(tmp_path / "ds"), field="picture", samples=4),
        models["vit"],
        task="v",
    )
    match_images(data.batches[0]["pixel_values"], expected)
    # a column of image paths relative to the jsonl file
    rel = [os.path.relpath(p, tmp_path) for p in paths]
    jsonl = write_jsonl(tmp_path / "images.jsonl", [{"file": r, "label": 1} for r in rel])
    data = load_calibration(
        CalibrationSpec(path=jsonl, field="file", samples=4), models["vit"], task="v"
    )
    match_images(data.batches[0]["pixel_values"], expected)


def test_clip_vision_from_whole_clip(models, tmp_path):
    save_images(tmp_path / "images", 3, seed=3)
    assert detect_modality(models["clip"]) == detect_modality(models["clip_vision"]) == "image"
    assert detect_modality(models["llama"]) == detect_modality(models["bert"]) == "text"
    data = load_calibration(
        CalibrationSpec(path=str(tmp_path / "images"), samples=3), models["clip"], task="c"
    )
    assert data.batches[0]["pixel_values"].shape == (3, 3, 16, 16) and data.num_tokens == 3 * 16


# ----------------------------------------------------------------------------------------
# Custom sources and the YAML path


@register_source("test_calibration_words")
def _words_source(spec: CalibrationSpec):
    texts = make_texts(spec.options["n"], seed=spec.options.get("text_seed", 0))
    if spec.options.get("as_dicts"):
        return [{"prompt": t, "id": i} for i, t in enumerate(texts)]
    return iter(texts)


@register_source("test_calibration_nothing")
def _empty_source(spec: CalibrationSpec):
    return iter(())


def test_custom_source_through_yaml(models):
    yaml_text = f"""
merge_method: linear
models:
  - model: {models["llama"]}
    name: words
    parameters: {{weight: 1.0}}
    calibration: {{source: test_calibration_words, options: {{n: 5}}}}
  - model: {models["llama_expert"]}
    name: dicts
    parameters: {{weight: 1.0}}
    calibration: {{source: test_calibration_words, field: prompt, options: {{n: 6, as_dicts: true, text_seed: 1}}}}
calibration: {{samples: 4, max_length: 32, path: not_used.jsonl}}
"""
    config = parse_config(yaml_text)
    words_entry, dicts_entry = config.models
    spec = config.calibration_for(words_entry)
    assert spec.source == "test_calibration_words" and spec.path is None and spec.samples == 4
    data = load_calibration(spec, words_entry.model, task=words_entry.name)
    rows = rows_of(data)
    assert len(rows) == 4 and set(rows) <= {tuple(llama_ids(t)) for t in make_texts(5)}
    assert data.source == "source:test_calibration_words"
    dicts = load_calibration(
        config.calibration_for(dicts_entry), dicts_entry.model, task=dicts_entry.name
    )
    assert set(rows_of(dicts)) <= {tuple(llama_ids(t)) for t in make_texts(6, seed=1)}

    with pytest.raises(
        CalibrationError,
        match=r"unknown calibration source 'nope'; registered sources: .*test_calibration_words",
    ):
        get_source("nope")
    with pytest.raises(CalibrationError, match="empty"):
        load_calibration(
            CalibrationSpec(source="test_calibration_nothing"), models["llama"], task="t"
        )


# ----------------------------------------------------------------------------------------
# Validation errors


def test_validation_errors(models, tmp_path, monkeypatch):
    text = dict(task="task_x", modality="text")
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(
        CalibrationError, match=rf"model task_x: calibration path '{missing}' not found"
    ):
        check_calibration(CalibrationSpec(path=missing), **text)

    columns = write_jsonl(tmp_path / "cols.jsonl", [{"prompt": "the cat", "label": 1}])
    with pytest.raises(
        CalibrationError, match=r"field 'text' not found in .*available columns: prompt, label"
    ):
        check_calibration(CalibrationSpec(path=columns, field="text"), **text)
    with pytest.raises(CalibrationError, match=r"several columns \(prompt, label\); set `field:`"):
        check_calibration(CalibrationSpec(path=columns), **text)
    check_calibration(CalibrationSpec(path=columns, field="prompt"), **text)

    xml = tmp_path / "data.xml"
    xml.write_text("<a/>")
    with pytest.raises(CalibrationError, match=r"unknown format \.xml"):
        check_calibration(CalibrationSpec(path=str(xml)), **text)
    with pytest.raises(CalibrationError, match="no calibration data"):
        check_calibration(CalibrationSpec(), **text)
    with pytest.raises(CalibrationError, match="names path and dataset; give exactly one"):
        check_calibration(CalibrationSpec(path=columns, dataset="user/data"), **text)
    numbers = write_jsonl(tmp_path / "numbers.jsonl", [{"text": 3}])
    with pytest.raises(CalibrationError, match="holds a int where a text was expected"):
        load_calibration(CalibrationSpec(path=numbers), models["llama"], task="t")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        CalibrationError,
        match=r"model task_x: calibration dataset 'user/data' is on the Hugging Face Hub, but the Hub is offline",
    ):
        check_calibration(CalibrationSpec(dataset="user/data"), **text)


def test_hub_dataset_unreachable_is_a_clear_error(monkeypatch):
    """Online mode without a network: a quick CalibrationError, no hang (a closed local port)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(CalibrationError, match="cannot reach Hub dataset 'user/data'"):
        check_calibration(CalibrationSpec(dataset="user/data"), task="t", modality="text")


def test_tokenizers_must_match(models):
    check_tokenizers_match([models["llama"], models["llama_expert"], models["llama_nopad"]])
    with pytest.raises(CalibrationError) as info:
        check_tokenizers_match(
            [models["llama"], models["llama_expert"], models["llama_other_vocab"]]
        )
    message = str(info.value)
    assert models["llama"] in message and models["llama_other_vocab"] in message
    assert "84 vs 85 tokens" in message and "'zebra'" in message


# ----------------------------------------------------------------------------------------
# Statistics


def test_flatten_tokens_drops_padding():
    hidden = torch.randn(3, 5, 4)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    expected = torch.cat([hidden[0, :3], hidden[1], hidden[2, :1]])
    assert torch.equal(flatten_tokens(hidden, mask), expected)
    assert flatten_tokens(hidden, None).shape == (15, 4)
    with pytest.raises(TensorError, match="does not fit"):
        flatten_tokens(hidden, mask[:, :4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_activation_statistics_match_float64(dtype):
    gen = torch.Generator().manual_seed(0)
    chunks = [(torch.randn(n, 6, generator=gen) * 3 + 1).to(dtype) for n in (5, 1, 0, 9)]
    chunks.append(
        torch.zeros(2, 6, dtype=dtype)
    )  # zero rows: counted, add nothing to the normalized Gram
    x = torch.cat(chunks).to(torch.float64)
    n = x.shape[0]
    norms = x.norm(dim=1, keepdim=True)
    unit = torch.where(norms > 0, x / norms, torch.zeros_like(x))
    expected_normalized = sum(torch.outer(u, u) for u in unit) / n
    expected_gram = sum(torch.outer(r, r) for r in x) / n
    # float64 products: exact to float64 rounding; the default float32 products: ~1e-7.
    for product_dtype, tol in ((torch.float64, 1e-12), (None, 1e-6)):
        acc = ActivationStatistics(6, normalized_gram=True, product_dtype=product_dtype)
        for chunk in chunks:
            acc.update(chunk)
        stats = acc.finalize()
        assert stats.count == n == 17
        assert stats.gram.dtype == torch.float64
        torch.testing.assert_close(stats.gram, expected_gram, rtol=tol, atol=tol)
        torch.testing.assert_close(stats.mean, x.mean(0), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(stats.gram_normalized, expected_normalized, rtol=tol, atol=tol)
        torch.testing.assert_close(
            torch.diagonal(stats.gram_normalized).sum(),
            torch.tensor(15 / 17, dtype=torch.float64),
            rtol=tol,
            atol=tol,
        )
        torch.testing.assert_close(
            stats.second_moment, torch.diagonal(expected_gram), rtol=tol, atol=tol
        )

    # Moments only: no Gram, the same mean and per-feature second moment and variance.
    moments = ActivationStatistics(6, full_gram=False)
    for chunk in chunks:
        moments.update(chunk)
    only = moments.finalize()
    assert only.gram is None and only.count == n
    torch.testing.assert_close(only.second_moment, (x * x).mean(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(only.variance, x.var(0, unbiased=False), rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="needs the Gram"):
        _ = only.covariance
    with pytest.raises(ValueError, match="normalized_gram needs full_gram"):
        ActivationStatistics(6, normalized_gram=True, full_gram=False)

    single = ActivationStatistics(6, dtype=torch.float32)
    single.update(chunks[0])
    out = single.finalize()
    assert out.gram.dtype == torch.float32 and out.gram_normalized is None
    x0 = chunks[0].to(torch.float64)
    torch.testing.assert_close(out.gram.double(), x0.T @ x0 / 5, rtol=1e-5, atol=1e-5)

    with pytest.raises(TensorError, match=r"expected inputs of shape \[N, 6\]"):
        acc.update(torch.zeros(3, 5))
    with pytest.raises(CalibrationError, match="no tokens"):
        ActivationStatistics(6).finalize()


def manual_gram(rows: list[torch.Tensor]) -> torch.Tensor:
    x = torch.cat(rows).to(torch.float64)
    return x.T @ x / x.shape[0]


def per_sample_inputs(model, module_names, samples, **forward):
    """Inputs of each module, one unpadded sample at a time, with plain hooks."""
    seen = {name: [] for name in module_names}
    modules = dict(model.named_modules())
    handles = [
        modules[name].register_forward_pre_hook(
            lambda m, a, name=name: seen[name].append(a[0].reshape(-1, a[0].shape[-1]))
        )
        for name in module_names
    ]
    with torch.no_grad():
        for ids in samples:
            model(input_ids=torch.tensor([ids]), **forward)
    for handle in handles:
        handle.remove()
    return seen


def test_linear_input_capture_llama_excludes_padding(models, tmp_path):
    texts = make_texts(7, seed=5, low=2, high=14)
    path = write_jsonl(tmp_path / "data.jsonl", [{"text": t} for t in texts])
    data = load_calibration(
        CalibrationSpec(path=path, samples=7, batch_size=4), models["llama"], task="t"
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(models["llama"]).eval()
    names = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"]

    with LinearInputCapture(model, names, normalized_gram=True) as capture, torch.no_grad():
        for batch in data.batches:
            capture.set_attention_mask(batch["attention_mask"])
            model(**batch)
    stats = capture.statistics()
    assert not model.model.layers[0].self_attn.q_proj._forward_pre_hooks  # hooks removed

    reference = per_sample_inputs(model, names, rows_of(data))
    for name in names:
        rows = reference[name]
        assert stats[name].count == data.num_tokens == sum(r.shape[0] for r in rows)
        torch.testing.assert_close(stats[name].gram, manual_gram(rows), rtol=1e-4, atol=1e-5)
        x = torch.cat(rows).double()
        torch.testing.assert_close(stats[name].mean, x.mean(0), rtol=1e-4, atol=1e-5)
        unit = x / x.norm(dim=1, keepdim=True)
        torch.testing.assert_close(
            stats[name].gram_normalized, unit.T @ unit / x.shape[0], rtol=1e-4, atol=1e-5
        )

    # the same batches without the mask count the padding, and the Gram moves
    with LinearInputCapture(model, names[:1]) as unmasked, torch.no_grad():
        for batch in data.batches:
            model(**batch)
    padded = unmasked.statistics()[names[0]]
    assert padded.count > data.num_tokens
    assert (padded.gram - stats[names[0]].gram).abs().max() > 1e-3


def test_linear_input_capture_bert_pooler_and_conv1d(models, tmp_path):
    texts = make_texts(5, seed=6)
    path = write_jsonl(tmp_path / "data.jsonl", [{"text": t} for t in texts])
    data = load_calibration(
        CalibrationSpec(path=path, samples=5, batch_size=5), models["bert"], task="t"
    )
    model = transformers.AutoModel.from_pretrained(models["bert"]).eval()
    names = ["encoder.layer.0.attention.self.query", "encoder.layer.1.output.dense", "pooler.dense"]
    with LinearInputCapture(model, names) as capture, torch.no_grad():
        for batch in data.batches:
            capture.set_attention_mask(batch["attention_mask"])
            model(**batch)
    stats = capture.statistics()
    reference = per_sample_inputs(model, names, rows_of(data))
    assert stats["pooler.dense"].count == 5  # one [CLS] row per sample
    for name in names:
        torch.testing.assert_close(
            stats[name].gram, manual_gram(reference[name]), rtol=1e-4, atol=1e-5
        )

    from transformers.pytorch_utils import Conv1D

    conv = torch.nn.Sequential(Conv1D(3, 4))  # GPT-2 style: weight [in=4, out=3]
    x = torch.randn(2, 5, 4)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    with LinearInputCapture(conv, ["0"]) as capture:
        capture.set_attention_mask(mask)
        conv(x)
    torch.testing.assert_close(capture.statistics()["0"].gram, manual_gram([x[0, :2], x[1, :4]]))

    with pytest.raises(
        ModelInputError,
        match=r"no module 'encoder.layer.9.output.dense'; linear modules with similar names: .*encoder.layer.1.output.dense",
    ):
        LinearInputCapture(model, ["encoder.layer.9.output.dense"])
    with pytest.raises(
        ModelInputError, match="is a LayerNorm; input statistics need nn.Linear or Conv1D"
    ):
        LinearInputCapture(model, ["encoder.layer.0.output.LayerNorm"])
    with pytest.raises(CalibrationError, match="saw no tokens"):
        LinearInputCapture(model, names[:1]).statistics()


def test_linear_input_capture_vit_patches(models, tmp_path):
    save_images(tmp_path / "images", 3, seed=4)
    data = load_calibration(
        CalibrationSpec(path=str(tmp_path / "images"), samples=3), models["vit"], task="v"
    )
    model = transformers.AutoModelForImageClassification.from_pretrained(models["vit"]).eval()
    name = "vit.layers.0.attention.q_proj"
    with LinearInputCapture(model, [name]) as capture, torch.no_grad():
        for batch in data.batches:
            capture.set_attention_mask(None)
            model(**batch)
    stats = capture.statistics()[name]
    assert stats.count == 3 * 17  # 16 patches + [CLS] per image
    with torch.no_grad():
        hidden = model.vit.embeddings(data.batches[0]["pixel_values"])
        x = model.vit.layers[0].layernorm_before(hidden)
    torch.testing.assert_close(stats.gram, manual_gram([x.reshape(-1, 32)]), rtol=1e-4, atol=1e-5)
