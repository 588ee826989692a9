"""Model cards for merged models: metadata, diagnostics, plots, no network.

:func:`write_model_card` reads a finished output folder (``mergekit_config.yml``,
``config.json``, ``mergekit_ext_diagnostics.json``), renders one of the Jinja2 templates
in ``mergekit_ext/hub/templates/`` (also reachable as ``model_cards/`` at the top of a
source checkout, a symlink to the same folder) and writes ``README.md`` plus the
diagnostics plots in ``images/``.

The YAML front matter is built with :class:`huggingface_hub.ModelCardData` (never written
by hand) and parsed back with :class:`huggingface_hub.ModelCard` before the card is saved.

Nothing here touches the network. mergekit 0.1.5's ``generate_card`` asks the Hub whether a
short relative path is a repository; we decide offline instead: an input is a Hub id when it
has the form ``owner/name`` and is not an existing local path (see :func:`is_hub_model_id`).
Licenses of Hub inputs are read from the local Hugging Face cache only.

The package: :mod:`.inputs` (architecture, input sources, licences), :mod:`.evaluation`
(``--eval`` results: ``mergekit-ext eval``'s file, lm-eval's results JSON, our list),
:mod:`.render` (the template context, Jinja2, ``README.md``), :mod:`.tools` (the cards of
``mergekit-moe`` and ``mergekit-extract-lora`` outputs, from the files those tools write;
templates ``moe.md.j2`` and ``lora.md.j2``).
"""

from __future__ import annotations

from mergekit_ext.hub.card.evaluation import (
    EVAL_RESULTS_SCHEMA,
    EvalReport,
    eval_results_to_card,
    format_eval_table,
    load_eval_results,
    read_eval_results,
)
from mergekit_ext.hub.card.folder import build_card_context, render_card_for_repo, write_model_card
from mergekit_ext.hub.card.render import (
    BACKUP_SUFFIX,
    CONFIG_FILENAME,
    DIAGNOSE_FILENAME,
    DIAGNOSE_PLOT,
    EVAL_FILENAME,
    TAGS,
    TEMPLATES_DIR,
    CardContext,
    CardError,
    CardOptions,
    MergeInMemory,
    _diagnostic_sections,
    card_is_unedited,
    card_text_is_unedited,
    keep_edited_card,
    render_model_card,
)
from mergekit_ext.merge_inputs import (
    README_FILENAME,
    ArchitectureInfo,
    InputModel,
    LicenseDecision,
    architecture_info,
    collect_inputs,
    decide_license,
    display_path,
    input_records,
    is_hub_model_id,
    local_path_redactor,
)

__all__ = [
    "ArchitectureInfo",
    "BACKUP_SUFFIX",
    "CardError",
    "CONFIG_FILENAME",
    "CardContext",
    "CardOptions",
    "DIAGNOSE_FILENAME",
    "DIAGNOSE_PLOT",
    "EVAL_FILENAME",
    "EVAL_RESULTS_SCHEMA",
    "EvalReport",
    "InputModel",
    "LicenseDecision",
    "MergeInMemory",
    "README_FILENAME",
    "TAGS",
    "TEMPLATES_DIR",
    "_diagnostic_sections",
    "architecture_info",
    "build_card_context",
    "card_is_unedited",
    "card_text_is_unedited",
    "collect_inputs",
    "decide_license",
    "display_path",
    "eval_results_to_card",
    "format_eval_table",
    "input_records",
    "is_hub_model_id",
    "keep_edited_card",
    "load_eval_results",
    "read_eval_results",
    "local_path_redactor",
    "render_card_for_repo",
    "render_model_card",
    "write_model_card",
]
