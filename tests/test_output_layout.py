"""Nothing missing, nothing in a foreign layout (issue #30 item 0; docs/methods.md, Output
completeness).

Tiny random Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 checkpoints (hidden 64, 2 layers,
4 experts; ``tests/tiny_architectures.py``) come from transformers' config classes;
transformers 5 saves their experts per expert (``experts.0.w1.weight``) although it holds them fused in memory. A
tensor-wise merge (mergekit's ``ties``, our ``ace``) must write the same tensors as the base
checkpoint, merge each expert matrix as a matrix, and give a model transformers loads with
no missing key. The completeness check itself must stop a merge that lost a tensor.
"""

from __future__ import annotations

import json
import os

import pytest
import tiny_architectures
import torch
import transformers
from mergekit.io.tensor_writer import TensorWriter
from safetensors import safe_open
from safetensors.torch import save_file
from tiny_models import VOCAB_SIZE, make_experts, save_tiny_tokenizer

import mergekit_ext
from mergekit_ext.errors import TensorError
from mergekit_ext.finite import weight_files
from mergekit_ext.methods.ace import ACEParameters, ace_merge_tensor
from mergekit_ext.models import completeness
from mergekit_ext.models.model_paths import tensor_shapes
from mergekit_ext.output import MARKER_FILE

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=4,
    eos_token_id=5,
)
# the mixture-of-experts types of tests/tiny_architectures.py (deepseek_v3: layer 0 dense,
# layer 1 routed + shared experts, the layer whose experts went missing)
MOE = ("deepseek_v3", "mixtral", "qwen2_moe", "qwen3_moe")
EXPERT_MARKER = ".experts."  # routed experts: ``experts.N.`` on disk, never a shared expert's


def load_all(folder: str) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def merge(method: str, base: str, experts: list[str], out: str) -> str:
    params = {"weight": 0.5, "density": 0.5} if method == "ties" else {}
    config = {
        "merge_method": method,
        "base_model": base,
        "models": [{"model": e, **({"parameters": params} if params else {})} for e in experts],
        "dtype": "float32",
    }
    return mergekit_ext.run_merge(config, out, {"random_seed": 0})


def assert_loads_cleanly(folder: str) -> None:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, output_loading_info=True
    )
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["unexpected_keys"], info["unexpected_keys"]
    assert not info["mismatched_keys"], info["mismatched_keys"]
    assert not info["error_msgs"], info["error_msgs"]
    with torch.no_grad():
        logits = model(torch.tensor([[4, 10, 20, 30, 40, 11]])).logits
    assert torch.isfinite(logits).all()


@pytest.fixture(scope="module", params=sorted(MOE))
def moe_set(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    base = tiny_architectures.build(request.param, str(root / "base"))
    experts = make_experts(base, [str(root / f"expert{i}") for i in range(2)])
    return request.param, base, experts


def test_mergekit_is_given_the_checkpoint_tensors(moe_set) -> None:
    """The architecture mergekit plans with in our runs names exactly the checkpoint's tensors."""
    from mergekit.architecture import arch_info_for_config

    from mergekit_ext.models.mergekit_definitions import layout_tensor_names, our_architectures

    _, base, _ = moe_set
    config = transformers.AutoConfig.from_pretrained(base)
    with our_architectures(layout_tensor_names(base)):
        weights = arch_info_for_config(config).all_weights(config)
    names = [w.name for w in weights]
    assert len(names) == len(set(names))
    assert set(names) == set(tensor_shapes(base))
    by_name = {w.name: w for w in weights}
    assert by_name["model.embed_tokens.weight"].vocabulary_axis == 0
    head = by_name["lm_head.weight"]
    assert head.vocabulary_axis == 0 and head.tied_names == ("model.embed_tokens.weight",)
    assert not [w.name for w in weights if w.optional and w.name != "lm_head.weight"]


@pytest.mark.parametrize("method", ["ties", "ace"])
def test_moe_merge_keeps_checkpoint_layout(moe_set, method, tmp_path) -> None:
    model_type, base, experts = moe_set
    base_shapes = tensor_shapes(base)
    routed = sorted(k for k in base_shapes if EXPERT_MARKER in k)
    assert routed and all(len(base_shapes[k]) == 2 for k in routed)  # per-expert matrices

    out = merge(method, base, experts, str(tmp_path / "out"))

    assert tensor_shapes(out) == base_shapes  # same names, same shapes: nothing fused
    assert_loads_cleanly(out)
    merged, b = load_all(out), load_all(base)
    e = [load_all(x) for x in experts]
    for key in routed:  # every expert matrix was merged, not copied from an input
        assert not torch.equal(merged[key], b[key]), key
        assert not any(torch.equal(merged[key], x[key]) for x in e), key
    if method == "ace":  # each expert matrix is merged as the matrix it is
        p = ACEParameters()
        for key in routed[:3]:
            want, _ = ace_merge_tensor(
                b[key],
                [x[key] for x in e],
                eps=p.eps,
                k_frac=p.k_frac,
                gamma_threshold=p.gamma_threshold,
                normalize=p.normalize,
                scale=p.scale,
                heterogeneity_rule=p.heterogeneity,
                spread_threshold=p.spread_threshold,
                name=key,
            )
            torch.testing.assert_close(merged[key], want, rtol=1e-6, atol=1e-6)
            simple_mean = b[key] + torch.stack([x[key] - b[key] for x in e]).mean(0)
            assert not torch.allclose(merged[key], simple_mean, atol=1e-6), key


def _written(folder, tensors: dict[str, torch.Tensor], config_from: str) -> str:
    os.makedirs(folder)
    transformers.AutoConfig.from_pretrained(config_from).save_pretrained(folder)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return str(folder)


def test_check_follows_what_transformers_loads(moe_set, tmp_path) -> None:
    """The verdict is from_pretrained's: the fused in-memory layout (what mergekit 0.1.5
    writes for these classes) loads completely and passes; an expert matrix lost from it,
    or a foreign tensor beside it, is refused by name."""
    model_type, base, _ = moe_set
    cls = getattr(transformers, tiny_architectures.ARCHITECTURES[model_type].model_class)
    memory = {k: v.contiguous() for k, v in cls.from_pretrained(base).state_dict().items()}
    assert set(memory) != set(tensor_shapes(base))  # fused in memory, per expert on disk
    fused = _written(tmp_path / "fused", memory, base)
    assert completeness.check_output_complete(fused, ("base", base)) == len(memory)
    assert_loads_cleanly(fused)

    on_disk = load_all(base)
    victim = next(k for k in sorted(on_disk) if EXPERT_MARKER in k and "layers.1." in k)
    lost = _written(tmp_path / "lost", {k: v for k, v in on_disk.items() if k != victim}, base)
    with pytest.raises(TensorError) as err:
        completeness.check_output_complete(lost, ("base", base))
    # the fused tensor lacks a piece: too few experts stacked, or a concatenation that fails
    said = str(err.value)
    assert "have another shape or do not convert: model.layers.1.mlp.experts." in said, said
    assert "[3, " in said or "transformers cannot convert it" in said, said

    extra = _written(
        tmp_path / "extra", {**on_disk, "model.layers.1.mlp.w9.weight": torch.zeros(2)}, base
    )
    with pytest.raises(
        TensorError,
        match=r"neither \w+ loads nor the base checkpoint holds: model\.layers\.1\.mlp\.w9\.weight",
    ):
        completeness.check_output_complete(extra, ("base", base))


def test_fused_base_merges_and_passes_in_its_own_layout(moe_set, tmp_path) -> None:
    """A base saved in transformers 5's fused in-memory layout (``mlp.experts.gate_up_proj``,
    what mergekit 0.1.5 itself writes) gets mergekit's own definition: the merge writes the
    base's fused names, and the check accepts them, as transformers loads them completely
    (it does not ask for the per-expert names ``save_pretrained`` would write)."""
    model_type, base, experts = moe_set
    cls = getattr(transformers, tiny_architectures.ARCHITECTURES[model_type].model_class)
    fused = []
    for i, folder in enumerate([base, *experts]):
        memory = {k: v.contiguous() for k, v in cls.from_pretrained(folder).state_dict().items()}
        fused.append(_written(tmp_path / f"fused{i}", memory, folder))
    fused_names = set(tensor_shapes(fused[0]))
    experts_on_disk = {k for k in tensor_shapes(base) if EXPERT_MARKER in k}
    assert experts_on_disk and not fused_names & experts_on_disk  # no expert name in common
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused_names)
    out = merge("ties", fused[0], fused[1:], str(tmp_path / "out"))
    assert tensor_shapes(out) == tensor_shapes(fused[0])  # the base's own (fused) layout
    assert_loads_cleanly(out)
    assert completeness.check_output_complete(out, ("fused", fused[0])) == len(fused_names)
    # the per-expert checkpoint is complete against a fused base too: both load whole
    assert completeness.check_output_complete(base, ("fused", fused[0])) > len(fused_names)


def test_dense_llama_passes_the_check(tiny_llama_set, tmp_path) -> None:
    out = merge("ties", tiny_llama_set.base, list(tiny_llama_set.experts[:2]), str(tmp_path / "o"))
    assert tensor_shapes(out) == tensor_shapes(tiny_llama_set.base)
    assert_loads_cleanly(out)


def test_output_folder_with_glob_characters(tiny_llama_set, tmp_path) -> None:
    """A folder named like the benchmark sweep's runs (``row[param=value]``) is a path, not a
    glob pattern: the completeness and finiteness checks read its weights."""
    out = merge(
        "ties",
        tiny_llama_set.base,
        list(tiny_llama_set.experts[:2]),
        str(tmp_path / "ties[compute_dtype=float32]" / "merged"),
    )
    assert tensor_shapes(out) == tensor_shapes(tiny_llama_set.base)
    assert completeness.written_shapes(out) == tensor_shapes(tiny_llama_set.base)
    assert weight_files(out) == [os.path.join(out, "model.safetensors")]


def test_tied_embeddings_are_not_flagged(tmp_path) -> None:
    torch.manual_seed(0)
    cfg = {**_COMMON, "tie_word_embeddings": True, "hidden_size": 32, "intermediate_size": 64}
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    tied = str(tmp_path / "tied")
    model.save_pretrained(tied)
    save_tiny_tokenizer(tied)
    assert "lm_head.weight" not in tensor_shapes(tied)
    experts = make_experts(tied, [str(tmp_path / f"e{i}") for i in range(2)])
    for method in ("ties", "ace"):
        out = merge(method, tied, experts, str(tmp_path / method))
        assert tensor_shapes(out) == tensor_shapes(tied)  # no lm_head asked for or written
        assert_loads_cleanly(out)


def _tamper(monkeypatch, how: str, victim: str) -> None:
    original = TensorWriter.save_tensor

    def save_tensor(self, name, tensor, *args, **kwargs):
        if name == victim:
            if how == "drop":
                return None
            if how == "rename":
                name = name.replace("mlp.down_proj", "mlp.fused_down_proj")
            if how == "transpose":
                tensor = tensor.t().contiguous()
        return original(self, name, tensor, *args, **kwargs)

    monkeypatch.setattr(TensorWriter, "save_tensor", save_tensor)


@pytest.mark.parametrize(
    "how, said",
    [
        ("drop", "missing"),
        ("rename", "neither LlamaForCausalLM loads nor the base checkpoint holds"),
        ("transpose", "[64, 32] (expected [32, 64])"),
    ],
)
def test_check_stops_a_merge_that_lost_a_tensor(
    tiny_llama_set, tmp_path, monkeypatch, how, said
) -> None:
    victim = "model.layers.1.mlp.down_proj.weight"
    _tamper(monkeypatch, how, victim)
    out = tmp_path / "out"
    with pytest.raises(TensorError) as err:
        merge("ties", tiny_llama_set.base, list(tiny_llama_set.experts[:2]), str(out))
    message = str(err.value)
    assert victim in message and said in message and "Nothing was written" in message
    assert not out.exists()
    assert os.listdir(tmp_path) == []  # no partial folder, no lock left behind


def _folder(path, tensors: dict[str, torch.Tensor], config: dict) -> str:
    os.makedirs(path)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as fp:
        json.dump(config, fp)
    return str(path)


def test_without_a_transformers_class_the_base_checkpoint_is_the_reference(tmp_path) -> None:
    config = {"model_type": "no_such_model", "architectures": ["NoSuchModelForCausalLM"]}
    a, b = torch.zeros(2, 3), torch.ones(3)
    base = _folder(tmp_path / "base", {"a.weight": a, "b.bias": b}, config)
    out = _folder(tmp_path / "out", {"a.weight": a}, config)
    with pytest.raises(TensorError, match=r"the base checkpoint base holds are missing: b\.bias"):
        completeness.check_output_complete(out, ("base", base))
    # mergekit's definition says b.bias is optional: not asked for
    assert completeness.check_output_complete(out, ("base", base), optional=lambda: {"b.bias"}) == 1


def test_check_reads_only_the_checkpoints_own_files(tiny_llama_set, tmp_path) -> None:
    """The check reads only the checkpoint's own weight files (diagnostics, card, tokenizer
    and subfolders such as SyMerge's tasks/ are no part of it)."""
    out = merge("ties", tiny_llama_set.base, list(tiny_llama_set.experts[:2]), str(tmp_path / "o"))
    assert os.path.isfile(os.path.join(out, MARKER_FILE))
    os.makedirs(os.path.join(out, "tasks", "t"))
    save_file({"x": torch.zeros(1)}, os.path.join(out, "tasks", "t", "model.safetensors"))
    assert completeness.written_shapes(out) == tensor_shapes(tiny_llama_set.base)


def test_tensor_the_base_lacks_too_is_not_asked_for(tmp_path) -> None:
    """ViTModel's class holds a pooler, but checkpoints saved without one (DINO-style) lack
    it: transformers initialises it for the base model too, so the merge is as complete as
    its base. A tensor the base holds is still required."""
    cfg = transformers.ViTConfig(
        image_size=16,
        patch_size=4,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
    )
    torch.manual_seed(0)
    base = str(tmp_path / "base")
    transformers.ViTModel(cfg, add_pooling_layer=False).save_pretrained(base)
    experts = make_experts(
        base,
        [str(tmp_path / f"e{i}") for i in range(2)],
        load=lambda p: transformers.ViTModel.from_pretrained(p, add_pooling_layer=False),
    )
    assert not [k for k in tensor_shapes(base) if "pooler" in k]
    out = merge("ties", base, experts, str(tmp_path / "out"))
    assert tensor_shapes(out) == tensor_shapes(base)
    assert completeness.check_output_complete(out, ("base", base)) == len(tensor_shapes(base))
    # without the base to compare with, the pooler is missing
    with pytest.raises(TensorError, match=r"ViTModel loads are missing: pooler\.dense\.bias"):
        completeness.check_output_complete(out)
    os.remove(os.path.join(out, "model.safetensors"))
    kept = {k: v for k, v in load_all(base).items() if k != "layernorm.bias"}
    save_file(kept, os.path.join(out, "model.safetensors"))
    with pytest.raises(
        TensorError, match=r"1 tensor\(s\) that ViTModel loads are missing: layernorm\.bias\."
    ):
        completeness.check_output_complete(out, ("base", base))


def _llama(path, vocab_size: int, seed: int) -> str:
    torch.manual_seed(seed)
    cfg = {**_COMMON, "vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 64}
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).save_pretrained(path)
    return str(path)


def test_unsafe_truncate_embeddings_is_accepted_as_asked(tmp_path) -> None:
    """mergekit's ``unsafe_truncate_embeddings`` cuts the embeddings to the smallest
    vocabulary (8 rows) and keeps the donor's ``vocab_size`` (10) in config.json, as its own
    tests assert: with that option the check accepts the cut embeddings; without it the same
    checkpoint is refused, and with it any other shape change still is."""
    large, small = _llama(tmp_path / "large", 10, 0), _llama(tmp_path / "small", 8, 1)
    config = {
        "merge_method": "linear",
        "base_model": large,
        "models": [{"model": large}, {"model": small}],
        "parameters": {"weight": 0.5},
        "dtype": "float32",
    }
    out = mergekit_ext.run_merge(
        config, str(tmp_path / "out"), {"unsafe_truncate_embeddings": True}
    )
    assert transformers.AutoConfig.from_pretrained(out).vocab_size == 10  # mergekit's choice
    shapes = tensor_shapes(out)
    assert shapes["model.embed_tokens.weight"] == shapes["lm_head.weight"] == (8, 32)
    assert {k: v for k, v in shapes.items() if "embed" not in k and "lm_head" not in k} == {
        k: v for k, v in tensor_shapes(large).items() if "embed" not in k and "lm_head" not in k
    }
    assert completeness.check_output_complete(out, ("large", large), truncated_vocabulary=True)
    with pytest.raises(TensorError, match=r"lm_head\.weight \[8, 32\] \(expected \[10, 32\]\)"):
        completeness.check_output_complete(out, ("large", large))
    # rows cut on the hidden axis are no vocabulary truncation
    tensors = load_all(out)
    tensors["lm_head.weight"] = torch.zeros(10, 16)
    bad = _written(tmp_path / "bad", tensors, out)
    with pytest.raises(TensorError, match=r"lm_head\.weight \[10, 16\] \(expected \[10, 32\]\)"):
        completeness.check_output_complete(bad, ("large", large), truncated_vocabulary=True)


def test_truncated_along_vocabulary() -> None:
    assert completeness.truncated_along_vocabulary((8, 32), (10, 32), 0)
    assert completeness.truncated_along_vocabulary((32, 8), (32, 10), 1)
    assert not completeness.truncated_along_vocabulary((12, 32), (10, 32), 0)  # grown
    assert not completeness.truncated_along_vocabulary((8, 16), (10, 32), 0)
    assert not completeness.truncated_along_vocabulary((8, 32), (10, 32), None)
    assert not completeness.truncated_along_vocabulary((0, 32), (10, 32), 0)
