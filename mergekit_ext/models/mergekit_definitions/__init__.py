"""Architecture definitions that mergekit 0.1.5 lacks or gets wrong under transformers 5,
for mergekit-ext's own runs only.

mergekit finds a model's tensors through ``mergekit.architecture.json_definitions.NAME_TO_ARCH``
(architecture class name → candidate :class:`~mergekit.architecture.ModelArchitecture`).
When a class is missing there it *infers* the layout from the transformers model's
``state_dict`` names, which in transformers 5 no longer match the names on disk for ViT
(``layers.N.attention.q_proj`` in memory, ``encoder.layer.N.attention.attention.query`` in
the checkpoint): every encoder tensor is then marked optional and silently dropped. For
``CLIPModel`` inference fails outright (``get_input_embeddings`` is not implemented).

Importing mergekit-ext changes none of mergekit's definitions (issue #48): a program that
imports both gets mergekit's own behaviour from mergekit's functions. Our entry points
(``mergekit-ext run``, :func:`mergekit_ext.run_merge`) run inside :func:`our_architectures`,
which gives mergekit, for the duration of the run only:

- the JSON definitions shipped in ``definitions/`` (ViTModel, ViTForImageClassification,
  CLIPVisionModel, CLIPVisionModelWithProjection, CLIPModel), written in mergekit's own JSON
  format and parsed by mergekit's own loader. They name the tensors as checkpoints store
  them; ``CLIPVisionModel`` also accepts the transformers-4 layout (``vision_model.`` prefix)
  through aliases. They copy ``preprocessor_config.json`` into the output (tagalong files).
- a repair of mergekit's own definitions whose *optional* weights have aliases (today only
  ``BertModel``'s ``embeddings.position_ids``): mergekit's planner concatenates a list and the
  alias tuple for such weights and raises ``TypeError`` on every merge. The repaired copy
  keeps the primary name only (``position_ids`` is a non-persistent buffer in transformers 5).
- when the checkpoint that sets the output's layout (the base model, else the first model)
  stores its routed experts one matrix each (``experts.0.w1.weight``), a *checkpoint layout*
  for the classes transformers 5 fuses in memory (Mixtral, Qwen2-MoE, Qwen3-MoE,
  DeepSeek-V3): :mod:`.checkpoint_layout` lists the tensors ``save_pretrained`` writes, so
  merges read and write the per-expert matrices. A checkpoint saved fused
  (``mlp.experts.gate_up_proj``, as mergekit itself writes) gets mergekit's own definition.
  Likewise LLaVA when the checkpoint holds ``language_model.model.`` (what transformers 5
  saves): mergekit infers the in-memory names and would drop the language model.

Our definition goes first in the candidate list of its class name, so it wins over any
same-``model_type`` definition mergekit ships; on exit every entry is the very list object it
was before. mergekit's ``run_merge`` has no parameter for the architecture (it asks
``get_architecture_info``), hence the temporary entries; one lock keeps two of our runs in
one process from interleaving them (mergekit's loader cache is per process anyway).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import importlib.resources
import json
import logging
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Optional

from mergekit.architecture import json_definitions
from mergekit.architecture.base import ModelArchitecture, ModuleDefinition, WeightInfo
from mergekit.architecture.json_definitions import (
    JsonLayerTemplates,
    JsonModuleArchDef,
    JsonModuleArchitecture,
)

from mergekit_ext.models.mergekit_definitions.checkpoint_layout import (
    CHECKPOINT_LAYOUT_CLASSES,
    CHECKPOINT_NAMES,
    checkpoint_layout_architectures,
)
from mergekit_ext.models.model_paths import (
    cached_snapshot,
    model_paths,
    split_revision,
    tensor_shapes,
)
from mergekit_ext.offline import hub_offline

LOG = logging.getLogger(__name__)

DEFINITIONS_FOLDER = "definitions"

_LOCK = threading.RLock()  # reentrant: a run's own checks ask again from inside it


@functools.cache
def _shipped() -> tuple[ModelArchitecture, ...]:
    return tuple(load_definitions())


def load_definitions() -> list[ModelArchitecture]:
    """Parse every ``definitions/*.json`` with mergekit's own JSON loader, sorted by file name."""
    folder = importlib.resources.files(__package__).joinpath(DEFINITIONS_FOLDER)
    files = sorted(
        (f for f in folder.iterdir() if f.is_file() and f.name.endswith(".json")),
        key=lambda f: f.name,
    )
    definitions = []
    for f in files:
        try:
            definitions.append(json_definitions._load_architecture_json(f.read_text()))
        except Exception as e:  # pydantic.ValidationError, json.JSONDecodeError
            raise RuntimeError(f"invalid mergekit architecture definition {f.name}: {e}") from e
    return definitions


def _drop_optional_aliases(weights: list[WeightInfo]) -> list[WeightInfo]:
    return [
        w.model_copy(update={"aliases": None}) if w.optional and w.aliases else w for w in weights
    ]


def repair_optional_aliases(arch: ModelArchitecture) -> ModelArchitecture | None:
    """A copy of ``arch`` without aliases on optional weights, or None when it has none.

    mergekit 0.1.5's ``MergePlanner.plan_tensor`` evaluates ``[name] + (aliases or [])`` for
    optional weights; ``aliases`` is a tuple, so any such weight raises ``TypeError``.
    """
    modules = {}
    changed = False
    for key, module in arch.modules.items():
        info = module.architecture
        if not isinstance(info, JsonModuleArchitecture):
            modules[key] = module
            continue
        d = info.definition
        pre = _drop_optional_aliases(d.pre_weights)
        layer = _drop_optional_aliases(d.layer_templates.weights)
        post = _drop_optional_aliases(d.post_weights)
        if (pre, layer, post) == (d.pre_weights, d.layer_templates.weights, d.post_weights):
            modules[key] = module
            continue
        changed = True
        definition = JsonModuleArchDef(
            model_type=d.expected_model_type,
            architectures=d.architectures,
            pre_weights=pre,
            layer_templates=JsonLayerTemplates(weights=layer),
            post_weights=post,
            num_layers_config_key=d.num_layers_config_key,
            override_num_layers=d.override_num_layers,
        )
        modules[key] = ModuleDefinition(
            architecture=JsonModuleArchitecture(definition=definition),
            weight_prefix=module.weight_prefix,
            subfolder=module.subfolder,
        )
    if not changed:
        return None
    return arch.model_copy(update={"modules": modules})


def stores_experts_separately(checkpoint_names: Iterable[str]) -> bool:
    """Whether a checkpoint's tensor names hold routed experts one matrix each
    (``experts.0.w1.weight``), the layout transformers 5's ``save_pretrained`` writes."""
    pattern = CHECKPOINT_NAMES["MixtralForCausalLM"]
    return any(pattern.search(name) for name in checkpoint_names)


def our_definitions(checkpoint_names: Iterable[str] = ()) -> dict[str, list[ModelArchitecture]]:
    """The candidate lists mergekit-ext gives mergekit for the classes it changes.

    Computed from mergekit's current ``NAME_TO_ARCH``, which is not modified.

    Args:
        checkpoint_names: the tensor names of the checkpoint that sets the output layout
            (:func:`layout_tensor_names`); the checkpoint layout of a class applies only
            when they are in it (per-expert matrices for MoE, ``language_model.model.``
            for LLaVA: :func:`~.checkpoint_layout.in_checkpoint_layout`).

    Returns:
        Architecture class name → candidates, ours first.
    """
    current = json_definitions.NAME_TO_ARCH
    table: dict[str, list[ModelArchitecture]] = {}

    def put_first(name: str, arch: ModelArchitecture) -> None:
        candidates = table.get(name, current.get(name, []))
        table[name] = [arch, *(c for c in candidates if c is not arch)]

    for arch in _shipped():
        for name in arch.architectures:
            put_first(name, arch)
    for arch in checkpoint_layout_architectures(checkpoint_names):
        for name in arch.architectures:
            put_first(name, arch)
    for name in set(current) | set(table):
        candidates = table[name] if name in table else current[name]
        repaired = [repair_optional_aliases(c) for c in candidates]  # < 1 ms for all
        if any(r is not None for r in repaired):
            table[name] = [r or c for r, c in zip(repaired, candidates)]
    return table


@contextlib.contextmanager
def our_architectures(
    checkpoint_names: Iterable[str] = (),
) -> Iterator[Mapping[str, ModelArchitecture]]:
    """Inside: mergekit's architecture lookup (``arch_info_for_config``,
    ``get_architecture_info``, hence ``mergekit.merge.run_merge``) sees our definitions.

    On exit, ``NAME_TO_ARCH`` holds exactly the entries (the same list objects) it held on
    entry, whatever happened inside.

    Args:
        checkpoint_names: as for :func:`our_definitions`.

    Yields:
        Architecture class name → the definition mergekit picks for it inside.
    """
    with _LOCK:
        names = json_definitions.NAME_TO_ARCH
        table = our_definitions(checkpoint_names)
        missing = object()
        saved = {name: names.get(name, missing) for name in table}
        try:
            names.update(table)
            yield {name: candidates[0] for name, candidates in table.items()}
        finally:
            for name, before in saved.items():
                if before is missing:
                    names.pop(name, None)
                else:
                    names[name] = before


def layout_tensor_names(model: str, cache_dir: Optional[str] = None) -> frozenset[str]:
    """The tensor names of checkpoint ``model`` when its class is one whose layout on disk
    decides its definition (:data:`~.checkpoint_layout.CHECKPOINT_LAYOUT_CLASSES`).

    Reads the safetensors index or headers (no weight), a cached Hub snapshot, or, online,
    the Hub's safetensors metadata. Never raises: a model it cannot read gives an empty set
    (then mergekit's own definition applies, and the run's checks report the model).

    Args:
        model: a model reference as in a config (folder or Hub id, ``@revision``,
            ``+lora``: the base part is read).
        cache_dir: the Hugging Face cache (``--transformers-cache``).
    """
    try:
        name, revision = split_revision(model_paths(model)[0])
        folder = (
            name
            if os.path.isdir(name)
            else cached_snapshot(name, revision=revision, cache_dir=cache_dir)
        )
        if folder is not None:
            return _folder_names(folder)
        if hub_offline():
            return frozenset()
        return _hub_names(name, revision, cache_dir)
    except Exception as e:  # noqa: BLE001 - the checks report unreadable models
        LOG.debug("tensor names of %s unknown (%s: %s)", model, type(e).__name__, e)
        return frozenset()


def _layout_class(config: Mapping) -> bool:
    return any(a in CHECKPOINT_LAYOUT_CLASSES for a in config.get("architectures") or ())


def _folder_names(folder: str) -> frozenset[str]:
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        if not _layout_class(json.load(f)):
            return frozenset()
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = os.path.join(folder, index_name)
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                return frozenset(json.load(f)["weight_map"])
    names = set(tensor_shapes(folder))
    if not names:  # pickled weights (--allow-pickle): names only, on the meta device
        import torch

        for file in sorted(glob.glob(os.path.join(glob.escape(folder), "*.bin"))):
            state = torch.load(file, map_location="meta", weights_only=True, mmap=True)
            names.update(state)
    return frozenset(names)


def _hub_names(repo_id: str, revision: Optional[str], cache_dir: Optional[str]) -> frozenset[str]:
    import huggingface_hub

    config_file = huggingface_hub.hf_hub_download(
        repo_id, "config.json", revision=revision, cache_dir=cache_dir
    )
    with open(config_file, encoding="utf-8") as f:
        if not _layout_class(json.load(f)):
            return frozenset()
    meta = huggingface_hub.get_safetensors_metadata(repo_id, revision=revision)
    return frozenset(meta.weight_map)


__all__ = [
    "layout_tensor_names",
    "load_definitions",
    "our_architectures",
    "our_definitions",
    "repair_optional_aliases",
    "stores_experts_separately",
]
