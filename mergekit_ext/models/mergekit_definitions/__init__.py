"""Architecture definitions that mergekit 0.1.5 lacks or gets wrong under transformers 5.

mergekit finds a model's tensors through ``mergekit.architecture.json_definitions.NAME_TO_ARCH``
(architecture class name → candidate :class:`~mergekit.architecture.ModelArchitecture`).
When a class is missing there it *infers* the layout from the transformers model's
``state_dict`` names, which in transformers 5 no longer match the names on disk for ViT
(``layers.N.attention.q_proj`` in memory, ``encoder.layer.N.attention.attention.query`` in
the checkpoint): every encoder tensor is then marked optional and silently dropped. For
``CLIPModel`` inference fails outright (``get_input_embeddings`` is not implemented).

Importing this package (done by ``import mergekit_ext``) registers, in memory only:

- the JSON definitions shipped in ``definitions/`` (ViTModel, ViTForImageClassification,
  CLIPVisionModel, CLIPVisionModelWithProjection, CLIPModel), written in mergekit's own JSON
  format and parsed by mergekit's own loader. They name the tensors as checkpoints store
  them; ``CLIPVisionModel`` also accepts the transformers-4 layout (``vision_model.`` prefix)
  through aliases. They copy ``preprocessor_config.json`` into the output (tagalong files).
- a repair of mergekit's own definitions whose *optional* weights have aliases (today only
  ``BertModel``'s ``embeddings.position_ids``): mergekit's planner concatenates a list and the
  alias tuple for such weights and raises ``TypeError`` on every merge. The repaired copy
  keeps the primary name only (``position_ids`` is a non-persistent buffer in transformers 5).

- a *checkpoint layout* for the classes transformers 5 holds in a fused layout that their
  checkpoints do not use (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3: experts fused in
  memory, per expert on disk): :mod:`.checkpoint_layout` lists the tensors
  ``save_pretrained`` writes, so merges read and write the per-expert matrices.

Registration puts our definition first in the candidate list of its class name, so it wins
over any same-``model_type`` definition mergekit ships; nothing on disk is changed.
"""

from __future__ import annotations

import importlib.resources
import logging

from mergekit.architecture import json_definitions
from mergekit.architecture.base import ModelArchitecture, ModuleDefinition, WeightInfo
from mergekit.architecture.json_definitions import (
    JsonLayerTemplates,
    JsonModuleArchDef,
    JsonModuleArchitecture,
)

from mergekit_ext.models.mergekit_definitions.checkpoint_layout import (
    checkpoint_layout_architectures,
)

LOG = logging.getLogger(__name__)

DEFINITIONS_FOLDER = "definitions"

_REGISTERED: dict[str, ModelArchitecture] = {}


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


def _put_first(name: str, arch: ModelArchitecture) -> None:
    previous = _REGISTERED.get(name)
    candidates = [
        c
        for c in json_definitions.NAME_TO_ARCH.get(name, [])
        if c is not arch and c is not previous
    ]
    json_definitions.NAME_TO_ARCH[name] = [arch, *candidates]
    _REGISTERED[name] = arch


def register_architectures() -> list[str]:
    """Register the shipped definitions and repairs with mergekit; idempotent.

    Returns the architecture class names registered or repaired (sorted).
    """
    for arch in load_definitions():
        for name in arch.architectures:
            _put_first(name, arch)
        if arch not in json_definitions.JSON_ARCHITECTURES:
            json_definitions.JSON_ARCHITECTURES.append(arch)
    for arch in checkpoint_layout_architectures():
        for name in arch.architectures:
            _put_first(name, arch)
    for name, candidates in list(json_definitions.NAME_TO_ARCH.items()):
        repaired = [repair_optional_aliases(c) for c in candidates]
        if any(r is not None for r in repaired):
            LOG.debug("repaired aliases of optional weights in mergekit's %s", name)
            json_definitions.NAME_TO_ARCH[name] = [r or c for r, c in zip(repaired, candidates)]
            _REGISTERED[name] = next(r for r in repaired if r is not None)
    return sorted(_REGISTERED)


def registered_architectures() -> dict[str, ModelArchitecture]:
    """Architecture class name → the definition mergekit-ext registered for it."""
    return dict(_REGISTERED)


register_architectures()

__all__ = [
    "load_definitions",
    "register_architectures",
    "registered_architectures",
    "repair_optional_aliases",
]
