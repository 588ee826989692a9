"""PEFT LoRA adapters as experts, merged into their base weights block by block.

mergekit users write an adapter expert as ``model: base_path+adapter_path`` or give the
adapter folder alone (its ``adapter_config.json`` names the base in
``base_model_name_or_path``). mergekit itself merges the adapter into a whole copy of the
base on disk first; here the adapter is applied to each tensor as its block is loaded::

    W_expert = W_base + scale · B A          (nn.Linear; transposed when fan_in_fan_out)
    E_expert = E_base + scale · (B A)ᵀ       (nn.Embedding: lora_embedding_A/B)
    scale = lora_alpha / r   (use_rslora: lora_alpha / sqrt(r)); alpha_pattern/rank_pattern
            are matched like PEFT (``peft.utils.other.get_pattern_key``)

Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", ICLR 2022, eq. (3);
PEFT's ``LoraLayer.get_delta_weight``. Tensors the adapter saves whole (``modules_to_save``
such as a classifier, trained biases, ``base_layer`` copies) replace the base tensor.
DoRA, LoRA biases and other PEFT types are refused with a clear error.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch
from safetensors import safe_open

from mergekit_ext.errors import ModelInputError
from mergekit_ext.models.checkpoint import (
    ModelSource,
    canonical_name,
    compute_tensor,
    rename_to_module_keys,
)
from mergekit_ext.models.model_files import read_json_object, safetensors_header

LOG = logging.getLogger(__name__)

_PEFT_PREFIX = "base_model.model."
_UNSUPPORTED_FLAGS = {
    "use_dora": "DoRA (use_dora: true)",
    "lora_bias": "LoRA biases (lora_bias: true)",
    "use_qalora": "QA-LoRA",
}


@dataclass(frozen=True)
class LoraDelta:
    """One adapted weight: ``scale · B A`` (linear) or ``scale · (B A)ᵀ`` (embedding)."""

    module: str  # PEFT module name, e.g. model.layers.0.self_attn.q_proj
    a_key: str
    b_key: str
    module_type: Literal["linear", "embedding"]
    scale: float
    fan_in_fan_out: bool
    rank: int


@dataclass(frozen=True)
class LowRankUpdate:
    """A weight update kept as its LoRA factors: ``scale · B A`` (``B`` out x r, ``A`` r x in),
    or its transpose for embeddings and ``fan_in_fan_out`` layers (``transposed``)."""

    b: torch.Tensor
    a: torch.Tensor
    scale: float
    transposed: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.b.shape[0], self.a.shape[1]
        return (cols, rows) if self.transposed else (rows, cols)

    @property
    def numel(self) -> int:
        return self.b.numel() + self.a.numel()

    def dense(self) -> torch.Tensor:
        product = self.b @ self.a
        return self.scale * (product.T if self.transposed else product)


@dataclass
class LoraModelSource:
    """An expert = a base checkpoint + a LoRA adapter; same interface as :class:`ModelSource`."""

    label: str
    adapter_path: str
    base: ModelSource
    deltas: dict[str, LoraDelta]  # canonical weight -> delta
    replacements: dict[str, str]  # canonical -> adapter file key of a whole tensor
    shapes: dict[str, tuple[int, ...]]
    adapter_file: str
    _handle: Optional[object] = field(default=None, repr=False)

    # ModelSource interface -------------------------------------------------------------
    @property
    def path(self) -> str:
        return self.base.path

    @property
    def config(self):
        return self.base.config

    @property
    def weightless(self) -> bool:
        return self.base.weightless

    @property
    def family(self):
        return self.base.family

    @property
    def dtypes(self) -> dict[str, str]:
        return self.base.dtypes

    @property
    def checkpoint_key(self) -> dict[str, str]:
        return self.base.checkpoint_key

    @property
    def skeleton(self):
        return self.base.skeleton

    @property
    def backbone_path(self) -> str:
        return self.base.backbone_path

    @property
    def backbone(self):
        return self.base.backbone

    @property
    def unloaded(self) -> list[str]:
        return self.base.unloaded

    @property
    def tied(self) -> dict[str, str]:
        return self.base.tied

    def has(self, canonical: str) -> bool:
        return canonical in self.shapes

    def names(self) -> list[str]:
        return list(self.shapes)

    def provides(self, canonical: str) -> bool:
        return canonical in self.shapes or canonical in self.base.tied

    def shape(self, canonical: str) -> tuple[int, ...]:
        return self.shapes.get(canonical) or self.base.shape(canonical)

    def load(
        self,
        canonical: str,
        device: torch.device | str = "cpu",
        cache: Optional[dict[tuple[str, str], torch.Tensor]] = None,
        keep: Optional[torch.dtype] = None,
    ) -> torch.Tensor:
        """The expert's full tensor: the base tensor (or the adapter's whole copy) + delta
        (a sum is float32; ``keep`` as :meth:`ModelSource.load`)."""
        if canonical in self.replacements:
            tensor = compute_tensor(
                self._adapter_tensor(self.replacements[canonical]), device, keep
            )
        else:
            tensor = self.base.load(canonical, device, cache, keep)
        delta = self.deltas.get(canonical)
        if delta is not None:
            tensor = tensor.float() + self.delta_weight(delta, device)
        return tensor

    def read_checkpoint_key(self, key: str) -> torch.Tensor:
        return self.base.read_checkpoint_key(key)

    def release(self) -> None:
        self.base.release()

    # LoRA --------------------------------------------------------------------------------
    def delta_weight(self, delta: LoraDelta, device: torch.device | str) -> torch.Tensor:
        return self.factors(delta, device).dense()

    def factors(self, delta: LoraDelta, device: torch.device | str) -> LowRankUpdate:
        """``delta``'s update as its float32 factors (nothing ``out x in`` is formed)."""
        return LowRankUpdate(
            b=self._adapter_tensor(delta.b_key).to(device=device, dtype=torch.float32),
            a=self._adapter_tensor(delta.a_key).to(device=device, dtype=torch.float32),
            scale=delta.scale,
            transposed=delta.module_type == "embedding" or delta.fan_in_fan_out,
        )

    def _adapter_tensor(self, key: str) -> torch.Tensor:
        with safe_open(self.adapter_file, framework="pt") as f:
            return f.get_tensor(key)


def _strip_peft(key: str) -> str:
    key = key[len(_PEFT_PREFIX) :] if key.startswith(_PEFT_PREFIX) else key
    for wrapper in (".modules_to_save.default.", ".base_layer."):
        key = key.replace(wrapper, ".")
    return key


def open_lora_expert(
    label: str, adapter_path: str, base: ModelSource, *, what: str
) -> LoraModelSource:
    """Index a PEFT LoRA adapter folder against its (already opened) base checkpoint."""
    from peft.utils.other import get_pattern_key

    config_file = os.path.join(adapter_path, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise ModelInputError(
            f"{what}: {adapter_path!r} is not a PEFT adapter (no adapter_config.json)"
        )
    cfg = read_json_object(config_file, what)
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise ModelInputError(
            f"{what}: adapter {adapter_path} is a {peft_type} adapter; only LoRA adapters can be "
            "merged block by block (merge it into its base with PEFT first)"
        )
    for flag, description in _UNSUPPORTED_FLAGS.items():
        if cfg.get(flag):
            raise ModelInputError(
                f"{what}: adapter {adapter_path} uses {description}, which the sequential "
                "executor does not apply; merge it into its base with PEFT's merge_and_unload first"
            )
    if cfg.get("trainable_token_indices") or cfg.get("target_parameters"):
        raise ModelInputError(
            f"{what}: adapter {adapter_path} uses trainable_token_indices/target_parameters, which "
            "the sequential executor does not apply; merge it with PEFT's merge_and_unload first"
        )
    adapter_file = os.path.join(adapter_path, "adapter_model.safetensors")
    if not os.path.isfile(adapter_file):
        raise ModelInputError(
            f"{what}: adapter {adapter_path} has no adapter_model.safetensors (pickled adapters "
            "are not read; re-save it with safe_serialization=True)"
        )
    file_shapes = {k: shape for k, (shape, _) in safetensors_header(adapter_file, what).items()}

    rank_default = int(cfg.get("r", 8))
    alpha_default = float(cfg.get("lora_alpha", rank_default))
    rank_pattern: dict = cfg.get("rank_pattern") or {}
    alpha_pattern: dict = cfg.get("alpha_pattern") or {}
    rslora = bool(cfg.get("use_rslora", False))
    fan_in_fan_out = bool(cfg.get("fan_in_fan_out", False))

    base_module_to_canonical = {_module_key(base, c): c for c in base.names()}

    def to_canonical(module_param: str, adapter_key: str) -> str:
        canonical = base_module_to_canonical.get(module_param)
        if canonical is None:  # adapter trained on checkpoint-named modules (older transformers)
            renamed = rename_to_module_keys(base.skeleton, [module_param], what)[module_param]
            canonical = base_module_to_canonical.get(renamed)
            if canonical is None:
                candidate = canonical_name(renamed, base.backbone_path)
                if candidate in base.shapes:
                    canonical = candidate
        if canonical is None:
            raise ModelInputError(
                f"{what}: adapter tensor {adapter_key} of {adapter_path} adapts {module_param}, "
                f"which the base model {base.label} does not have; is this adapter for that base?"
            )
        return canonical

    pairs: dict[str, dict[str, str]] = {}
    replacements: dict[str, str] = {}
    for key in file_shapes:
        stripped = key[len(_PEFT_PREFIX) :] if key.startswith(_PEFT_PREFIX) else key
        if ".lora_magnitude_vector" in stripped:
            raise ModelInputError(
                f"{what}: adapter {adapter_path} is a DoRA adapter ({key}); not supported"
            )
        matched = False
        for suffix, role, module_type in (
            (".lora_A.weight", "A", "linear"),
            (".lora_B.weight", "B", "linear"),
            (".lora_embedding_A", "A", "embedding"),
            (".lora_embedding_B", "B", "embedding"),
        ):
            if stripped.endswith(suffix):
                module = stripped[: -len(suffix)]
                entry = pairs.setdefault(module, {"module_type": module_type})
                entry[role] = key
                matched = True
                break
        if matched:
            continue
        if ".lora_" in stripped:
            raise ModelInputError(
                f"{what}: adapter tensor {key} of {adapter_path} is not a LoRA A/B weight the "
                "executor knows (lora_A/lora_B/lora_embedding_A/lora_embedding_B)"
            )
        if ".original_module." in stripped:
            continue
        replacements[to_canonical(_strip_peft(key), key)] = key

    shapes = dict(base.shapes)
    for canonical, key in replacements.items():
        shapes[canonical] = file_shapes[key]

    deltas: dict[str, LoraDelta] = {}
    for module, entry in pairs.items():
        if "A" not in entry or "B" not in entry:
            raise ModelInputError(
                f"{what}: adapter {adapter_path} has lora_{'B' if 'A' in entry else 'A'} but not "
                f"its pair for module {module}"
            )
        canonical = to_canonical(module + ".weight", entry["A"])
        a_shape, b_shape = file_shapes[entry["A"]], file_shapes[entry["B"]]
        rank = a_shape[0]
        pattern_rank = rank_pattern.get(get_pattern_key(rank_pattern.keys(), module), rank_default)
        if int(pattern_rank) != rank:
            raise ModelInputError(
                f"{what}: adapter {adapter_path}: {entry['A']} has rank {rank} but the config says "
                f"r={pattern_rank} for {module}"
            )
        alpha = float(
            alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), module), alpha_default)
        )
        scale = alpha / math.sqrt(rank) if rslora else alpha / rank
        target = shapes[canonical]
        if entry["module_type"] == "embedding":
            expected = (a_shape[1], b_shape[0])
        else:
            expected = (b_shape[0], a_shape[1])
            if fan_in_fan_out:
                expected = expected[::-1]
        if tuple(target) != tuple(expected) or b_shape[1] != rank:
            raise ModelInputError(
                f"shape mismatch for {base.checkpoint_key.get(canonical, canonical)}: base model "
                f"{base.label} has {list(target)} but adapter {adapter_path} gives a LoRA update of "
                f"{list(expected)} (A {list(a_shape)}, B {list(b_shape)})"
            )
        deltas[canonical] = LoraDelta(
            module=module,
            a_key=entry["A"],
            b_key=entry["B"],
            module_type=entry["module_type"],
            scale=scale,
            fan_in_fan_out=fan_in_fan_out and entry["module_type"] == "linear",
            rank=rank,
        )
    if not deltas:
        LOG.warning("adapter %s has no LoRA weights; the expert equals its base", adapter_path)
    return LoraModelSource(
        label=label,
        adapter_path=adapter_path,
        base=base,
        deltas=deltas,
        replacements=replacements,
        shapes=shapes,
        adapter_file=adapter_file,
    )


def _module_key(base: ModelSource, canonical: str) -> str:
    from mergekit_ext.models.checkpoint import module_key_of

    return module_key_of(canonical, base.backbone_path)
