"""Several processes: the least-squares group merge from sums over disjoint task sets
(:class:`LeastSquaresReduction`, a :class:`~mergekit_ext.methods.layerwise.SumReduction`)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch

from mergekit_ext.errors import TensorError
from mergekit_ext.methods.guard import (
    guard_group,
    norm_ratios,
    warn_output_errors,
)
from mergekit_ext.methods.layerwise import LinearGroup, SumReduction, TaskStatistics
from mergekit_ext.methods.least_squares.group import (
    LeastSquaresSettings,
    _check_statistics,
    _kept_rows,
    _solve_record,
    _stacked_weights,
    _task_output_error,
    _token_rows,
    norm_range,
)
from mergekit_ext.methods.least_squares.measures import (
    covariate_shift_w2,
    shift_covariance,
)
from mergekit_ext.methods.least_squares.solve import (
    FactoredSystem,
    factor_regmean_system,
    factored_solution,
    finish_in_range,
    regmean_add_numerator,
    regmean_add_row_term,
    regmean_add_system,
    regmean_add_task,
    regmean_zero_numerator_sums,
    regmean_zero_sums,
    regmean_zero_system_sums,
    resolve_ridge,
    solve_factored,
    solve_regmean_sums,
    span_solve_applies,
    span_solve_may_apply,
    span_work_pays,
    takes_row_terms,
    task_product,
    task_row_term,
    trace_product,
)
from mergekit_ext.wide_sums import frobenius64

LOG = logging.getLogger(__name__)


class LeastSquaresReduction(SumReduction):
    """:func:`merge_group_least_squares` split over processes (:class:`SumReduction`).

    Takes the same :class:`~.group.LeastSquaresSettings`. Each rank computes its tasks'
    products ``W_k G_k`` and adds its tasks' terms of ``Σ ω_k W_k G̃_k``, ``Σ ω_k G̃_k``,
    ``Σ ω_k`` (and ``Σ ω_k W_k`` with a ridge) when the sums reach it in task order, so they
    equal :func:`regmean_solve`'s bit for bit; the correlation weight ω_k needs only task k's
    own normalized Gram, so it is computed where the task lives. The
    per-task diagnostics (relative output error, covariate shift) are computed by the
    task's rank once the merged weights are known; the group record is the one
    :func:`merge_group_least_squares` writes.

    With α = 1 on plain Grams it takes two rounds, as :func:`regmean_solve` orders its work:
    the system's sums first, factored with the ridge decided on the solving rank; then
    either the numerator's terms or, where :func:`takes_row_terms`, each task's
    :func:`row_term` (the factor broadcast to every rank), whose sum is the merged weight.
    """

    def __init__(self, settings: LeastSquaresSettings) -> None:
        self.settings = settings
        self._stacked: list[torch.Tensor] = []
        self._rows: list[int] = []
        self._chosen: list[TaskStatistics] = []
        self._other: Optional[list[TaskStatistics]] = None
        self._omegas: list[float] = []
        self._grams: list[torch.Tensor] = []
        self._products: list[Optional[torch.Tensor]] = []
        self._references: list[float] = []
        self._norms: list[torch.Tensor] = []
        # α = 1 on plain Grams: the system first (class docstring); set alike on every rank
        self.rounds = (
            2 if settings.reduce_non_diagonal == 1.0 and not settings.use_normalized_gram else 1
        )
        self._first: dict[str, torch.Tensor] = {}  # the first round's totals (solving rank)
        self._factored: Optional[FactoredSystem] = None
        self._by_rows = False

    def _paths(self, group: LinearGroup, n_in: int) -> None:
        path = "merged-path" if self.settings.use_merged_path else "expert-path"
        self._chosen = _check_statistics(
            group.merged_stats if self.settings.use_merged_path else group.expert_stats,
            group,
            n_in,
            self.settings.method,
            path,
            need_normalized=self.settings.use_normalized_gram
            or self.settings.task_weight_needs_normalized_gram,
        )
        other, other_path = (
            (group.expert_stats, "expert-path")
            if self.settings.use_merged_path
            else (group.merged_stats, "merged-path")
        )
        self._other = (
            _check_statistics(
                other, group, n_in, self.settings.method, other_path, False, need_gram=False
            )
            if other
            else None
        )

    def _setup(self, group: LinearGroup) -> None:
        """This rank's weights, checked statistics and task weights (once per group)."""
        if self._chosen:
            return
        self._stacked, self._rows, n_in = _stacked_weights(group, self.settings.method)
        self._paths(group, n_in)
        self._omegas = [
            float(self.settings.task_weight(st)) if self.settings.task_weight else 1.0
            for st in self._chosen
        ]
        if any(not math.isfinite(w) or w < 0.0 for w in self._omegas):
            raise TensorError(
                f"{self.settings.method}: task weights must be finite and non-negative for "
                f"linear group {group.name}; got {self._omegas}"
            )

    def gather_vote(self, group: LinearGroup) -> dict[str, Any]:
        self._setup(group)
        return {
            "rows": _token_rows(self._chosen) is not None,
            "counts": [st.count for st, w in zip(self._chosen, self._omegas) if w > 0.0],
            "outputs": int(self._stacked[0].shape[0]),
            "inputs": int(self._stacked[0].shape[1]),
        }

    def needs_gather(self, votes: Sequence[Any]) -> bool:
        # The span solve (every task kept its rows, with a ridge) needs every task's rows on
        # one rank, which then decides as one process does; the dense solve needs only the
        # sums, each task's Gram formed from its rows where it kept them. With fewer tokens
        # than inputs that is known now; with more, only once the ridge is: two rounds
        # decide after the first (next_round), one round must gather wherever it may pay.
        counts = [n for v in votes for n in v["counts"]]
        n_in = votes[0]["inputs"]
        tokens = sum(counts)
        if not all(v["rows"] for v in votes):
            return False
        if span_solve_applies(
            self.settings.reduce_non_diagonal,
            resolve_ridge(self.settings.ridge, n_in, tokens),
            tokens,
            n_in,
        ):
            return True
        return self.rounds == 1 and span_solve_may_apply(
            self.settings.reduce_non_diagonal,
            self.settings.ridge,
            votes[0]["outputs"],
            n_in,
            counts,
        )

    def prepare(self, group: LinearGroup) -> dict[str, torch.Tensor]:
        self._setup(group)
        # A task that kept its rows gets its Gram formed from them, bit for bit as the
        # single process's dense path forms it
        self._grams = [
            st.gram_normalized if self.settings.use_normalized_gram else st.gram_from_rows()  # type: ignore[misc]
            for st in self._chosen
        ]
        if self.rounds == 1:
            self._products = self._task_products()
        # each task's weight norms (per weight of the group), for the result guard
        # (frobenius64, as the single process's guard: the same sums, the same bits)
        self._norms = [
            torch.tensor(
                [frobenius64(part) for part in torch.split(w, self._rows, dim=0)],
                dtype=torch.float64,
                device=w.device,
            )
            for w in self._stacked
        ]
        device = self._stacked[0].device
        if self.rounds == 1:
            sums = regmean_zero_sums(
                self._stacked[0].shape,
                # auto is resolved in solve from the tokens of every task
                with_weighted_experts=isinstance(self.settings.ridge, str)
                or float(self.settings.ridge) > 0.0,
                device=device,
            )
        else:
            sums = regmean_zero_system_sums(int(self._stacked[0].shape[1]), device=device)
            # weighted tasks, those of them whose rows are their Gram's (row terms), their
            # Σ min(2·N_k, in) (span_work_pays), and the tasks of any weight without rows
            sums["weighted_tasks"] = torch.zeros(4, dtype=torch.float64, device=device)
        sums["expert_norm_max"] = torch.zeros(len(self._rows), dtype=torch.float64, device=device)
        return sums

    def _task_products(self) -> list[Optional[torch.Tensor]]:
        """The products W_k G_k of this rank's tasks, in parallel with the other ranks', from
        the same operands as the single process's (the rows only behind a plain Gram), and
        the output errors' references: each product is dropped once added to the sums."""
        products: list[Optional[torch.Tensor]] = [
            task_product(w, g, None if self.settings.use_normalized_gram else _kept_rows(st))
            for w, g, st in zip(self._stacked, self._grams, self._chosen)
        ]
        self._references = [trace_product(p, w) for p, w in zip(products, self._stacked)]
        return products

    def next_round(self, totals: Mapping[str, torch.Tensor], group: LinearGroup) -> Any:
        if not self._rows:  # as in solve: the group's output rows decide the path too
            self._stacked, self._rows, _ = _stacked_weights(group, self.settings.method)
        self._first = dict(totals)
        tokens = int(round(float(totals["tokens"].sum())))
        self._factored = factor_regmean_system(
            self._first,
            ridge=self.settings.ridge,
            solver=self.settings.solver,
            tokens=tokens,
            name=f"linear group {group.name}",
        )
        weighted, with_rows, product_rows, without_rows = totals["weighted_tasks"].tolist()
        out, n_in = sum(self._rows), int(self._stacked[0].shape[1])
        # a ridge, now known, and every task's rows: the span solve where it pays, on the
        # whole group gathered to one rank (regmean_solve's own decision, so the same bytes)
        gather = (
            without_rows == 0
            and self._factored.ridge > 0.0
            and self.settings.reduce_non_diagonal > 0.0
            and span_work_pays(out, n_in, tokens, int(weighted), int(product_rows))
        )
        by_rows = takes_row_terms(
            self._factored, self.settings.reduce_non_diagonal, out, tokens, with_rows == weighted
        )
        cholesky = self._factored.cholesky
        return {
            "gather": gather,
            "by_rows": by_rows,
            "ridge": self._factored.ridge > 0.0,
            "cholesky": cholesky.cpu() if by_rows and cholesky is not None else None,
        }

    def start_round(self, shared: Any, group: LinearGroup) -> dict[str, torch.Tensor]:
        self._by_rows = bool(shared["by_rows"])
        device = self._stacked[0].device
        if self._by_rows:
            cholesky = shared["cholesky"].to(device)
            parts = [
                task_row_term(w, g, _kept_rows(st), omega, cholesky)
                for w, g, omega, st in zip(self._stacked, self._grams, self._omegas, self._chosen)
            ]
            self._products = [term for term, _ in parts]
            self._references = [reference for _, reference in parts]
        else:
            self._products = self._task_products()
        # auto's range rule may need Σ ω W_k after the solve (finish_in_range), with no ridge too
        weighted = bool(shared["ridge"]) or isinstance(self.settings.ridge, str)
        return regmean_zero_numerator_sums(
            self._stacked[0].shape, with_weighted_experts=weighted, device=device
        )

    def add_task(self, sums: dict[str, torch.Tensor], position: int) -> None:
        weight, gram = self._stacked[position], self._grams[position]
        omega, st = self._omegas[position], self._chosen[position]
        alpha = self.settings.reduce_non_diagonal
        if self.rounds == 1:
            regmean_add_task(
                sums, weight, gram, alpha, omega, self._products[position], count=st.count
            )
        elif "system" in sums:  # the first of two rounds
            regmean_add_system(sums, gram, alpha, omega, st.count)
            counts = sums["weighted_tasks"]
            rows = float(_kept_rows(st) is not None)
            n_in = int(self._stacked[0].shape[1])
            weighted = [1.0, rows, rows * min(2 * st.count, n_in)] if omega > 0.0 else [0.0] * 3
            counts.add_(
                torch.tensor([*weighted, 1.0 - rows], dtype=counts.dtype, device=counts.device)
            )
        elif self._by_rows:
            if omega > 0.0:
                regmean_add_row_term(sums, self._products[position], omega)  # type: ignore[arg-type]
            if "weighted_experts" in sums:  # as weighted_expert_sum adds it, every task
                scratch = torch.empty(weight.shape, dtype=torch.float64, device=weight.device)
                sums["weighted_experts"].add_(scratch.copy_(weight).mul_(omega))
        else:
            regmean_add_numerator(sums, weight, gram, alpha, omega, self._products[position])
        if "expert_norm_max" in sums:
            # a running max, not a sum: the largest expert's norm per weight
            torch.maximum(
                sums["expert_norm_max"], self._norms[position], out=sums["expert_norm_max"]
            )
        if "system" not in sums or self.rounds == 1:
            self._products[position] = None

    def solve(
        self, sums: Mapping[str, torch.Tensor], group: LinearGroup
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        if not self._rows:
            self._stacked, self._rows, _ = _stacked_weights(group, self.settings.method)
        reference = group.experts[0]
        first = self._first if self.rounds == 2 else sums
        n_in = int(first["system"].shape[0])
        tokens = int(round(float(first["tokens"].sum())))
        reference_norms = first["expert_norm_max"].tolist()
        out_dtype = reference[group.weights[0]].dtype
        name = f"linear group {group.name}"
        # auto's range, as the single process's (norm_range): the same reference norms
        target = norm_range(group, self._rows, reference_norms)
        if self.rounds == 1:
            solution = solve_regmean_sums(
                {k: v for k, v in sums.items() if k != "expert_norm_max"},
                ridge=self.settings.ridge,
                tokens=tokens,
                solver=self.settings.solver,
                name=name,
                out_dtype=out_dtype,
                norm_range=target,
            )
        else:
            assert self._factored is not None
            if self._by_rows and self._factored.auto:
                solution = finish_in_range(
                    self._factored,
                    sums["numerator"],
                    lambda: sums["weighted_experts"],
                    target,
                    tokens,
                    out_dtype,
                )
            elif self._by_rows:
                solution = factored_solution(
                    self._factored, sums["numerator"].to(out_dtype), tokens
                )
            else:
                solution = solve_factored(
                    self._factored,
                    dict(sums),
                    name=name,
                    out_dtype=out_dtype,
                    tokens=tokens,
                    norm_range=target,
                )
        parts = torch.split(solution.merged_weight, self._rows, dim=0)
        merged = {
            weight_name: part.to(reference[weight_name].dtype).contiguous()
            for weight_name, part in zip(group.weights, parts)
        }
        guard = guard_group(
            self.settings.method,
            group.name,
            norm_ratios(
                {w: group.as_written(w, merged[w]) for w in group.weights},
                dict(zip(group.weights, reference_norms)),
            ),
            self.settings.max_norm_ratio,
        )
        shift_kind: Optional[str] = None
        if self._other is not None and self._chosen:
            merged_path, expert_path = (
                (self._chosen[0], self._other[0])
                if self.settings.use_merged_path
                else (self._other[0], self._chosen[0])
            )
            shift_kind = shift_covariance(
                merged_path, expert_path, self.settings.full_covariance_max_dim
            )
        diagnostics: dict[str, Any] = {
            "layer": group.name,
            **_solve_record(solution, self.settings.ridge),
            "reduce_non_diagonal": float(self.settings.reduce_non_diagonal),
            "tokens": tokens,
            "input_width": n_in,
            "statistics": "merged_path" if self.settings.use_merged_path else "expert_path",
            "normalized_gram": bool(self.settings.use_normalized_gram),
            "task_weighting": self.settings.task_weighting_label,
            "covariate_shift_covariance": shift_kind,
            **guard,
            "tasks": {},
        }
        return merged, diagnostics

    def task_diagnostics(
        self, group: LinearGroup, merged: Mapping[str, torch.Tensor]
    ) -> dict[str, dict[str, Any]]:
        # as written (the shared weights were broadcast in float32 before the cast)
        merged_weight = torch.cat(
            [group.as_written(w, merged[w].to(self._stacked[0].dtype)) for w in group.weights]
        )
        tasks: dict[str, dict[str, Any]] = {}
        for k, task in enumerate(group.task_names):
            shift: Optional[float] = None
            # W_k G_k of the diagnostic's own (raw) Gram, as the single process does
            output_error = _task_output_error(
                merged_weight,
                self._stacked[k],
                self._chosen[k],
                None if self.settings.use_normalized_gram else self._grams[k],
                None if self.settings.use_normalized_gram else self._references[k],
                group.compute_dtype,
            )
            if self._other is not None:
                merged_path, expert_path = (
                    (self._chosen[k], self._other[k])
                    if self.settings.use_merged_path
                    else (self._other[k], self._chosen[k])
                )
                shift, _ = covariate_shift_w2(
                    merged_path,
                    expert_path,
                    full_covariance_max_dim=self.settings.full_covariance_max_dim,
                )
            tasks[task] = {
                "weight": self._omegas[k],
                "relative_output_error": output_error,
                "covariate_shift_w2": shift,
            }
        warn_output_errors(
            self.settings.method,
            group.name,
            {t: r["relative_output_error"] for t, r in tasks.items()},
        )
        return tasks
