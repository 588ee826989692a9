"""Writing SyMerge's outputs: the merged body, and per task a checkpoint or a PEFT adapter.

- ``out_dir/``: the base's class with λ baked in (config + safetensors), plus the base's
  tokenizer / processor files.
- ``out_dir/tasks/<name>/``: a complete checkpoint of the expert's class (merged body +
  the adapted task layer + the expert's config and tokenizer), loadable in one
  ``AutoModelFor...from_pretrained`` call; or, with ``task_layers_only``, a PEFT adapter
  whose ``modules_to_save`` hold the adapted layer (and any task-specific head) and whose
  ``base_model_name_or_path`` names the merged body. The expert's ``config.json`` is saved
  beside the adapter, because a headless base's config lacks the head (labels)::

      model = AutoPeftModelForSequenceClassification.from_pretrained("out/tasks/sst2", num_labels=2)
"""

from __future__ import annotations

import copy
import fnmatch
import json
import logging
import os
import shutil
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from mergekit_ext.adaptation.problem import materialise
from mergekit_ext.output import write_file

LOG = logging.getLogger(__name__)

PROCESSING_FILE_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.model",
    "*.tiktoken",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "chat_template*",
)


def copy_processing_files(source_dir: str, out_dir: str) -> list[str]:
    """Copy the tokenizer / image-processor files of a checkpoint folder (byte for byte)."""
    if not os.path.isdir(source_dir):
        return []
    copied = []
    for name in sorted(os.listdir(source_dir)):
        path = os.path.join(source_dir, name)
        if os.path.isfile(path) and any(fnmatch.fnmatch(name, p) for p in PROCESSING_FILE_PATTERNS):
            shutil.copyfile(path, os.path.join(out_dir, name))
            copied.append(name)
    return copied


def _filled_copy(
    module: nn.Module, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> nn.Module:
    model = copy.deepcopy(module)
    return materialise(model, {n: t.detach().to(dtype).contiguous() for n, t in tensors.items()})


def save_checkpoint(
    module: nn.Module, tensors: Mapping[str, torch.Tensor], out_dir: str, dtype: torch.dtype
) -> None:
    """Save a copy of the skeleton ``module`` holding ``tensors`` (cast to ``dtype``).

    The skeleton itself is left as it was (its parameters are meta placeholders, so the
    copy is cheap), so that a session can keep running and saving never pins a copy.
    """
    os.makedirs(out_dir, exist_ok=True)
    model = _filled_copy(module, tensors, dtype)
    model.save_pretrained(out_dir)


def save_peft_adapter(
    module: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    modules_to_save: Sequence[str],
    out_dir: str,
    dtype: torch.dtype,
    base_model_name_or_path: str,
) -> None:
    """Save the task-specific modules of a task model as a PEFT ``modules_to_save`` adapter.

    PEFT's dummy target (``target_modules="dummy-target-modules"``) makes an adapter that
    adds nothing but the saved modules. ``base_model_name_or_path`` names the merged body
    (the output folder as the user gave it, or its Hub id once published), which
    ``AutoPeftModel...from_pretrained`` loads under the adapter; PEFT's ``save_pretrained``
    would otherwise fill in the path of the expert the task module was built from.
    """
    from peft import LoraConfig, get_peft_model
    from peft.utils.constants import DUMMY_TARGET_MODULES

    os.makedirs(out_dir, exist_ok=True)
    module.config.save_pretrained(out_dir)
    model = _filled_copy(module, tensors, dtype)
    config = LoraConfig(target_modules=DUMMY_TARGET_MODULES, modules_to_save=list(modules_to_save))
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(out_dir)
    set_adapter_base(out_dir, base_model_name_or_path)
    readme = os.path.join(out_dir, "README.md")
    if os.path.exists(readme):  # PEFT's card template; the merge's card describes the tasks
        os.remove(readme)


def set_adapter_base(adapter_dir: str, base_model_name_or_path: str) -> None:
    """Point the adapter in ``adapter_dir`` at ``base_model_name_or_path`` (the merged body)."""
    path = os.path.join(adapter_dir, "adapter_config.json")
    with open(path, encoding="utf-8") as fp:
        config = json.load(fp)
    config["base_model_name_or_path"] = base_model_name_or_path
    write_file(path, json.dumps(config, indent=2, sort_keys=True) + "\n")
