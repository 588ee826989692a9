"""``mergekit-ext eval --data``: accuracy of encoders and image classifiers on labelled data,
with the experts' own heads.

A merge of classifiers (BERT/RoBERTa/DeBERTa, ViT/CLIP/SigLIP) has one body and, per task, the
head of the expert that was trained for it. Each model of the table (the merge, the base, each
expert) is scored on each task's labelled data with that task's expert head on its body: the
body's tensors are loaded into the expert's own transformers class and the head tensors (those
outside the class's base model) are the expert's. An expert on its own task is simply itself.
This is the "body + expert head" scoring of the benchmark suites (text_suite / vision_suite),
which use the same :mod:`mergekit_ext.evaluate.scoring` functions.

Data: a local ``.jsonl``/``.json``/``.csv``/``.parquet`` file with a text and a label column, a
folder of images in one subfolder per class (the ``imagefolder`` layout), or, online, a Hub
dataset id (``--split``). Labels may be class ids or the expert's label names
(``config.json``'s ``label2id``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from tqdm.auto import tqdm

from mergekit_ext.console import phase
from mergekit_ext.errors import ConfigError, ModelInputError
from mergekit_ext.evaluate.scoring import batched_accuracy, text_accuracy
from mergekit_ext.evaluate.targets import EvalTarget
from mergekit_ext.offline import hub_offline

LOG = logging.getLogger(__name__)

TEXT_FIELDS = ("text", "sentence", "content", "review")
IMAGE_FIELDS = ("image", "img", "pixel_values")
LABEL_FIELDS = ("label", "labels", "target")
_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


@dataclass
class LabelledData:
    """Inputs (texts or PIL images) and their labels as written in the data (ids or names)."""

    source: str
    kind: str  # "text" | "image"
    inputs: list[Any]
    labels: list[Any]
    split: Optional[str] = None

    @property
    def shown(self) -> str:
        """The source without its local folders (results files and cards are shared)."""
        return (
            os.path.basename(os.path.normpath(self.source))
            if os.path.exists(self.source)
            else self.source
        )


def _pick(
    columns: Sequence[str], given: Optional[str], candidates: Sequence[str], what: str, source: str
) -> str:
    if given:
        if given not in columns:
            raise ConfigError(
                f"{source}: no column {given!r} ({what}); its columns: {', '.join(columns)}"
            )
        return given
    for name in candidates:
        if name in columns:
            return name
    raise ConfigError(
        f"{source}: no {what} column (looked for {', '.join(candidates)}); its columns: "
        f"{', '.join(columns)}; name it with --{what}-field"
    )


def load_labelled(
    source: str,
    *,
    split: Optional[str] = None,
    text_field: Optional[str] = None,
    label_field: Optional[str] = None,
    image_field: Optional[str] = None,
    limit: Optional[int] = None,
) -> LabelledData:
    """Read labelled examples from a file, an image folder or (online) a Hub dataset."""
    import datasets

    if os.path.isdir(source):
        ds = datasets.load_dataset("imagefolder", data_dir=source)
    elif os.path.isfile(source):
        builder = _BUILDERS.get(os.path.splitext(source)[1].lower())
        if builder is None:
            raise ConfigError(
                f"{source}: unknown data file type; give a .jsonl, .json, .csv or .parquet file "
                "or a folder of images in one subfolder per class"
            )
        ds = datasets.load_dataset(builder, data_files=source)
    elif hub_offline():
        raise ConfigError(
            f"{source}: no such file or folder, and the Hub is offline (HF_HUB_OFFLINE=1), so it "
            "cannot be read as a Hub dataset; give a local labelled file or image folder"
        )
    else:
        ds = datasets.load_dataset(source)
    if split is None:
        if len(ds) != 1 and "test" not in ds:
            raise ConfigError(f"{source} has the splits {', '.join(ds)}; choose one with --split")
        split = "test" if "test" in ds else next(iter(ds))
    elif split not in ds:
        raise ConfigError(f"{source} has no split {split!r}; its splits: {', '.join(ds)}")
    table = ds[split]
    if limit is not None:
        table = table.select(range(min(limit, len(table))))
    columns = list(table.column_names)
    label = _pick(columns, label_field, LABEL_FIELDS, "label", source)
    names = getattr(table.features[label], "names", None)
    labels = list(table[label])
    if names:  # a ClassLabel (an image folder's subfolder names): the names
        labels = [names[i] for i in labels]
    if any(c in columns for c in IMAGE_FIELDS) or image_field:
        field = _pick(columns, image_field, IMAGE_FIELDS, "image", source)
        inputs = [img.convert("RGB") for img in table[field]]
        kind = "image"
    else:
        field = _pick(columns, text_field, TEXT_FIELDS, "text", source)
        inputs = [str(t) for t in table[field]]
        kind = "text"
    if not inputs:
        raise ConfigError(f"{source} ({split}) has no examples")
    return LabelledData(source=source, kind=kind, inputs=inputs, labels=labels, split=split)


def label_ids(labels: Sequence[Any], config: Any, where: str) -> list[int]:
    """Labels as class ids of ``config`` (names through its ``label2id``)."""
    label2id = {str(k): int(v) for k, v in (getattr(config, "label2id", None) or {}).items()}
    num_labels = int(getattr(config, "num_labels", len(label2id)) or 0)
    out = []
    for value in labels:
        if isinstance(value, str) and value in label2id:
            out.append(label2id[value])
        elif isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
            out.append(int(value))
        else:
            raise ConfigError(
                f"{where}: label {value!r} is neither a class id nor one of the head's labels "
                f"({', '.join(label2id) or 'none'})"
            )
        if not 0 <= out[-1] < num_labels:
            raise ConfigError(
                f"{where}: label {value!r} is out of range for a head of {num_labels} classes"
            )
    return out


def _auto_class(kind: str) -> Any:
    import transformers

    return (
        transformers.AutoModelForImageClassification
        if kind == "image"
        else transformers.AutoModelForSequenceClassification
    )


def _load(auto: Any, path: str, **kwargs: Any) -> torch.nn.Module:
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the head we replace is reported as missing
    try:
        return auto.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as e:
        raise ModelInputError(f"{path}: cannot be loaded as {auto.__name__}: {e}") from e
    finally:
        transformers.logging.set_verbosity(verbosity)


class HeadBank:
    """Each task's expert: its config and head tensors, loaded once."""

    def __init__(self, kind: str) -> None:
        self.auto = _auto_class(kind)
        self._heads: dict[str, tuple[Any, dict[str, torch.Tensor]]] = {}

    def head(self, expert: str) -> tuple[Any, dict[str, torch.Tensor]]:
        if expert not in self._heads:
            model = _load(self.auto, expert)
            prefix = f"{model.base_model_prefix}."
            state = model.state_dict()
            head = {k: v for k, v in state.items() if not k.startswith(prefix)}
            if not head:
                raise ModelInputError(
                    f"{expert}: {type(model).__name__} has no head outside its body"
                )
            self._heads[expert] = (model.config, head)
        return self._heads[expert]

    def model(self, body: EvalTarget, expert: Optional[str]) -> torch.nn.Module:
        """``body``'s tensors with ``expert``'s head (``expert`` None: ``body`` as it is)."""
        kwargs: dict[str, Any] = {"revision": body.revision} if body.revision else {}
        if (
            expert is None
            or os.path.abspath(expert) == os.path.abspath(body.path)
            and not body.adapter
        ):
            model = _load(self.auto, body.path, **kwargs)
        else:
            config, head = self.head(expert)
            model = _load(self.auto, body.path, config=config, **kwargs)
            model.load_state_dict(head, strict=False)
        if body.adapter:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, body.adapter).merge_and_unload()
        return model.eval()


def _preprocessor(kind: str, *folders: str) -> Any:
    import transformers

    auto = transformers.AutoImageProcessor if kind == "image" else transformers.AutoTokenizer
    for folder in folders:
        try:
            return auto.from_pretrained(folder)
        except (OSError, ValueError):
            continue
    raise ModelInputError(
        f"no {'image processor' if kind == 'image' else 'tokenizer'} in {', '.join(folders)}"
    )


def score(
    model: torch.nn.Module,
    data: LabelledData,
    labels: list[int],
    preprocessor: Any,
    *,
    batch_size: int,
    device: str,
    max_length: int = 512,
) -> float:
    model.to(device)
    if data.kind == "text":
        return text_accuracy(
            lambda enc: model(**enc.to(device)).logits,
            data.inputs,
            labels,
            preprocessor,
            max_length=min(max_length, int(getattr(preprocessor, "model_max_length", max_length))),
            batch_size=batch_size,
        )
    return batched_accuracy(
        lambda px: model(pixel_values=px.to(device)).logits,
        lambda a, b: preprocessor(data.inputs[a:b], return_tensors="pt")["pixel_values"],
        labels,
        batch_size=batch_size,
    )


def run_classification(
    targets: Sequence[EvalTarget],
    data: dict[str, LabelledData],
    *,
    batch_size: int = 32,
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """Accuracy of every target on every task of ``data`` (task name → labelled data).

    A task named after an expert of ``targets`` is scored with that expert's head; any other
    task (no ``--with-inputs``, one data set) with each model's own head.
    """
    experts = {t.name: t for t in targets if t.role == "expert"}
    kinds = {d.kind for d in data.values()}
    if len(kinds) != 1:
        raise ConfigError("--data mixes text files and image folders; evaluate them separately")
    bank = HeadBank(kinds.pop())
    entries = []
    bar = tqdm(total=len(targets) * len(data), desc="accuracy", unit="run")
    for target in targets:
        tasks: dict[str, Any] = {}
        for task, labelled in data.items():
            expert = experts.get(task)
            head = expert.path if expert else None
            phase(f"accuracy: {target.label} on {task} ({len(labelled.inputs)} examples)")
            model = bank.model(target, head)
            preprocessor = _preprocessor(labelled.kind, target.path, *([head] if head else []))
            labels = label_ids(labelled.labels, model.config, f"{labelled.source} ({task})")
            accuracy = score(
                model, labelled, labels, preprocessor, batch_size=batch_size, device=device
            )
            tasks[task] = {
                "accuracy": accuracy,
                "samples": len(labels),
                "data": labelled.shown,
                "split": labelled.split,
                "local": os.path.exists(labelled.source),
                "head": (expert.name if expert else "own"),
                "pipeline_tag": "image-classification"
                if labelled.kind == "image"
                else "text-classification",
            }
            del model
            bar.update(1)
        entries.append(
            {"name": target.name, "role": target.role, "classification": {"tasks": tasks}}
        )
    bar.close()
    return entries
