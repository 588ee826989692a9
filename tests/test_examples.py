"""The README's example commands, run as users run them (issue #47).

``make demo-tiny`` itself, every YAML under ``examples/`` through the ``mergekit-ext``
console script, and the MiniLM demo's merge path on its smallest setting
(``demo.py --smoke``), so that a guard, a default or a renamed key cannot break one unseen.
Each runs in a scratch folder laid out like the repository (the YAMLs name their inputs
relative to it), with this checkout's package on ``PYTHONPATH``.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)  # the environment's scripts: mergekit-ext is beside python
TIMEOUT_S = 900

#: YAMLs a script fills in and runs, with the command that runs them (cwd: the scratch folder)
DRIVEN = {
    "examples/minilm_text/merge.yaml": [
        sys.executable,
        os.path.join(REPO_ROOT, "examples", "minilm_text", "demo.py"),
        "--smoke",
        "--cache-dir",
        "cache",
    ],
}


#: lm-eval task YAMLs (not merge configs), with the test that runs each as the README does
LM_EVAL_TASKS = {
    "examples/eval/tiny_mc.yaml": "tests/test_evaluate.py::test_run_eval_puts_the_merge_results_on_its_card",
}


def _examples() -> list[str]:
    found = glob.glob(os.path.join(REPO_ROOT, "examples", "**", "*.y*ml"), recursive=True)
    return sorted(os.path.relpath(p, REPO_ROOT) for p in found if "_build" not in p)


def _demo_tiny_yamls() -> list[str]:
    """The YAMLs ``make demo-tiny`` runs (its recipe in the Makefile)."""
    with open(os.path.join(REPO_ROOT, "Makefile"), encoding="utf-8") as fp:
        recipe = re.search(r"^demo-tiny:.*\n((?:\t.*\n)+)", fp.read(), re.MULTILINE)
    assert recipe, "the Makefile has no demo-tiny target"
    return re.findall(r"examples/\S+\.ya?ml", recipe.group(1))


def _env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": REPO_ROOT + (os.pathsep + path if path else ""),
    }


def _run(command: list[str], cwd: str) -> str:
    done = subprocess.run(
        command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{output[-6000:]}"
    return output


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> str:
    """A folder with the repository's examples, Makefile and pyproject.toml linked in."""
    root = tmp_path_factory.mktemp("examples")
    os.makedirs(root / "examples")
    for name in os.listdir(os.path.join(REPO_ROOT, "examples")):
        if name != "_build":
            os.symlink(os.path.join(REPO_ROOT, "examples", name), root / "examples" / name)
    for name in ("Makefile", "pyproject.toml"):
        os.symlink(os.path.join(REPO_ROOT, name), root / name)
    return str(root)


@pytest.fixture(scope="module")
def tiny_experts(scratch) -> str:
    """The tiny experts, built as the README says (examples/_build/tiny in the scratch folder)."""
    _run([sys.executable, "examples/tiny/build_experts.py", "examples/_build/tiny"], scratch)
    return scratch


def test_every_example_runs_here():
    """Each YAML under examples/ is run by ``make demo-tiny``, by the per-YAML test below or
    by its script (:data:`DRIVEN`): a new example cannot be left out of CI."""
    examples = _examples()
    assert "examples/tiny/ace.yml" in examples
    covered = set(_demo_tiny_yamls()) | set(_tiny_yamls()) | set(DRIVEN) | set(LM_EVAL_TASKS)
    assert sorted(set(examples) - covered) == []
    for task, test in LM_EVAL_TASKS.items():  # the named test exists and reads that folder
        path, name = test.split("::")
        with open(os.path.join(REPO_ROOT, path), encoding="utf-8") as fp:
            source = fp.read()
        assert f"def {name}(" in source and os.path.dirname(task) in source, (task, test)
    assert set(DRIVEN) <= set(examples) and set(_demo_tiny_yamls()) <= set(examples)


def test_make_demo_tiny(scratch):
    """``make demo-tiny`` as the README gives it, with this environment's python and
    ``mergekit-ext`` (``BIN``) and its install step taken as done (``STAMP``)."""
    stamp = os.path.join(scratch, "installed")
    open(stamp, "w").close()  # newer than pyproject.toml and python: make installs nothing
    _run(["make", "--no-print-directory", "demo-tiny", f"BIN={BIN}", f"STAMP={stamp}"], scratch)
    for out in ("out/tiny-ace", "out/tiny-ties", "out/tiny-com"):
        assert os.path.isfile(os.path.join(scratch, out, "model.safetensors")), out


def _tiny_yamls() -> list[str]:
    """The tiny examples ``make demo-tiny`` does not run."""
    made = set(_demo_tiny_yamls())
    return [p for p in _examples() if p.startswith("examples/tiny/") and p not in made]


@pytest.mark.parametrize("example", _tiny_yamls())
def test_tiny_example(example, tiny_experts, tmp_path):
    out = str(tmp_path / "merged")
    _run([os.path.join(BIN, "mergekit-ext"), "run", example, out, "--overwrite"], tiny_experts)
    assert os.path.isfile(os.path.join(out, "model.safetensors"))


@pytest.mark.parametrize("example", sorted(DRIVEN))
def test_driven_example(example, scratch):
    """The MiniLM demo on its smallest setting: the smoke text suite's experts (one MiniLM
    layer, 4 training steps: built in seconds instead of the full demo's minutes), the
    template rendered and merged by ``mergekit-ext run``, the merged body scored."""
    output = _run(DRIVEN[example], scratch)
    assert "merge method: chain_of_merges" in output
    for task in ("bbc_news", "tweet_sentiment", "fine_food"):
        assert re.search(rf"^{task}\s+[\d.]+%\s+[\d.]+%\s+[\d.]+%", output, re.MULTILINE), task
