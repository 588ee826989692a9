"""Re-export of :mod:`mergekit_ext.testing` (the tiny checkpoint builders) for the tests,
plus PEFT LoRA experts saved as users have them."""

import os
import shutil

import peft
import torch

from mergekit_ext.testing import *  # noqa: F403
from mergekit_ext.testing import (  # noqa: F401
    SPECIAL,
    VOCAB_SIZE,
    WORDS,
    make_experts,
    make_tiny_bert,
    make_tiny_clip,
    make_tiny_clip_vision,
    make_tiny_llama,
    make_tiny_vit,
)


def make_lora_experts(
    base: str, root: str, cls, targets: list[str], **lora_kw
) -> tuple[list[str], list[str]]:
    """Two PEFT adapters on ``base`` and the same experts merged into full checkpoints."""
    adapters, full = [], []
    for i in range(2):
        torch.manual_seed(10 + i)
        model = cls.from_pretrained(base)
        config = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False, **lora_kw
        )
        peft_model = peft.get_peft_model(model, config)
        with torch.no_grad():  # small random updates of realistic size
            for name, p in peft_model.named_parameters():
                if "lora_B" in name or "lora_embedding_B" in name:
                    p.mul_(0.1)
        adapter = os.path.join(root, f"adapter{i}")
        peft_model.save_pretrained(adapter)
        merged = peft_model.merge_and_unload()
        path = os.path.join(root, f"full{i}")
        merged.save_pretrained(path)
        for f in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
            if os.path.exists(os.path.join(base, f)):
                shutil.copy(os.path.join(base, f), os.path.join(path, f))
        adapters.append(adapter)
        full.append(path)
    return adapters, full
