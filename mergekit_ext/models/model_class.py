"""What a model's own transformers class makes of a checkpoint, decided from the class itself.

Real checkpoints differ in more than weights. A checkpoint saved by an older transformers
stores buffers the current class never loads (BERT's ``embeddings.position_ids``, Llama's
``rotary_emb.inv_freq``, GPT-2's ``attn.bias``); transformers 5 no longer saves them. One
causal LM ties ``lm_head`` to its input embeddings and saves it once, another stores both.
Comparing tensor names across inputs would call such models incompatible; they are not.

- :func:`unloaded_keys`: checkpoint keys that ``from_pretrained`` would not load into the
  class: after transformers' own load-time renaming they are no key of the class's
  ``state_dict()`` (non-persistent buffers, keys the class does not have). They are ignored
  for merging.
- :func:`tied_weights`: the weights the class ties for this config (``lm_head.weight`` →
  ``model.embed_tokens.weight`` when ``tie_word_embeddings``), from transformers'
  ``get_expanded_tied_weights_keys``.
- :func:`check_tied_weights`: the rule for inputs that disagree on tying (see there).
- :func:`saved_state_dict`: the tensors ``save_pretrained`` of the class writes, by their
  checkpoint names (Mixtral's per-expert ``block_sparse_moe.experts.N.w1.weight``, not the
  fused ``mlp.experts.gate_up_proj`` the class holds in memory).
- :func:`load_report`: what ``from_pretrained`` of the class reports (missing, unexpected,
  mismatched keys) for a checkpoint's names and shapes, by transformers' own loading run
  on the meta device (the output completeness check).
- :func:`fused_pieces`: where each checkpoint tensor of one fused in-memory tensor sits in
  it (strided views found by transformers' own reverted conversion run on a meta tensor),
  so a fused tensor is gathered from its checkpoint pieces and a merged one split back into
  them (:func:`gather_fused`, :func:`split_fused`).

Nothing here reads a weight: configs, safetensors headers and a model built on the meta
device only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Optional, Union

import torch
import transformers
from torch import nn
from torch.overrides import TorchFunctionMode

from mergekit_ext.errors import ModelInputError

LOG = logging.getLogger(__name__)


def model_class(config: transformers.PretrainedConfig) -> Optional[type]:
    """The transformers class named by ``config.architectures`` (None when none is known)."""
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return None


def meta_model(config: transformers.PretrainedConfig) -> nn.Module:
    """The model's own class (``AutoModel`` when its config names none) on the meta device."""
    cls = model_class(config)
    with torch.device("meta"):
        if cls is not None:
            return cls(config)
        return transformers.AutoModel.from_config(config)


def saved_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{checkpoint key: tensor}`` as ``save_pretrained`` writes ``model`` (meta tensors welcome).

    ``save_pretrained``'s own steps on ``model.state_dict()``: keys to ignore on save, tied
    weights (a tied ``lm_head`` is not written) and transformers' reverted load-time
    conversion (fused experts back to per-expert tensors). Non-persistent buffers are no
    part of a ``state_dict``.

    Args:
        model: a transformers model, e.g. :func:`meta_model`.

    Returns:
        The checkpoint keys with their (possibly meta) tensors.

    Raises:
        Exception: whatever transformers raises for a conversion it cannot revert.
    """
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = model.state_dict()
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    state = remove_tied_weights_from_state_dict(state, model)
    return dict(revert_weight_conversion(model, state))


@dataclass(frozen=True)
class PieceView:
    """Where one checkpoint piece sits in its fused tensor: a strided view of it (sizes,
    strides and offset in elements of the contiguous fused tensor), so nothing the size of
    the fused tensor is built to read or write it."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def of(self, fused: torch.Tensor) -> torch.Tensor:
        """The piece as a view of ``fused`` (contiguous, of the fused shape)."""
        return fused.as_strided(self.size, self.stride, fused.storage_offset() + self.offset)

    @property
    def compact(self) -> bool:
        """Whether the view covers ``[offset, offset + numel)`` exactly, each element once
        (its dimensions, ordered by stride, are a contiguous layout, possibly permuted)."""
        step = 1
        for stride, size in sorted((st, s) for s, st in zip(self.size, self.stride) if s != 1):
            if stride != step:
                return False
            step *= size
        return True

    @property
    def numel(self) -> int:
        n = 1
        for s in self.size:
            n *= int(s)
        return n


# Piece locations: a strided view (the usual case) or, where the conversion copies, an int64
# map of flat positions the size of the piece.
Piece = Union[PieceView, torch.Tensor]


def fused_pieces(model: nn.Module, module_key: str, shape: Sequence[int]) -> dict[str, Piece]:
    """Where each checkpoint tensor of the fused in-memory tensor ``module_key`` sits in it.

    transformers' own reverted conversion (the one ``save_pretrained`` applies) is run on a
    meta tensor of ``shape`` (no memory): its pieces come back as views of it (unbind,
    chunk, transpose), whose sizes, strides and offsets say where each piece's elements sit
    in the fused tensor (:class:`PieceView`). The meta input is itself a view at a nonzero
    offset of a larger meta tensor, so a piece the conversion copied (offset 0) cannot pass
    for a view. When the pieces are not views that tile the tensor exactly, the conversion
    is run on a tensor holding each element's flat position instead (an int64 map the size
    of the fused tensor; docs/methods.md, "Mixture-of-experts blocks"). Nothing of the
    layout is re-implemented.

    Args:
        model: the class on the meta device (:func:`meta_model`).
        module_key: the fused tensor's key in ``model.state_dict()``
            (``model.layers.0.mlp.experts.gate_up_proj``).
        shape: its shape.

    Returns:
        ``{checkpoint key: PieceView or int64 tensor of flat positions}``; one entry for
        ``module_key`` itself when the class writes the tensor as it holds it.

    Raises:
        ModelInputError: the conversion does more than move elements (every element must
            land in exactly one piece, once).
    """
    views = _piece_views(model, module_key, shape)
    if views is not None:
        return dict(views)
    LOG.info(
        "%s: the checkpoint pieces are not views of the fused tensor; mapping its %s "
        "elements by position (a transient int64 map)",
        module_key,
        _numel(shape),
    )
    return dict(_position_map(model, module_key, shape))


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# Where the meta tensors of :func:`_piece_views` sit in their (meta, memoryless) storages:
# the fused tensor and each copy the conversion makes get disjoint offset ranges far above
# any tensor's size, so a tensor the conversion builds otherwise (offset below its size)
# is never taken for a view of them.
_REGION = 2**44


class _CopyTracker(TorchFunctionMode):
    """During the reverted conversion on meta: each whole copy (``contiguous``, ``clone``)
    of a tensor that is a known strided view of the fused tensor comes back as a meta tensor
    in a region of its own, remembered with the strided map it copies."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        # region start -> (shape of the tensor there, its map in the fused tensor)
        self.regions: dict[int, tuple[tuple[int, ...], PieceView]] = {}
        self.fused = self._place(shape, PieceView(shape, _contiguous_strides(shape), 0))

    def _place(self, shape: tuple[int, ...], view: PieceView) -> torch.Tensor:
        start = _REGION * (len(self.regions) + 1)
        self.regions[start] = (shape, view)
        storage = torch.empty(start + _numel(shape), device="meta")
        return storage[start:].view(shape)

    def resolve(self, t: torch.Tensor) -> Optional[PieceView]:
        """``t`` as a strided view of the fused tensor, or None (not one of the tracked
        tensors, or a view the maps do not compose for)."""
        start = (int(t.storage_offset()) // _REGION) * _REGION
        if start not in self.regions:
            return None
        shape, view = self.regions[start]
        local = int(t.storage_offset()) - start
        strides = _contiguous_strides(shape)
        origin = []  # the view's first element as an index of ``shape``
        for stride in strides:
            origin.append(local // stride)
            local %= stride
        out_stride = []
        used: set[int] = set()
        for size, stride in zip(t.shape, t.stride()):
            if size == 1:
                out_stride.append(0)
                continue
            # the dimension of ``shape`` whose contiguous stride divides ``stride`` and
            # whose index stays in range along this dimension of the view
            dim = next(
                (d for d, st in enumerate(strides) if st <= stride and stride % st == 0), None
            )
            if dim is None or dim in used:
                return None
            step = stride // strides[dim]
            if origin[dim] + (size - 1) * step >= shape[dim]:
                return None
            used.add(dim)
            out_stride.append(step * view.stride[dim])
        offset = view.offset + sum(i * st for i, st in zip(origin, view.stride))
        return PieceView(tuple(int(d) for d in t.shape), tuple(out_stride), offset)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.contiguous, torch.Tensor.clone, torch.clone) and args:
            x = args[0]
            if func is torch.Tensor.contiguous and x.is_contiguous():
                return x
            view = self.resolve(x)
            if view is not None:
                return self._place(tuple(int(d) for d in x.shape), view)
        return func(*args, **kwargs)


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, step = [], 1
    for d in reversed(shape):
        out.append(step)
        step *= int(d)
    return tuple(reversed(out))


def _piece_views(
    model: nn.Module, module_key: str, shape: Sequence[int]
) -> Optional[dict[str, PieceView]]:
    """The pieces as strided views of the fused tensor, or None when they are not views
    that tile it exactly (each element in one piece, once)."""
    from transformers.core_model_loading import revert_weight_conversion

    tracker = _CopyTracker(tuple(int(d) for d in shape))
    try:
        with tracker:
            reverted = dict(revert_weight_conversion(model, {module_key: tracker.fused}))
    except Exception as e:  # a conversion that needs real data: the position map decides
        LOG.debug("%s: the reverted conversion does not run on meta (%s)", module_key, e)
        return None
    views: dict[str, PieceView] = {}
    for key, piece in reverted.items():
        view = tracker.resolve(piece)
        if view is None or not view.compact:
            return None
        views[key] = view
    ranges = sorted((v.offset, v.offset + v.numel) for v in views.values())
    end = 0
    for lo, hi in ranges:
        if lo != end:
            return None  # a gap or an overlap
        end = hi
    return views if end == _numel(shape) else None


def _position_map(
    model: nn.Module, module_key: str, shape: Sequence[int]
) -> dict[str, torch.Tensor]:
    """The pieces as int64 maps of flat positions (the conversion run on the positions)."""
    from transformers.core_model_loading import revert_weight_conversion

    numel = _numel(shape)
    if numel > 2**53:  # pragma: no cover - float64 holds positions exactly up to 2**53
        raise ModelInputError(f"{module_key}: {numel} elements, too many to index exactly")
    positions = torch.arange(numel, dtype=torch.float64).reshape(tuple(shape))
    reverted = dict(revert_weight_conversion(model, {module_key: positions}))
    out = {key: t.to(torch.int64) for key, t in reverted.items()}
    seen = torch.cat([t.reshape(-1) for t in out.values()]) if out else torch.empty(0)
    exact = all(torch.equal(t.to(torch.float64), reverted[k]) for k, t in out.items())
    if (
        not exact
        or seen.numel() != numel
        or not torch.equal(seen.sort().values, positions.view(-1).to(torch.int64))
    ):
        raise ModelInputError(
            f"{module_key}: transformers' conversion of this tensor to its checkpoint pieces "
            f"({', '.join(list(out)[:3])}) is not a rearrangement of its elements; it cannot "
            "be read or written piece by piece"
        )
    return out


def gather_fused(
    pieces: Union[Mapping[str, torch.Tensor], Callable[[str], torch.Tensor]],
    index: Mapping[str, Piece],
    shape: Sequence[int],
) -> torch.Tensor:
    """The fused tensor from its checkpoint pieces (``index``: :func:`fused_pieces`).

    ``pieces``: the pieces by key, or a function reading one, so that a reader holds one
    piece at a time besides the result.
    """
    get = pieces.__getitem__ if isinstance(pieces, Mapping) else pieces
    out: Optional[torch.Tensor] = None
    for key, where in index.items():
        piece = get(key)
        if out is None:
            out = torch.empty(tuple(int(d) for d in shape), dtype=piece.dtype, device=piece.device)
        if isinstance(where, PieceView):
            where.of(out).copy_(piece.reshape(where.size))
        else:
            out.view(-1)[where.reshape(-1).to(out.device)] = piece.reshape(-1)
        del piece
    assert out is not None, "a fused tensor has at least one piece"
    return out


def split_fused(tensor: torch.Tensor, index: Mapping[str, Piece]) -> dict[str, torch.Tensor]:
    """A fused tensor as its checkpoint pieces (contiguous copies), by :func:`fused_pieces`."""
    fused = tensor.contiguous()
    flat = fused.reshape(-1)
    return {
        key: (
            where.of(fused) if isinstance(where, PieceView) else flat[where.to(flat.device)]
        ).contiguous()
        for key, where in index.items()
    }


def rename_to_module_keys(model: nn.Module, checkpoint_keys: Iterable[str]) -> dict[str, str]:
    """``{checkpoint key: module key}`` by transformers' own load-time renaming.

    Keys that transformers fuses or splits at load time (``WeightConverter``) are absent
    from the result; :func:`fused_keys` lists them.
    """
    out: dict[str, str] = {}
    for key, renamed, converter in _renamed(model, checkpoint_keys):
        if converter is None:
            out[key] = renamed
    return out


def fused_keys(model: nn.Module, checkpoint_keys: Iterable[str]) -> dict[str, str]:
    """``{checkpoint key: converter}`` for the keys transformers fuses or splits at load time."""
    return {
        key: str(converter)
        for key, _, converter in _renamed(model, checkpoint_keys)
        if converter is not None
    }


def fused_module_keys(model: nn.Module, checkpoint_keys: Iterable[str]) -> dict[str, list[str]]:
    """``{module key: its checkpoint pieces}`` for the tensors transformers fuses at load
    time (Mixtral's ``mlp.experts.gate_up_proj`` from ``block_sparse_moe.experts.N.w1/w3``)."""
    out: dict[str, list[str]] = {}
    for key, renamed, converter in _renamed(model, checkpoint_keys):
        if converter is not None:
            out.setdefault(renamed, []).append(key)
    return out


def saved_pieces(
    model: nn.Module, module_key: str, tensor: torch.Tensor
) -> dict[str, torch.Tensor]:
    """``tensor`` (the class's ``module_key``) as ``save_pretrained`` writes it: its
    checkpoint pieces by transformers' own reverted conversion (itself when not fused)."""
    from transformers.core_model_loading import revert_weight_conversion

    return {
        k: v.contiguous() for k, v in revert_weight_conversion(model, {module_key: tensor}).items()
    }


def _renamed(model: nn.Module, checkpoint_keys: Iterable[str]):
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        rename_source_key,
    )

    transforms = get_model_conversion_mapping(model, add_legacy=True)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta_state = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None) or None
    for key in checkpoint_keys:
        renamed, converter = rename_source_key(key, renamings, converters, prefix, meta_state)
        yield key, renamed, converter


def unloaded_keys(model: nn.Module, module_keys: Mapping[str, str]) -> list[str]:
    """The checkpoint keys (of ``{checkpoint key: module key}``) the class does not load.

    A key is loaded when its module key is a key of ``model.state_dict()``: non-persistent
    buffers (``position_ids``, ``inv_freq``) are not in it, nor are tensors of modules the
    class does not have; ``from_pretrained`` skips both ("unexpected keys").
    """
    state = set(model.state_dict())
    return sorted(key for key, module_key in module_keys.items() if module_key not in state)


def tied_weights(model: nn.Module) -> dict[str, str]:
    """``{tied module key: the module key it shares}`` for this model's config (empty: none)."""
    getter = getattr(model, "get_expanded_tied_weights_keys", None)
    if getter is None:
        return {}
    return dict(getter(all_submodels=True))


def log_unloaded(label: str, keys: Sequence[str], cls_name: str) -> None:
    """The one log line for a model's unloaded tensors."""
    if keys:
        shown = ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
        LOG.info(
            "%s: %d tensor(s) that %s does not load are ignored for merging: %s",
            label,
            len(keys),
            cls_name,
            shown,
        )


@dataclass(frozen=True)
class TyingInput:
    """One input model's tying, for :func:`check_tied_weights`."""

    label: str
    tied: Mapping[str, str]  # tied module key -> module key it shares
    keys: frozenset[str]  # every module key of its class (tied or not)


def check_tied_weights(base: Optional[TyingInput], experts: Sequence[TyingInput]) -> None:
    """Refuse inputs whose tying cannot be merged; log how the others are handled.

    - Every input ties a weight, or none does: nothing to do.
    - The base keeps a weight separate (``lm_head``) that some experts tie: those experts'
      weight *is* the one they share (their embeddings, as transformers runs them), and it
      is merged as such; the merged model keeps it separate, as the base does.
    - The base ties a weight that some experts keep separate: refused. The merged model
      would take the base's config, tie the weight and silently drop those experts' own.
    """
    if base is None:
        return
    for target, source in base.tied.items():
        separate = [e.label for e in experts if target in e.keys and target not in e.tied]
        if separate:
            tying = [e.label for e in experts if target in e.tied]
            raise ModelInputError(
                f"{target} is tied to {source} in the base model {base.label}"
                + (f" and in {', '.join(tying)}" if tying else "")
                + f" but is a separate tensor in {', '.join(separate)}; the merged model would "
                "tie it as the base does and lose those experts' own "
                f"{target}. Use a base that keeps {target} separate (tie_word_embeddings: "
                "false in its config.json, with the tensor saved), or experts that tie it too"
            )
    for e in experts:
        for target, source in e.tied.items():
            if base.tied.get(target) != source and target in base.keys:
                LOG.info(
                    "%s ties %s to %s (the base model %s keeps it separate): its %s is merged "
                    "as %s",
                    e.label,
                    target,
                    source,
                    base.label,
                    target,
                    source,
                )


@dataclass(frozen=True)
class LoadReport:
    """What ``from_pretrained`` of a class reports for a checkpoint's tensor names and shapes.

    Module keys (the class's ``state_dict`` names) except ``unexpected``: the checkpoint's
    own keys that the class does not load (as transformers renamed them where a key cannot
    be traced back, e.g. a fused target).
    """

    missing: frozenset[str]
    unexpected: frozenset[str]
    mismatched: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]  # key -> (got, expected)
    conversion_errors: dict[str, str]  # module key -> why its conversion failed


def load_report(
    config: transformers.PretrainedConfig, shapes: Mapping[str, Sequence[int]]
) -> LoadReport:
    """Load a checkpoint of ``shapes`` into the class of ``config`` as ``from_pretrained`` does,
    on the meta device (no weight is read or allocated).

    transformers' own loading steps run on meta tensors of the checkpoint's shapes: the
    model's conversion mapping (``get_model_conversion_mapping``: renames such as LLaVA's
    ``language_model.model.`` → ``model.language_model.``, fused experts), the base-model
    prefix added or stripped, ``convert_and_load_state_dict_in_model`` (its missing,
    unexpected and mismatched keys), then tied weights (a tied ``lm_head`` absent from the
    checkpoint is not missing) and the class's ``_keys_to_ignore_on_load_*`` patterns as
    ``_finalize_model_loading`` applies them. Non-persistent buffers are no part of a
    ``state_dict`` and are never missing.

    Args:
        config: the model's config (its ``architectures`` names the class).
        shapes: ``{checkpoint key: shape}``.

    Returns:
        The :class:`LoadReport`.

    Raises:
        Exception: whatever transformers raises for this class and config.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        convert_and_load_state_dict_in_model,
        rename_source_key,
    )
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.utils import logging as hf_logging

    model = meta_model(config)  # a fresh one: loading replaces its parameters
    module_state = model.state_dict()
    mapping = get_model_conversion_mapping(model)
    load_config = LoadStateDictConfig(device_map={"": "meta"}, weight_mapping=mapping)
    state = {k: torch.empty(tuple(int(d) for d in s), device="meta") for k, s in shapes.items()}
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # transformers' "Loading weights" bar, not ours to show
    try:
        info, _ = convert_and_load_state_dict_in_model(model, state, load_config)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    model.tie_weights(missing_keys=info.missing_keys, recompute_mapping=False)
    model._adjust_missing_and_unexpected_keys(info)
    unexpected = set(info.unexpected_keys)
    if unexpected - set(shapes):
        # named by the checkpoint's own key: the one transformers renamed into it (step 1 of
        # its loading, run again for these keys only)
        renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
        converters = [t for t in mapping if isinstance(t, WeightConverter)]
        prefix = getattr(model, "base_model_prefix", None) or None
        loaded_as: dict[str, str] = {}
        for key in shapes:
            renamed, _ = rename_source_key(key, renamings, converters, prefix, module_state)
            loaded_as.setdefault(renamed, key)
        unexpected = {k if k in shapes else loaded_as.get(k, k) for k in unexpected}
    return LoadReport(
        missing=frozenset(info.missing_keys),
        unexpected=frozenset(unexpected),
        mismatched={k: (tuple(got), tuple(want)) for k, got, want in info.mismatched_keys},
        conversion_errors={
            k: _last_line(str(v)) for k, v in (info.conversion_errors or {}).items()
        },
    )


def _last_line(error: str) -> str:
    """The exception line of a traceback transformers logged for a failed conversion."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    caught = [line for line in lines if line[:1].isupper() and "Error" in line.split(":")[0]]
    return caught[-1] if caught else (lines[-1] if lines else error)
