"""``qp_projection`` with ``objective: model_output`` on causal LMs: the per-token KL.

The sampled-token sketch is checked against the KL's exact gradient and Gauss-Newton
matrix in expectation, the executor's linear term against autograd of the KL of a whole
transformers Llama with respect to the QP coefficients, and the option end to end (a tied
head).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import tiny_models  # tests/ is on sys.path (conftest.py)
import torch
import transformers
import yaml
from click.testing import CliRunner
from mergekit.options import MergeOptions
from safetensors.torch import load_file
from test_qp_model_output import (
    _config,
    _merge,
    _sha,
    _texts,
)

from mergekit_ext.calibration.sources import load_calibration
from mergekit_ext.cli import main
from mergekit_ext.executor.model_output import next_token_log_probs, next_token_sketch

OPTIONS = MergeOptions(quiet=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see conftest.py


# ------------------------------------------------------------------------------------------
# The sketch


def _kl(hidden, head, target_log_probs, mask):
    log_p = next_token_log_probs(hidden, head)
    kl = (target_log_probs.exp() * (target_log_probs - log_p)).sum(-1)
    return (kl * mask).sum()


def test_next_token_sketch_is_the_kl_gauss_newton_in_expectation():
    """Rows v_p at the hidden state (all positions of a sample flattened): the mean of
    Σ_p v_p v_pᵀ is block-diagonal WᵀH_τW (H = diag(p) − ppᵀ), Σ_p v_p r_p estimates WᵀGτ
    (g = p − p_t), which the returned gradient gives exactly: autograd of the KL."""
    gen = torch.Generator().manual_seed(0)
    batch, tokens, width, vocab = 2, 3, 4, 7
    hidden = torch.randn(batch, tokens, width, generator=gen)
    head = torch.randn(vocab, width, generator=gen)
    target_hidden = hidden + 0.3 * torch.randn(batch, tokens, width, generator=gen)
    target = next_token_log_probs(target_hidden, head)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])

    rows = 200_000
    residual, backward_rows, error_grad = next_token_sketch(hidden, target, head, mask, rows, 0)
    assert residual.shape == (batch, rows) and residual.dtype == torch.float64
    assert backward_rows.shape == (rows, batch, tokens, width)

    exact = hidden.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(_kl(exact, head, target, mask), exact)
    torch.testing.assert_close(error_grad, grad, rtol=1e-5, atol=1e-6)

    p = next_token_log_probs(hidden, head).exp().double()
    w = head.double()
    for b in range(batch):
        v = backward_rows[:, b].reshape(rows, -1).double()
        estimate = v.T @ v
        expected = torch.zeros(tokens * width, tokens * width, dtype=torch.float64)
        for t in range(tokens):
            if mask[b, t]:
                h_tok = torch.diag(p[b, t]) - torch.outer(p[b, t], p[b, t])
                block = slice(t * width, (t + 1) * width)
                expected[block, block] = w.T @ h_tok @ w
        scale = float(expected.abs().max())
        torch.testing.assert_close(estimate, expected, rtol=0, atol=0.03 * scale)
        linear = v.T @ residual[b]
        torch.testing.assert_close(
            linear, error_grad[b].reshape(-1).double(), rtol=0, atol=0.05 * float(grad.abs().max())
        )
    assert (backward_rows[:, 1, 2] == 0).all() and float(error_grad[1, 2].abs().max()) == 0.0


# ------------------------------------------------------------------------------------------
# The executor on a whole transformers Llama


@pytest.fixture(scope="module")
def llama_texts(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("qp_mo_texts"))
    return [_texts(root, k) for k in range(3)]


def test_linear_term_is_the_exact_kl_gradient_of_the_whole_model(
    tiny_llama_set, llama_texts, tmp_path, recorded_fits
):
    """First linear: the sums' linear term is −Σ_t (1/N_t) Σ_j ∂KL_j/∂d at d = 0, by autograd
    of the KL of the whole LlamaForCausalLM (non-linear tensors and the head at the
    experts' mean, the fallback; linears at the base); the errors are the exact KL."""
    cfg = _config(
        tiny_llama_set,
        llama_texts,
        {"objective": "model_output", "output_sketch": 4},
    )
    result = _merge(cfg, tmp_path / "out").diagnostics
    first = recorded_fits[0]
    assert first.name == "model.layers.0.self_attn.q_proj.weight"
    assert len(result["layers"]) == 14  # 2 blocks x 7 linears, one at a time

    cls = transformers.LlamaForCausalLM
    base = cls.from_pretrained(tiny_llama_set.base).eval()
    experts = [cls.from_pretrained(e).eval() for e in tiny_llama_set.experts]
    assert not base.config.tie_word_embeddings
    linears = {n for n, mod in base.model.named_modules() if isinstance(mod, torch.nn.Linear)}
    states = [e.state_dict() for e in experts]
    params = {
        name: tensor
        if name.removeprefix("model.").removesuffix(".weight") in linears
        or not tensor.is_floating_point()
        else torch.stack([s[name] for s in states]).mean(0)
        for name, tensor in base.state_dict().items()
    }
    key = "model.layers.0.self_attn.q_proj.weight"
    w0 = params[key].double()
    deltas = [s[key].double() - w0 for s in states]
    m, k = w0.shape[0], len(deltas)

    def kl_of(d_flat, inputs, target):
        d = d_flat.reshape(m, k)
        weight = w0 + sum(d[:, i : i + 1] * deltas[i] for i in range(k))
        local = {**params, key: weight.float()}
        out = torch.func.functional_call(base, local, args=(), kwargs=inputs)
        log_p = torch.log_softmax(out.logits.double(), -1)
        kl = (target.exp() * (target - log_p)).sum(-1)
        return (kl * inputs["attention_mask"]).sum()

    gradient = torch.zeros(m * k, dtype=torch.float64)
    error = 0.0
    for t, entry in enumerate(cfg.models):
        data = load_calibration(
            cfg.calibration_for(entry), entry.model, task=entry.name, modality="text"
        )
        samples = sum(int(b["input_ids"].shape[0]) for b in data.batches)
        for batch in data.batches:
            inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
            with torch.no_grad():
                target = torch.log_softmax(experts[t](**inputs).logits.double(), -1)
            zero = torch.zeros(m * k, dtype=torch.float64)
            gradient += torch.func.grad(kl_of)(zero, inputs, target) / samples
            error += float(kl_of(zero, inputs, target)) / samples
    scale = float(gradient.abs().max())
    torch.testing.assert_close(first.sums.rhs, -gradient, rtol=0, atol=1e-4 * scale)
    record = result["layers"][0]["weights"][first.name]
    assert record["output_error_before"] == pytest.approx(error, rel=1e-4)
    assert result["model_output"]["output_error_initial"] == pytest.approx(error, rel=1e-4)
    assert result["model_output"]["output"] == "next_token_kl"
    # the sketched Gauss-Newton matrix is a sum of squares: symmetric, PSD
    eig = torch.linalg.eigvalsh(first.sums.normal)
    assert float(eig.min()) >= -1e-9 * float(eig.max())


def _tied_llama(root: str, tokenizer_from: str) -> tuple[str, list[str]]:
    """A Llama whose head is tied to its embeddings (saved once), and three experts."""
    base = os.path.join(root, "base")
    config = transformers.LlamaConfig.from_pretrained(tokenizer_from)
    config.tie_word_embeddings = True
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(config).save_pretrained(base)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_from, f), os.path.join(base, f))
    experts = tiny_models.make_experts(base, [os.path.join(root, f"e{i}") for i in range(3)])
    assert "lm_head.weight" not in load_file(os.path.join(base, "model.safetensors"))
    return base, list(experts)


def test_mergekit_ext_run_on_llama_with_a_tied_head(tiny_llama_set, llama_texts, tmp_path):
    """The CLI end to end with a tied head: a checkpoint transformers loads as it is, the
    KL to the experts lowered, the objective in the diagnostics; same seed, same bytes."""
    base, experts = _tied_llama(str(tmp_path / "tied"), tiny_llama_set.base)
    config = {
        "merge_method": "qp_projection",
        "base_model": base,
        "models": [
            {"model": e, "calibration": {"path": d, "field": "text"}}
            for e, d in zip(experts, llama_texts)
        ],
        "calibration": {"samples": 4, "max_length": 12, "batch_size": 2},
        "parameters": {"objective": "model_output", "output_sketch": 4, "prior": 0.0},
        "dtype": "float32",
    }
    (tmp_path / "c.yml").write_text(yaml.safe_dump(config))
    outs = []
    for name in ("a", "b"):
        out = tmp_path / name
        result = CliRunner().invoke(
            main, ["run", str(tmp_path / "c.yml"), str(out)], catch_exceptions=False
        )
        assert result.exit_code == 0, result.output
        outs.append(out)
    assert _sha(outs[0]) == _sha(outs[1]), "same config and seed: same bytes"
    merged = load_file(str(outs[0] / "model.safetensors"))
    assert set(merged) == set(load_file(os.path.join(base, "model.safetensors")))
    diag = json.loads((outs[0] / "mergekit_ext_diagnostics.json").read_text())
    section = diag["sections"]["qp_projection"]["model_output"]
    assert section["output"] == "next_token_kl" and section["output_tokens"] == "all"
    assert section["output_error_final"] < 0.8 * section["output_error_initial"]
    assert len(diag["sections"]["qp_projection"]["layers"]) == 14
    model = transformers.LlamaForCausalLM.from_pretrained(str(outs[0]))
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_probe_fits_only_the_first_linears_and_tabulates_each_variant(
    tiny_llama_set, llama_texts, tmp_path
):
    """``benchmarks.probes.qp_model_output_probe``: the first N linears are fitted (the rest stay at
    the base), one row each per variant, with the exact error before each."""
    from benchmarks.probes.qp_model_output_probe import main as probe

    config = {
        "merge_method": "qp_projection",
        "base_model": tiny_llama_set.base,
        "models": [
            {"model": e, "calibration": {"path": d, "field": "text", "samples": 4}}
            for e, d in zip(tiny_llama_set.experts, llama_texts)
        ],
        "parameters": {"objective": "model_output", "output_sketch": 2, "prior": 0.0},
    }
    (tmp_path / "c.yml").write_text(yaml.safe_dump(config))
    out = tmp_path / "probe.md"
    args = [str(tmp_path / "c.yml"), "--linears", "3", "--variant", "exact", "box"]
    assert probe([*args, "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| exact")]
    assert len(rows) == 4  # three linears and the error after them
    assert rows[0].split(" | ")[1] == "model.layers.0.self_attn.q_proj.weight"
    assert "k_proj" in rows[1] and "v_proj" in rows[2]
    box = [line for line in out.read_text().splitlines() if line.startswith("| box")]
    cells = [r.strip("| ").split(" | ") for r in box[:3]]
    assert all(0.0 <= float(c[3]) and float(c[5]) <= 1.0 for c in cells)
    assert "Command: `python -m benchmarks.probes.qp_model_output_probe" in out.read_text()
