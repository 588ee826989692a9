"""Text calibration: tokenising, chat templates, padding into batches."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

import torch
from tqdm.auto import tqdm

from mergekit_ext.calibration.chat import is_conversation, to_messages
from mergekit_ext.calibration.config import CalibrationSpec
from mergekit_ext.errors import CalibrationError

if TYPE_CHECKING:
    pass

from mergekit_ext.calibration.sources.files import (
    _OpenedSource,
)
from mergekit_ext.calibration.sources.sampling import (
    _Hasher,
    _shuffled,
    _warn_or_fail,
)

LOG = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------
# Text


def _pad_batches(
    rows: list[list[int]], batch_size: int, pad_id: int
) -> list[dict[str, torch.Tensor]]:
    """Right-padded ``input_ids`` and ``attention_mask`` (int64), batch by batch, in order."""
    # Hand-written rather than ``tokenizer.pad``: pre-tokenised calibration data (token ids
    # read from a file) has no tokenizer, and one padding for both forms keeps their batches,
    # and the calibration hash that rests on them, the same.
    batches = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        width = max(len(r) for r in chunk)
        input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.int64)
        attention_mask = torch.zeros((len(chunk), width), dtype=torch.int64)
        for i, row in enumerate(chunk):
            input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
            attention_mask[i, : len(row)] = 1
        batches.append({"input_ids": input_ids, "attention_mask": attention_mask})
    return batches


def _pad_token_id(tokenizer: Any) -> int:
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if candidate is not None:
            return int(candidate[0] if isinstance(candidate, list) else candidate)
    return 0


def _text_encoder(
    tokenizer: Any, spec: CalibrationSpec, task: str, model_path: str
) -> Callable[[Any], list[int]]:
    """``text or messages -> token ids``: tokenizer defaults (special tokens), truncation
    unless packing; with ``apply_chat_template`` the chat template renders the messages."""
    truncate = {} if spec.pack else {"truncation": True, "max_length": spec.max_length}
    if spec.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise CalibrationError(
            f"model {task}: `apply_chat_template: true` but the tokenizer of {model_path!r} has "
            "no chat template; set apply_chat_template: false or use a tokenizer with one"
        )

    def encode(item: Any) -> list[int]:
        if spec.apply_chat_template:
            rendered = tokenizer.apply_chat_template(item, tokenize=False)
            text = rendered if spec.pack else enough_prefix(tokenizer, rendered, spec.max_length)
            return list(
                tokenizer(text, add_special_tokens=False, verbose=False, **truncate)["input_ids"]
            )
        text = item if spec.pack else enough_prefix(tokenizer, item, spec.max_length)
        return list(tokenizer(text, verbose=False, **truncate)["input_ids"])

    return encode


# Characters kept past the last token a truncated row needs: a pre-tokenizer decides a
# token's end from a few characters after it (a regex lookahead, a word's end), never from
# a kilobyte away.
_PREFIX_MARGIN = 1024


def enough_prefix(tokenizer: Any, text: str, max_length: int) -> str:
    """A prefix of ``text`` whose first ``max_length`` tokens are those of the whole text.

    Tokenizing a 6.6 MB single-line text to keep 32 tokens took 1.6 GB: only a prefix is
    tokenized instead, doubled until the token after the ``max_length``-th starts at least
    :data:`_PREFIX_MARGIN` characters before its end (offsets of a fast tokenizer). Texts
    shorter than the first prefix, and slow tokenizers (no offsets), are returned whole:
    their rows are the same as before, byte for byte.
    """
    size = 64 * max_length + 4 * _PREFIX_MARGIN
    if len(text) <= size or not getattr(tokenizer, "is_fast", False):
        return text
    if max_length <= tokenizer.num_special_tokens_to_add():
        return text  # no room for a token: the tokenizer gives up truncating, keeps it all
    while size < len(text):
        prefix = text[:size]
        offsets = tokenizer(
            prefix, add_special_tokens=False, return_offsets_mapping=True, verbose=False
        )["offset_mapping"]
        if len(offsets) > max_length and offsets[max_length][0] <= size - _PREFIX_MARGIN:
            return prefix
        size *= 2
    return text


def _text_item(
    item: Any, spec: CalibrationSpec, task: str, source: str, index: int
) -> Optional[Any]:
    """What to encode: a text, or (``apply_chat_template``) its chat messages; None for an
    empty example (skipped); an error naming the row for anything else."""
    if item is None or (isinstance(item, str) and not item.strip()):
        return None
    where = f"model {task}: row {index} of calibration data {source!r}"
    if spec.apply_chat_template:
        return to_messages(item, where)
    if isinstance(item, str):
        return item
    if is_conversation(item):
        raise CalibrationError(
            f"{where} holds chat messages (a list), not a text: set `apply_chat_template: "
            "true` in its calibration section to render them with the tokenizer's chat template"
        )
    raise CalibrationError(
        f"{where} holds a {type(item).__name__} where a text was expected; point `field:` at "
        "a text column"
    )


def _text_samples(
    opened: _OpenedSource,
    spec: CalibrationSpec,
    task: str,
    encode: Callable[[Any], list[int]],
    hasher: _Hasher,
    skip: frozenset[int] = frozenset(),
    read: Optional[list[int]] = None,
) -> list[list[int]]:
    """Token rows: one per sample (truncated), or ``pack`` windows of ``max_length``.

    The examples at the indices in ``skip`` are left out; the index of every example read
    is appended to ``read``.
    """
    rows: list[list[int]] = []
    stream: list[int] = []
    skipped = 0
    progress = tqdm(
        total=spec.samples, desc=f"calibration {task}: tokenizing", disable=None, leave=False
    )
    for index, item in _shuffled(opened.rows, spec.seed, skip):
        if read is not None:
            read.append(index)
        if opened.form == "tokens":
            if not item:
                skipped += 1
                continue
            hasher.add(torch.tensor(item, dtype=torch.int64).numpy().tobytes())
            ids = item if spec.pack else item[: spec.max_length]
        else:
            text = _text_item(item, spec, task, opened.description, opened.offset + index)
            if text is None:
                skipped += 1
                continue
            hasher.add(json.dumps(item, ensure_ascii=False, sort_keys=True).encode("utf-8"))
            ids = encode(text)
            if not ids:
                skipped += 1
                continue
        if not spec.pack:
            rows.append(ids)
            progress.update(1)
        else:
            stream.extend(ids)
            while len(stream) >= spec.max_length and len(rows) < spec.samples:
                rows.append(stream[: spec.max_length])
                del stream[: spec.max_length]
                progress.update(1)
        if len(rows) >= spec.samples:
            break
    progress.close()
    if spec.pack and len(rows) < spec.samples and stream:
        rows.append(stream)  # the trailing partial window, only when short of windows
    if skipped:
        LOG.warning("model %s: skipped %d empty examples of %r", task, skipped, opened.description)
    _warn_or_fail(
        task,
        opened.description,
        len(rows),
        spec.samples,
        "windows" if spec.pack else "texts",
        len(skip),
    )
    return rows
