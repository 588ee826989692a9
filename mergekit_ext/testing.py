"""Tiny random checkpoints for tests and examples: built from configs, saved as safetensors, no network.

Every builder takes the output folder and a seed and returns the folder. Text models get a
small word-level tokenizer; vision models get an image processor config, so that the
folders look exactly like real Hub checkpoints to mergekit, transformers and our code.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, processors

WORDS = (
    "the a an of to and in is was for on with as by at from it this that be are were "
    "news sport music film food review good bad great terrible price taste market stock "
    "team game win lose goal player coach election vote party minister government law "
    "court tech phone app data cloud model network energy oil gas weather rain sun happy "
    "sad angry love hate coffee tea chocolate dog cat bird tree river city country"
).split()
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "<s>", "</s>"]
VOCAB_SIZE = 128


def _tokenizer(kind: str) -> transformers.PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if kind == "bert":
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B [SEP]",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
        )
        return transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok,
            unk_token="[UNK]",
            pad_token="[PAD]",
            cls_token="[CLS]",
            sep_token="[SEP]",
        )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        bos_token="<s>",
        eos_token="</s>",
    )


def save_tiny_tokenizer(path: str, kind: str = "llama") -> str:
    """Save the tiny word-level tokenizer (``"llama"`` or ``"bert"`` style) into ``path``."""
    os.makedirs(path, exist_ok=True)
    _tokenizer(kind).save_pretrained(path)
    return path


def _save(model: torch.nn.Module, path: str, extra: Sequence[object] = ()) -> str:
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    for item in extra:
        item.save_pretrained(path)
    return path


def _seeded(seed: int) -> None:
    torch.manual_seed(seed)


def make_tiny_llama(path: str, seed: int = 0, layers: int = 2, cls=None) -> str:
    """LlamaForCausalLM with GQA (4 heads, 2 KV heads) and rotary embeddings."""
    _seeded(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=4,
        eos_token_id=5,
    )
    model = (cls or transformers.LlamaForCausalLM)(cfg)
    return _save(model, path, [_tokenizer("llama")])


def make_tiny_bert(path: str, seed: int = 0, layers: int = 2, num_labels: int | None = None) -> str:
    """BertModel (or BertForSequenceClassification when ``num_labels`` is given)."""
    _seeded(seed)
    cfg = transformers.BertConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        max_position_embeddings=64,
        num_labels=num_labels or 2,
    )
    cls = transformers.BertForSequenceClassification if num_labels else transformers.BertModel
    return _save(cls(cfg), path, [_tokenizer("bert")])


def _vit_config(num_labels: int = 3) -> transformers.ViTConfig:
    return transformers.ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_labels=num_labels,
    )


def _vit_processor() -> transformers.ViTImageProcessor:
    return transformers.ViTImageProcessor(size={"height": 16, "width": 16})


def make_tiny_vit(path: str, seed: int = 0, classifier: bool = True, num_labels: int = 3) -> str:
    """ViTForImageClassification (or ViTModel with ``classifier=False``), 16x16 images."""
    _seeded(seed)
    cfg = _vit_config(num_labels)
    cls = transformers.ViTForImageClassification if classifier else transformers.ViTModel
    return _save(cls(cfg), path, [_vit_processor()])


def _clip_vision_config() -> transformers.CLIPVisionConfig:
    return transformers.CLIPVisionConfig(
        image_size=16,
        patch_size=4,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        projection_dim=16,
    )


def _clip_processor() -> transformers.CLIPImageProcessor:
    return transformers.CLIPImageProcessor(
        size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16}
    )


def make_tiny_clip_vision(path: str, seed: int = 0, with_projection: bool = False) -> str:
    """CLIPVisionModel (or CLIPVisionModelWithProjection)."""
    _seeded(seed)
    cls = (
        transformers.CLIPVisionModelWithProjection
        if with_projection
        else transformers.CLIPVisionModel
    )
    return _save(cls(_clip_vision_config()), path, [_clip_processor()])


def make_tiny_clip(path: str, seed: int = 0) -> str:
    """A whole CLIPModel (text + vision towers)."""
    _seeded(seed)
    cfg = transformers.CLIPConfig(
        text_config=dict(
            vocab_size=VOCAB_SIZE,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=32,
            projection_dim=16,
            pad_token_id=0,
            bos_token_id=4,
            eos_token_id=5,
        ),
        vision_config=_clip_vision_config().to_dict(),
        projection_dim=16,
    )
    return _save(transformers.CLIPModel(cfg), path, [_clip_processor()])


def make_experts(
    base_path: str,
    out_paths: Sequence[str],
    scale: float = 0.05,
    seed: int = 1,
    load: Callable[[str], torch.nn.Module] | None = None,
) -> list[str]:
    """Experts = base + seeded random task vectors (each expert its own seed and size)."""
    config = transformers.AutoConfig.from_pretrained(base_path)
    arch = getattr(transformers, config.architectures[0])
    for i, out in enumerate(out_paths):
        model = (load or arch.from_pretrained)(base_path)
        gen = torch.Generator().manual_seed(seed + i)
        with torch.no_grad():
            for _name, p in model.named_parameters():
                if p.dtype.is_floating_point:
                    p.add_(torch.randn(p.shape, generator=gen) * scale * (1.0 + 0.5 * i))
        extra = []
        for loader in (transformers.AutoTokenizer, transformers.AutoImageProcessor):
            try:
                extra.append(loader.from_pretrained(base_path))
            except Exception:
                pass
        _save(model, out, extra)
    return list(out_paths)
