"""The group driver shared with Chain of Merges: checks the statistics, stacks the experts'
weights, solves and records one linear group."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from mergekit_ext.errors import CalibrationError, TensorError
from mergekit_ext.finite import is_finite
from mergekit_ext.methods.guard import (
    expert_norms,
    guard_group,
    norm_ratios,
    warn_output_errors,
)
from mergekit_ext.methods.layerwise import LinearGroup, TaskStatistics
from mergekit_ext.methods.least_squares.in_range import NormRange
from mergekit_ext.methods.least_squares.measures import (
    FULL_COVARIANCE_W2_MAX_DIM,
    covariate_shift_w2,
    relative_output_error,
    relative_output_error_rows,
)
from mergekit_ext.methods.least_squares.solve import (
    RegMeanSolution,
    Ridge,
    Solver,
    regmean_solve,
    resolve_ridge,
    span_solve_applies,
)

LOG = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------
# The group driver shared with Chain of Merges
# --------------------------------------------------------------------------------------


def _check_statistics(
    stats: Optional[Sequence[TaskStatistics]],
    group: LinearGroup,
    n_in: int,
    method: str,
    path: str,
    need_normalized: bool,
    need_gram: bool = True,
) -> list[TaskStatistics]:
    n_tasks = len(group.task_names)
    if stats is None:
        raise CalibrationError(
            f"{method}: no {path} statistics for linear group {group.name}; the executor must "
            "compute them (check the method's statistics_request and the calibration data)"
        )
    if len(stats) != n_tasks:
        raise CalibrationError(
            f"{method}: linear group {group.name} has {n_tasks} tasks but {len(stats)} sets of "
            f"{path} statistics"
        )
    for task, st in zip(group.task_names, stats):
        where = f"{method}: {path} statistics of task {task!r} for linear group {group.name}"
        if st is None:
            raise CalibrationError(f"{where} are missing")
        if st.count <= 0:
            raise CalibrationError(
                f"{where} were accumulated over {st.count} tokens; give that task calibration data"
            )
        if st.rows is not None and (st.rows.ndim != 2 or tuple(st.rows.shape) != (st.count, n_in)):
            st.rows = None  # not this Gram's rows (e.g. counts summed over processes)
        if st.gram is None and st.rows is None and need_gram:
            raise CalibrationError(
                f"{where} keep only moments, but the merge needs the full Gram; the executor "
                "must not apply reference_gram_max_dim to the path a merge uses"
            )
        gram_shape = tuple(st.gram.shape) if st.gram is not None else (n_in, n_in)
        if gram_shape != (n_in, n_in) or tuple(st.mean.shape) != (n_in,):
            raise CalibrationError(
                f"{where}: Gram {gram_shape} / mean {tuple(st.mean.shape)} do not fit "
                f"the group's input width {n_in}"
            )
        if (st.gram is not None and not is_finite(st.gram)) or not is_finite(st.mean):
            raise CalibrationError(f"{where} contain NaN or Inf (overflowing activations?)")
        if need_normalized:
            if st.gram_normalized is None:
                raise CalibrationError(
                    f"{where} lack the Gram of unit-norm inputs (gram_normalized); the executor "
                    "must honour StatisticsRequest(normalized_gram=True)"
                )
            if tuple(st.gram_normalized.shape) != (n_in, n_in):
                raise CalibrationError(
                    f"{where}: gram_normalized is {tuple(st.gram_normalized.shape)}, expected "
                    f"({n_in}, {n_in})"
                )
    return list(stats)


def _stacked_weights(group: LinearGroup, method: str) -> tuple[list[torch.Tensor], list[int], int]:
    """Each task's group weights concatenated along ``out`` (they share the input)."""
    if not group.weights:
        raise TensorError(f"{method}: linear group {group.name} lists no weights")
    n_tasks = len(group.task_names)
    if n_tasks == 0 or len(group.experts) != n_tasks:
        raise TensorError(
            f"{method}: linear group {group.name} has {len(group.experts)} expert weight sets "
            f"for {n_tasks} task names; need one per task and at least one"
        )
    n_in: Optional[int] = None
    rows: list[int] = []
    for weight_name in group.weights:
        reference = group.experts[0].get(weight_name)
        if reference is None:
            raise TensorError(
                f"{method}: task {group.task_names[0]!r} has no tensor {weight_name} "
                f"(linear group {group.name})"
            )
        if reference.ndim != 2:
            raise TensorError(
                f"{method}: {weight_name} (linear group {group.name}) is "
                f"{tuple(reference.shape)}, not a 2-D out x in linear weight"
            )
        if n_in is None:
            n_in = reference.shape[1]
        elif reference.shape[1] != n_in:
            raise TensorError(
                f"{method}: the weights of linear group {group.name} must share an input width; "
                f"{weight_name} has {reference.shape[1]}, {group.weights[0]} has {n_in}"
            )
        rows.append(reference.shape[0])
        base = group.base.get(weight_name) if group.base is not None else None
        if base is not None and base.shape != reference.shape:
            raise TensorError(
                f"shape mismatch for {weight_name}: the base model has {tuple(base.shape)}, "
                f"task {group.task_names[0]!r} has {tuple(reference.shape)}"
            )
    stacked = []
    for task, expert in zip(group.task_names, group.experts):
        parts = []
        for weight_name, n_rows in zip(group.weights, rows):
            w = expert.get(weight_name)
            if w is None:
                raise TensorError(
                    f"{method}: task {task!r} has no tensor {weight_name} (linear group {group.name})"
                )
            if tuple(w.shape) != (n_rows, n_in):
                raise TensorError(
                    f"shape mismatch for {weight_name}: task {task!r} has {tuple(w.shape)}, "
                    f"task {group.task_names[0]!r} has {(n_rows, n_in)}"
                )
            if not is_finite(w):
                raise TensorError(f"{weight_name} of task {task!r} contains NaN or Inf values")
            parts.append(w)
        stacked.append(torch.cat(parts, dim=0))
    assert n_in is not None
    return stacked, rows, n_in


def _kept_rows(st: TaskStatistics) -> Optional[torch.Tensor]:
    """The task's kept input rows when they are its Gram's rows, else None."""
    return st.rows if st.rows is not None and st.rows.shape[0] == st.count else None


def _task_output_error(
    merged: torch.Tensor,
    weight: torch.Tensor,
    st: TaskStatistics,
    raw_gram: Optional[torch.Tensor],
    reference: Optional[float],
    compute_dtype: torch.dtype = torch.float32,
) -> float:
    """One task's relative output error, on the raw inputs, of ``merged`` as written: from
    its kept rows where it has them (fewer tokens than inputs: ``out x in x N`` float64
    products instead of the Gram form's ``out x in x in``); else from ``raw_gram`` (formed
    from the rows when None). ``reference``: ``tr(W_k G_k W_kᵀ)`` where the dense solve
    formed ``W_k G_k`` (:func:`~.solve.trace_product`), else None (formed here)."""
    rows = _kept_rows(st)
    if rows is not None:
        return relative_output_error_rows(merged, weight, rows, reference, compute_dtype)
    gram = raw_gram if raw_gram is not None else st.gram_from_rows()
    return relative_output_error(merged, weight, gram, reference)  # type: ignore[arg-type]


def _token_rows(stats: Sequence[TaskStatistics]) -> Optional[list[torch.Tensor]]:
    """Every task's kept input rows (``TaskStatistics.rows``), or None unless all have them.

    Rows whose count differs from the statistics' token count (statistics reduced from
    several processes, say) are not the Gram's rows: then None, and the Gram path is used.
    """
    rows = [st.rows for st in stats]
    if any(r is None or r.shape[0] != st.count for r, st in zip(rows, stats)):
        return None
    return rows  # type: ignore[return-value]


def _written_dtype(group: LinearGroup) -> Optional[torch.dtype]:
    """The dtype every weight of the group is written in, or None where they differ or the
    group does not say (the solve then keeps the precision the passes call for)."""
    dtypes = {(group.output_dtypes or {}).get(w) for w in group.weights}
    return dtypes.pop() if len(dtypes) == 1 else None


def norm_range(group: LinearGroup, rows: Sequence[int], reference: Sequence[float]) -> NormRange:
    """The group's range for ``ridge: auto`` (:class:`~.in_range.NormRange`), measured as the
    result guard measures it: each linear's part of the stacked merged weight in the
    experts' dtype, rounded as written, over ``reference`` (its largest expert norm)."""
    weights = list(group.weights)
    dtypes = [group.experts[0][w].dtype for w in weights]

    def ratios(merged: torch.Tensor) -> list[float]:
        parts = torch.split(merged, list(rows), dim=0)
        written = {
            w: group.as_written(w, part.to(dtype)) for w, part, dtype in zip(weights, parts, dtypes)
        }
        return list(norm_ratios(written, dict(zip(weights, reference))).values())

    return NormRange(tuple(int(r) for r in rows), tuple(float(r) for r in reference), ratios)


@dataclass(frozen=True, kw_only=True)
class LeastSquaresSettings:
    """How a linear group is merged by the least-squares solve: one set of settings for
    :func:`merge_group_least_squares` and :class:`~.reduction.LeastSquaresReduction` (the
    same merge split over processes); RegMean and CoM each build it from their parameters.

    - ``method``: the method's name in messages and in the merge record.
    - ``use_merged_path``: Grams from ``group.merged_stats`` (CoM ``propagate``) instead of
      ``group.expert_stats`` (RegMean).
    - ``use_normalized_gram``: solve with ``gram_normalized`` (CoM ``normalize``).
    - ``task_weight``: ω_k from the task's statistics on the chosen path (None: ω_k = 1);
      ``task_weight_needs_normalized_gram`` when it reads ``gram_normalized``;
      ``task_weighting_label`` is what the record calls it.
    - ``max_norm_ratio``: the result guard's bound (:mod:`~mergekit_ext.methods.guard`).
    """

    method: str
    reduce_non_diagonal: float
    ridge: Ridge
    solver: Solver
    use_merged_path: bool
    use_normalized_gram: bool
    task_weight: Optional[Callable[[TaskStatistics], float]] = None
    task_weight_needs_normalized_gram: bool = False
    task_weighting_label: str = "uniform"
    full_covariance_max_dim: int = FULL_COVARIANCE_W2_MAX_DIM
    max_norm_ratio: float = math.inf


def merge_group_least_squares(
    group: LinearGroup, settings: LeastSquaresSettings
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Merge one :class:`LinearGroup` by (weighted) RegMean; shared by RegMean and CoM.

    The relative output error is measured on the merged weights as written (cast to
    ``group.output_dtypes``), on the raw Gram of the path the ``settings`` choose (the inputs
    the objective used); the covariate shift W2 whenever ``merged_stats`` are present. The
    result guard (:mod:`~mergekit_ext.methods.guard`) then compares each merged linear's norm
    with the experts' and stops the merge above ``settings.max_norm_ratio``.
    """
    stacked, rows, n_in = _stacked_weights(group, settings.method)
    path = "merged-path" if settings.use_merged_path else "expert-path"
    # Statistics the objective uses; the expert path is checked too when W2 needs it.
    chosen = _check_statistics(
        group.merged_stats if settings.use_merged_path else group.expert_stats,
        group,
        n_in,
        settings.method,
        path,
        need_normalized=settings.use_normalized_gram or settings.task_weight_needs_normalized_gram,
    )
    # W2 compares the two paths of the same task; either may be absent (then no W2).
    if settings.use_merged_path:
        merged_path: Optional[list[TaskStatistics]] = chosen
        expert_path = (
            _check_statistics(
                group.expert_stats,
                group,
                n_in,
                settings.method,
                "expert-path",
                False,
                need_gram=False,
            )
            if group.expert_stats
            else None
        )
    else:
        expert_path = chosen
        merged_path = (
            _check_statistics(
                group.merged_stats,
                group,
                n_in,
                settings.method,
                "merged-path",
                False,
                need_gram=False,
            )
            if group.merged_stats
            else None
        )

    omegas = [float(settings.task_weight(st)) if settings.task_weight else 1.0 for st in chosen]
    if sum(omegas) <= 0.0:
        raise TensorError(
            f"{settings.method}: all task weights are zero for linear group {group.name} "
            f"({omegas}); use task_weighting: uniform"
        )
    # raw Grams may be None where the rows were kept instead (regmean_solve forms them if needed)
    grams = [st.gram_normalized if settings.use_normalized_gram else st.gram for st in chosen]
    # The rank of Σ ω G̃ is at most the tokens behind it (tasks with ω > 0)
    tokens = sum(st.count for st, omega in zip(chosen, omegas) if omega > 0.0)
    raw_rows = _token_rows(chosen)
    span = raw_rows is not None and span_solve_applies(
        settings.reduce_non_diagonal, resolve_ridge(settings.ridge, n_in, tokens), tokens, n_in
    )
    if not span:
        # The n x n solve: the Gram of each task that kept rows, bit for bit as accumulated
        grams = [g if g is not None else st.gram_from_rows() for g, st in zip(grams, chosen)]
    solve_rows = raw_rows
    if raw_rows is not None and settings.use_normalized_gram:
        solve_rows = [
            r / r.norm(dim=1, keepdim=True).clamp_min(torch.finfo(r.dtype).tiny) for r in raw_rows
        ]
    reference_norms = expert_norms(group.experts, group.weights)
    solution = regmean_solve(
        stacked,
        grams,  # type: ignore[arg-type]  # checked non-None above
        settings.reduce_non_diagonal,
        task_weights=omegas,
        ridge=settings.ridge,
        solver=settings.solver,
        name=f"linear group {group.name}",
        keep_references=not settings.use_normalized_gram,  # W_k G_k of the diagnostic's own Gram
        tokens=tokens,
        rows=solve_rows,
        compute_dtype=group.compute_dtype,
        gram_rows=None if settings.use_normalized_gram else [_kept_rows(st) for st in chosen],
        norm_range=norm_range(group, rows, [reference_norms[w] for w in group.weights]),
        written_dtype=_written_dtype(group),
    )
    del solve_rows
    merged_parts = torch.split(solution.merged_weight, rows, dim=0)
    merged = {
        weight_name: part.to(group.experts[0][weight_name].dtype).contiguous()
        for weight_name, part in zip(group.weights, merged_parts)
    }
    # The diagnostics describe the model that ships: the weights rounded as written
    written = {w: group.as_written(w, merged[w]) for w in group.weights}
    written_weight = torch.cat([written[w] for w in group.weights])
    guard = guard_group(
        settings.method,
        group.name,
        norm_ratios(written, reference_norms),
        settings.max_norm_ratio,
    )

    tasks: dict[str, dict[str, Any]] = {}
    shift_kind: Optional[str] = None
    for k, task in enumerate(group.task_names):
        shift: Optional[float] = None
        if merged_path is not None and expert_path is not None:
            shift, shift_kind = covariate_shift_w2(
                merged_path[k],
                expert_path[k],
                full_covariance_max_dim=settings.full_covariance_max_dim,
            )
        output_error = _task_output_error(
            written_weight,
            stacked[k],
            chosen[k],
            None if settings.use_normalized_gram else grams[k],
            solution.references[k] if solution.references is not None else None,
            group.compute_dtype,
        )
        tasks[task] = {
            "weight": omegas[k],
            "relative_output_error": output_error,
            "covariate_shift_w2": shift,
        }
    warn_output_errors(
        settings.method, group.name, {t: rec["relative_output_error"] for t, rec in tasks.items()}
    )
    diagnostics: dict[str, Any] = {
        "layer": group.name,
        **_solve_record(solution, settings.ridge),
        "reduce_non_diagonal": float(settings.reduce_non_diagonal),
        "tokens": tokens,
        "input_width": n_in,
        "statistics": "merged_path" if settings.use_merged_path else "expert_path",
        "normalized_gram": bool(settings.use_normalized_gram),
        "task_weighting": settings.task_weighting_label,
        "covariate_shift_covariance": shift_kind,
        **guard,
        "tasks": tasks,
    }
    return merged, diagnostics


def _solve_record(solution: RegMeanSolution, ridge: Ridge) -> dict[str, Any]:
    """The group record's fields on the solve: conditioning, solver, ridge and why."""
    return {
        "condition_number": solution.condition_number,
        "condition_number_method": solution.condition_number_method,
        "condition_number_unregularized": solution.condition_number_unregularized,
        "solver": solution.solver,
        "ridge": solution.ridge,
        "ridge_setting": ridge if isinstance(ridge, str) else float(ridge),
        "ridge_reason": solution.ridge_reason,
        "norm_ratio_before_ridge": solution.norm_ratio_before_ridge,
    }
