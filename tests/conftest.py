"""Shared test set-up: offline Hugging Face, two torch threads, tiny base + expert checkpoints.

Each ``tiny_*_set`` fixture builds one tiny random base model and three experts
(``tiny_models.make_experts``: base + seeded random task vectors of growing size) once per
test session, under a ``tmp_path_factory`` folder, the first time a test asks for it.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

# The torch threads of a test process and of the processes it starts: the cores shared by the
# pytest workers (`make test` runs two on CI's two cores). More threads than cores make
# OpenMP teams spin on cores another worker needs; tiny models gain nothing from a second
# thread. OMP_NUM_THREADS reaches the `mergekit-ext` / torchrun processes tests start.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
TEST_THREADS = max(1, min(2, (os.cpu_count() or 1) // _WORKERS))
os.environ.setdefault("OMP_NUM_THREADS", str(TEST_THREADS))

import pytest  # noqa: E402
import tiny_models  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(TEST_THREADS)

NUM_EXPERTS = 3

# mergekit's own suite and its helpers run through tests/mergekit_suite/run.py
# (`make test-mergekit`), in their own pytest processes, never in this one
collect_ignore = ["mergekit_suite"]


@dataclass(frozen=True)
class TinySet:
    """A tiny base checkpoint and its experts (folders on disk)."""

    name: str
    architecture: str  # the transformers class in the checkpoint's config
    base: str
    experts: tuple[str, ...]

    @property
    def models(self) -> tuple[str, ...]:
        """Base first, then the experts."""
        return (self.base, *self.experts)


def _build_set(
    tmp_path_factory: pytest.TempPathFactory, name: str, architecture: str, build
) -> TinySet:
    root = tmp_path_factory.mktemp(name)
    base = build(str(root / "base"))
    experts = tiny_models.make_experts(base, [str(root / f"expert{i}") for i in range(NUM_EXPERTS)])
    return TinySet(name=name, architecture=architecture, base=base, experts=tuple(experts))


@pytest.fixture(scope="session")
def llama_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[str]]:
    """A tiny Llama base and two small experts (scale 0.05, seed 3): (base, [expert, expert]).

    Read-only; a test that changes the models works on copies (:func:`user_work`)."""
    root = tmp_path_factory.mktemp("llama_pair")
    base = tiny_models.make_tiny_llama(str(root / "base"), seed=0)
    experts = tiny_models.make_experts(
        base, [str(root / f"e{i}") for i in range(2)], scale=0.05, seed=3
    )
    return base, experts


@pytest.fixture
def user_work(llama_pair: tuple[str, list[str]], tmp_path: Path) -> Path:
    """A user's working folder ``work/`` with copies of :func:`llama_pair` under ``m/``
    (``m/base``, ``m/expert_a``, ``m/expert_b``), free to change or corrupt."""
    base, experts = llama_pair
    work = tmp_path / "work"
    (work / "m").mkdir(parents=True)
    shutil.copytree(base, work / "m" / "base")
    shutil.copytree(experts[0], work / "m" / "expert_a")
    shutil.copytree(experts[1], work / "m" / "expert_b")
    return work


@pytest.fixture(scope="session")
def tiny_llama_set(tmp_path_factory: pytest.TempPathFactory) -> TinySet:
    """LlamaForCausalLM, 2 layers, GQA, untied head."""
    return _build_set(tmp_path_factory, "llama", "LlamaForCausalLM", tiny_models.make_tiny_llama)


@pytest.fixture(scope="session")
def tiny_bert_set(tmp_path_factory: pytest.TempPathFactory) -> TinySet:
    """BertModel (encoder + pooler, no head)."""
    return _build_set(tmp_path_factory, "bert", "BertModel", tiny_models.make_tiny_bert)


@pytest.fixture(scope="session")
def tiny_bert_classifier_set(tmp_path_factory: pytest.TempPathFactory) -> TinySet:
    """BertForSequenceClassification with 3 labels."""
    return _build_set(
        tmp_path_factory,
        "bert_cls",
        "BertForSequenceClassification",
        lambda path: tiny_models.make_tiny_bert(path, num_labels=3),
    )


@pytest.fixture(scope="session")
def tiny_vit_set(tmp_path_factory: pytest.TempPathFactory) -> TinySet:
    """ViTForImageClassification (3 labels, 16x16 images)."""
    return _build_set(
        tmp_path_factory, "vit_cls", "ViTForImageClassification", tiny_models.make_tiny_vit
    )


@pytest.fixture(scope="session")
def tiny_vit_model_set(tmp_path_factory: pytest.TempPathFactory) -> TinySet:
    """ViTModel (encoder + pooler, no head)."""
    return _build_set(
        tmp_path_factory,
        "vit",
        "ViTModel",
        lambda path: tiny_models.make_tiny_vit(path, classifier=False),
    )


@pytest.fixture(scope="session")
def tiny_clip_vision_set(tmp_path_factory: pytest.TempPathFactory) -> TinySet:
    """CLIPVisionModel (vision tower only)."""
    return _build_set(
        tmp_path_factory, "clip_vision", "CLIPVisionModel", tiny_models.make_tiny_clip_vision
    )


@pytest.fixture(scope="session")
def tiny_clip_vision_projection_set(tmp_path_factory: pytest.TempPathFactory) -> TinySet:
    """CLIPVisionModelWithProjection (vision tower + visual projection)."""
    return _build_set(
        tmp_path_factory,
        "clip_vision_proj",
        "CLIPVisionModelWithProjection",
        lambda path: tiny_models.make_tiny_clip_vision(path, with_projection=True),
    )


@pytest.fixture(scope="session")
def tiny_clip_set(tmp_path_factory: pytest.TempPathFactory) -> TinySet:
    """A whole CLIPModel (text + vision towers, projections, logit scale)."""
    return _build_set(tmp_path_factory, "clip", "CLIPModel", tiny_models.make_tiny_clip)


@pytest.fixture
def recorded_fits(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every QP model-output fit the executor solves, in order (to inspect their sums)."""
    from mergekit_ext.methods.qp_model_output import QPModelOutputFit

    fits: list = []
    original = QPModelOutputFit.solve

    def recording(self):
        fits.append(self)
        return original(self)

    monkeypatch.setattr(QPModelOutputFit, "solve", recording)
    return fits


@pytest.fixture
def fast_products(monkeypatch: pytest.MonkeyPatch) -> list:
    """The operand shapes of every product the least-squares solve sends to the bfloat16 units
    (``solve.float32_product``), in order."""
    from mergekit_ext.methods.least_squares import solve

    calls: list = []
    original = solve.float32_product

    def counting(a, b):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return original(a, b)

    monkeypatch.setattr(solve, "float32_product", counting)
    return calls


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One torch thread for a test of tiny tensors: on a shared 2-core machine (and beside
    the other pytest worker) a second thread only costs. Modules ask for it with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
