"""The import rules of docs/architecture.md, checked on the source (``ast``, nothing imported).

Every import of a mergekit_ext module counts, wherever it is written: at module level (also
inside ``try``/``if``), inside a function, and under ``if TYPE_CHECKING:``. A deferred or
type-only import still says that one module knows another; a circle through one is a circle
of the design even when Python never runs it (issue #53).

* No import circles among mergekit_ext modules.
* Layers: a module may import its own layer and the layers below it, never a higher one
  (:data:`LAYERS`).
* ``hub/`` reads only the lowest layer, the method registry and the config schema
  (:data:`HUB_MAY_READ`).

Importing a subpackage one is inside of (``from mergekit_ext.models.families import
register_family`` in ``families/clip.py``) is no edge: Python has loaded every ancestor package
before the module runs. The root package is the exception: its ``__init__`` is the front file
(layer 7, it wires the API), so ``from mergekit_ext import X`` in a lower module is an upward
import (the version lives in ``mergekit_ext/_version.py``, layer 0). Where today's code breaks
a rule, the import is listed in :data:`KNOWN_EXCEPTIONS` (or the circle in
:data:`KNOWN_CIRCLES`) with the reason, so that this test passes and any new violation fails.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

import mergekit_ext
from benchmarks import merge_hashes

PACKAGE_DIR = os.path.dirname(mergekit_ext.__file__)

#: (module-name prefix, layer); the longest matching prefix wins. Lower numbers are lower layers:
#: errors/merge_record <- models <- calibration <- methods <- executor/adaptation <- runner <- cli.
LAYERS: tuple[tuple[str, int], ...] = (
    # 0: errors, the merge record and the other leaf utilities every layer may use
    ("mergekit_ext.errors", 0),
    ("mergekit_ext._version", 0),
    ("mergekit_ext.merge_record", 0),
    ("mergekit_ext.plots", 0),
    ("mergekit_ext.merge_inputs", 0),
    ("mergekit_ext.yaml_input", 0),
    ("mergekit_ext.finite", 0),
    ("mergekit_ext.kl", 0),
    ("mergekit_ext.bf16_products", 0),
    ("mergekit_ext.wide_sums", 0),
    ("mergekit_ext.console", 0),
    ("mergekit_ext.offline", 0),
    ("mergekit_ext.memory_model", 0),
    ("mergekit_ext.resources", 0),
    ("mergekit_ext.output", 0),
    ("mergekit_ext.distributed", 0),
    ("mergekit_ext.testing", 0),
    # 1: everything that reads a model or checkpoint
    ("mergekit_ext.models", 1),
    # 2: calibration data and the user's configuration
    ("mergekit_ext.calibration", 2),
    ("mergekit_ext.config", 2),
    # 3: the methods (declarations and pure math)
    ("mergekit_ext.methods", 3),
    # 4: the executor (block walker, plan, diagnose) and test-time adaptation, side by side
    ("mergekit_ext.executor", 4),
    ("mergekit_ext.adaptation", 4),
    # 5: the runner and its one validation pass
    ("mergekit_ext.runner", 5),
    ("mergekit_ext.checks", 5),
    ("mergekit_ext.preflight", 5),  # every check before a weight loads, in one pass
    ("mergekit_ext.diagnose", 5),  # the post-merge check: walks models with the executor's blocks
    ("mergekit_ext.evaluate", 5),  # `eval`: lm-eval and classifier accuracy on merged models
    # 6: the hub wing (only runner and cli above it reach it; what it reads: HUB_MAY_READ)
    ("mergekit_ext.hub", 6),
    # 7: the entry points
    ("mergekit_ext.api", 7),
    ("mergekit_ext.cli", 7),
    ("mergekit_ext.cli_hub", 7),  # the card and publish commands
    ("mergekit_ext.cli_eval", 7),  # the eval command
    ("mergekit_ext.__main__", 7),
    ("mergekit_ext", 7),  # the package's __init__ (registers the methods, exports the API)
)

#: what hub/ may import besides itself: the lowest layer, the method registry, the config schema
HUB_MAY_READ = (
    "mergekit_ext.methods.registry",
    # the schema of the user's YAML: `card OUT` and `publish OUT` describe an existing output
    # folder from the config copy it holds (models, calibration, parameters), so the hub must
    # parse that file as the runner does; the schema computes nothing and imports no executor
    "mergekit_ext.config",
)

#: (importer, imported) pairs that break a rule today; a new entry needs a reason here.
KNOWN_EXCEPTIONS: frozenset[tuple[str, str]] = frozenset({})


def _modules() -> dict[str, str]:
    """Module name -> file path for every module of the package."""
    out = {}
    root = os.path.dirname(PACKAGE_DIR)
    for dirpath, _dirs, files in os.walk(PACKAGE_DIR):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                module = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                out[module.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str:
    """The longest prefix of ``name`` that is a module of the package ('' when none)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _targets(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [_resolve(alias.name) for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    base = node.module or ""
    if node.level:
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    # ``from pkg import sub``: the edge is to ``pkg.sub`` when that is a module
    return [
        f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else _resolve(base)
        for alias in node.names
    ]


#: where an import is written
MODULE_LEVEL, IN_FUNCTION, TYPE_ONLY = "module", "function", "type-checking"


def _imports(module: str) -> Iterator[tuple[str, str]]:
    """(imported module, where) for every mergekit_ext import of ``module``; ``where`` is
    :data:`MODULE_LEVEL`, :data:`IN_FUNCTION` or :data:`TYPE_ONLY`."""
    path = MODULES[module]
    with open(path, encoding="utf-8") as fp:
        tree = ast.parse(fp.read(), path)
    is_package = path.endswith("__init__.py")

    def walk(node: ast.AST, where: str) -> Iterator[tuple[str, str]]:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                inner = TYPE_ONLY
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and where != TYPE_ONLY:
                inner = IN_FUNCTION
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in _targets(child, module, is_package):
                    if target and not _is_loaded_ancestor(module, target):
                        yield target, where
            yield from walk(child, inner)

    yield from walk(tree, MODULE_LEVEL)


def _is_loaded_ancestor(module: str, target: str) -> bool:
    """The module itself, or a subpackage it is inside of (loaded before it runs); the root
    package's ``__init__`` (the front file, layer 7) counts as an import like any other."""
    if module == target:
        return True
    return module.startswith(target + ".") and target != "mergekit_ext"


def _edges() -> dict[str, set[str]]:
    """Every module's imports of the package's modules, wherever they are written."""
    return {module: {t for t, _ in _imports(module)} for module in MODULES}


def _layer(module: str) -> int:
    best = max((p for p, _ in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return dict(LAYERS)[best]


def _is_base(module: str) -> bool:
    return _layer(module) == 0


def test_every_module_has_a_layer():
    for module in MODULES:
        assert any(module == p or module.startswith(p + ".") for p, _ in LAYERS), module


#: circles the code still has, each with the reason and the step that removes it
KNOWN_CIRCLES: frozenset[frozenset[str]] = frozenset()


def _circles() -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    graph = _edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_import_circles():
    """No circle, counting function-level and ``TYPE_CHECKING`` imports too."""
    new = [c for c in _circles() if frozenset(c) not in KNOWN_CIRCLES]
    assert not new, f"import circles: {new}"


def test_known_circles_are_still_there():
    """A circle the code no longer has is deleted from the list, not kept."""
    found = {frozenset(c) for c in _circles()}
    stale = [sorted(c) for c in KNOWN_CIRCLES if c not in found]
    assert not stale, f"no longer a circle, remove from KNOWN_CIRCLES: {stale}"


def test_function_level_and_type_checking_imports_are_counted():
    """The graph holds the imports written inside functions and under ``TYPE_CHECKING``."""
    where = {target: w for target, w in _imports("mergekit_ext.runner")}
    assert where["mergekit_ext.executor"] == IN_FUNCTION  # _run_layerwise imports it late
    assert "mergekit_ext.executor" in _edges()["mergekit_ext.runner"]
    typed = [(m, t) for m in MODULES for t, w in _imports(m) if w == TYPE_ONLY]
    assert typed, "no TYPE_CHECKING import found: the walk no longer sees them"
    assert all(t in _edges()[m] for m, t in typed)


def test_the_root_package_is_an_edge_and_a_subpackage_is_not():
    assert _is_loaded_ancestor("mergekit_ext.models.families.clip", "mergekit_ext.models.families")
    assert not _is_loaded_ancestor("mergekit_ext.merge_record", "mergekit_ext")
    assert _layer("mergekit_ext") == 7 and _layer("mergekit_ext._version") == 0


def _violations() -> list[tuple[str, str]]:
    out = []
    for module, targets in _edges().items():
        for target in sorted(targets):
            if module.startswith("mergekit_ext.hub") and not target.startswith("mergekit_ext.hub"):
                allowed = _is_base(target) or target in HUB_MAY_READ
            else:
                allowed = _layer(target) <= _layer(module)
            if not allowed:
                out.append((module, target))
    return out


def test_no_upward_imports_beyond_the_known_exceptions():
    new = [pair for pair in _violations() if pair not in KNOWN_EXCEPTIONS]
    assert not new, (
        "imports from a lower layer to a higher one (docs/architecture.md): "
        + ", ".join(f"{a} -> {b}" for a, b in new)
    )


def test_known_exceptions_are_still_needed():
    """An exception that the code no longer needs is deleted from the list, not kept."""
    stale = sorted(KNOWN_EXCEPTIONS - set(_violations()))
    assert not stale, f"no longer violated, remove from KNOWN_EXCEPTIONS: {stale}"


@pytest.mark.parametrize(
    "module, target, upward",
    [
        ("mergekit_ext.calibration.sources.models", "mergekit_ext.models.model_paths", False),
        ("mergekit_ext.methods.layerwise", "mergekit_ext.calibration.statistics", False),
        ("mergekit_ext.merge_record", "mergekit_ext.methods.registry", True),
        ("mergekit_ext.methods.qp_solve", "mergekit_ext.executor.plan", True),
    ],
)
def test_layer_order(module, target, upward):
    """The rule itself: a lower layer reaching up is a violation, down is not."""
    assert (_layer(target) > _layer(module)) is upward


HASHES = os.path.join(os.path.dirname(PACKAGE_DIR), "benchmarks", "merge_hashes.json")


def test_merge_hashes_match_the_recorded_ones():
    """Two of the eight harness merges (benchmarks/merge_hashes.py) give the bytes recorded
    for this environment: library versions, CPU and kernel variables, one record each in
    benchmarks/merge_hashes.json (the kernels, and so the bytes, differ per CPU).

    The full check (all eight, < 30 s on one core) after a refactor:
    ``python -m benchmarks.merge_hashes --check benchmarks/merge_hashes.json``.
    """
    environment = merge_hashes.environment()
    expected = merge_hashes.recorded(HASHES, environment)
    if expected is None:
        pytest.skip(
            f"no merge hashes recorded for {environment} (test_merge_hashes_do_not_depend_on_"
            "the_process checks this machine): `python -m benchmarks.merge_hashes --write "
            "benchmarks/merge_hashes.json` on an unchanged commit records them"
        )
    # a record lacks the cases a change meant to alter until that machine re-records them
    names = [name for name in ("ties", "regmean") if name in expected]
    if not names:
        pytest.skip(f"ties and regmean are not recorded for {environment}: re-record them there")
    results = merge_hashes.run_cases(names)
    assert results == {name: expected[name] for name in names}


def test_merge_hashes_do_not_depend_on_the_process(tmp_path):
    """Byte-identity on every machine, recorded or not: the eight harness merges give the
    same bytes here and in a fresh process with another hash seed (set and dict orders of
    strings change with it). A merge whose bytes depend on such an order, on leftover state
    or on timing could not pass the recorded check on any machine."""
    here = merge_hashes.run_cases(list(merge_hashes.CASES))
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    out = tmp_path / "hashes.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.merge_hashes", "--write", str(out)],
        cwd=os.path.dirname(PACKAGE_DIR),
        env={**os.environ, "PYTHONHASHSEED": seed},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    [record] = merge_hashes.load_records(str(out))
    assert record["hashes"] == here
    assert set(here) == set(merge_hashes.CASES) and all(here.values())
