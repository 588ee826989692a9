"""The checks :func:`mergekit_ext.preflight.preflight` runs, in its order, before any weight is
loaded (a check is called from there, once, never from the runner or an executor).

Each check raises a :class:`~mergekit_ext.errors.MergekitExtError` subclass whose message
names the model, tensor or field at fault and says what to do.
"""

from __future__ import annotations

import difflib
import glob
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable
from typing import Any, Optional

from mergekit_ext.config import ExtMergeConfig
from mergekit_ext.errors import ConfigError, ModelInputError, ModelNotFoundError
from mergekit_ext.methods.registry import (
    all_method_names,
    ext_method_info,
    mergekit_method,
    method_kind,
)
from mergekit_ext.models.model_files import check_model_files, read_json_object, safetensors_header
from mergekit_ext.models.model_paths import (
    PICKLE_PATTERNS,
    VOCABULARY_FILES,
    cached_snapshot,
    checkpoint_shapes,
    is_config_only,
    model_paths,
    read_config_json,
)
from mergekit_ext.offline import hub_offline

LOG = logging.getLogger(__name__)


def check_method(name: str) -> None:
    names = all_method_names()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(
            f"unknown merge_method {name!r}{hint} (`mergekit-ext methods` lists all {len(names)})"
        )


def looks_like_hub_id(path: str) -> bool:
    """``owner/name`` that is not a local path (decided offline, without asking the Hub)."""
    if path.startswith((".", "/", "~")) or os.path.exists(path):
        return False
    parts = path.split("/")
    return len(parts) == 2 and all(parts)


def check_model_paths(cfg: ExtMergeConfig, allow_pickle: bool, dry_run: bool = False) -> None:
    """Every input exists and holds a config and weights (safetensors; pickles if allowed).

    With ``dry_run`` a folder with only a ``config.json`` is accepted: its shapes come
    from its transformers class (:func:`~mergekit_ext.models.model_paths.config_shapes`), so the
    memory of a merge can be planned before the weights are downloaded.
    """
    weightless: list[str] = []
    for ref in _referenced(cfg):
        for path in model_paths(ref):
            if looks_like_hub_id(path):
                path = hub_model_folder(path, ref)
                if path is None:
                    continue  # downloaded (with a progress bar) when the merge opens it
            if not os.path.isdir(path):
                raise ModelNotFoundError(
                    f"model path not found: {path!r} (referenced as {ref!r}); check the path "
                    "in the YAML (relative paths resolve against the current directory)"
                )
            # config.json, adapter_config.json, shard indexes, safetensors headers
            check_model_files(path, f"model {ref}")
            if os.path.exists(os.path.join(path, "adapter_config.json")):
                continue  # a PEFT adapter: its weights are checked when merged
            if is_config_only(path):
                if path not in weightless:
                    weightless.append(path)
                continue
            has_safetensors = bool(glob.glob(os.path.join(glob.escape(path), "*.safetensors")))
            pickles = [
                f
                for pat in PICKLE_PATTERNS
                for f in glob.glob(os.path.join(glob.escape(path), pat))
            ]
            if not has_safetensors and pickles:
                if not allow_pickle:
                    raise ModelInputError(
                        f"model {path!r} has only pickle checkpoints ({os.path.basename(pickles[0])}); "
                        "pickles can run arbitrary code when loaded: convert it to safetensors, "
                        "or pass --allow-pickle if you trust it"
                    )
            elif not has_safetensors:
                raise ModelNotFoundError(f"model {path!r} has no .safetensors weights")
            if not os.path.exists(os.path.join(path, "config.json")):
                raise ModelNotFoundError(f"model {path!r} has no config.json")
    weightless.sort()  # mergekit's referenced models come in no fixed order
    if weightless and not dry_run:
        one = len(weightless) == 1
        raise ModelNotFoundError(
            f"model{'' if one else 's'} {', '.join(repr(p) for p in weightless)} "
            f"{'has' if one else 'have'} no weights (only config.json): download the "
            "*.safetensors files to merge; `mergekit-ext run CONFIG OUT --dry-run` plans the "
            "merge (shapes and memory per rank) without them"
        )
    for path in weightless:
        LOG.warning("%s: shapes from config.json (no weights): dry run only", path)


def hub_model_folder(repo_id: str, ref: str) -> Optional[str]:
    """The cached folder of a Hub model, None to download it, an error when offline."""
    folder = cached_snapshot(repo_id)
    if folder is None and hub_offline():
        raise ModelInputError(
            f"model {repo_id!r} (referenced as {ref!r}) is not a local folder nor in the "
            "Hugging Face cache, and HF_HUB_OFFLINE is set: download it first "
            f"(`hf download {repo_id}`), or unset HF_HUB_OFFLINE"
        )
    return folder


def _referenced(cfg: ExtMergeConfig) -> list[str]:
    refs = [str(m) for m in cfg.merge.referenced_models()]
    return list(dict.fromkeys(refs))


def check_compatible(cfg: ExtMergeConfig, allow_crimes: bool, shapes: bool = True) -> None:
    """Same architecture and (with ``shapes``) the same tensor shapes across all full inputs.

    The shape check is for the data-aware methods; mergekit's tensor-wise methods follow
    mergekit's own rules (``tokenizer_source`` resizes embeddings, slices pick layers).
    """
    refs = [r for r in _referenced(cfg) if "+" not in r]
    local = [r for r in refs if os.path.isdir(model_paths(r)[0])]
    local = [r for r in local if os.path.exists(os.path.join(r, "config.json"))]
    if len(local) < 2:
        return
    base_ref = str(cfg.merge.base_model) if cfg.merge.base_model else local[0]
    if base_ref not in local:
        base_ref = local[0]
    base_cfg = read_config_json(base_ref)
    if not allow_crimes:
        for ref in local:
            other = read_config_json(ref)
            if other.get("model_type") != base_cfg.get("model_type"):
                raise ModelInputError(
                    f"models of different architectures: {base_ref} is "
                    f"{base_cfg.get('model_type')!r}, {ref} is {other.get('model_type')!r}; "
                    "merge models that share one architecture (or pass --allow-crimes)"
                )
    if not shapes:
        return
    base_shapes = _strip_prefixes(checkpoint_shapes(base_ref))
    for ref in local:
        if ref == base_ref:
            continue
        shapes = _strip_prefixes(checkpoint_shapes(ref))
        for name in sorted(set(base_shapes) & set(shapes)):
            if base_shapes[name] != shapes[name]:
                raise ModelInputError(
                    f"tensor {name} has shape {list(shapes[name])} in {ref} but "
                    f"{list(base_shapes[name])} in {base_ref}; the models must share shapes"
                )


_PREFIXES = ("model.", "bert.", "roberta.", "vit.", "transformer.")


def _strip_prefixes(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    out = {}
    for name, shape in shapes.items():
        for p in _PREFIXES:
            if name.startswith(p):
                name = name[len(p) :]
                break
        out[name] = shape
    return out


def check_parameter_names(cfg: ExtMergeConfig) -> list[str]:
    """Warn (and return the warnings) for parameter names the method does not know.

    mergekit silently ignores misspelt parameters; a typo then merges with a default.
    """
    method = mergekit_method(cfg.method)
    known = {p.name for p in method.spec.parameters}
    info = ext_method_info(cfg.method)
    if info is not None:
        known |= info.parameter_names
    warnings = []
    for where, names in _parameter_sites(cfg):
        for name in names:
            if name not in known:
                close = difflib.get_close_matches(name, sorted(known), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                msg = (
                    f"{where}: parameter {name!r} is not a parameter of {cfg.method}{hint}; "
                    f"it is ignored. Known: {', '.join(sorted(known)) or 'none'}"
                )
                LOG.warning(msg)
                warnings.append(msg)
    return warnings


def check_parameter_values(cfg: ExtMergeConfig) -> None:
    """Validate the values of mergekit-ext's methods' parameters before anything loads.

    Each method declares its parameters once, with types and ranges
    (``methods/parameters.py``); a value outside them is a ``ConfigError`` that names the
    field, the value and the allowed range, never a silent clamp. Our methods read only the
    global ``parameters:`` section; a value given per model is checked the same way.
    mergekit's methods: every site, by :mod:`~mergekit_ext.methods.mergekit_ranges`.
    """
    info = ext_method_info(cfg.method)
    if info is None:  # mergekit's own methods: their types, finiteness and ranges
        from mergekit_ext.methods.mergekit_ranges import check_values

        for where, _ in _parameter_sites(cfg):
            site = cfg.parameters if where == "parameters" else _site_values(cfg, where)
            check_values(cfg.method, where, site, inherited=cfg.parameters)
        return
    info.parse_parameters(cfg.parameters)
    known = info.parameter_names
    for where, names in _parameter_sites(cfg):
        if where == "parameters":
            continue
        site = _site_values(cfg, where)
        given = {n: site[n] for n in names if n in known and _is_scalar(site[n])}
        try:
            info.parse_parameters(given)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from e


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (int, float, str, bool)) or value is None


def _site_values(cfg: ExtMergeConfig, where: str) -> dict[str, Any]:
    raw = cfg.raw
    if where.startswith("models["):
        return raw["models"][int(where[len("models[") : where.index("]")])]["parameters"]
    i = int(where[len("slices[") : where.index("]")])
    j = int(where[where.index("sources[") + len("sources[") : where.rindex("]")])
    return raw["slices"][i]["sources"][j]["parameters"]


def _parameter_sites(cfg: ExtMergeConfig) -> Iterable[tuple[str, Iterable[str]]]:
    raw = cfg.raw
    if isinstance(raw.get("parameters"), dict):
        yield "parameters", raw["parameters"].keys()
    for i, m in enumerate(raw.get("models") or []):
        if isinstance(m, dict) and isinstance(m.get("parameters"), dict):
            yield f"models[{i}] ({m.get('model')}).parameters", m["parameters"].keys()
    for i, s in enumerate(raw.get("slices") or []):
        for j, src in enumerate((s or {}).get("sources") or []):
            if isinstance(src, dict) and isinstance(src.get("parameters"), dict):
                yield f"slices[{i}].sources[{j}].parameters", src["parameters"].keys()


def check_models_list(cfg: ExtMergeConfig) -> None:
    """Data-aware methods merge whole models listed under ``models:``.

    ``slices:`` / ``modules:`` (frankenmerges, per-module layer ranges) stack or pick layers
    one tensor at a time, which only mergekit's tensor-wise methods do.
    """
    kind = method_kind(cfg.method)
    if not kind.data_aware:
        return
    for key in ("slices", "modules"):
        if cfg.raw.get(key):
            raise ConfigError(
                f"`{key}:` is not supported by {cfg.method} ({kind.name} method): it merges "
                "whole models listed under `models:` (with `base_model:`). Write the models "
                f"as a `models:` list, or use a tensor-wise method (linear, slerp, ties, "
                f"passthrough, ...) for a {key}-based merge"
            )


def check_calibration_present(cfg: ExtMergeConfig) -> None:
    """A data-aware method needs a base model and calibration data for every expert."""
    info = ext_method_info(cfg.method)
    if info is not None and info.needs_calibration:
        cfg.check_data_aware(cfg.method)


def tokenizer_sources(cfg: ExtMergeConfig) -> list[str]:
    """The models the output's tokenizer (or token embeddings) come from.

    ``tokenizer_source:`` / ``tokenizer: {source:, tokens:}``, which mergekit's
    ``referenced_models()`` leaves out; ``base`` and ``union`` name no extra model.
    """
    from mergekit.common import ModelReference
    from mergekit.tokenizer.config import ModelTokenEmbedding

    merge = cfg.merge
    found: list[Any] = [merge.tokenizer_source]
    if merge.tokenizer is not None:
        found.append(merge.tokenizer.source)
        for token in (merge.tokenizer.tokens or {}).values():
            source = token.source
            # ``{kind: model_token, model: M}`` names M; a bare ``source: M`` is M itself
            # (a ModelReference has a ``model`` attribute too: its ModelPath, not a reference).
            found.append(source.model if isinstance(source, ModelTokenEmbedding) else source)
    return list(dict.fromkeys(str(s) for s in found if isinstance(s, ModelReference)))


def local_input_paths(cfg: ExtMergeConfig, extra: Iterable[str] = ()) -> list[str]:
    """Every existing local path the merge reads: models, adapters, the tokenizer source,
    calibration data, the config file, and ``extra`` (plugin files, caches); an output may
    not touch any of them."""
    refs = _referenced(cfg) + tokenizer_sources(cfg)
    paths = [path for ref in dict.fromkeys(refs) for path in model_paths(ref)]
    specs = [cfg.calibration_for(e) for e in cfg.models] + [cfg.calibration_defaults]
    paths += [str(spec.path) for spec in specs if spec is not None and spec.path]
    if cfg.path:
        paths.append(cfg.path)
    paths += list(extra)
    return [p for p in dict.fromkeys(paths) if p and os.path.exists(p)]


_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def _layer_counts(config: dict[str, Any]) -> dict[str, int]:
    """Layer counts a config.json declares, top level and per sub-model (text/vision)."""
    counts = {key: config[key] for key in _LAYER_KEYS if isinstance(config.get(key), int)}
    for sub, value in config.items():
        if sub.endswith("_config") and isinstance(value, dict):
            counts.update({f"{sub}.{k}": v for k, v in _layer_counts(value).items()})
    return counts


def _layer_values(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every layer-count key of a config.json with its raw value, sub-models included."""
    found = {f"{prefix}{k}": config[k] for k in _LAYER_KEYS if k in config}
    for sub, value in config.items():
        if sub.endswith("_config") and isinstance(value, dict):
            found.update(_layer_values(value, f"{prefix}{sub}."))
    return found


def check_layer_counts(cfg: ExtMergeConfig) -> None:
    """With ``models:`` every full input must have as many layers as the others.

    mergekit fails on the first missing tensor with a bare RuntimeError; this names the
    models and their layer counts before anything loads. (``slices:`` may pick layer ranges
    from models of different depths, so it is not checked.)
    """
    if not cfg.merge.models:
        return
    refs = [r for r in _referenced(cfg) if "+" not in r]
    local = [r for r in refs if os.path.isfile(os.path.join(model_paths(r)[0], "config.json"))]
    configs = {r: read_config_json(model_paths(r)[0]) for r in local}
    for ref, config in configs.items():
        for key, value in _layer_values(config).items():
            if value is None:  # some configs leave an unused key empty
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                path = os.path.join(model_paths(ref)[0], "config.json")
                raise ModelInputError(
                    f"{path}: {key} is {value!r}, not a whole number of layers; fix that "
                    "config.json"
                )
    counts = {r: _layer_counts(c) for r, c in configs.items()}
    if len({tuple(sorted(c.items())) for c in counts.values()}) > 1:
        listed = "; ".join(
            f"{r}: {', '.join(f'{k}={v}' for k, v in sorted(c.items())) or 'unknown'}"
            for r, c in counts.items()
        )
        raise ModelInputError(
            f"the models have different numbers of layers ({listed}); merge models of the same "
            "depth, or use `slices:` to pick matching layer ranges"
        )


def _tokenizer_digest(folder: str) -> Optional[str]:
    for name in VOCABULARY_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as fp:
                data = fp.read()
            if name == "tokenizer.json":
                _check_tokenizer_json(path, data)
            return f"{name}:{hashlib.sha256(data).hexdigest()}"
    return None


def _check_tokenizer_json(path: str, data: bytes) -> None:
    """A damaged tokenizer.json read as "the tokenizers differ" and then as a missing one."""
    try:
        json.loads(data)
    except ValueError as e:
        raise ModelInputError(
            f"{path} is damaged: it is not JSON ({e}); copy a good tokenizer.json from "
            "where the model came from (or remove it if the folder has tokenizer.model / "
            "vocab files the tokenizer can be built from)"
        ) from None


def warn_tokenizers_differ(cfg: ExtMergeConfig) -> list[str]:
    """Warn (and return the warnings) when the inputs' tokenizers are not identical.

    Weights of models with different vocabularies do not line up row by row; the data-aware
    methods refuse them when they tokenize calibration data, the data-free ones only warn.
    Silent when ``tokenizer_source:`` / ``tokenizer:`` is set: the user chose the output's
    tokenizer (mergekit then aligns the embedding rows), which is what the warning advises.
    """
    if cfg.merge.tokenizer_source is not None or cfg.merge.tokenizer is not None:
        return []
    digests = {}
    for ref in _referenced(cfg):
        folder = model_paths(ref)[0]
        if os.path.isdir(folder):
            digest = _tokenizer_digest(folder)
            if digest is not None:
                digests[ref] = digest
    if len(set(digests.values())) <= 1:
        return []
    groups: dict[str, list[str]] = {}
    for ref, digest in digests.items():
        groups.setdefault(digest, []).append(ref)
    msg = (
        "the input models' tokenizers differ ("
        + " vs ".join(", ".join(refs) for refs in groups.values())
        + "); their embedding rows may mean different tokens: merge models that share one "
        "tokenizer, or set `tokenizer_source:`/`tokenizer:` in the YAML"
    )
    LOG.warning(msg)
    return [msg]


def check_checkpoint_classes(cfg: ExtMergeConfig) -> None:
    """Read each local input as its own transformers class would (see :mod:`model_class`).

    Logs, per model, the tensors its class does not load (old buffers such as
    ``embeddings.position_ids``: every executor ignores them for merging) and refuses
    inputs whose tied weights cannot be merged (:func:`model_class.check_tied_weights`).
    """
    from mergekit_ext.models import model_class

    base_ref = str(cfg.merge.base_model) if cfg.merge.base_model else None
    seen: dict[str, model_class.TyingInput] = {}
    base: model_class.TyingInput | None = None
    experts: list[model_class.TyingInput] = []
    for ref in _referenced(cfg):
        path = model_paths(ref)[0]  # base+LoRA: the full model under the adapter
        if not os.path.isfile(os.path.join(path, "config.json")):
            continue
        key = os.path.realpath(path)
        if key not in seen:
            seen[key] = _tying_input(path)
        tying = seen[key]
        if ref == base_ref or (base_ref is not None and "+" not in ref and path == base_ref):
            base = tying
        else:
            experts.append(model_class.TyingInput(ref, tying.tied, tying.keys))
    model_class.check_tied_weights(base, experts)


def _tying_input(path: str) -> Any:
    """``path`` read by its own class: logs its unloaded tensors, returns its tying."""
    import transformers

    from mergekit_ext.models import model_class

    try:
        config = transformers.AutoConfig.from_pretrained(path)
        model = model_class.meta_model(config)
    except Exception as e:  # a class we cannot build offline: nothing to decide from
        LOG.debug("%s: cannot build its transformers class (%s); tensors taken as listed", path, e)
        return model_class.TyingInput(path, {}, frozenset())
    module_keys = model_class.rename_to_module_keys(model, checkpoint_shapes(path))
    model_class.log_unloaded(
        path, model_class.unloaded_keys(model, module_keys), type(model).__name__
    )
    return model_class.TyingInput(
        path, model_class.tied_weights(model), frozenset(model.state_dict())
    )


# ------------------------------------------------------------------------ LoRA adapters

_PEFT_PREFIX = "base_model.model."
# (suffix of a PEFT tensor key, factor, module kind)
_LORA_SUFFIXES = (
    (".lora_A.weight", "A", "linear"),
    (".lora_B.weight", "B", "linear"),
    (".lora_embedding_A", "A", "embedding"),
    (".lora_embedding_B", "B", "embedding"),
)
# ``layers.7.`` and its stack (``layers``, ``encoder.layer``, ``h``, ``blocks``)
_LAYER_INDEX = re.compile(r"^(?P<stack>(?:.*\.)?(?:layers|layer|h|blocks|block))\.(?P<i>\d+)\.")


def check_adapters(cfg: ExtMergeConfig) -> list[str]:
    """Each LoRA adapter fits the model it is applied to, checked on the files' headers.

    In every form (``base+adapter`` for mergekit's methods, Chain of Merges and SyMerge; an
    adapter folder alone, applied to ``base_model`` or to the base its config names): every
    adapted module exists in that model, no adapted layer lies beyond its depth, and every
    LoRA update ``B A`` (and every tensor the adapter saves whole) has the shape of the
    weight it changes. A ``base_model_name_or_path`` that names another model while the
    shapes fit is only a warning (a local copy and its Hub id name one model two ways).
    Returns the warnings.
    """
    base_ref = str(cfg.merge.base_model) if cfg.merge.base_model else None
    warnings = []
    for ref in _referenced(cfg):
        paths = model_paths(ref)
        if len(paths) == 2:
            target, adapter = paths
        elif os.path.isfile(os.path.join(paths[0], "adapter_config.json")) and not (
            os.path.isfile(os.path.join(paths[0], "config.json"))
        ):
            adapter, target = paths[0], ""
        else:
            continue
        config_file = os.path.join(adapter, "adapter_config.json")
        if not os.path.isfile(config_file):
            continue  # not an adapter folder: check_model_paths says what it lacks
        config = read_json_object(config_file, f"adapter {adapter}")
        named = str(config.get("base_model_name_or_path") or "")
        target = target or (model_paths(base_ref)[0] if base_ref else named)
        folder = _local_model_folder(target)
        if folder is None or not os.path.isfile(os.path.join(folder, "config.json")):
            continue  # a base not downloaded yet: checked when the executor opens it
        _check_adapter_shapes(ref, adapter, config, target, folder, named)
        if named and not _same_model(named, target, folder):
            msg = (
                f"model {ref}: adapter {adapter} was trained on {named!r} "
                f"(base_model_name_or_path) but is applied to {target!r}; their shapes match, "
                "so it is merged: make sure that is the model it was trained on"
            )
            LOG.warning(msg)
            warnings.append(msg)
    return warnings


def _local_model_folder(ref: str) -> Optional[str]:
    if os.path.isdir(ref):
        return ref
    if looks_like_hub_id(ref.split("@")[0]):
        return cached_snapshot(ref.split("@")[0])
    return None


def _same_model(named: str, target: str, folder: str) -> bool:
    """Whether an adapter's ``base_model_name_or_path`` names ``target`` (as a path, a Hub
    id whose cached snapshot is ``folder``, or the same folder written another way)."""
    if named.rstrip("/") == target.rstrip("/"):
        return True
    if os.path.exists(named):
        return os.path.realpath(named) == os.path.realpath(folder)
    if looks_like_hub_id(named.split("@")[0]):
        snapshot = cached_snapshot(named.split("@")[0])
        return snapshot is not None and os.path.realpath(snapshot) == os.path.realpath(folder)
    return False


def _check_adapter_shapes(
    ref: str, adapter: str, config: dict[str, Any], target: str, folder: str, named: str
) -> None:
    adapter_file = os.path.join(adapter, "adapter_model.safetensors")
    if not os.path.isfile(adapter_file):
        return  # a pickled adapter: refused where it would be read
    trained_on = f" (it names {named!r} as its base)" if named else ""
    where = f"model {ref}: adapter {adapter}"
    header = {k: shape for k, (shape, _) in safetensors_header(adapter_file, where).items()}
    base = _strip_prefixes(checkpoint_shapes(folder))
    depth: dict[str, int] = {}
    for name in base:
        m = _LAYER_INDEX.match(name)
        if m:
            depth[m["stack"]] = max(depth.get(m["stack"], 0), int(m["i"]) + 1)
    pairs: dict[str, dict[str, Any]] = {}
    whole: dict[str, str] = {}
    for key in header:
        stripped = key.removeprefix(_PEFT_PREFIX)
        for suffix, factor, kind in _LORA_SUFFIXES:
            if stripped.endswith(suffix):
                entry = pairs.setdefault(stripped[: -len(suffix)], {"kind": kind})
                entry[factor] = key
                break
        else:
            if ".lora_" not in stripped and ".original_module." not in stripped:
                for wrapper in (".modules_to_save.default.", ".base_layer."):
                    stripped = stripped.replace(wrapper, ".")
                whole[stripped] = key
    targets = [(module + ".weight", entry) for module, entry in pairs.items()]
    targets += [(name, {"kind": "whole", "key": key}) for name, key in whole.items()]
    found = 0
    for weight, entry in targets:
        name = _strip_prefixes({weight: ()}).popitem()[0]
        shown = entry.get("A") or entry.get("key")
        if name not in base:
            m = _LAYER_INDEX.match(name)
            if m and m["stack"] in depth and int(m["i"]) >= depth[m["stack"]]:
                raise ModelInputError(
                    f"{where}: tensor {shown} adapts layer {m['i']} of {m['stack']}, but {target} "
                    f"has {depth[m['stack']]} layers ({m['stack']}.0-{depth[m['stack']] - 1}): "
                    f"the adapter was trained on a deeper model{trained_on}; give the model it "
                    "was trained on as its base"
                )
            continue
        found += 1
        actual = tuple(base[name])
        if entry["kind"] == "whole":
            expected = tuple(header[entry["key"]])
            detail = ""
        else:
            if "A" not in entry or "B" not in entry:
                continue  # an unpaired factor: refused with the details when opened
            a, b = header[entry["A"]], header[entry["B"]]
            expected = (a[1], b[0]) if entry["kind"] == "embedding" else (b[0], a[1])
            if entry["kind"] == "linear" and config.get("fan_in_fan_out"):
                expected = expected[::-1]
            detail = f" (lora_A {list(a)}, lora_B {list(b)})"
        if expected != actual:
            raise ModelInputError(
                f"{where}: tensor {shown}{detail} changes a weight of shape {list(expected)}, "
                f"but {weight} of {target} is {list(actual)}: the adapter was trained on "
                f"another model{trained_on}; give the model it was trained on as its base"
            )
    if targets and not found:  # renamed checkpoints (transformers 5): the executor maps them
        LOG.debug("%s: no adapted weight found under its name in %s", where, target)
