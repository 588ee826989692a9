"""Block-wise distillation on Chain of Merges (ProDistill's layer-wise objective).

"Scalable Model Merging with Progressive Layer-wise Distillation" (ProDistill), arXiv
2502.12706 (ICML 2025): the merged model is trained layer by layer so that each merged
layer's output, on the inputs the already merged layers give it, matches each expert
layer's output on the same inputs, with a few unlabeled samples per task. Here each block
starts from Chain of Merges' closed-form solution (``chain_of_merges.py``: the same
statistics, solve and result guard), then takes ``distill_steps`` Adam steps on

    Σ_k ω_k ‖f(X_k) − Y_k‖² / ‖Y_k‖²,   ω_k = 1/K

(``distill_token_weight: equal``: each task's term the mean over tokens of
``‖f(x_t) − y_t‖² / ‖y_t‖²`` instead),

``f`` the merged block, ``X_k`` task k's merged-path inputs (one calibration batch per task
and step, in turn), ``Y_k`` the target: expert k's block on expert k's own-path inputs
(``distill_target: expert_path``, ProDistill's "dual inputs": the expert's real features,
so each block also corrects the drift of the merged blocks below it) or on ``X_k``
(``merged_path``: the block's own error). The executor runs the blocks and adds the
tasks' gradients in task order (:mod:`mergekit_ext.executor.refine`); this module only
does tensor arithmetic: the parametrization, Adam, the guard. What is trained
(``distill_train``; the embeddings before the first block, ``distill_embeddings``; each
block's biases and norms, ``distill_vectors``), the first block's extra steps
(``distill_first_block_factor``), the defaults and the measurements behind them:
``docs/methods.md``, section "Block-wise distillation".

The optimizer works on float32 master weights whatever ``compute_dtype`` the block passes
run in; after every step each trained tensor is kept within ``distill_max_norm_ratio`` of
the largest expert's norm (the range the result guard accepts without a warning); the result is
kept only where it lowers the ω-weighted calibration error of the block (as written) by at
least ``distill_min_gain`` of the start's, and the result guard (norm over the largest
expert's) checks it as it checks CoM's groups.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from mergekit_ext.methods.card_sections.block_distillation import distillation_report
from mergekit_ext.methods.chain_of_merges import ChainOfMergesMethod, ChainOfMergesParameters
from mergekit_ext.methods.guard import NORM_RATIO_WARN, guard_group, norm_ratios
from mergekit_ext.methods.kinds import Layerwise
from mergekit_ext.methods.layerwise import BlockRefinement, BlockToRefine
from mergekit_ext.methods.registry import MethodInfo, data_aware_method, register_method

LOG = logging.getLogger(__name__)

Trained = Literal["weights", "lowrank"]
Target = Literal["expert_path", "merged_path"]
Schedule = Literal["constant", "cosine"]
TokenWeight = Literal["energy", "equal"]


class BlockDistillationParameters(ChainOfMergesParameters):
    """CoM's parameters (the start) plus the distillation's."""

    distill_steps: int = Field(
        200,
        ge=0,
        le=100_000,
        description="Adam steps per block (each: one calibration batch of every task, in turn); "
        "0 gives Chain of Merges",
    )
    distill_first_block_factor: int = Field(
        3,
        ge=1,
        le=100,
        description="the first block takes this many times distill_steps: its start error "
        "is the largest (the embeddings before it are merged by the fallback) and every "
        "later block starts from what it leaves",
    )
    distill_lr: float = Field(
        0.1,
        gt=0.0,
        le=10.0,
        allow_inf_nan=False,
        description="Adam step size of each linear, as a fraction of the RMS of its start's "
        "change from the base (W_CoM − W_0), so one value serves full fine-tunes and LoRA",
    )
    distill_train: Trained = Field(
        "weights",
        description="what is trained: weights (every entry of the block's linears) | lowrank "
        "(a rank-distill_rank correction B·A added to each linear)",
    )
    distill_rank: int = Field(
        8, ge=1, le=4096, description="distill_train: lowrank: rank of each linear's correction"
    )
    seed: int = Field(0, ge=0, description="seed of the low-rank correction's initial A")
    distill_target: Target = Field(
        "expert_path",
        description="each task's target: expert_path (expert k's block output on its own "
        "path's inputs, the expert's real features: each block also corrects the drift of "
        "the merged blocks below it, ProDistill's dual inputs) | merged_path (expert k's "
        "block on the merged block's inputs: the block's own error only)",
    )
    distill_token_weight: TokenWeight = Field(
        "energy",
        description="how the block-output error (the loss, distill_min_gain's measure and the "
        "diagnostics) weighs a batch's tokens: energy (‖f(X) − Y‖² / ‖Y‖², each token by "
        "its share of ‖Y‖²: in an LLM's middle blocks the first position, the attention "
        "sink, holds most of it) | equal (each token's ‖f(x_t) − y_t‖² / ‖y_t‖², averaged) "
        "(docs/methods.md)",
    )
    distill_embeddings: bool = Field(
        True,
        description="with distill_target: expert_path, also train the tensors before the "
        "first block (patch and position embeddings, CLS token, embedding LayerNorm; never an "
        "LM's token embedding table) with the first block: the merged path then starts "
        "where the experts' do (merged_path: not trained, the targets would move with them)",
    )
    distill_vectors: bool = Field(
        False,
        description="also train each block's vectors (the linears' biases, the norms' "
        "weights and biases), merged as CoM merges non-linear tensors otherwise (off: "
        "no measured gain, docs/methods.md)",
    )
    distill_min_gain: float = Field(
        0.02,
        ge=0.0,
        lt=1.0,
        allow_inf_nan=False,
        description="keep a block's steps only where they lower its mean calibration error "
        "(the weights as written) by at least this fraction, else Chain of Merges' solution: "
        "a smaller gain is within what the steps change on inputs the calibration data does "
        "not cover (docs/methods.md)",
    )
    distill_checkpoints: int = Field(
        0,
        ge=0,
        le=10_000,
        description="measure the block's calibration error (the weights as written) at this "
        "many evenly spaced points of its steps and keep the lowest-error weights among "
        "them and the end's: under the constant step the error oscillates (docs/methods.md); "
        "costs one error pass per point and one more copy of the block's linears; 0: the "
        "end's weights",
    )
    distill_schedule: Schedule = Field(
        "constant",
        description="step size over the steps: constant | cosine (from distill_lr down to 0)",
    )
    distill_max_norm_ratio: float = Field(
        NORM_RATIO_WARN,
        ge=1.0,
        description="after every step each trained tensor is kept within this multiple of "
        "the largest expert's Frobenius norm (or of its start's, where CoM's solution is "
        "further out), by shortening the step back toward the start: by default the range "
        "the result guard accepts without a warning; .inf: no limit (docs/methods.md)",
    )

    @model_validator(mode="after")
    def _needs_merged_path(self) -> BlockDistillationParameters:
        if not self.propagate:
            raise ValueError(
                "propagate: false is not supported: block_distillation trains each block on "
                "the merged-path inputs (remove propagate, or set it to true)"
            )
        return self


def _rms(t: torch.Tensor) -> float:
    return float(t.double().pow(2).mean().sqrt()) if t.numel() else 0.0


# The norm limit is met this far inside: the weights are rounded to float32 after the step
# is shortened, and may be rounded again as written (bfloat16 lifts a norm by ~1e-6
# relative), while the guard compares the written norm with its warning line exactly.
_LIMIT_MARGIN = 1e-3


def _dot(a: torch.Tensor, b: torch.Tensor) -> float:
    """``⟨a, b⟩`` summed in float64 (the product float32: no float64 copy of a linear)."""
    return float(a.mul(b).sum(dtype=torch.float64))


# A refinement's float32 copies of one block's linears: the start, the base (the step
# sizes' reference), the trained correction, two Adam moments, the weights of a step, the
# gradient sums and one task's gradient (docs/methods.md, "Block-wise distillation"). Seven,
# without the base, fell 2.5 GB (19%) short of the peak at Llama-3-8B widths (issue #51).
REFINE_LINEAR_COPIES = 8


class BlockDistillation(BlockRefinement):
    """Adam on the block's linears from CoM's solution (one object per merge)."""

    def __init__(self, p: BlockDistillationParameters, method: str) -> None:
        self.p = p
        self.method = method
        # read by the executor (executor/refine.py) when it builds each block's targets
        self.target: str = p.distill_target
        self.token_weight: str = p.distill_token_weight
        # read by the executor: the first block also trains the embeddings before it
        self.trains_pre_block = p.distill_embeddings and p.distill_target == "expert_path"
        self.trains_vectors = p.distill_vectors

    def _parts(
        self, block: BlockToRefine
    ) -> tuple[dict[str, list[torch.Tensor]], dict[str, float]]:
        """The trained tensors per weight and each weight's step size."""
        p = self.p
        parts: dict[str, list[torch.Tensor]] = {}
        lrs: dict[str, float] = {}
        generator = torch.Generator().manual_seed(p.seed)
        for n, w in block.start.items():
            # the step: a fraction of how far CoM moved this linear from the base; a linear
            # CoM left at the base (no task changed it) is not trained
            scale = _rms(w - block.base[n])
            lrs[n] = p.distill_lr * scale
            if p.distill_train == "weights" or w.dim() != 2:
                parts[n] = [torch.zeros_like(w)]
            else:
                r = min(p.distill_rank, *w.shape)
                a = torch.randn(r, w.shape[1], generator=generator, dtype=torch.float32)
                parts[n] = [torch.zeros(w.shape[0], r), (a / math.sqrt(w.shape[1])).to(w.device)]
        return parts, lrs

    def _weights(
        self, start: dict[str, torch.Tensor], parts: dict[str, list[torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        """The trained tensors now: the start plus each correction (float32)."""
        return {
            n: (start[n] + self._correction([t.detach() for t in parts[n]])).contiguous()
            for n in start
        }

    @staticmethod
    def _correction(parts: list[torch.Tensor]) -> torch.Tensor:
        return parts[0] if len(parts) == 1 else parts[0] @ parts[1]

    def _norm_limits(
        self, block: BlockToRefine, names: Sequence[str]
    ) -> dict[str, tuple[float, float]]:
        """Per trained tensor, ``(limit², ‖start‖²)``: the largest Frobenius norm the steps
        may give it is ``distill_max_norm_ratio`` times its largest expert's, or its start's
        where CoM's solution is further out (an explicit ridge): the steps never take a
        tensor further out than they found it."""
        limits = {}
        for n in names:
            reference = block.expert_norms.get(n, 0.0)
            limit = self.p.distill_max_norm_ratio * reference * (1.0 - _LIMIT_MARGIN)
            if reference > 0.0 and math.isfinite(limit):
                s2 = _dot(block.start[n], block.start[n])
                limits[n] = (max(limit * limit, s2), s2)
        return limits

    def _keep_in_range(
        self,
        start: dict[str, torch.Tensor],
        parts: dict[str, list[torch.Tensor]],
        limits: dict[str, tuple[float, float]],
    ) -> list[str]:
        """Shorten each correction ``C`` that took its weight past its limit back along
        itself to the limit: ``start + α·C`` with ``‖start + α·C‖ = limit`` (``‖start‖ ≤
        limit``, so ``0 ≤ α < 1``). One rule for both parametrizations (``B·A`` scales with
        ``B``); the optimizer's moments stay as they are. Returns the tensors shortened."""
        shortened = []
        with torch.no_grad():
            for n, (limit2, s2) in limits.items():
                correction = self._correction(parts[n])
                # ‖s + αc‖² = ‖s‖² + 2α⟨s, c⟩ + α²‖c‖², summed in float64 without a wide copy
                sc, c2 = _dot(start[n], correction), _dot(correction, correction)
                if s2 + 2.0 * sc + c2 <= limit2:
                    continue
                alpha = (-sc + math.sqrt(max(sc * sc - c2 * (s2 - limit2), 0.0))) / c2
                parts[n][0].mul_(min(max(alpha, 0.0), 1.0))
                shortened.append(n)
        return shortened

    def memory_bytes(
        self,
        blocks: Sequence[Sequence[tuple[int, ...]]],
        merged_hidden: int,
        batch_positions: int,
    ) -> int:
        """The optimizer state and gradient sums of the widest block's linears
        (:data:`REFINE_LINEAR_COPIES` float32 copies), the targets (``merged_path``: as many
        bytes as the merged-path hidden states; ``expert_path``: none, the executor holds the
        expert path's anyway) and the autograd graph of one batch (every linear's input and output
        per position, float32, twice for the elementwise steps between them; attention
        scores not counted)."""
        linear = graph = 0
        for shapes in blocks:
            linear = max(linear, sum(math.prod(int(d) for d in s) for s in shapes) * 4)
            graph = max(graph, sum(int(s[0]) + int(s[-1]) for s in shapes) * 4 * 2)
        targets = merged_hidden if self.target == "merged_path" else 0
        # distill_checkpoints: the lowest-error weights measured so far, one more copy
        copies = REFINE_LINEAR_COPIES + (1 if self.p.distill_checkpoints else 0)
        return copies * linear + targets + graph * batch_positions

    def refine(self, block: BlockToRefine) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        p = self.p
        start = dict(block.start)
        parts, lrs = self._parts(block)
        trained = [n for n in start if lrs[n] > 0.0]
        groups = [
            {"params": [t.requires_grad_(True) for t in parts[n]], "lr": lrs[n]} for n in trained
        ]
        before = block.errors(start)
        limits = self._norm_limits(block, trained)
        # per tensor: the steps after which it was shortened back to its limit
        shortened: dict[str, int] = {}
        losses: list[float] = []
        steps = p.distill_steps * (p.distill_first_block_factor if block.first else 1)
        # the steps after which the error is measured (distill_checkpoints), the end's apart
        points = {
            steps * i // (p.distill_checkpoints + 1) for i in range(1, p.distill_checkpoints + 1)
        }
        points.discard(0)
        # the lowest-error weights measured so far: (mean error, step, errors, weights)
        best: tuple[float, int, dict[str, float], dict[str, torch.Tensor]] | None = None
        if groups and steps:
            optimizer = torch.optim.Adam(groups)
            for step in range(steps):
                if p.distill_schedule == "cosine":
                    # the last steps small: the result is not one noisy batch's step away
                    # from the minimum (each step sees one calibration batch per task)
                    factor = 0.5 * (1.0 + math.cos(math.pi * step / steps))
                    for group, n in zip(optimizer.param_groups, trained):
                        group["lr"] = lrs[n] * factor
                weights = self._weights(start, parts)
                grads, task_losses = block.gradient(weights, step)
                losses.append(sum(task_losses) / max(len(task_losses), 1))
                for n, g in grads.items():
                    if len(parts[n]) == 1:
                        parts[n][0].grad = g
                    else:  # W = start + B A: ∂/∂B = G Aᵀ, ∂/∂A = Bᵀ G
                        b, a = parts[n]
                        b.grad, a.grad = g @ a.detach().T, b.detach().T @ g
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                for n in self._keep_in_range(start, parts, limits):
                    shortened[n] = shortened.get(n, 0) + 1
                if block.progress is not None:
                    block.progress(step + 1, steps, losses[-1])
                if step + 1 in points and step + 1 < steps:
                    del weights, grads  # as at the end: the measured copy is the peak
                    now = self._weights(start, parts)
                    errors = block.errors(now)
                    mean = sum(errors.values()) / max(len(errors), 1)
                    if best is None or mean < best[0]:
                        best = (mean, step + 1, errors, now)
                    del now
            # the last step's copies go before the refined weights are built (the peak)
            del weights, grads
        refined = self._weights(start, parts)
        after = block.errors(refined) if losses else dict(before)
        mean_before = sum(before.values()) / max(len(before), 1)
        mean_after = sum(after.values()) / max(len(after), 1)
        best_step = len(losses)
        if best is not None and best[0] < mean_after:  # ties: the end's weights
            mean_after, best_step, after, refined = best
        best = None
        # kept only where it helps on the calibration data (as written) by a margin: on
        # low-diversity calibration the steps found no gain there (≤ 1%) yet moved the model
        # on held-out text away from CoM's solution (docs/methods.md)
        kept = bool(losses) and mean_after <= (1.0 - p.distill_min_gain) * mean_before
        result = refined if kept else start
        guard = guard_group(
            self.method,
            block.name,
            norm_ratios(result, block.expert_norms),
            p.max_norm_ratio,
        )
        diagnostics = {
            "steps": len(losses),
            # the step whose weights the steps' result is (distill_checkpoints: the lowest
            # measured error; else the last)
            "best_step": best_step,
            "trained": p.distill_train,
            "target": p.distill_target,
            "token_weight": p.distill_token_weight,
            "kept": "refined" if kept else "start",
            "error_before": mean_before,
            "error_after": mean_after if kept else mean_before,
            # what the steps reached, kept or not (not kept: below distill_min_gain)
            "error_refined": mean_after if losses else None,
            "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None,
            # tensors the norm limit held back, with the number of steps it did
            "norm_limited": dict(sorted(shortened.items())),
            "tasks": {
                t: {"error_before": before[t], "error_after": after[t] if kept else before[t]}
                for t in before
            },
            **guard,
        }
        return result, diagnostics


class BlockDistillationMethod(ChainOfMergesMethod):
    """Chain of Merges, then each block distilled against the experts' blocks."""

    name = "block_distillation"
    parameters_model = BlockDistillationParameters

    def block_refinement(self, parameters: Any) -> BlockDistillation:
        return BlockDistillation(self.parse(parameters), self.name)


INFO = MethodInfo(
    name="block_distillation",
    pretty_name="Block-wise distillation on Chain of Merges",
    kind=Layerwise(BlockDistillationMethod()),
    needs_calibration=True,
    paper='"Scalable Model Merging with Progressive Layer-wise Distillation" (ProDistill, '
    "ICML 2025), started from Chain of Merges",
    paper_url="https://arxiv.org/abs/2502.12706",
    parameters_model=BlockDistillationParameters,
    report=distillation_report("block_distillation", "Block-wise distillation"),
)

register_method(INFO, data_aware_method(INFO))
