"""Build-once artefacts (bases, experts, calibration files) keyed by a recipe hash.

An artefact lives in a folder with a ``recipe.json`` holding the hash of everything that
determines it (training settings, the data's fingerprint, the base's recipe). A folder whose
recipe matches is reused; any change rebuilds it. Builds go to ``<folder>.tmp`` and are
renamed into place when complete, so an interrupted build never looks finished.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

LOG = logging.getLogger(__name__)

# Bump when the training code changes in a way the settings do not show.
CODE_VERSION = 1
RECIPE_FILE = "recipe.json"


def default_cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "mergekit-ext", "bench")


def recipe_hash(recipe: dict[str, Any]) -> str:
    text = json.dumps({"code_version": CODE_VERSION, **recipe}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def read_recipe(folder: str) -> dict[str, Any] | None:
    path = os.path.join(folder, RECIPE_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fp:
        return json.load(fp)


def cached_build(
    folder: str, recipe: dict[str, Any], build: Callable[[str], dict[str, Any] | None]
) -> dict[str, Any]:
    """Return ``folder``'s recipe record, building it with ``build(tmp_folder)`` if needed.

    ``build`` writes the artefact into the folder it is given and may return extra facts to
    record (e.g. final training loss). The record holds ``hash``, ``recipe``,
    ``build_seconds`` (of the build that made it) and ``reused`` (True when nothing ran).
    """
    digest = recipe_hash(recipe)
    existing = read_recipe(folder)
    if existing is not None and existing.get("hash") == digest:
        LOG.info("reusing %s (recipe %s)", folder, digest)
        return {**existing, "reused": True}
    tmp = folder + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    LOG.info("building %s (recipe %s)", folder, digest)
    start = time.perf_counter()
    extra = build(tmp) or {}
    record = {
        "hash": digest,
        "recipe": recipe,
        "build_seconds": round(time.perf_counter() - start, 2),
        **extra,
    }
    with open(os.path.join(tmp, RECIPE_FILE), "w", encoding="utf-8") as fp:
        json.dump(record, fp, indent=2, sort_keys=True, default=str)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return {**record, "reused": False}
