"""The harness that runs mergekit's own test suite three ways (tests/mergekit_suite/run.py,
issue #48): its verdicts, its extraction, and its plugins on a small fake suite."""

from __future__ import annotations

import importlib.util
import io
import os
import sys
import tarfile
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parent / "mergekit_suite"


def _load_runner():
    spec = importlib.util.spec_from_file_location("mksuite_run", SUITE / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


mk = _load_runner()

STRIDED = "tests/test_r.py::test_strided[{}]"


def _run(mode: str, outcomes: dict[str, str], imported=None, routed=None, code=1):
    return mk.ModeRun(
        mode=mode,
        results={k: {"outcome": v, "reason": f"{v} here"} for k, v in outcomes.items()},
        mergekit_ext_imported=mode != "plain" if imported is None else imported,
        merges_routed=(3 if mode == "routed" else None) if routed is None else routed,
        seconds=1.0,
        cpu_seconds=1.0,
        returncode=code,
        log=Path("/nowhere.log"),
    )


def _three(plain: dict, imported: dict, routed: dict) -> list:
    return [_run("plain", plain), _run("imported", imported), _run("routed", routed)]


NONE = mk.Known(plain={}, ext_only={})


def test_identical_outcomes_pass_and_one_mode_failing_is_reported():
    same = {"t::a": "passed", "t::b": "skipped"}
    assert mk.compare(_three(same, same, same), NONE, selected=False) == []

    problems = mk.compare(
        _three(same, same, {"t::a": "failed", "t::b": "skipped"}), NONE, selected=False
    )
    assert problems == ["t::a: the modes differ (plain passed, imported passed, routed failed)"]
    # an error in set-up against a failure in the body is still the same failing set
    mixed = _three({"t::a": "failed"}, {"t::a": "error"}, {"t::a": "failed"})
    assert mk.compare(mixed, mk.Known(plain={"t::a": "why"}, ext_only={}), False) == []


def test_a_failure_everywhere_needs_a_listed_reason_and_a_listed_pass_is_stale():
    failing = {"t::a": "failed"}
    runs = _three(failing, failing, failing)
    (problem,) = mk.compare(runs, NONE, selected=False)
    assert "t::a: fails in every mode and is not in known_failures.yml (plain)" == problem
    assert mk.compare(runs, mk.Known(plain={"t::a": "upstream bug"}, ext_only={}), False) == []

    passing = {"t::a": "passed"}
    stale = mk.compare(
        _three(passing, passing, passing), mk.Known({"t::a": "upstream bug"}, {}), False
    )
    assert stale == ["t::a: listed in known_failures.yml (plain) but passes: remove it"]


def test_a_listed_failure_that_did_not_run_is_reported_unless_a_selection_ran():
    known = mk.Known(plain={"t::gone": "was broken"}, ext_only={})
    runs = _three({"t::a": "passed"}, {"t::a": "passed"}, {"t::a": "passed"})
    problems = mk.compare(runs, known, selected=False)
    assert "t::gone: listed in known_failures.yml (plain) but did not run in plain" in problems
    assert mk.compare(runs, known, selected=True) == []


def test_cases_parametrized_over_our_methods_are_ext_only():
    plain = {STRIDED.format("linear"): "passed"}
    ours = {**plain, STRIDED.format("ace"): "passed", STRIDED.format("regmean"): "failed"}
    runs = _three(plain, ours, ours)
    assert mk.is_ext_only(runs, STRIDED.format("regmean"))
    assert not mk.is_ext_only(runs, STRIDED.format("linear"))
    (problem,) = mk.compare(runs, NONE, selected=False)
    assert problem == (
        f"{STRIDED.format('regmean')}: fails with mergekit_ext imported and is not in "
        "known_failures.yml (ext_only)"
    )
    known = mk.Known(plain={}, ext_only={STRIDED.format("regmean"): "needs data"})
    assert mk.compare(runs, known, selected=False) == []
    # listed as ext_only but failing only when routed: the modes differ
    routed = {**ours, STRIDED.format("ace"): "failed"}
    problems = mk.compare(_three(plain, ours, routed), known, selected=False)
    assert problems == [
        f"{STRIDED.format('ace')}: the modes differ (plain absent, imported passed, routed failed)"
    ]


def test_a_test_plain_did_not_collect_for_another_reason_is_a_difference():
    # plain's module failed to import: its tests are absent there, not ext-only
    plain = {"tests/test_x.py": "error"}
    other = {"tests/test_x.py::test_a": "passed"}
    runs = _three(plain, other, other)
    assert not mk.is_ext_only(runs, "tests/test_x.py::test_a")
    problems = mk.compare(runs, NONE, selected=False)
    assert (
        "tests/test_x.py::test_a: the modes differ (plain absent, imported passed, routed passed)"
        in problems
    )
    assert any(p.startswith("tests/test_x.py: the modes differ") for p in problems)


def test_check_modes_refuses_a_plain_run_with_mergekit_ext_and_a_routed_run_routing_nothing():
    good = _three({}, {}, {})
    assert mk.check_modes(good, selected=False) == []
    bad = [
        _run("plain", {}, imported=True),
        _run("imported", {}, imported=False),
        _run("routed", {}, routed=0, code=4),
    ]
    problems = mk.check_modes(bad, selected=False)
    assert "plain: mergekit_ext was imported (the plain run is not plain)" in problems
    assert "imported: mergekit_ext was never imported" in problems
    assert "routed: no merge went through mergekit_ext.run_merge" in problems
    assert "routed: pytest exited with 4; see /nowhere.log" in problems
    # a selection may hold no merge at all
    assert mk.check_modes([_run("routed", {}, routed=0)], selected=True) == []


def test_known_failures_file_needs_a_reason_per_test(tmp_path: Path):
    listed = mk.load_known_failures(SUITE / "known_failures.yml")
    assert all(reason.strip() for reason in {**listed.plain, **listed.ext_only}.values())
    bad = tmp_path / "known.yml"
    bad.write_text("plain:\n  tests/test_a.py::test_b: ''\n")
    with pytest.raises(mk.SuiteError, match="map each node id to why it fails"):
        mk.load_known_failures(bad)
    bad.write_text("flaky:\n  tests/test_a.py::test_b: sometimes\n")
    with pytest.raises(mk.SuiteError, match="unknown section"):
        mk.load_known_failures(bad)


def _fake_sdist(path: Path, files: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_extract_takes_tests_and_pytest_settings_never_mergekit_sources(tmp_path: Path):
    sdist = _fake_sdist(
        tmp_path / "mergekit-9.9.tar.gz",
        {
            "mergekit-9.9/pyproject.toml": "[tool.pytest.ini_options]\n",
            "mergekit-9.9/tests/test_a.py": "def test_a():\n    pass\n",
            "mergekit-9.9/mergekit/__init__.py": "",
            "mergekit-9.9/tests/../../escape.py": "",
        },
    )
    dest = tmp_path / "out"
    (dest / "stale").mkdir(parents=True)
    assert mk.extract_tests(sdist, dest) is False  # no tests/common.py in it
    got = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert got == ["pyproject.toml", "tests/__init__.py", "tests/test_a.py"]
    assert not (tmp_path / "escape.py").exists()

    with_common = _fake_sdist(
        tmp_path / "with-common.tar.gz",
        {"m/tests/common.py": "", "m/tests/test_a.py": ""},
    )
    assert mk.extract_tests(with_common, dest) is True


FAKE_TEST = """
import mergekit.merge
from mergekit.merge import run_merge


def test_bound_name_is_routed():
    assert run_merge.__module__ == "mksuite_routed"


def test_module_attribute_is_routed():
    assert mergekit.merge.run_merge.__module__ == "mksuite_routed"


def test_same_everywhere():
    pass


def test_fails_everywhere():
    assert 1 == 2, "upstream bug"
"""


@pytest.mark.slow
def test_runner_end_to_end_on_a_fake_suite(tmp_path: Path, capsys: pytest.CaptureFixture):
    """Two real modes on a fake sdist: the routed plugin swaps both ways mergekit's tests reach
    ``run_merge``, the results plugin records them, and the runner reports the difference."""
    sdist = _fake_sdist(
        tmp_path / "fake.tar.gz",
        {
            "m/pyproject.toml": "[tool.pytest.ini_options]\n",
            "m/tests/test_fake.py": FAKE_TEST,
        },
    )
    known = tmp_path / "known.yml"
    known.write_text("plain:\n  tests/test_fake.py::test_fails_everywhere: upstream bug\n")
    argv = ["--mode", "plain", "--mode", "routed", "--sdist", str(sdist), "--known", str(known)]
    code = mk.main([*argv, "--cache", str(tmp_path / "cache"), "--timeout", "300"])
    out = capsys.readouterr().out
    assert code == 1
    assert "has no tests/common.py: using" in out
    assert (
        tmp_path / "cache" / f"mergekit-{mk.version('mergekit')}" / "tests" / "common.py"
    ).is_file()
    for name in ("test_bound_name_is_routed", "test_module_attribute_is_routed"):
        assert f"tests/test_fake.py::{name}: the modes differ (plain failed, routed passed)" in out
    assert "test_same_everywhere" not in out
    assert "known: upstream bug" in out
    assert "routed: no merge went through mergekit_ext.run_merge" in out  # the fake merges none
    assert "mksuite: FAILED" in out
    assert os.path.isfile(tmp_path / "cache" / "runs" / "routed.log")
