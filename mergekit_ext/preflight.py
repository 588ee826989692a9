"""Preflight: every check of a merge before a weight loads, in one pass with one owner.

``preflight(cfg, options, world) -> Plan`` is the one place a ``run`` (one process, a rank
of several, a dry run; the CLI and the Python API alike) checks its inputs. In order:

1. :func:`check_world`: the method runs on ``world.size`` processes (the CLI also calls it
   early, through this module, before a launcher's processes meet);
2. the configuration alone: the method's name, its parameters' values (``checks.py``);
3. the inputs: ``models:`` for the data-aware methods, the paths and their files, LoRA
   adapters against their bases, one architecture (and for data-aware methods the tensor
   shapes, by name), the layer counts, each checkpoint read as its class reads it;
4. warnings: parameter names the method does not know, tokenizers that differ;
5. calibration: a base model and data for every expert (``ExtMergeConfig.check_data_aware``);
6. a tensor-wise merge: its chat template (mergekit resolves it only after writing).

A layer-wise merge's own plan (:meth:`Plan.layerwise`: the model classes, the blocks and their
shapes, the tokenizers' vocabularies, the calibration data, the memory estimate, and on
several processes the world's task rules) is built from the returned :class:`Plan`; it
reads configs, headers and data, never a weight. mergekit's options that would fail late
(:func:`check_merge_options`) are checked where they are parsed, before the config is.

A new check goes into ``checks.py`` (a function that raises a
:class:`~mergekit_ext.errors.MergekitExtError` naming the model / tensor / field and what to
do) and is called here, once, at the step whose inputs it needs (docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from mergekit.options import MergeOptions

from mergekit_ext import checks
from mergekit_ext import distributed as dist_context
from mergekit_ext.config import ExtMergeConfig
from mergekit_ext.errors import ConfigError, ExecutionError
from mergekit_ext.methods.kinds import Layerwise, MethodKind
from mergekit_ext.methods.registry import method_kind
from mergekit_ext.models import tokenization

if TYPE_CHECKING:
    from mergekit_ext.executor.plan import MergePlan


@dataclass(frozen=True)
class World:
    """How many processes the merge runs on: ``planned`` when ``--dry-run --world-size W``
    asks for the plan of W processes, not a launcher that started them."""

    size: int = 1
    planned: bool = False

    @classmethod
    def of_run(cls, plan_world_size: Optional[int]) -> World:
        """``--world-size`` when given (a plan), else the launcher's ``WORLD_SIZE``."""
        if plan_world_size is not None:
            return cls(plan_world_size, planned=True)
        return cls(dist_context.world_size_from_env())


@dataclass
class Plan:
    """A merge that passed preflight: what the executors run from.

    ``kind`` is the method's kind (``methods/kinds.py``), ``warnings`` what the checks
    warned about (logged already). :meth:`layerwise` is the sequential executor's plan.
    """

    cfg: ExtMergeConfig
    options: MergeOptions
    kind: MethodKind
    world: World = World()
    warnings: list[str] = field(default_factory=list)
    _layerwise: Optional[MergePlan] = field(default=None, repr=False)

    def layerwise(self) -> MergePlan:
        """The sequential executor's plan of a layer-wise merge, built once: the base's class
        and family, every expert's shapes by model class (heads may differ), the tokenizers'
        vocabularies, the calibration data (tokenized), the memory estimate; on several
        processes also the world's rules for the tasks and their batches."""
        if self._layerwise is None:
            from mergekit_ext.executor import plan_layerwise_merge

            assert isinstance(self.kind, Layerwise), f"{self.cfg.method} is not layer-wise"
            plan = plan_layerwise_merge(
                self.cfg, self.options, self.kind.method, self.cfg.parameters
            )
            if self.world.size > 1:  # the run's own rules (executor/strategy.py)
                dist_context.check_tasks(self.world.size, len(plan.experts))
                dist_context.check_shares(
                    self.world.size,
                    [(e.task, len(e.data.batches) if e.data else 1) for e in plan.experts],
                )
            self._layerwise = plan
        return self._layerwise


def preflight(
    cfg: ExtMergeConfig,
    options: MergeOptions,
    world: World = World(),
    *,
    allow_pickle: bool = False,
    dry_run: bool = False,
) -> Plan:
    """Every check that needs no weights, in the order of the module docstring; the
    :class:`Plan` the merge runs from. ``allow_pickle`` accepts pickle-only checkpoints
    (``--allow-pickle``); ``dry_run`` accepts inputs with only a ``config.json``."""
    check_world(cfg, world)
    checks.check_method(cfg.method)
    checks.check_parameter_values(cfg)  # pure config: before any path is looked at
    kind = method_kind(cfg.method)
    checks.check_models_list(cfg)
    checks.check_model_paths(cfg, allow_pickle=allow_pickle, dry_run=dry_run)
    warnings = checks.check_adapters(cfg)  # before mergekit/PEFT or the executor open one
    checks.check_compatible(cfg, allow_crimes=options.allow_crimes, shapes=kind.data_aware)
    checks.check_layer_counts(cfg)
    checks.check_checkpoint_classes(cfg)
    warnings += checks.check_parameter_names(cfg)
    warnings += checks.warn_tokenizers_differ(cfg)
    checks.check_calibration_present(cfg)
    if not kind.data_aware:  # data-aware methods resolve it when planning their tokenizer
        # mergekit resolves it only after writing the weights, then logs a traceback and
        # writes no tokenizer at all (exit 0)
        tokenization.resolve_chat_template(cfg.merge, options.trust_remote_code)
    return Plan(cfg, options, kind, world, warnings)


def check_world(cfg: ExtMergeConfig, world: World) -> None:
    """Refuse several processes for a method the distributed executor does not run, and a
    block refinement on more processes than tasks."""
    if world.size <= 1:
        return
    kind = method_kind(cfg.method)
    why = kind.single_process
    if why is not None:
        if world.planned:
            raise ExecutionError(
                f"{cfg.method} runs in a single process ({why}): "
                f"--world-size {world.size} cannot plan it; drop --world-size"
            )
        raise ExecutionError(
            f"{cfg.method} runs in a single process ({why}); launch it "
            f"without torchrun/accelerate (WORLD_SIZE is {world.size}), e.g. `mergekit-ext run "
            "CONFIG OUT`"
        )
    if isinstance(kind, Layerwise) and kind.method.block_refinement(cfg.parameters) is not None:
        # the refinement sums each task's gradient on the rank that holds the task; a rank
        # with no task of its own, or two ranks sharing one, has no term to pass on
        base = str(cfg.merge.base_model) if cfg.merge.base_model else None
        tasks = sum(1 for e in cfg.models if e.model != base)
        if world.size > tasks:
            raise ExecutionError(
                f"{cfg.method} refines each block with gradients summed task by task: run it "
                f"with at most as many processes as tasks ({tasks}), not {world.size}"
            )


# ---------------------------------------------------------------------- mergekit's options


def parse_shard_size(value: Any) -> int:
    """``--out-shard-size``: parameters per output shard, ``500M``, ``5B``, ``1000000``.

    Raises:
        ValueError: not a size, or not positive (the message says what is accepted).
    """
    from mergekit.common import parse_kmb

    hint = "a positive number of parameters per shard, such as 500M, 5B or 1000000"
    try:
        size = parse_kmb(value if isinstance(value, int) else str(value).strip())
    except (ValueError, IndexError):
        raise ValueError(f"{value!r} is not a size: give {hint}") from None
    if isinstance(size, bool) or size <= 0:
        raise ValueError(f"{value!r}: give {hint}")
    return size


def merge_option_problem(name: str, value: Any) -> Optional[str]:
    """What is wrong with mergekit's option ``name`` set to ``value`` (None: nothing).

    mergekit takes these as they come and fails late: ``torch.device`` deep in the merge
    (``Invalid device string``), ``torch.set_num_threads`` without naming ``-j``, numpy's
    seed range.
    """
    import torch

    if value is None:
        return None
    if name == "device":
        if value == "auto":
            return None
        try:
            torch.device(value)
        except (RuntimeError, TypeError):
            return f"{value!r} is not a device torch knows: use cpu, cuda, cuda:N, mps, xpu or auto"
    elif name in ("num_threads", "write_threads"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{value!r}: give a whole number of threads, 1 or more"
    elif name == "random_seed":
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
            return f"{value!r}: give a whole number from 0 to {2**32 - 1} (numpy's seed range)"
    elif name == "out_shard_size":
        try:
            parse_shard_size(value)
        except ValueError as e:
            return str(e)
    return None


def check_merge_options(options: MergeOptions, spell: Callable[[str], str]) -> None:
    """Refuse a value of mergekit's options that would fail late, naming it as ``spell``
    writes it (``--device`` on the command line, ``options['device']`` in Python)."""
    for name in ("device", "num_threads", "write_threads", "random_seed", "out_shard_size"):
        problem = merge_option_problem(name, getattr(options, name))
        if problem is not None:
            raise ConfigError(f"{spell(name)} {problem}")
