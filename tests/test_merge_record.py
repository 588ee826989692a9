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
    collector = merge_record.DiagnosticsCollector()
    collector.record_item("ace", "tensors", "w", {"gamma": 0.5, "normalized": True})
    collector.append("regmean", "layers", {"layer": "0.qkv", "condition_number": 3.0})
    collector.record("symerge", "loss", [1.0, 0.5])
    record = merge_record.MergeRecord("ace", sections=collector.sections)
    path = record.write(str(tmp_path), parameters={"k_frac": 0.3}, seed=7, config_sha256="abc")

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
    assert record.diagnostics == data["sections"]["ace"]  # the method's own section
    assert merge_record.load(str(tmp_path)) == data


def test_optional_fields_appear_only_when_measured() -> None:
    """An executor that measured no calibration, compute dtype, distribution or resources
    leaves them out of the file (the card then shows no such line), and an empty section
    is no section."""
    bare = merge_record.MergeRecord("ties", sections={"ties": {}}).to_json()
    assert not {"calibration", "executor", "distributed", "resources"} & set(bare)
    assert bare["sections"] == {}
    full = merge_record.MergeRecord(
        "regmean",
        sections={"regmean": {"layers": []}},
        calibration={"a": {"samples": 4}},
        executor={"compute_dtype": "float64"},
        distributed={"world_size": 2, "task_ranks": {"a": 1}},
        resources={"wall_time_s": 1.5},
    ).to_json(seed=None)
    assert full["calibration"] == {"a": {"samples": 4}}
    assert full["executor"] == {"compute_dtype": "float64"}
    assert full["distributed"]["world_size"] == 2 and full["resources"]["wall_time_s"] == 1.5
    assert full["seed"] is None and full["sections"] == {"regmean": {"layers": []}}


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
    record = merge_record.MergeRecord(
        "ties", sections={"sec": {"inputs": {"/home/me/models/a": "/home/me/models/b"}}}
    )
    record.write(
        str(tmp_path), redact=lambda s: s.replace("/home/me/", ""), note="/home/me/models/a"
    )
    text = (tmp_path / merge_record.FILENAME).read_text(encoding="utf-8")
    assert "/home/me" not in text
    assert json.loads(text)["sections"]["sec"]["inputs"] == {"models/a": "models/b"}
    assert json.loads(text)["note"] == "models/a"
    # the record itself keeps the real paths (the merge may still need them)
    assert record.sections["sec"]["inputs"] == {"/home/me/models/a": "/home/me/models/b"}


def test_module_functions_record_only_inside_collecting() -> None:
    merge_record.record("orphan", "k", 1)  # no active collector: a no-op, no error
    assert merge_record.active() is None
    with merge_record.collecting() as outer:
        merge_record.record("s", "k", 1)
        with merge_record.collecting() as inner:
            merge_record.append("s", "items", 2)
        assert merge_record.active() is outer
        merge_record.record_item("s", "c", "x", 3)
    assert merge_record.active() is None
    assert outer.sections == {"s": {"k": 1, "c": {"x": 3}}}
    assert inner.sections == {"s": {"items": [2]}}


def test_a_collector_is_scoped_to_its_context_not_the_process() -> None:
    """Two merges in one process (two threads, each in its own context) never see each
    other's collector, and a thread started without the caller's context sees none."""
    seen: dict[str, object] = {}

    def merge(name: str) -> None:
        with merge_record.collecting() as collector:
            merge_record.record(name, "k", name)
            seen[name] = collector

    threads = [threading.Thread(target=merge, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen["a"].sections == {"a": {"k": "a"}}
    assert seen["b"].sections == {"b": {"k": "b"}}
    with merge_record.collecting() as collector:
        bare = threading.Thread(target=merge_record.record, args=("lost", "k", 1))
        bare.start()
        bare.join()
    assert collector.sections == {}


def test_concurrent_appends_lose_nothing() -> None:
    """mergekit's --multi-gpu executor runs tensor tasks in threads: the collector must be
    thread-safe."""
    collector = merge_record.DiagnosticsCollector()

    def work(start: int) -> None:
        for i in range(start, start + 500):
            collector.append("s", "items", i)
            collector.record_item("s", "map", str(i), i)

    threads = [threading.Thread(target=work, args=(k * 500,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(collector.sections["s"]["items"]) == list(range(2000))
    assert len(collector.sections["s"]["map"]) == 2000


def test_missing_file_loads_as_empty(tmp_path) -> None:
    assert merge_record.load(str(tmp_path)) == {}


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_written_file_never_holds_bare_nan_or_inf(tmp_path, bad) -> None:
    merge_record.MergeRecord("ace", sections={"s": {"v": bad}}).write(str(tmp_path))
    text = (tmp_path / merge_record.FILENAME).read_text()
    assert "NaN" not in text and "Infinity" not in text
    json.loads(text)


def test_multi_gpu_workers_record_into_the_merge_that_started_them(monkeypatch) -> None:
    """mergekit's --multi-gpu executor runs the kernels in a thread pool, where a context
    variable set by the runner is not seen: the tensor-wise executor runs mergekit's device
    workers in its context, so ACE's and WUDI's per-tensor records are not lost, and puts
    mergekit's class back afterwards."""
    from concurrent.futures import ThreadPoolExecutor

    from mergekit.multigpu_executor import MultiGPUExecutor
    from mergekit.options import MergeOptions

    from mergekit_ext.runner import _workers_share_context

    def device_worker(self, *, device: str) -> str:  # what mergekit's worker does: kernels
        merge_record.record_item("ace", "tensors", device, {"gamma": 1.0})
        return device

    monkeypatch.setattr(MultiGPUExecutor, "_device_worker", device_worker)

    def run_like_mergekit() -> list[str]:
        executor = object.__new__(MultiGPUExecutor)
        with ThreadPoolExecutor() as pool:
            futures = [pool.submit(executor._device_worker, device=f"cuda:{i}") for i in (0, 1)]
            return [f.result() for f in futures]

    with merge_record.collecting() as lost:
        run_like_mergekit()  # mergekit's threads alone: nothing reaches the collector
    assert lost.sections == {}
    with merge_record.collecting() as collector:
        with _workers_share_context(MergeOptions(multi_gpu=True)):
            assert run_like_mergekit() == ["cuda:0", "cuda:1"]
    assert set(collector.sections["ace"]["tensors"]) == {"cuda:0", "cuda:1"}
    assert MultiGPUExecutor._device_worker is device_worker
