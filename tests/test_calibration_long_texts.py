"""A long single-line calibration text is truncated before it is tokenized (issue #49.10):
the rows are those of tokenizing the whole text, and the memory is that of a prefix."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import transformers
from test_safety import _env
from tokenizers import ByteLevelBPETokenizer

from mergekit_ext.calibration.config import CalibrationSpec
from mergekit_ext.calibration.sources import text
from mergekit_ext.testing import WORDS, _tokenizer

EXTRA = ["é", "日本語", "  ", "\n", "12345", "!!", "\t"]


def _byte_level() -> transformers.PreTrainedTokenizerFast:
    rng = random.Random(0)
    bpe = ByteLevelBPETokenizer()
    corpus = [" ".join(rng.choices(WORDS + EXTRA, k=200)) for _ in range(100)]
    bpe.train_from_iterator(corpus, vocab_size=400)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)


def _texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    words = WORDS + EXTRA
    return [" ".join(rng.choices(words, k=n)) for n in (5, 300, 3000, 40_000)] + [
        "x" * 50_000,
        " " * 30_000 + "dog cat " * 5000,
        "日本語" * 20_000,
    ]


@pytest.mark.parametrize("kind", ["llama", "bert", "byte_level"])
@pytest.mark.parametrize("max_length", [1, 32, 256])
@pytest.mark.parametrize("chat", [False, True])
def test_rows_are_those_of_the_whole_text(kind, max_length, chat):
    tokenizer = _byte_level() if kind == "byte_level" else _tokenizer(kind)
    if chat:
        tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    spec = CalibrationSpec(path="x.jsonl", max_length=max_length, apply_chat_template=chat)
    encode = text._text_encoder(tokenizer, spec, "t", "m")
    for item in _texts(max_length):
        given = [{"role": "user", "content": item}] if chat else item
        if chat:
            whole = tokenizer.apply_chat_template(given, tokenize=False)
            expected = tokenizer(
                whole, add_special_tokens=False, truncation=True, max_length=max_length
            )["input_ids"]
        else:
            expected = tokenizer(item, truncation=True, max_length=max_length)["input_ids"]
        assert encode(given) == list(expected), (kind, max_length, item[:40])


def test_short_texts_are_not_cut():
    tokenizer = _byte_level()
    short = " ".join(WORDS)
    assert text.enough_prefix(tokenizer, short, 32) is short
    long = short * 1000
    prefix = text.enough_prefix(tokenizer, long, 32)
    assert long.startswith(prefix) and len(prefix) < len(long)


PEAK = """
import random, resource, sys
sys.path.insert(0, {tests!r})
from test_calibration_long_texts import _byte_level
from mergekit_ext.calibration.config import CalibrationSpec
from mergekit_ext.calibration.sources import text
from mergekit_ext.testing import WORDS
tokenizer = _byte_level()
line = " ".join(random.Random(0).choices(WORDS, k=1_200_000))[:6_600_000]
encode = text._text_encoder(tokenizer, CalibrationSpec(path="x.jsonl", max_length=32), "t", "m")
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert len(encode(line)) == 32
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_a_6_mb_line_costs_no_memory_to_truncate():
    """Measured: tokenizing the whole 6.6 MB line rose the peak by about 1 GB."""
    tests = str(__import__("pathlib").Path(__file__).parent)
    proc = subprocess.run(
        [sys.executable, "-c", PEAK.format(tests=tests)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout.split()[-1]) < 100, proc.stdout
