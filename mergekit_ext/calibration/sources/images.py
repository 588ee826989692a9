"""Image calibration: decoding images and batching them through the image processor."""

from __future__ import annotations

import json
import logging
import os
from typing import TYPE_CHECKING, Any, Optional

import torch
from tqdm.auto import tqdm

from mergekit_ext.calibration.config import CalibrationSpec
from mergekit_ext.errors import CalibrationError

if TYPE_CHECKING:
    import PIL.Image

from mergekit_ext.calibration.sources.files import (
    _OpenedSource,
)
from mergekit_ext.calibration.sources.models import (
    _ImagePreprocessor,
)
from mergekit_ext.calibration.sources.sampling import (
    _Hasher,
    _shuffled,
    _warn_or_fail,
)

LOG = logging.getLogger(__name__)

# ----------------------------------------------------------------------------------------
# Images


def _resolve_path(item: Any, base_dir: str) -> Any:
    """An image path relative to the data file's folder (when it is not relative to the CWD)."""
    if isinstance(item, (str, os.PathLike)):
        path = os.fspath(item)
        if not os.path.isabs(path) and not os.path.exists(path) and base_dir:
            return os.path.join(base_dir, path)
        return path
    return item


def _to_image(item: Any, task: str, source: str) -> PIL.Image.Image:
    from PIL import Image

    if isinstance(item, dict) and (
        item.get("bytes") or item.get("path")
    ):  # datasets Image, undecoded
        if item.get("bytes"):
            import io

            return Image.open(io.BytesIO(item["bytes"])).convert("RGB")
        item = item["path"]
    if isinstance(item, Image.Image):
        return item.convert("RGB")
    if isinstance(item, (str, os.PathLike)):
        try:
            with Image.open(item) as image:
                return image.convert("RGB")
        except OSError as e:
            raise CalibrationError(
                f"model {task}: cannot open image {os.fspath(item)!r} from {source!r}: {e}"
            ) from e
    raise CalibrationError(
        f"model {task}: calibration data {source!r} holds a {type(item).__name__} where an image "
        "(PIL image or image path) was expected; point `field:` at an image column"
    )


def _image_bytes(item: Any, image: PIL.Image.Image) -> bytes:
    """The file's bytes for an image path, else the decoded pixels."""
    if isinstance(item, str) and os.path.isfile(item):
        with open(item, "rb") as fp:
            return fp.read()
    return f"{image.mode}:{image.size}".encode() + image.tobytes()


def _selected_images(
    opened: _OpenedSource, spec: CalibrationSpec, skip: frozenset[int], read: list[int]
) -> list[Any]:
    selected: list[Any] = []
    for index, item in _shuffled(opened.rows, spec.seed, skip):
        read.append(index)
        selected.append(item)
        if len(selected) >= spec.samples:
            break
    return selected


def _image_batches(
    opened: _OpenedSource,
    spec: CalibrationSpec,
    task: str,
    model_path: str,
    hasher: _Hasher,
    skip: frozenset[int] = frozenset(),
    read: Optional[list[int]] = None,
) -> tuple[list[dict[str, torch.Tensor]], int]:
    selected = _selected_images(opened, spec, skip, read if read is not None else [])
    _warn_or_fail(task, opened.description, len(selected), spec.samples, "images", len(skip))
    if opened.form == "pixels":
        for pixels in selected:
            hasher.add(pixels.numpy().tobytes())
        chunks = [
            selected[i : i + spec.batch_size] for i in range(0, len(selected), spec.batch_size)
        ]
        return [{"pixel_values": torch.stack(chunk)} for chunk in chunks], len(selected)
    preprocess = _ImagePreprocessor(spec, model_path, task)
    hasher.add(json.dumps(preprocess.settings, sort_keys=True, default=str).encode("utf-8"))
    batches = []
    for start in tqdm(
        range(0, len(selected), spec.batch_size),
        desc=f"calibration {task}: images",
        disable=None,
        leave=False,
    ):
        images = []
        for item in selected[start : start + spec.batch_size]:
            item = _resolve_path(item, opened.base_dir)
            image = _to_image(item, task, opened.description)
            hasher.add(_image_bytes(item, image))
            images.append(image)
        batches.append({"pixel_values": preprocess(images)})
    return batches, len(selected)
