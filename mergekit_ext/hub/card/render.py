"""Rendering a model card: the template context (from a finished output folder, or from the
run writing it: :class:`MergeInMemory`), Jinja2, ``README.md``."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Optional

import jinja2
import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from mergekit_ext import merge_record
from mergekit_ext.config import ExtMergeConfig
from mergekit_ext.errors import ExecutionError, MergekitExtError, ModelNotFoundError
from mergekit_ext.hub.card.evaluation import (
    EvalReport,
    read_eval_results,
)
from mergekit_ext.merge_inputs import (
    README_FILENAME,
    _declared_license,
    _read_json,
    _shorten_yaml_paths,
    architecture_info,
    collect_inputs,
    decide_license,
    display_path,
    dot_local_models,
    undot,
)
from mergekit_ext.plots import IMAGES_DIR

LOG = logging.getLogger(__name__)

# the templates ship in mergekit_ext/hub/templates (model_cards/ in a source checkout)
TEMPLATES_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "templates"
)

CONFIG_FILENAME = "mergekit_config.yml"

TAGS = ("mergekit", "merge", "mergekit-ext")


class CardError(MergekitExtError, FileExistsError):
    """The model card cannot be written without losing the user's edits."""


_PARTIAL_DIR = re.compile(r"^\.(?P<name>.+)\.partial-[^/\\]*$")


# --------------------------------------------------------------------------- rendering


def _fmt(value: Any, digits: int = 3) -> str:
    """Numbers for Markdown: 3 significant digits, ``—`` for missing/NaN."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value):
            return "—"
        if math.isinf(value):
            return "∞" if value > 0 else "−∞"
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f"{value:.{digits - 1}e}"
        return f"{value:.{digits}g}"
    return str(value)


def _fmt_measured(value: Any, digits: int = 3) -> str:
    """:func:`_fmt` for a value that was measured: NaN shows as ``NaN``, not as missing."""
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    return _fmt(value, digits)


def _pct(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return f"{100.0 * value:.1f}%"
    return "—"


def _yaml_value(value: Any) -> str:
    """A parameter value as it would be written in the YAML (``true``, ``null``, ``[0, 1]``)."""
    text = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True, width=10**6)
    return text.strip().removesuffix("...").strip()


def _cell(value: Any) -> str:
    """Text safe inside a Markdown table cell."""
    return str(value).replace("|", "\\|").replace("\n", " ")


def _environment(template_dir: Optional[str]) -> jinja2.Environment:
    search = [template_dir, TEMPLATES_DIR] if template_dir else [TEMPLATES_DIR]
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(search),
        undefined=jinja2.StrictUndefined,
        autoescape=False,  # Markdown, not HTML
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    env.filters["fmt"] = _fmt
    env.filters["fmtm"] = _fmt_measured
    env.filters["pct"] = _pct
    env.filters["cell"] = _cell
    env.filters["yamlv"] = _yaml_value
    return env


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _versions(diag: Mapping[str, Any]) -> list[tuple[str, str]]:
    recorded = diag.get("versions") if isinstance(diag.get("versions"), Mapping) else {}
    from mergekit_ext._version import __version__

    rows = [("mergekit-ext", str(diag.get("mergekit_ext_version") or __version__))]
    for pkg in ("mergekit", "torch", "transformers", "huggingface_hub"):
        rows.append((pkg, str(recorded.get(pkg) or _package_version(pkg))))
    return rows


def _model_name(out_dir: str, name: Optional[str], repo_id: Optional[str]) -> str:
    if name:
        return name
    if repo_id:
        return repo_id.split("/")[-1]
    base = os.path.basename(os.path.normpath(os.path.abspath(out_dir)))
    partial = _PARTIAL_DIR.match(base)  # the runner's temporary folder beside OUT_DIR
    return partial.group("name") if partial else base


def _calibration_rows(diag: Mapping[str, Any], cfg: Any, cwd: str) -> list[dict[str, Any]]:
    """One row per model with calibration data, in the order of ``models:``; what the merge
    recorded (samples, tokens, content hash) beside what the config asked (max_length,
    chat template)."""
    recorded = diag.get("calibration") or {}
    recorded = recorded if isinstance(recorded, Mapping) else {}
    rows = []
    for entry in cfg.models:
        spec = cfg.calibration_for(entry)
        info = recorded.get(entry.name)
        if info is None and (spec is None or not spec.has_data):
            continue
        info = info or {}
        chat = getattr(spec, "apply_chat_template", None)
        if chat is None:
            chat = getattr(spec, "chat_template", None)
        rows.append(
            {
                "model": entry.name,
                "source": _display_source(
                    str(info.get("source") or (spec.describe() if spec else "")), cwd
                ),
                "samples": info.get("samples", spec.samples if spec else None),
                "tokens": info.get("tokens"),
                "split": getattr(spec, "split", None),
                "max_length": getattr(spec, "max_length", None),
                "chat_template": chat if isinstance(chat, bool) else None,
                "modality": info.get("modality") or "",
                "sha256": info.get("sha256") or "",
                "recorded": bool(info),
            }
        )
    names = {r["model"] for r in rows}
    for model, info in recorded.items():  # a task the config no longer names: still shown
        if model not in names and isinstance(info, Mapping):
            rows.append(
                {
                    "model": model,
                    "source": _display_source(str(info.get("source") or ""), cwd),
                    "samples": info.get("samples"),
                    "tokens": info.get("tokens"),
                    "split": None,
                    "max_length": None,
                    "chat_template": None,
                    "modality": info.get("modality") or "",
                    "sha256": info.get("sha256") or "",
                    "recorded": True,
                }
            )
    return rows


def _display_source(source: str, cwd: str) -> str:
    prefix, sep, rest = source.partition(":")
    if sep and prefix in ("path", "dataset", "source", "file", "folder") and rest:
        return f"{prefix}:{_display_source(rest, cwd)}"
    if os.path.isabs(os.path.expanduser(source)):
        return display_path(source, cwd)
    return source


def read_licenses(inputs: list[Any], cwd: str) -> list[Any]:
    """``inputs`` with the license each declares (its README front matter, locally or in
    the Hub cache) where the merge did not record it; returns ``inputs``."""
    for m in inputs:
        if m.recorded:
            continue  # the license was recorded with the merge
        declared = _declared_license(m.path, m.is_hub, m.revision, cwd)
        if not declared and m.lora:
            declared = _declared_license(m.lora, m.lora_is_hub, None, cwd)
        if declared:
            m.license = declared["license"]
            m.license_name = declared.get("license_name")
            m.license_link = declared.get("license_link")
            m.license_origin = declared["origin"]
    return inputs


def _hub_datasets(cfg: Any, cwd: str) -> list[str]:
    """Hub datasets among the calibration sources (``dataset:`` that is not a local path)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    found: list[str] = []
    specs = [cfg.calibration_for(e) for e in cfg.models]
    if cfg.calibration_defaults is not None:
        specs.append(cfg.calibration_defaults)
    for spec in specs:
        name = getattr(spec, "dataset", None) if spec is not None else None
        if not name or os.path.exists(os.path.join(cwd, name)):
            continue
        try:
            validate_repo_id(name)
        except HFValidationError:
            continue
        if name not in found:
            found.append(name)
    return found


# Remarks of a parameter's description that belong to the project's docs, not to a card:
# benchmark-suite numbers, sweeps, references to docs/methods.md (not in the model repo).
_RESEARCH_REMARK = re.compile(r"suite|benchmark|sweep|docs/methods\.md|FusionBench", re.I)


def _card_description(text: str) -> str:
    """A parameter's description for the card: parenthesised remarks and ``;``-clauses
    about benchmarks, sweeps or the project's docs dropped."""
    out, depth, start, pieces = "", 0, 0, []
    for i, ch in enumerate(text):  # top-level parenthesised groups
        if ch == "(":
            if depth == 0:
                pieces.append((False, text[start:i]))
                start = i
            depth += 1
        elif ch == ")" and depth:
            depth -= 1
            if depth == 0:
                pieces.append((True, text[start : i + 1]))
                start = i + 1
    pieces.append((False, text[start:]))
    for is_group, piece in pieces:
        if is_group and _RESEARCH_REMARK.search(piece):
            out = out.rstrip()
            continue
        out += piece
    clauses = [c for c in out.split("; ") if not _RESEARCH_REMARK.search(c)]
    return "; ".join(clauses).strip()


def _parameters(cfg: Any, method: Mapping[str, Any]) -> dict[str, Any]:
    """The parameters as the YAML gave them: a global table and a per-model table.

    Global rows: every shared parameter of the method (given value, or none, beside its
    default) and every per-model parameter that ``parameters:`` sets for all models. The
    per-model table has one row per ``models:`` entry and one column per per-model
    parameter, holding what that entry's ``parameters:`` gave (nothing: the global value, or
    else the default, applies), followed by the global and default rows.
    """
    given = cfg.parameters
    documented = {p["name"]: p for p in method.get("parameters", [])}
    per_model = [n for n, p in documented.items() if p.get("scope", "shared") != "shared"]
    global_rows = []
    for name, doc in documented.items():
        if name in per_model and name not in given:
            continue
        global_rows.append(
            {
                "name": name,
                "given": name in given,
                "value": given.get(name),
                "default": doc.get("default"),
                "required": bool(doc.get("required")),
                "description": _card_description(doc.get("description") or ""),
            }
        )
    for name, value in given.items():
        if name not in documented:
            global_rows.append(
                {
                    "name": name,
                    "given": True,
                    "value": value,
                    "default": None,
                    "required": False,
                    "description": f"not a parameter of `{method.get('name')}`",
                }
            )

    entries = cfg.raw.get("models") if isinstance(cfg.raw.get("models"), list) else []
    model_params = [
        dict(e.get("parameters") or {}) if isinstance(e, Mapping) else {} for e in entries
    ]
    columns = list(per_model)
    for params in model_params:
        columns += [n for n in params if n not in columns]
    model_rows = []
    if any(model_params) or per_model:
        for i, params in enumerate(model_params):
            name = cfg.models[i].name if i < len(cfg.models) else str(i)
            model_rows.append(
                {"model": name, "cells": [(c in params, params.get(c)) for c in columns]}
            )
    return {
        "global": global_rows,
        "columns": columns,
        "models": model_rows if columns else [],
        "global_values": [(c in given, given.get(c)) for c in columns],
        "defaults": [
            (
                c in documented and not documented[c].get("required"),
                documented.get(c, {}).get("default"),
            )
            for c in columns
        ],
    }


def _describe_method(name: str) -> dict[str, Any]:
    from mergekit_ext.methods.registry import describe_method

    try:
        return describe_method(name)
    except Exception as e:  # noqa: BLE001 - an unknown method still gets a card
        LOG.warning("no description for merge method %r: %s", name, e)
        return {
            "name": name,
            "pretty_name": name,
            "source": "unknown",
            "kind": "tensorwise",
            "needs_calibration": False,
            "paper": "",
            "paper_url": "",
            "parameters": [],
        }


def _diagnostic_sections(
    diag: Mapping[str, Any], images_dir: str, raw_parameters: Mapping[str, Any]
) -> list[dict[str, Any]]:
    """One card section per method section of the diagnostics, through each method's report.

    The card never dispatches on a method's name: a registered method brings its own title,
    summary, plots and (optionally) template (``MethodInfo.report``).
    """
    from mergekit_ext.methods.registry import ext_method_info

    result = []
    for key in sorted(diag.get("sections") or {}):
        section = diag["sections"][key]
        info = ext_method_info(key)
        report = info.report if info is not None else None
        if report is None or not isinstance(section, Mapping):
            result.append(
                {"key": key, "template": None, "title": key, "summary": {}, "plots": [], "rows": []}
            )
            continue
        try:
            parameters = info.parse_parameters(raw_parameters)
        except MergekitExtError:  # a card for a merge made with other parameters: defaults
            parameters = info.parse_parameters({})
        summary = report.summarize(section, parameters)
        plots = report.plot(section, images_dir, parameters) if report.plot else []
        result.append(
            {
                "key": key,
                "template": report.template,
                "title": report.title,
                "summary": summary,
                "plots": plots,
                "rows": _plain_rows(summary) if report.template is None else [],
            }
        )
    return result


DIAGNOSE_PLOT = "diagnose_block_errors.png"
# `mergekit-ext card OUT --diagnose CONFIG` saves its result here; later cards (a rebuild, the
# copy `publish` uploads) keep the section by reading it back.
DIAGNOSE_FILENAME = "mergekit_ext_diagnose.json"
EVAL_FILENAME = merge_record.EVAL_FILENAME


def _diagnose_section(
    result: Mapping[str, Any], images_dir: str, render_images: bool
) -> dict[str, Any]:
    """The card's view of a ``mergekit-ext diagnose`` result (its JSON, as a mapping)."""
    from mergekit_ext.plots import as_float, plot_block_errors

    rows = []
    base_row = (result.get("references") or {}).get("base") or {}
    base = base_row.get("tasks") or {}
    base_probe = (base_row.get("probe") or {}).get("tasks") or {}
    probe = (result.get("probe") or {}).get("tasks") or {}
    tasks = result.get("tasks") or {}
    # the probe's rows (generic prose) below the held-out ones; a task whose only data is
    # the probe has one row
    listed = [(task, t, base.get(task), "") for task, t in tasks.items()]
    listed += [
        (task, t, base_probe.get(task), " (generic prose probe)")
        for task, t in probe.items()
        if t != tasks.get(task)
    ]
    for task, t, b, suffix in listed:
        worst = t.get("worst_block") or {}
        rows.append(
            {
                "task": task + suffix,
                "agreement": t.get("agreement"),
                "kl": t.get("kl"),
                "base_kl": (b or {}).get("kl"),
                "worst": f"{worst['index']} ({_fmt(as_float(worst.get('relative_error')))})"
                if worst
                else "—",
                "last": as_float(t["blocks"][-1]["relative_error"]) if t.get("blocks") else None,
                "head": "the expert's (not in this model)"
                if t.get("head") == "expert"
                else ("this model's" if t.get("output") else "none (block errors only)"),
                "output": t.get("output"),
            }
        )
    warnings = [
        f"{task}: {w}"
        for task, d in (result.get("data") or {}).items()
        for w in (d.get("warnings") or [])
    ]
    warnings += [f"this merge: {w}" for w in result.get("merge_warnings") or []]
    plots = []
    if render_images and rows:
        plots.append(plot_block_errors(dict(result), images_dir, DIAGNOSE_PLOT))
    return {
        "rows": rows,
        "mean_agreement": result.get("mean_agreement"),
        "mean_kl": result.get("mean_kl"),
        "verdict": result.get("verdict"),
        "heldout": all(
            d.get("kind") in ("held-out", "probe") for d in (result.get("data") or {}).values()
        ),
        "has_probe": bool(probe),
        "probe_skipped": result.get("probe_skipped"),
        "warnings": warnings,
        "has_base": bool(base),
        "next_token": any(r["output"] == "next_token" for r in rows),
        "plots": plots,
    }


def _plain_rows(summary: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """The top-level numbers and words of a summary, for methods without a template."""
    return [
        (str(k).replace("_", " "), v)
        for k, v in summary.items()
        if isinstance(v, (int, float, str, bool)) or v is None
    ]


def _task_folders(out_dir: str, diag: Mapping[str, Any]) -> list[dict[str, str]]:
    tasks_dir = os.path.join(out_dir, "tasks")
    names: list[str] = []
    symerge = (diag.get("sections") or {}).get("symerge") or {}
    for task in symerge.get("tasks") or []:
        if os.path.isdir(os.path.join(tasks_dir, str(task))):
            names.append(str(task))
    if os.path.isdir(tasks_dir):
        for entry in sorted(os.listdir(tasks_dir)):
            if entry not in names and os.path.isdir(os.path.join(tasks_dir, entry)):
                names.append(entry)
    return [_task_entry(tasks_dir, n) for n in names]


def _task_entry(tasks_dir: str, name: str) -> dict[str, Any]:
    """How to load one SyMerge task folder: its expert's class, and whether it is an adapter."""
    folder = os.path.join(tasks_dir, name)
    auto_class = "AutoModel"
    config_path = os.path.join(folder, "config.json")
    if os.path.exists(config_path):
        with open(config_path, encoding="utf-8") as fp:
            architectures = json.load(fp).get("architectures") or []
        if architectures:
            auto_class = str(architectures[0])
    return {
        "name": name,
        "subfolder": f"tasks/{name}",
        "auto_class": auto_class,
        "adapter": os.path.exists(os.path.join(folder, "adapter_config.json")),
    }


_CHAT_FILES = ("chat_template.jinja", "chat_template.json")


def has_chat_template(folder: str) -> bool:
    """The tokenizer saved in ``folder`` has a chat template (in ``tokenizer_config.json``
    or a ``chat_template.jinja`` / ``.json`` file, as transformers saves them)."""
    if any(os.path.isfile(os.path.join(folder, f)) for f in _CHAT_FILES):
        return True
    config = _read_json(os.path.join(folder, "tokenizer_config.json")) or {}
    return bool(config.get("chat_template"))


def _project_url() -> Optional[str]:
    """The project's repository URL as the installed package declares it (pyproject
    ``[project.urls]``), or None: the card links to nothing then."""
    try:
        urls = importlib.metadata.metadata("mergekit-ext").get_all("Project-URL") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = {}
    for entry in urls:
        label, _, url = entry.partition(",")
        found[label.strip().lower()] = url.strip()
    for key in ("repository", "source", "source code", "homepage"):
        if found.get(key):
            return found[key]
    return None


@dataclass
class CardContext:
    """Everything a template sees, plus the metadata; built by :func:`build_card_context`."""

    card_data: ModelCardData
    variables: dict[str, Any]
    template: str


def _resources(diag: Mapping[str, Any]) -> Optional[dict[str, Any]]:
    """Wall time and peak memory of the merge as the card shows them (None: not recorded)."""
    from mergekit_ext.resources import format_bytes, format_duration

    record = diag.get("resources")
    if not isinstance(record, Mapping) or record.get("wall_time_s") is None:
        return None
    cuda = record.get("cuda_max_allocated_bytes")
    return {
        "wall_time": format_duration(float(record["wall_time_s"])),
        "peak_rss": format_bytes(record.get("peak_rss_bytes")),
        "process_scope": record.get("peak_rss_scope") == "process",
        "cuda": format_bytes(cuda) if cuda is not None else None,
    }


@dataclass(frozen=True)
class MergeInMemory:
    """The merge ``mergekit-ext run`` is writing, handed to the card in memory: its config
    as the user wrote it (parsed), the text of the config copy and the diagnostics, both as
    written beside the card (paths shortened). Without it the card reads the copy and the
    diagnostics back from the folder (``mergekit-ext card OUT``), through the same code, so
    the two cards are the same text."""

    config: ExtMergeConfig
    config_text: str
    diagnostics: Mapping[str, Any]


def _read_merge(out_dir: str, cwd: str) -> tuple[str, ExtMergeConfig, dict[str, Any]]:
    """The config copy (text and parsed) and the diagnostics of a finished output folder."""
    from mergekit_ext.config import parse_config

    config_path = os.path.join(out_dir, CONFIG_FILENAME)
    with open(config_path, encoding="utf-8") as fp:
        config_text = fp.read()
    # the merge warned about unknown keys when it read the config; its copy does not warn again
    cfg = parse_config(config_text, config_path, warn_unknown=False)
    cfg.base_dir = cwd  # relative paths in the YAML resolve against the CWD, like mergekit
    return config_text, cfg, merge_record.load(out_dir)


def _copy_provenance(config_text: str, diag: Mapping[str, Any]) -> tuple[str, bool, bool]:
    """``(hash of the original config, the runner shortened this text's paths, the text was
    edited after the merge)`` of a config copy, from the hashes the diagnostics recorded
    (the runner's copy is the original with its local paths shortened; a copy written by
    ``mergekit-yaml`` is the original)."""
    text_sha = hashlib.sha256(config_text.encode("utf-8")).hexdigest()
    recorded_sha = diag.get("config_sha256")
    written_sha = diag.get("config_written_sha256")
    shortened = (
        recorded_sha != text_sha
        and written_sha == text_sha
        and diag.get("config_paths_shortened", True) is not False
    )
    modified = bool(recorded_sha) and recorded_sha != text_sha and written_sha != text_sha
    return recorded_sha or text_sha, shortened, modified


@dataclass(frozen=True)
class CardOptions:
    """What a folder's card is built from besides the folder: the merge's card
    (:func:`build_merge_context`) reads them all, the tools' cards ``name``, ``repo_id``,
    ``cwd`` and the evaluation results.

    - ``eval_results``: any shape :func:`~mergekit_ext.hub.card.evaluation.read_eval_results`
      reads (``mergekit-ext eval``'s file, lm-eval's results, our list); without it the
      results saved by an earlier ``card --eval`` (``mergekit_ext_eval.json``) are used.
    - ``name``: the model's title (default: the folder name); ``repo_id``: the Hub
      repository of the loading snippets; ``cwd``: where the config's relative paths
      resolve (default: the current folder).
    - ``render_images``: the methods' diagnostic sections and the plots (False: neither);
      ``images_dir`` draws the plots somewhere else than ``out_dir/images`` (the links stay
      ``images/...``): :mod:`~mergekit_ext.hub.publish` renders the uploaded copy of the
      card without touching the folder.
    - ``card_eval_results``: evaluation results that are already ``EvalResult`` objects (a
      card's model-index), instead of ``eval_results``.
    - ``diagnose``: a ``mergekit-ext diagnose`` result of the model (default: the one an
      earlier ``card --diagnose`` saved).
    - ``merge``: the config and diagnostics of the merge being written (``mergekit-ext
      run``), used instead of the folder's copies; the weights' files (``config.json``,
      tokenizer) are read from the folder either way.
    """

    eval_results: Any = None
    name: Optional[str] = None
    repo_id: Optional[str] = None
    cwd: Optional[str] = None
    render_images: bool = True
    images_dir: Optional[str] = None
    card_eval_results: Optional[list[EvalResult]] = None
    diagnose: Optional[Mapping[str, Any]] = None
    merge: Optional[MergeInMemory] = None


def build_merge_context(out_dir: str, options: CardOptions = CardOptions()) -> CardContext:
    """Read a finished output folder and assemble the card's metadata and template variables
    (``options``: :class:`CardOptions`)."""
    diagnose = options.diagnose
    if diagnose is None:  # a result saved by an earlier `card --diagnose`
        diagnose = _read_json(os.path.join(out_dir, DIAGNOSE_FILENAME))
    cwd = os.path.abspath(options.cwd or os.getcwd())
    merge = options.merge
    if merge is None:
        config_text, cfg, diag = _read_merge(out_dir, cwd)
    else:
        config_text, cfg, diag = merge.config_text, merge.config, dict(merge.diagnostics)
    model_config = _read_json(os.path.join(out_dir, "config.json"))
    if model_config is None:
        raise ModelNotFoundError(f"{out_dir} has no readable config.json: re-run the merge")
    arch = architecture_info(model_config)
    model_name = _model_name(out_dir, options.name, options.repo_id)
    method = _describe_method(cfg.method)

    inputs = collect_inputs(cfg, cwd, diag.get("inputs"))
    license_decision = decide_license(read_licenses(inputs, cwd))

    hub_ids: list[str] = []
    for m in inputs:
        for hub_id in m.hub_ids:
            if hub_id not in hub_ids:
                hub_ids.append(hub_id)
    datasets = _hub_datasets(cfg, cwd)
    where = "evaluation results"
    eval_results = options.eval_results
    if eval_results is None:  # the results an earlier `card --eval` kept beside the card
        where = os.path.join(out_dir, EVAL_FILENAME)
        eval_results = _read_json(where)
    report: Optional[EvalReport] = None
    if eval_results:
        report = read_eval_results(eval_results, model_name, where=where)
    card_eval = report.model_index if report else None
    if options.card_eval_results and not report:
        card_eval = list(options.card_eval_results)
    extra: dict[str, Any] = {}
    if hub_ids:
        extra["base_model_relation"] = "merge"
    if license_decision.license == "other":
        if license_decision.license_name:
            extra["license_name"] = license_decision.license_name
        if license_decision.license_link:
            extra["license_link"] = license_decision.license_link
    card_data = ModelCardData(
        base_model=hub_ids or None,
        datasets=datasets or None,
        eval_results=card_eval,
        library_name="transformers",
        license=license_decision.license,
        model_name=model_name if card_eval else None,
        pipeline_tag=arch.pipeline_tag,
        tags=[*TAGS, cfg.method],
        **extra,
    )

    sections = (
        _diagnostic_sections(
            diag, options.images_dir or os.path.join(out_dir, IMAGES_DIR), cfg.parameters
        )
        if options.render_images
        else []
    )
    shown_yaml, shortened = _shorten_yaml_paths(config_text.rstrip("\n"), cfg.raw, cwd)
    local = {undot(display_path(m.path, cwd)) for m in inputs if not m.is_hub}
    local |= {undot(display_path(m.lora, cwd)) for m in inputs if m.lora and not m.lora_is_hub}
    dotted = dot_local_models(shown_yaml, local.__contains__)
    yaml_dotted = dotted != shown_yaml or bool(re.search(r"model:\s*['\"]?\./", shown_yaml))
    shown_yaml = dotted
    config_sha256, shortened_by_run, config_modified = _copy_provenance(config_text, diag)
    has_tokenizer = any(
        os.path.isfile(os.path.join(out_dir, f))
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt")
    )
    has_processor = any(
        os.path.isfile(os.path.join(out_dir, f))
        for f in ("preprocessor_config.json", "processor_config.json")
    )
    chat = has_chat_template(out_dir) or any(
        has_chat_template(os.path.join(cwd, os.path.expanduser(m.path)))
        for m in inputs
        if not m.is_hub
    )
    eval_rows = [
        {
            "task": r.task_name or r.task_type,
            "dataset": r.dataset_name,
            "split": r.dataset_split or "",
            "metric": r.metric_name or r.metric_type,
            "value": r.metric_value,
        }
        for r in card_eval or []
    ]
    variables = {
        "name": model_name,
        "arch": arch,
        "method": method,
        "parameters": _parameters(cfg, method),
        "inputs": inputs,
        "base": next((m for m in inputs if m.role == "base"), None),
        "license": license_decision,
        "config_yaml": shown_yaml,
        "yaml_shortened": shortened or shortened_by_run,
        "yaml_dotted": yaml_dotted,
        "config_sha256": config_sha256,
        "config_modified": config_modified,
        "seed": diag.get("seed"),
        "resources": _resources(diag),
        "distributed": diag.get("distributed"),
        "executor": diag.get("executor"),
        "calibration": _calibration_rows(diag, cfg, cwd),
        "data_aware": bool(method.get("needs_calibration")),
        "sections": sections,
        "diagnose": _diagnose_section(
            diagnose,
            options.images_dir or os.path.join(out_dir, IMAGES_DIR),
            options.render_images,
        )
        if diagnose
        else None,
        "has_diagnostics": bool(diag),
        "eval_rows": eval_rows,
        "evaluation": report,
        "versions": _versions(diag),
        "project_url": _project_url(),
        "usage": {
            "model_id": options.repo_id or f"./{model_name}",
            "auto_class": arch.auto_class,
            "has_tokenizer": has_tokenizer,
            "has_processor": has_processor,
            "chat": chat,
            "tasks": _task_folders(out_dir, diag),
        },
    }
    return CardContext(card_data=card_data, variables=variables, template=f"{arch.template}.md.j2")


def render_model_card(context: CardContext, template_dir: Optional[str] = None) -> ModelCard:
    """Render the template and parse it back (front matter → ``ModelCardData``)."""
    env = _environment(template_dir)
    try:
        template = env.get_template(context.template)
    except jinja2.TemplateNotFound as e:
        raise ExecutionError(
            f"model card template {context.template!r} not found in "
            f"{template_dir or TEMPLATES_DIR}; reinstall mergekit-ext"
        ) from e
    content = template.render(card_data=context.card_data.to_yaml(), **context.variables)
    return ModelCard(content)


# The last line of every README.md mergekit-ext writes: the hash of the text above it. A
# README without it, or whose text no longer matches, was written or edited by someone else.
_SIGNATURE = re.compile(r"<!-- mergekit-ext card sha256:(?P<sha>[0-9a-f]{64})[^\n]*-->\n?\Z")
BACKUP_SUFFIX = ".bak"


def _sign(text: str) -> str:
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return (
        f"{text}<!-- mergekit-ext card sha256:{digest} (`mergekit-ext card` replaces this file "
        "only while it is unedited) -->\n"
    )


def card_is_unedited(path: str) -> bool:
    """``path`` is a README.md written by mergekit-ext and not changed since."""
    try:
        with open(path, encoding="utf-8", newline="") as fp:
            text = fp.read()
    except (OSError, UnicodeDecodeError):
        return False
    return card_text_is_unedited(text)


def card_text_is_unedited(text: str) -> bool:
    """``text`` is a card mergekit-ext wrote and signed, unchanged since (the Hub's copy
    of a card uploaded with ``--keep-card`` is checked this way)."""
    match = _SIGNATURE.search(text)
    if match is None:
        return False
    body = text[: match.start()]
    return hashlib.sha256(body.encode("utf-8")).hexdigest() == match.group("sha")


def keep_edited_card(out_dir: str, force: bool) -> Optional[str]:
    """Refuse to replace a README.md of ``out_dir`` that mergekit-ext did not write as it is
    now (edited by hand, or written by another tool); with ``force`` copy it to
    ``README.md.bak`` (``.bak2``, ... if taken) first and return that path."""
    path = os.path.join(out_dir, README_FILENAME)
    if not os.path.lexists(path) or card_is_unedited(path):
        return None
    if not force:
        raise CardError(
            f"{path} was edited by hand or not written by mergekit-ext (its last line is not "
            "the signature mergekit-ext writes, or the text no longer matches it), so "
            "rebuilding the card would lose it: pass --force to replace it (the current file "
            f"is kept as {README_FILENAME}{BACKUP_SUFFIX}), or keep it and publish it as it "
            "is with `mergekit-ext publish --keep-card`"
        )
    backup, n = path + BACKUP_SUFFIX, 1
    while os.path.lexists(backup):
        n += 1
        backup = f"{path}{BACKUP_SUFFIX}{n}"
    shutil.copy2(path, backup)
    LOG.warning("%s was edited by hand: kept as %s", path, backup)
    return backup
