"""The ``calibration:`` section of a merge YAML (top-level defaults and per-model entries)."""

from __future__ import annotations

import logging
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

LOG = logging.getLogger(__name__)

_DATA_FIELDS = ("path", "dataset", "source")


def rename_deprecated_fields(values: dict[str, Any], where: str = "calibration") -> dict[str, Any]:
    """``values`` with the old ``chat_template`` flag renamed ``apply_chat_template``.

    The flag was renamed because mergekit's top-level ``chat_template:`` (the output's
    template, e.g. ``chatml``) has the same name and another meaning. The old name is
    still read, with a warning; both names with different values are an error.
    """
    if "chat_template" not in values:
        return values
    values = dict(values)
    old = values.pop("chat_template")
    if "apply_chat_template" in values and values["apply_chat_template"] != old:
        raise ValueError(
            f"`chat_template: {old}` and `apply_chat_template: {values['apply_chat_template']}` "
            "disagree; keep only apply_chat_template"
        )
    values.setdefault("apply_chat_template", old)
    LOG.warning(
        "%s: `chat_template:` is deprecated in a calibration section: write "
        "`apply_chat_template: %s` (the top-level `chat_template:` is mergekit's: the "
        "template written with the merged model)",
        where,
        str(old).lower(),
    )
    return values


class CalibrationSpec(BaseModel):
    """Where one model's calibration data comes from and how it is sampled.

    Exactly one of ``path`` (a local file or folder), ``dataset`` (a Hub dataset name, only
    online) or ``source`` (a custom source registered by name) names the data.
    """

    model_config = ConfigDict(extra="forbid")

    path: Optional[str] = None
    dataset: Optional[str] = None
    source: Optional[str] = None
    # Hub dataset configuration name: ``load_dataset(dataset, subset)``
    subset: Optional[str] = None
    split: Optional[str] = None
    field: Optional[str] = None  # text column, or image column for vision models
    samples: int = Field(default=128, ge=1)
    max_length: int = Field(default=256, ge=1)
    batch_size: int = Field(default=8, ge=1)
    # torch's generators take a 64-bit seed: a larger one failed as "Overflow when unpacking
    # long long", naming no field
    seed: int = Field(0, ge=0, lt=2**63, strict=True)
    pack: bool = False
    # render each example with the tokenizer's chat template (texts as one user message;
    # `messages`/`conversations` columns: OpenAI role/content or ShareGPT from/value)
    apply_chat_template: bool = False
    # vision preprocessing overrides (default: the model's own image processor config)
    image_size: Optional[int] = None
    image_mean: Optional[list[float]] = None
    image_std: Optional[list[float]] = None
    # free-form options for custom sources
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _deprecated_names(cls, values: Any) -> Any:
        return rename_deprecated_fields(values) if isinstance(values, dict) else values

    def merged_with(self, defaults: Optional[CalibrationSpec]) -> CalibrationSpec:
        """This entry with unset fields taken from the top-level defaults.

        When the entry names its own data (``path``, ``dataset`` or ``source``), none of the
        defaults' data-naming fields (nor their ``subset``) is inherited, so that the result
        names exactly one.
        """
        if defaults is None:
            return self
        values = defaults.model_dump(exclude_unset=True)
        own = self.model_dump(exclude_unset=True)
        if any(own.get(key) for key in _DATA_FIELDS):
            for key in (*_DATA_FIELDS, "subset"):
                values.pop(key, None)
        values.update(own)
        return CalibrationSpec.model_validate(values)

    @property
    def has_data(self) -> bool:
        return bool(self.path or self.dataset or self.source)

    def describe(self) -> str:
        return self.path or self.dataset or f"source:{self.source}"
