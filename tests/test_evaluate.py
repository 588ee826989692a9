"""``mergekit-ext eval`` and ``card --eval`` (issue #52), offline.

- lm-evaluation-harness through its Python API on a tiny Llama merge, its base and its experts,
  with a 20-row multiple-choice task from a local YAML and data file;
- classifier accuracy with the experts' own heads on a tiny ViT and a labelled image folder,
  checked against the same models run by hand;
- the card read back with huggingface_hub and its model-index checked, from our results file
  and from a results JSON written by lm-eval 0.4.13 itself (``tests/data/``);
- the error for a file of another shape keeps its help block, ``#`` comments included, on
  their own lines.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from huggingface_hub import ModelCard

from mergekit_ext.cli import main
from mergekit_ext.hub.card import (
    EVAL_FILENAME,
    format_eval_table,
    read_eval_results,
    write_model_card,
)

DATA = Path(__file__).parent / "data"
LM_EVAL_FIXTURE = DATA / "lm_eval_0.4.13_results.json"  # written by lm-eval 0.4.13's tracker
WORDS = "news sport music film food review good bad great terrible price taste".split()


def _invoke(args: list[str]):
    return CliRunner().invoke(main, args, catch_exceptions=False)


def _merge(base: str, experts: list[str], out: Path, tmp_path: Path) -> Path:
    """A real linear merge through `mergekit-ext run` (the card needs a finished folder)."""
    models = "".join(f"  - model: {e}\n    name: task{i}\n" for i, e in enumerate(experts))
    config = tmp_path / "merge.yml"
    config.write_text(
        f"merge_method: linear\nbase_model: {base}\nmodels:\n{models}"
        "parameters:\n  weight: 0.5\ndtype: float32\n",
        encoding="utf-8",
    )
    result = _invoke(["run", str(config), str(out)])
    assert result.exit_code == 0, result.output
    return config


@pytest.fixture(scope="module")
def llama_merge(tiny_llama_set, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(merged folder, merge config) of two tiny Llama experts; tests copy the folder."""
    root = tmp_path_factory.mktemp("eval_llama")
    merged = root / "merged"
    config = _merge(tiny_llama_set.base, list(tiny_llama_set.experts[:2]), merged, root)
    return merged, config


def _copy(folder: Path, tmp_path: Path) -> Path:
    out = tmp_path / folder.name
    shutil.copytree(folder, out)
    return out


def _local_task(folder: Path) -> Path:
    """A 20-row multiple-choice task: YAML + JSON lines (absolute data path, as lm-eval
    resolves data_files against the working directory)."""
    folder.mkdir()
    rows = [
        {
            "question": " ".join(WORDS[(i + k) % len(WORDS)] for k in range(4)),
            "choices": [WORDS[(i * 3 + c) % len(WORDS)] for c in range(4)],
            "answer": i % 4,
        }
        for i in range(20)
    ]
    data = folder / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (folder / "tiny_mc.yaml").write_text(
        "task: tiny_mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "output_type: multiple_choice\ntest_split: test\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "metadata:\n  version: 2.0\n",
        encoding="utf-8",
    )
    return folder


def test_lm_eval_merge_base_experts_into_card(llama_merge, tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    merged, config = _copy(llama_merge[0], tmp_path), llama_merge[1]
    tasks = _local_task(tmp_path / "tasks")
    output = tmp_path / "eval" / "results.json"
    result = _invoke(
        ["eval", str(merged), "--tasks", "tiny_mc", "--include-path", str(tasks)]
        + ["--with-inputs", str(config), "--limit", "12", "--batch-size", "4"]
        + ["--output", str(output)]
    )
    assert result.exit_code == 0, result.output

    data = json.loads(output.read_text(encoding="utf-8"))
    assert data["harness"]["name"] == "lm-evaluation-harness"
    assert [(m["role"], m["name"]) for m in data["models"]] == [
        ("merge", "merged"),
        ("base", "base"),
        ("expert", "task0"),
        ("expert", "task1"),
    ]
    for model in data["models"]:
        own = json.loads((output.parent / model["results_file"]).read_text(encoding="utf-8"))
        # lm-eval's own file of this model holds the numbers the summary carries
        assert (
            own["results"]["tiny_mc"]["acc,none"]
            == model["lm_eval"]["results"]["tiny_mc"]["acc,none"]
        )
        assert own["n-samples"]["tiny_mc"] == {"original": 20, "effective": 12}
        assert own["config"]["model_args"]["pretrained"]
        assert 0.0 <= own["results"]["tiny_mc"]["acc,none"] <= 1.0
        assert model["lm_eval"]["versions"]["tiny_mc"] == 2.0
        assert str(tmp_path) not in json.dumps(model["lm_eval"])  # no local path kept
    for column in ("merged", "base (base)", "task0 (expert)", "task1 (expert)"):
        assert column in result.output

    # into the card: the merge's number in the model-index, all four in the table
    result = _invoke(["card", str(merged), "--eval", str(output)])
    assert result.exit_code == 0, result.output
    card = ModelCard.load(merged / "README.md")
    (entry,) = card.data.eval_results
    merged_acc = data["models"][0]["lm_eval"]["results"]["tiny_mc"]["acc,none"]
    assert entry.metric_type == "acc" and entry.metric_value == merged_acc
    assert entry.dataset_name == "tiny_mc (local data)" and entry.dataset_split == "test"
    assert entry.source_name == f"lm-evaluation-harness {data['harness']['version']}"
    assert "--limit: 12 of 20 examples" in entry.metric_name
    text = (merged / "README.md").read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith("| tiny_mc ‡ †"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    values = [m["lm_eval"]["results"]["tiny_mc"] for m in data["models"]]
    assert cells[2:6] == [f"{v['acc,none']:.4f} ± {v['acc_stderr,none']:.4f}" for v in values]
    assert cells[6:9] == ["2.0", "0", "12 of 20"]
    assert "`--limit 12`" in text and "read local data" in text
    # kept beside the card: `card` again without --eval shows the same table
    assert json.loads((merged / EVAL_FILENAME).read_text(encoding="utf-8")) == data
    result = _invoke(["card", str(merged)])
    assert result.exit_code == 0, result.output
    assert row in (merged / "README.md").read_text(encoding="utf-8")


def test_card_reads_lm_eval_results_json(llama_merge, tmp_path: Path) -> None:
    """A results file as lm-eval 0.4.13 writes it (``tests/data``, from its own tracker)."""
    raw = json.loads(LM_EVAL_FIXTURE.read_text(encoding="utf-8"))
    report = read_eval_results(raw, "my-merge", where=str(LM_EVAL_FIXTURE))
    assert report.columns == ["my-merge"] and report.harness == "lm-evaluation-harness 0.4.13"
    (row,) = report.rows
    assert (row.task, row.metric, row.values) == ("tiny_mc", "acc", {"my-merge": 0.2})
    assert row.limited and row.local and row.samples == "10 of 20" and row.version == "1.0"
    assert "tiny_mc" in format_eval_table(report)

    merged = _copy(llama_merge[0], tmp_path)
    readme = write_model_card(str(merged), eval_results=raw)
    meta = ModelCard.load(readme).data.to_dict()
    (result,) = meta["model-index"][0]["results"]
    assert result["task"] == {"type": "text-generation", "name": "tiny_mc"}
    assert result["dataset"]["type"] == "tiny_mc" and result["dataset"]["split"] == "test"
    assert result["dataset"]["args"] == {"num_few_shot": 0}
    assert result["metrics"][0]["type"] == "acc" and result["metrics"][0]["value"] == 0.2
    assert result["source"]["name"] == "lm-evaluation-harness 0.4.13"


def test_card_eval_error_keeps_help_block(llama_merge, tmp_path: Path) -> None:
    merged = _copy(llama_merge[0], tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"accuracy": 0.5}), encoding="utf-8")
    result = CliRunner().invoke(main, ["card", str(merged), "--eval", str(bad)])
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert lines[0] == f"error: {bad}: not an evaluation results file mergekit-ext reads"
    # the help block as written: one line each, the `#` comments on their own lines
    assert '    "task_name": "Sentiment",                  # optional, readable' in lines
    assert '    #   {"name": "SST-2", "type": "stanfordnlp/sst2", "config": "default",' in lines
    assert "--eval reads one of:" in lines
    # a list in our schema is still accepted, with its one-model table
    good = tmp_path / "good.json"
    good.write_text(
        json.dumps([{"task": "text-generation", "dataset": "wikitext",
                     "metrics": [{"type": "perplexity", "value": 12.5}]}]),
        encoding="utf-8",
    )  # fmt: skip
    result = CliRunner().invoke(main, ["card", str(merged), "--eval", str(good)])
    assert result.exit_code == 0, result.output
    assert "| text-generation | wikitext | — | perplexity | 12.5 |" in (
        merged / "README.md"
    ).read_text(encoding="utf-8")


def _image_folder(root: Path, n_per_class: int = 4, size: int = 16) -> Path:
    from PIL import Image

    generator = torch.Generator().manual_seed(0)
    for label in ("cat", "dog", "bird"):
        (root / label).mkdir(parents=True)
        for i in range(n_per_class):
            pixels = torch.randint(0, 256, (size, size, 3), generator=generator, dtype=torch.uint8)
            Image.fromarray(pixels.numpy()).save(root / label / f"{i}.png")
    return root


@torch.no_grad()
def _accuracies_by_hand(bodies: dict[str, str], heads: dict[str, str], folder: Path) -> dict:
    """(body, task) → accuracy of the head's class with the body's ViT tensors, by hand."""
    import copy

    import transformers
    from PIL import Image

    files = [(label, folder / label / n) for label in sorted(os.listdir(folder))
             for n in sorted(os.listdir(folder / label))]  # fmt: skip
    processor = transformers.AutoImageProcessor.from_pretrained(next(iter(heads.values())))
    pixels = processor([Image.open(f).convert("RGB") for _, f in files], return_tensors="pt")
    load = transformers.ViTForImageClassification.from_pretrained
    vits = {name: load(path).vit.state_dict() for name, path in bodies.items()}
    out = {}
    for task, head in heads.items():
        expert = load(head).eval()
        labels = torch.tensor([expert.config.label2id[label] for label, _ in files])
        for name, vit in vits.items():
            model = copy.deepcopy(expert)
            model.vit.load_state_dict(vit)
            predicted = model(**pixels).logits.argmax(-1)
            out[name, task] = float((predicted == labels).float().mean())
    return out


@pytest.fixture(scope="module")
def vit_merge(tiny_vit_set, tmp_path_factory: pytest.TempPathFactory):
    """Two tiny ViT experts whose heads name their classes (in different orders), merged."""
    import transformers

    root = tmp_path_factory.mktemp("eval_vit")
    experts = []
    for i, source in enumerate(tiny_vit_set.experts[:2]):
        expert = root / f"expert{i}"
        shutil.copytree(source, expert)
        config = transformers.AutoConfig.from_pretrained(expert)
        names = ["cat", "dog", "bird"] if i == 0 else ["bird", "cat", "dog"]
        config.id2label = dict(enumerate(names))
        config.label2id = {n: k for k, n in enumerate(names)}
        config.save_pretrained(expert)
        experts.append(str(expert))
    merged = root / "merged"
    config = _merge(tiny_vit_set.base, experts, merged, root)
    return merged, config, experts, tiny_vit_set.base


def test_vit_accuracy_with_expert_heads(vit_merge, tmp_path: Path) -> None:
    merged, config, experts, base = vit_merge
    images = _image_folder(tmp_path / "images")
    output = tmp_path / "results.json"
    result = _invoke(
        ["eval", str(merged), "--with-inputs", str(config), "--output", str(output)]
        + ["--data", f"task0={images}", "--data", f"task1={images}"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(output.read_text(encoding="utf-8"))
    by_model = {m["name"]: m["classification"]["tasks"] for m in data["models"]}
    bodies = {
        "merged": str(merged),
        "base": base,
        "task0": experts[0],
        "task1": experts[1],
    }
    expected = _accuracies_by_hand(bodies, {"task0": experts[0], "task1": experts[1]}, images)
    for name, tasks in by_model.items():
        for task in ("task0", "task1"):
            assert tasks[task]["accuracy"] == pytest.approx(expected[name, task]), (name, task)
            assert tasks[task]["samples"] == 12 and tasks[task]["head"] == task
    report = read_eval_results(data, "merged")
    assert [r.task for r in report.rows] == ["task0", "task1"]
    assert report.model_index[0].task_type == "image-classification"


def test_eval_refuses_bad_input(vit_merge, tmp_path: Path) -> None:
    merged, config = vit_merge[0], vit_merge[1]
    images = _image_folder(tmp_path / "images", n_per_class=1)
    result = CliRunner().invoke(main, ["eval", str(merged)])
    assert result.exit_code == 1 and "nothing to evaluate" in result.output
    args = ["eval", str(merged), "--with-inputs", str(config), "--output", str(tmp_path / "r.json")]
    result = CliRunner().invoke(main, [*args, "--data", f"nosuch={images}"])
    assert result.exit_code == 1
    assert "--data task(s) nosuch are not experts" in result.output
    os.rename(images / "bird", images / "fish")  # a class the head does not know: named
    result = CliRunner().invoke(main, [*args, "--data", f"task0={images}"])
    assert result.exit_code == 1 and "label 'fish' is neither a class id" in result.output
    os.rename(images / "fish", images / "1")  # a folder named by a class id is accepted
    result = CliRunner().invoke(main, [*args, "--data", f"task0={images}"])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "r_lm_eval").exists()  # no lm-eval run, no folder for it


@torch.no_grad()
def test_text_classifier_own_head_on_jsonl(tiny_bert_classifier_set, tmp_path: Path) -> None:
    """No --with-inputs: a classifier folder is scored with its own head (BERT, a .jsonl)."""
    import transformers

    model_dir = tiny_bert_classifier_set.experts[0]
    rows = [{"text": " ".join(WORDS[(i * k) % len(WORDS)] for k in range(1, 6)), "label": i % 3}
            for i in range(9)]  # fmt: skip
    data = tmp_path / "reviews.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    output = tmp_path / "r.json"
    result = _invoke(["eval", model_dir, "--data", str(data), "--output", str(output)])
    assert result.exit_code == 0, result.output
    (model,) = json.loads(output.read_text(encoding="utf-8"))["models"]
    (task,) = model["classification"]["tasks"].values()

    classifier = transformers.BertForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    predicted = [
        int(classifier(**tokenizer(r["text"], return_tensors="pt")).logits.argmax()) for r in rows
    ]
    expected = sum(p == r["label"] for p, r in zip(predicted, rows)) / len(rows)
    assert task["accuracy"] == pytest.approx(expected) and task["head"] == "own"
    assert task["data"] == "reviews.jsonl" and task["local"] is True


def _llama_config(tiny_llama_set, tmp_path: Path) -> Path:
    experts = list(tiny_llama_set.experts[:2])
    models = "".join(f"  - model: {e}\n    name: task{i}\n" for i, e in enumerate(experts))
    config = tmp_path / "merge.yml"
    config.write_text(
        f"merge_method: linear\nbase_model: {tiny_llama_set.base}\nmodels:\n{models}"
        "parameters:\n  weight: 0.5\ndtype: float32\n",
        encoding="utf-8",
    )
    return config


def test_run_eval_puts_the_merge_results_on_its_card(
    tiny_llama_set, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`run --eval` with the README's example task (examples/eval, run from the repository
    root as the README does): lm-eval on the merge before its card; the card's model-index
    holds the merge's number, the kept results name the output folder (not the run's
    temporary one) and hold no local path; an unknown task is refused before anything merges."""
    pytest.importorskip("lm_eval")
    config = _llama_config(tiny_llama_set, tmp_path)
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)  # the task's data_files root
    refused = CliRunner().invoke(
        main, ["run", str(config), str(tmp_path / "bad"), "--eval", "no_such_task"]
    )
    assert refused.exit_code != 0 and "no_such_task" in refused.output, refused.output
    assert not (tmp_path / "bad").exists()

    out = tmp_path / "merged"
    args = ["run", str(config), str(out), "--eval", "tiny_mc", "--eval-limit", "8"]
    result = _invoke(args + ["--eval-include-path", "examples/eval"])
    assert result.exit_code == 0, result.output
    kept = json.loads((out / EVAL_FILENAME).read_text(encoding="utf-8"))
    assert [(m["role"], m["name"]) for m in kept["models"]] == [("merge", "merged")]
    assert kept["limit"] == 8 and str(tmp_path) not in json.dumps(kept)
    assert not any("_lm_eval" in p for p in os.listdir(out))  # lm-eval's files stay out
    index = {e.metric_type: e for e in ModelCard.load(out / "README.md").data.eval_results}
    acc = kept["models"][0]["lm_eval"]["results"]["tiny_mc"]["acc,none"]
    assert set(index) == {"acc", "acc_norm"} and index["acc"].metric_value == acc
    manifest = json.loads((out / "mergekit_ext_manifest.json").read_text(encoding="utf-8"))
    assert EVAL_FILENAME in json.dumps(manifest)  # publish uploads it with the card


def test_run_eval_without_lm_eval_is_refused_before_merging(tiny_llama_set, tmp_path) -> None:
    """Where the [eval] extra is missing, `run --eval` says how to install it before the
    merge starts, and `--eval-limit` alone is refused as a usage error."""
    config = _llama_config(tiny_llama_set, tmp_path)
    lonely = CliRunner().invoke(
        main, ["run", str(config), str(tmp_path / "o"), "--eval-limit", "5"]
    )
    assert lonely.exit_code == 2 and "only apply with --eval" in lonely.output, lonely.output
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("lm-eval is installed here; the test above covers the installed case")
    result = CliRunner().invoke(main, ["run", str(config), str(tmp_path / "out"), "--eval", "x"])
    assert result.exit_code != 0
    assert "pip install 'mergekit-ext[eval]'" in result.output, result.output
    assert not (tmp_path / "out").exists()
