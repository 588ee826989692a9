"""The tokenizer and chat template of a data-aware merge's output, with mergekit's own code.

mergekit's executor builds the output tokenizer from ``tokenizer_source`` / ``tokenizer:``
(:func:`mergekit.tokenizer.build_tokenizer`) and sets ``chat_template``
(``mergekit.merge._set_chat_template``: a bundled template name, ``auto`` for the most
common template among the inputs, or a Jinja string). The data-aware methods use the same
functions. They merge with the base model's embedding rows, so a tokenizer source that
would change the vocabulary (a union of different vocabularies, added tokens, padding the
vocabulary) is refused before any weight is loaded.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Optional

from mergekit.config import MergeConfiguration
from mergekit.options import MergeOptions

from mergekit_ext.errors import ConfigError
from mergekit_ext.models.model_paths import TOKENIZER_FILES

LOG = logging.getLogger(__name__)


@dataclass
class OutputTokenizer:
    """What a data-aware merge writes as its tokenizer, decided before merging."""

    tokenizer: Optional[Any]  # built from tokenizer_source / tokenizer:, or None (the donor's)
    chat_template: Optional[str]  # the resolved template text, or None (keep the donor's)

    @property
    def rewrites(self) -> bool:
        """Whether the donor's tokenizer files are replaced (instead of copied as they are)."""
        return self.tokenizer is not None or self.chat_template is not None


def tokenizer_request(merge_config: MergeConfiguration) -> tuple[Any, dict, Optional[int]]:
    """(source, tokens to add, pad_to_multiple_of) of the YAML, as mergekit's planner reads them."""
    if merge_config.tokenizer is not None:
        tok = merge_config.tokenizer
        return tok.source, dict(tok.tokens or {}), tok.pad_to_multiple_of
    return merge_config.tokenizer_source, {}, None


def resolve_chat_template(
    merge_config: MergeConfiguration, trust_remote_code: bool
) -> Optional[str]:
    """The template text ``chat_template`` asks for (None: not set, or ``auto`` found none).

    Raises:
        ConfigError: the value is neither a bundled template name nor a Jinja template.
    """
    if not merge_config.chat_template:
        return None
    from mergekit.merge import _set_chat_template

    holder = SimpleNamespace(chat_template=None)
    try:
        _set_chat_template(holder, merge_config, trust_remote_code=trust_remote_code)
    except RuntimeError as e:
        from importlib.resources import files

        from mergekit._data import chat_templates

        names = sorted(
            p.name[: -len(".jinja")]
            for p in files(chat_templates).iterdir()
            if p.name.endswith(".jinja")
        )
        raise ConfigError(
            f"chat_template: {e}; give a template name ({', '.join(names)}), `auto` (the "
            "most common template among the input models), or a Jinja template string"
        ) from None
    return holder.chat_template


def plan_output_tokenizer(
    merge_config: MergeConfiguration, options: MergeOptions, method: str
) -> OutputTokenizer:
    """Check the tokenizer options for a data-aware ``method`` and build what they ask for.

    Loads tokenizers only, never a weight.

    Raises:
        ConfigError: the options would change the vocabulary of the base model.
    """
    template = resolve_chat_template(merge_config, options.trust_remote_code)
    source, tokens, pad_to = tokenizer_request(merge_config)
    if source is None:
        return OutputTokenizer(None, template)
    if tokens:
        raise ConfigError(
            f"tokenizer.tokens is not supported by {method}: a data-aware merge keeps the base "
            "model's vocabulary and embedding rows. Add the tokens to the models (and their "
            "embeddings) before merging, or use a tensor-wise method"
        )
    from mergekit.tokenizer.build import build_tokenizer

    base = merge_config.base_model or merge_config.referenced_models()[0]
    try:
        info = build_tokenizer(
            base_model=base,
            referenced_models=list(merge_config.referenced_models()),
            tokenizer_source=source,
            trust_remote_code=options.trust_remote_code,
            add_tokens=[],
        )
    except Exception as e:  # noqa: BLE001 - transformers raises many types here
        raise ConfigError(
            f"tokenizer_source {_shown(source)}: cannot build the tokenizer "
            f"({type(e).__name__}: {' '.join(str(e).split())})"
        ) from None
    vocab_out = info.tokenizer.get_vocab()
    for model, vocab in info.original_vocabs.items():
        if vocab != vocab_out:
            example = next(
                (t for t in sorted(vocab_out) if vocab.get(t) != vocab_out[t]),
                next((t for t in sorted(vocab) if t not in vocab_out), None),
            )
            raise ConfigError(
                f"tokenizer_source {_shown(source)} changes the vocabulary of {model} "
                f"({len(vocab)} → {len(vocab_out)} tokens; token {example!r} is id "
                f"{vocab.get(example)} there and {vocab_out.get(example)} in the output), which "
                f"{method} cannot do: a data-aware merge keeps the base model's vocabulary and "
                "embedding rows. Merge models that share one tokenizer, or use a tensor-wise "
                "method (ties, linear, ...) for a vocabulary change"
            )
    if pad_to:
        rows = base.config(trust_remote_code=options.trust_remote_code).vocab_size
        if rows % pad_to:
            raise ConfigError(
                f"tokenizer.pad_to_multiple_of: {pad_to} would resize the embeddings of "
                f"{base} ({rows} rows), which {method} cannot do; remove it or use a "
                "tensor-wise method"
            )
    return OutputTokenizer(info.tokenizer, template)


def write_output_tokenizer(
    plan: OutputTokenizer,
    donor_folder: str,
    out_dir: str,
    *,
    copy_tokenizer: bool = True,
    trust_remote_code: bool = False,
) -> None:
    """Write the planned tokenizer into ``out_dir`` as mergekit's ``run_merge`` does.

    Without ``tokenizer_source`` and ``chat_template`` the executors' byte copy of the
    donor's files stands (mergekit copies them too). Otherwise the copied files are replaced
    by the built tokenizer (or the donor's, re-serialized) carrying the chat template.
    """
    if not plan.rewrites:
        return
    tokenizer = plan.tokenizer
    if tokenizer is None:
        if not copy_tokenizer:
            LOG.warning("chat_template is set but no tokenizer is written; it is not saved")
            return
        import transformers

        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(
                donor_folder, trust_remote_code=trust_remote_code
            )
        except Exception as e:  # noqa: BLE001
            LOG.warning(
                "chat_template is set but %s has no loadable tokenizer (%s); it is not saved",
                donor_folder,
                e,
            )
            return
    if plan.chat_template is not None:
        tokenizer.chat_template = plan.chat_template
    for name in TOKENIZER_FILES:
        path = os.path.join(out_dir, name)
        if os.path.isfile(path):
            os.remove(path)
    tokenizer.save_pretrained(out_dir)


def _shown(source: Any) -> str:
    return repr(source) if isinstance(source, str) else f"'{source}'"
