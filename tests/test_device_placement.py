"""Every tensor the merge math allocates lives on its inputs' device.

With ``--device cuda`` the groups, rows and Grams are CUDA tensors; a ``torch.zeros(...)``
without ``device=`` then lands on the CPU and the first mixed operation fails (or, for a
scalar, syncs). CI has no GPU, so these tests run the same math on CPU inputs with the
*default* device set to ``meta``: an allocation that forgets its inputs' device becomes a
meta tensor, and the result is then meta, or the run fails. Each path must give CPU results
with the same bits as without the meta default.
"""

from __future__ import annotations

import math

import pytest
import test_distributed
import torch
from test_llm_width import _group

from mergekit_ext.calibration.statistics import ActivationStatistics
from mergekit_ext.executor.model_output import output_sketch
from mergekit_ext.methods import least_squares
from mergekit_ext.methods.ace import ace_merge_tensor
from mergekit_ext.methods.chain_of_merges import ChainOfMergesMethod
from mergekit_ext.methods.layerwise import ModelOutputRequest
from mergekit_ext.methods.qp_solve import qp_merge_weight
from mergekit_ext.methods.regmean import RegMeanMethod
from mergekit_ext.methods.wudi import wudi_merge_tensor

DIM = 24


def _inputs(seed: int, n: int, dim: int = DIM) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g, dtype=torch.float64) @ torch.randn(
        dim, dim, generator=g, dtype=torch.float64
    )
    return x + torch.randn(dim, generator=g, dtype=torch.float64)


def _experts(k: int, out: int, dim: int = DIM) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    base = torch.randn(out, dim, generator=g, dtype=torch.float64)
    return [base + 0.1 * torch.randn(out, dim, generator=g, dtype=torch.float64) for _ in range(k)]


def _same(plain, meta) -> None:
    """Equal results, tensors on the CPU with the same bits, everywhere in a nest."""
    if isinstance(plain, torch.Tensor):
        assert isinstance(meta, torch.Tensor) and meta.device.type == "cpu", meta
        assert meta.dtype == plain.dtype and torch.equal(meta, plain)
    elif isinstance(plain, dict):
        assert plain.keys() == meta.keys()
        for key in plain:
            _same(plain[key], meta[key])
    elif isinstance(plain, (list, tuple)):
        assert len(plain) == len(meta)
        for a, b in zip(plain, meta):
            _same(a, b)
    elif isinstance(plain, float) and math.isnan(plain):
        assert math.isnan(meta)
    else:
        assert plain == meta


def _on_meta_default(fn):
    """``fn()`` as it runs, and again with ``meta`` as the default device: the same."""
    plain = fn()
    with torch.device("meta"):
        meta = fn()
    _same(plain, meta)
    return plain


# (tasks, tokens per task, outputs, parameters): which solve each case takes
GROUP_CASES = {
    "span, out <= in": (2, 5, 16, {}),
    "span, two tasks regrouped": (2, 5, 200, {}),
    "span, three tasks, out > in": (3, 4, 60, {}),
    "span, alpha < 1": (2, 5, 16, {"reduce_non_diagonal": 0.9}),
    "dense, from the rows": (2, 20, 60, {"ridge": 0.0}),
    "dense, numerator": (2, 20, 16, {"reduce_non_diagonal": 0.9}),
}


@pytest.mark.parametrize("case", list(GROUP_CASES))
@pytest.mark.parametrize("method", [RegMeanMethod(), ChainOfMergesMethod()], ids=["regmean", "com"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_least_squares_group_allocates_on_its_inputs_device(monkeypatch, case, method, dtype):
    tasks, tokens, out, parameters = GROUP_CASES[case]
    # the condition-number estimates too (above this many inputs they replace eigvalsh)
    monkeypatch.setattr(least_squares.solve, "EXACT_CONDITION_MAX_DIM", 8)
    xs = [_inputs(30 + k, tokens) for k in range(tasks)]
    ws = _experts(tasks, out)
    keep = tokens * tasks < DIM or "rows" in case
    merged, diagnostics = _on_meta_default(
        lambda: method.merge_linear_group(_group(xs, ws, keep, True, dtype), parameters)
    )
    assert merged["blk.fc.weight"].dtype == dtype
    if keep and tokens * tasks < DIM:
        assert diagnostics["solver"].startswith("cholesky in the span")


@pytest.mark.parametrize("method, parameters", test_distributed.REDUCTION_CASES)
@pytest.mark.parametrize("kept_rows, outputs", [(False, 3), (True, 3), (True, 30)])
def test_sum_reduction_allocates_on_its_inputs_device(method, parameters, kept_rows, outputs):
    """The reduction of several ranks (NCCL keeps its sums on the GPU); with 30 outputs for
    12 tokens and α = 1, the two rounds of row terms."""
    weights, expert, merged_path = test_distributed._three_tasks(0, outputs, 2, kept_rows)
    reduce = test_distributed._reduce_like_two_ranks
    reduced = _on_meta_default(lambda: reduce(method, parameters, weights, expert, merged_path))
    if reduced is None:  # gathered to one rank: the group merge, as above
        whole = test_distributed._group([0, 1, 2], weights, expert, merged_path)
        _on_meta_default(lambda: method.merge_linear_group(whole, parameters))


def test_activation_statistics_allocate_on_the_rows_device():
    x = _inputs(40, 50).float()

    def accumulate(keep_rows: bool, normalized: bool):
        stats = ActivationStatistics(DIM, keep_rows=keep_rows, normalized_gram=normalized)
        for part in torch.split(x, 7):
            stats.update(part)
        st = stats.finalize()
        return st.gram_from_rows(), st.second_moment, st.mean, st.gram_normalized

    _on_meta_default(lambda: accumulate(True, False))
    _on_meta_default(lambda: accumulate(False, True))


def test_data_free_and_qp_merges_allocate_on_their_inputs_device():
    base = _experts(1, 16)[0].float()
    experts = [w.float() for w in _experts(3, 16)]
    grams = [(x.T @ x / x.shape[0]).float() for x in (_inputs(50 + k, 30) for k in range(3))]
    _on_meta_default(lambda: ace_merge_tensor(base, experts)[0])
    _on_meta_default(lambda: wudi_merge_tensor(base, experts, steps=5)[0])
    _on_meta_default(lambda: qp_merge_weight(base, experts, grams)[0])
    _on_meta_default(lambda: qp_merge_weight(base, experts, grams, basis="residual_eigen")[0])


@pytest.mark.parametrize("sketch_rows", [0, 3])
def test_output_sketches_are_drawn_on_the_cpu_on_every_device(sketch_rows):
    """The model-output sketches come from a CPU generator (the same rows on every device);
    the padding mask may live on the merge's device."""
    request = ModelOutputRequest(sketch_rows=sketch_rows, tokens="all")
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    rows = _on_meta_default(lambda: output_sketch(request, torch.Size([2, 3, 4]), mask, 7))
    assert rows.shape == (sketch_rows or 12, 2, 3, 4) and not rows[:, 1, 1:].any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", list(GROUP_CASES))
@pytest.mark.parametrize("method", [RegMeanMethod(), ChainOfMergesMethod()], ids=["regmean", "com"])
def test_least_squares_group_on_cuda_matches_the_cpu(case, method):
    """Each solve of the cases above on a GPU: the same solver, the same weights to float32's
    rounding, the result on the GPU."""
    tasks, tokens, out, parameters = GROUP_CASES[case]
    xs = [_inputs(30 + k, tokens) for k in range(tasks)]
    ws = _experts(tasks, out)
    keep = tokens * tasks < DIM or "rows" in case
    cpu_w, cpu_d = method.merge_linear_group(_group(xs, ws, keep, True), parameters)
    on_gpu = _group([x.cuda() for x in xs], [w.cuda() for w in ws], keep, True)
    gpu_w, gpu_d = method.merge_linear_group(on_gpu, parameters)
    assert gpu_w["blk.fc.weight"].is_cuda
    # float32 products summed in another order: float32's rounding, amplified by the solve
    torch.testing.assert_close(
        gpu_w["blk.fc.weight"].cpu(), cpu_w["blk.fc.weight"], rtol=1e-4, atol=1e-5
    )
    assert gpu_d["solver"] == cpu_d["solver"] and gpu_d["ridge"] == cpu_d["ridge"]
