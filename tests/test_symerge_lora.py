"""SyMerge with PEFT LoRA adapters as experts: task vectors kept as their factors.

A LoRA expert's task vector is its update ``s · B A``; SyMerge keeps the factors instead of a
dense copy per expert, and tensors no expert changed are not copied at all. The adaptation
must follow the same run as with the adapters merged into full checkpoints (up to float32
rounding), in a fraction of the memory.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import tiny_models
import torch
import transformers

from mergekit_ext.adaptation import memory
from mergekit_ext.adaptation.parameters import SyMergeParameters
from mergekit_ext.adaptation.run import adapt_session, prepare_symerge
from mergekit_ext.config import parse_config
from mergekit_ext.errors import ModelInputError
from mergekit_ext.models.lora import LowRankUpdate

LLAMA_TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]


def _text(path: str, lines: int = 24) -> str:
    rng = random.Random(0)
    with open(path, "w", encoding="utf-8") as fp:
        fp.writelines(
            " ".join(rng.choice(tiny_models.WORDS) for _ in range(rng.randrange(3, 9))) + "\n"
            for _ in range(lines)
        )
    return path


def _config(base: str, experts: list[str], data: str, **top: str) -> str:
    lines = ["merge_method: symerge", f"base_model: {base}"]
    lines += [f"{k}: {v}" for k, v in top.items()]
    lines.append(f"calibration: {{path: {data}, samples: 24, max_length: 12, batch_size: 8}}")
    lines.append("models:")
    for name, expert in zip(("one", "two"), experts):
        lines += [f"  - model: {expert}", f"    name: {name}"]
    return "\n".join(lines) + "\n"


def _session(base, experts, data, **parameters):
    params = SyMergeParameters(**{"epochs": 3, "batch_size": 8, "lr": 0.05, **parameters})
    return prepare_symerge(parse_config(_config(base, experts, data)), params)


@pytest.fixture(scope="module")
def llama_lora(tmp_path_factory):
    root = tmp_path_factory.mktemp("symerge_lora")
    base = tiny_models.make_tiny_llama(str(root / "base"), seed=0)
    adapters, full = tiny_models.make_lora_experts(
        base, str(root), transformers.LlamaForCausalLM, LLAMA_TARGETS
    )
    return base, adapters, full, _text(str(root / "text.txt"))


def test_lora_experts_follow_their_merged_checkpoints(llama_lora) -> None:
    base, adapters, full, data = llama_lora
    lora_session = _session(base, adapters, data)
    full_session = _session(base, full, data)
    lora, dense = lora_session.problem, full_session.problem
    assert lora.shared_keys == dense.shared_keys
    for k in range(2):  # the teachers are the same experts
        for name, value in dense.expert_parameters(k).items():
            torch.testing.assert_close(lora.expert_parameters(k)[name], value, rtol=0, atol=1e-6)
    lora_section = adapt_session(lora_session, progress=False)
    full_section = adapt_session(full_session, progress=False)
    assert lora_section["loss"] == pytest.approx(full_section["loss"], rel=1e-3, abs=1e-6)
    torch.testing.assert_close(lora.lambdas.detach(), dense.lambdas.detach(), rtol=0, atol=1e-5)
    merged_lora, merged_full = lora.merged_tensors(), dense.merged_tensors()
    for key in lora.shared_keys:
        torch.testing.assert_close(merged_lora[key], merged_full[key], rtol=0, atol=1e-6)


def test_lora_task_vectors_are_factors_and_unchanged_tensors_are_not_copied(llama_lora) -> None:
    base, adapters, full, data = llama_lora
    problem = _session(base, adapters, data).problem
    adapted = [k for k in problem.shared_keys if any(t in k for t in LLAMA_TARGETS)]
    assert adapted
    for key in problem.shared_keys:
        vectors = problem.task_vectors[key]
        if key in adapted:
            assert vectors.stack is None
            assert all(isinstance(u, LowRankUpdate) for u in vectors.updates), key
            assert vectors.numel == sum(4 * sum(vectors.shape) for _ in range(2))  # r = 4
        else:  # embeddings, norms, the untargeted projections
            assert vectors.is_zero, key
            merged = problem.merged_tensors()[key]
            assert merged is problem.base_tensors[key]  # θ_0 itself, no copy
    # the same experts merged into full checkpoints: dense, except what LoRA left exactly alone
    dense = _session(base, full, data).problem
    assert {k for k in dense.shared_keys if not dense.task_vectors[k].is_zero} == set(adapted)


def test_memory_estimate_counts_the_factors(llama_lora) -> None:
    base, adapters, full, data = llama_lora
    lora = _session(base, adapters, data).estimate.parts
    dense = _session(base, full, data).estimate.parts
    config = transformers.AutoConfig.from_pretrained(base)
    model = transformers.LlamaForCausalLM(config)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    targeted = [s for n, s in shapes.items() if any(f".{t}." in n for t in LLAMA_TARGETS)]
    assert lora["task_vectors"] == memory.FLOAT32 * 2 * sum(4 * (o + i) for o, i in targeted)
    assert lora["merged_copy_and_gradient"] == 0  # the layers add B (A x): nothing is formed
    total = memory.checkpoint_parameter_count(base)
    assert dense["task_vectors"] == memory.FLOAT32 * 2 * total
    assert lora["task_vectors"] < dense["task_vectors"] / 4


def test_lora_classifier_saved_whole_is_the_task_layer(tmp_path) -> None:
    """BERT classifiers fine-tuned with LoRA save their head whole (modules_to_save): the
    head is the task layer, the body's query/value updates stay factors."""
    base = tiny_models.make_tiny_bert(str(tmp_path / "base"), seed=0, num_labels=3)
    adapters, full = tiny_models.make_lora_experts(
        base,
        str(tmp_path),
        transformers.BertForSequenceClassification,
        ["query", "value"],
        modules_to_save=["classifier"],
    )
    data = _text(str(tmp_path / "text.txt"))
    lora = _session(base, adapters, data).problem
    dense = _session(base, full, data).problem
    for k in range(2):
        assert sorted(lora.tasks[k].layer) == ["classifier.bias", "classifier.weight"]
        for name, value in dense.tasks[k].layer_init.items():
            assert torch.equal(lora.tasks[k].layer_init[name], value)
    query = next(k for k in lora.shared_keys if k.endswith("query.weight"))
    assert all(isinstance(u, LowRankUpdate) for u in lora.task_vectors[query].updates)
    for k in range(2):
        torch.testing.assert_close(
            lora.task_vectors[query].task(k), dense.task_vectors[query].task(k), rtol=0, atol=1e-6
        )


def test_adapter_on_another_base_is_refused(llama_lora, tmp_path) -> None:
    base, adapters, _, data = llama_lora
    other = tiny_models.make_tiny_llama(str(tmp_path / "other"), seed=1)
    with pytest.raises(ModelInputError, match="not on base_model"):
        _session(other, adapters, data)
    with pytest.raises(ModelInputError, match="base_model .* must be a full checkpoint"):
        _session(adapters[0], [adapters[1], adapters[1]], data)


def test_dora_adapter_is_refused_before_loading(llama_lora, tmp_path, monkeypatch) -> None:
    base, adapters, _, data = llama_lora
    dora = str(tmp_path / "dora")
    os.makedirs(dora)
    for name in os.listdir(adapters[0]):
        with open(os.path.join(adapters[0], name), "rb") as src:
            payload = src.read()
        with open(os.path.join(dora, name), "wb") as dst:
            dst.write(payload)
    config_path = os.path.join(dora, "adapter_config.json")
    with open(config_path, encoding="utf-8") as fp:
        config = json.load(fp)
    config["use_dora"] = True
    with open(config_path, "w", encoding="utf-8") as fp:
        json.dump(config, fp)

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the adapter was checked")

    monkeypatch.setattr(transformers.LlamaForCausalLM, "from_pretrained", no_loading)
    with pytest.raises(ModelInputError, match="DoRA"):
        _session(base, [dora, adapters[1]], data)


def test_factored_layers_equal_the_formed_merged_weights(llama_lora) -> None:
    """The layers that add ``Σ λ_k s_k B_k (A_k x)`` to ``θ_0 x`` give the outputs and the
    λ-gradients of the model run on the formed weights ``θ_0 + Σ λ_k Δ_k``."""
    base, adapters, full, data = llama_lora
    session = _session(base, adapters, data)
    problem = session.problem
    assert set(problem.factored_keys) == {
        k for k in problem.shared_keys if any(t in k for t in LLAMA_TARGETS)
    }
    assert not _session(base, full, data).problem.factored_keys  # full checkpoints: dense
    with torch.no_grad():
        problem.lambdas.uniform_(0.0, 1.0, generator=torch.Generator().manual_seed(0))
    batch = {key: v[:4] for key, v in session.data[0].inputs.items()}
    outputs, grads = [], []
    for merged in (None, problem.merged_tensors()):  # factored, then formed
        problem.lambdas.grad = None
        logits = problem.forward(0, batch, merged).logits
        (logits.square().mean()).backward()
        outputs.append(logits.detach())
        grads.append(problem.lambdas.grad.clone())
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-7)
    assert grads[0][list(problem.factored_keys.values())].abs().sum() > 0
