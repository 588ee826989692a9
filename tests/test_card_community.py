"""The card a community merger would post (issue #32, items 6 to 8): a mergekit-style
summary on top, the research diagnostics folded below it; a chat usage example for chat
models; the lineage of inputs downloaded with ``hf download --local-dir``.

Each test runs a real tiny merge (or renders the card of one) and reads the card back.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import huggingface_hub
import huggingface_hub.constants as hf_constants
import pytest
import yaml
from click.testing import CliRunner
from PIL import Image

from mergekit_ext.hub.card import write_model_card
from mergekit_ext.merge_inputs import downloaded_hub_id

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _download_layout(folder: Path, commit: str = COMMIT) -> None:
    """What ``hf download REPO --local-dir folder`` leaves: one metadata file per file,
    written by huggingface_hub's own ``_local_folder.write_download_metadata``."""
    from huggingface_hub._local_folder import write_download_metadata

    for f in sorted(folder.iterdir()):
        if f.is_file():
            write_download_metadata(folder, f.name, commit, f'"etag-{f.name}"')


def _set_name_or_path(folder: Path, value: str) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["_name_or_path"] = value
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture
def workspace(tiny_llama_set, tmp_path: Path, monkeypatch) -> Path:
    """./m/{base,expert0,expert1} (relative paths that look like owner/name), per-model
    calibration data, the working directory set there."""
    m = tmp_path / "m"
    m.mkdir()
    shutil.copytree(tiny_llama_set.base, m / "base")
    for i, expert in enumerate(tiny_llama_set.experts[:2]):
        shutil.copytree(expert, m / f"expert{i}")
    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(f'{{"text": "{name} one two three {i}"}}\n' for i in range(8))
        )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    return tmp_path


def _merge(workspace: Path, out: str = "out") -> Path:
    from mergekit_ext.cli import main

    (workspace / "c.yml").write_text(
        "merge_method: regmean\nbase_model: m/base\nmodels:\n"
        "  - model: m/expert1\n    name: second\n"
        "    calibration: {path: b.jsonl, samples: 4, max_length: 12}\n"
        "  - model: m/expert0\n    name: first\n"
        "    calibration: {path: a.jsonl, samples: 4, max_length: 8}\n"
        "dtype: float32\n"
    )
    result = CliRunner().invoke(main, ["run", "c.yml", out])
    assert result.exit_code == 0, result.output
    return workspace / out


def test_card_layout_summary_on_top_diagnostics_folded(workspace: Path) -> None:
    """Item 6: method, models and YAML on top; everything measured below, in <details>,
    with plain words for the numbers; no benchmark numbers, no docs/methods.md, no flat
    task-weight bar chart for uniform weights."""
    out = _merge(workspace)
    text = (out / "README.md").read_text(encoding="utf-8")
    top, _, folded = text.partition("<details>")
    assert folded and "</details>" in folded
    assert top.index("### Merge method") < top.index("### Models merged")
    assert top.index("### Models merged") < top.index("### Configuration")
    assert "merge method (`regmean`)" in top and "with `./m/base` as the base" in top
    assert "* `./m/expert1`\n* `./m/expert0`\n" in top
    assert "```yaml\nmerge_method: regmean\nbase_model: ./m/base\n" in top
    assert "## How to use" in top
    for research in ("### Calibration data", "### What the merge measured", "condition number"):
        assert research not in top and research in folded
    assert "how close to singular the matrix" in folded  # what the number means
    for banned in ("docs/methods.md", "suite", "benchmark", "sweep"):
        assert banned not in text, banned
    # uniform task weights: the plot has one panel (the condition number), and says why
    caption = re.search(r"\*(The task weights are equal[^*]*)\*", folded)
    assert caption and "2 tasks, each 1/2" in caption.group(1)
    height = Image.open(out / "images" / "regmean_task_weights.png").size[1]
    assert height < 1.2 * 3.2 * 110  # one row (new_figure: 3.2 in per row at 110 dpi)
    huggingface_hub.ModelCard(text)  # the front matter parses


def test_calibration_rows_in_model_order(workspace: Path) -> None:
    """Item 8: one calibration row per model, in the order of `models:`, with max_length
    and the chat-template flag."""
    text = (_merge(workspace) / "README.md").read_text(encoding="utf-8")
    header = "| Model | Source | Split | Samples | Tokens | Max length | Chat template |"
    assert header in text
    rows = re.findall(
        r"^\| (second|first) \| `([^`]+)` \| — \| 4 \| [\d,]+ \| (\d+) \| (\w+) \|", text, re.M
    )
    assert rows == [("second", "b.jsonl", "12", "no"), ("first", "a.jsonl", "8", "no")]
    # a dataset's `split:` is shown (issue #50, item 14)
    from mergekit_ext.config import parse_config
    from mergekit_ext.hub.card.render import _calibration_rows

    cfg = parse_config(
        "merge_method: regmean\nbase_model: b\nmodels:\n  - model: e\n    calibration:\n"
        "      dataset: some/set\n      split: 'validation[:50]'\n"
    )
    assert _calibration_rows({}, cfg, ".")[0]["split"] == "validation[:50]"


def test_chat_usage_example(workspace: Path) -> None:
    """Item 7: a chat template on the inputs (or the output) gives a chat usage example."""
    out = _merge(workspace)
    text = (out / "README.md").read_text(encoding="utf-8")
    assert "apply_chat_template" not in text and 'tokenizer("The merged model"' in text
    (workspace / "m" / "expert0" / "chat_template.jinja").write_text(
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    write_model_card(str(out))
    text = (out / "README.md").read_text(encoding="utf-8")
    assert 'messages = [{"role": "user"' in text
    assert "apply_chat_template(\n    messages, add_generation_prompt=True" in text
    assert 'tokenizer("The merged model"' not in text


def test_lineage_of_downloaded_inputs(workspace: Path) -> None:
    """Item 8: folders fetched with `hf download --local-dir` keep their Hub id (config.json
    `_name_or_path`, or the Hub cache's snapshot of the recorded commit); a folder saved
    locally that names its parent is not taken for it; local paths are written ./m/x."""
    m = workspace / "m"
    _set_name_or_path(m / "expert0", "org-a/expert0")
    _download_layout(m / "expert0")
    # expert1: downloaded, no usable _name_or_path; its commit is in the local Hub cache
    _set_name_or_path(m / "expert1", "/fsx/checkpoints/run-7")
    _download_layout(m / "expert1", "f" * 40)
    snapshot = workspace / "hub-cache" / "models--org-b--expert1" / "snapshots" / ("f" * 40)
    snapshot.mkdir(parents=True)
    # base: saved locally after fine-tuning (no download metadata): its parent is not its id
    _set_name_or_path(m / "base", "org-z/parent-of-base")

    assert downloaded_hub_id(str(m / "expert0")) == (
        "org-a/expert0",
        "config.json `_name_or_path`, a hint (its name is the folder's)",
        COMMIT,
    )
    assert downloaded_hub_id(str(m / "base")) == (None, None, None)

    out = _merge(workspace)
    card = huggingface_hub.ModelCard.load(str(out / "README.md"))
    assert card.data.base_model == ["org-b/expert1", "org-a/expert0"]
    text = card.text
    assert "local copy of [org-a/expert0](https://huggingface.co/org-a/expert0)" in text
    assert "org-z/parent-of-base" not in text
    copied = yaml.safe_load((out / "mergekit_config.yml").read_text())
    assert copied["base_model"] == "./m/base"
    assert [e["model"] for e in copied["models"]] == ["./m/expert1", "./m/expert0"]
    # the config as written still merges (./m/x is the same folder as m/x)
    from mergekit_ext.cli import main

    shutil.copy(out / "mergekit_config.yml", workspace / "again.yml")
    result = CliRunner().invoke(main, ["run", "again.yml", "out2", "--dry-run"])
    assert result.exit_code == 0, result.output


def test_lora_row_names_the_adapter(workspace: Path, tmp_path: Path) -> None:
    """Item 8: a `model+lora` input is listed by its adapter, on its base."""
    out = _merge(workspace)
    (out / "mergekit_config.yml").write_text(
        "merge_method: linear\nmodels:\n  - model: m/base+m/adapter\n"
        "    parameters: {weight: 1.0}\n  - model: m/expert0\n    parameters: {weight: 1.0}\n"
        "dtype: float32\n"
    )
    (workspace / "m" / "adapter").mkdir()
    write_model_card(str(out))
    text = (out / "README.md").read_text(encoding="utf-8")
    assert "* LoRA adapter `./m/adapter` on `./m/base`" in text
    assert "| model | adapter | `./m/base + ./m/adapter` |" in text


def test_downloaded_fine_tune_is_not_its_parent(workspace: Path) -> None:
    """Issue #50.2: a fine-tune fetched with `hf download --local-dir` whose config.json
    names its parent (`_name_or_path`) is not a copy of the parent: the download metadata
    (the commit, and the Hub cache's snapshot of it) decides, and the card says which
    source it used. A license is written only when every input declares the same one."""
    m = workspace / "m"
    parent = "HuggingFaceTB/SmolLM2-135M-Instruct"
    for name in ("expert0", "expert1"):
        _set_name_or_path(m / name, parent)
    _download_layout(m / "expert0", COMMIT)  # not in the Hub cache
    _download_layout(m / "expert1", "e" * 40)  # its snapshot is cached, under its own id
    (workspace / "hub-cache" / "models--bob--expert1" / "snapshots" / ("e" * 40)).mkdir(
        parents=True
    )
    (m / "base" / "README.md").write_text("---\nlicense: apache-2.0\n---\n# base\n")
    assert downloaded_hub_id(str(m / "expert0")) == (None, None, COMMIT)
    assert downloaded_hub_id(str(m / "expert1")) == (
        "bob/expert1",
        "the Hub cache's snapshot of the downloaded commit",
        "e" * 40,
    )

    out = _merge(workspace)
    card = huggingface_hub.ModelCard.load(str(out / "README.md"))
    assert card.data.base_model == ["bob/expert1"]  # never the parent
    text = card.text
    assert parent not in text
    assert "local copy of [bob/expert1](https://huggingface.co/bob/expert1), id read from the " \
        "Hub cache's snapshot of the downloaded commit" in text  # fmt: skip
    row = next(line for line in text.splitlines() if "`./m/expert0`" in line and "|" in line)
    assert f"(commit `{COMMIT[:12]}`)" in row and "| local folder |" in row
    # two inputs declare no license: none is written, the card says why
    assert card.data.license is None
    assert "Inputs that declare no license: second, first" in text
    assert "no license is set" in text

    # every input declares apache-2.0: the merge carries it
    for name in ("expert0", "expert1"):
        (m / name / "README.md").write_text("---\nlicense: apache-2.0\n---\n")
    out = _merge(workspace, "out-licensed")
    assert huggingface_hub.ModelCard.load(str(out / "README.md")).data.license == "apache-2.0"
