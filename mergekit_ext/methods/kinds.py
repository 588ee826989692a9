"""How a method runs: its kind, one small class each, chosen by type.

mergekit chooses how to run a method by its class; mergekit-ext's methods come in three
kinds, and a method's :class:`~mergekit_ext.methods.registry.MethodInfo` holds one of them:

- :class:`Tensorwise`: mergekit's planner and executor run it one tensor at a time
  (mergekit's own methods, ACE, WUDI);
- :class:`Layerwise`: mergekit-ext's sequential executor runs its :class:`LayerwiseMethod`
  block by block with calibration statistics (RegMean, Chain of Merges, QP projection);
- :class:`Adaptation`: a test-time adaptation loop over whole models (SyMerge), a callable
  that merges into a folder (:class:`AdaptationRun`).

The runner picks the executor by the kind's type (``runner.py``); everything else asks the
kind object (whether it reads data, whether several processes can run it), never its name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Union

from mergekit_ext.merge_record import MergeRecord
from mergekit_ext.methods.layerwise import LayerwiseMethod

if TYPE_CHECKING:
    from mergekit_ext.config import ExtMergeConfig

__all__ = ["TENSORWISE", "Adaptation", "AdaptationRun", "Layerwise", "MethodKind", "Tensorwise"]


@dataclass(frozen=True)
class Tensorwise:
    """Run by mergekit's planner and executor, one tensor at a time."""

    name: ClassVar[str] = "tensorwise"
    #: merges whole models listed under ``models:`` with their data (no ``slices:``), and
    #: mergekit-ext writes the output tokenizer (mergekit's executor writes its own)
    data_aware: ClassVar[bool] = False
    #: why the method runs in one process; None: several processes (``torchrun``) can run it
    single_process: ClassVar[str | None] = "mergekit's tensor-wise methods are not distributed"


@dataclass(frozen=True)
class Layerwise:
    """Run block by block by mergekit-ext's sequential executor: ``method`` is the object it
    calls (``methods/layerwise.py``)."""

    method: LayerwiseMethod
    name: ClassVar[str] = "layerwise"
    data_aware: ClassVar[bool] = True
    single_process: ClassVar[str | None] = None


class AdaptationRun(Protocol):
    """A test-time adaptation merge: reads the config's models and data, writes ``out_dir``
    and returns its :class:`~mergekit_ext.merge_record.MergeRecord` (its diagnostics under
    the config's method, the calibration summaries)."""

    def __call__(
        self,
        cfg: ExtMergeConfig,
        out_dir: str,
        parameters: Any,
        *,
        device: str,
        force: bool,
        task_layers_only: bool,
        trust_remote_code: bool,
        body_path: str,
    ) -> MergeRecord: ...


@dataclass(frozen=True)
class Adaptation:
    """Test-time adaptation over whole models in one process: ``run`` merges."""

    run: AdaptationRun
    name: ClassVar[str] = "adaptation"
    data_aware: ClassVar[bool] = True
    single_process: ClassVar[str | None] = "test-time adaptation is not distributed"


MethodKind = Union[Tensorwise, Layerwise, Adaptation]

#: the kind of every tensor-wise method, mergekit's own included
TENSORWISE = Tensorwise()
