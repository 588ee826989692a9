"""What a merge reports about itself (issue #14, items 7, 9, 10, 11, 12).

- where each input came from is recorded at merge time, so a card rebuilt from another
  directory never turns a relative folder into a Hub repository (item 7);
- the card's parameter tables show the values as the YAML gave them (item 9);
- user-facing text never points at files outside the package (item 10);
- wall time and peak memory of every method path, in the diagnostics, the card and ``run``'s
  last line (item 11);
- ``dtype``/``out_dtype`` set the written dtype of the data-aware methods while their
  statistics stay float64 (item 12).
"""

from __future__ import annotations

import json
import mmap
import random
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors import safe_open

from mergekit_ext.cli import main
from mergekit_ext.methods import least_squares
from mergekit_ext.resources import ResourceMeter, format_bytes, format_duration, summary_line
from mergekit_ext.testing import WORDS

MEASURED_LINE = re.compile(r"^- \*\*Merge time and memory:\*\*.*\n", re.M)
# the card's last line: the hash of the text above it, measurements included (issue #28, 2)
SIGNATURE_LINE = re.compile(r"^<!-- mergekit-ext card sha256:.*-->\n", re.M)
SUMMARY = re.compile(
    r"^merged in (\d+(\.\d)? s|\d+ min \d+ s|\d+ h \d+ min), peak memory \d+(\.\d+)? [kMG]B$"
)


def run_cli(*args: str) -> str:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


@pytest.fixture
def workspace(tiny_llama_set, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A CWD holding the tiny models under the relative paths tiny/base, tiny/e0, tiny/e1
    (they look like Hub ids ``owner/name``), plus calibration texts."""
    work = tmp_path / "work"
    for name, src in zip(("base", "e0", "e1"), tiny_llama_set.models):
        shutil.copytree(src, work / "tiny" / name)
    rng = random.Random(0)
    with open(work / "texts.txt", "w", encoding="utf-8") as fp:
        for _ in range(24):
            fp.write(" ".join(rng.choice(WORDS) for _ in range(8)) + "\n")
    monkeypatch.chdir(work)
    return work


def write_config(work: Path, method: str, **extra) -> str:
    models = [{"model": "tiny/e0"}, {"model": "tiny/e1"}]
    config = {"merge_method": method, "base_model": "tiny/base", "models": models, **extra}
    if method in ("regmean", "symerge"):
        config["calibration"] = {"path": "texts.txt", "samples": 16, "max_length": 12}
    if method == "symerge":
        config["parameters"] = {"epochs": 1, "batch_size": 8, "seed": 0}
    if method == "ties":
        config.setdefault("parameters", {"density": 0.5, "weight": 0.5})
    path = work / f"{method}.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return path.name


def floating_dtypes(folder: Path) -> set[torch.dtype]:
    found = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                if tensor.dtype.is_floating_point:
                    found.add(tensor.dtype)
    return found


# ------------------------------------------------------------------------- item 7


def test_card_rebuilt_from_another_directory_keeps_relative_inputs_local(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write_config(workspace, "ties", parameters={"density": 0.5, "weight": 0.5})
    run_cli("run", config, "out/merged")
    merged = workspace / "out" / "merged"
    written = (merged / "README.md").read_bytes()
    recorded = json.loads((merged / "mergekit_ext_diagnostics.json").read_text())["inputs"]
    assert [(r["model"], r["source"]) for r in recorded] == [
        ("tiny/base", "local"),
        ("tiny/e0", "local"),
        ("tiny/e1", "local"),
    ]
    elsewhere = workspace.parent / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # tiny/base does not exist here: it looks like a Hub id
    run_cli("card", str(merged))
    card = (merged / "README.md").read_text(encoding="utf-8")
    front = card.split("---\n")[1]
    assert "base_model" not in front and "tiny/" not in front  # no fake Hub repositories
    assert "| base | base | `./tiny/base` | local folder |" in card  # ./: not a Hub id
    assert "huggingface.co/tiny" not in card
    assert card.encode("utf-8") == written  # the same card as the merge wrote


# ------------------------------------------------------------------------- item 9


def test_parameter_tables_show_values_as_given(workspace: Path) -> None:
    config = {
        "merge_method": "ties",
        "base_model": "tiny/base",
        "models": [
            {"model": "tiny/e0", "parameters": {"weight": 0.7, "density": 0.5}},
            {"model": "tiny/e1", "parameters": {"weight": 0.3}},
        ],
        "parameters": {"normalize": False, "density": 0.9},
        "dtype": "float32",
    }
    (workspace / "p.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    run_cli("run", "p.yml", "out/p")
    card = (workspace / "out" / "p" / "README.md").read_text(encoding="utf-8")
    # Global: what was given beside the default; per-model parameters given globally too.
    assert "| `normalize` | `false` | `true` |" in card
    assert "| `rescale` | — | `false` |" in card
    assert "| `density` | `0.9` | `1.0` |" in card
    # Per model, exactly what each entry gave; then the global and default rows.
    assert "| Model | `weight` | `density` |" in card
    assert "| e0 | `0.7` | `0.5` |" in card
    assert "| e1 | `0.3` | — |" in card
    assert "| *global* | — | `0.9` |" in card
    assert "| *default* | — | `1.0` |" in card  # weight has no default
    assert "(default)" not in card and "null" not in card.split("```yaml")[0]


# ------------------------------------------------------------------------- item 10

FORBIDDEN = ("METHODS.md", "../shared", "/work/shared", "provisional default", "until measured")


def test_user_facing_text_cites_only_the_package_docs(workspace: Path) -> None:
    root = Path(__file__).resolve().parent.parent
    files = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    files += sorted((root / "mergekit_ext").rglob("*.py"))
    files += sorted((root / "mergekit_ext").rglob("*.j2"))
    for path in files:
        text = path.read_text(encoding="utf-8")
        for needle in FORBIDDEN:
            assert needle not in text, f"{path.relative_to(root)} mentions {needle!r}"
    listing = run_cli("methods")
    for needle in FORBIDDEN:
        assert needle not in listing
    # Parameter help cites no file but the package's own docs (no benchmark script, no spec).
    for method in json.loads(run_cli("methods", "--json")):
        for p in method["parameters"]:
            cited = re.findall(r"[\w./-]+\.(?:py|md|txt|yml|yaml)\b", p["description"])
            assert set(cited) <= {"docs/methods.md"}, (method["name"], p["name"], cited)
            assert "benchmarks/" not in p["description"], (method["name"], p["name"])
    config = write_config(workspace, "regmean", dtype="float32")
    run_cli("run", config, "out/r")
    card = (workspace / "out" / "r" / "README.md").read_text(encoding="utf-8")
    for needle in FORBIDDEN:
        assert needle not in card


# ------------------------------------------------------------------------- item 11


def _touch_and_unmap(size: int) -> None:
    """Make ``size`` bytes resident and give them back to the kernel (munmap), whatever the
    allocator's state: a torch tensor may come from memory the process already holds."""
    block = mmap.mmap(-1, size)
    for offset in range(0, size, mmap.PAGESIZE):
        block[offset] = 1
    block.close()


def test_resource_meter_measures_the_block_not_the_process() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("the per-merge peak needs Linux's VmHWM reset")
    with ResourceMeter() as big:
        _touch_and_unmap(256 * 2**20)
    with ResourceMeter() as small:
        torch.ones(1024).sum()
    assert big.usage is not None and small.usage is not None
    assert big.usage.wall_time_s > 0 and big.usage.cuda_max_allocated_bytes is None
    if big.usage.peak_rss_scope == "merge":
        # The second block's peak does not carry the first one's: the high-water mark was reset.
        assert small.usage.peak_rss_scope == "merge"
        assert big.usage.peak_rss_bytes - small.usage.peak_rss_bytes > 200 * 2**20
    else:
        # A kernel that keeps the mark (the reset was checked and found missing): the record
        # says the peak is the process's, which is at least the 256 MiB block.
        assert big.usage.peak_rss_scope == "process" == small.usage.peak_rss_scope
        assert small.usage.peak_rss_bytes >= 256 * 2**20


def test_resource_meter_checks_that_the_reset_took(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A kernel that accepts the write to clear_refs and keeps the old mark (seen in CI):
    the meter must not call the lifetime peak the merge's own."""
    if not sys.platform.startswith("linux"):
        pytest.skip("needs /proc/self/status")
    _touch_and_unmap(256 * 2**20)  # the process's mark now sits well above its resident set
    monkeypatch.setattr("mergekit_ext.resources._CLEAR_REFS", str(tmp_path / "clear_refs"))
    with ResourceMeter() as meter:
        torch.ones(1024).sum()
    assert meter.usage is not None and meter.usage.peak_rss_scope == "process"
    assert summary_line(meter.usage.to_json() | {"wall_time_s": 1.0}).endswith("(whole process)")


def test_durations_and_sizes_as_printed() -> None:
    assert format_duration(0.42) == "0.4 s"
    assert format_duration(12.4) == "12 s"
    assert format_duration(72.3) == "1 min 12 s"
    assert format_duration(7384) == "2 h 03 min"
    assert format_bytes(3.4e9) == "3.40 GB"  # tqdm's format_sizeof, in 1000s (issue #50.12)
    assert format_bytes(123_456) == "123 kB" and format_bytes(999) == "999 B"
    assert format_bytes(812e6) == "812 MB"
    line = summary_line({"wall_time_s": 72.0, "peak_rss_bytes": 3.4e9, "peak_rss_scope": "merge"})
    assert line == "merged in 1 min 12 s, peak memory 3.40 GB"
    cuda = {"wall_time_s": 5, "peak_rss_bytes": 2e9, "cuda_max_allocated_bytes": 1.5e9}
    assert summary_line(cuda) == "merged in 5.0 s, peak memory 2.00 GB, CUDA max allocated 1.50 GB"


@pytest.mark.parametrize("method", ["ties", "regmean", "symerge"])
def test_run_records_and_prints_time_and_memory(workspace: Path, method: str) -> None:
    """Every executor: mergekit's tensor-wise one, the layer-wise one, SyMerge's adaptation."""
    config = write_config(workspace, method, dtype="float32")
    output = run_cli("run", config, "out/m")
    diag = json.loads((workspace / "out" / "m" / "mergekit_ext_diagnostics.json").read_text())
    resources = diag["resources"]
    assert resources["wall_time_s"] > 0
    # The tiny models are small, but a process with torch loaded holds far more than 50 MB.
    assert resources["peak_rss_bytes"] > 50e6
    assert resources["peak_rss_scope"] == (
        "merge" if sys.platform.startswith("linux") else "process"
    )
    assert resources["cuda_max_allocated_bytes"] is None  # a CPU merge
    line = summary_line(resources)
    assert line is not None and SUMMARY.match(line), line
    assert output.rstrip("\n").splitlines()[-1] == line  # run's last line
    card = (workspace / "out" / "m" / "README.md").read_text(encoding="utf-8")
    measured = MEASURED_LINE.findall(card)
    assert len(measured) == 1 and format_bytes(resources["peak_rss_bytes"]) in measured[0]

    # Deterministic apart from the measurements: the same merge gives the same card.
    run_cli("run", config, "out/m", "--overwrite")
    again = (workspace / "out" / "m" / "README.md").read_text(encoding="utf-8")
    unmeasured = [SIGNATURE_LINE.sub("", MEASURED_LINE.sub("", c)) for c in (again, card)]
    assert unmeasured[0] == unmeasured[1]
    diag_again = json.loads((workspace / "out" / "m" / "mergekit_ext_diagnostics.json").read_text())
    if method != "symerge":  # SyMerge records its own timings per phase as well
        assert {k: v for k, v in diag_again.items() if k != "resources"} == {
            k: v for k, v in diag.items() if k != "resources"
        }


# ------------------------------------------------------------------------- item 12


def test_bf16_regmean_writes_bf16_from_float64_statistics(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    solve = least_squares.regmean_solve

    def spy(expert_weights, grams, *args, **kwargs):
        seen.extend((w.dtype, g.dtype) for w, g in zip(expert_weights, grams))
        return solve(expert_weights, grams, *args, **kwargs)

    monkeypatch.setattr(least_squares.group, "regmean_solve", spy)  # where the driver looks it up
    config = write_config(workspace, "regmean", dtype="bfloat16")
    run_cli("run", config, "out/bf16")
    out = workspace / "out" / "bf16"
    assert seen and set(seen) == {(torch.float32, torch.float64)}  # the math
    assert floating_dtypes(out) == {torch.bfloat16}  # what is written
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"

    # out_dtype wins over dtype for the written tensors.
    config = write_config(workspace, "regmean", dtype="bfloat16", out_dtype="float16")
    run_cli("run", config, "out/f16")
    assert floating_dtypes(workspace / "out" / "f16") == {torch.float16}


def test_bf16_symerge_writes_bf16_checkpoints(workspace: Path) -> None:
    config = write_config(workspace, "symerge", dtype="bfloat16")
    run_cli("run", config, "out/s")
    out = workspace / "out" / "s"
    assert floating_dtypes(out) == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    for task in ("e0", "e1"):
        assert floating_dtypes(out / "tasks" / task) == {torch.bfloat16}, task
