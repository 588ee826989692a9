"""BERT and RoBERTa encoders (headless or with heads: ``bert.`` / ``roberta.`` prefixes).

Block ``encoder.layer.{i}``: ``[query, key, value] -> attention.output.dense ->
intermediate.dense -> output.dense``. The pooler and heads take the fallback merge.
"""

from __future__ import annotations

from mergekit_ext.executor.families import GroupSpec, ModelFamily, register_family


@register_family
class BertFamily(ModelFamily):
    name = "bert"
    model_types = frozenset({"bert", "roberta"})
    modality = "text"
    layers_paths = ("encoder.layer",)
    pre_block_modules = ("embeddings",)
    group_layouts = (
        (
            GroupSpec(
                "qkv",
                ("attention.self.query", "attention.self.key", "attention.self.value"),
            ),
            GroupSpec("attention_output", ("attention.output.dense",)),
            GroupSpec("intermediate", ("intermediate.dense",)),
            GroupSpec("output", ("output.dense",)),
        ),
    )
