"""Every class mergekit 0.1.5 ships a definition for, merged by mergekit and by mergekit-ext
(issue #48 item 3; docs/methods.md, Output completeness).

For each class of ``tests/tiny_definitions.py`` (mergekit's ``architectures`` lists, and
LLaVA from mergekit's own VLM tests), three tiny random checkpoints saved by
``save_pretrained`` are merged with ``ties`` (base + 2 experts, density 0.5):

- by mergekit alone, in a Python process that never imports mergekit_ext (what
  ``mergekit-yaml`` runs: ``mergekit.merge.run_merge``);
- by ``mergekit_ext.run_merge`` (what ``mergekit-ext run`` runs), whose completeness check
  asks transformers what it loads.

Where mergekit writes a checkpoint that transformers loads completely, mergekit-ext writes
the same bytes for every tensor, and its output loads with no missing key. The other
classes are listed in :data:`EXPECTED` with what happens and why; each entry is checked.
``test_both_real_clis_write_the_same_bytes`` runs the two real commands once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import tiny_definitions
import torch
import transformers
from safetensors import safe_open

import mergekit_ext
from mergekit_ext.errors import TensorError
from mergekit_ext.models import model_class
from mergekit_ext.models.model_paths import tensor_shapes

CLASSES = tiny_definitions.classes()

# mergekit's definition does not fit the checkpoint transformers 5 saves for the class's
# default config: mergekit raises while reading, and so does mergekit-ext (same message)
MERGEKIT_REFUSES = "mergekit-refuses"
# mergekit-ext describes the class by its checkpoint tensors (per expert); mergekit 0.1.5
# writes transformers 5's fused in-memory tensors. Both load completely; ties trims the
# fused [E, 2I, H] block as one tensor, so the numbers differ too
PER_EXPERT = "per-expert"
# mergekit's planner raises TypeError on its own BertModel definition (optional weight with
# aliases); mergekit-ext's repaired definition merges it
REPAIRED = "repaired"
# mergekit 0.1.5 writes a checkpoint transformers does not load completely (it would
# initialise the listed tensors randomly); mergekit-ext, describing the class by its
# checkpoint tensors, writes all of them: every tensor mergekit writes is in ours, under
# the same name, with the same bytes
OURS_COMPLETE = "ours-complete"

EXPECTED: dict[str, tuple[str, str]] = {
    "BertForMaskedLM": (MERGEKIT_REFUSES, "bert.pooler.dense.weight"),  # the class has none
    "CohereForCausalLM": (MERGEKIT_REFUSES, "self_attn.q_norm.weight"),  # use_qk_norm only
    "DistilBertModel": (MERGEKIT_REFUSES, "distilbert.embeddings"),  # saved without prefix
    "FalconForCausalLM": (MERGEKIT_REFUSES, "ln_attn.bias"),  # new_decoder_architecture only
    "Gemma3ForConditionalGeneration": (MERGEKIT_REFUSES, "patch_embedding.bias"),
    "GPTNeoXForCausalLM": (MERGEKIT_REFUSES, "attention.masked_bias"),  # a transformers-4 buffer
    "Qwen2VLForConditionalGeneration": (MERGEKIT_REFUSES, "Qwen2VLConfig"),
    "RobertaModel": (MERGEKIT_REFUSES, "roberta.embeddings"),  # saved without prefix
    "T5ForConditionalGeneration": (MERGEKIT_REFUSES, "wi_0.weight"),  # gated-gelu only
    "WhisperForConditionalGeneration": (MERGEKIT_REFUSES, "model.decoderembed_tokens"),  # typo
    "MixtralForCausalLM": (PER_EXPERT, "block_sparse_moe.experts.0.w1.weight"),
    "Qwen3MoeForCausalLM": (PER_EXPERT, "mlp.experts.0.gate_proj.weight"),
    "BertModel": (REPAIRED, "can only concatenate list"),
    # mergekit infers LLaVA's layout from transformers' in-memory names and converts the
    # checkpoint's with the model type's conversion mapping only, without the renames
    # transformers' from_pretrained adds (language_model.model. -> model.language_model.):
    # it writes the vision tower and projector, none of the language model. mergekit-ext
    # describes the class by its checkpoint tensors, under mergekit's (in-memory) names
    # with the checkpoint's as aliases (mergekit_definitions/checkpoint_layout.py; the
    # layer count taken from the layout: LlavaConfig has no num_hidden_layers)
    "LlavaForConditionalGeneration": (OURS_COMPLETE, "model.language_model.embed_tokens.weight"),
}

PLAIN_MERGE = """
import json, logging, sys
logging.disable(logging.WARNING)
import torch
torch.set_num_threads(1)
from mergekit.config import MergeConfiguration
from mergekit.merge import run_merge
from mergekit.options import MergeOptions
assert "mergekit_ext" not in sys.modules
jobs, result = json.load(open(sys.argv[1])), {}
for name, (config, out) in jobs.items():
    try:
        run_merge(MergeConfiguration.model_validate(config), out, MergeOptions(**OPTIONS))
        result[name] = None
    except Exception as e:
        result[name] = f"{type(e).__name__}: {e}"
json.dump(result, open(sys.argv[2], "w"))
"""
OPTIONS = {"random_seed": 0, "copy_tokenizer": False, "write_model_card": False, "quiet": True}


def merge_config(models: list[str]) -> dict:
    return {
        "merge_method": "ties",
        "base_model": models[0],
        "models": [{"model": m, "parameters": {"weight": 1.0, "density": 0.5}} for m in models[1:]],
        "dtype": "float32",
    }


def load_all(folder: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def assert_same_bytes(a: torch.Tensor, b: torch.Tensor, key: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, key
    assert (
        a.contiguous().view(-1).view(torch.uint8).equal(b.contiguous().view(-1).view(torch.uint8))
    ), key


def loading_info(folder: str, name: str) -> dict:
    _, info = getattr(transformers, name).from_pretrained(folder, output_loading_info=True)
    return info


def _selected(request) -> list[str]:
    """The classes this session runs (so that ``-k Llama`` merges one class, not all)."""
    names = set()
    for item in getattr(request.session, "items", []):
        callspec = getattr(item, "callspec", None)
        if item.module is sys.modules[__name__] and callspec and "name" in callspec.params:
            names.add(callspec.params["name"])
    return [n for n in CLASSES if n in names]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: see conftest.py


@pytest.fixture(scope="module")
def merged(request, tmp_path_factory) -> dict[str, tuple[list[str], str, str | None]]:
    """``{class: (checkpoints, mergekit's output folder, mergekit's error or None)}``,
    mergekit's merges run in one process that never imports mergekit_ext."""
    root = tmp_path_factory.mktemp("definitions")
    jobs, checkpoints = {}, {}
    for name in _selected(request):
        checkpoints[name] = [
            tiny_definitions.build(name, str(root / name / f"m{i}"), seed=i) for i in range(3)
        ]
        jobs[name] = (merge_config(checkpoints[name]), str(root / name / "mergekit"))
    with open(root / "jobs.json", "w") as fp:
        json.dump(jobs, fp)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # mergekit alone
    subprocess.run(
        [sys.executable, "-c", PLAIN_MERGE.replace("OPTIONS", repr(OPTIONS)),
         str(root / "jobs.json"), str(root / "result.json")],
        check=True, env=env, timeout=600,
    )  # fmt: skip
    with open(root / "result.json") as fp:
        errors = json.load(fp)
    return {n: (checkpoints[n], jobs[n][1], errors[n]) for n in jobs}


def test_every_definition_is_built() -> None:
    """Every class mergekit names is built here, except remote-code ones (listed)."""
    assert len(CLASSES) >= 50
    assert not set(EXPECTED) - set(CLASSES)
    assert all("remote code" in why for why in tiny_definitions.NOT_BUILT.values())
    assert {"BaichuanForCausalLM", "ChatGLMModel", "QWenLMHeadModel"} <= set(
        tiny_definitions.NOT_BUILT
    )


@pytest.mark.parametrize("name", CLASSES)
def test_ties_through_mergekit_and_mergekit_ext(name, merged, tmp_path) -> None:
    checkpoints, theirs, their_error = merged[name]
    kind, said = EXPECTED.get(name, (None, ""))
    ours = str(tmp_path / "out")
    try:
        mergekit_ext.run_merge(merge_config(checkpoints), ours, {"random_seed": 0})
        our_error = None
    except Exception as e:  # noqa: BLE001 - compared with mergekit's below
        our_error = f"{type(e).__name__}: {e}"

    if kind == MERGEKIT_REFUSES:
        assert their_error and said in their_error, their_error
        assert our_error and their_error.splitlines()[0] in our_error, our_error
        return
    if kind == REPAIRED:
        assert their_error and said in their_error, their_error
    else:
        assert their_error is None, their_error
    assert our_error is None, our_error
    info = loading_info(ours, name)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    if kind == OURS_COMPLETE:
        # transformers would initialise these randomly in mergekit's output
        assert said in loading_info(theirs, name)["missing_keys"]
        a, b = load_all(theirs), load_all(ours)
        assert set(a) < set(b) and said in set(b) - set(a)  # mergekit's names, and the rest
        for key in a:
            assert_same_bytes(a[key], b[key], key)
        return
    if kind == PER_EXPERT:
        assert tensor_shapes(ours) == tensor_shapes(checkpoints[0])  # the checkpoint's layout
        assert any(said in k for k in tensor_shapes(ours))
        assert not loading_info(theirs, name)["missing_keys"]  # both load completely
        return
    if kind == REPAIRED:
        assert tensor_shapes(ours) == tensor_shapes(checkpoints[0])
        return
    a, b = load_all(theirs), load_all(ours)
    assert set(a) == set(b)
    for key in a:
        assert_same_bytes(a[key], b[key], key)


def test_check_accepts_llava_in_its_in_memory_layout(tmp_path) -> None:
    """A complete LLaVA written under transformers 5's in-memory names (what mergekit names
    its tensors) loads completely: accepted, although the base checkpoint holds the
    ``language_model.model.`` names; without its language model it is refused, naming it."""
    from safetensors.torch import save_file

    base = tiny_definitions.build("LlavaForConditionalGeneration", str(tmp_path / "base"), 0)
    config = transformers.AutoConfig.from_pretrained(base)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(base)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert set(state) != set(tensor_shapes(base))  # the layouts do differ
    out = tmp_path / "out"
    out.mkdir()
    config.save_pretrained(out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    from mergekit_ext.models import completeness

    assert completeness.check_output_complete(str(out), ("base", base)) == len(state)
    report = model_class.load_report(config, tensor_shapes(str(out)))
    assert not report.missing and not report.unexpected and not report.mismatched
    vision = {k: v for k, v in state.items() if "language_model" not in k and k != "lm_head.weight"}
    save_file(vision, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(TensorError) as err:
        completeness.check_output_complete(str(out), ("base", base))
    assert "that LlavaForConditionalGeneration loads are missing: lm_head.weight" in str(err.value)
    assert "layout that" not in str(err.value)


def test_llava_with_tied_embeddings_merges_whole(tmp_path) -> None:
    """A tied LLaVA saves no head: the layout's head is optional (no alias), the rest is read
    through the checkpoint's names, and the output loads completely."""
    base = tiny_definitions.build("LlavaForConditionalGeneration", str(tmp_path / "b"), 0)
    config = transformers.AutoConfig.from_pretrained(base)
    config.tie_word_embeddings = config.text_config.tie_word_embeddings = True
    models = []
    for i in range(3):
        torch.manual_seed(i)
        models.append(str(tmp_path / f"m{i}"))
        transformers.LlavaForConditionalGeneration(config).save_pretrained(models[-1])
    assert not [k for k in tensor_shapes(models[0]) if "lm_head" in k]
    out = mergekit_ext.run_merge(merge_config(models), str(tmp_path / "out"), {"random_seed": 0})
    written = tensor_shapes(out)
    assert "model.language_model.embed_tokens.weight" in written and "lm_head.weight" not in written
    assert len(written) == len(tensor_shapes(models[0]))
    info = loading_info(out, "LlavaForConditionalGeneration")
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_both_real_clis_write_the_same_bytes(tmp_path) -> None:
    """``mergekit-yaml`` and ``mergekit-ext run`` themselves, on one class."""
    name = "LlamaForCausalLM"
    models = [tiny_definitions.build(name, str(tmp_path / f"m{i}"), seed=i) for i in range(3)]
    config = tmp_path / "ties.yml"
    config.write_text(json.dumps(merge_config(models)))  # JSON is YAML
    bin_dir = os.path.dirname(sys.executable)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run(
        [os.path.join(bin_dir, "mergekit-yaml"), str(config), str(tmp_path / "yaml"),
         "--random-seed", "0", "--no-copy-tokenizer"],
        check=True, env=env, timeout=300, capture_output=True,
    )  # fmt: skip
    subprocess.run(
        [sys.executable, "-m", "mergekit_ext", "run", str(config), str(tmp_path / "ext"),
         "--random-seed", "0"],
        check=True, timeout=300, capture_output=True,
    )  # fmt: skip
    a, b = load_all(str(tmp_path / "yaml")), load_all(str(tmp_path / "ext"))
    assert set(a) == set(b) and len(a) > 10
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert not loading_info(str(tmp_path / "ext"), name)["missing_keys"]
