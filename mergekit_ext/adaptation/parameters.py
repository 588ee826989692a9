"""SyMerge's parameters, declared once (``docs/methods.md``, section SyMerge).

Their own module so that the adaptation code (``run.py``) and the method's declaration
(``symerge.py``) both import them without importing each other.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from mergekit_ext.methods.parameters import MethodParameters


class SyMergeParameters(MethodParameters):
    """SyMerge's parameters (``docs/methods.md``, section SyMerge)."""

    lr: float = Field(
        1e-2,
        gt=0.0,
        allow_inf_nan=False,
        description="Adam learning rate for λ (and the task layers)",
    )
    task_layer_lr: Optional[float] = Field(
        None,
        gt=0.0,
        allow_inf_nan=False,
        description="Adam learning rate for the task layers; null: 1e-4 for a causal LM's block "
        "task layer (a last block diverges at lr's 1e-2), lr otherwise",
    )
    epochs: int = Field(
        100,
        ge=1,
        description="epochs; each takes one batch and one step per task (the reference uses 500)",
    )
    batch_size: int = Field(32, ge=1, description="samples per step")
    init_lambda: Optional[float] = Field(
        None,
        allow_inf_nan=False,
        description="initial λ; null: 0.3 (task arithmetic's coefficient) with the "
        "task_arithmetic body, 0 with a data-aware body (epoch 0 is then that body's merge)",
    )
    body: Literal["task_arithmetic", "regmean", "chain_of_merges"] = Field(
        "task_arithmetic",
        description="the merge SyMerge adapts around: task_arithmetic adapts θ_0 + Σ λ_k Δ_k; "
        "regmean | chain_of_merges first merge the body with that method (same calibration "
        "data, body_parameters) and adapt W_body + Σ λ_k (W_k − W_body)",
    )
    body_parameters: dict[str, Any] = Field(
        default_factory=dict,
        description="parameters of the body's merge method (e.g. {propagate: true})",
    )
    clamp: bool = Field(True, description="clamp λ to [0, 1] after every step")
    target: Literal["hard", "soft"] = Field(
        "hard",
        description="hard: cross-entropy to the expert's argmax (reference filter) | soft: KL to "
        "its softmax",
    )
    confidence_top_p: Optional[float] = Field(
        None,
        gt=0.0,
        le=1.0,
        description="learn only from this fraction of each batch where the expert is most confident",
    )
    task_layer: str = Field(
        "head", description="head | last_block | a module name: the layer adapted per task"
    )
    seed: int = Field(0, description="seed of the data split, batches and task order")
    teacher_top_k: Optional[int] = Field(
        256,
        ge=1,
        description="causal LMs: keep each position's teacher distribution as its k most likely "
        "tokens plus one bucket for the rest, and fit the student's KL to that (memory grows "
        "with k, not the vocabulary); null keeps the full distribution",
    )
    logit_chunk_tokens: int = Field(
        512,
        ge=1,
        description="causal LMs with teacher_top_k: positions whose logits are formed at a time "
        "(recomputed in the backward pass), so memory grows with this, not batch x length",
    )
    micro_batch_size: Optional[int] = Field(
        None,
        ge=1,
        description="causal LMs: samples per forward/backward pass, their gradients added up "
        "to the batch's (same step, less activation memory); null: the largest that keeps "
        "one micro-batch's activations under 384 MiB",
    )
    heldout_fraction: float = Field(
        0.1,
        ge=0.0,
        lt=1.0,
        description="share of each task's data held back to measure agreement with the expert",
    )
