"""The merge's inputs: where each came from (local folder or Hub, commit), how its path shows,
its architecture and licence. The runner records them in the diagnostics when it merges; the
model card (:mod:`mergekit_ext.hub.card`) reads them."""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

LOG = logging.getLogger(__name__)

README_FILENAME = "README.md"

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*/[A-Za-z0-9][A-Za-z0-9_.\-]*$")

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


def dot_path(path: str) -> str:
    """A relative local path as ``./x`` so that ``m/x`` cannot be read as a Hub id."""
    if (
        path.startswith(("./", "../", "/", "~"))
        or path in (".", "..")
        or re.match(r"^[A-Za-z]:[\\/]", path)
    ):
        return path
    return "./" + path


def undot(path: str) -> str:
    return path[2:] if path.startswith("./") else path


# ``model:`` / ``base_model:`` values of a mergekit YAML (block style, optionally quoted)
_MODEL_LINE = re.compile(
    r"^(?P<head>[ \t]*(?:-[ \t]*)?(?:base_)?model[ \t]*:[ \t]*)(?P<q>['\"]?)"
    r"(?P<value>[^'\"#\s]+)(?P=q)",
    re.M,
)


def dot_local_models(text: str, local: Callable[[str], bool]) -> str:
    """``model:`` and ``base_model:`` values of the YAML ``text`` that name a local folder
    (``local(path)``; each side of ``model+lora`` apart) written as ``./path``."""

    def fix(match: re.Match[str]) -> str:
        parts = [dot_path(p) if local(undot(p)) else p for p in match["value"].split("+")]
        return f"{match['head']}{match['q']}{'+'.join(parts)}{match['q']}"

    return _MODEL_LINE.sub(fix, text)


_DOWNLOAD_METADATA = os.path.join(".cache", "huggingface", "download")


def _hub_like(value: Any) -> bool:
    if not isinstance(value, str) or not _HUB_ID.match(value) or os.path.exists(value):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def _download_commit(folder: str) -> Optional[str]:
    """The commit that ``hf download --local-dir`` recorded for the folder's config (first
    line of ``.cache/huggingface/download/<file>.metadata``, huggingface_hub's layout)."""
    meta_dir = os.path.join(folder, _DOWNLOAD_METADATA)
    for name in ("config.json", "adapter_config.json", README_FILENAME):
        try:
            with open(os.path.join(meta_dir, name + ".metadata"), encoding="utf-8") as fp:
                commit = fp.readline().strip()
        except OSError:
            continue
        if re.fullmatch(r"[0-9a-f]{40}", commit):
            return commit
    return None


def _cached_snapshot_id(commit: str) -> Optional[str]:
    """The repo whose snapshot ``commit`` is in the local Hugging Face cache, if one is."""
    from huggingface_hub import constants

    try:
        entries = os.listdir(constants.HF_HUB_CACHE)
    except OSError:
        return None
    for entry in sorted(entries):
        if entry.startswith("models--") and os.path.isdir(
            os.path.join(constants.HF_HUB_CACHE, entry, "snapshots", commit)
        ):
            return entry[len("models--") :].replace("--", "/", 1)
    return None


def downloaded_hub_id(folder: str) -> tuple[Optional[str], Optional[str], Optional[str]]:
    """``(hub id, where it was read, commit)`` of a local folder that ``hf download
    --local-dir`` fetched (it holds ``.cache/huggingface/download``); Nones otherwise.

    The download metadata is the authority: it records the commit each file came from
    (huggingface_hub's ``_local_folder.py``: commit, etag, time; no repository name), and
    the repository whose snapshot of that commit is in the local Hub cache is the folder's
    id. Without one, the folder's own files are hints only, taken when the name they give
    is the folder's name (``hf download org/x --local-dir x``): the README front matter's
    ``model_id`` / ``model-index`` name, then ``config.json``'s ``_name_or_path`` — a
    fine-tune saved with ``save_pretrained`` keeps its parent's ``_name_or_path``, which is
    never its own id. The second element says which source was used (the card shows it).
    """
    if not os.path.isdir(os.path.join(folder, _DOWNLOAD_METADATA)):
        return None, None, None
    commit = _download_commit(folder)
    if commit:
        cached = _cached_snapshot_id(commit)
        if cached:
            return cached, "the Hub cache's snapshot of the downloaded commit", commit
    hints: list[tuple[str, str]] = []
    readme = os.path.join(folder, README_FILENAME)
    meta = _front_matter(readme) if os.path.isfile(readme) else {}
    index = meta.get("model-index")
    named = [meta.get("model_id")]
    if isinstance(index, list) and index and isinstance(index[0], Mapping):
        named.append(index[0].get("name"))
    hints += [(v, "README.md front matter") for v in named if _hub_like(v)]
    config = _read_json(os.path.join(folder, "config.json")) or {}
    if _hub_like(config.get("_name_or_path")):
        hints.append((config["_name_or_path"], "config.json `_name_or_path`"))
    base = os.path.basename(os.path.normpath(folder)).lower()
    for value, origin in hints:
        if value.split("/")[1].lower() == base:
            return value, f"{origin}, a hint (its name is the folder's)", commit
    return None, None, commit


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
    # a local folder fetched from the Hub (`hf download --local-dir`): its id, read back
    # from the folder (:func:`downloaded_hub_id`), and where it was read
    hub_id: Optional[str] = None
    hub_id_origin: Optional[str] = None
    lora_display: Optional[str] = None

    @property
    def hub_ids(self) -> list[str]:
        ids = [self.path] if self.is_hub else ([self.hub_id] if self.hub_id else [])
        if self.lora and self.lora_is_hub:
            ids.append(self.lora)
        return ids

    @property
    def model_id(self) -> Optional[str]:
        """The Hub id of the model (not of a LoRA on it): as given, or read back."""
        return self.path if self.is_hub else self.hub_id

    @property
    def url(self) -> Optional[str]:
        return f"https://huggingface.co/{self.model_id}" if self.model_id else None

    @property
    def lora_url(self) -> Optional[str]:
        return f"https://huggingface.co/{self.lora}" if self.lora and self.lora_is_hub else None

    @property
    def model_display(self) -> str:
        return self.display.split(" + ")[0]

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
        hub_id, origin, commit = (
            (None, None, None) if is_hub else downloaded_hub_id(os.path.expanduser(path))
        )
        records.append(
            {
                "hub_id": hub_id,
                "hub_id_origin": origin,
                "download_commit": commit,
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
            lora_key = record.get("lora")
            by_key.setdefault(
                (undot(record["model"]), undot(lora_key) if lora_key else None), record
            )
    result = []
    for role, ref, name in _model_entries(cfg):
        lora = ref.lora.path if ref.lora is not None else None
        # The record holds the paths as published (absolute ones shortened): compare so.
        record = by_key.get((undot(redact(ref.model.path)), undot(redact(lora)) if lora else None))
        result.append(reference_input(role, ref, cwd, name, record))
    return result


def reference_input(
    role: str,
    ref: Any,
    cwd: Optional[str] = None,
    name: Optional[str] = None,
    record: Optional[Mapping[str, Any]] = None,
) -> InputModel:
    """One input (a mergekit ``ModelReference``) as the card describes it.

    ``record`` is what the merge recorded about it (:func:`input_records`); without one
    (an older output, or the output of another mergekit tool: ``mergekit-moe``,
    ``mergekit-extract-lora``) an ``owner/name`` found in the local Hugging Face cache is
    a Hub model and anything else a local folder, read for the id it was downloaded as.
    """
    cwd = cwd or os.getcwd()
    path = ref.model.path
    lora = ref.lora.path if ref.lora is not None else None
    if record is not None:
        is_hub = record.get("source") == "hub"
        lora_is_hub = bool(lora) and record.get("lora_source") == "hub"
    else:
        is_hub = not os.path.isabs(os.path.expanduser(path)) and _in_hub_cache(
            path, ref.model.revision
        )
        lora_is_hub = bool(lora) and _in_hub_cache(lora, None)
    display = path if is_hub else dot_path(display_path(path, cwd))
    lora_display = None
    if lora:
        lora_display = lora if lora_is_hub else dot_path(display_path(lora, cwd))
        display += " + " + lora_display
    if record is not None and "hub_id" in record:
        hub_id, hub_origin = record.get("hub_id"), record.get("hub_id_origin")
    elif not is_hub:  # an older record, or none: read the folder if it is here
        folder = os.path.join(cwd, os.path.expanduser(path))
        hub_id, hub_origin, _ = downloaded_hub_id(folder)
    else:
        hub_id = hub_origin = None
    shown = lora_display or display
    model = InputModel(
        role=role,
        name=name or (os.path.basename(undot(shown).rstrip("/")) or shown),
        path=path,
        revision=ref.model.revision,
        lora=lora,
        is_hub=is_hub,
        lora_is_hub=lora_is_hub,
        display=display,
        recorded=record is not None,
        commit=(record or {}).get("commit" if is_hub else "download_commit"),
        hub_id=None if is_hub else hub_id,
        hub_id_origin=None if is_hub else hub_origin,
        lora_display=lora_display,
    )
    if record is not None and "license" in record:
        declared = record.get("license") or {}
        model.license = declared.get("license")
        model.license_name = declared.get("license_name")
        model.license_link = declared.get("license_link")
        model.license_origin = declared.get("origin")
    return model


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
    """The merged model's license when every input declares one and they agree; else none,
    with a note that says why and leaves the choice to the user."""
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
    if undeclared:  # a merge derives from every input: one without terms leaves it open
        license_id, license_name = next(iter(keys))
        shown = f"`{license_id}`" + (f" ({license_name})" if license_name else "")
        return LicenseDecision(
            None,
            None,
            None,
            f"Inputs that declare no license: {', '.join(undeclared)}; the others use "
            f"{shown}. A merge derives from every input, so no license is set: check the "
            "terms of those inputs and set the license yourself (the `license:` line of the "
            "front matter).",
            undeclared,
        )
    license_id, license_name = next(iter(keys))
    links = {m.license_link for m in declared if m.license_link}
    text = f"Every input model that declares a license uses `{license_id}`"
    text += f" ({license_name})" if license_name else ""
    text += ", so the merge carries the same license."
    return LicenseDecision(
        license_id, license_name, next(iter(links)) if len(links) == 1 else None, text, undeclared
    )


def _read_json(path: str) -> Optional[dict[str, Any]]:
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as fp:
            return json.load(fp)
    except (OSError, json.JSONDecodeError) as e:
        LOG.warning("could not read %s: %s", path, e)
        return None


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


# An absolute POSIX path (or ``~/...``) standing alone: not a URL's path (``https://h/x``),
# not the second half of ``a/b``; it ends at whitespace, quotes and brackets.
_ABSOLUTE_PATH = re.compile(r"(?<![\w.~/:\-])(~?/[^\s'\"`<>|;,*?(){}\[\]\\]+)")


def _is_local_absolute(path: str) -> bool:
    """``~/...``, or ``/TOP/...`` whose first folder exists on this machine (``/home``,
    ``/tmp``, ``/work``...): what a local path looks like, whatever follows."""
    if path.startswith("~/"):
        return True
    top = path.strip("/").split("/")[0]
    return bool(top) and "/" in path.strip("/") and os.path.isdir("/" + top)


def redact_local_paths(text: str, cwd: Optional[str] = None) -> str:
    """Replace every absolute local path in ``text`` (YAML comments, JSON values, Markdown)
    by its display form (:func:`display_path`: relative to ``cwd`` or the folder name)."""
    where = os.path.abspath(cwd or os.getcwd())

    def shorten(match: re.Match[str]) -> str:
        found = match.group(1)
        path = found.rstrip(".:")  # the end of a sentence or of a YAML key
        if not _is_local_absolute(path):
            return found
        return display_path(path, where) + found[len(path) :]

    return _ABSOLUTE_PATH.sub(shorten, text)


def local_path_redactor(raw: Any, cwd: Optional[str] = None) -> Callable[[str], str]:
    """A function that replaces absolute local paths in a text by their display form (as
    the card shows them), for every file a merge writes or publishes: first the config's
    own paths as written (spaces included), then any other (comments, recorded values)."""
    where = os.path.abspath(cwd or os.getcwd())
    return lambda text: redact_local_paths(_shorten_yaml_paths(text, raw, where)[0], where)
