"""Routed-expert statistics and per-expert least-squares merges of mixture-of-experts blocks.

The sequential executor calls this for an experts module (a group with ``experts=True``,
:mod:`mergekit_ext.models.families.discovery`); docs/methods.md, "Mixture-of-experts
blocks", states the choices.

transformers 5 holds the routed experts of Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 in
one module (``MixtralExperts`` ...) with 3-D weights ``gate_up_proj`` ``[E, 2I, H]`` and
``down_proj`` ``[E, H, I]``, called as ``experts(hidden [T, H], top_k_index [T, k],
top_k_weights [T, k])``; expert ``e`` computes ``down_e(act(gate_e x) * up_e x)`` on the
tokens routed to it and the block multiplies that OUTPUT by the routing weight ``r``.

Statistics (docs/methods.md, "Mixture-of-experts blocks"): for expert ``e`` and task ``k``

    G_gate_up[e, k] = (1/N_k) Σ_{t routed to e} r_t² x_t x_tᵀ
    G_down[e, k]    = (1/N_k) Σ_{t routed to e} r_t² h_t h_tᵀ,   h_t = act(gate_e x_t) * up_e x_t

with ``N_k`` the task's (non-padding) tokens: the least squares on what the block adds to
the residual stream, ``Σ_t ‖r_t (W x_t − W_k x_t)‖²`` per task token, as RegMean's per-task
means. ``gate`` and ``up`` read the same rows and are merged as the one fused linear they
are held as. The intermediate rows ``h`` come from the experts module's own forward (run
with every row routed to ``e`` at weight 1), never from a re-implementation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.nn.utils.stateless import _reparametrize_module
from torch.overrides import TorchFunctionMode

from mergekit_ext.calibration.statistics import ActivationStatistics, TaskStatistics
from mergekit_ext.errors import TensorError
from mergekit_ext.methods.layerwise import LinearGroup

LOG = logging.getLogger(__name__)

GATE_UP = "gate_up_proj"
DOWN = "down_proj"


def is_experts_module(module: nn.Module) -> bool:
    """transformers 5's fused experts: 3-D ``gate_up_proj`` and ``down_proj`` parameters."""
    params = dict(module.named_parameters(recurse=False))
    return all(n in params and params[n].dim() == 3 for n in (GATE_UP, DOWN))


@dataclass
class RoutedCall:
    """One call of an experts module: its rows and the router's choice for each."""

    hidden: torch.Tensor  # [T, H]
    top_k_index: torch.Tensor  # [T, k]
    top_k_weights: torch.Tensor  # [T, k]


def routed_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> RoutedCall:
    """The arguments of one call of an experts module (``forward(hidden_states,
    top_k_index, top_k_weights)``, positional or by name)."""
    values = list(args) + [
        kwargs[n] for n in ("hidden_states", "top_k_index", "top_k_weights") if n in kwargs
    ]
    if len(values) < 3:
        raise TensorError(
            "an experts module was called without (hidden_states, top_k_index, top_k_weights)"
        )
    hidden, index, weights = values[:3]
    return RoutedCall(hidden.detach(), index.detach(), weights.detach())


@contextmanager
def capture_routing(experts: nn.Module, calls: list[RoutedCall]) -> Iterator[None]:
    """Record each call of ``experts`` (the rows and the routing the block's router chose)."""

    def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        calls.append(routed_call(args, kwargs))

    handle = experts.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


class _LinearInputs(TorchFunctionMode):
    """Records the input of every ``F.linear`` whose weight lies in ``storage``."""

    def __init__(self, storage: int) -> None:
        super().__init__()
        self.storage = storage
        self.inputs: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is nn.functional.linear:
            weight = args[1] if len(args) > 1 else kwargs.get("weight")
            if weight is not None and weight.untyped_storage().data_ptr() == self.storage:
                self.inputs.append(args[0])
        return func(*args, **kwargs)


def _eager_forward(experts: nn.Module) -> Callable[..., torch.Tensor]:
    """The class's own eager forward: transformers dispatches the decorated experts classes
    to fused kernels (``grouped_mm``) by ``config._experts_implementation``, which compute
    the same products without one ``F.linear`` per expert."""
    forward = type(experts).forward
    return getattr(forward, "__wrapped__", forward)


def expert_intermediate(
    experts: nn.Module,
    params: dict[str, torch.Tensor],
    rows: torch.Tensor,
    expert: int,
) -> torch.Tensor:
    """The input of expert ``expert``'s ``down_proj`` for ``rows``, by the module's own forward.

    Args:
        experts: the experts module (its class's forward; parameters may be on meta).
        params: ``{"gate_up_proj": [E, 2I, H], "down_proj": [E, H, I]}``.
        rows: ``[n, H]`` inputs routed to the expert.
        expert: the expert's index.

    Returns:
        ``[n, I]``, row i for ``rows[i]``.
    """
    n = rows.shape[0]
    index = torch.full((n, 1), expert, dtype=torch.long, device=rows.device)
    weights = torch.ones(n, 1, dtype=rows.dtype, device=rows.device)
    mode = _LinearInputs(params[DOWN].untyped_storage().data_ptr())
    # the forward itself, not the module's __call__: no hook of the module runs again (the
    # executor's statistics hook sits on it), with ``params`` in place of its parameters
    with _reparametrize_module(experts, params), mode:
        _eager_forward(experts)(experts, rows, index, weights)
    if len(mode.inputs) != 1:
        raise TensorError(
            f"{type(experts).__name__}: expected one down_proj product for expert {expert}, "
            f"saw {len(mode.inputs)}; this experts implementation is not the eager one"
        )
    return mode.inputs[0]


class RoutedExpertStatistics:
    """One task's per-expert statistics (gate_up input and down input) over its calls.

    Args:
        num_experts, hidden, intermediate: the experts' shape (``E``, ``H``, ``I``).
        dtype: the running sums' dtype (the executor's ``statistics_dtype``).
    """

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        *,
        dtype: torch.dtype = torch.float64,
        device: Optional[torch.device | str] = None,
    ) -> None:
        self.num_experts = num_experts
        self.tokens = 0
        self.gate_up = [
            ActivationStatistics(hidden, dtype=dtype, device=device) for _ in range(num_experts)
        ]
        self.down = [
            ActivationStatistics(intermediate, dtype=dtype, device=device)
            for _ in range(num_experts)
        ]

    @torch.no_grad()
    def update(
        self,
        experts: nn.Module,
        params: dict[str, torch.Tensor],
        call: RoutedCall,
        token_mask: Optional[torch.Tensor] = None,
    ) -> None:
        """Add one call's routed rows (``token_mask``: ``[T]`` or ``[B, S]`` of kept rows)."""
        hidden, index, weights = call.hidden, call.top_k_index, call.top_k_weights
        if token_mask is not None:
            keep = token_mask.reshape(-1).bool()
            hidden, index, weights = hidden[keep], index[keep], weights[keep]
        self.tokens += int(hidden.shape[0])
        for e in range(self.num_experts):
            token, slot = torch.where(index == e)
            if token.numel() == 0:
                continue
            rows = hidden[token]
            r = weights[token, slot].to(rows.dtype).unsqueeze(1)
            inner = expert_intermediate(experts, params, rows, e)
            # r x: the Gram of the weighted rows is Σ r² x xᵀ (the forward scales the output)
            self.gate_up[e].update(r * rows)
            self.down[e].update(r * inner)

    def finalize(self) -> list[Optional[tuple[TaskStatistics, TaskStatistics]]]:
        """Per expert ``(gate_up, down)`` statistics as means over the task's tokens
        (``count``: the tokens routed to it); None for an expert no token reached."""
        out: list[Optional[tuple[TaskStatistics, TaskStatistics]]] = []
        for gu, dn in zip(self.gate_up, self.down):
            if gu.count == 0:
                out.append(None)
                continue
            out.append(
                (
                    _per_task_token(gu.finalize(), self.tokens),
                    _per_task_token(dn.finalize(), self.tokens),
                )
            )
        return out


def _per_task_token(stats: TaskStatistics, tokens: int) -> TaskStatistics:
    """Means over the routed rows rescaled to means over all of the task's tokens."""
    scale = stats.count / tokens
    assert stats.gram is not None and stats.second_moment is not None
    return TaskStatistics(
        gram=stats.gram * scale,
        mean=stats.mean * scale,
        count=stats.count,
        second_moment=stats.second_moment * scale,
    )


@dataclass
class ExpertMergeResult:
    """The merged fused tensors, one diagnostics record per solved expert linear, and the
    experts that took the fallback (no token of some task reached them)."""

    gate_up: torch.Tensor  # [E, 2I, H]
    down: torch.Tensor  # [E, H, I]
    records: list[dict[str, Any]]
    without_tokens: list[int]


def merge_experts(
    method: Any,
    parameters: Any,
    base: dict[str, torch.Tensor],
    experts: Sequence[dict[str, torch.Tensor]],
    task_names: Sequence[str],
    expert_stats: Sequence[Sequence[Optional[tuple[TaskStatistics, TaskStatistics]]]],
    names: Callable[[int], tuple[str, str]],
    merged_stats: Optional[
        Sequence[Sequence[Optional[tuple[TaskStatistics, TaskStatistics]]]]
    ] = None,
    output_dtype: Optional[torch.dtype] = None,
    parts: tuple[str, ...] = (GATE_UP, DOWN),
    compute_dtype: torch.dtype = torch.float32,
) -> ExpertMergeResult:
    """Merge each routed expert's ``gate_up`` and ``down`` as linear groups of their own.

    Args:
        method: a :class:`~mergekit_ext.methods.layerwise.LayerwiseMethod`.
        parameters: its parameters.
        base, experts: ``{"gate_up_proj": [E, 2I, H], "down_proj": [E, H, I]}`` of the base
            and of each task's model.
        task_names: one per task.
        expert_stats: per task, :meth:`RoutedExpertStatistics.finalize` on the expert path.
        names: expert index -> the (gate_up, down) names its groups are called by.
        merged_stats: the same on the merged path (CoM, QP ``propagate``), or None.
        output_dtype: the dtype the merged matrices are written in (diagnostics describe
            them as written), or None.
        parts: which of ``gate_up_proj`` / ``down_proj`` to merge (the others are returned
            as the base's): Chain of Merges merges ``gate_up`` first, then ``down`` on the
            merged-path rows that the merged ``gate_up`` gives.
        compute_dtype: the dtype of the passes the statistics came from (``LinearGroup``).

    Returns:
        The merged fused tensors; an expert that some task routed no token to takes the
        method's fallback merge (``merge_other``) for both matrices and is listed.
    """
    num = base[GATE_UP].shape[0]
    gate_up = base[GATE_UP].clone()
    down = base[DOWN].clone()
    records: list[dict[str, Any]] = []
    without: list[int] = []
    for e in range(num):
        gu_name, dn_name = names(e)
        own = [s[e] for s in expert_stats]
        path = [s[e] for s in merged_stats] if merged_stats is not None else None
        if any(s is None for s in own) or (path is not None and any(s is None for s in path)):
            without.append(e)
            for target, key, name in ((gate_up, GATE_UP, gu_name), (down, DOWN, dn_name)):
                if key not in parts:
                    continue
                target[e] = method.merge_other(
                    name, base[key][e], [w[key][e] for w in experts], parameters
                )
            continue
        for target, key, name, part in ((gate_up, GATE_UP, gu_name, 0), (down, DOWN, dn_name, 1)):
            if key not in parts:
                continue
            group = LinearGroup(
                name=name,
                weights=[name],
                base={name: base[key][e]},
                experts=[{name: w[key][e]} for w in experts],
                task_names=list(task_names),
                expert_stats=[s[part] for s in own],  # type: ignore[index]
                merged_stats=[s[part] for s in path] if path is not None else None,  # type: ignore[index]
                output_dtypes={name: output_dtype} if output_dtype is not None else None,
                compute_dtype=compute_dtype,
            )
            result, diagnostics = method.merge_linear_group(group, parameters)
            target[e] = result[name]
            records.append({"layer": name, "expert": e, **(diagnostics or {})})
    if without:
        LOG.info("experts %s received no calibration token in some task: fallback merge", without)
    return ExpertMergeResult(gate_up, down, records, without)
