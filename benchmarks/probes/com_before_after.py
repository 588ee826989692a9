"""Chain of Merges before and after a change, and mergekit's ``ties``, on the same synthetic
Llama, interleaved in one run (issue #47, item 4: the 0.34B CoM / ties ratio).

The models and calibration data are the executor-memory probe's
(:mod:`benchmarks.probes.executor_memory`, ``--size probe``: the 0.34B widths with 4 blocks).
Each merge runs in its own subprocess with one torch thread; ``--before`` names a source tree
of mergekit-ext (for instance ``git archive <commit> | tar -x -C DIR``) whose
``mergekit_ext`` the "before" merges import, the "after" merges import this tree's. Reported
per merge: wall seconds and the child's CPU seconds (user + system, ``RUSAGE_CHILDREN``,
which contention on a shared machine stretches far less than wall time), the sha256 of each
written weight file (before and after must be byte-identical) and, for CoM, the largest
change of any group's relative output error and covariate-shift W2 between the two.

    python -m benchmarks.probes.com_before_after --before /tmp/before --after /tmp/after \\
        --cache /tmp/cache --rounds 2 --json benchmarks/results/raw/com_before_after.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _child(method: str, folder: str, out: str, size_name: str, record_path: str) -> None:
    """One merge, one thread, in this process (imports whichever mergekit_ext is first on
    PYTHONPATH); CoM's per-group diagnostics go to ``record_path``."""
    import torch

    torch.set_num_threads(1)
    from mergekit.options import MergeOptions

    import mergekit_ext  # noqa: F401  (registers the methods)
    from benchmarks.probes.executor_memory import SIZES, _yaml
    from mergekit_ext.config import parse_config

    cfg = parse_config(_yaml(method, folder, SIZES[size_name]))
    options = MergeOptions(quiet=True, write_model_card=False, copy_tokenizer=False)
    if method == "ties":
        from mergekit.merge import run_merge

        run_merge(cfg.merge, out, options=options, config_source=cfg.source_text)
        return
    from mergekit_ext.executor import run_layerwise_merge
    from mergekit_ext.methods.registry import ext_method_info

    info = ext_method_info(method)
    assert info is not None
    record = run_layerwise_merge(
        cfg, out, options, info.implementation, cfg.parameters, device="cpu"
    )
    with open(record_path, "w") as f:
        json.dump(record.sections, f, default=str)


def _hashes(folder: str) -> dict[str, str]:
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with open(os.path.join(folder, name), "rb") as f:
                out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def run_one(
    label: str, method: str, source: str, folder: str, work: str, size_name: str
) -> dict[str, Any]:
    """Run one merge in a subprocess importing ``source``'s mergekit_ext; its wall and CPU."""
    out = os.path.join(work, f"{label}-{method}")
    record_path = out + ".record.json"
    shutil.rmtree(out, ignore_errors=True)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        # the tree under test first; this script's benchmarks package from the same tree
        "PYTHONPATH": source,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    cmd = [sys.executable, os.path.abspath(__file__), "--child", method]
    cmd += ["--models", folder, "--out", out, "--size", size_name, "--record", record_path]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=source, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{label} {method} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result: dict[str, Any] = {
        "label": label,
        "method": method,
        "wall_s": wall,
        "cpu_s": cpu,
        "load_avg": os.getloadavg()[0],
        "hashes": _hashes(out),
    }
    if os.path.isfile(record_path):
        with open(record_path) as f:
            result["sections"] = json.load(f)
    shutil.rmtree(out, ignore_errors=True)
    return result


def _group_values(sections: dict[str, Any]) -> dict[tuple[str, str, str], float]:
    """(group, task, field) -> value for every group record's per-task diagnostics."""
    values: dict[tuple[str, str, str], float] = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "tasks" in node and "layer" in node and isinstance(node["tasks"], dict):
                for task, rec in node["tasks"].items():
                    for key in ("relative_output_error", "covariate_shift_w2"):
                        if isinstance(rec.get(key), (int, float)):
                            values[(str(node["layer"]), task, key)] = float(rec[key])
            for child in node.values():
                walk(child)
        elif isinstance(node, list):
            for child in node:
                walk(child)

    walk(sections)
    return values


def diagnostics_change(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Largest relative change of each diagnostic between two CoM records."""
    a, b = _group_values(before), _group_values(after)
    changes: dict[str, float] = {}
    for key in a.keys() & b.keys():
        old, new = a[key], b[key]
        change = 0.0 if old == new else abs(new - old) / max(abs(old), 1e-300)
        changes[key[2]] = max(changes.get(key[2], 0.0), change)
    return {"compared": len(a.keys() & b.keys()), "missing": len(a.keys() ^ b.keys()), **changes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="source tree whose mergekit_ext is 'before'")
    parser.add_argument(
        "--after", default=ROOT, help="source tree whose mergekit_ext is 'after' (this one)"
    )
    parser.add_argument("--cache", default=None, help="cache folder for the synthetic models")
    parser.add_argument("--size", default="probe", help="executor_memory SIZES name")
    parser.add_argument("--rounds", type=int, default=1, help="before/after pairs")
    parser.add_argument("--no-ties", action="store_true", help="skip mergekit's ties")
    parser.add_argument("--json", default=None, help="write the raw results here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--models", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--record", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child, args.models, args.out, args.size, args.record)
        return 0
    if not args.before:
        parser.error("--before is required")

    from benchmarks.probes.executor_memory import build
    from benchmarks.suites.cache import default_cache_dir

    folder, _ = build(args.cache or default_cache_dir(), args.size)
    work = tempfile.mkdtemp(prefix="com-before-after-")
    runs: list[dict[str, Any]] = []
    try:
        if not args.no_ties:
            runs.append(run_one("ties", "ties", ROOT, folder, work, args.size))
        for _ in range(args.rounds):
            for label, source in (
                ("before", os.path.abspath(args.before)),
                ("after", os.path.abspath(args.after)),
            ):
                runs.append(run_one(label, "chain_of_merges", source, folder, work, args.size))
                r = runs[-1]
                print(f"{label:<7} wall {r['wall_s']:8.1f} s  CPU {r['cpu_s']:8.1f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    com = [r for r in runs if r["method"] == "chain_of_merges"]
    before = [r for r in com if r["label"] == "before"]
    after = [r for r in com if r["label"] == "after"]
    identical = all(r["hashes"] == before[0]["hashes"] for r in com)
    change = diagnostics_change(before[0].get("sections", {}), after[0].get("sections", {}))
    print(f"{'merge':<10}{'wall s':>10}{'CPU s':>10}{'load':>7}")
    for r in runs:
        print(f"{r['label']:<10}{r['wall_s']:>10.1f}{r['cpu_s']:>10.1f}{r['load_avg']:>7.1f}")

    def best(rs: list[dict[str, Any]], key: str) -> float:
        return min(r[key] for r in rs) if rs else math.nan

    for key in ("cpu_s", "wall_s"):
        line = f"{key}: before {best(before, key):.1f}, after {best(after, key):.1f}"
        ties = [r for r in runs if r["method"] == "ties"]
        if ties:
            t = best(ties, key)
            line += (
                f", ties {t:.1f}; CoM / ties before {best(before, key) / t:.2f}, "
                f"after {best(after, key) / t:.2f}"
            )
        print(line)
    print(f"written weights byte-identical before / after: {identical}")
    print(f"diagnostics, largest relative change: {change}")
    if args.json:
        for r in runs:
            r.pop("sections", None)
        with open(args.json, "w") as f:
            json.dump(
                {"runs": runs, "identical": identical, "diagnostics_change": change}, f, indent=1
            )
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
