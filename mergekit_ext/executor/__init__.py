"""The sequential layer-by-layer executor of data-aware merge methods.

Entry points used by the CLI (``mergekit_ext.runner``):

- :func:`plan_layerwise_merge`: validates the merge before any weight is loaded and returns
  a :class:`MergePlan` whose :meth:`MergePlan.describe` is the ``--dry-run`` text;
- :func:`run_layerwise_merge`: writes the merged model into a folder and returns its
  :class:`~mergekit_ext.merge_record.MergeRecord`: the method's section
  (``{"layers": [...], "not_merged": [...]}``), the per-task calibration summaries, the
  compute dtype and, in several processes, who held which task.

See :mod:`mergekit_ext.executor.sequential` for how the network is walked.
"""

from __future__ import annotations

from typing import Optional

import torch
from mergekit.options import MergeOptions

from mergekit_ext.config import ExtMergeConfig
from mergekit_ext.distributed import DistributedContext
from mergekit_ext.errors import ExecutionError
from mergekit_ext.executor.plan import MemoryEstimate, MergePlan, build_plan
from mergekit_ext.executor.sequential import SequentialExecutor, resolve_device
from mergekit_ext.merge_record import MergeRecord
from mergekit_ext.methods.layerwise import LayerwiseMethod
from mergekit_ext.models.families import family_for, family_names


def plan_layerwise_merge(
    cfg: ExtMergeConfig, options: MergeOptions, method: LayerwiseMethod, parameters: dict
) -> MergePlan:
    """Check the merge (models, family, shapes, calibration, tokenizers) and plan it.

    Reads configs, safetensors headers and the calibration data, never a weight. A model
    folder with only a ``config.json`` is planned from its class (shapes, memory); the
    merge itself refuses it (:meth:`MergePlan.check_weights`).
    """
    return build_plan(cfg, options, method, dict(parameters or {}))


def run_layerwise_merge(
    cfg: ExtMergeConfig,
    out_dir: Optional[str],
    options: MergeOptions,
    method: LayerwiseMethod,
    parameters: dict,
    *,
    device: str = "cpu",
    distributed: Optional[DistributedContext] = None,
    plan: Optional[MergePlan] = None,
) -> MergeRecord:
    """Merge block by block into ``out_dir`` (config, tokenizer/processor files, safetensors);
    returns the merge's record (its section, calibration, compute dtype, distribution).

    ``plan``: the plan preflight built (``Plan.layerwise()``), run as it is; without it (a
    direct call) it is built here from the same arguments.

    ``device``: ``cpu`` | ``cuda`` | ``auto``; statistics and block forwards run there,
    weights stream from disk. ``distributed``: this process's place among several
    (``torchrun``); rank r runs on ``cuda:LOCAL_RANK`` with ``cuda``, and only rank 0
    writes (the others pass ``out_dir=None``). The record then also has ``distributed``:
    ``{"world_size", "backend", "task_ranks"}`` (and ``"task_shares"`` when there are more
    processes than tasks).
    """
    torch_device = resolve_device(device)
    if distributed is not None and distributed.enabled and torch_device.type == "cuda":
        torch_device = torch.device("cuda", distributed.local_rank)
    if plan is None:
        plan = plan_layerwise_merge(cfg, options, method, parameters)
    plan.check_weights()
    if plan.request.model_output is not None:
        # Whole-model path (qp_projection objective: model_output): one process, memory
        # checked before any weight is read.
        from mergekit_ext.executor.model_output import ModelOutputExecutor
        from mergekit_ext.executor.model_output_checks import check_model_output_memory

        if distributed is not None and distributed.enabled:
            raise ExecutionError(
                f"{method.name} with the model-output objective runs in a single process; "
                "launch it without torchrun/accelerate"
            )
        check_model_output_memory(plan, torch_device)
        return ModelOutputExecutor(plan, out_dir, torch_device).run()
    return SequentialExecutor(plan, out_dir, torch_device, distributed).run()


__all__ = [
    "MemoryEstimate",
    "MergePlan",
    "SequentialExecutor",
    "family_for",
    "family_names",
    "plan_layerwise_merge",
    "run_layerwise_merge",
]
