"""The narrow interface between the sequential executor and a data-aware method.

The executor (``mergekit_ext.executor``) walks the network block by block. Inside a block
it visits *linear groups* in forward order: the linears that read the same input (for a
Llama block ``[q,k,v] -> o -> [gate,up] -> down``). For each group it hands the method a
:class:`LinearGroup` (the group's weights per model, float32, PyTorch ``out x in``) and
the per-task :class:`TaskStatistics` of the group's input; the method returns the merged
weights. Every other tensor (biases, norms, embeddings, heads) goes through
:meth:`LayerwiseMethod.merge_other`.

A method never loads files, runs models or writes output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from mergekit_ext.methods.parameters import MethodParameters


@dataclass
class TaskStatistics:
    """Statistics of the inputs a linear group sees on one task's calibration data.

    All are means over the task's (non-padding) tokens or patches, accumulated in float64:

    - ``gram``: ``(1/N) sum_x x x^T`` (in x in); None when only moments were requested
      (``StatisticsRequest.reference_gram_max_dim``)
    - ``gram_normalized``: the same over ``x / ||x||`` (CoM's ``normalize``); None when
      not requested
    - ``mean``: ``(1/N) sum_x x`` (in,)
    - ``count``: N, the number of tokens
    - ``second_moment``: ``(1/N) sum_x x ⊙ x`` (in,), the diagonal of ``gram``; derived
      from ``gram`` when not given
    - ``rows``: the inputs themselves (``N x in``, float32 or float64), kept only when asked
      (``StatisticsRequest.keep_rows``) and N < in, INSTEAD of ``gram`` (then None): the Gram
      ``rowsᵀ rows / N`` has rank at most N, the least-squares merge solves in the rows' span
      and :meth:`gram_from_rows` forms the Gram where something needs it; None otherwise
    """

    gram: Optional[torch.Tensor]
    mean: torch.Tensor
    count: int
    gram_normalized: Optional[torch.Tensor] = None
    second_moment: Optional[torch.Tensor] = None
    rows: Optional[torch.Tensor] = None
    row_batches: Optional[tuple[int, ...]] = None  # sizes of the batches ``rows`` came in

    def __post_init__(self) -> None:
        if self.second_moment is None:
            if self.gram is None:
                raise ValueError("TaskStatistics needs a gram or a second_moment")
            self.second_moment = torch.diagonal(self.gram).clone()

    def gram_from_rows(self) -> Optional[torch.Tensor]:
        """``gram``, or ``rowsᵀ rows / N`` (float64) when the rows were kept instead; None
        when only moments were kept.

        Formed as :class:`~mergekit_ext.calibration.statistics.ActivationStatistics` would
        have: each batch's product (``row_batches``) in the rows' dtype added to a float64
        sum in order, divided by N, symmetrised; so it is bit for bit the Gram the
        accumulator would have returned.
        """
        if self.gram is not None or self.rows is None:
            return self.gram
        sizes = list(self.row_batches) if self.row_batches else [self.rows.shape[0]]
        total = torch.zeros(self.rows.shape[1], self.rows.shape[1], dtype=torch.float64)
        total = total.to(self.rows.device)
        for chunk in torch.split(self.rows, sizes):
            total.add_(chunk.T @ chunk)
        total.div_(self.count)
        return (total + total.T).mul_(0.5)

    @property
    def covariance(self) -> torch.Tensor:
        """``gram − mean meanᵀ`` (needs the full Gram or the rows)."""
        gram = self.gram_from_rows()
        if gram is None:
            raise ValueError("these statistics keep only moments; the covariance needs the Gram")
        return gram - torch.outer(self.mean, self.mean)

    @property
    def variance(self) -> torch.Tensor:
        """Per-feature variance ``second_moment − mean²`` (clamped at 0)."""
        assert self.second_moment is not None
        return (self.second_moment - self.mean.square()).clamp_min(0.0)


@dataclass
class LinearGroup:
    """One group of linear layers that share an input, with everything a method may use.

    - ``name``: a readable id, e.g. ``model.layers.3.self_attn.qkv``
    - ``weights``: tensor names of the group's linear weights (full checkpoint names)
    - ``base``: ``{weight name: W_0}``; ``experts``: one ``{weight name: W_k}`` per task
    - ``task_names``: one per expert, in the config's order
    - ``expert_stats``: per task, the statistics of this group's input in the expert's OWN
      unmerged forward pass (RegMean's statistics)
    - ``merged_stats``: per task, the statistics of this group's input when the task's data
      runs through the already merged layers before it (CoM/QP ``propagate``); None when
      the method did not ask for propagation
    All weights are float32 ``out x in`` (HF Conv1D weights are transposed by the executor).
    """

    name: str
    weights: Sequence[str]
    base: Mapping[str, torch.Tensor]
    experts: Sequence[Mapping[str, torch.Tensor]]
    task_names: Sequence[str]
    expert_stats: Sequence[TaskStatistics]
    merged_stats: Optional[Sequence[TaskStatistics]] = None


@dataclass(frozen=True)
class StatisticsRequest:
    """What a method asks the executor to compute for each group.

    - ``propagate``: statistics along the merged path (``merged_stats``)
    - ``expert_path``: statistics along each expert's own path (``expert_stats``)
    - ``normalized_gram``: also the Gram of unit-norm inputs, on the path the merge uses
      (the merged path with ``propagate``, else the expert path)
    - ``reference_gram_max_dim``: with ``propagate``, the expert path is only a reference
      (a diagnostic); above this input width its statistics keep only the mean and the
      per-feature second moment (``gram=None``). None: full Grams at every width.
    - ``keep_rows``: on the path the merge uses, also keep the input rows while a task has
      fewer tokens than the group has inputs (``TaskStatistics.rows``; at most half the
      float64 Gram's memory)
    - ``product_dtype``: dtype of each batch's ``xᵀx`` before it is added to the float64
      sum; None: float32 for float32 (or narrower) activations, the fast default (see
      :class:`~mergekit_ext.calibration.statistics.ActivationStatistics`); ``torch.float64``
      for float64 products throughout.
    """

    propagate: bool
    expert_path: bool = True
    normalized_gram: bool = False
    reference_gram_max_dim: Optional[int] = None
    product_dtype: Optional[torch.dtype] = None
    keep_rows: bool = False


class LayerwiseMethod(ABC):
    """A data-aware merge method run by the sequential executor.

    ``parameters_model`` is the method's one parameter declaration; the planner parses the
    YAML into it once and every call below receives that typed object (a plain mapping is
    parsed on the spot, for direct calls).
    """

    name: str
    parameters_model: type[MethodParameters] = MethodParameters

    def parse(self, parameters: Any) -> Any:
        """``parameters`` as this method's typed model (``ConfigError`` naming a bad field)."""
        return self.parameters_model.parse(parameters, self.name)

    @abstractmethod
    def statistics_request(self, parameters: Any) -> StatisticsRequest: ...

    @abstractmethod
    def merge_linear_group(
        self, group: LinearGroup, parameters: Any
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Return ``({weight name: merged weight}, diagnostics for this group)``."""

    def merge_other(
        self,
        name: str,
        base: Optional[torch.Tensor],
        experts: Sequence[torch.Tensor],
        parameters: Any,
    ) -> torch.Tensor:
        """Merge a tensor that is not an input-hooked linear weight (the fallback merge)."""
        how = getattr(self.parse(parameters), "fallback", "mean")
        return fallback_merge(name, base, experts, how)


def fallback_merge(
    name: str, base: Optional[torch.Tensor], experts: Sequence[torch.Tensor], how: str
) -> torch.Tensor:
    """``mean`` of experts (default), ``base`` (keep W_0) or ``task_arithmetic`` (W_0 + sum Δ)."""
    stacked = torch.stack([e.to(torch.float32) for e in experts])
    if how == "mean":
        return stacked.mean(0)
    if base is None:
        raise ValueError(f"fallback {how!r} for tensor {name} needs a base model")
    if how == "base":
        return base.to(torch.float32).clone()
    if how == "task_arithmetic":
        return base.to(torch.float32) + (stacked - base.to(torch.float32)).sum(0)
    raise ValueError(
        f"unknown fallback {how!r} for tensor {name}: use mean, base or task_arithmetic"
    )
