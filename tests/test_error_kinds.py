"""Our errors are also the built-in exceptions mergekit raises in the same situation
(issue #48 item 4), so ``except ValueError`` around a merge keeps catching a bad config.

mergekit 0.1.5's ``test_della_invalid_epsilon`` (tests/test_basic_merges.py) expects a
``ValueError`` for della with ``epsilon: 1.35``; through :func:`mergekit_ext.run_merge` the
same config must raise one too, and the CLI must still print each of our errors on one line.
"""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

import mergekit_ext
from mergekit_ext.adaptation.memory import AdaptationMemoryError
from mergekit_ext.console import cli_errors
from mergekit_ext.distributed import DistributedError
from mergekit_ext.errors import (
    CalibrationError,
    CalibrationFileNotFoundError,
    ConfigError,
    ConfigFileNotFoundError,
    ExecutionError,
    MergekitExtError,
    ModelInputError,
    ModelNotFoundError,
    NotSupportedError,
    PluginError,
    PublishError,
    TensorError,
)
from mergekit_ext.executor.model_output_checks import ModelOutputMemoryError
from mergekit_ext.hub.card.render import CardError
from mergekit_ext.output import OutputError

# class -> the built-in(s) mergekit (or the library it calls) raises in the same situation
BUILTINS: dict[type[MergekitExtError], tuple[type[BaseException], ...]] = {
    ConfigError: (ValueError,),
    ConfigFileNotFoundError: (ValueError, FileNotFoundError),
    CalibrationError: (ValueError,),
    CalibrationFileNotFoundError: (ValueError, FileNotFoundError),
    TensorError: (ValueError,),
    ModelInputError: (RuntimeError,),
    ModelNotFoundError: (RuntimeError, FileNotFoundError),
    ExecutionError: (RuntimeError,),
    PluginError: (RuntimeError,),
    DistributedError: (RuntimeError,),
    NotSupportedError: (NotImplementedError,),
    PublishError: (OSError,),
    OutputError: (OSError,),
    CardError: (FileExistsError,),
    AdaptationMemoryError: (MemoryError,),
    ModelOutputMemoryError: (MemoryError,),
}


def _all_subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _all_subclasses(sub)
    return out


@pytest.mark.parametrize("cls", list(BUILTINS), ids=lambda c: c.__name__)
def test_each_error_is_its_builtin_and_ours(cls: type[MergekitExtError]) -> None:
    error = cls("model ./a: something is wrong; do this")
    assert isinstance(error, MergekitExtError)
    for builtin in BUILTINS[cls]:
        assert isinstance(error, builtin), builtin
    assert str(error) == "model ./a: something is wrong; do this"  # OSError's too


def test_every_error_class_has_a_builtin_kind() -> None:
    # a new error class must say which built-in it is (and be listed above)
    import mergekit_ext.calibration.sources.sampling  # noqa: F401  (its subclass)

    classes = {
        c for c in _all_subclasses(MergekitExtError) if c.__module__.startswith("mergekit_ext")
    }
    unlisted = {c.__name__ for c in classes if not any(issubclass(c, k) for k in BUILTINS)}
    assert not unlisted


def test_della_invalid_epsilon_is_a_value_error(tiny_llama_set, tmp_path) -> None:
    # mergekit's test_della_invalid_epsilon, through our entry point
    config = {
        "merge_method": "della",
        "base_model": tiny_llama_set.base,
        "models": [
            {"model": tiny_llama_set.experts[0], "parameters": {"weight": 1.0}},
            {"model": tiny_llama_set.experts[1], "parameters": {"weight": 1.0}},
        ],
        "parameters": {"density": 0.66, "epsilon": 1.35, "lambda": 0.5},
        "dtype": "bfloat16",
    }
    try:
        mergekit_ext.run_merge(config, str(tmp_path / "out"), {"random_seed": 0})
    except ValueError as e:
        assert isinstance(e, ConfigError)
        assert "epsilon" in str(e) and "1.35" in str(e)
    else:
        pytest.fail("della with epsilon 1.35 merged")
    assert not (tmp_path / "out").exists()


def test_a_missing_model_is_a_file_not_found_error(tiny_llama_set, tmp_path) -> None:
    config = {
        "merge_method": "linear",
        "models": [
            {"model": tiny_llama_set.base, "parameters": {"weight": 1.0}},
            {"model": str(tmp_path / "no-such-model"), "parameters": {"weight": 1.0}},
        ],
    }
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        mergekit_ext.run_merge(config, str(tmp_path / "out"))
    with pytest.raises(FileNotFoundError, match="missing.yml"):
        mergekit_ext.run_merge(str(tmp_path / "missing.yml"), str(tmp_path / "out"))


@pytest.mark.parametrize("cls", list(BUILTINS), ids=lambda c: c.__name__)
def test_the_cli_prints_each_error_on_one_line(cls: type[MergekitExtError]) -> None:
    @click.command()
    @cli_errors(lambda kwargs: 0)
    def fail() -> None:
        raise cls("output ./out: what went wrong; what to do")

    result = CliRunner().invoke(fail, [])
    assert result.exit_code == 1
    assert result.output == "error: output ./out: what went wrong; what to do\n"
