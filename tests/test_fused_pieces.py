"""Fused in-memory tensors (transformers 5's MoE experts) read from and written as the
checkpoint's per-expert pieces, by transformers' own reverted conversion (issue #30 item 3)."""

from __future__ import annotations

import pytest
import tiny_architectures
import torch
import transformers
from safetensors.torch import load_file

from mergekit_ext.errors import ModelInputError
from mergekit_ext.models import model_class


def _meta(model_type: str) -> torch.nn.Module:
    arch = tiny_architectures.ARCHITECTURES[model_type]
    with torch.device("meta"):
        return getattr(transformers, arch.model_class)(arch.config())


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_fused_experts_gather_from_and_split_into_the_saved_pieces(model_type, tmp_path) -> None:
    arch = tiny_architectures.ARCHITECTURES[model_type]
    torch.manual_seed(0)
    model = getattr(transformers, arch.model_class)(arch.config())
    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    meta = model_class.meta_model(model.config)
    fused = {k: v for k, v in model.state_dict().items() if v.dim() == 3}
    assert fused, model_type
    covered: set[str] = set()
    for key, tensor in fused.items():
        index = model_class.fused_pieces(meta, key, tensor.shape)
        assert len(index) == tensor.shape[0] * (2 if key.endswith("gate_up_proj") else 1)
        assert set(index) <= set(saved), sorted(set(index) - set(saved))[:2]
        covered |= set(index)
        pieces = {k: saved[k] for k in index}
        assert torch.equal(model_class.gather_fused(pieces, index, tensor.shape), tensor)
        back = model_class.split_fused(tensor, index)
        assert all(torch.equal(back[k], saved[k]) for k in index)
    # every per-expert matrix on disk belongs to one fused tensor
    assert {k for k in saved if ".experts." in k and "shared" not in k} == covered


def test_a_tensor_written_as_held_is_its_own_piece() -> None:
    meta = _meta("mixtral")
    key = "model.layers.0.self_attn.q_proj.weight"
    shape = meta.state_dict()[key].shape
    index = model_class.fused_pieces(meta, key, shape)
    assert list(index) == [key]
    assert torch.equal(index[key].reshape(-1), torch.arange(shape.numel()))


def test_a_conversion_that_is_not_a_rearrangement_is_refused(monkeypatch) -> None:
    import transformers.core_model_loading as loading

    meta = _meta("mixtral")
    monkeypatch.setattr(
        loading, "revert_weight_conversion", lambda m, sd: {k: v * 0.5 for k, v in sd.items()}
    )
    key = "model.layers.0.mlp.experts.down_proj"
    with pytest.raises(ModelInputError, match="not a rearrangement"):
        model_class.fused_pieces(meta, key, meta.state_dict()[key].shape)
