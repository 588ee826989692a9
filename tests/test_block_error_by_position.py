"""benchmarks/probes/block_error_by_position.py: the split of a block's error by position."""

import json

import pytest
import torch
import transformers

from benchmarks.probes.block_error_by_position import main
from mergekit_ext.testing import make_tiny_llama

TEXTS = ["the cat sat on the mat", "a b c d e f g", "hello there world again"]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("position")
    a = make_tiny_llama(str(root / "a"), seed=0)
    b = make_tiny_llama(str(root / "b"), seed=1)
    texts = root / "t.jsonl"
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return a, b, str(texts)


def test_a_model_against_itself_has_no_error(pair):
    a, _, texts = pair
    rows = main([a, "--expert", f"t={a}", "--texts", f"t={texts}"])["blocks"]
    assert len(rows) == 2
    assert all(r["error"] == 0.0 and r["first"] == 0.0 and r["rest"] == 0.0 for r in rows)


def test_the_split_adds_up_to_the_whole_sequence_error(pair, tmp_path):
    a, b, texts = pair
    out = tmp_path / "r.json"
    rows = main([b, "--expert", f"t={a}", "--texts", f"t={texts}", "--json", str(out)])["blocks"]
    assert json.loads(out.read_text())["blocks"] == rows
    tok = transformers.AutoTokenizer.from_pretrained(a)
    models = [transformers.AutoModelForCausalLM.from_pretrained(p).eval() for p in (b, a)]
    err = [0.0, 0.0]
    ref = [0.0, 0.0]
    first_err = first_ref = 0.0
    for text in TEXTS:
        ids = tok(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            hm, he = (m(input_ids=ids, output_hidden_states=True).hidden_states for m in models)
        for block in range(2):
            m, e = hm[block + 1][0].double(), he[block + 1][0].double()
            err[block] += float((m - e).pow(2).sum())
            ref[block] += float(e.pow(2).sum())
            if block == 1:
                first_err += float((m[0] - e[0]).pow(2).sum())
                first_ref += float(e[0].pow(2).sum())
    for block in range(2):
        assert rows[block]["error"] == pytest.approx(err[block] / ref[block], rel=1e-9)
        assert 0.0 < rows[block]["first_share_h"] < 1.0
        assert 0.0 < rows[block]["first_share_error"] < 1.0
    assert rows[1]["first"] == pytest.approx(first_err / first_ref, rel=1e-9)
    assert rows[1]["first_share_h"] == pytest.approx(first_ref / ref[1], rel=1e-9)


def test_names_must_pair_up(pair):
    a, _, texts = pair
    with pytest.raises(SystemExit, match="differ"):
        main([a, "--expert", f"x={a}", "--texts", f"t={texts}"])
    with pytest.raises(SystemExit, match="TASK=PATH"):
        main([a, "--expert", a, "--texts", f"t={texts}"])
