"""Input checkpoints for the sequential executor: where each tensor is and what it is called.

Three name spaces meet here:

- *checkpoint keys*: the names in a model's safetensors files (``vit.encoder.layer.0.
  attention.attention.query.weight``);
- *module keys*: the parameter names of the transformers class in use, which may differ
  (transformers 5 renames some keys at load time: that module is ``vit.layers.0.attention.
  q_proj``). We apply transformers' own renaming (``transformers.core_model_loading.
  rename_source_key`` with the class's conversion mapping), exactly as ``from_pretrained``;
- *canonical names*: module keys relative to the family's backbone (``layers.0.attention.
  q_proj.weight``), so that a headless ``BertModel`` and a ``BertForSequenceClassification``
  (``bert.`` prefix) share names. Tensors outside the backbone (heads, a CLIP text tower)
  are canonical ``"@" + module key``.

The merged output takes the base model's checkpoint keys.

Tensors are read with mergekit's :class:`~mergekit.io.LazyTensorLoader`; :meth:`ModelSource.load`
is the one place the executor reads a weight (tests instrument it to count live tensors).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import transformers
from mergekit.io import LazyTensorLoader, ShardedTensorIndex
from safetensors import safe_open
from torch import nn

from mergekit_ext.errors import ModelInputError, ModelNotFoundError
from mergekit_ext.models import model_class
from mergekit_ext.models.families import ModelFamily
from mergekit_ext.models.model_files import check_model_files, read_json_object
from mergekit_ext.models.model_paths import VOCABULARY_FILES, config_shapes, is_config_only
from mergekit_ext.models.model_paths import resolve_model_folder as resolve_model_folder

LOG = logging.getLogger(__name__)

HEAD_PREFIX = "@"


def build_skeleton(config: transformers.PretrainedConfig) -> nn.Module:
    """The model's own transformers class with parameters on the meta device (no memory).

    Buffers (rotary ``inv_freq``, ``position_ids``) stay real: the embeddings and blocks run
    with them as transformers computed them.
    """
    from accelerate import init_empty_weights
    from transformers.initialization import no_init_weights

    cls = model_class.model_class(config)
    # no_init_weights: transformers' post_init would run every initializer over the meta
    # parameters (seconds for an 80-block model, per model of the merge: 8,465 normal_ calls
    # for Llama-3-70B) to no effect; it skips tie_weights too, so that runs on its own.
    with init_empty_weights(include_buffers=False):
        with no_init_weights():
            if cls is not None:
                model = cls(config)
            else:
                model = transformers.AutoModel.from_config(config)
        model.tie_weights()
    model.eval()
    return model


def rename_to_module_keys(
    model: nn.Module, checkpoint_keys: list[str], where: str, *, allow_fused: bool = False
) -> dict[str, str]:
    """``{checkpoint key: module key}`` by transformers' own load-time renaming; the keys
    transformers fuses at load time are refused unless ``allow_fused`` (then absent: see
    :func:`mergekit_ext.models.model_class.fused_module_keys`)."""
    fused = model_class.fused_keys(model, checkpoint_keys)
    if fused and not allow_fused:
        key, converter = next(iter(fused.items()))
        raise ModelInputError(
            f"{where}: checkpoint tensor {key} is fused/split by transformers at load time "
            f"({converter}); the sequential executor supports renamed tensors only"
        )
    return model_class.rename_to_module_keys(model, checkpoint_keys)


@dataclass
class ModelSource:
    """One full checkpoint, indexed by canonical names (no weights loaded until :meth:`load`)."""

    label: str  # the model as written in the YAML
    path: str  # local folder with the weights
    config: transformers.PretrainedConfig
    family: ModelFamily
    skeleton: nn.Module
    backbone_path: str
    checkpoint_key: dict[str, str]  # canonical -> checkpoint key
    shapes: dict[str, tuple[int, ...]]  # canonical -> shape
    dtypes: dict[str, str]  # canonical -> safetensors dtype string ("F32", "BF16", ...)
    # checkpoint keys the class does not load (old buffers): never merged, the base's copied
    unloaded: list[str] = field(default_factory=list)
    # canonical of a weight the class ties but the checkpoint does not store -> the canonical
    # it shares (an ``lm_head`` tied to the embeddings): read as that tensor
    tied: dict[str, str] = field(default_factory=dict)
    # only a config.json (no weights): shapes from its class, for a dry run; never read
    weightless: bool = False
    # canonical of a tensor the class holds fused (MoE experts, ``checkpoint_key`` then its
    # module key) -> its checkpoint pieces; read gathered, written split (docs/methods.md,
    # "Mixture-of-experts blocks")
    fused: dict[str, list[str]] = field(default_factory=dict)
    _loader: Optional[LazyTensorLoader] = field(default=None, repr=False)

    @property
    def backbone(self) -> nn.Module:
        return (
            self.skeleton.get_submodule(self.backbone_path) if self.backbone_path else self.skeleton
        )

    def has(self, canonical: str) -> bool:
        return canonical in self.checkpoint_key

    def names(self) -> list[str]:
        return list(self.checkpoint_key)

    def provides(self, canonical: str) -> bool:
        """Stored, or tied to a stored tensor (:attr:`tied`)."""
        return canonical in self.checkpoint_key or canonical in self.tied

    def shape(self, canonical: str) -> tuple[int, ...]:
        return self.shapes[self.tied.get(canonical, canonical)]

    def load(
        self,
        canonical: str,
        device: torch.device | str = "cpu",
        cache: Optional[dict[tuple[str, str], torch.Tensor]] = None,
        keep: Optional[torch.dtype] = None,
    ) -> torch.Tensor:
        """Read one tensor; floating tensors come back as float32 on ``device`` (a matrix
        stored in ``keep``: in that dtype, :func:`compute_tensor`).

        ``cache`` (keyed by folder and name) shares a tensor between sources reading the
        same checkpoint, e.g. the base model and LoRA experts built on it; every read through
        one cache passes the same ``keep``.
        """
        if canonical not in self.checkpoint_key:
            canonical = self.tied.get(canonical, canonical)
        cache_key = (self.path, canonical)
        if cache is not None and cache_key in cache:
            return cache[cache_key]
        tensor = self._read(canonical, device, keep)
        if cache is not None:
            cache[cache_key] = tensor
        return tensor

    def _read(
        self, canonical: str, device: torch.device | str, keep: Optional[torch.dtype] = None
    ) -> torch.Tensor:
        self._check_readable()
        if self._loader is None:
            self._loader = LazyTensorLoader(ShardedTensorIndex.from_disk(self.path))
        if canonical in self.fused:
            return self._read_fused(canonical, device)
        try:
            tensor = self._loader.get_tensor(self.checkpoint_key[canonical])
        except KeyError:
            raise ModelInputError(
                f"model {self.label}: tensor {self.checkpoint_key.get(canonical, canonical)} "
                "is listed but cannot be read"
            ) from None
        return compute_tensor(tensor, device, keep)

    def _read_fused(self, canonical: str, device: torch.device | str) -> torch.Tensor:
        """A fused tensor gathered from its pieces, one piece read at a time, where the
        class's own conversion puts them (strided views: no index map)."""
        loader = self._loader
        assert loader is not None
        module_key = self.checkpoint_key[canonical]
        shape = self.shapes[canonical]
        index = model_class.fused_pieces(self.skeleton, module_key, shape)
        return model_class.gather_fused(
            lambda key: compute_tensor(loader.get_tensor(key), device), index, shape
        )

    def read_checkpoint_key(self, key: str) -> torch.Tensor:
        """One tensor as stored (dtype and all), by checkpoint key, on the CPU."""
        self._check_readable()
        if self._loader is None:
            self._loader = LazyTensorLoader(ShardedTensorIndex.from_disk(self.path))
        return self._loader.get_tensor(key)

    def _check_readable(self) -> None:
        # The runner refuses such inputs before anything loads; this guards direct API use.
        if self.weightless:
            raise ModelNotFoundError(
                f"model {self.label}: {self.path!r} has no weights (only config.json); "
                "it can be planned (--dry-run), not merged"
            )

    def release(self) -> None:
        """Close the open shard (tensors already returned stay valid)."""
        if self._loader is not None:
            self._loader.flush()


def compute_tensor(
    tensor: torch.Tensor, device: torch.device | str, keep: Optional[torch.dtype] = None
) -> torch.Tensor:
    """A tensor as read, made ready for the merge: floating tensors as float32, except a matrix
    (two or more dimensions) stored in ``keep``, which stays in that dtype (owned memory, not
    a view of the file): the block passes multiply in ``keep`` anyway, and float32 copies of
    every model's block would double the memory the block weights take."""
    if not tensor.dtype.is_floating_point:
        return tensor.to(device=device)
    if keep is not None and tensor.dtype == keep and tensor.dim() >= 2:
        moved = tensor.to(device=device)
        return moved.clone() if moved is tensor else moved
    return tensor.to(device=device, dtype=torch.float32)


def read_config(path: str, what: str) -> transformers.PretrainedConfig:
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelNotFoundError(f"{what}: {path!r} has no config.json")
    try:
        return transformers.AutoConfig.from_pretrained(path)
    except Exception as e:
        raise ModelInputError(f"{what}: cannot read {path}/config.json: {e}") from e


def _header_shapes(path: str, what: str) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Checkpoint key -> shape and dtype, from the safetensors headers only (a folder with
    only a ``config.json``: from its class, :func:`~mergekit_ext.models.model_paths.config_shapes`)."""
    if is_config_only(path):
        return config_shapes(path)
    check_model_files(path, what)  # corrupt files, index entries outside the folder
    try:
        index = ShardedTensorIndex.from_disk(path)
    except RuntimeError as e:
        raise ModelNotFoundError(f"{what}: no model weights in {path!r} ({e})") from e
    if not index.is_safetensors:
        raise ModelInputError(
            f"{what}: {path!r} has only pickle (.bin) weights; the sequential executor reads "
            "safetensors: convert it (e.g. load and save_pretrained(safe_serialization=True))"
        )
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for shard in index.shards:
        with safe_open(os.path.join(index.base_path, shard.filename), framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                shapes[key] = tuple(sl.get_shape())
                dtypes[key] = sl.get_dtype()
    return shapes, dtypes


def open_model(label: str, path: str, family: Optional[ModelFamily], *, what: str) -> ModelSource:
    """Index a full checkpoint folder: config, skeleton, canonical names and shapes."""
    from mergekit_ext.models.families import discover_family, family_for

    config = read_config(path, what)
    arch = (getattr(config, "architectures", None) or [""])[0]
    declared = family_for(config.model_type, arch)
    skeleton = build_skeleton(config)
    # Blocks, pre-block modules and linear groups from the class itself (no weights read).
    own_family = discover_family(skeleton, config)
    if (
        family is not None
        and declared.name != family.name
        and own_family.structure() != family.structure()
    ):
        # Model types that only rename a structure (a Mistral expert of a Llama base, with
        # --allow-crimes) walk alike; others are refused.
        raise ModelInputError(
            f"{what}: {label} is a {config.model_type!r} model ({declared.name} family) but the "
            f"base model is of the {family.name} family; merge models of one architecture"
        )
    backbone_path = own_family.backbone_path(skeleton)
    shapes_by_key, dtypes_by_key = _header_shapes(path, what)
    module_keys = rename_to_module_keys(
        skeleton, list(shapes_by_key), what, allow_fused=own_family.fused_experts
    )
    unloaded = model_class.unloaded_keys(skeleton, module_keys)
    LOG.debug("%s: not loaded by %s: %s", label, type(skeleton).__name__, unloaded)
    checkpoint_key: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for key, module_key in module_keys.items():
        if key in unloaded:
            continue
        canonical = canonical_name(module_key, backbone_path)
        if canonical in checkpoint_key:
            raise ModelInputError(
                f"{what}: checkpoint tensors {checkpoint_key[canonical]} and {key} of {label} "
                "map to the same parameter"
            )
        checkpoint_key[canonical] = key
        shapes[canonical] = shapes_by_key[key]
        dtypes[canonical] = dtypes_by_key[key]
    fused: dict[str, list[str]] = {}
    if own_family.fused_experts:
        state = skeleton.state_dict()
        for module_key, pieces in model_class.fused_module_keys(
            skeleton, list(shapes_by_key)
        ).items():
            canonical = canonical_name(module_key, backbone_path)
            expected = sorted(model_class.saved_pieces(skeleton, module_key, state[module_key]))
            if sorted(pieces) != expected:
                missing = sorted(set(expected) - set(pieces))
                raise ModelInputError(
                    f"{what}: {label} holds {len(pieces)} of the {len(expected)} checkpoint "
                    f"tensors of {module_key} (missing e.g. {missing[:2]}); its class fuses "
                    "them on load"
                )
            kinds = {dtypes_by_key[k] for k in pieces}
            if len(kinds) != 1:
                raise ModelInputError(
                    f"{what}: the checkpoint tensors of {module_key} in {label} have "
                    f"different dtypes ({sorted(kinds)})"
                )
            checkpoint_key[canonical] = module_key
            shapes[canonical] = tuple(state[module_key].shape)
            dtypes[canonical] = kinds.pop()
            fused[canonical] = sorted(pieces)
    tied = {}
    for target, source in model_class.tied_weights(skeleton).items():
        target, source = (canonical_name(k, backbone_path) for k in (target, source))
        if target not in checkpoint_key and source in checkpoint_key:
            tied[target] = source
    return ModelSource(
        label=label,
        path=path,
        config=config,
        family=own_family,
        skeleton=skeleton,
        backbone_path=backbone_path,
        checkpoint_key=checkpoint_key,
        shapes=shapes,
        dtypes=dtypes,
        unloaded=unloaded,
        tied=tied,
        weightless=is_config_only(path),
        fused=fused,
    )


def canonical_name(module_key: str, backbone_path: str) -> str:
    if not backbone_path:
        return module_key
    if module_key.startswith(backbone_path + "."):
        return module_key[len(backbone_path) + 1 :]
    return HEAD_PREFIX + module_key


def module_key_of(canonical: str, backbone_path: str) -> str:
    if canonical.startswith(HEAD_PREFIX):
        return canonical[len(HEAD_PREFIX) :]
    return f"{backbone_path}.{canonical}" if backbone_path else canonical


def is_adapter_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "adapter_config.json"))


def adapter_base_path(adapter_path: str) -> Optional[str]:
    config = os.path.join(adapter_path, "adapter_config.json")
    return read_json_object(config, f"adapter {adapter_path}").get("base_model_name_or_path")


@dataclass(frozen=True)
class ResolvedReference:
    """A mergekit model reference as local folders: the full checkpoint ``folder`` and, for
    a LoRA expert, its ``adapter`` folder (``folder`` is then the adapter's base)."""

    folder: str
    label: str  # how the full checkpoint is named (the YAML's, or the adapter config's)
    adapter: Optional[str] = None

    @property
    def processing_folder(self) -> str:
        """Where the tokenizer/processor is read: the adapter's when it ships one."""
        if self.adapter is not None and has_tokenizer(self.adapter):
            return self.adapter
        return self.folder


def resolve_reference(ref: Any, what: str, cache_dir: Optional[str] = None) -> ResolvedReference:
    """Resolve a mergekit ``ModelReference``: ``base+adapter``, an adapter folder whose
    ``adapter_config.json`` names a local base, or a full checkpoint."""
    folder = resolve_model_folder(
        ref.model.path, what=what, cache_dir=cache_dir, revision=ref.model.revision
    )
    if ref.lora is not None:
        adapter = resolve_model_folder(
            ref.lora.path, what=what, cache_dir=cache_dir, revision=ref.lora.revision
        )
        return ResolvedReference(folder, str(ref.model), adapter)
    if is_adapter_folder(folder) and not os.path.isfile(os.path.join(folder, "config.json")):
        base_name = adapter_base_path(folder)
        if not base_name:
            raise ModelInputError(
                f"{what}: adapter {folder} does not name its base model "
                "(base_model_name_or_path); write the model as `base_path+adapter_path`"
            )
        try:
            base_folder = resolve_model_folder(base_name, what=what, cache_dir=cache_dir)
        except ModelInputError:
            raise ModelInputError(
                f"{what}: adapter {folder} names base model {base_name!r}, which is not a local "
                "folder; write the model as `base_path+adapter_path`"
            ) from None
        return ResolvedReference(base_folder, base_name, folder)
    return ResolvedReference(folder, str(ref))


TAGALONG_FILES = (
    "generation_config.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)


def has_tokenizer(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "tokenizer_config.json")) and any(
        os.path.isfile(os.path.join(path, name)) for name in VOCABULARY_FILES
    )
