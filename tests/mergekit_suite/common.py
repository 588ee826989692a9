"""Our own ``tests/common.py`` for mergekit 0.1.5's test suite (the sdist ships the tests
that import it, not the module itself).

The API is what the sdist's tests import: ``run_and_check_merge`` and the tiny-model builders
``make_picollama``, ``make_picoLlaVa``, ``make_gpt2size`` and ``make_picogranite``. ``run.py``
copies this file to ``tests/common.py`` next to the extracted tests.

``run_and_check_merge`` looks ``run_merge`` up on ``mergekit.merge`` at each call, so the
"routed" mode (``mksuite_routed.py``) reaches every merge made through it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Optional

import torch
from mergekit import merge as mergekit_merge
from mergekit.architecture import arch_info_for_config, get_architecture_info
from mergekit.config import MergeConfiguration
from mergekit.io.lazy_tensor_loader import LazyTensorLoader, ShardedTensorIndex
from mergekit.options import MergeOptions
from transformers import (
    AutoConfig,
    CLIPVisionConfig,
    GPT2Config,
    GPT2LMHeadModel,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    PreTrainedModel,
)


def run_and_check_merge(
    config: MergeConfiguration,
    check_nan: bool = True,
    check_tensors: bool = True,
    validate: Optional[Callable[[str], None]] = None,
    index_json_name: Optional[str] = None,
    auto_arch: bool = False,
) -> None:
    """Merge ``config`` into a temporary folder and check what a merge must produce.

    Args:
        config: the merge.
        check_nan: no output tensor holds a NaN.
        check_tensors: every non-optional weight of the output's architecture is in the
            output (under its name or an alias).
        validate: called with the output folder for the test's own checks.
        index_json_name: the shard index's file name (default
            ``model.safetensors.index.json``); a single unsharded file of the same stem
            also counts.
        auto_arch: take the architecture from the merge config (mergekit's inference
            over the inputs, as for VLMs) instead of from the output's ``config.json``.
    """
    index_name = index_json_name or "model.safetensors.index.json"
    with tempfile.TemporaryDirectory() as out:
        # looked up at call time: the routed mode swaps mergekit.merge.run_merge
        mergekit_merge.run_merge(config, out_path=out, options=MergeOptions())

        single_file = index_name.removesuffix(".index.json")
        assert os.path.exists(os.path.join(out, index_name)) or os.path.exists(
            os.path.join(out, single_file)
        ), f"the merge wrote neither {index_name} nor {single_file}"
        assert os.path.exists(os.path.join(out, "config.json")), "the merge wrote no config.json"

        if check_nan:
            _assert_no_nan(out)
        if check_tensors:
            _assert_all_weights(out, config, auto_arch)
        if validate is not None:
            validate(out)


def _assert_no_nan(out: str) -> None:
    loader = LazyTensorLoader.from_disk(out, lazy_unpickle=False)
    for name in sorted(loader.index.tensor_paths):
        assert not torch.isnan(loader.get_tensor(name)).any(), f"output tensor {name} has NaN"


def _assert_all_weights(out: str, config: MergeConfiguration, auto_arch: bool) -> None:
    model_config = AutoConfig.from_pretrained(out)
    if auto_arch:
        arch_info = get_architecture_info(config, MergeOptions())
    else:
        arch_info = arch_info_for_config(model_config)
    written = ShardedTensorIndex.from_disk(out).tensor_paths
    for weight in arch_info.all_weights(model_config):
        if weight.optional:
            continue
        names = (weight.name, *(weight.aliases or ()))
        if not any(name in written for name in names):
            raise RuntimeError(f"the merge output lacks tensor {weight.name}")


def _save(model: PreTrainedModel, path: str | os.PathLike[str]) -> str:
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


def _pico_llama_config(vocab_size: int = 64) -> LlamaConfig:
    # two layers, 16 heads of width 2: every per-head and per-layer path, almost no weights
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=16,
        num_hidden_layers=2,
    )


def make_picollama(path: str | os.PathLike[str], vocab_size: int = 64) -> str:
    """A random two-layer Llama (hidden 32) saved as safetensors at ``path``."""
    return _save(LlamaForCausalLM(_pico_llama_config(vocab_size)), path)


def make_picoLlaVa(path: str | os.PathLike[str]) -> str:  # (the name the tests import)
    """A random LLaVA: a two-layer CLIP vision tower (32 px images, 4 px patches) and the
    :func:`make_picollama` text model."""
    vision = CLIPVisionConfig(
        image_size=32,
        patch_size=4,
        num_hidden_layers=2,
        num_attention_heads=2,
        hidden_size=64,
        intermediate_size=128,
    )
    config = LlavaConfig(
        vision_config=vision, text_config=_pico_llama_config(), image_seq_length=16
    )
    return _save(LlavaForConditionalGeneration(config), path)


def make_gpt2size(path: str | os.PathLike[str]) -> str:
    """A random GPT-2 with GPT-2 small's 12 layers and vocabulary, narrow (width 64).

    The tests that use it check layer counts (a 0-12 slice stacked twice gives 24 layers),
    not widths; GPT-2 small's 768 width would only add time (124M parameters per copy)."""
    config = GPT2Config(
        n_ctx=1024, n_positions=1024, n_embd=64, n_head=4, n_layer=12, vocab_size=50257
    )
    return _save(GPT2LMHeadModel(config), path)


def make_picogranite(path: str | os.PathLike[str]) -> str:
    """A random two-layer Granite with grouped-query attention (4 heads, 2 key/value heads)."""
    config = GraniteConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
    )
    return _save(GraniteForCausalLM(config), path)
