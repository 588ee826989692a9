"""lm-evaluation-harness on merged models, their base and their experts, through its Python API.

``pip install 'mergekit-ext[eval]'`` installs ``lm-eval`` (0.4.x). Each model runs through
``lm_eval.simple_evaluate`` with lm-eval's own ``hf`` model class (so the numbers are the ones
``lm_eval --model hf`` gives), the tasks from a ``TaskManager`` that also reads the user's
task YAMLs (``include_path``: local or private data, no download), and lm-eval's own
``EvaluationTracker`` writes each model's results JSON exactly as lm-eval's CLI writes it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, Optional, Union

from tqdm.auto import tqdm

from mergekit_ext.console import phase
from mergekit_ext.errors import ConfigError, NotSupportedError
from mergekit_ext.evaluate.targets import EvalTarget

LOG = logging.getLogger(__name__)

#: what a results entry keeps of a task's config: where its data came from, nothing local
_CONFIG_KEYS = ("task", "dataset_path", "dataset_name", "test_split", "validation_split")
#: the run's own fields of lm-eval's results dict that the card reads
_RESULT_KEYS = ("results", "groups", "versions", "n-shot", "n-samples", "higher_is_better")


def lm_eval_module() -> Any:
    """``lm_eval``, or one error that says how to install it."""
    try:
        import lm_eval
    except ImportError as e:
        raise NotSupportedError(
            "`mergekit-ext eval --tasks` runs lm-evaluation-harness, which is not installed: "
            "pip install 'mergekit-ext[eval]' (or pip install 'lm-eval>=0.4.9,<0.5')"
        ) from e
    return lm_eval


def task_manager(tasks: Sequence[str], include_path: Sequence[str] = ()) -> Any:
    """A ``TaskManager`` that knows every task of ``tasks``; one clear error otherwise.

    Indexing lm-eval's own few thousand task YAMLs takes a minute on a slow disk, so when
    every task is one of the user's (``include_path``) only those folders are indexed.
    """
    lm_eval_module()
    from lm_eval.tasks import TaskManager

    for folder in include_path:
        if not os.path.exists(folder):
            raise ConfigError(f"--include-path {folder}: no such file or folder of task YAMLs")
    paths = [os.path.abspath(p) for p in include_path]
    if paths:
        local = TaskManager(include_path=paths, include_defaults=False)
        if set(tasks) <= set(local.all_tasks):
            return local  # otherwise some task is one of lm-eval's own: index those too
    manager = TaskManager(include_path=paths or None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" or in {', '.join(include_path)}" if include_path else ""
        raise ConfigError(
            f"unknown lm-eval task(s) {', '.join(unknown)}: not among lm-eval's tasks{where}; "
            "check the name (`lm_eval ls tasks`) or give the folder of your task YAML with "
            "--include-path"
        )
    return manager


def _model_args(target: EvalTarget, dtype: Optional[str]) -> dict[str, Any]:
    args: dict[str, Any] = {"pretrained": target.path}
    if target.adapter:
        args["peft"] = target.adapter
    if target.revision:
        args["revision"] = target.revision
    if dtype:
        args["dtype"] = dtype
    return args


def summarize_results(results: dict[str, Any]) -> dict[str, Any]:
    """The part of lm-eval's results dict a table and a card need, with no local path:
    metrics, task versions, shots, sample counts, each task's data source, lm-eval's
    version and ``limit``."""
    out: dict[str, Any] = {k: results[k] for k in _RESULT_KEYS if k in results}
    configs = {}
    for task, config in (results.get("configs") or {}).items():
        kept = {k: config[k] for k in _CONFIG_KEYS if config.get(k) is not None}
        files = (config.get("dataset_kwargs") or {}).get("data_files")
        if files:  # local data: its file names only, never the folders
            if isinstance(files, dict):
                files = {split: _basenames(v) for split, v in files.items()}
            kept["dataset_kwargs"] = {"data_files": _basenames(files)}
        configs[task] = kept
    out["configs"] = configs
    out["config"] = {"limit": (results.get("config") or {}).get("limit")}
    out["lm_eval_version"] = results.get("lm_eval_version")
    return out


def _basenames(files: Any) -> Any:
    if isinstance(files, dict):
        return {k: _basenames(v) for k, v in files.items()}
    if isinstance(files, (list, tuple)):
        return [os.path.basename(str(f)) for f in files]
    return os.path.basename(str(files))


def run_lm_eval(
    targets: Sequence[EvalTarget],
    tasks: Sequence[str],
    output_dir: str,
    *,
    include_path: Sequence[str] = (),
    limit: Optional[Union[int, float]] = None,
    num_fewshot: Optional[int] = None,
    batch_size: Union[int, str] = 1,
    device: str = "cpu",
    dtype: Optional[str] = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Evaluate each target on ``tasks``; lm-eval's own results JSON of each is written to
    ``output_dir`` (``<role>-<name>_<date>.json``). Returns one entry per target:
    ``{"name", "role", "results_file", "lm_eval": summarize_results(...)}``."""
    lm_eval = lm_eval_module()
    from lm_eval.loggers import EvaluationTracker

    if not tasks:
        raise ConfigError("give the lm-eval tasks to run: --tasks TASK1,TASK2")
    manager = task_manager(tasks, include_path)
    os.makedirs(output_dir, exist_ok=True)
    entries = []
    bar = tqdm(targets, desc="models", unit="model", disable=len(targets) < 2)
    for target in bar:
        phase(f"lm-eval: {target.label} on {', '.join(tasks)}")
        tracker = EvaluationTracker(
            output_path=os.path.join(output_dir, f"{target.file_stem}.json")
        )
        results = lm_eval.simple_evaluate(
            model="hf",
            model_args=_model_args(target, dtype),
            tasks=list(tasks),
            num_fewshot=num_fewshot,
            batch_size=batch_size,
            device=device,
            limit=limit,
            task_manager=manager,
            evaluation_tracker=tracker,
            log_samples=False,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
        if results is None:  # only a non-zero rank of a multi-process run gets None
            continue
        tracker.save_results_aggregated(results=results, samples=None)
        # the tracker names the file <stem>_<date_id>.json (lm-eval's own naming)
        written = os.path.join(output_dir, f"{target.file_stem}_{tracker.date_id}.json")
        entries.append(
            {
                "name": target.name,
                "role": target.role,
                "results_file": written if os.path.isfile(written) else None,
                "lm_eval": summarize_results(results),
            }
        )
    return entries
