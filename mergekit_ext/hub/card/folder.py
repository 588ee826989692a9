"""The card of an output folder, whoever wrote it: a mergekit-ext merge (:mod:`.render`) or
mergekit-moe / mergekit-extract-lora (:mod:`.tools`); the two writers that render it.

The dispatch lives here, above both, so that :mod:`.render` (the merge's card) and
:mod:`.tools` (the tools' cards, which reuse render's helpers) do not import each other.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any, Optional

from huggingface_hub import ModelCard

from mergekit_ext.hub.card import tools
from mergekit_ext.hub.card.render import (
    EVAL_FILENAME,
    CardContext,
    CardOptions,
    MergeInMemory,
    _sign,
    build_merge_context,
    keep_edited_card,
    render_model_card,
)
from mergekit_ext.merge_inputs import README_FILENAME
from mergekit_ext.output import write_file

LOG = logging.getLogger("mergekit_ext.hub.card.render")  # the writers' messages, as before


def build_card_context(out_dir: str, options: CardOptions = CardOptions()) -> CardContext:
    """The card's metadata and template variables for ``out_dir`` (``options``:
    :class:`~.render.CardOptions`): the merge's (:func:`~.render.build_merge_context`) for a
    merge in memory or a folder mergekit-ext wrote, else the tool's that wrote it
    (:func:`~.tools.build_tool_context`; a folder of none of them is refused there)."""
    source = "merge" if options.merge is not None else tools.card_source(out_dir)
    if source != "merge":  # mergekit-moe's or mergekit-extract-lora's output (or none)
        return tools.build_tool_context(out_dir, source, options)
    return build_merge_context(out_dir, options)


def render_card_for_repo(out_dir: str, repo_id: str, *, template_dir: Optional[str] = None) -> str:
    """The card of ``out_dir`` as it should read on the Hub under ``repo_id``; writes nothing.

    The local ``README.md`` is written for the folder (its name as the title, ``./NAME`` in
    the loading snippets); the uploaded copy is rendered again here with the repository's
    name as the title and ``repo_id`` in every snippet. Image links stay relative
    (``images/...``, uploaded beside the card); the plots are drawn into a temporary folder
    and thrown away, so ``out_dir`` is left exactly as it is. Evaluation results already in
    the local card's model-index are kept.
    """
    import tempfile

    readme = os.path.join(out_dir, README_FILENAME)
    card_eval = None
    if os.path.isfile(readme):
        try:
            card_eval = ModelCard.load(readme).data.eval_results
        except Exception as e:  # noqa: BLE001 - publish checks the card itself
            LOG.warning("could not read the evaluation results of %s: %s", readme, e)
    with tempfile.TemporaryDirectory(prefix="mergekit-ext-card-") as images:
        context = build_card_context(
            out_dir, CardOptions(repo_id=repo_id, images_dir=images, card_eval_results=card_eval)
        )
        text = str(render_model_card(context, template_dir))
    return text if text.endswith("\n") else text + "\n"


def write_model_card(
    out_dir: str,
    *,
    eval_results: Any = None,
    name: Optional[str] = None,
    repo_id: Optional[str] = None,
    template_dir: Optional[str] = None,
    diagnose: Optional[Mapping[str, Any]] = None,
    force: bool = False,
    merge: Optional[MergeInMemory] = None,
) -> str:
    """Write ``README.md`` and ``images/*.png`` for the merge in ``out_dir``; returns the card path.

    ``name`` is the model's title (default: the folder name; the runner's temporary
    ``.NAME.partial-*`` folder gives NAME); ``repo_id`` is used in the loading snippet when
    the model is about to be published; ``template_dir`` overrides the shipped templates
    (files with the same names: ``causal_lm.md.j2``, ``vision.md.j2``, ``encoder.md.j2``);
    ``diagnose`` is a ``mergekit-ext diagnose`` result of this model (a section and a plot).
    A README.md that mergekit-ext did not write as it is now is never replaced silently:
    it is refused (:func:`keep_edited_card`) unless ``force``, which replaces whatever is
    there (the caller kept it: ``keep_edited_card(out_dir, force=True)`` backs it up).
    ``merge``: the run's config and diagnostics in memory (:class:`MergeInMemory`).
    """
    if not force:
        keep_edited_card(out_dir, force=False)
    context = build_card_context(
        out_dir,
        CardOptions(
            eval_results=eval_results, name=name, repo_id=repo_id, diagnose=diagnose, merge=merge
        ),
    )
    card = render_model_card(context, template_dir)
    if eval_results:  # kept for the next `card` and for `publish`
        write_file(os.path.join(out_dir, EVAL_FILENAME), json.dumps(eval_results, indent=2) + "\n")
    path = os.path.join(out_dir, README_FILENAME)
    text = str(card) if str(card).endswith("\n") else str(card) + "\n"
    write_file(path, _sign(text))
    LOG.info("wrote model card %s", path)
    return path
