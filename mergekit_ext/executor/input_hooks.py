"""The statistics of a linear group's input, taken by hooks while a block runs.

The sequential walk runs each task's batches through a block with a forward pre-hook on the
first module of a linear group (every group at once on the expert path; one group, the
forward stopped there, on the merged path). :class:`InputHooks` makes the accumulator of one
task at one group and the hook that feeds it: a linear group's input rows
(:class:`~mergekit_ext.calibration.statistics.ActivationStatistics`), or an experts module's
routed rows per expert (:class:`~mergekit_ext.executor.moe.RoutedExpertStatistics`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import nn

from mergekit_ext.calibration.statistics import (
    ActivationStatistics,
    flatten_tokens,
    multiplied_input,
)
from mergekit_ext.executor.blocks import StopForward
from mergekit_ext.executor.moe import GATE_UP, RoutedExpertStatistics, routed_call
from mergekit_ext.executor.plan import EXPERT_WEIGHTS, BlockLayout
from mergekit_ext.methods.layerwise import StatisticsRequest
from mergekit_ext.models.families import GroupSpec


class InputHooks:
    """Accumulators and input hooks of one walk (its statistics request, device, shapes).

    ``mask``: the running batch's token mask (None: every position), set by the walk
    around each batch; the hooks leave out the padding it marks.
    """

    def __init__(
        self,
        request: StatisticsRequest,
        device: torch.device,
        shapes: Mapping[str, Any],
        rounds_inputs: bool,
    ) -> None:
        self.request = request
        self.device = device
        self.shapes = shapes  # the base model's tensor shapes, by canonical name
        # the statistics describe the inputs as the compute dtype rounds them
        self.rounds_inputs = rounds_inputs
        self.mask: Optional[torch.Tensor] = None

    def accumulator(self, block: BlockLayout, group: GroupSpec, *, expert_path: bool) -> Any:
        """A new accumulator of one task's input statistics at ``group``."""
        if group.experts:
            return self._routed_accumulator(block, group)
        width = block.group_width(group, self.shapes)
        return self._new_accumulator(width, expert_path=expert_path)

    def hook(
        self,
        module: nn.Module,
        group: GroupSpec,
        accumulator: Any,
        params: dict[str, torch.Tensor],
        stop: bool,
    ) -> Any:
        """``accumulator``'s input hook on the group's first module of the block ``module``
        (``params``: the block's tensors by local name); returns the hook's handle.
        ``stop``: end the forward after the module's last call of the pass."""
        target = module.get_submodule(group.modules[0])
        if group.experts:
            hook = self._experts_hook(accumulator, group, params, stop=stop)
            return target.register_forward_pre_hook(hook, with_kwargs=True)
        return target.register_forward_pre_hook(
            self._input_hook(accumulator, stop=stop, reads=group.reads)
        )

    def _new_accumulator(self, width: int, *, expert_path: bool) -> ActivationStatistics:
        """An accumulator for one group and task on the merged or the expert path.

        The normalized Gram only on the path the merge uses; with ``propagate`` the expert
        path is a reference, and above ``reference_gram_max_dim`` it keeps moments only.
        """
        request = self.request
        reference = expert_path and request.propagate
        full_gram = not (
            reference
            and request.reference_gram_max_dim is not None
            and width > request.reference_gram_max_dim
        )
        return ActivationStatistics(
            width,
            normalized_gram=request.normalized_gram and not reference,
            full_gram=full_gram,
            dtype=request.statistics_dtype,
            product_dtype=request.product_dtype,
            device=self.device,
            keep_rows=request.keep_rows and not reference,
        )

    def _routed_accumulator(self, block: BlockLayout, group: GroupSpec) -> RoutedExpertStatistics:
        """Per-expert statistics of one task at an experts module (docs/methods.md,
        "Mixture-of-experts blocks")."""
        gate_up = self.shapes[f"{block.prefix}{group.modules[0]}.{GATE_UP}"]
        return RoutedExpertStatistics(
            int(gate_up[0]),
            int(gate_up[2]),
            int(gate_up[1]) // 2,
            dtype=self.request.statistics_dtype,
            device=self.device,
        )

    def _input_hook(
        self, accumulator: ActivationStatistics, stop: bool, reads: tuple[str, ...] = ()
    ):
        """A pre-hook adding the module's input rows: the non-padding tokens, or for a
        ``"table"`` call (``GroupSpec.reads``) every row of the table, once per call
        (docs/methods.md, "Relative position tables"). ``stop``: end the forward after the
        module's last call of the pass."""
        calls = [0]

        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            kind = reads[calls[0] % len(reads)] if reads else "tokens"
            calls[0] += 1
            x = multiplied_input(module, args[0]) if self.rounds_inputs else args[0]
            if kind == "table":
                accumulator.update(x.reshape(-1, x.shape[-1]))
            else:
                accumulator.update(flatten_tokens(x, self.mask))
            if stop and (not reads or calls[0] % len(reads) == 0):
                raise StopForward

        return hook

    def _experts_hook(
        self,
        accumulator: RoutedExpertStatistics,
        group: GroupSpec,
        params: dict[str, torch.Tensor],
        stop: bool,
    ):
        """A pre-hook on the experts module: the routing the block's own router chose, and
        each expert's rows through its own weights (``params``: the block's tensors)."""
        own = {w: params[f"{group.modules[0]}.{w}"] for w in EXPERT_WEIGHTS}

        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            accumulator.update(module, own, routed_call(args, kwargs), self.mask)
            if stop:
                raise StopForward

        return hook
