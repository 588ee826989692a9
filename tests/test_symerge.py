"""SyMerge: a real (tiny) adaptation run, its outputs, its invariants and its errors.

A tiny BERT base and three experts fine-tuned here on separable token-presence tasks with
different heads (2, 3 and 2 labels); unlabeled adaptation sentences from each task.
"""

from __future__ import annotations

import json
import math
import os
import random

import pytest
import tiny_models
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file

from mergekit_ext.adaptation import memory
from mergekit_ext.adaptation.losses import (
    confidence_keep,
    hard_label_keep,
    kl_to_teacher,
    self_labelling_loss,
)
from mergekit_ext.adaptation.parameters import SyMergeParameters
from mergekit_ext.adaptation.run import (
    BLOCK_TASK_LAYER_LR,
    adapt_session,
    prepare_symerge,
    resolved_task_layer_lr,
    save_symerge,
    task_layers_are_lm_blocks,
)
from mergekit_ext.adaptation.symerge import run_symerge
from mergekit_ext.adaptation.trainer import (
    AdaptationSettings,
    adapt,
    output_tensor,
    select,
    split_heldout,
    stack_batches,
)
from mergekit_ext.config import parse_config
from mergekit_ext.errors import ConfigError, ModelInputError

TASKS = {"sentiment": ["good", "bad"], "animal": ["dog", "cat", "bird"], "weather": ["rain", "sun"]}
MARKERS = {w for labels in TASKS.values() for w in labels}
FILLER = [w for w in tiny_models.WORDS if w not in MARKERS]


def sentences(task: str, n: int, seed: int) -> tuple[list[str], torch.Tensor]:
    """Seven filler words and one label word of ``task`` at a random position."""
    rng = random.Random(seed)
    texts, labels = [], []
    for _ in range(n):
        y = rng.randrange(len(TASKS[task]))
        words = [rng.choice(FILLER) for _ in range(7)]
        words.insert(rng.randrange(8), TASKS[task][y])
        texts.append(" ".join(words))
        labels.append(y)
    return texts, torch.tensor(labels)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see conftest.py


@pytest.fixture(scope="module")
def problem_set(tmp_path_factory):
    """Base BertModel, three fine-tuned experts, a tokenizer and adaptation data files."""
    transformers.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("symerge")
    base = tiny_models.make_tiny_bert(str(root / "base"), seed=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    experts, data_files = {}, {}
    for i, (task, labels) in enumerate(TASKS.items()):
        torch.manual_seed(100 + i)
        model = transformers.BertForSequenceClassification.from_pretrained(
            base, num_labels=len(labels)
        )
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        texts, ys = sentences(task, 640, seed=i)
        enc = tokenizer(texts, padding=True, return_tensors="pt")
        model.train()
        for step in range(40):
            index = torch.arange(step * 32 % 640, step * 32 % 640 + 32)
            out = model(
                input_ids=enc["input_ids"][index],
                attention_mask=enc["attention_mask"][index],
                labels=ys[index],
            )
            optimizer.zero_grad()
            out.loss.backward()
            optimizer.step()
        model.eval()
        path = str(root / task)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        experts[task] = path
        texts, _ = sentences(task, 200, seed=900 + i)
        data_files[task] = str(root / f"{task}.jsonl")
        with open(data_files[task], "w", encoding="utf-8") as fp:
            fp.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return {
        "root": root,
        "base": base,
        "experts": experts,
        "data": data_files,
        "tokenizer": tokenizer,
    }


def make_config(ps, *, tasks=tuple(TASKS), experts=None, data=True, parameters=None):
    experts = experts or ps["experts"]
    lines = ["merge_method: symerge", f"base_model: {ps['base']}", "models:"]
    for task in tasks:
        lines += [f"  - model: {experts[task]}", f"    name: {task}"]
        if data:
            lines += [
                f"    calibration: {{path: {ps['data'][task]}, samples: 200, max_length: 16, batch_size: 64}}"
            ]
    return parse_config("\n".join(lines) + "\n"), SyMergeParameters.parse(parameters, "symerge")


MAIN_PARAMETERS = {"epochs": 30, "seed": 0, "heldout_fraction": 0.25}


@pytest.fixture(scope="module")
def main_run(problem_set, tmp_path_factory):
    """One adaptation run kept in memory (the session) and saved to disk."""
    cfg, params = make_config(problem_set, parameters=MAIN_PARAMETERS)
    session = prepare_symerge(cfg, params)
    section = adapt_session(session, progress=False)
    out = str(tmp_path_factory.mktemp("out") / "merged")
    os.makedirs(out)
    save_symerge(session, out)
    return session, section, out


def encode(ps, texts):
    enc = ps["tokenizer"](texts, padding=True, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


# ---------------------------------------------------------------------------- losses


def test_hard_label_filter_keeps_exactly_the_rule():
    # rows: agree; disagree + teacher more confident; disagree + teacher less confident;
    # disagree + equal confidence (kept: ">="); agree + teacher less confident (kept).
    teacher = torch.tensor([[2.0, 0.0], [3.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 0.5]])
    student = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 3.0], [0.0, 1.0], [0.0, 4.0]])
    keep = hard_label_keep(student, teacher)
    assert keep.tolist() == [True, True, False, True, True]
    loss, used = self_labelling_loss(student, teacher, "hard")
    expected = F.cross_entropy(student[[0, 1, 3, 4]], torch.tensor([0, 0, 0, 1]))
    assert used == 4 and torch.allclose(loss, expected)
    # nothing kept: a zero loss, not NaN
    loss, used = self_labelling_loss(student[[2]], teacher[[2]], "hard")
    assert used == 0 and float(loss) == 0.0


def test_confidence_top_p_and_soft_target():
    teacher = torch.tensor([[0.0, 0.1], [5.0, 0.0], [0.0, 2.0], [1.0, 0.0]])
    student = torch.tensor([[0.3, 0.0], [0.0, 0.2], [1.0, 1.0], [0.0, 0.0]])
    # teacher confidences: 0.525, 0.993, 0.881, 0.731 -> top half = rows 1, 2
    assert confidence_keep(teacher, 0.5).tolist() == [False, True, True, False]
    assert confidence_keep(teacher, 0.6).tolist() == [False, True, True, True]  # ceil(2.4)
    loss, used = self_labelling_loss(student, teacher, "soft", top_p=0.5)
    p = teacher[[1, 2]].softmax(-1)
    manual = (p * (p.log() - student[[1, 2]].log_softmax(-1))).sum(-1).mean()
    assert used == 2 and torch.allclose(loss, manual)
    assert torch.allclose(kl_to_teacher(teacher, teacher), torch.tensor(0.0), atol=1e-7)


def test_stack_batches_repads_and_split_is_seeded():
    batches = [
        {"input_ids": torch.tensor([[2, 7, 3]]), "attention_mask": torch.tensor([[1, 1, 1]])},
        {"input_ids": torch.tensor([[2, 3]]), "attention_mask": torch.tensor([[1, 1]])},
    ]
    stacked = stack_batches(batches, pad_token_id=9)
    assert stacked["input_ids"].tolist() == [[2, 7, 3], [2, 3, 9]]
    assert stacked["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    adapt_a, held_a = split_heldout(20, 0.25, torch.Generator().manual_seed(4))
    adapt_b, held_b = split_heldout(20, 0.25, torch.Generator().manual_seed(4))
    assert len(held_a) == 5 and torch.equal(held_a, held_b) and torch.equal(adapt_a, adapt_b)
    assert sorted(adapt_a.tolist() + held_a.tolist()) == list(range(20))
    assert len(split_heldout(2, 0.01, torch.Generator())[1]) == 1  # at least one held out


# ---------------------------------------------------------------------------- the run


def _task_arithmetic_model(ps, task, init_lambda=0.3):
    """θ_0 + init_lambda · Σ_k Δ_k built by hand, with ``task``'s own expert head."""
    base = load_file(os.path.join(ps["base"], "model.safetensors"))
    experts = {t: load_file(os.path.join(p, "model.safetensors")) for t, p in ps["experts"].items()}
    model = transformers.BertForSequenceClassification.from_pretrained(ps["experts"][task]).eval()
    state = model.state_dict()
    for key, theta0 in base.items():
        name = "bert." + key
        if name in state:
            state[name] = theta0 + init_lambda * sum(e[name] - theta0 for e in experts.values())
    model.load_state_dict(state)
    return model


def _agreement(model, expert, batch):
    with torch.no_grad():
        return float(
            (model(**batch).logits.argmax(-1) == expert(**batch).logits.argmax(-1)).float().mean()
        )


def test_adaptation_beats_task_arithmetic(problem_set, main_run):
    session, section, out = main_run
    k, p = len(TASKS), len(section["lambda_tensors"])
    assert section["tasks"] == list(TASKS)
    assert len(section["loss"]) == MAIN_PARAMETERS["epochs"] * k
    assert len(section["lambda"]) == k and all(len(row) == p for row in section["lambda"])
    assert all(0.0 <= v <= 1.0 for row in section["lambda"] for v in row)
    assert section["samples"]["animal"] == {"adaptation": 150, "heldout": 50}
    for task in TASKS:
        assert section["heldout_accuracy"][task] > section["task_arithmetic_heldout_accuracy"][task]
        assert section["heldout_accuracy"][task] >= 0.9
    # Independently: fresh sentences, the saved task checkpoints against task arithmetic
    # built by hand from the safetensors files, both scored against the experts.
    for i, task in enumerate(TASKS):
        texts, _ = sentences(task, 200, seed=5000 + i)
        batch = encode(problem_set, texts)
        expert = transformers.BertForSequenceClassification.from_pretrained(
            problem_set["experts"][task]
        ).eval()
        adapted = transformers.AutoModelForSequenceClassification.from_pretrained(
            os.path.join(out, "tasks", task)
        ).eval()
        ta = _task_arithmetic_model(problem_set, task)
        assert _agreement(adapted, expert, batch) > _agreement(ta, expert, batch) + 0.2, task


def test_saved_checkpoints_reproduce_in_memory_predictions(problem_set, main_run):
    session, _, out = main_run
    problem = session.problem
    texts, _ = sentences("animal", 40, seed=77)
    batch = encode(problem_set, texts)
    merged = problem.merged_tensors()
    for k, task in enumerate(problem.tasks):
        with torch.no_grad():
            in_memory = output_tensor(problem.forward(k, batch, merged))
        reloaded = transformers.AutoModelForSequenceClassification.from_pretrained(
            os.path.join(out, "tasks", task.name)
        ).eval()
        assert type(reloaded).__name__ == "BertForSequenceClassification"
        with torch.no_grad():
            assert torch.equal(reloaded(**batch).logits, in_memory), task.name
        for name in ("tokenizer.json", "tokenizer_config.json"):
            assert os.path.exists(os.path.join(out, "tasks", task.name, name))
    # The merged body: the base's class with λ baked in.
    body = transformers.AutoModel.from_pretrained(out)
    assert type(body).__name__ == "BertModel"
    expected = problem.base_checkpoint_tensors()
    for name, param in body.named_parameters():
        assert torch.equal(param.detach(), expected[name]), name
    key = "encoder.layer.0.attention.self.query.weight"
    p = problem.shared_keys.index(key)
    manual = problem.base_tensors[key] + sum(
        problem.lambdas[p, k].detach() * problem.task_vectors[key].task(k) for k in range(3)
    )
    assert torch.allclose(expected[key], manual, atol=1e-6)
    assert os.path.exists(os.path.join(out, "tokenizer.json"))


def test_peft_adapter_variant_reproduces_predictions(problem_set, tmp_path):
    from peft import PeftModel

    cfg, params = make_config(problem_set, parameters={"epochs": 3, "seed": 1})
    session = prepare_symerge(cfg, params)
    adapt_session(session, progress=False)
    out = str(tmp_path / "merged")
    os.makedirs(out)
    save_symerge(session, out, task_layers_only=True)
    texts, _ = sentences("weather", 30, seed=78)
    batch = encode(problem_set, texts)
    for k, task in enumerate(session.problem.tasks):
        folder = os.path.join(out, "tasks", task.name)
        assert sorted(os.listdir(folder)) == [
            "adapter_config.json",
            "adapter_model.safetensors",
            "config.json",
        ]
        with torch.no_grad():
            in_memory = output_tensor(session.problem.forward(k, batch))
        config = transformers.AutoConfig.from_pretrained(folder)
        model = transformers.AutoModelForSequenceClassification.from_pretrained(out, config=config)
        model = PeftModel.from_pretrained(model, folder).eval()
        with torch.no_grad():
            assert torch.equal(model(**batch).logits, in_memory), task.name


def test_peft_adapter_names_the_merged_body_for_auto_peft_model(problem_set, tmp_path):
    from peft import AutoPeftModelForSequenceClassification

    cfg, params = make_config(problem_set, parameters={"epochs": 3, "seed": 0})
    session = prepare_symerge(cfg, params)
    adapt_session(session, progress=False)
    out = str(tmp_path / "merged")
    os.makedirs(out)
    save_symerge(session, out, task_layers_only=True)
    batch = encode(problem_set, sentences("animal", 20, seed=80)[0])
    for k, task in enumerate(session.problem.tasks):
        folder = os.path.join(out, "tasks", task.name)
        with open(os.path.join(folder, "adapter_config.json"), encoding="utf-8") as fp:
            assert json.load(fp)["base_model_name_or_path"] == out  # not the expert's path
        with torch.no_grad():
            in_memory = output_tensor(session.problem.forward(k, batch))
        # the body's config has the base's 2 labels; a task with another count says so
        labels = transformers.AutoConfig.from_pretrained(folder).num_labels
        model = AutoPeftModelForSequenceClassification.from_pretrained(
            folder, num_labels=labels
        ).eval()
        with torch.no_grad():
            assert torch.equal(model(**batch).logits, in_memory), task.name


def test_run_adapters_name_the_output_folder_and_chat_template_is_written(
    problem_set, tmp_path, monkeypatch
):
    import mergekit_ext

    cfg, _ = make_config(problem_set, parameters={"epochs": 1, "seed": 0})
    cfg = parse_config(cfg.source_text + "chat_template: chatml\n")
    monkeypatch.chdir(tmp_path)
    mergekit_ext.run_merge(
        cfg,
        "merged",
        {"write_model_card": False},
        mergekit_ext.RunOptions(task_layers_only=True),
    )
    for task in TASKS:
        with open(os.path.join("merged", "tasks", task, "adapter_config.json")) as fp:
            assert json.load(fp)["base_model_name_or_path"] == "merged"
    assert "<|im_start|>" in transformers.AutoTokenizer.from_pretrained("merged").chat_template


def test_same_seed_gives_identical_bytes(problem_set, tmp_path):
    outputs = []
    for run in ("a", "b"):
        cfg, params = make_config(problem_set, parameters={"epochs": 3, "seed": 7})
        out = str(tmp_path / run)
        os.makedirs(out)
        record = run_symerge(cfg, out, params)
        files = {}
        for folder, _, names in os.walk(out):
            for name in names:
                path = os.path.join(folder, name)
                with open(path, "rb") as fp:
                    files[os.path.relpath(path, out)] = fp.read()
        outputs.append((files, record))
    (files_a, record_a), (files_b, record_b) = outputs
    section_a, section_b = record_a.diagnostics, record_b.diagnostics
    assert "tasks/animal/model.safetensors" in files_a and "model.safetensors" in files_a
    assert files_a == files_b
    assert section_a["loss"] == section_b["loss"] and section_a["lambda"] == section_b["lambda"]
    assert record_a.calibration["animal"]["samples"] == 200


def test_invariants_during_adaptation(problem_set):
    cfg, params = make_config(problem_set, parameters={"seed": 3})
    session = prepare_symerge(cfg, params)
    problem, data = session.problem, session.data
    base = load_file(os.path.join(problem_set["base"], "model.safetensors"))
    for k, task in enumerate(TASKS):
        expert = load_file(os.path.join(problem_set["experts"][task], "model.safetensors"))
        layer = problem.tasks[k].layer
        assert sorted(layer) == ["classifier.bias", "classifier.weight"]
        for name, param in layer.items():  # the task layer starts as the expert's head
            assert torch.equal(param.detach(), expert[name])
        key = "encoder.layer.1.output.dense.weight"  # task vectors are W_k - W_0
        assert torch.allclose(problem.task_vectors[key].task(k), expert["bert." + key] - base[key])
    frozen = {
        "theta0": {k: v.clone() for k, v in problem.base_tensors.items()},
        "deltas": {k: v.stack.clone() for k, v in problem.task_vectors.items()},
    }
    heads = [{n: p.detach().clone() for n, p in t.layer.items()} for t in problem.tasks]
    settings = AdaptationSettings(epochs=4, lr=0.5, seed=3)  # a large lr pushes λ to the box
    adapt(problem, data, settings, progress=False)
    lam = problem.lambdas.detach()
    assert lam.min() >= 0.0 and lam.max() <= 1.0
    assert bool(((lam == 0.0) | (lam == 1.0)).any())  # the clamp was active
    for key, value in frozen["theta0"].items():
        assert torch.equal(problem.base_tensors[key], value)
    for key, value in frozen["deltas"].items():
        assert torch.equal(problem.task_vectors[key].stack, value)
    for task, before in zip(problem.tasks, heads):
        assert any(not torch.equal(task.layer[n].detach(), before[n]) for n in before)
    # without the clamp the same steps leave the box
    adapt(problem, data, AdaptationSettings(epochs=4, lr=0.5, seed=3, clamp=False), progress=False)
    lam = problem.lambdas.detach()
    assert lam.min() < 0.0 or lam.max() > 1.0
    # per-batch teacher (no cache) reproduces the cached teacher outputs
    d = data[0]
    index = d.adapt_index[:8]
    batch = select(d.inputs, index)
    with torch.no_grad():
        recomputed = output_tensor(problem.teacher_forward(0, batch))
    assert torch.allclose(recomputed, d.teacher[index], atol=1e-5)


# ---------------------------------------------------------------------------- causal LM


def test_task_layer_lr_is_its_own_adam_group(problem_set):
    from mergekit_ext.adaptation.trainer import optimizer_groups

    cfg, params = make_config(problem_set, parameters={"seed": 3, "task_layer_lr": 1e-4})
    session = prepare_symerge(cfg, params)
    problem, data = session.problem, session.data
    assert resolved_task_layer_lr(session.parameters, problem) == 1e-4  # given
    heads_default = make_config(problem_set, parameters={"seed": 3})[1]

    assert not task_layers_are_lm_blocks(problem)  # classification heads
    assert resolved_task_layer_lr(SyMergeParameters.model_validate(heads_default), problem) == 1e-2
    groups = optimizer_groups(problem, AdaptationSettings(lr=0.5, task_layer_lr=1e-30))
    assert [g["lr"] for g in groups] == [0.5, 1e-30]
    assert groups[0]["params"] == [problem.lambdas]
    assert len(groups[1]["params"]) == sum(len(t.layer) for t in problem.tasks)
    assert [g["lr"] for g in optimizer_groups(problem, AdaptationSettings(lr=0.5))] == [0.5, 0.5]
    heads = [{n: p.detach().clone() for n, p in t.layer.items()} for t in problem.tasks]
    lambdas = problem.lambdas.detach().clone()
    adapt(
        problem,
        data,
        AdaptationSettings(epochs=2, lr=0.5, task_layer_lr=1e-30, seed=3),
        progress=False,
    )
    assert not torch.equal(problem.lambdas.detach(), lambdas)  # λ moved at lr 0.5 ...
    for task, before in zip(problem.tasks, heads):  # ... the heads did not at lr 1e-30
        for name, value in before.items():
            torch.testing.assert_close(task.layer[name].detach(), value, rtol=0, atol=1e-20)


def test_causal_lm_uses_last_block_and_kl(tmp_path):
    base = tiny_models.make_tiny_llama(str(tmp_path / "base"), seed=0)
    experts = tiny_models.make_experts(base, [str(tmp_path / "e0"), str(tmp_path / "e1")])
    data = str(tmp_path / "text.txt")
    rng = random.Random(0)
    with open(data, "w", encoding="utf-8") as fp:
        fp.writelines(
            " ".join(rng.choice(FILLER) for _ in range(rng.randrange(3, 9))) + "\n"
            for _ in range(40)
        )
    text = (
        f"merge_method: symerge\nbase_model: {base}\n"
        f"calibration: {{path: {data}, samples: 40, max_length: 12, batch_size: 8}}\n"
        f"models:\n  - model: {experts[0]}\n    name: one\n  - model: {experts[1]}\n    name: two\n"
    )
    session = prepare_symerge(parse_config(text), SyMergeParameters(epochs=3, batch_size=8))
    section = adapt_session(session, progress=False)
    assert section["output_kinds"] == {"one": "causal_lm", "two": "causal_lm"}
    assert section["task_layers"] == {"one": ["model.layers.1"], "two": ["model.layers.1"]}
    assert section["settings"]["task_layer_lr"] == BLOCK_TASK_LAYER_LR  # a block, not a head
    assert not any(k.startswith("layers.1.") for k in section["lambda_tensors"])
    assert all(math.isfinite(v) and v >= 0 for v in section["loss"])
    out = str(tmp_path / "out")
    os.makedirs(out)
    save_symerge(session, out)
    batch = select(session.data[1].inputs, torch.arange(4))
    with torch.no_grad():
        in_memory = output_tensor(session.problem.forward(1, batch))
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.join(out, "tasks", "two")
        )
        assert torch.equal(reloaded(**batch).logits, in_memory)
    # the shared body's last block: task arithmetic at init_lambda over the experts' blocks
    w = [load_file(os.path.join(p, "model.safetensors")) for p in (base, *experts)]
    merged = load_file(os.path.join(out, "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    expected = w[0][name] + 0.3 * ((w[1][name] - w[0][name]) + (w[2][name] - w[0][name]))
    assert torch.allclose(merged[name], expected, atol=1e-6)


# ---------------------------------------------------------------------------- bad input


def test_expert_with_another_body_shape_is_refused(problem_set, tmp_path):
    config = transformers.BertConfig(
        vocab_size=tiny_models.VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        num_labels=2,
    )
    odd = str(tmp_path / "odd")
    transformers.BertForSequenceClassification(config).save_pretrained(odd)
    problem_set["tokenizer"].save_pretrained(odd)
    experts = dict(problem_set["experts"], weather=odd)
    cfg, params = make_config(problem_set, experts=experts)
    with pytest.raises(
        ModelInputError, match=r"intermediate\.dense\.weight.*\[48, 32\].*\[64, 32\]"
    ):
        prepare_symerge(cfg, params)


def test_task_without_data_is_refused(problem_set):
    cfg, params = make_config(problem_set, data=False)
    with pytest.raises(ConfigError, match="symerge needs calibration data: add a `calibration:`"):
        prepare_symerge(cfg, params)


def test_unknown_task_layer_lists_candidates(problem_set):
    cfg, params = make_config(problem_set, parameters={"task_layer": "encoder.layer.7"})
    with pytest.raises(ConfigError) as error:
        prepare_symerge(cfg, params)
    message = str(error.value)
    assert "'encoder.layer.7'" in message and "sentiment" in message
    for candidate in ("head", "last_block", "classifier", "bert.encoder.layer.1"):
        assert candidate in message


def test_module_name_task_layer_as_peft_adapter(problem_set, tmp_path):
    from peft import PeftModel

    cfg, params = make_config(
        problem_set, tasks=("animal",), parameters={"task_layer": "encoder.layer.1", "epochs": 2}
    )
    session = prepare_symerge(cfg, params)
    task = session.problem.tasks[0]
    assert task.roles.task_layer_modules == ["bert.encoder.layer.1"]
    assert sorted(task.roles.frozen) == ["classifier.bias", "classifier.weight"]  # own head
    assert not any(k.startswith("encoder.layer.1.") for k in session.problem.shared_keys)
    adapt_session(session, progress=False)
    out = str(tmp_path / "merged")
    os.makedirs(out)
    save_symerge(session, out, task_layers_only=True)
    folder = os.path.join(out, "tasks", "animal")
    with open(os.path.join(folder, "adapter_config.json"), encoding="utf-8") as fp:
        assert json.load(fp)["modules_to_save"] == ["bert.encoder.layer.1", "classifier"]
    batch = encode(problem_set, sentences("animal", 20, seed=79)[0])
    config = transformers.AutoConfig.from_pretrained(folder)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out, config=config)
    model = PeftModel.from_pretrained(model, folder).eval()
    with torch.no_grad():
        in_memory = output_tensor(session.problem.forward(0, batch))
        assert torch.equal(model(**batch).logits, in_memory)


def test_memory_estimate_refusal(problem_set, monkeypatch):
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device="cpu": 10_000)
    cfg, params = make_config(problem_set)
    with pytest.raises(memory.AdaptationMemoryError, match="--force"):
        prepare_symerge(cfg, params)
    estimate = memory.AdaptationMemory({"base": 20_000})
    memory.check_memory(estimate, 10_000, force=True, device="cpu")  # force: a warning only
    # the parameter-side terms follow the formula: (K + 3) copies of the base, float32
    est = memory.estimate_adaptation_memory(
        base_parameters=1000,
        expert_parameters=[1100, 1100],
        config={"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2},
        seq_len=4,
        batch_size=2,
        causal_lm=False,
        teacher_cache_bytes=0,
    )
    assert (
        est.parts["base"] + est.parts["task_vectors"] + est.parts["merged_copy_and_gradient"]
        == 4 * 5 * 1000
    )
    assert est.parts["task_layers_adam"] == 5 * 4 * 2 * 500  # max(1100 - 1000, 1000 // 2)
    assert est.parts["activations"] == 2 * 2 * (34 * 4 * 2 * 8 + 5 * 2 * 16 * 2)


def test_headless_experts_learn_dense_outputs_with_l1(tiny_bert_set, tmp_path):
    data = str(tmp_path / "text.txt")
    rng = random.Random(1)
    with open(data, "w", encoding="utf-8") as fp:
        fp.writelines(" ".join(rng.choice(FILLER) for _ in range(6)) + "\n" for _ in range(48))
    models = "".join(f"  - model: {e}\n" for e in tiny_bert_set.experts[:2])
    text = (
        f"merge_method: symerge\nbase_model: {tiny_bert_set.base}\n"
        f"calibration: {{path: {data}, samples: 48, max_length: 10}}\nmodels:\n{models}"
    )
    session = prepare_symerge(
        parse_config(text), SyMergeParameters(epochs=10, batch_size=16, heldout_fraction=0.25)
    )
    section = adapt_session(session, progress=False)
    tasks = section["tasks"]
    assert set(section["output_kinds"].values()) == {"dense"}
    assert all(section["task_layers"][t] == ["encoder.layer.1"] for t in tasks)  # no head
    assert all(section["heldout_accuracy"][t] is None for t in tasks)
    for t in tasks:
        assert section["heldout_l1"][t] < 0.8 * section["task_arithmetic_heldout_l1"][t]


# ---------------------------------------------------------------------------- data-aware body


def test_chain_of_merges_body_is_epoch_zero(problem_set, tmp_path):
    """body: chain_of_merges merges the body first; λ starts at 0, so before any step the
    adapted model's shared tensors are exactly that merge (as `mergekit-ext run` writes it),
    and the task vectors are W_k − W_body."""
    from mergekit.options import MergeOptions

    from mergekit_ext.adaptation.structure import canonical_key
    from mergekit_ext.executor import run_layerwise_merge
    from mergekit_ext.methods.registry import ext_method_info

    body_parameters = {"propagate": True, "max_norm_ratio": float("inf")}
    cfg, params = make_config(
        problem_set,
        parameters={"epochs": 2, "body": "chain_of_merges", "body_parameters": body_parameters},
    )
    session = prepare_symerge(cfg, params)
    problem = session.problem
    assert problem.init_lambda == 0.0 and float(problem.lambdas.detach().abs().max()) == 0.0

    com = ext_method_info("chain_of_merges")
    out = str(tmp_path / "com")
    run_layerwise_merge(cfg, out, MergeOptions(), com.implementation, body_parameters)
    written = transformers.AutoModel.from_pretrained(out)
    prefix = written.base_model_prefix + "."
    written_tensors = {canonical_key(n, ""): t for n, t in written.named_parameters()}
    merged = problem.merged_tensors()
    checked = 0
    for key, value in merged.items():
        reference = written_tensors.get(key, written_tensors.get(key.removeprefix(prefix)))
        assert reference is not None, key
        torch.testing.assert_close(value.detach(), reference, rtol=0, atol=0)
        checked += 1
    assert checked == len(problem.shared_keys) > 0
    # the task vectors point from the body to each expert
    key = next(k for k in problem.shared_keys if k.endswith("query.weight"))
    first = next(iter(problem.tasks))
    name = next(n for n, k in first.roles.shared.items() if k == key)
    expert = load_file(os.path.join(session.expert_paths[0], "model.safetensors"))
    torch.testing.assert_close(
        problem.task_vectors[key].task(0), expert[name] - merged[key].detach(), rtol=0, atol=1e-6
    )

    section = adapt_session(session, progress=False)
    assert section["body"] == "chain_of_merges" and section["settings"]["init_lambda"] == 0.0
    assert set(section["start_heldout_accuracy"]) == set(TASKS)
    assert all(math.isfinite(v) for v in section["loss"])


def test_task_arithmetic_body_keeps_its_start(problem_set):
    cfg, params = make_config(problem_set, parameters={"epochs": 1})
    assert params.body == "task_arithmetic" and params.init_lambda is None
    session = prepare_symerge(cfg, params)
    assert session.problem.init_lambda == 0.3
