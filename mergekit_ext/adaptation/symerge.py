"""SyMerge: test-time adaptation of merge coefficients plus one task layer per task.

"From Non-Interference to Synergistic Merging via Single-Layer Adaptation", arXiv 2412.19098
(ICML 2026); public reference code: github.com/AIM-SKKU/SyMerge (``src/main_symerge.py``).

On unlabeled data of each task, learn jointly (``docs/methods.md``, section SyMerge):

- per-tensor, per-task coefficients of the shared body, ``θ_p = θ_0,p + Σ_k λ[p,k] Δ_k,p``
  (AdaMerging's layer-wise parametrisation; init ``init_lambda``, clamped to [0, 1] after
  each step unless ``clamp: false``);
- one task layer per task, initialised from that task's expert (``task_layer``: ``head``,
  the default; ``last_block``; or a module name). Models without a task head (causal LMs,
  headless encoders) use their last block for ``head``.

The loss is expert-guided self-labelling (:mod:`mergekit_ext.adaptation.losses`): the expert
labels the data. Adam over λ and the task layers; each epoch takes one batch of each task in
a shuffled task order with one step per task.

``epochs`` defaults to 100 (not the reference's 500 for 8 ViT tasks), a CPU-sized run; raise
it for large task suites. Models run in eval mode (no dropout) so that a fixed ``seed``
gives the same bytes. ``task_arithmetic_heldout_accuracy`` is the adaptation's starting
point: task arithmetic at ``λ = init_lambda`` (0.3) with each task's unadapted expert layer.
"""

from __future__ import annotations

from typing import Any

from mergekit_ext.adaptation import run
from mergekit_ext.adaptation.parameters import SyMergeParameters
from mergekit_ext.config import ExtMergeConfig
from mergekit_ext.merge_record import MergeRecord
from mergekit_ext.methods.card_sections.symerge import plot_symerge, summarize_symerge
from mergekit_ext.methods.kinds import Adaptation
from mergekit_ext.methods.registry import (
    MethodInfo,
    MethodReport,
    data_aware_method,
    register_method,
)


def run_symerge(cfg: ExtMergeConfig, out_dir: str, parameters: Any, **options: Any) -> MergeRecord:
    """Validate ``parameters`` and run SyMerge (:func:`mergekit_ext.adaptation.run.run_symerge`)."""
    return run.run_symerge(cfg, out_dir, SyMergeParameters.parse(parameters, "symerge"), **options)


# ---------------------------------------------------------------------------- registration

INFO = MethodInfo(
    name="symerge",
    pretty_name="SyMerge (test-time adaptation)",
    kind=Adaptation(run_symerge),
    needs_calibration=True,
    paper="From Non-Interference to Synergistic Merging via Single-Layer Adaptation (ICML 2026)",
    paper_url="https://arxiv.org/abs/2412.19098",
    parameters_model=SyMergeParameters,
    report=MethodReport("SyMerge", summarize_symerge, plot_symerge, template="symerge"),
)

register_method(INFO, data_aware_method(INFO))
