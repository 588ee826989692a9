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
    assert index[key] == model_class.PieceView(tuple(shape), (shape[1], 1), 0)


@pytest.mark.parametrize("model_type", ["mixtral", "deepseek_v3"])
def test_views_and_the_position_map_give_the_same_bytes(model_type) -> None:
    """The strided views and the position map (the fallback, transformers' conversion run on
    each element's flat position) gather and split a fused tensor identically."""
    meta = _meta(model_type)
    for key, t in meta.state_dict().items():
        if t.dim() != 3:
            continue
        tensor = torch.randn(tuple(t.shape), generator=torch.Generator().manual_seed(0))
        views = model_class.fused_pieces(meta, key, t.shape)
        positions = model_class._position_map(meta, key, t.shape)
        assert list(views) == list(positions)
        assert all(isinstance(v, model_class.PieceView) for v in views.values())
        by_view = model_class.split_fused(tensor, views)
        by_position = model_class.split_fused(tensor, positions)
        for k in views:
            assert torch.equal(by_view[k], by_position[k]) and by_view[k].is_contiguous()
        assert torch.equal(model_class.gather_fused(by_view, views, t.shape), tensor)
        assert torch.equal(model_class.gather_fused(by_view.get, positions, t.shape), tensor)


def test_a_conversion_that_copies_falls_back_to_the_position_map(monkeypatch) -> None:
    """Pieces that are new tensors the views cannot follow (here: ``v + 0``, not a copy by
    ``contiguous``/``clone``): located by their elements' positions instead."""
    import transformers.core_model_loading as loading

    meta = _meta("mixtral")
    key = "model.layers.0.mlp.experts.down_proj"
    shape = meta.state_dict()[key].shape
    original = loading.revert_weight_conversion
    monkeypatch.setattr(
        loading,
        "revert_weight_conversion",
        lambda m, sd: {k: v + 0 for k, v in original(m, sd).items()},
    )
    index = model_class.fused_pieces(meta, key, shape)
    assert all(isinstance(v, torch.Tensor) for v in index.values())
    tensor = torch.randn(tuple(shape))
    assert torch.equal(
        model_class.gather_fused(model_class.split_fused(tensor, index), index, shape), tensor
    )


def test_mixtral_8x7b_experts_are_located_without_an_index_map() -> None:
    """Mixtral-8x7B's fused experts (gate_up [8, 28672, 4096], down [8, 4096, 14336]: an
    int64 map of gate_up alone would take 7.5 GB): located as views, with no tensor of
    their size; the process's peak memory grows by less than 64 MB."""
    import resource

    meta = _meta("mixtral")  # the conversion is per layer and shape-agnostic
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    for key, shape, piece in (
        ("model.layers.0.mlp.experts.gate_up_proj", (8, 28672, 4096), (14336, 4096)),
        ("model.layers.0.mlp.experts.down_proj", (8, 4096, 14336), (4096, 14336)),
    ):
        index = model_class.fused_pieces(meta, key, shape)
        assert len(index) == 8 * (2 if "gate_up" in key else 1)
        assert all(isinstance(v, model_class.PieceView) for v in index.values())
        assert {v.size for v in index.values()} == {piece}
        offsets = sorted(v.offset for v in index.values())
        assert offsets == [i * 14336 * 4096 for i in range(len(index))]
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown < 64 * 1024, f"peak memory grew by {grown} KiB"


def test_a_conversion_that_is_not_a_rearrangement_is_refused(monkeypatch) -> None:
    import transformers.core_model_loading as loading

    meta = _meta("mixtral")
    monkeypatch.setattr(
        loading, "revert_weight_conversion", lambda m, sd: {k: v * 0.5 for k, v in sd.items()}
    )
    key = "model.layers.0.mlp.experts.down_proj"
    with pytest.raises(ModelInputError, match="not a rearrangement"):
        model_class.fused_pieces(meta, key, meta.state_dict()[key].shape)
