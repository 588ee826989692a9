"""Byte-identity harness: the eight tiny-model merges, one sha256 per output weight file.

Every merge method (mergekit's ties and each mergekit-ext method, QP under both objectives) runs
on the same tiny random Llama set (built here from fixed seeds), on one thread, and the
sha256 of each written weight file is printed. A refactor that must not change behaviour keeps
these hashes byte-identical:

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m benchmarks.merge_hashes --write hashes.json
    ... change the code ...
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python -m benchmarks.merge_hashes --check hashes.json

``--only NAME`` (repeatable) runs a subset (the tests in tests/test_architecture_rules.py do).

The bytes depend on the CPU's kernels (MKL, oneDNN and ATen pick their code per CPU, so their
sums round differently), so the file holds one record per environment (library versions,
CPU, kernel variables): ``--write`` adds or replaces this machine's record, ``--check``
compares with it and says so when there is none (record one on the start commit first).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import sys
import tempfile
from typing import Any

import torch
import yaml

#: case name -> (merge_method, parameters); run in this order
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "ties": ("ties", {"weight": 0.5, "density": 0.7}),
    "ace": ("ace", {}),
    "regmean": ("regmean", {}),
    "chain_of_merges": ("chain_of_merges", {"propagate": True}),
    "qp_projection": ("qp_projection", {"basis": "diagonal"}),
    "qp_projection_model_output": ("qp_projection", {"objective": "model_output"}),
    "symerge": ("symerge", {"epochs": 2, "seed": 0}),
    "wudi": ("wudi", {}),
}
DATA_AWARE = {"regmean", "chain_of_merges", "qp_projection", "symerge"}
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def _texts(path: str, k: int) -> dict[str, Any]:
    from mergekit_ext.testing import WORDS

    rng = random.Random(k)
    with open(path, "w", encoding="utf-8") as fp:
        for _ in range(12):
            fp.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(10))}) + "\n")
    return {"path": path, "field": "text"}


def _models(root: str) -> tuple[str, list[str]]:
    from mergekit_ext import testing

    base = testing.make_tiny_llama(os.path.join(root, "base"), seed=0)
    experts = testing.make_experts(base, [os.path.join(root, f"expert{i}") for i in range(2)])
    return base, experts


def _config(root: str, base: str, experts: list[str], method: str, params: dict) -> dict:
    models: list[dict[str, Any]] = []
    for k, expert in enumerate(experts):
        entry: dict[str, Any] = {"model": expert}
        if method in DATA_AWARE:
            entry["calibration"] = _texts(os.path.join(root, f"texts{k}.jsonl"), k)
        if method == "ties":
            entry["parameters"] = dict(params)
        models.append(entry)
    config: dict[str, Any] = {"merge_method": method, "base_model": base, "models": models}
    if method in DATA_AWARE:
        config["calibration"] = {"samples": 8, "max_length": 16, "batch_size": 4}
    if method != "ties" and params:
        config["parameters"] = params
    config["dtype"] = "float32"
    return config


def _hashes(folder: str) -> dict[str, str]:
    out = {}
    for dirpath, _dirs, files in os.walk(folder):
        for name in sorted(files):
            if name.endswith(WEIGHT_SUFFIXES):
                path = os.path.join(dirpath, name)
                with open(path, "rb") as fp:
                    out[os.path.relpath(path, folder)] = hashlib.sha256(fp.read()).hexdigest()
    return dict(sorted(out.items()))


def run_cases(names: list[str]) -> dict[str, dict[str, str]]:
    """Run the named merges in a fresh temporary folder, on one thread; return
    {case: {weight file: sha256}}."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run_cases(names)
    finally:
        torch.set_num_threads(threads)  # a caller's (a test process's) setting is its own


def _run_cases(names: list[str]) -> dict[str, dict[str, str]]:
    from click.testing import CliRunner

    from mergekit_ext.cli import main

    results: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory() as root:
        base, experts = _models(root)
        for name in names:
            method, params = CASES[name]
            torch.manual_seed(0)
            random.seed(0)
            case_root = os.path.join(root, name)
            os.makedirs(case_root)
            config = _config(case_root, base, experts, method, params)
            cfg_path = os.path.join(case_root, "c.yml")
            with open(cfg_path, "w", encoding="utf-8") as fp:
                yaml.safe_dump(config, fp)
            out = os.path.join(case_root, "out")
            result = CliRunner().invoke(main, ["run", cfg_path, out], catch_exceptions=False)
            if result.exit_code != 0:
                raise RuntimeError(f"merge {name!r} failed:\n{result.output}")
            results[name] = _hashes(out)
    return results


def _cpu() -> str:
    """The CPU the float32 GEMMs ran on: vendor, family and model from ``/proc/cpuinfo``,
    torch's kernel capability. The BLAS picks its kernels (and so its summation order) per
    CPU: the same code and library versions gave other bytes on an Intel Xeon with AMX than
    on the VM that recorded the earlier hashes (measured)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fp:
            for line in fp:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("vendor_id", "cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
    except OSError:  # not Linux: the processor string is what there is
        fields["vendor_id"] = platform.processor() or platform.machine()
    parts = [fields.get(k, "?") for k in ("vendor_id", "cpu family", "model")]
    return " ".join([*parts, torch.backends.cpu.get_cpu_capability()])


#: variables that change which kernels run (benchmarks/cpu_kernels.py), and so the bytes
KERNEL_VARIABLES = (
    "ATEN_CPU_CAPABILITY",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_CBWR",
    "ONEDNN_MAX_CPU_ISA",
)


def environment() -> dict[str, str]:
    """The library versions, the CPU and the kernel variables set, which the hashes depend on
    (another torch, or another CPU's kernels, may round differently)."""
    import safetensors
    import transformers

    out = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "cpu": _cpu(),
    }
    out.update({k: os.environ[k] for k in KERNEL_VARIABLES if os.environ.get(k)})
    return out


def load_records(path: str) -> list[dict[str, Any]]:
    """The ``{"environment": ..., "hashes": {case: {file: sha256}}}`` records in ``path``
    (none if it does not exist)."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fp:
        return json.load(fp)["records"]


def recorded(path: str, env: dict[str, str]) -> dict[str, dict[str, str]] | None:
    """The hashes recorded in ``path`` for ``env``, or None."""
    return next((r["hashes"] for r in load_records(path) if r["environment"] == env), None)


def write_record(path: str, env: dict[str, str], hashes: dict[str, dict[str, str]]) -> None:
    """Add (or replace) the hashes of ``env`` in ``path``, keeping the other environments and
    this environment's other cases (``--only`` re-records some cases of a record)."""
    old = recorded(path, env) if os.path.exists(path) else None
    records = [r for r in load_records(path) if r["environment"] != env]
    records.append({"environment": env, "hashes": dict(sorted({**(old or {}), **hashes}.items()))})
    records.sort(key=lambda r: json.dumps(r["environment"], sort_keys=True))
    with open(path, "w", encoding="utf-8") as fp:
        json.dump({"records": records}, fp, indent=1, sort_keys=True)
        fp.write("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", action="append", choices=sorted(CASES), help="run this case")
    parser.add_argument("--write", metavar="FILE", help="write the hashes as JSON")
    parser.add_argument("--check", metavar="FILE", help="compare with the hashes in FILE")
    args = parser.parse_args(argv)
    names = args.only or list(CASES)
    results = run_cases(names)
    for name, files in results.items():
        for path, digest in files.items():
            print(f"{digest}  {name}/{path}")
    if args.check:
        expected = recorded(args.check, environment())
        if expected is None:
            print(f"no hashes recorded in {args.check} for {environment()}: record them first")
            return 2
        # a record may lack a case whose bytes a change meant to alter, until it is
        # re-recorded on that machine (``--write FILE --only CASE`` there)
        missing = [n for n in names if n not in expected]
        if missing:
            print(f"not recorded for this environment (re-record them here): {', '.join(missing)}")
        bad = [n for n in names if n in expected and expected[n] != results[n]]
        if bad:
            print(f"DIFFERENT: {', '.join(bad)}")
            return 1
        print(f"identical: {len(names) - len(missing)} merges")
    if args.write:
        write_record(args.write, environment(), results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
