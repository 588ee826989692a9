"""Evaluation results on the model card (``mergekit-ext card --eval``): the JSON schema and its model-index."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from typing import Any

from huggingface_hub import EvalResult

from mergekit_ext.errors import ConfigError, ConfigFileNotFoundError

LOG = logging.getLogger(__name__)


# ------------------------------------------------------------------------------- eval


EVAL_RESULTS_SCHEMA = """\
A JSON list, one entry per task and dataset:

  [{"task": "text-classification",            # the task type (a Hub pipeline tag)
    "task_name": "Sentiment",                  # optional, readable
    "dataset": "stanfordnlp/sst2",             # Hub id or name; or an object:
    #   {"name": "SST-2", "type": "stanfordnlp/sst2", "config": "default",
    #    "split": "validation", "revision": "..."}
    "metrics": [{"type": "accuracy", "value": 0.91, "name": "Accuracy"}]}]
"""


def load_eval_results(path: str) -> list[dict[str, Any]]:
    """Read and validate an evaluation results file (schema: :data:`EVAL_RESULTS_SCHEMA`)."""
    try:
        with open(path, encoding="utf-8") as fp:
            data = json.load(fp)
    except FileNotFoundError as e:
        raise ConfigFileNotFoundError(f"evaluation results file not found: {path}") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON: {e}") from e
    eval_results_to_card(data, "check", where=path)  # validates
    return data


def eval_results_to_card(
    results: Any, model_name: str, where: str = "eval results"
) -> list[EvalResult]:
    """Turn the documented eval schema into ``huggingface_hub.EvalResult`` objects."""
    if not isinstance(results, list):
        raise ConfigError(f"{where}: expected a JSON list of results\n{EVAL_RESULTS_SCHEMA}")
    out: list[EvalResult] = []
    for i, entry in enumerate(results):
        here = f"{where}: entry {i}"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{here}: expected an object with task, dataset and metrics")
        task = entry.get("task")
        if not isinstance(task, str) or not task:
            raise ConfigError(
                f"{here}: 'task' (a task type such as text-classification) is required"
            )
        dataset = entry.get("dataset")
        if isinstance(dataset, str) and dataset:
            dataset = {"name": dataset, "type": dataset}
        if not isinstance(dataset, Mapping) or not (dataset.get("name") or dataset.get("type")):
            raise ConfigError(f"{here}: 'dataset' must be a name or an object with name/type")
        metrics = entry.get("metrics")
        if not isinstance(metrics, list) or not metrics:
            raise ConfigError(f"{here}: 'metrics' must be a non-empty list of {{type, value}}")
        for j, metric in enumerate(metrics):
            if not isinstance(metric, Mapping) or not metric.get("type"):
                raise ConfigError(f"{here}: metrics[{j}] needs a 'type' (e.g. accuracy)")
            value = metric.get("value")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(
                    f"{here}: metrics[{j}] ('{metric['type']}') needs a numeric 'value'"
                )
            if not math.isfinite(float(value)):
                raise ConfigError(f"{here}: metrics[{j}] ('{metric['type']}') value is not finite")
            out.append(
                EvalResult(
                    task_type=task,
                    task_name=entry.get("task_name"),
                    dataset_type=str(dataset.get("type") or dataset.get("name")),
                    dataset_name=str(dataset.get("name") or dataset.get("type")),
                    dataset_config=dataset.get("config"),
                    dataset_split=dataset.get("split"),
                    dataset_revision=dataset.get("revision"),
                    metric_type=str(metric["type"]),
                    metric_value=value,
                    metric_name=metric.get("name"),
                )
            )
    return out
