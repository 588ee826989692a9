"""Walking a network block by block: the helpers the executors and ``diagnose`` compose.

A model's class is built on the meta device (:func:`skeleton_on_device`); its block list gets
:class:`BlockCallRecorder` stand-ins, so that one ``forward`` of the backbone records the
first block's input and the exact arguments transformers passes to every block into a
:class:`CallSink`, and stops (:class:`StopForward`). The real blocks then run one at a time
with real tensors through ``torch.func.functional_call`` (:func:`run_block`), so attention,
rotary embeddings and masks are transformers' own. Used by
:class:`~mergekit_ext.executor.sequential.SequentialExecutor`,
:class:`~mergekit_ext.executor.model_output.ModelOutputExecutor` and ``mergekit-ext diagnose``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from mergekit_ext.models.checkpoint import build_skeleton

#: One block call's positional arguments after the hidden states, and its keyword arguments.
BlockCall = tuple[tuple[Any, ...], dict[str, Any]]


class StopForward(Exception):
    """Ends a forward pass once the wanted input has been captured."""


@dataclass
class CallSink:
    """What the block stand-ins record during one embeddings pass."""

    last: int
    hidden: Optional[torch.Tensor] = None
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=list)

    def reset(self) -> None:
        """Forget the last pass's recordings before the next one."""
        self.hidden = None
        self.calls = []


class BlockCallRecorder(nn.Module):
    """Stands in for block ``index``: records its call arguments and passes the hidden states
    on, shaped as the block returns its result (``wrap``: a tensor, or a tuple).

    Block 0 also records its input (the embeddings' output); the last block raises
    :class:`StopForward`, so one backbone ``forward`` yields every block's call arguments
    (attention masks, rotary embeddings) without running a block.
    """

    def __init__(
        self, index: int, sink: CallSink, wrap: Optional[Callable[[torch.Tensor], Any]] = None
    ) -> None:
        super().__init__()
        self.index = index
        self.sink = sink
        self.wrap = wrap

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.index == 0:
            self.sink.hidden = hidden_states
        self.sink.calls.append((args, kwargs))
        if self.index == self.sink.last:
            raise StopForward
        return self.wrap(hidden_states) if self.wrap is not None else hidden_states


class LinearOutputCache:
    """Replays the outputs of a block's already merged linears on the merged path.

    Within a block the merged path re-runs the block from its input once per group (a
    group's input needs every earlier group merged) and once more for the block's output.
    The outputs of the earlier groups' linears do not change between those passes: their
    weights are final and their inputs depend only on still earlier, final groups. So the
    first pass after a group is merged records its linears' outputs and later passes replay
    them: each linear of the block runs once per task and batch, not once per later group.
    Outputs are recorded in forward order while they fit in ``budget_bytes`` (later ones
    are simply recomputed, which gives the same values); they are dropped when the block
    ends.
    """

    def __init__(self, block: nn.Module, budget_bytes: int) -> None:
        self.block = block
        self.budget_bytes = budget_bytes
        self.recorded_bytes = 0
        self.outputs: dict[tuple[str, int, int, int], torch.Tensor] = {}
        self._key: tuple[int, int] = (-1, -1)
        self._calls: dict[str, int] = {}
        self._covered: list[nn.Module] = []
        self._names: set[str] = set()

    def begin(self, task: int, batch: int) -> None:
        """The next forward pass runs ``task``'s batch ``batch``."""
        self._key = (task, batch)
        self._calls = {}

    def cover(self, module_names: Sequence[str]) -> None:
        """Record (then replay) the outputs of these modules of the block from now on."""
        for name in module_names:
            if name in self._names:
                continue
            module = self.block.get_submodule(name)
            module.forward = self._replaying(name, module.forward)  # type: ignore[method-assign]
            self._covered.append(module)
            self._names.add(name)

    def _replaying(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            call = self._calls.get(name, 0)  # a module called twice in one pass: two entries
            self._calls[name] = call + 1
            key = (name, *self._key, call)
            output = self.outputs.get(key)
            if output is None:
                output = original(*args, **kwargs)
                if not isinstance(output, torch.Tensor):
                    return output  # a router's routing tuple: recomputed, never recorded
                size = output.numel() * output.element_size()
                if self.recorded_bytes + size <= self.budget_bytes:
                    self.outputs[key] = output
                    self.recorded_bytes += size
            return output

        return forward

    def close(self) -> None:
        """Restore the modules' own forward and drop the recorded outputs."""
        for module in self._covered:
            del module.forward  # the instance attribute; the class's forward is back
        self._covered.clear()
        self._names.clear()
        self.outputs.clear()
        self.recorded_bytes = 0


@dataclass
class TaskState:
    """One task's calibration batches and their hidden states at the current block."""

    name: str
    index: int  # the task's position in the config (its owner is index mod W)
    inputs: list[dict[str, Any]]  # backbone forward kwargs per batch, on the device
    masks: list[Optional[torch.Tensor]]  # [B, T] token masks (None: every position)
    calls: list[list[tuple[tuple[Any, ...], dict[str, Any]]]] = field(default_factory=list)
    # the expert path's own block arguments where they differ from ``calls`` (the merged
    # path's): a table computed from pre-block weights (DeBERTa's relative embeddings)
    expert_calls: Optional[list[list[tuple[tuple[Any, ...], dict[str, Any]]]]] = None
    expert_hidden: Optional[list[torch.Tensor]] = None
    merged_hidden: Optional[list[torch.Tensor]] = None


def same_calls(a: Any, b: Any) -> bool:
    """Whether two embeddings passes handed the blocks the same arguments (tensors equal)."""
    leaves_a, spec_a = tree_flatten(a)
    leaves_b, spec_b = tree_flatten(b)
    if spec_a != spec_b:
        return False
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x is not y and (x.shape != y.shape or not torch.equal(x, y)):
                return False
        else:
            try:
                if x is not y and bool(x != y):
                    return False
            except Exception:  # an object without a usable comparison: assume it differs
                return False
    return True


def buffers_to(module: nn.Module, device: torch.device) -> None:
    """Move the real (non-meta) buffers of a meta-parameter skeleton to ``device``."""
    for sub in module.modules():
        for name, buf in list(sub._buffers.items()):
            if buf is not None and buf.device.type != "meta":
                sub._buffers[name] = buf.to(device)


_LIBC: Any = None


def trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Blocks allocate and free the same large tensors over and over; without this, glibc
    keeps the freed pages and the process's RSS grows block after block.
    """
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


def orient(tensor: torch.Tensor, flip: bool) -> torch.Tensor:
    """A linear weight as the methods take it (``out x in``) from a ``Conv1D``'s ``in x out``
    (and back: the transpose is its own inverse)."""
    return tensor.t() if flip else tensor


def group_name(output_names: Sequence[str], label: str) -> str:
    """The name a group's diagnostics record carries: the one linear's own name, or the
    common prefix of several linears' names followed by the group's ``label``."""
    stems = [n[: -len(".weight")] if n.endswith(".weight") else n for n in output_names]
    if len(stems) == 1:
        return stems[0]
    parts = [s.split(".") for s in stems]
    common: list[str] = []
    for pieces in zip(*parts):
        if len(set(pieces)) != 1:
            break
        common.append(pieces[0])
    return ".".join([*common, label])


def skeleton_on_device(config: Any, device: torch.device) -> nn.Module:
    """The model class of ``config`` with meta parameters and its real buffers on ``device``.

    Args:
        config: the model's transformers config.
        device: where the buffers (rotary frequencies, position ids) go.

    Returns:
        The skeleton; its parameters stay on the meta device (the real tensors are passed to
        ``functional_call`` per block).
    """
    skeleton = build_skeleton(config)
    buffers_to(skeleton, device)
    return skeleton


def run_block(
    block: nn.Module,
    params: dict[str, torch.Tensor],
    hidden: torch.Tensor,
    call: BlockCall,
) -> torch.Tensor:
    """Run one transformers block with real tensors on recorded call arguments.

    Args:
        block: the block module of a skeleton (meta parameters).
        params: the block's tensors by module-relative name.
        hidden: the block's input hidden states.
        call: the block's other arguments, as a :class:`BlockCallRecorder` recorded them.

    Returns:
        The block's output hidden states (the first element when the block returns a tuple).
    """
    args, kwargs = call
    out = torch.func.functional_call(block, params, (hidden, *args), kwargs)
    return out[0] if isinstance(out, tuple) else out
