"""What a calibration source yields (:class:`CalibrationData`), the registry of custom sources
(:func:`register_source`), and the file formats and column names the loaders recognise."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, Union

import torch

from mergekit_ext.calibration.config import CalibrationSpec
from mergekit_ext.errors import CalibrationError

LOG = logging.getLogger(__name__)

if TYPE_CHECKING:
    import PIL.Image


Modality = Literal["text", "image"]

# file suffix -> datasets builder
DATASET_FORMATS = {
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".parquet": "parquet",
    ".txt": "text",
}
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
TEXT_COLUMNS = ("text",)
IMAGE_COLUMNS = ("image", "img")

# model_type values of vision-only checkpoints (CLIP: its vision tower, the usual merge target)
IMAGE_MODEL_TYPES = frozenset(
    {
        "beit", "bit", "clip", "clip_vision_model", "convnext", "convnextv2", "cvt",
        "data2vec-vision", "deit", "dinov2", "dinov2_with_registers", "dinov3_vit",
        "efficientnet", "focalnet", "hiera", "levit", "mobilenet_v1", "mobilenet_v2",
        "mobilevit", "mobilevitv2", "poolformer", "pvt", "pvt_v2", "regnet", "resnet",
        "siglip", "siglip_vision_model", "siglip2", "siglip2_vision_model", "swin",
        "swinv2", "van", "vit", "vit_hybrid", "vit_mae", "vit_msn",
    }
)  # fmt: skip

_FETCH_CHUNK = 64


# ----------------------------------------------------------------------------------------
# The result


@dataclass
class CalibrationData:
    """One task's calibration batches, ready for forward passes.

    - ``batches``: text: ``input_ids`` and ``attention_mask`` (int64, right padded to the
      longest sample of the batch); image: ``pixel_values`` (float32, ``[B, C, H, W]``).
    - ``num_tokens``: text: the non-padding tokens; image: images x patches per image
      (``(H / patch_size) * (W / patch_size)`` from the model config, class token not
      counted; one per image for models without patches).
    - ``sha256``: hash of the sampled raw examples (texts, image bytes or token rows) and the
      tokenization/preprocessing settings, for the model card; never the data itself.
    """

    task: str
    modality: Modality
    batches: list[dict[str, torch.Tensor]]
    num_samples: int
    num_tokens: int
    sha256: str
    source: str
    # indices (in the source) of every example read, in reading order: what a merge that
    # loaded this data has seen (the last one may be cut, or skipped when empty)
    rows_read: tuple[int, ...] = ()
    # examples left out because a merge read them (``load_calibration(exclude=...)``)
    rows_excluded: int = 0
    split: str = ""  # which rows of the source were read, in words
    preview: str = ""  # the first sample as the model reads it (text: its tokens decoded)

    def preview_line(self, width: int = 160) -> str:
        """``split ...; first sample: '...'`` on one line, the sample cut to ``width``
        characters (``--dry-run``)."""
        sample = self.preview if len(self.preview) <= width else self.preview[:width] + "…"
        return f"split {self.split}; first sample: {sample!r}"

    def summary(self) -> dict[str, Any]:
        """The card/diagnostics entry: ``{"source", "samples", "tokens", "sha256", "modality"}``."""
        return {
            "source": self.source,
            "samples": self.num_samples,
            "tokens": self.num_tokens,
            "sha256": self.sha256,
            "modality": self.modality,
        }


# ----------------------------------------------------------------------------------------
# Custom sources


class CalibrationSource(Protocol):
    """A custom source: ``(spec) -> iterable of examples`` (finite).

    An example is a text (``str``), an image (``PIL.Image.Image`` or an image file path for
    vision models) or a ``dict`` whose ``spec.field`` (default ``text`` / ``image``) holds
    one. ``spec.options`` carries the YAML's free-form ``options:``.
    """

    def __call__(
        self, spec: CalibrationSpec
    ) -> Iterable[Union[str, PIL.Image.Image, dict[str, Any]]]: ...


_SOURCES: dict[str, CalibrationSource] = {}
_F = TypeVar("_F", bound=Callable[..., Any])


def register_source(name: str) -> Callable[[_F], _F]:
    """Decorator: register a custom source under ``name`` (``calibration: {source: name}``).

    Example::

        @register_source("my_prompts")
        def my_prompts(spec):
            yield from (f"Question {i}: ..." for i in range(spec.options.get("n", 100)))
    """
    if not isinstance(name, str) or not name:
        raise ValueError("register_source needs a non-empty name")

    def decorator(fn: _F) -> _F:
        if not callable(fn):
            raise TypeError(f"calibration source {name!r} must be callable: (spec) -> iterable")
        previous = _SOURCES.get(name)
        if previous is not None and previous is not fn:
            LOG.warning(
                "calibration source %r registered again; the new one replaces the old", name
            )
        _SOURCES[name] = fn
        return fn

    return decorator


def _qualname(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def get_source(name: str) -> CalibrationSource:
    """The registered source ``name``; an unknown name lists the registered ones."""
    try:
        return _SOURCES[name]
    except KeyError:
        known = ", ".join(sorted(_SOURCES)) or "none"
        raise CalibrationError(
            f"unknown calibration source {name!r}; registered sources: {known}. Register it with "
            f"@mergekit_ext.calibration.register_source({name!r}) in code that runs before the merge"
        ) from None
