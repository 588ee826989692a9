"""``mergekit-ext eval``: benchmark numbers for a merge beside its base and experts.

- :mod:`.harness`: lm-evaluation-harness through its Python API (causal LMs; ``--tasks``);
- :mod:`.classification`: accuracy of encoders and image classifiers on labelled data, with
  the experts' own heads (``--data``);
- :mod:`.scoring`: the accuracy functions (shared with the benchmark suites);
- :mod:`.targets`: which models run (the merged folders; with ``--with-inputs`` the config's
  base model and experts).

:func:`evaluate` writes one results file (:data:`RESULTS_FORMAT`) that ``mergekit-ext card
--eval`` reads; lm-eval's own results JSON of each model is written beside it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any, Optional, Union

from mergekit_ext.errors import ConfigError
from mergekit_ext.evaluate.targets import EvalTarget, eval_targets
from mergekit_ext.merge_record import EVAL_FILENAME, jsonable
from mergekit_ext.output import write_file

#: the ``format`` field of the results file ``evaluate`` writes (read by ``card --eval``)
RESULTS_FORMAT = "mergekit-ext-eval"


def parse_data_args(values: Sequence[str]) -> dict[str, str]:
    """``--data [TASK=]PATH`` values → task name → source (a lone path is task ``data``)."""
    out: dict[str, str] = {}
    for value in values:
        task, sep, path = value.partition("=")
        if not sep or os.path.exists(value):
            task, path = "", value
        task = task or (os.path.splitext(os.path.basename(os.path.normpath(path)))[0] or "data")
        if task in out:
            raise ConfigError(f"--data names task {task!r} twice; give TASK=PATH once per task")
        out[task] = path
    return out


def evaluate(
    model_dirs: Sequence[str],
    *,
    tasks: Sequence[str] = (),
    data: Sequence[str] = (),
    with_inputs: Optional[str] = None,
    output: str = "eval_results.json",
    include_path: Sequence[str] = (),
    limit: Optional[Union[int, float]] = None,
    num_fewshot: Optional[int] = None,
    batch_size: Union[int, str] = 8,
    device: str = "cpu",
    dtype: Optional[str] = None,
    split: Optional[str] = None,
    text_field: Optional[str] = None,
    label_field: Optional[str] = None,
    image_field: Optional[str] = None,
) -> dict[str, Any]:
    """Evaluate merged folders (and with ``with_inputs`` the config's base and experts):
    lm-eval ``tasks`` and/or classification accuracy on labelled ``data``; writes ``output``
    and returns its content."""
    if not tasks and not data:
        raise ConfigError(
            "nothing to evaluate: give lm-eval tasks (--tasks T1,T2) for causal LMs, or "
            "labelled data (--data [TASK=]FILE_OR_FOLDER) for classifiers"
        )
    targets = eval_targets(list(model_dirs), with_inputs)
    result: dict[str, Any] = {
        "format": RESULTS_FORMAT,
        "version": 1,
        "limit": limit,
        "models": [{"name": t.name, "role": t.role} for t in targets],
    }
    by_name: dict[tuple[str, str], dict[str, Any]] = {
        (m["role"], m["name"]): m for m in result["models"]
    }
    if tasks:
        from mergekit_ext.evaluate.harness import lm_eval_module, run_lm_eval

        folder = os.path.splitext(output)[0] + "_lm_eval"
        entries = run_lm_eval(
            targets,
            list(tasks),
            folder,
            include_path=include_path,
            limit=limit,
            num_fewshot=num_fewshot,
            batch_size=batch_size,
            device=device,
            dtype=dtype,
        )
        result["harness"] = {
            "name": "lm-evaluation-harness",
            "version": lm_eval_module().__version__,
        }
        result["tasks"] = list(tasks)
        result["local_task_files"] = bool(include_path)
        base = os.path.dirname(os.path.abspath(output))
        for entry in entries:
            model = by_name[(entry["role"], entry["name"])]
            model["lm_eval"] = entry["lm_eval"]
            if entry["results_file"]:
                model["results_file"] = os.path.relpath(entry["results_file"], base)
    if data:
        from mergekit_ext.evaluate.classification import load_labelled, run_classification

        sources = parse_data_args(data)
        experts = {t.name for t in targets if t.role == "expert"}
        if experts:
            unknown = sorted(set(sources) - experts)
            if unknown:
                raise ConfigError(
                    f"--data task(s) {', '.join(unknown)} are not experts of {with_inputs} "
                    f"({', '.join(sorted(experts))}): write --data EXPERT=PATH so that each "
                    "task is scored with its expert's head"
                )
        labelled = {
            task: load_labelled(
                path,
                split=split,
                text_field=text_field,
                label_field=label_field,
                image_field=image_field,
                limit=int(limit) if limit is not None and limit >= 1 else None,
            )
            for task, path in sources.items()
        }
        for entry in run_classification(
            targets,
            labelled,
            batch_size=int(batch_size) if str(batch_size).isdigit() else 32,
            device=device,
        ):
            by_name[(entry["role"], entry["name"])]["classification"] = entry["classification"]
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    write_file(output, json.dumps(jsonable(result), indent=2) + "\n")
    return result


__all__ = ["RESULTS_FORMAT", "EvalTarget", "eval_targets", "evaluate", "parse_data_args"]


def check_lm_eval_tasks(tasks: Sequence[str], include_path: Sequence[str] = ()) -> None:
    """Before a merge that ``run --eval`` evaluates: lm-eval is installed and knows every
    task (a typo found after an hour of merging would cost the hour)."""
    from mergekit_ext.evaluate.harness import task_manager

    task_manager(list(tasks), list(include_path))


def evaluate_into_folder(
    folder: str,
    name: str,
    tasks: Sequence[str],
    *,
    include_path: Sequence[str] = (),
    limit: Optional[Union[int, float]] = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """``run --eval``: lm-eval ``tasks`` on the merged model in ``folder`` (the run's
    temporary folder), its results saved there as :data:`EVAL_FILENAME` for the card.

    lm-eval's own per-model JSON names the model by its path, so it is written to a
    temporary folder and left out: nothing local goes into the folder ``publish`` uploads.
    The merge is named ``name`` (the output folder's name), not the temporary folder's.
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix="mergekit-ext-eval-") as scratch:
        result = evaluate(
            [folder],
            tasks=tasks,
            output=os.path.join(scratch, "results.json"),
            include_path=include_path,
            limit=limit,
            device=device,
        )
    for model in result["models"]:
        model.pop("results_file", None)
        if model["role"] == "merge":
            model["name"] = name
    write_file(os.path.join(folder, EVAL_FILENAME), json.dumps(jsonable(result), indent=2) + "\n")
    return result
