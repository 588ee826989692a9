"""The merge record (``mergekit_ext/merge_record.py``): the schema of the diagnostics file every
merge writes next to its weights."""

from __future__ import annotations

import json
import math
import threading

import numpy as np
import pytest
import torch

from mergekit_ext import __version__, merge_record


def test_header_and_sections_follow_the_schema(tmp_path) -> None:
    recorder = merge_record.DiagnosticsRecorder("ace", parameters={"k_frac": 0.3}, seed=7)
    recorder.record_item("ace", "tensors", "w", {"gamma": 0.5, "normalized": True})
    recorder.append("regmean", "layers", {"layer": "0.qkv", "condition_number": 3.0})
    recorder.record("symerge", "loss", [1.0, 0.5])
    recorder.set_header("config_sha256", "abc")
    path = recorder.write(str(tmp_path))

    assert path == str(tmp_path / merge_record.FILENAME)
    data = json.loads(open(path, encoding="utf-8").read())
    assert data["schema_version"] == merge_record.SCHEMA_VERSION == 1
    assert data["mergekit_ext_version"] == __version__
    assert data["method"] == "ace" and data["seed"] == 7 and data["config_sha256"] == "abc"
    assert data["parameters"] == {"k_frac": 0.3}
    assert data["sections"] == {
        "ace": {"tensors": {"w": {"gamma": 0.5, "normalized": True}}},
        "regmean": {"layers": [{"layer": "0.qkv", "condition_number": 3.0}]},
        "symerge": {"loss": [1.0, 0.5]},
    }
    assert merge_record.load(str(tmp_path)) == data


def test_values_become_strict_json() -> None:
    """Tensors and numpy values become lists and numbers; NaN and ±inf the strings
    "nan"/"inf"/"-inf", so the file is valid JSON (``allow_nan=False``) and a measured NaN
    stays apart from a missing value (null)."""
    value = {
        "tensor": torch.tensor([1.5, float("nan")]),
        "array": np.array([[1, 2]]),
        "scalar": np.float64(2.5),
        "inf": math.inf,
        "ninf": -math.inf,
        3: (1, 2),
    }
    assert merge_record._jsonable(value) == {
        "tensor": [1.5, "nan"],  # a measured NaN, not a missing value (null)
        "array": [[1, 2]],
        "scalar": 2.5,
        "inf": "inf",
        "ninf": "-inf",
        "3": [1, 2],
    }


def test_redaction_rewrites_every_string_keys_included(tmp_path) -> None:
    recorder = merge_record.DiagnosticsRecorder("ties", note="/home/me/models/a")
    recorder.record_item("sec", "inputs", "/home/me/models/a", "/home/me/models/b")
    recorder.write(str(tmp_path), redact=lambda s: s.replace("/home/me/", ""))
    text = (tmp_path / merge_record.FILENAME).read_text(encoding="utf-8")
    assert "/home/me" not in text
    assert json.loads(text)["sections"]["sec"]["inputs"] == {"models/a": "models/b"}
    # the recorder itself keeps the real paths (the merge may still need them)
    assert recorder.data["note"] == "/home/me/models/a"


def test_module_functions_record_only_inside_recording() -> None:
    merge_record.record("orphan", "k", 1)  # no active recorder: a no-op, no error
    assert merge_record.active() is None
    outer = merge_record.DiagnosticsRecorder("a")
    inner = merge_record.DiagnosticsRecorder("b")
    with merge_record.recording(outer):
        merge_record.record("s", "k", 1)
        with merge_record.recording(inner):
            merge_record.append("s", "items", 2)
        assert merge_record.active() is outer
        merge_record.record_item("s", "c", "x", 3)
    assert merge_record.active() is None
    assert outer.data["sections"] == {"s": {"k": 1, "c": {"x": 3}}}
    assert inner.data["sections"] == {"s": {"items": [2]}}


def test_concurrent_appends_lose_nothing() -> None:
    """mergekit runs tensor tasks in threads: the recorder must be thread-safe."""
    recorder = merge_record.DiagnosticsRecorder("ace")

    def work(start: int) -> None:
        for i in range(start, start + 500):
            recorder.append("s", "items", i)
            recorder.record_item("s", "map", str(i), i)

    threads = [threading.Thread(target=work, args=(k * 500,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(recorder.data["sections"]["s"]["items"]) == list(range(2000))
    assert len(recorder.data["sections"]["s"]["map"]) == 2000


def test_missing_file_loads_as_empty(tmp_path) -> None:
    assert merge_record.load(str(tmp_path)) == {}


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_written_file_never_holds_bare_nan_or_inf(tmp_path, bad) -> None:
    recorder = merge_record.DiagnosticsRecorder("ace")
    recorder.record("s", "v", bad)
    text = (tmp_path / merge_record.FILENAME).read_text() if recorder.write(str(tmp_path)) else ""
    assert "NaN" not in text and "Infinity" not in text
    json.loads(text)
