"""CLIP vision towers: ``CLIPVisionModel``, ``CLIPVisionModelWithProjection`` and ``CLIPModel``.

Block ``encoder.layers.{i}`` of the vision tower: ``[q_proj, k_proj, v_proj] -> out_proj ->
fc1 -> fc2``; ``embeddings`` and ``pre_layrnorm`` run before the first block.

A whole ``CLIPModel`` is merged with data on its vision tower only: the text tower, the
projections and ``logit_scale`` are not in the walked backbone and take the method's
fallback merge (a warning says so). Merge a text tower with data by giving it as a text
model of its own.
"""

from __future__ import annotations

from mergekit_ext.executor.families import GroupSpec, ModelFamily, register_family


@register_family
class CLIPVisionFamily(ModelFamily):
    name = "clip_vision"
    model_types = frozenset({"clip", "clip_vision_model"})
    modality = "image"
    backbone_class_names = ("CLIPVisionModel", "CLIPVisionTransformer")
    layers_paths = ("encoder.layers",)
    pre_block_modules = ("embeddings", "pre_layrnorm")
    group_layouts = (
        (
            GroupSpec("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            GroupSpec("out_proj", ("self_attn.out_proj",)),
            GroupSpec("fc1", ("mlp.fc1",)),
            GroupSpec("fc2", ("mlp.fc2",)),
        ),
    )
