"""Model cards for merged models: metadata, diagnostics, plots, no network.

:func:`write_model_card` reads a finished output folder (``mergekit_config.yml``,
``config.json``, ``mergekit_ext_diagnostics.json``), renders one of the Jinja2 templates
in ``mergekit_ext/hub/templates/`` (also reachable as ``model_cards/`` at the top of a
source checkout, a symlink to the same folder) and writes ``README.md`` plus the
diagnostics plots in ``images/``.

The YAML front matter is built with :class:`huggingface_hub.ModelCardData` (never written
by hand) and parsed back with :class:`huggingface_hub.ModelCard` before the card is saved.

Nothing here touches the network. mergekit 0.1.5's ``generate_card`` asks the Hub whether a
short relative path is a repository; we decide offline instead: an input is a Hub id when it
has the form ``owner/name`` and is not an existing local path (see :func:`is_hub_model_id`).
Licenses of Hub inputs are read from the local Hugging Face cache only.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import jinja2
import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from mergekit_ext import diagnostics as diagnostics_mod
from mergekit_ext.errors import ConfigError, MergekitExtError
from mergekit_ext.reporting import IMAGES_DIR

LOG = logging.getLogger(__name__)

TEMPLATES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")
CONFIG_FILENAME = "mergekit_config.yml"
README_FILENAME = "README.md"
TAGS = ("mergekit", "merge", "mergekit-ext")

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_PARTIAL_DIR = re.compile(r"^\.(?P<name>.+)\.partial-[^/\\]*$")

# Architecture-name suffix → (template, pipeline_tag, transformers Auto class).
_HEAD_SUFFIXES: tuple[tuple[str, str, Optional[str], str], ...] = (
    ("ForCausalLM", "causal_lm", "text-generation", "AutoModelForCausalLM"),
    ("LMHeadModel", "causal_lm", "text-generation", "AutoModelForCausalLM"),
    ("ForImageClassification", "vision", "image-classification", "AutoModelForImageClassification"),
    ("ForSemanticSegmentation", "vision", "image-segmentation", "AutoModelForSemanticSegmentation"),
    ("ForObjectDetection", "vision", "object-detection", "AutoModelForObjectDetection"),
    (
        "ForSequenceClassification",
        "encoder",
        "text-classification",
        "AutoModelForSequenceClassification",
    ),
    (
        "ForTokenClassification",
        "encoder",
        "token-classification",
        "AutoModelForTokenClassification",
    ),
    ("ForQuestionAnswering", "encoder", "question-answering", "AutoModelForQuestionAnswering"),
    ("ForMaskedLM", "encoder", "fill-mask", "AutoModelForMaskedLM"),
    ("ForMultipleChoice", "encoder", None, "AutoModelForMultipleChoice"),
)
# Whole-model architectures without a task suffix.
_EXACT_ARCHITECTURES: dict[str, tuple[str, Optional[str], str]] = {
    "CLIPModel": ("vision", "zero-shot-image-classification", "AutoModel"),
    "SiglipModel": ("vision", "zero-shot-image-classification", "AutoModel"),
    "Siglip2Model": ("vision", "zero-shot-image-classification", "AutoModel"),
    "CLIPVisionModel": ("vision", "image-feature-extraction", "CLIPVisionModel"),
    "CLIPVisionModelWithProjection": (
        "vision",
        "image-feature-extraction",
        "CLIPVisionModelWithProjection",
    ),
    "CLIPTextModel": ("encoder", "feature-extraction", "CLIPTextModel"),
    "CLIPTextModelWithProjection": ("encoder", "feature-extraction", "CLIPTextModelWithProjection"),
}


# ------------------------------------------------------------------------- architecture


@dataclass(frozen=True)
class ArchitectureInfo:
    """What the merged ``config.json`` says the model is, and how the card presents it."""

    architecture: Optional[str]
    model_type: Optional[str]
    template: str  # causal_lm | vision | encoder
    pipeline_tag: Optional[str]
    auto_class: str


def _is_vision_config(config: Mapping[str, Any]) -> bool:
    if config.get("vision_config") is not None and config.get("text_config") is None:
        return True
    if "image_size" in config and ("patch_size" in config or "num_channels" in config):
        return True
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_MAPPING_NAMES

        return str(config.get("model_type")) in MODEL_FOR_IMAGE_MAPPING_NAMES
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False


def _is_decoder_type(model_type: Optional[str]) -> bool:
    try:
        from transformers.models.auto.modeling_auto import (
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
            MODEL_FOR_MASKED_LM_MAPPING_NAMES,
        )
    except ImportError:  # pragma: no cover
        return False
    return (
        model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES
    )


def architecture_info(config: Mapping[str, Any]) -> ArchitectureInfo:
    """Template, pipeline tag and Auto class from a ``config.json`` (architectures, model_type)."""
    architectures = config.get("architectures") or []
    arch = str(architectures[0]) if architectures else None
    model_type = config.get("model_type")
    if arch in _EXACT_ARCHITECTURES:
        template, tag, auto = _EXACT_ARCHITECTURES[arch]
        return ArchitectureInfo(arch, model_type, template, tag, auto)
    if arch:
        for suffix, template, tag, auto in _HEAD_SUFFIXES:
            if arch.endswith(suffix):
                return ArchitectureInfo(arch, model_type, template, tag, auto)
        if arch.endswith("ForConditionalGeneration"):
            if config.get("vision_config") is not None:
                return ArchitectureInfo(
                    arch,
                    model_type,
                    "causal_lm",
                    "image-text-to-text",
                    "AutoModelForImageTextToText",
                )
            return ArchitectureInfo(
                arch, model_type, "causal_lm", "text2text-generation", "AutoModelForSeq2SeqLM"
            )
    # A bare body (``LlamaModel``, ``BertModel``, ``ViTModel``) or no architectures at all.
    if _is_vision_config(config):
        return ArchitectureInfo(arch, model_type, "vision", "image-feature-extraction", "AutoModel")
    if _is_decoder_type(model_type):
        return ArchitectureInfo(arch, model_type, "causal_lm", "feature-extraction", "AutoModel")
    return ArchitectureInfo(arch, model_type, "encoder", "feature-extraction", "AutoModel")


# ------------------------------------------------------------------------- model inputs


def is_hub_model_id(path: str, search_dirs: Sequence[str] = ()) -> bool:
    """``owner/name`` that is not an existing local path (relative to the CWD or ``search_dirs``).

    Decided offline: the Hub is never asked. A local folder that happens to look like
    ``owner/name`` counts as local as long as it exists where the merge ran.
    """
    if not _HUB_ID.match(path):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    if os.path.exists(path):
        return False
    return not any(os.path.exists(os.path.join(d, path)) for d in search_dirs)


def display_path(path: str, cwd: Optional[str] = None) -> str:
    """A local path as the card shows it: relative as written, or never absolute.

    Absolute paths under ``cwd`` become relative to it; other absolute (or ``~``) paths are
    shown by their folder name only, so no machine path leaks into a public card.
    """
    expanded = os.path.expanduser(path)
    if not os.path.isabs(expanded) and not path.startswith("~"):
        return path.replace(os.sep, "/")
    cwd = os.path.abspath(cwd or os.getcwd())
    normalized = os.path.normpath(expanded)
    try:
        rel = os.path.relpath(normalized, cwd)
    except ValueError:  # another drive on Windows
        rel = os.pardir
    if rel != os.curdir and not rel.startswith(os.pardir):
        return rel.replace(os.sep, "/")
    return os.path.basename(normalized.rstrip(os.sep)) or "model"


@dataclass
class InputModel:
    """One input checkpoint (plus optional LoRA) as the card describes it."""

    role: str  # base | model
    name: str
    path: str
    revision: Optional[str]
    lora: Optional[str]
    is_hub: bool
    lora_is_hub: bool
    display: str
    license: Optional[str] = None
    license_name: Optional[str] = None
    license_link: Optional[str] = None
    license_origin: Optional[str] = None
    # False for outputs whose diagnostics predate the ``inputs`` record (see collect_inputs).
    recorded: bool = True
    commit: Optional[str] = None

    @property
    def hub_ids(self) -> list[str]:
        ids = [self.path] if self.is_hub else []
        if self.lora and self.lora_is_hub:
            ids.append(self.lora)
        return ids

    @property
    def url(self) -> Optional[str]:
        return f"https://huggingface.co/{self.path}" if self.is_hub else None

    @property
    def source(self) -> str:
        return "Hub" if self.is_hub else "local folder"


def _model_entries(cfg: Any) -> list[tuple[str, Any, Optional[str]]]:
    """``(role, ModelReference, task name)`` in config order, base first, deduplicated."""
    merge = cfg.merge
    out: list[tuple[str, Any, Optional[str]]] = []
    seen: set[str] = set()

    def add(role: str, ref: Any, name: Optional[str]) -> None:
        key = str(ref)
        if key in seen:
            for i, (r, existing, n) in enumerate(out):
                if str(existing) == key and n is None and name is not None:
                    out[i] = (r, existing, name)
            return
        seen.add(key)
        out.append((role, ref, name))

    if merge.base_model is not None:
        add("base", merge.base_model, None)
    for i, model in enumerate(merge.models or []):
        name = cfg.models[i].name if i < len(cfg.models) else None
        add("model", model.model, name)
    for s in merge.slices or []:
        for src in s.sources:
            add("model", src.model, None)
    for module in (merge.modules or {}).values():
        for model in module.models or []:
            add("model", model.model, None)
        for s in module.slices or []:
            for src in s.sources:
                add("model", src.model, None)
    return out


def _hub_commit(repo_id: str, revision: Optional[str]) -> Optional[str]:
    """The commit of ``repo_id`` in the local Hugging Face cache (its snapshot folder name)."""
    from huggingface_hub import try_to_load_from_cache

    for filename in ("config.json", "adapter_config.json", README_FILENAME):
        try:
            found = try_to_load_from_cache(repo_id, filename, revision=revision)
        except Exception as e:  # noqa: BLE001 - a broken cache must not break the merge
            LOG.debug("cache lookup for %s failed: %s", repo_id, e)
            return None
        if isinstance(found, str) and os.path.isfile(found):
            return os.path.basename(os.path.dirname(found))
    return None


def _is_local(path: str) -> bool:
    return os.path.exists(os.path.expanduser(path))


def input_records(cfg: Any) -> list[dict[str, Any]]:
    """Where each input of ``cfg`` comes from, decided where the merge reads them.

    Called by the runner while the merge runs (relative paths resolve against that CWD, as
    mergekit resolves them); the card reads the record back, so a card rebuilt from another
    directory never takes a relative folder for a Hub repository. A reference that is not a
    local path was read from the Hugging Face Hub (the merge resolved it from the cache or
    downloaded it): its id, the revision asked for and the cached commit are recorded. The
    license each input declares is recorded too (None: it declares none).
    """
    cwd = os.getcwd()
    records = []
    for role, ref, _ in _model_entries(cfg):
        path = ref.model.path
        lora = ref.lora.path if ref.lora is not None else None
        is_hub = not _is_local(path)
        lora_is_hub = bool(lora) and not _is_local(lora)
        declared = _declared_license(path, is_hub, ref.model.revision, cwd)
        if not declared and lora:
            declared = _declared_license(lora, lora_is_hub, None, cwd)
        records.append(
            {
                "role": role,
                "model": path,
                "revision": ref.model.revision,
                "source": "hub" if is_hub else "local",
                "commit": _hub_commit(path, ref.model.revision) if is_hub else None,
                "lora": lora,
                "lora_source": None if lora is None else ("hub" if lora_is_hub else "local"),
                "license": declared or None,
            }
        )
    return records


def _in_hub_cache(path: str, revision: Optional[str]) -> bool:
    """``owner/name`` found in the local Hugging Face cache (for outputs without a record)."""
    if not _HUB_ID.match(path):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        return False
    return _hub_commit(path, revision) is not None


def collect_inputs(
    cfg: Any, cwd: Optional[str] = None, recorded: Optional[Sequence[Mapping[str, Any]]] = None
) -> list[InputModel]:
    """Every input of the config, as Hub repository or local folder.

    ``recorded`` is the diagnostics' ``inputs`` list, written when the merge ran: the
    source of each input is taken from it, never from the current directory. Outputs
    written before that record existed fall back to the local Hugging Face cache: an
    ``owner/name`` found there is a Hub model, anything else a local folder.
    """
    cwd = cwd or os.getcwd()
    redact = local_path_redactor(cfg.raw, cwd)
    by_key: dict[tuple[str, Optional[str]], Mapping[str, Any]] = {}
    for record in recorded or ():
        if isinstance(record, Mapping) and isinstance(record.get("model"), str):
            by_key.setdefault((record["model"], record.get("lora")), record)
    result = []
    for role, ref, name in _model_entries(cfg):
        path = ref.model.path
        lora = ref.lora.path if ref.lora is not None else None
        # The record holds the paths as published (absolute ones shortened): compare so.
        record = by_key.get((redact(path), redact(lora) if lora else None))
        if record is not None:
            is_hub = record.get("source") == "hub"
            lora_is_hub = bool(lora) and record.get("lora_source") == "hub"
        else:
            is_hub = not os.path.isabs(os.path.expanduser(path)) and _in_hub_cache(
                path, ref.model.revision
            )
            lora_is_hub = bool(lora) and _in_hub_cache(lora, None)
        display = path if is_hub else display_path(path, cwd)
        if lora:
            display += " + " + (lora if lora_is_hub else display_path(lora, cwd))
        result.append(
            InputModel(
                role=role,
                name=name or (os.path.basename(display.split(" + ")[0].rstrip("/")) or display),
                path=path,
                revision=ref.model.revision,
                lora=lora,
                is_hub=is_hub,
                lora_is_hub=lora_is_hub,
                display=display,
                recorded=record is not None,
                commit=(record or {}).get("commit") if is_hub else None,
            )
        )
        if record is not None and "license" in record:
            declared = record.get("license") or {}
            result[-1].license = declared.get("license")
            result[-1].license_name = declared.get("license_name")
            result[-1].license_link = declared.get("license_link")
            result[-1].license_origin = declared.get("origin")
    return result


# ----------------------------------------------------------------------------- licenses


def _front_matter(readme_path: str) -> dict[str, Any]:
    from huggingface_hub import metadata_load

    try:
        return metadata_load(readme_path) or {}
    except (yaml.YAMLError, ValueError, OSError) as e:
        LOG.warning("could not read the front matter of %s: %s", readme_path, e)
        return {}


def _cached_hub_readme(repo_id: str, revision: Optional[str]) -> Optional[str]:
    """README.md of a Hub model from the local cache only (never downloads)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo_id, "README.md", revision=revision)
    except Exception as e:  # noqa: BLE001 - a broken cache must not break the card
        LOG.debug("cache lookup for %s failed: %s", repo_id, e)
        return None
    return found if isinstance(found, str) and os.path.isfile(found) else None


def _declared_license(folder_or_id: str, is_hub: bool, revision: Optional[str], cwd: str) -> dict:
    """The license an input declares in its README front matter or config.json (or {})."""
    if is_hub:
        readme = _cached_hub_readme(folder_or_id, revision)
        meta = _front_matter(readme) if readme else {}
        origin = "README.md (local Hub cache)"
        config: dict[str, Any] = {}
    else:
        folder = os.path.join(cwd, os.path.expanduser(folder_or_id))
        readme = os.path.join(folder, README_FILENAME)
        meta = _front_matter(readme) if os.path.isfile(readme) else {}
        origin = "README.md"
        config = _read_json(os.path.join(folder, "config.json")) or {}
    for source, where in ((meta, origin), (config, "config.json")):
        value = source.get("license")
        if isinstance(value, list):
            value = value[0] if len(value) == 1 else None
        if isinstance(value, str) and value.strip():
            return {
                "license": value.strip().lower(),
                "license_name": source.get("license_name"),
                "license_link": source.get("license_link"),
                "origin": where,
            }
    return {}


@dataclass
class LicenseDecision:
    license: Optional[str]
    license_name: Optional[str]
    license_link: Optional[str]
    explanation: str
    undeclared: list[str] = field(default_factory=list)


def decide_license(inputs: Sequence[InputModel]) -> LicenseDecision:
    """The merged model's license when every input that declares one agrees; else none."""
    declared = [m for m in inputs if m.license]
    undeclared = [m.name for m in inputs if not m.license]
    keys = {(m.license, m.license_name) for m in declared}
    if not declared:
        return LicenseDecision(
            None,
            None,
            None,
            "None of the input models declares a license (in its README front matter or "
            "config.json), so no license is set. Check each input's terms before you share "
            "this model.",
            undeclared,
        )
    if len(keys) > 1:
        listing = ", ".join(
            f"{m.name}: {m.license}{f' ({m.license_name})' if m.license_name else ''}"
            for m in declared
        )
        return LicenseDecision(
            None,
            None,
            None,
            f"The input models declare different licenses ({listing}), so no license is set. "
            "A merge is a derivative of every input: its terms are the combination of theirs; "
            "set the license yourself once you have checked that they are compatible.",
            undeclared,
        )
    license_id, license_name = next(iter(keys))
    links = {m.license_link for m in declared if m.license_link}
    text = f"Every input model that declares a license uses `{license_id}`"
    text += f" ({license_name})" if license_name else ""
    text += ", so the merge carries the same license."
    if undeclared:
        text += " Inputs that declare none: " + ", ".join(undeclared) + "; check their terms."
    return LicenseDecision(
        license_id, license_name, next(iter(links)) if len(links) == 1 else None, text, undeclared
    )


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
        raise ConfigError(f"evaluation results file not found: {path}") from e
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
    env.filters["pct"] = _pct
    env.filters["cell"] = _cell
    env.filters["yamlv"] = _yaml_value
    return env


def _read_json(path: str) -> Optional[dict[str, Any]]:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as fp:
            return json.load(fp)
    except (OSError, json.JSONDecodeError) as e:
        LOG.warning("could not read %s: %s", path, e)
        return None


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _versions(diag: Mapping[str, Any]) -> list[tuple[str, str]]:
    recorded = diag.get("versions") if isinstance(diag.get("versions"), Mapping) else {}
    from mergekit_ext import __version__

    rows = [("mergekit-ext", str(diag.get("mergekit_ext_version") or __version__))]
    for pkg in ("mergekit", "torch", "transformers", "huggingface_hub"):
        rows.append((pkg, str(recorded.get(pkg) or _package_version(pkg))))
    return rows


def _shorten_yaml_paths(text: str, raw: Any, cwd: str) -> tuple[str, bool]:
    """Replace absolute local paths in the YAML text by their display form."""
    found: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, Mapping):
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, str):
            for part in node.split("+"):
                if os.path.isabs(os.path.expanduser(part)) and (
                    part.startswith(("/", "~")) or re.match(r"^[A-Za-z]:[\\/]", part)
                ):
                    found.add(part)

    walk(raw)
    changed = False
    for path in sorted(found, key=len, reverse=True):
        if path in text:
            text = text.replace(path, display_path(path, cwd))
            changed = True
    return text, changed


def local_path_redactor(raw: Any, cwd: Optional[str] = None) -> Callable[[str], str]:
    """A function that replaces the config's absolute local paths in a text by their
    display form (as the card shows them), for every file a merge may publish."""
    where = os.path.abspath(cwd or os.getcwd())
    return lambda text: _shorten_yaml_paths(text, raw, where)[0]


def _model_name(out_dir: str, name: Optional[str], repo_id: Optional[str]) -> str:
    if name:
        return name
    if repo_id:
        return repo_id.split("/")[-1]
    base = os.path.basename(os.path.normpath(os.path.abspath(out_dir)))
    partial = _PARTIAL_DIR.match(base)  # the runner's temporary folder beside OUT_DIR
    return partial.group("name") if partial else base


def _calibration_rows(diag: Mapping[str, Any], cfg: Any, cwd: str) -> list[dict[str, Any]]:
    rows = []
    recorded = diag.get("calibration") or {}
    if isinstance(recorded, Mapping) and recorded:
        for model, info in recorded.items():
            info = info or {}
            source = str(info.get("source") or "")
            rows.append(
                {
                    "model": model,
                    "source": _display_source(source, cwd),
                    "samples": info.get("samples"),
                    "tokens": info.get("tokens"),
                    "modality": info.get("modality") or "",
                    "sha256": info.get("sha256") or "",
                    "recorded": True,
                }
            )
        return rows
    for entry in cfg.models:
        spec = cfg.calibration_for(entry)
        if spec is None or not spec.has_data:
            continue
        rows.append(
            {
                "model": entry.name,
                "source": _display_source(spec.describe(), cwd),
                "samples": spec.samples,
                "tokens": None,
                "modality": "",
                "sha256": "",
                "recorded": False,
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
                "description": doc.get("description") or "",
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
    from mergekit_ext.methods import describe_method

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
    from mergekit_ext.methods import ext_method_info

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


def build_card_context(
    out_dir: str,
    *,
    eval_results: Optional[list[dict[str, Any]]] = None,
    name: Optional[str] = None,
    repo_id: Optional[str] = None,
    cwd: Optional[str] = None,
    render_images: bool = True,
    images_dir: Optional[str] = None,
    card_eval_results: Optional[list[EvalResult]] = None,
) -> CardContext:
    """Read a finished output folder and assemble the card's metadata and template variables.

    ``images_dir`` draws the plots somewhere else than ``out_dir/images`` (the links stay
    ``images/...``): :mod:`~mergekit_ext.hub.publish` renders the uploaded copy of the card
    without touching the folder. ``card_eval_results`` passes evaluation results that are
    already ``EvalResult`` objects (a card's model-index), instead of ``eval_results``.
    """
    from mergekit_ext.config import parse_config

    cwd = os.path.abspath(cwd or os.getcwd())
    config_path = os.path.join(out_dir, CONFIG_FILENAME)
    if not os.path.isfile(config_path):
        raise MergekitExtError(
            f"{out_dir} has no {CONFIG_FILENAME}: it is not the output of a finished merge"
        )
    with open(config_path, encoding="utf-8") as fp:
        config_text = fp.read()
    cfg = parse_config(config_text, config_path)
    cfg.base_dir = cwd  # relative paths in the YAML resolve against the CWD, like mergekit
    model_config = _read_json(os.path.join(out_dir, "config.json"))
    if model_config is None:
        raise MergekitExtError(f"{out_dir} has no readable config.json: re-run the merge")
    diag = diagnostics_mod.load(out_dir)
    arch = architecture_info(model_config)
    model_name = _model_name(out_dir, name, repo_id)
    method = _describe_method(cfg.method)

    inputs = collect_inputs(cfg, cwd, diag.get("inputs"))
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
    license_decision = decide_license(inputs)

    hub_ids: list[str] = []
    for m in inputs:
        for hub_id in m.hub_ids:
            if hub_id not in hub_ids:
                hub_ids.append(hub_id)
    datasets = _hub_datasets(cfg, cwd)
    card_eval = eval_results_to_card(eval_results, model_name) if eval_results else None
    if card_eval_results:
        card_eval = list(card_eval_results)
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
        _diagnostic_sections(diag, images_dir or os.path.join(out_dir, IMAGES_DIR), cfg.parameters)
        if render_images
        else []
    )
    shown_yaml, shortened = _shorten_yaml_paths(config_text.rstrip("\n"), cfg.raw, cwd)
    text_sha = hashlib.sha256(config_text.encode("utf-8")).hexdigest()
    recorded_sha = diag.get("config_sha256")
    has_tokenizer = any(
        os.path.isfile(os.path.join(out_dir, f))
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt")
    )
    has_processor = any(
        os.path.isfile(os.path.join(out_dir, f))
        for f in ("preprocessor_config.json", "processor_config.json")
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
        # A copy the runner already shortened: the hash differs from the recorded original.
        "yaml_shortened": shortened
        or (recorded_sha != text_sha and diag.get("config_written_sha256") == text_sha),
        "config_sha256": recorded_sha or text_sha,
        "config_modified": bool(recorded_sha)
        and recorded_sha != text_sha
        and diag.get("config_written_sha256") != text_sha,
        "seed": diag.get("seed"),
        "resources": _resources(diag),
        "distributed": diag.get("distributed"),
        "calibration": _calibration_rows(diag, cfg, cwd),
        "data_aware": bool(method.get("needs_calibration")),
        "sections": sections,
        "has_diagnostics": bool(diag),
        "eval_rows": eval_rows,
        "versions": _versions(diag),
        "usage": {
            "model_id": repo_id or f"./{model_name}",
            "auto_class": arch.auto_class,
            "has_tokenizer": has_tokenizer,
            "has_processor": has_processor,
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
        raise MergekitExtError(
            f"model card template {context.template!r} not found in "
            f"{template_dir or TEMPLATES_DIR}; reinstall mergekit-ext"
        ) from e
    content = template.render(card_data=context.card_data.to_yaml(), **context.variables)
    return ModelCard(content)


def render_card_for_repo(out_dir: str, repo_id: str, *, template_dir: Optional[str] = None) -> str:
    """The card of ``out_dir`` as it should read on the Hub under ``repo_id``; writes nothing.

    The local ``README.md`` is written for the folder (its name as the title, ``./NAME`` in
    the loading snippets); the uploaded copy is rendered again here with the repository's
    name as the title and ``repo_id`` in every snippet. Image links stay relative
    (``images/...``, uploaded beside the card); the plots are drawn into a temporary folder
    and thrown away, so ``out_dir`` is left exactly as it is. Evaluation results already in
    the local card's model-index are kept.
    """
    import tempfile

    readme = os.path.join(out_dir, README_FILENAME)
    card_eval = None
    if os.path.isfile(readme):
        try:
            card_eval = ModelCard.load(readme).data.eval_results
        except Exception as e:  # noqa: BLE001 - publish checks the card itself
            LOG.warning("could not read the evaluation results of %s: %s", readme, e)
    with tempfile.TemporaryDirectory(prefix="mergekit-ext-card-") as images:
        context = build_card_context(
            out_dir, repo_id=repo_id, images_dir=images, card_eval_results=card_eval
        )
        text = str(render_model_card(context, template_dir))
    return text if text.endswith("\n") else text + "\n"


def write_model_card(
    out_dir: str,
    *,
    eval_results: Optional[list[dict[str, Any]]] = None,
    name: Optional[str] = None,
    repo_id: Optional[str] = None,
    template_dir: Optional[str] = None,
) -> str:
    """Write ``README.md`` and ``images/*.png`` for the merge in ``out_dir``; returns the card path.

    ``name`` is the model's title (default: the folder name; the runner's temporary
    ``.NAME.partial-*`` folder gives NAME); ``repo_id`` is used in the loading snippet when
    the model is about to be published; ``template_dir`` overrides the shipped templates
    (files with the same names: ``causal_lm.md.j2``, ``vision.md.j2``, ``encoder.md.j2``).
    """
    context = build_card_context(out_dir, eval_results=eval_results, name=name, repo_id=repo_id)
    card = render_model_card(context, template_dir)
    path = os.path.join(out_dir, README_FILENAME)
    with open(path, "w", encoding="utf-8") as fp:
        fp.write(str(card) if str(card).endswith("\n") else str(card) + "\n")
    LOG.info("wrote model card %s", path)
    return path
