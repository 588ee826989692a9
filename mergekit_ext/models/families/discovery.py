"""Discover a model's blocks, pre-block modules and linear groups from the model itself.

The model is the transformers class built on the meta device (no weights). Discovery:

1. the **backbone** is the family's (``base_model`` unless declared); an encoder-decoder
   model is refused here (two stacks, cross-attention: see docs/methods.md);
2. the **block list** is the ``ModuleList`` of identical modules in the backbone that holds
   the most parameters;
3. one **traced forward** of the backbone on a few dummy tokens (or one blank image): every
   parameter is a stride-0 zero tensor (no memory), every linear-like layer (``nn.Linear``,
   GPT-2's ``Conv1D``) returns zeros of its output shape and records the tensor it read.
   From it: the modules and tensors used before the first block (the embeddings pass needs
   them), anything that runs *between* blocks (refused: the executor carries hidden states
   from one block straight to the next), what a block returns (a tensor or a tuple), and
   per block the **linear groups**: the linear layers that read the same tensor object,
   ordered by their first call, the layers of a group in call order. Fused projections
   (``qkv_proj``, ``gate_up_proj``, Falcon's ``query_key_value``) are one linear each.

Mixture-of-experts blocks: an *experts module* (transformers 5's fused 3-D
``gate_up_proj`` / ``down_proj``) is replaced in the trace by one that records its input and
is a group of its own (``experts=True``); a *router* (one ``[E, H]`` weight, not an
``nn.Linear``) runs on the zero weights, its input is recorded and it is a group of its own.

A linear that also reads a *table* the backbone hands every block (DeBERTa-v3's relative
position embeddings, read by ``query_proj`` and ``key_proj`` with ``share_att_key``) keeps
that call: the linears reading the same tensors form a group, ``GroupSpec.reads`` lists
what each call reads (docs/methods.md, "Relative position tables").

Refused, naming the module and the reason: a linear layer that reads two different inputs
of one row per token in one forward, a weight of a block that is not a
linear layer, experts module or router that ran (a linear the forward never called), a
module that runs between blocks (DeBERTa-v2's convolution after the first block). Nothing
here reads a weight.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from mergekit_ext.errors import ModelInputError
from mergekit_ext.models.families import GroupSpec, ModelFamily
from mergekit_ext.models.head_kind import is_causal_lm

LOG = logging.getLogger(__name__)

ALTERNATIVES = "use a tensor-wise method (ties, ace) or symerge for this model"
# Dummy tokens of the traced forward: short, inside any vocabulary, no padding.
_TRACE_TOKENS = 7  # prime: unlike any table's length (2 x a relative span)
# Last path components too generic to name a group by themselves (BERT's ``output.dense``).
_GENERIC = {"dense", "linear", "proj", "weight"}


def conv1d_class() -> Optional[type]:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - every supported transformers has it
        return None
    return Conv1D


def is_transposed_linear(module: nn.Module) -> bool:
    """GPT-2's ``Conv1D``: ``y = x W + b`` with ``W`` stored ``in x out``."""
    conv1d = conv1d_class()
    return conv1d is not None and isinstance(module, conv1d)


def is_linear_like(module: nn.Module) -> bool:
    """``nn.Linear`` (and subclasses such as Falcon's) or GPT-2's ``Conv1D``."""
    return isinstance(module, nn.Linear) or is_transposed_linear(module)


def is_experts_module(module: nn.Module) -> bool:
    """transformers 5's fused mixture-of-experts experts (``MixtralExperts`` ...): 3-D
    ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] parameters of their own."""
    params = dict(module.named_parameters(recurse=False))
    return all(n in params and params[n].dim() == 3 for n in ("gate_up_proj", "down_proj"))


def is_router(module: nn.Module, num_experts: int) -> bool:
    """A mixture-of-experts router: not a linear layer, one 2-D ``weight`` of ``num_experts``
    rows of its own (its logits are ``F.linear(x, weight)``; it returns the routing)."""
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    return (
        not is_linear_like(module)
        and weight is not None
        and weight.dim() == 2
        and int(weight.shape[0]) == num_experts
        and set(params) <= {"weight", "bias", "e_score_correction_bias"}
    )


def moe_modules(block: nn.Module) -> tuple[set[str], set[str]]:
    """The experts modules of a block and its routers (module paths in the block)."""
    experts = {n for n, m in block.named_modules() if n and is_experts_module(m)}
    counts = {int(block.get_submodule(n).gate_up_proj.shape[0]) for n in experts}
    routers = {
        n
        for n, m in block.named_modules()
        if n and n not in experts and any(is_router(m, e) for e in counts)
    }
    return experts, routers


def out_features(module: nn.Module) -> int:
    if is_transposed_linear(module):
        return int(module.nf)  # type: ignore[attr-defined]
    return int(module.out_features)  # type: ignore[attr-defined]


def block_signature(block: nn.Module) -> tuple[Any, ...]:
    """What makes two blocks the same for discovery: module names, classes, parameter shapes."""
    modules = tuple((name, type(m).__name__) for name, m in block.named_modules())
    params = tuple((name, tuple(p.shape)) for name, p in block.named_parameters())
    return modules, params


def group_label(modules: tuple[str, ...]) -> str:
    """A short label: ``qkv`` for q/k/v (query/key/value), else the layers' names joined
    (``gate_up``); one layer: its name, or its parent's for a generic one (``output``)."""
    if len(modules) == 1:
        parts = modules[0].split(".")
        if parts[-1] in _GENERIC and len(parts) > 1:
            return "_".join(parts[:-1])
        return parts[-1]
    stems = [m.split(".")[-1].removesuffix("_proj") for m in modules]
    for attention in (["q", "k", "v"], ["query", "key", "value"]):
        if stems[:3] == attention:
            stems = ["qkv", *stems[3:]]
            break
    return "_".join(stems)


def _unique_labels(groups: list[tuple[str, ...]]) -> list[str]:
    labels = [group_label(g) for g in groups]
    for i, label in enumerate(labels):
        if labels.count(label) > 1:
            labels[i] = "_".join(groups[i][0].split("."))
    return labels


class _TensorUses(TorchFunctionMode):
    """Records which of the watched tensors (by identity) any torch function reads."""

    def __init__(self, watched: dict[int, str]) -> None:
        super().__init__()
        self.watched = watched
        self.used: list[str] = []
        self.active = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.active:
            for leaf in tree_flatten((args, kwargs))[0]:
                name = self.watched.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
                if name is not None and name not in self.used:
                    self.used.append(name)
        return func(*args, **kwargs)


def _find_block_list(backbone: nn.Module, what: str) -> str:
    best: Optional[tuple[int, int, str]] = None
    for path, module in backbone.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0 or not path:
            continue
        if len({type(child) for child in module}) != 1 or is_linear_like(module[0]):
            continue
        size = sum(p.numel() for p in module.parameters())
        if size == 0:
            continue
        key = (size, len(module), path)
        if best is None or key[:2] > best[:2]:
            best = key
    if best is None:
        raise ModelInputError(
            f"{what}: {type(backbone).__name__} has no list of identical blocks "
            f"(nn.ModuleList) to walk block by block; {ALTERNATIVES}"
        )
    return best[2]


def _modality(backbone: nn.Module, declared: Optional[str], what: str) -> str:
    if declared is not None:
        return declared
    params = inspect.signature(backbone.forward).parameters
    if "input_ids" in params:
        return "text"
    if "pixel_values" in params:
        return "image"
    raise ModelInputError(
        f"{what}: {type(backbone).__name__}.forward takes neither input_ids nor pixel_values; "
        f"the sequential executor runs text or image models; {ALTERNATIVES}"
    )


def _sub_config(backbone: nn.Module, config: Any) -> Any:
    return getattr(backbone, "config", None) or config


def _dummy_inputs(backbone: nn.Module, config: Any, modality: str) -> dict[str, torch.Tensor]:
    cfg = _sub_config(backbone, config)
    if modality == "image":
        size = getattr(cfg, "image_size", 224)
        size = size if isinstance(size, int) else int(size[0])
        channels = int(getattr(cfg, "num_channels", 3) or 3)
        return {"pixel_values": torch.zeros(1, channels, size, size)}
    vocab = int(getattr(cfg, "vocab_size", 0) or 0) or 32
    tokens = torch.arange(_TRACE_TOKENS).remainder(max(vocab - 1, 1)) + 1
    tokens = tokens.clamp(max=vocab - 1).unsqueeze(0)
    return {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}


class _Trace:
    """What one traced forward recorded."""

    def __init__(self) -> None:
        self.order: list[str] = []  # module paths in call order (pre-hooks)
        self.block_calls: list[int] = []  # block indices in call order
        self.linear_calls: dict[int, list[tuple[str, torch.Tensor]]] = {}  # block -> calls
        self.block_outputs: dict[int, Any] = {}
        self.block_inputs: dict[int, tuple[int, ...]] = {}  # leading shape of the hidden states
        # storages of the other tensors the backbone hands each block (masks, position
        # tables): a linear reading one of them reads a table, not the tokens
        self.block_tables: dict[int, set[int]] = {}
        self.current_block: Optional[int] = None


@contextmanager
def _fake_linears(blocks: nn.ModuleList, trace: _Trace) -> Iterator[None]:
    """Every linear-like layer of the blocks returns zeros and records its input."""
    patched: list[nn.Module] = []

    def fake(index: int, name: str, module: nn.Module):
        width = out_features(module)

        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            trace.linear_calls.setdefault(index, []).append((name, x))
            return x.new_zeros(*x.shape[:-1], width)

        return forward

    def fake_experts(index: int, name: str):
        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            trace.linear_calls.setdefault(index, []).append((name, x))
            return torch.zeros_like(x)

        return forward

    def record(index: int, name: str):
        def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            trace.linear_calls.setdefault(index, []).append((name, args[0]))

        return hook

    handles = []
    try:
        for index, block in enumerate(blocks):
            experts, routers = moe_modules(block)
            for name, module in block.named_modules():
                if name in experts:
                    module.forward = fake_experts(index, name)  # type: ignore[method-assign]
                    patched.append(module)
                elif name in routers:  # runs (zeros route somewhere); its input is recorded
                    handles.append(module.register_forward_pre_hook(record(index, name)))
                elif name and is_linear_like(module):
                    module.forward = fake(index, name, module)  # type: ignore[method-assign]
                    patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward  # the instance attribute; the class's forward is back
        for h in handles:
            h.remove()


def _trace(
    backbone: nn.Module, layers_path: str, inputs: dict[str, Any], what: str
) -> tuple[_Trace, list[str], list[str]]:
    """Run the backbone once; returns the trace, the non-block tensors used before the first
    block and those used between blocks (backbone-relative names)."""
    blocks = backbone.get_submodule(layers_path)
    trace = _Trace()
    params: dict[str, torch.Tensor] = {}
    for name, p in backbone.named_parameters():
        params[name] = torch.zeros((), dtype=torch.float32).expand(p.shape)
    block_prefix = layers_path + "."
    watched = {id(t): n for n, t in params.items() if not n.startswith(block_prefix)}
    for name, buf in backbone.named_buffers():
        if not name.startswith(block_prefix) and buf.device.type != "meta":
            watched[id(buf)] = name
    uses = _TensorUses(watched)
    before: list[str] = []
    between: list[str] = []
    handles = []

    def on_module(path: str):
        def hook(module: nn.Module, args: Any) -> None:
            trace.order.append(path)

        return hook

    def on_block(index: int):
        def pre(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            hidden = args[0] if args else kwargs.get("hidden_states")
            if isinstance(hidden, torch.Tensor):
                trace.block_inputs[index] = tuple(hidden.shape[:-1])
            others = (list(args[1:]), {k: v for k, v in kwargs.items() if k != "hidden_states"})
            trace.block_tables[index] = {
                t.untyped_storage().data_ptr()
                for t in tree_flatten(others)[0]
                if isinstance(t, torch.Tensor) and t.device.type != "meta"
            }
            if not trace.block_calls:
                before.extend(uses.used)
            elif len(trace.block_calls) < len(blocks):
                between.extend(u for u in uses.used if u not in before and u not in between)
            uses.used = []
            uses.active = False
            trace.order.append(f"__block__{index}")
            trace.block_calls.append(index)
            trace.current_block = index

        def post(module: nn.Module, args: Any, output: Any) -> None:
            trace.block_outputs[index] = output
            trace.current_block = None
            uses.active = True

        return pre, post

    for path, module in backbone.named_modules():
        if path and not path.startswith(block_prefix) and path != layers_path:
            handles.append(module.register_forward_pre_hook(on_module(path)))
    for index, block in enumerate(blocks):
        pre, post = on_block(index)
        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post))
    extra = (
        {"use_cache": False}
        if "use_cache" in inspect.signature(backbone.forward).parameters
        else {}
    )
    # as the executor runs it: dropout off (in training mode a dropout copies the tensor it
    # reads, and a table handed to the blocks would no longer be recognised)
    training = backbone.training
    backbone.eval()
    try:
        with _fake_linears(blocks, trace), uses, torch.no_grad():
            torch.func.functional_call(backbone, params, args=(), kwargs={**inputs, **extra})
    except ModelInputError:
        raise
    except Exception as e:
        raise ModelInputError(
            f"{what}: a traced forward of {type(backbone).__name__} (no weights, "
            f"{_TRACE_TOKENS} dummy tokens) failed, so its blocks and linear groups cannot be "
            f"discovered ({type(e).__name__}: {e}); {ALTERNATIVES}"
        ) from e
    finally:
        backbone.train(training)
        for h in handles:
            h.remove()
    return trace, before, between


_MOE_REASON = (
    "mixture-of-experts expert weights outside an experts module of transformers 5's layout "
    "(3-D gate_up_proj and down_proj); data-aware merging cannot route them"
)


def _refuse_expert_tensors(block: nn.Module, where: str) -> None:
    """Refuse a block holding weights of more than two dimensions (MoE experts) before the
    traced forward (which could not run them on stride-0 tensors anyway)."""
    experts, _ = moe_modules(block)
    for name, p in block.named_parameters():
        if p.dim() >= 3:
            owner = block.get_submodule(name.rsplit(".", 1)[0]) if "." in name else block
            if name.rsplit(".", 1)[0] in experts:
                continue
            raise ModelInputError(
                f"{where}.{name} ({type(owner).__name__}, shape {list(p.shape)}): "
                f"{_MOE_REASON}; {ALTERNATIVES}"
            )


def _block_groups(
    block: nn.Module,
    calls: list[tuple[str, torch.Tensor]],
    where: str,
    tokens: Optional[tuple[int, ...]],
    tables: frozenset[int] = frozenset(),
) -> tuple[GroupSpec, ...]:
    """The linear groups of one block from its recorded linear calls (``tokens``: the
    leading shape of the block's input hidden states; ``tables``: the storages of the other
    tensors the backbone hands the block)."""
    reads: dict[str, list[torch.Tensor]] = {}  # module -> the tensors it read, in call order
    kinds: dict[str, list[str]] = {}  # module -> "tokens" | "table" per call
    experts, routers = moe_modules(block)
    flat = (int(torch.tensor(tokens).prod()),) if tokens is not None else None
    for name, x in calls:
        rows = tuple(x.shape[:-1])
        # the block's tokens, flattened (a router's input) or with singleton axes (DeepSeek's
        # [B, 1, T, D] latent) are the same rows in the same order
        same = rows in (tokens, flat) or (
            tokens is not None
            and tuple(d for d in rows if d != 1) == tuple(d for d in tokens if d != 1)
        )
        kind = "tokens"
        if tokens is not None and not same:
            if x.untyped_storage().data_ptr() not in tables or name in experts | routers:
                raise ModelInputError(
                    f"{where}.{name} ({type(block.get_submodule(name)).__name__}) reads a "
                    f"tensor of shape {list(x.shape)}, not one row per token of the block's "
                    f"input {[*tokens, '...']} nor a table the backbone hands every block: "
                    "its input statistics would not be the calibration tokens'; "
                    f"{ALTERNATIVES}"
                )
            kind = "table"  # DeBERTa's relative position embeddings (share_att_key)
        seen = reads.setdefault(name, [])
        if any(t is x for t in seen):
            continue
        if kind == "tokens" and "tokens" in kinds.get(name, []):
            raise ModelInputError(
                f"{where}.{name} ({type(block.get_submodule(name)).__name__}) reads two "
                "different inputs of one row per token in one forward pass: its input "
                "statistics would mix them with no weighting that the data defines; "
                f"{ALTERNATIVES}"
            )
        seen.append(x)
        kinds.setdefault(name, []).append(kind)
    inputs: list[Optional[tuple[int, ...]]] = []  # per group, what its linears read (None: alone)
    members: list[list[str]] = []
    for name, xs in reads.items():
        if kinds[name][0] != "tokens":
            raise ModelInputError(
                f"{where}.{name} ({type(block.get_submodule(name)).__name__}) reads a table "
                "before the tokens; the executor fits a linear whose first call reads the "
                f"block's tokens; {ALTERNATIVES}"
            )
        if name in experts or name in routers:
            # a group of its own: a router's weight is no linear of the shared experts, and
            # the experts are merged one expert at a time
            inputs.append(None)
            members.append([name])
            continue
        # linears reading the same tensors (DeBERTa's query_proj and key_proj: the tokens and
        # the relative position table; value_proj: the tokens only) form one group
        key = tuple(id(t) for t in xs)
        for i, seen_key in enumerate(inputs):
            if seen_key == key:
                members[i].append(name)
                break
        else:
            inputs.append(key)
            members.append([name])
    grouped = {m for g in members for m in g}
    for name in sorted((experts | routers) - grouped):
        raise ModelInputError(
            f"{where}.{name} ({type(block.get_submodule(name)).__name__}) does not run in a "
            f"forward pass of the block: the executor cannot fit it from its inputs; {ALTERNATIVES}"
        )
    for name, module in block.named_modules():
        if name and is_linear_like(module) and name not in grouped:
            raise ModelInputError(
                f"{where}.{name} ({type(module).__name__}) does not run in a forward pass of "
                "the block (a mixture-of-experts expert, or a layer this configuration does "
                f"not use): the executor cannot fit it from its inputs; {ALTERNATIVES}"
            )
    for name, p in block.named_parameters():
        module_path = name.rsplit(".", 1)[0] if "." in name else ""
        owner = block.get_submodule(module_path)
        if p.dim() < 2 or (
            module_path in grouped
            and (is_linear_like(owner) or module_path in experts or module_path in routers)
        ):
            continue
        if "expert" in name.lower() or p.dim() >= 3:
            reason = _MOE_REASON
        else:
            reason = "a weight matrix of a module that is not a linear layer"
        raise ModelInputError(
            f"{where}.{name} ({type(owner).__name__}, shape {list(p.shape)}): {reason}; "
            f"{ALTERNATIVES}"
        )
    groups = [tuple(g) for g in members]
    return tuple(
        GroupSpec(
            label,
            g,
            frozenset(m for m in g if is_transposed_linear(block.get_submodule(m))),
            experts=g[0] in experts,
            reads=tuple(kinds[g[0]]) if len(kinds[g[0]]) > 1 else (),
        )
        for label, g in zip(_unique_labels(groups), groups)
    )


# Discovered structures by (family, class, config): the base and experts of one merge share
# one architecture, so the traced forward runs once.
_DISCOVERED: dict[tuple[str, str, str], dict[str, Any]] = {}
_FIELDS = (
    "layers_paths",
    "pre_block_modules",
    "modality",
    "causal_lm",
    "block_returns",
    "fused_experts",
    "_discovered_groups",
)


def discover_structure(family: ModelFamily, model: nn.Module, config: Any) -> None:
    """Fill ``family`` (a declaration, possibly empty) from ``model`` (meta device)."""
    key = (family.name, type(model).__qualname__, config.to_json_string(use_diff=False))
    if key not in _DISCOVERED:
        _discover(family, model, config)
        _DISCOVERED[key] = {f: getattr(family, f) for f in _FIELDS}
    for name, value in _DISCOVERED[key].items():
        setattr(family, name, value)


def _discover(family: ModelFamily, model: nn.Module, config: Any) -> None:
    what = f"{config.model_type} ({type(model).__name__})"
    if getattr(config, "is_encoder_decoder", False):
        raise ModelInputError(
            f"{what} is an encoder-decoder model: the sequential executor walks one stack of "
            "blocks, and the decoder's cross-attention reads the (merged) encoder's output, "
            "which it does not carry; data-aware methods do not merge it (docs/methods.md, "
            f"'Model structure'); {ALTERNATIVES}"
        )
    path = family.backbone_path(model)
    backbone = model.get_submodule(path) if path else model
    layers_path = (
        family.layers_path(backbone) if family.layers_paths else _find_block_list(backbone, what)
    )
    blocks = backbone.get_submodule(layers_path)
    for index, block in enumerate(blocks):
        _refuse_expert_tensors(block, f"{type(model).__name__} block {layers_path}.{index}")
    modality = _modality(backbone, family.modality, what)
    trace, before, between = _trace(
        backbone, layers_path, _dummy_inputs(backbone, config, modality), what
    )
    if trace.block_calls != list(range(len(blocks))):
        raise ModelInputError(
            f"{what}: the forward pass calls the blocks of {layers_path} in the order "
            f"{trace.block_calls[:8]}, not once each in order; the executor walks them in order; "
            f"{ALTERNATIVES}"
        )
    if between:
        raise ModelInputError(
            f"{what}: {', '.join(between[:3])} is used between blocks of {layers_path} (after "
            "the first, before the last): the executor carries the hidden states from one "
            f"block straight to the next; {ALTERNATIVES}"
        )
    ancestors = {""}
    parts = layers_path.split(".")
    ancestors.update(".".join(parts[:i]) for i in range(1, len(parts)))
    pre = _pre_block_modules(trace, before, ancestors)
    output = trace.block_outputs.get(0)
    family.block_returns = len(output) if isinstance(output, tuple) else 0
    groups_by_signature: dict[Any, tuple[GroupSpec, ...]] = {}
    for index, block in enumerate(blocks):
        where = f"{type(model).__name__} block {layers_path}.{index}"
        groups = _block_groups(
            block,
            trace.linear_calls.get(index, []),
            where,
            trace.block_inputs.get(index),
            frozenset(trace.block_tables.get(index, ())),
        )
        if not groups:
            raise ModelInputError(
                f"{where}: no linear layer runs in the block; nothing to merge with data; "
                f"{ALTERNATIVES}"
            )
        signature = block_signature(block)
        known = groups_by_signature.get(signature)
        if known is not None and known != groups:
            raise ModelInputError(
                f"{where}: blocks of the same layout read their linear layers' inputs "
                f"differently ({[g.modules for g in known]} vs {[g.modules for g in groups]}); "
                f"{ALTERNATIVES}"
            )
        groups_by_signature[signature] = groups
    family.layers_paths = (layers_path,)
    family.pre_block_modules = tuple(pre)
    family.modality = modality  # type: ignore[assignment]
    family.causal_lm = is_causal_lm(model)
    family.fused_experts = any(g.experts for gs in groups_by_signature.values() for g in gs)
    family._discovered_groups = groups_by_signature
    LOG.debug(
        "%s: blocks %s (%d), before them %s, groups of block 0 %s",
        what,
        layers_path,
        len(blocks),
        list(pre),
        [(g.label, g.modules) for g in groups_by_signature[block_signature(blocks[0])]],
    )


def _pre_block_modules(trace: _Trace, before: list[str], ancestors: set[str]) -> list[str]:
    """Modules whose tensors the embeddings pass needs: those called before the first block
    and the owners of the tensors read then (a table read as ``.weight`` is not called)."""
    out: list[str] = []
    for path in trace.order:
        if path.startswith("__block__"):
            break
        if path in ancestors or path in out:
            continue
        out.append(path)
    for name in before:
        owner = name.rsplit(".", 1)[0] if "." in name else name
        if owner not in out:
            out.append(owner)
    return out
