"""ViT image encoders (``ViTModel`` or ``ViTForImageClassification``, prefix ``vit.``).

Block ``vit.encoder.layer.{i}`` in the checkpoint: ``[query, key, value] ->
attention.output.dense -> intermediate.dense -> output.dense``. transformers 5 names these
modules ``layers.{i}.attention.{q,k,v,o}_proj`` / ``mlp.fc1`` / ``mlp.fc2`` (renamed at
load time); both layouts are listed. The executor reads and writes checkpoint names.
"""

from __future__ import annotations

from mergekit_ext.executor.families import GroupSpec, ModelFamily, register_family


@register_family
class ViTFamily(ModelFamily):
    name = "vit"
    model_types = frozenset({"vit"})
    modality = "image"
    layers_paths = ("layers", "encoder.layer")
    pre_block_modules = ("embeddings",)
    group_layouts = (
        (
            GroupSpec("qkv", ("attention.q_proj", "attention.k_proj", "attention.v_proj")),
            GroupSpec("attention_output", ("attention.o_proj",)),
            GroupSpec("intermediate", ("mlp.fc1",)),
            GroupSpec("output", ("mlp.fc2",)),
        ),
        (
            GroupSpec(
                "qkv",
                (
                    "attention.attention.query",
                    "attention.attention.key",
                    "attention.attention.value",
                ),
            ),
            GroupSpec("attention_output", ("attention.output.dense",)),
            GroupSpec("intermediate", ("intermediate.dense",)),
            GroupSpec("output", ("output.dense",)),
        ),
    )
