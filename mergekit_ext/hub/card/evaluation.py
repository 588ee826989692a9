"""Evaluation results on the model card (``mergekit-ext card --eval``): the files it reads,
the card's table and its ``model-index``.

Three shapes are read (:func:`read_eval_results`):

- the results file of ``mergekit-ext eval`` (``"format": "mergekit-ext-eval"``): lm-eval and/or
  classification results of the merge, its base model and each expert;
- lm-evaluation-harness's own results JSON (``results_<date>.json`` of ``lm_eval
  --output_path``, or the files ``mergekit-ext eval`` writes beside its own): the merge's;
- our hand-written list (:data:`EVAL_RESULTS_SCHEMA`).

Only the merge's own numbers go into the ``model-index`` (the Hub's metadata is about this
model); the base model and the experts are columns of the card's table. Every number that
used ``--limit`` (fewer examples than the task has) or a task reading local data is labelled
so on both.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from huggingface_hub import EvalResult

from mergekit_ext.errors import ConfigError, ConfigFileNotFoundError

LOG = logging.getLogger(__name__)

#: the ``format`` of the file ``mergekit-ext eval`` writes (``mergekit_ext.evaluate``, a layer
#: below the hub wing, which therefore cannot import it from there)
EVAL_FORMAT = "mergekit-ext-eval"
HARNESS_URL = "https://github.com/EleutherAI/lm-evaluation-harness"
#: ``datasets`` builders that read files rather than a Hub dataset
_LOCAL_BUILDERS = frozenset(
    {"json", "csv", "parquet", "text", "arrow", "pandas", "imagefolder", "audiofolder"}
)

EVAL_RESULTS_SCHEMA = """\
A JSON list, one entry per task and dataset:

  [{"task": "text-classification",            # the task type (a Hub pipeline tag)
    "task_name": "Sentiment",                  # optional, readable
    "dataset": "stanfordnlp/sst2",             # Hub id or name; or an object:
    #   {"name": "SST-2", "type": "stanfordnlp/sst2", "config": "default",
    #    "split": "validation", "revision": "..."}
    "metrics": [{"type": "accuracy", "value": 0.91, "name": "Accuracy"}]}]
"""

EVAL_FILES_HELP = f"""\
--eval reads one of:
  - the results file of `mergekit-ext eval` ({{"format": "{EVAL_FORMAT}", "models": [...]}});
  - lm-evaluation-harness's results JSON (results_<date>.json: {{"results": ..., "versions": ...,
    "n-shot": ..., "configs": ..., "lm_eval_version": ...}}), the merge's own numbers;
  - {EVAL_RESULTS_SCHEMA}"""


@dataclass
class EvalRow:
    """One metric of one task: its value per model of the table."""

    task: str
    metric: str
    values: dict[str, Optional[float]] = field(default_factory=dict)
    stderr: dict[str, Optional[float]] = field(default_factory=dict)
    dataset: str = ""
    split: str = ""
    version: Optional[str] = None
    n_shot: Optional[int] = None
    samples: Optional[str] = None  # "20" or "20 of 1172" (with --limit)
    local: bool = False
    limited: bool = False


@dataclass
class EvalReport:
    """What the card shows: a table (``columns`` × ``rows``), the merge's ``model_index``,
    and the notes under the table."""

    columns: list[str]
    rows: list[EvalRow]
    model_index: list[EvalResult]
    harness: Optional[str] = None  # "lm-evaluation-harness 0.4.13"
    limit: Any = None
    notes: list[str] = field(default_factory=list)
    legacy: bool = False  # our hand-written list: the card keeps its one-model table

    @property
    def any_local(self) -> bool:
        return any(r.local for r in self.rows)

    @property
    def any_limited(self) -> bool:
        return any(r.limited for r in self.rows)


def load_eval_results(path: str) -> Any:
    """Read and validate an evaluation results file (any shape :func:`read_eval_results`
    takes); returns the parsed JSON."""
    try:
        with open(path, encoding="utf-8") as fp:
            data = json.load(fp)
    except FileNotFoundError as e:
        raise ConfigFileNotFoundError(f"evaluation results file not found: {path}") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON: {e}") from e
    read_eval_results(data, "check", where=path)  # validates
    return data


def is_lm_eval_results(data: Any) -> bool:
    """``data`` is one results dict of lm-evaluation-harness (``simple_evaluate``'s return
    value as its tracker saves it)."""
    return (
        isinstance(data, Mapping)
        and isinstance(data.get("results"), Mapping)
        and any(k in data for k in ("versions", "n-shot", "configs", "lm_eval_version"))
    )


def read_eval_results(data: Any, model_name: str, where: str = "eval results") -> EvalReport:
    """Any accepted results shape → the card's table and the merge's model-index."""
    if isinstance(data, list):
        index = eval_results_to_card(data, model_name, where)
        rows = [
            EvalRow(
                task=r.task_name or r.task_type,
                metric=r.metric_name or r.metric_type,
                values={model_name: float(r.metric_value)},
                dataset=r.dataset_name,
                split=r.dataset_split or "",
            )
            for r in index
        ]
        return EvalReport(columns=[model_name], rows=rows, model_index=index, legacy=True)
    if isinstance(data, Mapping) and data.get("format") == EVAL_FORMAT:
        return _read_ours(data, model_name, where)
    if is_lm_eval_results(data):
        report = EvalReport(columns=[model_name], rows=[], model_index=[])
        _add_lm_eval(report, data, model_name, merge=True, where=where)
        _finish(report, data.get("lm_eval_version"))
        return report
    raise ConfigError(
        f"{where}: not an evaluation results file mergekit-ext reads", details=EVAL_FILES_HELP
    )


def _label(model: Mapping[str, Any]) -> str:
    role = model.get("role")
    return str(model["name"]) if role == "merge" else f"{model['name']} ({role})"


def _read_ours(data: Mapping[str, Any], model_name: str, where: str) -> EvalReport:
    models = data.get("models")
    if not isinstance(models, list) or not models:
        raise ConfigError(f"{where}: 'models' must be a non-empty list", details=EVAL_FILES_HELP)
    for i, model in enumerate(models):
        if not isinstance(model, Mapping) or not model.get("name") or not model.get("role"):
            raise ConfigError(f"{where}: models[{i}] needs a 'name' and a 'role'")
    merges = [m for m in models if m.get("role") == "merge"]
    if not merges:
        raise ConfigError(f"{where}: no model with role 'merge' (the card's own numbers)")
    # the card's model: the merged folder of that name, else the only (or first) merge
    own = next((m for m in merges if m["name"] == model_name), merges[0])
    if len(merges) > 1 and own["name"] != model_name:
        LOG.warning(
            "%s holds %d merged models; the card of %s takes %s's numbers",
            where,
            len(merges),
            model_name,
            own["name"],
        )
    shown = [own] + [m for m in models if m.get("role") != "merge"]
    report = EvalReport(columns=[_label(m) for m in shown], rows=[], model_index=[])
    report.limit = data.get("limit")
    version = (data.get("harness") or {}).get("version")
    for model in shown:
        here = f"{where}: model {model['name']}"
        if model.get("lm_eval") is not None:
            if not is_lm_eval_results(model["lm_eval"]):
                raise ConfigError(f"{here}: 'lm_eval' is not lm-eval's results dict")
            _add_lm_eval(report, model["lm_eval"], _label(model), model is own, here)
            version = version or model["lm_eval"].get("lm_eval_version")
        if model.get("classification") is not None:
            _add_classification(report, model["classification"], _label(model), model is own, here)
    _finish(report, version if any(m.get("lm_eval") for m in shown) else None)
    return report


def _row(report: EvalReport, task: str, metric: str) -> EvalRow:
    for row in report.rows:
        if row.task == task and row.metric == metric:
            return row
    row = EvalRow(task=task, metric=metric)
    report.rows.append(row)
    return row


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None  # lm-eval writes "N/A" for a stderr it could not compute
    return float(value) if math.isfinite(float(value)) else None


def _is_local(config: Mapping[str, Any]) -> bool:
    path = str(config.get("dataset_path") or "")
    kwargs = config.get("dataset_kwargs") or {}
    return (
        path in _LOCAL_BUILDERS
        or path.startswith((".", "/", "~"))
        or os.path.exists(path)
        or bool(isinstance(kwargs, Mapping) and kwargs.get("data_files"))
    )


def _data_shown(config: Mapping[str, Any], task: str) -> str:
    """The task's data for the table: the Hub dataset, or a local file's name (never its
    folder: the card is public)."""
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if isinstance(files, Mapping):
        files = [f for v in files.values() for f in (v if isinstance(v, list) else [v])]
    if isinstance(files, str):
        files = [files]
    if files:
        return ", ".join(sorted({os.path.basename(str(f)) for f in files}))
    return str(config.get("dataset_path") or task)


def _add_lm_eval(
    report: EvalReport, data: Mapping[str, Any], column: str, merge: bool, where: str
) -> None:
    version = data.get("lm_eval_version")
    limit = (data.get("config") or {}).get("limit")
    if report.limit is None:
        report.limit = limit
    for task, metrics in data["results"].items():
        if not isinstance(metrics, Mapping):
            raise ConfigError(f"{where}: results[{task!r}] is not an object of metrics")
        config = (data.get("configs") or {}).get(task) or {}
        samples = (data.get("n-samples") or {}).get(task) or {}
        effective, original = samples.get("effective"), samples.get("original")
        limited = limit is not None or (
            isinstance(effective, int) and isinstance(original, int) and effective < original
        )
        local = _is_local(config)
        split = str(config.get("test_split") or config.get("validation_split") or "")
        n_shot = (data.get("n-shot") or {}).get(task)
        task_version = (data.get("versions") or {}).get(task)
        alias = str(metrics.get("alias") or task).strip(" -")
        for key, value in metrics.items():
            metric, sep, filt = str(key).partition(",")
            number = _number(value)
            if not sep or metric.endswith("_stderr") or number is None:
                continue
            shown_metric = metric if filt in ("", "none") else f"{metric} ({filt})"
            row = _row(report, alias, shown_metric)
            row.values[column] = number
            row.stderr[column] = _number(metrics.get(f"{metric}_stderr,{filt}"))
            if merge or not row.dataset:
                row.dataset = _data_shown(config, task)
                row.split = split
                row.version = None if task_version is None else str(task_version)
                row.n_shot = n_shot if isinstance(n_shot, int) else None
                row.samples = (
                    f"{effective} of {original}"
                    if limited and effective is not None and original is not None
                    else (str(effective) if effective is not None else None)
                )
            row.local = row.local or local
            row.limited = row.limited or limited
            if merge:
                report.model_index.append(
                    _lm_eval_result(task, alias, metric, shown_metric, number, config, row, version)
                )


def _lm_eval_result(
    task: str,
    alias: str,
    metric: str,
    shown_metric: str,
    value: float,
    config: Mapping[str, Any],
    row: EvalRow,
    version: Optional[str],
) -> EvalResult:
    labels = []
    if row.n_shot is not None:
        labels.append(f"{row.n_shot}-shot")
    if row.limited:
        labels.append(f"--limit: {row.samples or 'a subset'} examples")
    if row.local:
        labels.append("local data")
    return EvalResult(
        task_type="text-generation",
        task_name=alias,
        # a local data file has no Hub id: the task's own name stands for it, marked local
        dataset_type=task if row.local else str(config.get("dataset_path") or task),
        dataset_name=f"{alias} (local data)" if row.local else alias,
        dataset_config=None if row.local else config.get("dataset_name"),
        dataset_split=row.split or None,
        dataset_args={"num_few_shot": row.n_shot} if row.n_shot is not None else None,
        metric_type=metric,
        metric_value=value,
        metric_name=f"{shown_metric} ({', '.join(labels)})" if labels else shown_metric,
        source_name=f"lm-evaluation-harness {version}" if version else "lm-evaluation-harness",
        source_url=HARNESS_URL,
    )


def _add_classification(
    report: EvalReport, data: Mapping[str, Any], column: str, merge: bool, where: str
) -> None:
    tasks = data.get("tasks")
    if not isinstance(tasks, Mapping):
        raise ConfigError(f"{where}: 'classification' needs 'tasks' (task → accuracy)")
    for task, result in tasks.items():
        value = _number((result or {}).get("accuracy"))
        if value is None:
            raise ConfigError(f"{where}: classification task {task!r} has no numeric accuracy")
        row = _row(report, str(task), "accuracy")
        row.values[column] = value
        row.local = row.local or bool(result.get("local"))
        if merge or not row.dataset:
            row.dataset = str(result.get("data") or task)
            row.split = str(result.get("split") or "")
            row.samples = None if result.get("samples") is None else str(result["samples"])
        if merge:
            head = result.get("head")
            report.model_index.append(
                EvalResult(
                    task_type=str(result.get("pipeline_tag") or "text-classification"),
                    task_name=str(task),
                    dataset_type=str(task) if row.local else row.dataset,
                    dataset_name=f"{row.dataset} (local data)" if row.local else row.dataset,
                    dataset_split=row.split or None,
                    metric_type="accuracy",
                    metric_value=value,
                    metric_name=(
                        f"accuracy ({head}'s head)" if head and head != "own" else "accuracy"
                    ),
                )
            )


def _finish(report: EvalReport, version: Optional[str]) -> None:
    if version:
        report.harness = f"lm-evaluation-harness {version}"
    if not report.rows:
        raise ConfigError("the evaluation results hold no numeric metric", details=EVAL_FILES_HELP)
    notes = []
    if report.harness:
        notes.append(f"Measured with {report.harness} (`mergekit-ext eval`).")
    if report.any_limited:
        limit = f" `--limit {report.limit}`" if report.limit is not None else ""
        notes.append(
            f"Rows marked ‡ used{limit}: fewer examples than the task has (the Examples "
            "column), so they are not comparable with full-task scores."
        )
    if report.any_local:
        notes.append("Rows marked † read local data (a task YAML or data file, not a Hub dataset).")
    report.notes = notes


def eval_results_to_card(
    results: Any, model_name: str, where: str = "eval results"
) -> list[EvalResult]:
    """Turn the documented eval schema into ``huggingface_hub.EvalResult`` objects."""
    if not isinstance(results, list):
        raise ConfigError(f"{where}: expected a JSON list of results", details=EVAL_RESULTS_SCHEMA)
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


def format_eval_table(report: EvalReport) -> str:
    """The table for a terminal: one line per task and metric, one column per model."""
    header = ["task", "metric", *report.columns]
    lines = [header]
    for row in report.rows:
        mark = ("‡" if row.limited else "") + ("†" if row.local else "")
        cells = [f"{row.task}{mark}", row.metric]
        for column in report.columns:
            value = row.values.get(column)
            err = row.stderr.get(column)
            cells.append(
                "—" if value is None else f"{value:.4f}" + (f" ± {err:.4f}" if err else "")
            )
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)
    notes = [n.replace("`", "") for n in report.notes]
    return text + ("\n" + "\n".join(notes) if notes else "")
