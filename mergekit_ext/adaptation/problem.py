"""SyMerge's learnable merged model: ``θ_p = θ_0,p + Σ_k λ[p,k] Δ_k,p`` plus one task layer per task.

The merged weights are a differentiable function of λ evaluated with
``torch.func.functional_call`` on each expert's module skeleton (its parameters replaced by
meta-device placeholders once its tensors are extracted), so no model copy is materialised
per task and step: one merged copy per step, K task vectors, one base.
Reference: AdaMerging's layer-wise coefficients (Yang et al., ICLR 2024) as used by SyMerge
(arXiv 2412.19098, §3); one coefficient per parameter tensor and task.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.func import functional_call

from mergekit_ext.adaptation.structure import TaskRoles, body_prefix, canonical_key, plan_roles
from mergekit_ext.models.head_kind import HeadKind, is_causal_lm, is_causal_lm_class
from mergekit_ext.models.lora import LowRankUpdate

LOG = logging.getLogger(__name__)

# One task's update of one tensor: dense (float32), LoRA factors, or None for an exact zero.
TaskUpdate = Union[torch.Tensor, LowRankUpdate, None]


class FactoredTensors(dict):
    """Merged tensors whose factored keys hold θ_0: the model adds their low-rank update in
    its layers (:meth:`SyMergeProblem.merged_tensors` with ``factored=True``)."""


class TaskVectors:
    """The K task vectors ``Δ_k`` of one shared tensor, in the least memory that keeps them.

    Full checkpoints give dense ``Δ_k = W_k − θ_0``; when every task's is dense and non-zero
    they are one ``(K, *shape)`` stack (the combination is then ``tensordot(λ, stack)``).
    LoRA experts keep ``Δ_k = s · B_k A_k`` as factors, and a tensor a task did not change is
    None: the K + 1 model copies of a dense run shrink to the base plus the factors
    (``docs/methods.md``, section SyMerge, has the sizes measured).
    """

    def __init__(self, shape: Sequence[int], updates: Sequence[TaskUpdate]) -> None:
        self.shape = tuple(shape)
        self.updates: list[TaskUpdate] = list(updates)
        self.stack: Optional[torch.Tensor] = None
        # (A's, B's, task of each rank, scale of each rank), concatenated once for apply()
        self._factors: Optional[tuple[torch.Tensor, ...]] = None
        if self.updates and all(isinstance(u, torch.Tensor) for u in self.updates):
            self.stack = torch.stack(self.updates)  # type: ignore[arg-type]
            self.updates = []

    @property
    def is_zero(self) -> bool:
        """True when no task changed this tensor: θ = θ_0 whatever λ is."""
        return self.stack is None and all(u is None for u in self.updates)

    @property
    def numel(self) -> int:
        """Floats held: the dense updates' and the factors'."""
        if self.stack is not None:
            return self.stack.numel()
        return sum(u.numel() if isinstance(u, torch.Tensor) else u.numel for u in self.updates if u is not None)  # fmt: skip

    def combine(self, coefficients: torch.Tensor) -> Optional[torch.Tensor]:
        """``Σ_k coefficients[k] Δ_k`` (differentiable; None when every Δ_k is zero).

        LoRA factors are combined as one product ``[c_k s_k B_k]_k [A_k]_k`` (out x Σr, Σr x
        in), so no task's dense update is formed.
        """
        if self.stack is not None:
            return torch.tensordot(coefficients, self.stack, dims=1)
        total: Optional[torch.Tensor] = None
        for transposed in (False, True):
            pairs = [
                (coefficients[k] * u.scale * u.b, u.a)
                for k, u in enumerate(self.updates)
                if isinstance(u, LowRankUpdate) and u.transposed == transposed
            ]
            if pairs:
                product = torch.cat([b for b, _ in pairs], 1) @ torch.cat([a for _, a in pairs])
                product = product.T if transposed else product
                total = product if total is None else total + product
        for k, u in enumerate(self.updates):
            if isinstance(u, torch.Tensor):
                total = coefficients[k] * u if total is None else total + coefficients[k] * u
        return total

    @property
    def factored(self) -> bool:
        """True when every non-zero ``Δ_k`` is LoRA factors of a plain ``out x in`` weight:
        its layer can then add ``Σ_k λ_k s_k B_k (A_k x)`` to ``θ_0 x`` (:meth:`apply`)."""
        if self.stack is not None:
            return False
        factors = [u for u in self.updates if u is not None]
        return bool(factors) and all(
            isinstance(u, LowRankUpdate) and not u.transposed for u in factors
        )

    def apply(self, x: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
        """``Σ_k coefficients[k] Δ_k x`` for inputs ``x`` (…, in) of a factored tensor.

        ``((x [A_k]ᵀ) ⊙ [c_k s_k]) [B_k]ᵀ``: two thin products (…, Σr), so neither the merged
        weight nor any ``Δ_k`` is formed, and λ's gradient needs only the (…, Σr) projections.
        """
        if self._factors is None:
            parts = [u for u in self.updates if isinstance(u, LowRankUpdate)]
            self._factors = (
                torch.cat([u.a for u in parts]),  # Σr x in
                torch.cat([u.b for u in parts], 1),  # out x Σr
                torch.tensor(
                    [
                        k
                        for k, u in enumerate(self.updates)
                        if u is not None
                        for _ in range(u.a.shape[0])
                    ]
                ),  # fmt: skip
                torch.cat([torch.full((u.a.shape[0],), u.scale) for u in parts]),
            )
        a, b, task_of_rank, scales = self._factors
        weights = coefficients[task_of_rank] * scales.to(coefficients.device)
        return ((x @ a.T) * weights) @ b.T

    def task(self, k: int) -> Optional[torch.Tensor]:
        """``Δ_k`` as a dense tensor (None for an exact zero)."""
        if self.stack is not None:
            return self.stack[k]
        u = self.updates[k]
        return u.dense() if isinstance(u, LowRankUpdate) else u


def free_parameters(module: nn.Module) -> dict[str, torch.Tensor]:
    """Take a module's parameters out: return ``{name: tensor}`` (de-duplicated names) and
    leave meta-device placeholders of the same shapes behind (ties kept: one placeholder per
    distinct parameter). Buffers stay real, so the skeleton runs under ``functional_call``."""
    tensors = {name: p.detach() for name, p in module.named_parameters()}
    placeholders: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for leaf, p in list(sub._parameters.items()):
            if p is None:
                continue
            if id(p) not in placeholders:
                placeholders[id(p)] = nn.Parameter(
                    torch.empty_like(p, device="meta"), requires_grad=False
                )
            sub._parameters[leaf] = placeholders[id(p)]
    return tensors


def materialise(module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> nn.Module:
    """Put real tensors (by de-duplicated parameter name) into a skeleton, keeping ties."""
    by_placeholder: dict[int, nn.Parameter] = {}
    for name, p in module.named_parameters():
        by_placeholder[id(p)] = nn.Parameter(tensors[name].detach(), requires_grad=False)
    for sub in module.modules():
        for leaf, p in list(sub._parameters.items()):
            if p is not None:
                sub._parameters[leaf] = by_placeholder[id(p)]
    return module


def forward_keys(module: nn.Module) -> Optional[frozenset[str]]:
    """Keyword arguments ``module.forward`` accepts (None when it takes ``**kwargs``)."""
    params = inspect.signature(module.forward).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params)


def model_inputs(
    module: nn.Module, batch: Mapping[str, torch.Tensor], accepts: Optional[frozenset[str]]
) -> dict[str, Any]:
    """The batch entries ``module.forward`` accepts; no KV cache for causal LMs."""
    kwargs: dict[str, Any] = {k: v for k, v in batch.items() if accepts is None or k in accepts}
    if is_causal_lm_class(type(module)) and (accepts is None or "use_cache" in accepts):
        kwargs["use_cache"] = False
    return kwargs


def causal_lm_split(module: nn.Module) -> Optional[tuple[str, str]]:
    """``(body attribute, head weight's parameter name)`` of a causal LM whose logits are
    ``body(x).last_hidden_state @ head.weightᵀ``; None for any other model.

    transformers' causal LMs (Llama, Mistral, Qwen2/3, GPT-2, …) compute exactly that; models
    that rescale or soft-cap their logits say so in their config and are left out. The head's
    name is the de-duplicated parameter name (the embedding's when the head is tied to it).
    """
    if not is_causal_lm(module):
        return None
    config = getattr(module, "config", None)
    for key in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier"):
        if getattr(config, key, None) not in (None, 1, 1.0):
            return None
    body_name = getattr(module, "base_model_prefix", "")
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    if not body_name or not isinstance(getattr(module, body_name, None), nn.Module):
        return None
    if not isinstance(head, nn.Linear) or head.bias is not None:
        return None
    for name, p in module.named_parameters():
        if p is head.weight:
            return body_name, name
    return None


@dataclass
class TaskModel:
    """One task: its expert's skeleton, parameter roles and its trainable task layer."""

    name: str
    module: nn.Module
    roles: TaskRoles
    layer: dict[str, nn.Parameter]  # trainable, initialised from the expert
    layer_init: dict[str, torch.Tensor]  # the expert's task layer (a frozen copy)
    frozen: dict[str, torch.Tensor]  # task-specific, kept at the expert's value
    head_kind: Optional[HeadKind] = None
    accepts: Optional[frozenset[str]] = field(default=None)

    def inputs(self, batch: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        return model_inputs(self.module, batch, self.accepts)


class SyMergeProblem:
    """θ_0, the stacked task vectors, the coefficients λ (P x K) and the task layers.

    ``lambdas[p, k]`` is the coefficient of task vector k on shared tensor
    ``shared_keys[p]``; ``tasks[k].layer`` are task k's trainable task-layer parameters.
    θ_0 and the task vectors are plain tensors (not parameters): nothing updates them.
    """

    def __init__(
        self,
        base: nn.Module,
        shared_keys: Sequence[str],
        base_tensors: Mapping[str, torch.Tensor],
        task_vectors: Mapping[str, TaskVectors],
        tasks: Sequence[TaskModel],
        init_lambda: float,
    ) -> None:
        self.base = base  # the base's skeleton (parameters freed); used to save out_dir
        self.shared_keys = list(shared_keys)
        self.base_tensors = dict(base_tensors)  # canonical key -> θ_0 (all base parameters)
        self.task_vectors = dict(task_vectors)  # canonical key -> the K tasks' Δ_k
        self.tasks = list(tasks)
        self.init_lambda = float(init_lambda)
        # keys whose layers add their low-rank update themselves (plain linear weights)
        self.factored_keys = {
            key: p
            for p, key in enumerate(self.shared_keys)
            if self.task_vectors[key].factored and self._is_linear_weight(key)
        }
        first = next(iter(self.base_tensors.values()))
        self.lambdas = nn.Parameter(
            torch.full(
                (len(self.shared_keys), len(self.tasks)),
                self.init_lambda,
                dtype=torch.float32,
                device=first.device,
            )
        )

    def _is_linear_weight(self, key: str) -> bool:
        """True when ``key`` is the weight of an ``nn.Linear`` in every task's model."""
        for task in self.tasks:
            name = next((n for n, k in task.roles.shared.items() if k == key), None)
            if name is None or not name.endswith(".weight"):
                return False
            module = task.module.get_submodule(name[: -len(".weight")])
            if type(module) is not nn.Linear:
                return False
        return True

    # ------------------------------------------------------------------ merged weights
    def merged_tensors(self, factored: bool = False) -> dict[str, torch.Tensor]:
        """``{key: θ_0 + Σ_k λ[p,k] Δ_k}`` for every shared key (differentiable in λ);
        θ_0 itself, no copy, where no task changed the tensor.

        ``factored``: the keys of :attr:`factored_keys` map to θ_0 too; run the model with
        them through :meth:`forward` / :meth:`hidden_and_head`, whose layers then add
        ``Σ_k λ_k Δ_k x`` themselves (the merged weights are never formed).
        """
        merged = FactoredTensors() if factored else {}
        for p, key in enumerate(self.shared_keys):
            if factored and key in self.factored_keys:
                merged[key] = self.base_tensors[key]
                continue
            update = self.task_vectors[key].combine(self.lambdas[p])
            merged[key] = (
                self.base_tensors[key] if update is None else self.base_tensors[key] + update
            )
        return merged

    @contextmanager
    def _low_rank_layers(self, k: int, merged: Mapping[str, torch.Tensor]) -> Iterator[None]:
        """While task k's model runs on ``merged`` from ``merged_tensors(factored=True)``: a
        forward hook on each factored linear adds ``Σ_j λ[p,j] Δ_j x`` to its ``θ_0 x``."""
        if not isinstance(merged, FactoredTensors):
            yield
            return
        task = self.tasks[k]
        handles = []
        for name, key in task.roles.shared.items():
            p = self.factored_keys.get(key)
            if p is None:
                continue
            vectors = self.task_vectors[key]

            def add_update(module, args, output, vectors=vectors, p=p):
                return output + vectors.apply(args[0], self.lambdas[p])

            module = task.module.get_submodule(name[: -len(".weight")])
            handles.append(module.register_forward_hook(add_update))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def task_parameters(
        self, k: int, merged: Optional[Mapping[str, torch.Tensor]] = None
    ) -> dict[str, torch.Tensor]:
        """Every parameter of task k's model, by its full name in the expert."""
        task = self.tasks[k]
        merged = self.merged_tensors() if merged is None else merged
        params = {name: merged[key] for name, key in task.roles.shared.items()}
        params.update(task.layer)
        params.update(task.frozen)
        return params

    def forward(
        self,
        k: int,
        batch: Mapping[str, torch.Tensor],
        merged: Optional[Mapping[str, torch.Tensor]] = None,
    ) -> Any:
        """Task k's model on ``batch`` with the merged weights (``merged``: from
        :meth:`merged_tensors`; None: formed now, factored)."""
        task = self.tasks[k]
        merged = self.merged_tensors(factored=True) if merged is None else merged
        with self._low_rank_layers(k, merged):
            return functional_call(
                task.module, self.task_parameters(k, merged), args=(), kwargs=task.inputs(batch)
            )

    def hidden_and_head(
        self,
        k: int,
        batch: Mapping[str, torch.Tensor],
        merged: Optional[Mapping[str, torch.Tensor]] = None,
        *,
        teacher: bool = False,
    ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """A causal LM's last hidden states ``(B, T, d)`` and its head weight ``(V, d)``.

        The logits are ``hidden @ headᵀ``; the caller applies the head to a few positions at
        a time, so the ``(B, T, V)`` logits are never held at once. None when the model's
        logits are not a plain bias-free linear head of its body's output (logit soft-capping,
        logit scales, a biased head): such models take :meth:`forward`.
        """
        task = self.tasks[k]
        split = causal_lm_split(task.module)
        if split is None:
            return None
        body_name, head_name = split
        if not teacher and merged is None:
            merged = self.merged_tensors(factored=True)
        params = self.expert_parameters(k) if teacher else self.task_parameters(k, merged)
        prefix = body_name + "."
        body_params = {n[len(prefix) :]: v for n, v in params.items() if n.startswith(prefix)}
        body = getattr(task.module, body_name)
        inputs = {key: v for key, v in task.inputs(batch).items() if key != "logits_to_keep"}
        with self._low_rank_layers(k, {} if teacher else merged):
            out = functional_call(body, body_params, args=(), kwargs=inputs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return hidden, params[head_name]

    def expert_parameters(self, k: int) -> dict[str, torch.Tensor]:
        """Task k's expert reconstructed as ``θ_0 + Δ_k`` (exact up to float32 rounding)."""
        task = self.tasks[k]
        params = {}
        for name, key in task.roles.shared.items():
            delta = self.task_vectors[key].task(k)
            params[name] = (
                self.base_tensors[key] if delta is None else self.base_tensors[key] + delta
            )
        params.update(task.layer_init)
        params.update(task.frozen)
        return params

    def teacher_forward(self, k: int, batch: Mapping[str, torch.Tensor]) -> Any:
        task = self.tasks[k]
        return functional_call(
            task.module, self.expert_parameters(k), args=(), kwargs=task.inputs(batch)
        )

    # ------------------------------------------------------------------ parameters
    def trainable_parameters(self) -> list[nn.Parameter]:
        return [self.lambdas, *(p for t in self.tasks for p in t.layer.values())]

    @torch.no_grad()
    def clamp_(self) -> None:
        self.lambdas.clamp_(0.0, 1.0)

    @torch.no_grad()
    def base_checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The base class's parameters with λ baked in (full names of the base).

        Shared keys: ``θ_0 + Σ λ Δ``; body keys that are task layers (``last_block``):
        task arithmetic at ``init_lambda`` over the experts' own layers (no task's adapted
        layer fits all tasks); every other base parameter (e.g. a headless base's pooler,
        or the base's own head when heads are task layers): θ_0.
        """
        merged = self.merged_tensors()
        layer_values: dict[str, list[torch.Tensor]] = {}
        for task in self.tasks:
            for name, tensor in task.layer_init.items():
                layer_values.setdefault(canonical_key(name, task.roles.prefix), []).append(tensor)
        prefix = body_prefix(self.base)
        out = {}
        for name, _ in self.base.named_parameters():
            key = canonical_key(name, prefix)
            theta0 = self.base_tensors[key]
            if key in merged:
                out[name] = merged[key]
            elif (
                key in layer_values
                and len(layer_values[key]) == len(self.tasks)
                and all(v.shape == theta0.shape for v in layer_values[key])
            ):
                out[name] = theta0 + self.init_lambda * sum(v - theta0 for v in layer_values[key])
            else:
                out[name] = theta0
        return out

    @torch.no_grad()
    def task_checkpoint_tensors(self, k: int) -> dict[str, torch.Tensor]:
        return {n: t.detach() for n, t in self.task_parameters(k).items()}


def build_problem(
    base: nn.Module,
    experts: Sequence[nn.Module],
    expert_tensors: Sequence[dict[str, Union[torch.Tensor, LowRankUpdate, None]]],
    task_names: Sequence[str],
    *,
    task_layer: str = "head",
    init_lambda: float = 0.3,
    expert_labels: Optional[Sequence[str]] = None,
    base_tensors: Optional[dict[str, torch.Tensor]] = None,
) -> SyMergeProblem:
    """Assemble the problem from the base and the expert skeletons.

    ``experts[k]`` is expert k's module with its parameters already taken out by
    :func:`free_parameters` into ``expert_tensors[k]`` (consumed: its shared entries are
    turned into task vectors in place, to keep the peak memory at ~K+1 copies). An entry may
    also be a :class:`LowRankUpdate` (a LoRA expert: θ_0 plus those factors) or None (equal
    to θ_0); both are relative to ``base_tensors``, so only a base model's own tensors may
    serve as θ_0 for them. ``base`` may still hold its parameters; they are taken out here
    unless ``base_tensors`` is given (θ_0: the base's, or a merged body's).
    """
    labels = list(expert_labels or task_names)
    if base_tensors is None:
        base_tensors = free_parameters(base)
    shared_keys, roles = plan_roles(base, experts, task_names, task_layer, labels)
    base_prefix = body_prefix(base)
    theta0 = {canonical_key(n, base_prefix): t.to(torch.float32) for n, t in base_tensors.items()}

    def dense(tensors: Mapping[str, Any], name: str, role: TaskRoles) -> torch.Tensor:
        """The expert's own float32 tensor ``name``."""
        value = tensors[name]
        if isinstance(value, torch.Tensor):
            return value.to(torch.float32)
        theta = theta0[canonical_key(name, role.prefix)]
        return theta if value is None else theta + value.dense()

    tasks = []
    for module, tensors, role in zip(experts, expert_tensors, roles):
        layer = {
            n: nn.Parameter(dense(tensors, n, role).clone(), requires_grad=True)
            for n in role.task_layer
        }
        tasks.append(
            TaskModel(
                name=role.name,
                module=module,
                roles=role,
                layer=layer,
                layer_init={n: dense(tensors, n, role) for n in role.task_layer},
                frozen={n: dense(tensors, n, role) for n in role.frozen},
                accepts=forward_keys(module),
            )
        )
    names_by_key = [{key: name for name, key in role.shared.items()} for role in roles]
    task_vectors = {}
    for key in shared_keys:
        updates: list[TaskUpdate] = []
        for tensors, names in zip(expert_tensors, names_by_key):
            value = tensors.pop(names[key])
            if isinstance(value, torch.Tensor):
                value = value.to(torch.float32) - theta0[key]
                # an exact zero (e.g. embeddings a LoRA never touched) needs no copy
                value = value if bool(value.any()) else None
            updates.append(value)
        task_vectors[key] = TaskVectors(theta0[key].shape, updates)
        del updates
    zero = sum(1 for tv in task_vectors.values() if tv.is_zero)
    LOG.info(
        "SyMerge: %d shared tensors x %d tasks (%d unchanged by every task, %.2f M floats of "
        "task vectors); task layers: %s",
        len(shared_keys),
        len(tasks),
        zero,
        sum(tv.numel for tv in task_vectors.values()) / 1e6,
        ", ".join(f"{t.name}={'+'.join(t.roles.task_layer_modules)}" for t in tasks),
    )
    return SyMergeProblem(base, shared_keys, theta0, task_vectors, tasks, init_lambda)
