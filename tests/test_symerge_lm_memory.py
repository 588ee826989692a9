"""SyMerge on causal LMs in bounded memory: the top-k teacher and the chunked logits.

The teacher's next-token distributions are cached as their top-k log-probabilities plus one
bucket for the rest; the student's logits are formed a few positions at a time and
recomputed in the backward pass. With k = the vocabulary both are exact: value and
gradients equal the full-logits KL.
"""

from __future__ import annotations

import math
import random

import pytest
import tiny_models
import torch
import transformers

from mergekit_ext.adaptation import memory
from mergekit_ext.adaptation.losses import (
    TopKLogProbs,
    kl_to_teacher,
    kl_to_top_k_teacher,
    top_k_log_probs,
)
from mergekit_ext.adaptation.parameters import SyMergeParameters
from mergekit_ext.adaptation.problem import causal_lm_split
from mergekit_ext.adaptation.run import adapt_session, prepare_symerge
from mergekit_ext.adaptation.trainer import causal_lm_chunked_loss, task_loss, teacher_outputs
from mergekit_ext.config import parse_config

V = 50


def _logits(seed: int, *shape: int) -> torch.Tensor:
    return 3.0 * torch.randn(*shape, V, generator=torch.Generator().manual_seed(seed))


def test_top_k_with_the_whole_vocabulary_is_the_exact_kl() -> None:
    student, teacher = _logits(0, 7), _logits(1, 7)
    compressed = top_k_log_probs(teacher, V)
    assert torch.isneginf(compressed.rest).all()
    exact = kl_to_teacher(student, teacher) * 7  # batchmean -> sum
    torch.testing.assert_close(kl_to_top_k_teacher(student, compressed), exact, rtol=1e-5, atol=0)


@pytest.mark.parametrize("k", [1, 5, 20])
def test_top_k_kl_is_the_kl_of_the_lumped_distributions(k: int) -> None:
    """Transcribed literally: both distributions on the teacher's top-k tokens plus one
    outcome for everything else; a lower bound of the full KL (data processing)."""
    student, teacher = _logits(2, 6).double(), _logits(3, 6).double()
    compressed = top_k_log_probs(teacher, k)
    p, q = teacher.softmax(-1), student.softmax(-1)
    expected = 0.0
    for i in range(6):
        top = p[i].topk(k).indices
        pk, qk = p[i][top], q[i][top]
        lumped_p = torch.cat([pk, (1 - pk.sum()).reshape(1)])
        lumped_q = torch.cat([qk, (1 - qk.sum()).reshape(1)])
        expected += float((lumped_p * (lumped_p.log() - lumped_q.log())).sum())
        torch.testing.assert_close(compressed.indices[i], top)
    got = float(kl_to_top_k_teacher(student, compressed))
    assert got == pytest.approx(expected, rel=1e-9)
    assert got <= float(kl_to_teacher(student, teacher)) * 6 + 1e-12


@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_chunked_loss_equals_the_full_logits_loss_and_gradients(chunk: int) -> None:
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(3, 5, 8, generator=g, requires_grad=True)
    head = torch.randn(V, 8, generator=g, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    teacher_logits = _logits(5, 3, 5)
    teacher = top_k_log_probs(teacher_logits, V)

    full, full_agree = task_loss("causal_lm", hidden @ head.T, teacher_logits, mask, "hard", None)
    grads = torch.autograd.grad(full, (hidden, head))
    loss, agree = causal_lm_chunked_loss(hidden, head, teacher, mask, chunk)
    chunked_grads = torch.autograd.grad(loss, (hidden, head))

    torch.testing.assert_close(loss, full, rtol=1e-5, atol=1e-7)
    assert agree == pytest.approx(full_agree)
    for a, b in zip(chunked_grads, grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert hidden.grad is None  # autograd.grad, not backward: nothing accumulated


def test_teacher_cache_is_compressed_in_small_batches() -> None:
    calls: list[int] = []
    logits = _logits(6, 10, 4)

    def forward(batch):
        calls.append(len(batch["input_ids"]))
        return transformers.modeling_outputs.CausalLMOutput(logits=logits[batch["idx"]])

    inputs = {"input_ids": torch.zeros(10, 4, dtype=torch.long), "idx": torch.arange(10)}
    out = teacher_outputs(forward, inputs, 8, "cpu", top_k=3, vocab_size=V)
    assert isinstance(out, TopKLogProbs) and out.shape == (10, 4, 3)
    torch.testing.assert_close(out[2:4].logprobs, top_k_log_probs(logits[2:4], 3).logprobs)
    assert calls == [8, 2]
    # a vocabulary so large that one sample's logits exceed the budget: one sample per call
    calls.clear()
    teacher_outputs(forward, inputs, 8, "cpu", top_k=3, vocab_size=10**9)
    assert calls == [1] * 10


def _llama_with_data(tmp_path):
    base = tiny_models.make_tiny_llama(str(tmp_path / "base"), seed=0)
    experts = tiny_models.make_experts(base, [str(tmp_path / "e0"), str(tmp_path / "e1")])
    data = str(tmp_path / "text.txt")
    rng = random.Random(0)
    with open(data, "w", encoding="utf-8") as fp:
        fp.writelines(
            " ".join(rng.choice(tiny_models.WORDS) for _ in range(rng.randrange(3, 9))) + "\n"
            for _ in range(24)
        )
    return base, experts, data


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_body_and_head_reproduce_the_model_logits(tmp_path, tie: bool) -> None:
    base = tiny_models.make_tiny_llama(str(tmp_path / "base"), seed=0)
    config = transformers.AutoConfig.from_pretrained(base)
    config.tie_word_embeddings = tie
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    body, head_name = causal_lm_split(model)
    assert body == "model"
    assert head_name == ("model.embed_tokens.weight" if tie else "lm_head.weight")
    ids = torch.tensor([[3, 5, 7, 9]])
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        params = dict(model.named_parameters())
        torch.testing.assert_close(hidden @ params[head_name].T, model(input_ids=ids).logits)


def test_softcapped_or_biased_heads_take_the_full_logits(tmp_path) -> None:
    base = tiny_models.make_tiny_llama(str(tmp_path / "base"), seed=0)
    model = transformers.LlamaForCausalLM.from_pretrained(base)
    model.config.final_logit_softcapping = 30.0
    assert causal_lm_split(model) is None
    model.config.final_logit_softcapping = None
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.lm_head.out_features))
    assert causal_lm_split(model) is None
    bert = transformers.BertForSequenceClassification(
        transformers.BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=8, vocab_size=V)
    )  # fmt: skip
    assert causal_lm_split(bert) is None


def _run(base, experts, data, **parameters):
    text = (
        f"merge_method: symerge\nbase_model: {base}\n"
        f"calibration: {{path: {data}, samples: 24, max_length: 12, batch_size: 8}}\n"
        f"models:\n  - model: {experts[0]}\n    name: one\n  - model: {experts[1]}\n    name: two\n"
    )
    params = SyMergeParameters(epochs=3, batch_size=8, lr=0.05, **parameters)
    session = prepare_symerge(parse_config(text), params)
    section = adapt_session(session, progress=False)
    return session, section


def test_top_k_chunked_adaptation_equals_the_full_distribution(tmp_path) -> None:
    """k = the vocabulary: the bounded-memory path follows the full-logits path step by step
    (same λ and losses up to float32 rounding); a small k stays close."""
    base, experts, data = _llama_with_data(tmp_path)
    vocab = transformers.AutoConfig.from_pretrained(base).vocab_size
    full_session, full = _run(base, experts, data, teacher_top_k=None)
    exact_session, exact = _run(base, experts, data, teacher_top_k=vocab, logit_chunk_tokens=5)
    assert isinstance(exact_session.data[0].teacher, TopKLogProbs)
    assert not isinstance(full_session.data[0].teacher, TopKLogProbs)
    assert exact["loss"] == pytest.approx(full["loss"], rel=1e-4)
    torch.testing.assert_close(
        exact_session.problem.lambdas.detach(),
        full_session.problem.lambdas.detach(),
        atol=1e-5,
        rtol=0,
    )
    _, small = _run(base, experts, data, teacher_top_k=4)
    assert all(math.isfinite(v) for v in small["loss"])
    assert small["loss"][0] <= full["loss"][0] + 1e-6  # the lumped KL bounds the full one


def test_memory_estimate_follows_k_and_the_chunk() -> None:
    config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "vocab_size": 49152}  # fmt: skip
    full = memory.activation_bytes(config, 128, 32, True)
    chunked = memory.activation_bytes(config, 128, 32, True, logit_rows=512)
    logits = 3 * memory.FLOAT32 * 49152
    assert full - chunked == logits * (32 * 128 - 512)
    assert memory.activation_bytes(config, 4, 2, True, logit_rows=512) == memory.activation_bytes(
        config, 4, 2, True
    )  # fewer positions than a chunk: nothing changes


def test_micro_batches_give_the_whole_batch_step(tmp_path) -> None:
    """Micro-batches of 3 samples, their gradients weighted by positions: the same Adam steps
    as the whole batch of 8 at once (up to float32 summation order)."""
    base, experts, data = _llama_with_data(tmp_path)
    whole_session, whole = _run(base, experts, data, micro_batch_size=8)
    micro_session, micro = _run(base, experts, data, micro_batch_size=3)
    assert whole["settings"]["micro_batch_size"] == 8 and micro["settings"]["micro_batch_size"] == 3
    assert micro["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    torch.testing.assert_close(
        micro_session.problem.lambdas.detach(),
        whole_session.problem.lambdas.detach(),
        atol=1e-5,
        rtol=0,
    )


def test_default_micro_batch_bounds_the_activations() -> None:
    from mergekit_ext.adaptation.run import MICRO_BATCH_ACTIVATIONS_BYTES, resolved_micro_batch_size

    smollm = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
              "vocab_size": 49152}  # fmt: skip
    p = SyMergeParameters(batch_size=32)
    size = resolved_micro_batch_size(p, smollm, 128)
    assert 1 <= size < 32
    assert memory.activation_bytes(smollm, 128, size, True, 512) <= MICRO_BATCH_ACTIVATIONS_BYTES
    tiny = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}
    assert resolved_micro_batch_size(p, tiny, 16) == 32  # small models: the whole batch
    assert resolved_micro_batch_size(SyMergeParameters(micro_batch_size=4), smollm, 128) == 4


def test_a_student_that_matches_the_top_k_almost_surely_stays_finite() -> None:
    """Top-k mass of 1 − 1e-30: in float32 1 − Σ q_top is exactly 0 and its log −inf; the
    rest bucket summed over the other tokens stays finite (a CoM body's LM hit this)."""
    logits = torch.full((2, V), -80.0)
    logits[:, :3] = torch.tensor([10.0, 9.0, 8.0])
    teacher_logits = logits.clone()
    teacher_logits[:, 5] = -20.0  # the teacher keeps a little mass outside its top-3
    teacher = top_k_log_probs(teacher_logits, 3)
    assert torch.isfinite(teacher.rest).all() and float(teacher.rest.max()) < -25
    student = logits.clone().requires_grad_(True)
    loss = kl_to_top_k_teacher(student, teacher)
    (grad,) = torch.autograd.grad(loss, student)
    assert torch.isfinite(loss.detach()) and torch.isfinite(grad).all()
    assert float(loss.detach()) >= 0.0
