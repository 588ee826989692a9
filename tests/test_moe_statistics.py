"""Routed-expert statistics and per-expert RegMean of a Mixtral MoE block (issue #30 item 3).

The statistics machinery (:mod:`mergekit_ext.executor.moe`) is checked against a reference
built independently: the router's softmax/top-k by hand, the routed rows and the experts'
intermediate activations captured by forward hooks on a per-expert ``nn.Linear`` copy of
each expert, and RegMean's closed form ``(Σ_k W_k G_k)(Σ_k G_k)⁻¹`` per expert linear.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from mergekit_ext.executor.moe import (
    DOWN,
    GATE_UP,
    RoutedCall,
    RoutedExpertStatistics,
    capture_routing,
    is_experts_module,
    merge_experts,
)
from mergekit_ext.methods.regmean import RegMeanMethod

H, INTER, E, TOP_K = 16, 24, 4, 2


def _block(seed: int, base: nn.Module | None = None) -> nn.Module:
    config = transformers.MixtralConfig(
        hidden_size=H,
        intermediate_size=INTER,
        num_local_experts=E,
        num_experts_per_tok=TOP_K,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=32,
    )
    torch.manual_seed(seed)
    block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config)
    with torch.no_grad():
        if base is None:
            block.gate.weight.normal_(0, 0.5)
            block.experts.gate_up_proj.normal_(0, 0.2)
            block.experts.down_proj.normal_(0, 0.2)
        else:
            for mine, theirs in zip(block.parameters(), base.parameters()):
                mine.copy_(theirs + 0.05 * torch.randn_like(theirs))
    return block.eval()


def _reference_grams(
    block: nn.Module, x: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Per expert, Σ r² x xᵀ / N and Σ r² h hᵀ / N: router by hand, h from hooks on a copy
    of the expert as two nn.Linear layers."""
    probs = torch.softmax(x @ block.gate.weight.T, dim=-1)
    top, index = torch.topk(probs, TOP_K, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    out = []
    for e in range(E):
        tok, slot = torch.where(index == e)
        if tok.numel() == 0:
            out.append(None)
            continue
        rows, r = x[tok].double(), top[tok, slot].double()
        gate_up = nn.Linear(H, 2 * INTER, bias=False)
        down = nn.Linear(INTER, H, bias=False)
        gate_up.weight.data = block.experts.gate_up_proj[e].detach().clone()
        down.weight.data = block.experts.down_proj[e].detach().clone()
        seen: dict[str, torch.Tensor] = {}
        down.register_forward_pre_hook(lambda m, a, seen=seen: seen.__setitem__("h", a[0]))
        with torch.no_grad():
            g, u = gate_up(x[tok]).chunk(2, dim=-1)
            down(nn.functional.silu(g) * u)
        h = seen["h"].double()
        n = x.shape[0]
        out.append(((rows * r[:, None] ** 2).T @ rows / n, (h * r[:, None] ** 2).T @ h / n))
    return out


def _routed_stats(block: nn.Module, x: torch.Tensor):
    calls: list[RoutedCall] = []
    with capture_routing(block.experts, calls), torch.no_grad():
        block(x.unsqueeze(0))
    stats = RoutedExpertStatistics(E, H, INTER)
    params = {GATE_UP: block.experts.gate_up_proj.detach(), DOWN: block.experts.down_proj.detach()}
    for call in calls:
        stats.update(block.experts, params, call)
    return stats.finalize()


def _fused(block: nn.Module) -> dict[str, torch.Tensor]:
    return {GATE_UP: block.experts.gate_up_proj.detach(), DOWN: block.experts.down_proj.detach()}


def _names(e: int) -> tuple[str, str]:
    return f"experts.{e}.gate_up", f"experts.{e}.down"


def test_statistics_and_regmean_match_the_closed_form_per_expert() -> None:
    base = _block(0)
    tasks = [_block(1, base), _block(2, base)]
    assert is_experts_module(base.experts) and not is_experts_module(base.gate)
    inputs = [
        torch.randn(400, H, generator=torch.Generator().manual_seed(10 + k)) for k in range(2)
    ]
    stats = [_routed_stats(t, x) for t, x in zip(tasks, inputs)]
    refs = [_reference_grams(t, x) for t, x in zip(tasks, inputs)]
    for got_task, ref_task in zip(stats, refs):
        for got, ref in zip(got_task, ref_task):
            assert (got is None) == (ref is None)
            assert got is not None and ref is not None  # every expert gets tokens here
            for g, r in zip(got, ref):
                assert torch.allclose(g.gram, r, rtol=1e-5, atol=1e-7)
    result = merge_experts(
        RegMeanMethod(),
        {"ridge": 0},
        _fused(base),
        [_fused(t) for t in tasks],
        ["a", "b"],
        stats,
        _names,
    )
    assert result.without_tokens == []
    assert len(result.records) == 2 * E
    for e in range(E):
        for key, part, merged in ((GATE_UP, 0, result.gate_up), (DOWN, 1, result.down)):
            grams = [refs[k][e][part] for k in range(2)]
            weights = [_fused(t)[key][e].double() for t in tasks]
            total = sum(grams)
            ref = sum(w @ g for w, g in zip(weights, grams)) @ torch.linalg.inv(total)
            diff = merged[e].double() - ref
            err = torch.sqrt(torch.trace(diff @ total @ diff.T) / torch.trace(ref @ total @ ref.T))
            assert err < 1e-4, (key, e, float(err))
            # and it is not simply the mean (the data moved it)
            mean = sum(weights) / 2
            far = mean - ref
            assert (
                torch.sqrt(torch.trace(far @ total @ far.T) / torch.trace(ref @ total @ ref.T))
                > 1e-3
            )


def test_expert_without_routed_tokens_takes_the_fallback_and_is_counted() -> None:
    base = _block(0)
    tasks = [_block(1, base), _block(2, base)]
    for t in tasks:  # expert 3 scores lowest for every positive input: never routed to
        with torch.no_grad():
            t.gate.weight[3] = -5.0
            t.gate.weight[:3] = t.gate.weight[:3].abs()
    inputs = [
        torch.rand(300, H, generator=torch.Generator().manual_seed(k)) + 0.1 for k in range(2)
    ]
    stats = [_routed_stats(t, x) for t, x in zip(tasks, inputs)]
    assert all(s[3] is None for s in stats) and all(s[0] is not None for s in stats)
    result = merge_experts(
        RegMeanMethod(),
        {"ridge": 0, "fallback": "mean"},
        _fused(base),
        [_fused(t) for t in tasks],
        ["a", "b"],
        stats,
        _names,
    )
    assert result.without_tokens == [3]
    for key, merged in ((GATE_UP, result.gate_up), (DOWN, result.down)):
        mean = (_fused(tasks[0])[key][3] + _fused(tasks[1])[key][3]) / 2
        assert torch.allclose(merged[3], mean, atol=1e-6)
        assert not torch.allclose(
            merged[0], (_fused(tasks[0])[key][0] + _fused(tasks[1])[key][0]) / 2, atol=1e-4
        )
    assert {r["expert"] for r in result.records} == {0, 1, 2}


def test_padding_rows_are_left_out_of_the_routed_statistics() -> None:
    block = _block(1, _block(0))
    x = torch.randn(50, H, generator=torch.Generator().manual_seed(3))
    calls: list[RoutedCall] = []
    with capture_routing(block.experts, calls), torch.no_grad():
        block(x.unsqueeze(0))
    mask = torch.arange(50) < 30
    masked = RoutedExpertStatistics(E, H, INTER)
    masked.update(block.experts, _fused(block), calls[0], mask)
    alone = RoutedExpertStatistics(E, H, INTER)
    call = calls[0]
    alone.update(
        block.experts,
        _fused(block),
        RoutedCall(call.hidden[:30], call.top_k_index[:30], call.top_k_weights[:30]),
    )
    assert masked.tokens == alone.tokens == 30
    for a, b in zip(masked.finalize(), alone.finalize()):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert torch.equal(a[0].gram, b[0].gram) and torch.equal(a[1].gram, b[1].gram)


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_other_experts_classes_share_the_interface(model_type: str) -> None:
    """The intermediate rows come from each class's own forward (one down_proj product)."""
    from tiny_architectures import ARCHITECTURES

    config = ARCHITECTURES[model_type].config()
    with torch.device("meta"):
        model = getattr(transformers, ARCHITECTURES[model_type].model_class)(config)
    found = [m for m in model.modules() if is_experts_module(m)]
    assert found, model_type
    experts = found[0]
    e, two_i, h = experts.gate_up_proj.shape
    params = {
        GATE_UP: torch.randn(e, two_i, h, generator=torch.Generator().manual_seed(0)),
        DOWN: torch.randn(e, h, two_i // 2, generator=torch.Generator().manual_seed(1)),
    }
    x = torch.randn(20, h, generator=torch.Generator().manual_seed(2))
    stats = RoutedExpertStatistics(e, h, two_i // 2)
    index = torch.stack([torch.arange(20) % e, (torch.arange(20) + 1) % e], 1)
    stats.update(experts, params, RoutedCall(x, index, torch.full((20, 2), 0.5)))
    got = stats.finalize()
    assert all(s is not None for s in got)
    assert got[0][0].count == sum(int((index == 0).any(1)[t]) for t in range(20))
