"""mergekit-ext as a drop-in for mergekit: tokenizers of different vocabularies, chat
templates, slices, the public Python API, and mergekit's own executor meeting our methods.

Tokenizers are real: a BPE and a WordPiece tokenizer trained in the test on a small corpus,
with different vocabularies and sizes.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
import transformers
import yaml
from click.testing import CliRunner
from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions
from mergekit.scripts.run_yaml import main as mergekit_yaml
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import mergekit_ext
from mergekit_ext.cli import main
from mergekit_ext.errors import ConfigError
from mergekit_ext.testing import WORDS

SPECIALS = ["<pad>", "<unk>", "<s>", "</s>"]
TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"


def _corpus(seed: int, n: int = 400) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(n)]


def _bpe_tokenizer(vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.BPEDecoder()
    tok.train_from_iterator(
        _corpus(0), trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS)
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
    )


def _wordpiece_tokenizer(vocab_size: int) -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordPiece(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        _corpus(1), trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIALS)
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
    )


def _llama(path: str, tokenizer, seed: int, layers: int = 2, template: str | None = None) -> str:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer.get_vocab()),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    return path


def _expert(base: str, path: str, seed: int, tokenizer=None, template: str | None = None) -> str:
    """base + a seeded random task vector; with ``tokenizer``: embeddings resized to its vocabulary."""
    model = transformers.LlamaForCausalLM.from_pretrained(base)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    tok = tokenizer or transformers.AutoTokenizer.from_pretrained(base)
    if tokenizer is not None:
        model.resize_token_embeddings(len(tokenizer.get_vocab()), mean_resizing=False)
    model.save_pretrained(path)
    tok.chat_template = template
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def vocab_set(tmp_path_factory):
    """A base (BPE vocabulary), two experts sharing it, one expert with a WordPiece one."""
    transformers.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("dropin")
    bpe, wordpiece = _bpe_tokenizer(90), _wordpiece_tokenizer(110)
    assert bpe.get_vocab() != wordpiece.get_vocab()
    base = _llama(str(root / "base"), bpe, seed=0)
    same_a = _expert(base, str(root / "same_a"), seed=1, template=TEMPLATE)
    same_b = _expert(base, str(root / "same_b"), seed=2, template=TEMPLATE)
    other = _expert(base, str(root / "other"), seed=3, tokenizer=wordpiece)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in _corpus(5, 24)))
    return {
        "root": root,
        "base": base,
        "same": [same_a, same_b],
        "other": other,
        "data": str(data),
        "vocab": (len(bpe.get_vocab()), len(wordpiece.get_vocab())),
    }


def _write(path, config: dict) -> str:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


def _run(args):
    return CliRunner().invoke(main, args, catch_exceptions=False)


def _mergekit_yaml(args):
    return CliRunner().invoke(mergekit_yaml, args, catch_exceptions=False)


def _tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def assert_same_tensors(a, b) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype, name
        assert torch.equal(ta[name], tb[name]), name


def _com(vs, experts, **extra) -> dict:
    return {
        "merge_method": "chain_of_merges",
        "base_model": vs["base"],
        "models": [
            {"model": e, "calibration": {"path": vs["data"], "samples": 8, "max_length": 16}}
            for e in experts
        ],
        "dtype": "float32",
        **extra,
    }


# ------------------------------------------------------------------------------ item 1


def test_ties_union_of_different_vocabularies_matches_mergekit(vocab_set, tmp_path):
    vs = vocab_set
    config = _write(
        tmp_path / "ties.yml",
        {
            "merge_method": "ties",
            "base_model": vs["base"],
            "models": [
                {"model": vs["same"][0], "parameters": {"density": 0.5, "weight": 0.5}},
                {"model": vs["other"], "parameters": {"density": 0.5, "weight": 0.5}},
            ],
            "tokenizer_source": "union",
            "dtype": "float32",
        },
    )
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    result = _run(["run", config, str(ours), "--no-write-model-card", "--random-seed", "0"])
    assert result.exit_code == 0, result.output
    seeded = ["--no-write-model-card", "--random-seed", "0"]
    assert _mergekit_yaml([config, str(theirs), *seeded]).exit_code == 0
    # mergekit orders the union's added tokens as the Rust tokenizers' vocabulary maps list
    # them (a different order in each run), so embedding rows are compared token by token.
    ours_vocab = transformers.AutoTokenizer.from_pretrained(str(ours)).get_vocab()
    theirs_vocab = transformers.AutoTokenizer.from_pretrained(str(theirs)).get_vocab()
    assert set(ours_vocab) == set(theirs_vocab)
    assert len(ours_vocab) > max(vs["vocab"])  # the union of both vocabularies
    ta, tb = _tensors(ours), _tensors(theirs)
    assert sorted(ta) == sorted(tb)
    tokens = sorted(ours_vocab)
    rows_a = torch.tensor([ours_vocab[t] for t in tokens])
    rows_b = torch.tensor([theirs_vocab[t] for t in tokens])
    for name in ta:
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            assert ta[name].shape == (len(ours_vocab), 32)
            assert torch.equal(ta[name][rows_a], tb[name][rows_b]), name
        else:
            assert torch.equal(ta[name], tb[name]), name


def test_shape_check_still_guards_data_aware_methods(vocab_set, tmp_path):
    vs = vocab_set
    config = _write(tmp_path / "com.yml", _com(vs, [vs["same"][0], vs["other"]]))
    result = _run(["run", config, str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "embed_tokens.weight" in result.output and "must share shapes" in result.output
    assert not os.path.exists(tmp_path / "out")


# ------------------------------------------------------------------------------ item 2


def _template_of(folder) -> str | None:
    return transformers.AutoTokenizer.from_pretrained(str(folder)).chat_template


def test_named_chat_template_written_as_mergekit_writes_it(vocab_set, tmp_path):
    vs = vocab_set
    com = _write(tmp_path / "com.yml", _com(vs, vs["same"], chat_template="chatml"))
    ties = _write(
        tmp_path / "ties.yml",
        {
            "merge_method": "ties",
            "base_model": vs["base"],
            "models": [
                {"model": e, "parameters": {"density": 0.5, "weight": 0.5}} for e in vs["same"]
            ],
            "chat_template": "chatml",
            "dtype": "float32",
        },
    )
    assert _run(["run", com, str(tmp_path / "com"), "--no-write-model-card"]).exit_code == 0
    assert _mergekit_yaml([ties, str(tmp_path / "ties"), "--no-write-model-card"]).exit_code == 0
    expected = _template_of(tmp_path / "ties")
    assert expected and "<|im_start|>" in expected
    assert _template_of(tmp_path / "com") == expected
    assert _template_of(vs["base"]) is None  # it did not come from the base


def test_auto_chat_template_takes_the_experts_common_template(vocab_set, tmp_path):
    vs = vocab_set
    config = _write(tmp_path / "com.yml", _com(vs, vs["same"], chat_template="auto"))
    out = tmp_path / "out"
    assert _run(["run", config, str(out), "--no-write-model-card"]).exit_code == 0
    assert _template_of(out) == TEMPLATE.strip()
    # without chat_template the base's tokenizer files are copied byte for byte, as mergekit does
    plain = _write(tmp_path / "plain.yml", _com(vs, vs["same"]))
    assert _run(["run", plain, str(tmp_path / "plain"), "--no-write-model-card"]).exit_code == 0
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with (
            open(os.path.join(vs["base"], name), "rb") as a,
            open(tmp_path / "plain" / name, "rb") as b,
        ):
            assert a.read() == b.read(), name


def test_invalid_chat_template_refused_before_merging(vocab_set, tmp_path):
    vs = vocab_set
    config = _write(tmp_path / "com.yml", _com(vs, vs["same"], chat_template="nonsense"))
    result = _run(["run", config, str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "chat_template" in result.output and "chatml" in result.output
    assert not os.path.exists(tmp_path / "out")


def test_tokenizer_source_changing_vocabulary_refused_for_data_aware(vocab_set, tmp_path):
    vs = vocab_set
    # the experts' shapes agree with the base; only the tokenizer source changes the vocabulary
    cfg = _com(vs, vs["same"], tokenizer_source=vs["other"])
    config = _write(tmp_path / "com.yml", cfg)
    result = _run(["run", config, str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "changes the vocabulary" in result.output and "tensor-wise" in result.output
    assert not os.path.exists(tmp_path / "out")
    with pytest.raises(ConfigError, match="tokenizer.tokens is not supported"):
        mergekit_ext.run_merge(
            _com(vs, vs["same"], tokenizer={"source": "base", "tokens": {"<new>": {}}}),
            tmp_path / "out2",
        )


def test_tokenizer_source_with_one_shared_vocabulary_is_honoured(vocab_set, tmp_path):
    vs = vocab_set
    out = tmp_path / "out"
    mergekit_ext.run_merge(
        _com(vs, vs["same"], tokenizer_source="union", chat_template="chatml"),
        out,
        {"write_model_card": False},
    )
    written = transformers.AutoTokenizer.from_pretrained(str(out))
    assert written.get_vocab() == transformers.AutoTokenizer.from_pretrained(vs["base"]).get_vocab()
    assert "<|im_start|>" in written.chat_template


# ------------------------------------------------------------------------------ item 5


def test_slices_refused_by_data_aware_methods_with_a_clear_error(vocab_set, tmp_path):
    vs = vocab_set
    cfg = {
        "merge_method": "chain_of_merges",
        "base_model": vs["base"],
        "slices": [
            {
                "sources": [
                    {"model": vs["base"], "layer_range": [0, 2]},
                    {"model": vs["same"][0], "layer_range": [0, 2]},
                ]
            }
        ],
        "calibration": {"path": vs["data"]},
    }
    result = _run(["run", _write(tmp_path / "s.yml", cfg), str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "`slices:` is not supported by chain_of_merges" in result.output
    assert "needs at least one expert" not in result.output


# ------------------------------------------------------------------------------ item 6


def test_python_api_runs_every_data_aware_method_with_calibration(vocab_set, tmp_path):
    vs = vocab_set
    for method in ("regmean", "chain_of_merges", "qp_projection"):
        cfg = _com(vs, vs["same"])
        cfg["merge_method"] = method
        path = _write(tmp_path / f"{method}.yml", cfg)
        api_out = mergekit_ext.run_merge(path, tmp_path / f"api_{method}", {"random_seed": 0})
        assert api_out == str(tmp_path / f"api_{method}")
        cli_out = tmp_path / f"cli_{method}"
        assert _run(["run", path, str(cli_out), "--random-seed", "0"]).exit_code == 0
        assert_same_tensors(api_out, cli_out)
    # a dry run validates and writes nothing; its result holds the plan, no path (#32 item 15)
    dry = mergekit_ext.run_merge(
        _com(vs, vs["same"]),
        tmp_path / "dry",
        run_options=mergekit_ext.RunOptions(dry_run=True),
    )
    assert dry.path is None and "method: chain_of_merges" in dry.plan
    assert not os.path.exists(tmp_path / "dry")


@pytest.mark.parametrize("method", ["regmean", "chain_of_merges", "qp_projection", "symerge"])
def test_mergekit_executor_refuses_data_aware_methods_early(vocab_set, tmp_path, method):
    vs = vocab_set
    cfg = _com(vs, vs["same"])
    cfg["merge_method"] = method
    config = MergeConfiguration.model_validate(cfg)  # drops `calibration:`
    from mergekit.merge import run_merge

    out = tmp_path / "out"
    # a data-aware method is not in mergekit's registry (importing us adds only methods that
    # merge tensor groups, mergekit's contract): mergekit refuses it as unknown, while planning
    with pytest.raises(RuntimeError, match=f"Unimplemented merge method {method}"):
        run_merge(config, str(out), MergeOptions(write_model_card=False, quiet=True))
    assert not os.path.exists(out)  # refused while planning: nothing written
    # mergekit's MergeConfiguration holds no calibration: our API says what is missing
    # (mergekit's run_merge rewrote `config` in place, so a fresh one)
    with pytest.raises(ConfigError, match="needs calibration data"):
        mergekit_ext.run_merge(MergeConfiguration.model_validate(cfg), tmp_path / "api")
    assert not os.path.exists(tmp_path / "api")


def test_python_api_rejects_yaml_text_and_unknown_types(tmp_path):
    with pytest.raises(ConfigError, match="parse_config"):
        mergekit_ext.run_merge("merge_method: ties\nmodels: []\n", tmp_path / "out")
    with pytest.raises(ConfigError, match="not int"):
        mergekit_ext.run_merge(3, tmp_path / "out")
