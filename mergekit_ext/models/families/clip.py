"""Two-tower image-text models (CLIP, SigLIP): the image tower is the walked backbone.

Why a declaration: a ``CLIPModel`` / ``SiglipModel`` holds two block lists of the same
kind (a text and a vision tower) and discovery cannot tell which one the calibration data
should run through. The vision tower is walked with calibration images (the usual merge
target: image classifiers built on these towers); its blocks and linear groups are
discovered. The text tower, the projections and ``logit_scale`` are outside the walked
backbone and take the method's fallback merge (a warning says so). Merge a text tower with
data by giving it as a text model of its own. Vision-only checkpoints
(``CLIPVisionModel``, ``SiglipVisionModel``) resolve to their vision transformer the same way.
"""

from __future__ import annotations

from mergekit_ext.models.families import ModelFamily, register_family


@register_family
class CLIPVisionFamily(ModelFamily):
    name = "clip_vision"
    model_types = frozenset({"clip", "clip_vision_model"})
    modality = "image"
    backbone_class_names = ("CLIPVisionModel", "CLIPVisionTransformer")


@register_family
class SiglipVisionFamily(ModelFamily):
    name = "siglip_vision"
    model_types = frozenset({"siglip", "siglip_vision_model"})
    modality = "image"
    backbone_class_names = ("SiglipVisionModel", "SiglipVisionTransformer")
