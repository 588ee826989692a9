"""``qp_projection``'s parameters: those both objectives read, and each objective's own.

The method has two implementations over the shared solve (``qp_solve.py``), chosen by
``objective`` (``docs/methods.md``, section "QP / output-space projection" and its
"The model-output objective"):

- :class:`QPLayerOutputParameters` (``objective: layer_output``, the default): each linear
  fitted to its own output, streamed block by block (``qp_projection.py``);
- :class:`QPModelOutputParameters` (``objective: model_output``): each linear fitted to the
  model's output, whole model in memory (``qp_model_output.py``).

Each parameter is declared once, in the model of the objective that reads it (or in
:class:`QPSharedParameters` when both do). :class:`QPParameters` is the method's whole
declaration (the ``methods`` listing, mergekit's spec, the card's table); its :meth:`parse`
returns the model of the objective the YAML chose, and refuses a parameter that only the
other objective reads, naming it and the objective, unless it is given at its default
(which changes nothing).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, Optional

from pydantic import Field, field_validator

from mergekit_ext.errors import ConfigError
from mergekit_ext.methods.guard import max_norm_ratio_field
from mergekit_ext.methods.parameters import (
    ComputeDtype,
    MethodParameters,
    StatisticsDtype,
    compute_dtype_field,
    statistics_dtype_field,
)

Objective = Literal["layer_output", "model_output"]


class QPSharedParameters(MethodParameters):
    """What both objectives read: the objective itself and the solve's ridge, prior and box
    (``docs/methods.md``, section QP)."""

    objective: Objective = Field(
        "layer_output",
        description="layer_output | model_output: fit each linear to its own output (streamed "
        "block by block), or to the model's output, the paper's objective (whole model in "
        "memory; diagonal basis; causal LMs: the per-token KL to each expert)",
    )
    ridge: float = Field(
        1.0,
        ge=0.0,
        allow_inf_nan=False,
        description="relative ridge: μ = ridge · mean diagonal of the K×K normal matrices, "
        "added to each; it pulls d toward prior",
    )
    bounds: Optional[tuple[float, float]] = Field(
        None,
        description="optional [lo, hi] box on every coefficient d (a true QP); null = unconstrained",
    )
    prior: float = Field(
        1.0,
        allow_inf_nan=False,
        description="the coefficient the ridge pulls d toward, (N_r + μI) d_r = h_r + μ·prior·1: "
        "0 = the base model, 1 = task arithmetic λ=1",
    )
    fallback: Literal["mean", "base", "task_arithmetic"] = Field(
        "mean",
        description="mean | base | task_arithmetic: merge of tensors that are not input-hooked "
        "linears",
    )

    @field_validator("bounds")
    @classmethod
    def _ordered(cls, bounds: Optional[tuple[float, float]]) -> Optional[tuple[float, float]]:
        if bounds is not None and not bounds[0] <= bounds[1]:
            raise ValueError(f"bounds must be [lo, hi] with lo <= hi; got {list(bounds)}")
        return bounds


class QPLayerOutputParameters(QPSharedParameters):
    """``objective: layer_output``: each linear fitted to its own output, per direction of an
    output basis (``docs/methods.md``, section QP; defaults from its sweeps)."""

    basis: Literal["diagonal", "residual_eigen"] = Field(
        "diagonal",
        description="diagonal | residual_eigen: output basis U (identity rows, or eigenvectors "
        "of the residual energy matrix S in descending order, the paper's optimal basis)",
    )
    energy_floor: float = Field(
        0.0,
        ge=0.0,
        allow_inf_nan=False,
        description="directions whose residual energy is below energy_floor · the mean energy "
        "per direction are not fitted and keep d = prior",
    )
    task_weighting: Literal["samples", "energy"] = Field(
        "samples",
        description="samples | energy: tasks count equally per sample (1/N_t), or each task's "
        "Gram is scaled so that every task has the same residual energy at the weight",
    )
    propagate: bool = Field(
        True,
        description="inputs (and residuals) along the already merged layers (merged-path statistics)",
    )
    diagnose_both_bases: bool = Field(
        False, description="also solve in the other basis and report its J and captured energy"
    )
    statistics_dtype: StatisticsDtype = statistics_dtype_field()
    compute_dtype: ComputeDtype = compute_dtype_field()
    max_norm_ratio: float = max_norm_ratio_field()


class QPModelOutputParameters(QPSharedParameters):
    """``objective: model_output``: each linear fitted to the model's output, diagonal basis
    (``docs/methods.md``, "The model-output objective")."""

    output_sketch: int = Field(
        32,
        ge=0,
        description="model_output: random projections of each sample's output (one backward "
        "pass each per linear); 0 = every output coordinate (exact); causal LMs: next tokens "
        "sampled per position (>= 1)",
    )
    output_tokens: Literal["first", "all"] = Field(
        "first",
        description="model_output: the output is the backbone's last hidden state at the "
        "first position (CLS, what classification heads read) or at every unmasked position "
        "(causal LMs: always every position's next-token distribution)",
    )
    output_seed: int = Field(0, ge=0, description="model_output: seed of the output sketches")


#: each objective's parameter model
OBJECTIVE_PARAMETERS: dict[str, type[QPSharedParameters]] = {
    "layer_output": QPLayerOutputParameters,
    "model_output": QPModelOutputParameters,
}


class QPParameters(QPModelOutputParameters, QPLayerOutputParameters):
    """Every ``qp_projection`` parameter (both objectives'), for the listing, mergekit's spec
    and the card; :meth:`parse` gives the chosen objective's own model."""

    @classmethod
    def parse(cls, values: Mapping[str, Any] | None, method: str) -> Any:  # type: ignore[override]
        """The chosen objective's parameters (:data:`OBJECTIVE_PARAMETERS`).

        Raises:
            ConfigError: naming a bad field, or a parameter only the other objective reads
            (given at anything but its default) together with the objective.
        """
        if isinstance(values, QPSharedParameters):
            return values
        # every value against its own declaration first (type, range), whichever objective
        objective = super().parse(values, method).objective
        model = OBJECTIVE_PARAMETERS[objective]
        given = {k: v for k, v in (values or {}).items() if v is not None}
        foreign = [
            f"{name} = {value!r}"
            for name, value in given.items()
            if name in cls.model_fields
            and name not in model.model_fields
            and value != cls.model_fields[name].get_default()
        ]
        if foreign:
            other = next(o for o in OBJECTIVE_PARAMETERS if o != objective)
            them = "them" if len(foreign) > 1 else "it"
            raise ConfigError(
                f"{method}: parameters {', '.join(foreign)}: used only with objective: {other}, "
                f"but the objective is {objective}; remove {them} (or set objective: {other}) "
                "in the YAML's parameters: section"
            )
        return model.parse(given, method)
