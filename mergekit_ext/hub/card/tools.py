"""Cards for the outputs of mergekit's other tools, built from the files each writes.

- ``mergekit-moe CONFIG OUT`` writes the model and, unless ``--no-write-model-card``, its
  config as ``mergekit_moe_config.yml`` (no README): read with mergekit's own
  :class:`mergekit.moe.config.MoEMergeConfig`.
- ``mergekit-extract-lora --model FT --base-model BASE --out-path OUT`` writes a PEFT
  adapter (``adapter_config.json``: base, rank, target modules) and its own README.md,
  whose command block is the only record of the fine-tuned model: parsed with
  mergekit-extract-lora's own click command. Once ``card --force`` replaced that README,
  the copy it kept (``README.md.bak``) is read instead.

:func:`card_source` says which tool wrote a folder; ``folder.build_card_context`` hands
the two tools' folders to :func:`build_tool_context`. Inputs are described as for a merge
(:func:`~mergekit_ext.merge_inputs.reference_input`): local paths never reach the card,
and only Hub ids become ``base_model`` metadata.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from typing import Any, Optional

from huggingface_hub import EvalResult, ModelCardData

from mergekit_ext.errors import ModelNotFoundError
from mergekit_ext.hub.card.render import (
    CONFIG_FILENAME,
    CardContext,
    CardOptions,
    _model_name,
    _project_url,
    _versions,
    has_chat_template,
    read_licenses,
)
from mergekit_ext.merge_inputs import (
    README_FILENAME,
    InputModel,
    _read_json,
    _shorten_yaml_paths,
    architecture_info,
    decide_license,
    reference_input,
)

MOE_CONFIG_FILENAME = "mergekit_moe_config.yml"  # mergekit-moe (scripts/moe.py)
ADAPTER_CONFIG = "adapter_config.json"  # mergekit-extract-lora (scripts/extract_lora.py)
ADAPTER_WEIGHTS = "adapter_model.safetensors"

MOE_TAGS = ("mergekit", "moe")
LORA_TAGS = ("mergekit", "lora", "peft")

# mergekit/moe/config.py's own comments on gate_mode, as a card reader needs them
GATE_MODES = {
    "hidden": "each router row is the base model's hidden state on the expert's prompts, "
    "layer by layer (positive prompts minus negative ones)",
    "cheap_embed": "each router row is the mean token embedding of the expert's prompts, "
    "the same for every layer",
    "random": "random router weights: the model routes arbitrarily until it is trained",
    "uniform_random": "random router weights as torch.nn.Linear initialises them: the model "
    "routes arbitrarily until it is trained",
}

# PEFT task types (adapter_config.json `task_type`) and what loads and serves them
_PEFT_TASKS = {
    "CAUSAL_LM": ("AutoModelForCausalLM", "text-generation"),
    "SEQ_2_SEQ_LM": ("AutoModelForSeq2SeqLM", "text2text-generation"),
    "SEQ_CLS": ("AutoModelForSequenceClassification", "text-classification"),
    "TOKEN_CLS": ("AutoModelForTokenClassification", "token-classification"),
    "FEATURE_EXTRACTION": ("AutoModel", "feature-extraction"),
}

# mergekit's LoRA card (mergekit/card.py CARD_TEMPLATE_LORA): the command it ran
_LORA_CARD_MARK = "The following command was used to extract this LoRA adapter:"
_COMMAND_BLOCK = re.compile(r"```sh\n(?P<command>.*?)\n```", re.S)


def card_source(out_dir: str) -> Optional[str]:
    """What wrote ``out_dir``, as far as the card goes: ``"merge"`` (``mergekit_config.yml``:
    ``mergekit-ext run`` or ``mergekit-yaml``), ``"moe"`` (``mergekit-moe``), ``"lora"``
    (``mergekit-extract-lora``'s adapter at the top), or None (nothing to build a card from)."""
    if os.path.isfile(os.path.join(out_dir, CONFIG_FILENAME)):
        return "merge"
    if os.path.isfile(os.path.join(out_dir, MOE_CONFIG_FILENAME)):
        return "moe"
    if os.path.isfile(os.path.join(out_dir, ADAPTER_CONFIG)) and os.path.isfile(
        os.path.join(out_dir, ADAPTER_WEIGHTS)
    ):
        return "lora"
    return None


def no_card_source(out_dir: str) -> str:
    """Why a card cannot be built for ``out_dir`` (none of the files it reads), and what to do."""
    lacks = [
        f"{CONFIG_FILENAME} (written by `mergekit-ext run` and `mergekit-yaml`)",
        f"{MOE_CONFIG_FILENAME} (written by `mergekit-moe`, unless --no-write-model-card)",
        f"{ADAPTER_CONFIG} with {ADAPTER_WEIGHTS} (written by `mergekit-extract-lora`)",
    ]
    return (
        f"{out_dir} is not the output of a finished merge: it has none of "
        + ", ".join(lacks[:-1])
        + f" or {lacks[-1]}. Point at the output folder of one of those tools; for a "
        f"`mergekit-moe` output written with --no-write-model-card, copy its config there as "
        f"{MOE_CONFIG_FILENAME}"
    )


def _reference(value: Any) -> Any:
    from mergekit.common import ModelReference

    return value if isinstance(value, ModelReference) else ModelReference.model_validate(value)


def _hub_ids(inputs: Sequence[InputModel]) -> list[str]:
    ids: list[str] = []
    for m in inputs:
        ids += [i for i in m.hub_ids if i not in ids]
    return ids


def _card_data(
    inputs: Sequence[InputModel],
    base_ids: list[str],
    relation: str,
    library: str,
    pipeline_tag: Optional[str],
    tags: Sequence[str],
    card_eval: Optional[list[EvalResult]],
    model_name: str,
    cwd: str,
) -> tuple[ModelCardData, Any]:
    license_decision = decide_license(read_licenses(list(inputs), cwd))
    extra: dict[str, Any] = {}
    if base_ids:
        extra["base_model_relation"] = relation
    if license_decision.license == "other":
        if license_decision.license_name:
            extra["license_name"] = license_decision.license_name
        if license_decision.license_link:
            extra["license_link"] = license_decision.license_link
    data = ModelCardData(
        base_model=base_ids or None,
        eval_results=card_eval,
        library_name=library,
        license=license_decision.license,
        model_name=model_name if card_eval else None,
        pipeline_tag=pipeline_tag,
        tags=list(tags),
        **extra,
    )
    return data, license_decision


def _common(out_dir: str, model_name: str, repo_id: Optional[str], card_eval: Any) -> dict:
    return {
        "name": model_name,
        "model_id": repo_id or f"./{model_name}",
        "project_url": _project_url(),
        "versions": [v for v in _versions({}) if v[0] in ("mergekit-ext", "mergekit")],
        "eval_rows": [
            {
                "task": r.task_name or r.task_type,
                "dataset": r.dataset_name,
                "split": r.dataset_split or "",
                "metric": r.metric_name or r.metric_type,
                "value": r.metric_value,
            }
            for r in card_eval or []
        ],
    }


def _moe_context(
    out_dir: str, model_name: str, repo_id: Optional[str], cwd: str, card_eval: Any
) -> CardContext:
    import yaml
    from mergekit.moe.config import MoEMergeConfig
    from pydantic import ValidationError

    path = os.path.join(out_dir, MOE_CONFIG_FILENAME)
    with open(path, encoding="utf-8") as fp:
        text = fp.read()
    try:
        raw = yaml.safe_load(text)
        config = MoEMergeConfig.model_validate(raw)
    except (yaml.YAMLError, ValidationError) as e:
        raise ModelNotFoundError(
            f"{path} is not a mergekit-moe config mergekit can read "
            f"({' '.join(str(e).split())[:300]}): restore the config the model was built "
            "with (mergekit-moe copies it there)"
        ) from None
    model_config = _read_json(os.path.join(out_dir, "config.json"))
    if model_config is None:
        raise ModelNotFoundError(
            f"{out_dir} has no readable config.json: mergekit-moe did not finish; build it again"
        )
    arch = architecture_info(model_config)
    base = reference_input("base", _reference(config.base_model), cwd)
    experts = []
    for kind, group in (("expert", config.experts), ("shared expert", config.shared_experts)):
        for i, expert in enumerate(group or []):
            model = reference_input(kind, _reference(expert.source_model), cwd)
            model.name = f"{kind} {i}"
            experts.append({"input": model, "spec": expert, "shared": kind != "expert"})
    inputs = [base] + [e["input"] for e in experts]
    card_data, license_decision = _card_data(
        inputs, _hub_ids(inputs), "merge", "transformers", arch.pipeline_tag,
        MOE_TAGS, card_eval, model_name, cwd,
    )  # fmt: skip
    shown_yaml, shortened = _shorten_yaml_paths(text.rstrip("\n"), raw, cwd)
    variables = _common(out_dir, model_name, repo_id, card_eval)
    variables.update(
        {
            "arch": arch,
            "base": base,
            "experts": experts,
            "inputs": inputs,
            "license": license_decision,
            "gate_mode": config.gate_mode,
            "gate_mode_text": GATE_MODES.get(config.gate_mode, "not a gate mode mergekit names"),
            "experts_per_token": model_config.get("num_experts_per_tok", config.experts_per_token),
            "num_experts": model_config.get("num_local_experts", len(config.experts)),
            "dtype": config.dtype,
            "config_yaml": shown_yaml,
            "yaml_shortened": shortened,
            "chat": has_chat_template(out_dir),
        }
    )
    return CardContext(card_data=card_data, variables=variables, template="moe.md.j2")


def extraction_command(out_dir: str) -> Optional[dict[str, Any]]:
    """The options ``mergekit-extract-lora`` was run with, from the command its own
    README.md records (or the ``README.md.bak*`` that ``card --force`` kept), parsed by
    its own click command; None when no such card is there."""
    import click
    from mergekit.scripts.extract_lora import main as extract_lora

    candidates = [os.path.join(out_dir, README_FILENAME)]
    candidates += sorted(glob.glob(os.path.join(glob.escape(out_dir), README_FILENAME + ".bak*")))
    for path in candidates:
        try:
            with open(path, encoding="utf-8") as fp:
                text = fp.read()
        except (OSError, UnicodeDecodeError):
            continue
        _, mark, rest = text.partition(_LORA_CARD_MARK)
        match = _COMMAND_BLOCK.search(rest) if mark else None
        if match is None:
            continue
        try:
            words = shlex.split(match["command"])
            ctx = extract_lora.make_context(
                "mergekit-extract-lora", words[1:], resilient_parsing=True
            )
        except (ValueError, click.ClickException):  # a command it cannot parse: not recorded
            continue
        if ctx.params.get("model"):
            return dict(ctx.params)
    return None


def _lora_context(
    out_dir: str, model_name: str, repo_id: Optional[str], cwd: str, card_eval: Any
) -> CardContext:
    adapter = _read_json(os.path.join(out_dir, ADAPTER_CONFIG))
    if not isinstance(adapter, Mapping) or not adapter.get("base_model_name_or_path"):
        raise ModelNotFoundError(
            f"{os.path.join(out_dir, ADAPTER_CONFIG)} is unreadable or names no "
            "base_model_name_or_path: extract the adapter again with mergekit-extract-lora"
        )
    command = extraction_command(out_dir)
    base = reference_input("base", _reference(adapter["base_model_name_or_path"]), cwd)
    inputs = [base]
    finetuned = None
    if command is not None:
        finetuned = reference_input("fine-tuned", _reference(command["model"]), cwd)
        inputs.append(finetuned)
    auto_class, pipeline_tag = _PEFT_TASKS.get(str(adapter.get("task_type")), ("AutoModel", None))
    # The adapter applies to the base only: the fine-tuned model is its source, not a
    # model it loads onto (the Hub's model tree: "adapter of" the base).
    card_data, license_decision = _card_data(
        inputs, base.hub_ids, "adapter", "peft", pipeline_tag, LORA_TAGS, card_eval,
        model_name, cwd,
    )  # fmt: skip
    rank = adapter.get("r")
    rank_pattern = adapter.get("rank_pattern") or {}
    options = []
    if command is not None:
        for key in ("max_rank", "sv_epsilon", "distribute_scale", "embed_lora",
                    "include_regexes", "exclude_regexes", "skip_undecomposable"):  # fmt: skip
            value = command.get(key)
            if isinstance(value, tuple):
                value = list(value)
            options.append((key.replace("_", "-"), value))
    variables = _common(out_dir, model_name, repo_id, card_eval)
    variables.update(
        {
            "base": base,
            "finetuned": finetuned,
            "inputs": inputs,
            "license": license_decision,
            "rank": rank,
            "alpha": adapter.get("lora_alpha"),
            "lower_ranks": sorted(rank_pattern.items()),
            "target_modules": sorted(adapter.get("target_modules") or []),
            "modules_to_save": list(adapter.get("modules_to_save") or []),
            "task_type": adapter.get("task_type"),
            "auto_class": auto_class,
            "options": options,
        }
    )
    return CardContext(card_data=card_data, variables=variables, template="lora.md.j2")


def build_tool_context(
    out_dir: str, source: Optional[str], options: CardOptions = CardOptions()
) -> CardContext:
    """The :class:`~mergekit_ext.hub.card.render.CardContext` of a ``mergekit-moe`` or
    ``mergekit-extract-lora`` output (``source`` from :func:`card_source`); of ``options``
    it reads ``name``, ``repo_id``, ``cwd`` and the evaluation results."""
    from mergekit_ext.hub.card.evaluation import eval_results_to_card

    if source not in ("moe", "lora"):
        raise ModelNotFoundError(no_card_source(out_dir))
    cwd = os.path.abspath(options.cwd or os.getcwd())
    model_name = _model_name(out_dir, options.name, options.repo_id)
    card_eval = (
        eval_results_to_card(options.eval_results, model_name) if options.eval_results else None
    )
    if options.card_eval_results:
        card_eval = list(options.card_eval_results)
    build = _moe_context if source == "moe" else _lora_context
    return build(out_dir, model_name, options.repo_id, cwd, card_eval)


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "GATE_MODES",
    "LORA_TAGS",
    "MOE_CONFIG_FILENAME",
    "MOE_TAGS",
    "build_tool_context",
    "card_source",
    "extraction_command",
    "no_card_source",
]
