"""Build a tiny random Llama base and three experts (base + seeded task vectors), offline.

    python examples/tiny/build_experts.py [OUT_ROOT]

Writes OUT_ROOT/{base,expert_a,expert_b,expert_c} (default examples/_build/tiny) and the
calibration texts OUT_ROOT/data/{a,b,c}.jsonl used by the data-aware example configs.
"""

from __future__ import annotations

import json
import os
import random
import sys

from mergekit_ext.testing import WORDS, make_experts, make_tiny_llama


def main(root: str) -> None:
    base = make_tiny_llama(os.path.join(root, "base"), seed=0, layers=4)
    make_experts(base, [os.path.join(root, f"expert_{t}") for t in "abc"], scale=0.02, seed=1)
    os.makedirs(os.path.join(root, "data"), exist_ok=True)
    for i, task in enumerate("abc"):
        rng = random.Random(i)
        topic = WORDS[20 + 10 * i : 30 + 10 * i]
        with open(os.path.join(root, "data", f"{task}.jsonl"), "w", encoding="utf-8") as fp:
            for _ in range(64):
                words = [rng.choice(topic if rng.random() < 0.6 else WORDS) for _ in range(16)]
                fp.write(json.dumps({"text": " ".join(words)}) + "\n")
    print(f"tiny models and data written under {root}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join("examples", "_build", "tiny"))
