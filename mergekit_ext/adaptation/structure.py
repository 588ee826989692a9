"""Which parameters of a base model and its experts are shared, task-specific or trained.

A transformers model is a *body* (``model.base_model``, e.g. ``bert`` / ``vit`` / ``model``)
plus head modules outside it (``classifier``, ``lm_head``). Parameters are compared across
models by their *canonical key*: the name relative to the body for body parameters, the
full name for head parameters, so that a headless ``BertModel`` base lines up with
``BertForSequenceClassification`` experts.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from mergekit_ext.errors import ConfigError
from mergekit_ext.models.head_kind import is_causal_lm

LOG = logging.getLogger(__name__)

TASK_LAYER_HEAD = "head"
TASK_LAYER_LAST_BLOCK = "last_block"


def body_prefix(model: nn.Module) -> str:
    """``"bert."`` for ``BertForSequenceClassification``, ``""`` for a headless ``BertModel``."""
    body = getattr(model, "base_model", model)
    if body is model:
        return ""
    for name, module in model.named_modules():
        if module is body:
            return name + "."
    return ""


def canonical_key(name: str, prefix: str) -> str:
    """The name relative to the body (body parameters) or the full name (head parameters)."""
    return name[len(prefix) :] if prefix and name.startswith(prefix) else name


def head_modules(model: nn.Module) -> list[str]:
    """Direct children outside the body that hold parameters (``classifier``, ``lm_head``)."""
    prefix = body_prefix(model)
    if not prefix:
        return []
    body_name = prefix[:-1]
    return [
        name
        for name, child in model.named_children()
        if name != body_name and any(True for _ in child.parameters())
    ]


def last_block(model: nn.Module) -> str:
    """The last element of the body's largest ``nn.ModuleList`` (its stack of blocks)."""
    prefix = body_prefix(model)
    best, best_size = None, -1
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and name.startswith(prefix):
            size = sum(p.numel() for p in module.parameters())
            if size > best_size:
                best, best_size = name, size
    if best is None:
        raise ConfigError(
            f"{type(model).__name__} has no stack of blocks (nn.ModuleList) for "
            "task_layer: last_block; give a module name instead"
        )
    return f"{best}.{len(model.get_submodule(best)) - 1}"


def _module_owns_parameters(model: nn.Module, name: str) -> bool:
    try:
        module = model.get_submodule(name)
    except AttributeError:
        return False
    return any(True for _ in module.parameters())


def task_layer_candidates(model: nn.Module) -> list[str]:
    """Module names worth suggesting: head modules, the blocks, the body's direct children."""
    prefix = body_prefix(model)
    names = [TASK_LAYER_HEAD, TASK_LAYER_LAST_BLOCK, *head_modules(model)]
    body = model.get_submodule(prefix[:-1]) if prefix else model
    for child, _ in body.named_children():
        names.append(prefix + child)
    try:
        blocks = last_block(model).rsplit(".", 1)[0]
        names += [f"{blocks}.{i}" for i in range(len(model.get_submodule(blocks)))]
    except ConfigError:
        pass
    return list(
        dict.fromkeys(
            n
            for n in names
            if n in (TASK_LAYER_HEAD, TASK_LAYER_LAST_BLOCK) or _module_owns_parameters(model, n)
        )
    )


def resolve_task_layer(model: nn.Module, task_layer: str, task: str) -> list[str]:
    """The module name(s) of ``task_layer`` in ``model`` (task ``task``).

    ``head``: the head modules outside the body; for causal LMs (whose head is the
    vocabulary projection, not a task head) and headless models, the last block.
    ``last_block``: the last block of the body. Anything else: a module name, full
    (``bert.encoder.layer.1``) or relative to the body (``encoder.layer.1``).
    """
    if task_layer == TASK_LAYER_HEAD:
        heads = head_modules(model)
        if heads and not is_causal_lm(model):
            return heads
        LOG.info(
            "task %s: %s has no task head; its task layer is the last block",
            task,
            type(model).__name__,
        )
        return [last_block(model)]
    if task_layer == TASK_LAYER_LAST_BLOCK:
        return [last_block(model)]
    prefix = body_prefix(model)
    for name in (task_layer, prefix + task_layer):
        if _module_owns_parameters(model, name):
            return [name]
    all_names = [n for n, _ in model.named_modules() if n]
    close = difflib.get_close_matches(task_layer, all_names, n=3, cutoff=0.6)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise ConfigError(
        f"symerge: task_layer {task_layer!r} is not a module with parameters in "
        f"{type(model).__name__} (task {task}); {hint}candidates: "
        f"{', '.join(task_layer_candidates(model))}"
    )


def parameters_under(model: nn.Module, modules: Iterable[str]) -> list[str]:
    """Full names of the (de-duplicated) parameters inside the given modules."""
    roots = tuple(m + "." for m in modules)
    return [name for name, _ in model.named_parameters() if name.startswith(roots)]


@dataclass
class TaskRoles:
    """How each parameter of one expert is treated (full parameter names of that expert).

    - ``shared``: full name -> canonical key; merged as ``θ_0 + Σ_k λ[p,k] Δ_k``
    - ``task_layer``: the names trained per task, initialised from the expert
    - ``frozen``: task-specific parameters kept at the expert's value (e.g. a head whose
      shape the other experts do not share, when the task layer is a block)
    """

    name: str
    prefix: str
    task_layer_modules: list[str]
    shared: dict[str, str]
    task_layer: list[str]
    frozen: list[str]


def plan_roles(
    base: nn.Module,
    experts: Sequence[nn.Module],
    task_names: Sequence[str],
    task_layer: str,
    expert_labels: Sequence[str],
) -> tuple[list[str], list[TaskRoles]]:
    """The λ-merged canonical keys (in the base's order) and every expert's roles.

    A key is λ-merged when the base and every expert hold it with one shape and it is no
    task's task layer. Raises :class:`~mergekit_ext.errors.ModelInputError` when an
    expert's body tensor has another shape than the base's; body tensors the base lacks
    stay task-specific (with a warning).
    """
    from mergekit_ext.errors import ModelInputError

    base_prefix = body_prefix(base)
    base_shapes = {
        canonical_key(n, base_prefix): tuple(p.shape) for n, p in base.named_parameters()
    }
    roles: list[TaskRoles] = []
    layer_keys: set[str] = set()
    expert_keys: list[dict[str, str]] = []  # per expert: full name -> canonical key
    expert_shapes: list[dict[str, tuple[int, ...]]] = []  # per expert: canonical key -> shape
    for expert, task, label in zip(experts, task_names, expert_labels):
        prefix = body_prefix(expert)
        modules = resolve_task_layer(expert, task_layer, task)
        layer_names = parameters_under(expert, modules)
        keys, shapes = {}, {}
        for name, p in expert.named_parameters():
            key = keys[name] = canonical_key(name, prefix)
            shapes[key] = tuple(p.shape)
            in_body = not prefix or name.startswith(prefix)
            if in_body and key in base_shapes and shapes[key] != base_shapes[key]:
                raise ModelInputError(
                    f"expert {label} ({task}): body tensor {name} has shape {list(p.shape)} but "
                    f"the base model's is {list(base_shapes[key])}; SyMerge merges experts that "
                    "share the base's body"
                )
        layer_keys.update(keys[n] for n in layer_names)
        expert_keys.append(keys)
        expert_shapes.append(shapes)
        roles.append(TaskRoles(task, prefix, modules, {}, layer_names, []))

    shared_keys = [
        key
        for key, shape in base_shapes.items()
        if key not in layer_keys and all(s.get(key) == shape for s in expert_shapes)
    ]
    shared_set = set(shared_keys)
    for role, keys in zip(roles, expert_keys):
        layer = set(role.task_layer)
        for name, key in keys.items():
            if name in layer:
                continue
            if key in shared_set:
                role.shared[name] = key
            else:
                role.frozen.append(name)
        frozen_body = [n for n in role.frozen if not role.prefix or n.startswith(role.prefix)]
        if frozen_body:
            LOG.warning(
                "task %s keeps its own value for body tensors not shared by the base and every "
                "expert: %s",
                role.name,
                ", ".join(frozen_body),
            )
    return shared_keys, roles


def frozen_modules(roles: TaskRoles) -> list[str]:
    """The modules holding a task's frozen parameters, outside its task layer (for a PEFT
    adapter's ``modules_to_save``, which saves whole modules)."""
    layer = tuple(m + "." for m in roles.task_layer_modules)
    parents = (n.rsplit(".", 1)[0] for n in roles.frozen if not n.startswith(layer))
    return list(dict.fromkeys(parents))
