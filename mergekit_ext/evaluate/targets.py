"""Which models ``mergekit-ext eval`` evaluates: the merged folders and, with ``--with-inputs``,
the base model and each expert of the merge config, so the table shows the merge beside what
it came from."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Literal, Optional

from mergekit_ext.config import load_config
from mergekit_ext.errors import ConfigError, ModelNotFoundError
from mergekit_ext.models.model_paths import split_revision

Role = Literal["merge", "base", "expert"]


@dataclass(frozen=True)
class EvalTarget:
    """One model to evaluate: ``path`` is a folder or Hub id, ``adapter`` a LoRA on it
    (a ``base+adapter`` input of the config)."""

    name: str
    role: Role
    path: str
    adapter: Optional[str] = None
    revision: Optional[str] = None

    @property
    def label(self) -> str:
        """The name as the results table shows it: ``NAME (base)``, ``NAME (expert)``."""
        return self.name if self.role == "merge" else f"{self.name} ({self.role})"

    @property
    def file_stem(self) -> str:
        """A file name for this model's own results (one path component)."""
        return re.sub(r"[^A-Za-z0-9._-]+", "_", f"{self.role}-{self.name}").strip("._") or "model"


def _from_reference(ref: str, name: str, role: Role) -> EvalTarget:
    model, _, adapter = ref.partition("+")
    path, revision = split_revision(model)
    return EvalTarget(name=name, role=role, path=path, adapter=adapter or None, revision=revision)


def eval_targets(model_dirs: list[str], config_path: Optional[str] = None) -> list[EvalTarget]:
    """The merged folders (each must exist), then the config's base model and experts."""
    if not model_dirs:
        raise ConfigError("give at least one MODEL_DIR to evaluate (a merged model folder)")
    targets: list[EvalTarget] = []
    for folder in model_dirs:
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise ModelNotFoundError(
                f"{folder}: no config.json, so it is not a model folder; give the output "
                "folder of a merge (or any transformers checkpoint)"
            )
        name = os.path.basename(os.path.normpath(os.path.abspath(folder)))
        targets.append(EvalTarget(name=name, role="merge", path=folder))
    if config_path:
        cfg = load_config(config_path)
        base = cfg.merge.base_model
        if base is not None:
            ref = str(base)
            targets.append(_from_reference(ref, _short(ref), "base"))
        for entry in cfg.models:
            if base is not None and entry.model == str(base):
                continue  # the base listed among the models (SLERP) runs once
            targets.append(_from_reference(entry.model, entry.name, "expert"))
    names = [t.label for t in targets]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(
            f"two models would share the name {', '.join(dupes)} in the results; give the "
            "merged folders different names (or the config's models a `name:`)"
        )
    return targets


def _short(ref: str) -> str:
    model = ref.split("+")[0].split("@")[0].rstrip("/")
    return os.path.basename(model) or model
