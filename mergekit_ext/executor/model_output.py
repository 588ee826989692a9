"""The whole-model path: fit each linear weight to the model's output.

A method whose :class:`~mergekit_ext.methods.layerwise.StatisticsRequest` carries
``model_output`` (``qp_projection`` with ``objective: model_output``) does not fit a
linear to its own layer's output but to the output of the whole backbone: for the
paper's QP (arXiv 2605.29101) ``J(d) = Σ_j w_j ‖A_j d + b_j‖²`` with ``b_j`` the error of
the model merged so far against task t's expert on sample j and ``A_j`` its Jacobian with
respect to the linear's coefficients, recomputed after every merged linear. That needs, per
linear, one forward pass of every calibration batch through the whole model and one
backward pass per sketch row from the output back to the linear, so the streaming
executor's one-block-at-a-time memory does not apply: this path holds the whole backbone
(float32) and runs it with transformers' own modules (``torch.func.functional_call`` on the
model class's skeleton, as the streaming executor runs its blocks).

The order is the family's: blocks, their linear groups, the linears of a group (e.g.
``q, k, v, o, fc1, fc2``), one linear at a time. Before the first linear every tensor that
is not a merged linear takes the method's fallback merge (embeddings, norms, biases, the
final norm and pooler), so the output the linears are fitted to is that of the model being
built; the linears not yet merged are at the base. The targets ``f_t(x_j)`` come from each
expert's own backbone, loaded one expert at a time at the start.

Memory: the backbone twice (the merged model, and one expert's while its targets are
computed), the targets, one batch's graph and vector-Jacobian products, the method's dense
system (:func:`~mergekit_ext.executor.model_output_checks.estimate_model_output_memory`); the merge refuses before loading a weight
when that exceeds the available memory. One process only.

Causal LMs: the output is every position's next-token distribution, and the error against
expert t the per-token ``KL(p_t ‖ p)``; its Gauss-Newton form is sketched with next tokens
sampled from the model (:func:`next_token_sketch`), so no Jacobian ever has a vocabulary
dimension; the linear term is the KL's exact gradient.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, Optional

import numpy as np
import torch
from tqdm.auto import tqdm

from mergekit_ext import finite
from mergekit_ext.errors import ExecutionError, ModelInputError
from mergekit_ext.executor.blocks import TaskState, group_name, orient
from mergekit_ext.executor.model_output_checks import VJP_CHUNK
from mergekit_ext.executor.plan import MergePlan
from mergekit_ext.executor.sequential import SequentialExecutor
from mergekit_ext.kl import kl_from_log_probs
from mergekit_ext.merge_record import MergeRecord
from mergekit_ext.methods.layerwise import ModelOutputRequest
from mergekit_ext.models.checkpoint import HEAD_PREFIX, canonical_name

LOG = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------
# The executor


def sketch_seed(seed: int, linear: int, task: int, batch: int) -> int:
    """The seed of one sketch: independent streams per linear, task and batch."""
    return int(np.random.SeedSequence([seed, linear, task, batch]).generate_state(1)[0])


def output_sketch(
    request: ModelOutputRequest,
    shape: torch.Size,
    mask: Optional[torch.Tensor],
    seed: int,
) -> torch.Tensor:
    """``[P, *shape]`` rows ``s_p`` (one per sample in each row: per-sample sketches).

    ``sketch_rows`` 0: the identity over the output coordinates of each sample (``P`` = the
    per-sample output size), so the products are the exact Jacobian rows. Otherwise Gaussian
    of variance ``1/P``, so ``E[SᵀS] = I``. Masked positions (padding) get 0.
    """
    per_sample = int(math.prod(shape[1:]))
    # Built on the CPU whatever the merge's device, from a CPU generator: the same sketch, so
    # the same merge, on every device (the caller moves it)
    if request.sketch_rows == 0:
        eye = torch.eye(per_sample, dtype=torch.float32, device="cpu")
        rows = eye.reshape(per_sample, 1, *shape[1:]).expand(per_sample, *shape).clone()
    else:
        generator = torch.Generator().manual_seed(seed)
        rows = torch.randn(request.sketch_rows, *shape, generator=generator, device="cpu")
        rows /= math.sqrt(request.sketch_rows)
    if mask is not None and len(shape) == 3:
        rows *= mask[None, :, :, None].to(device=rows.device, dtype=rows.dtype)
    return rows


def output_head_name(source: Any) -> str:
    """Canonical name of the output embedding (``@lm_head.weight``) of a causal LM's source."""
    return _output_head_names(source)[0]


def _output_head_names(source: Any) -> tuple[str, Optional[str]]:
    skeleton = source.skeleton
    head = skeleton.get_output_embeddings()
    if head is None:
        raise ModelInputError(f"{source.label}: its class has no output embedding (lm_head)")
    for name, module in skeleton.named_modules():
        if module is head:
            bias = (
                canonical_name(f"{name}.bias", source.backbone_path)
                if getattr(head, "bias", None) is not None
                else None
            )
            return canonical_name(f"{name}.weight", source.backbone_path), bias
    raise ModelInputError(f"{source.label}: its output embedding is not a named module")


def next_token_log_probs(
    hidden: torch.Tensor, head: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``log softmax(h Wᵀ + b)`` (``[B, T, V]``, float32) from the last hidden state (``b``:
    the output embedding's bias, Phi's, or None)."""
    logits = hidden.to(torch.float32) @ head.to(torch.float32).T
    if bias is not None:
        logits = logits + bias.to(torch.float32)
    return torch.log_softmax(logits, dim=-1)


def next_token_sketch(
    hidden: torch.Tensor,
    target_log_probs: torch.Tensor,
    head: torch.Tensor,
    mask: Optional[torch.Tensor],
    rows: int,
    seed: int,
    log_p: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-token KL's Gauss-Newton form, sketched by sampled next tokens.

    Per position, ``KL(p_t ‖ softmax(ℓ + δ)) ≈ KL + gᵀδ + ½ δᵀ H δ`` with ``g = p − p_t`` and
    ``H = diag(p) − p pᵀ`` (exact gradient and Hessian in the logits ``ℓ``). With
    ``M = (I − √p √pᵀ) diag(√p)`` (``MᵀM = H``) and ``b = (p − p_t)/√p`` (``Mᵀ b = g``) this is
    ``½ ‖M δ + b‖²`` plus a constant: the least-squares form ``‖A d + b‖²`` of the QP with
    ``A = M ∂ℓ/∂d``. Sketch rows ``s = e_y/√p_y`` with ``y ~ p`` have ``E[s sᵀ] = I``, so the
    P sampled rows per position (scaled ``1/√P``) estimate ``AᵀA`` without ever forming a
    vocabulary-sized Jacobian: ``Mᵀ s = e_y − p`` (the score of the sampled token), whose
    effect on the hidden state is ``W_y − pᵀW``; the sketched residual is ``s · b =
    1 − p_t(y)/p(y)``. Positions add up within a sample (their scores have mean 0, so the
    cross terms vanish in expectation). The gradient ``g`` itself is exact: ``(p − p_t) W``
    at the hidden state, one more backward row.

    Args:
        hidden: ``[B, T, h]`` last hidden state of the model merged so far.
        target_log_probs: ``[B, T, V]`` the expert's next-token log-probabilities.
        head: ``[V, h]`` the merged output embedding.
        mask: ``[B, T]`` positions that count (None: all).
        rows: sampled tokens per position (P).
        seed: the sampling seed.
        log_p: :func:`next_token_log_probs` of ``hidden`` when the caller has it already.
        bias: the output embedding's bias (it moves the logits, not their gradient at the
            hidden state), or None.

    Returns:
        ``residual`` ``[B, P]`` (float64), the backward rows at the hidden state
        ``[P, B, T, h]`` and the KL's gradient there ``[B, T, h]`` (float32).
    """
    if log_p is None:
        log_p = next_token_log_probs(hidden, head, bias)
    batch, tokens, vocab = log_p.shape
    probs = log_p.exp()
    generator = torch.Generator().manual_seed(seed)
    sampled = torch.multinomial(
        probs.reshape(-1, vocab).cpu(), rows, replacement=True, generator=generator
    )
    sampled = sampled.to(hidden.device).T.reshape(rows, batch, tokens)  # [P, B, T]
    weight = head.to(torch.float32)
    expected = probs @ weight  # [B, T, h]: pᵀW per position
    scale = 1.0 / math.sqrt(rows)
    backward_rows = (weight[sampled] - expected.unsqueeze(0)) * scale
    index = sampled.permute(1, 2, 0)  # [B, T, P]
    ratio = (target_log_probs.gather(-1, index) - log_p.gather(-1, index)).exp()
    per_token = (1.0 - ratio.to(torch.float64)) * scale  # [B, T, P]
    error_grad = (probs - target_log_probs.exp()) @ weight
    if mask is not None:
        keep = mask.to(torch.float32)
        backward_rows = backward_rows * keep[None, :, :, None]
        per_token = per_token * keep[..., None].to(torch.float64)
        error_grad = error_grad * keep[..., None]
    return per_token.sum(1), backward_rows, error_grad


def next_token_kl(
    log_p: torch.Tensor, target_log_probs: torch.Tensor, mask: Optional[torch.Tensor]
) -> float:
    """``Σ_j Σ_τ KL(p_t ‖ p)`` over the unmasked positions of a batch."""
    kl = kl_from_log_probs(target_log_probs, log_p)
    if mask is not None:
        kl = kl * mask.to(kl.dtype)
    return float(kl.double().sum())


class ModelOutputExecutor(SequentialExecutor):
    """Runs a plan whose method fits linears to the model's output (module docstring)."""

    def __init__(self, plan: MergePlan, out_dir: Optional[str], device: torch.device) -> None:
        super().__init__(plan, out_dir, device)
        request = plan.request.model_output
        assert request is not None, "the plan's method does not ask for the model output"
        self.output_request = request
        self.causal_lm = plan.family.causal_lm
        # The whole backbone runs in one functional_call: the real blocks go back in place
        # of the streaming executor's call recorders.
        block_list = self.backbone.get_submodule(plan.layers_path)
        for i, block in enumerate(self.blocks):
            block_list[i] = block
        self.params: dict[str, torch.Tensor] = {}
        self.head_name, self.head_bias_name = (
            _output_head_names(plan.base) if self.causal_lm else (None, None)
        )
        self.head: Optional[torch.Tensor] = None  # the merged output embedding (causal LMs)
        self.head_bias: Optional[torch.Tensor] = None  # its merged bias (Phi), if any

    # ---------------------------------------------------------------------------------

    def run(self) -> MergeRecord:
        with torch.no_grad():
            self._prepare_tasks()
            self.params.update(self._merge_pre_block())
            self._merge_block_others()
            heads: dict[str, torch.Tensor] = {}
            self.params.update(self._merge_post_block(heads))
            self._drop_absent_modules()
            if self.causal_lm:
                self.head = self._head_of(heads, self.params)
                if self.head_bias_name is not None:
                    self.head_bias = heads[self.head_bias_name]
            del heads
            targets = self._targets()
            initial = self._output_error(targets)
            order = [
                (block, group, module)
                for block in self.plan.blocks
                for group in block.groups
                for module in group.modules
            ]
            progress = tqdm(
                order,
                desc=f"{self.method.name} (model output)",
                unit="linear",
                disable=self.plan.options.quiet,
            )
            for index, (block, group, module) in enumerate(progress):
                LOG.info(
                    "model-output fit %d/%d: %s",
                    index + 1,
                    len(order),
                    block.group_weight(module),
                )
                self._merge_linear(index, block, group, module, targets)
            final = self._output_error(targets)
            self._copy_unloaded()
        assert self.writer is not None
        self.writer.finalize()
        self._write_support_files()
        request = self.output_request
        method = self.plan.cfg.method
        section = {
            "layers": self.layer_diagnostics,
            "not_merged": self.not_merged,
            "model_output": {
                "objective": "model_output",
                "output": "next_token_kl" if self.causal_lm else "hidden_state",
                "output_tokens": "all" if self.causal_lm else request.tokens,
                "output_sketch": request.sketch_rows,
                "output_seed": request.seed,
                "output_error_initial": initial,
                "output_error_final": final,
            },
        }
        return MergeRecord(
            method,
            sections={method: section},
            calibration={e.task: e.data.summary() for e in self.experts if e.data is not None},
        )

    # ---------------------------------------------------------------------------------
    # Tensors

    def _merge_block_others(self) -> None:
        """Every block's non-linear tensors take the fallback merge; its linears start at
        the base (they are fitted one by one)."""
        for block in self.plan.blocks:
            linears = block.group_weights
            for name in block.tensors:
                base = self.base.load(name, self.device)
                finite.check_loaded_finite(
                    {name: base}, model=self.base.label, task="base", where=f"layer {block.index}"
                )
                if name in linears:
                    self.params[name] = base
                    continue
                experts = [e.source.load(name, self.device) for e in self.experts]
                self._check_inputs(
                    {name: base}, [{name: w} for w in experts], f"layer {block.index}"
                )
                self.params[name] = self._merge_other(name, base, experts)
                del experts
            self._release()

    def _drop_absent_modules(self) -> None:
        """Backbone modules none of whose parameters the checkpoint has (a ``ViTModel``
        saved without its pooler, ``add_pooling_layer=False``) are removed from the
        skeleton, as transformers' ``forward`` skips them when they are None."""
        for child, module in list(self.backbone.named_children()):
            names = [f"{child}.{n}" for n, _ in module.named_parameters()]
            if names and not any(n in self.params for n in names):
                LOG.info("%s: not in the checkpoint; the forward passes skip it", child)
                setattr(self.backbone, child, None)

    def _expert_params(self, k: int) -> dict[str, torch.Tensor]:
        """Expert ``k``'s own backbone (the base's tensors where it has none, e.g. a pooler)."""
        source = self.experts[k].source
        own = {}
        for name, merged in self.params.items():
            if merged.dtype.is_floating_point and source.provides(name):
                own[name] = source.load(name, self.device)
            else:
                own[name] = self.base.load(name, self.device)
        finite.check_loaded_finite(
            own, model=self.experts[k].label, task=self.experts[k].task, where="the backbone"
        )
        return own

    def _head_of(
        self, heads: Mapping[str, torch.Tensor], backbone: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """The merged output embedding: the merged head, or the merged tensor it is tied to."""
        assert self.head_name is not None
        if self.head_name in heads:
            return heads[self.head_name]
        tied = self.base.tied.get(self.head_name)
        if tied is not None and tied in backbone:
            return backbone[tied]
        raise ModelInputError(
            f"{self.base.label}: its output embedding {self.head_name.removeprefix(HEAD_PREFIX)} "
            "is neither stored nor tied to a merged tensor; the model-output objective needs "
            "the next-token logits"
        )

    def _expert_head(
        self, k: int, own: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Expert ``k``'s output embedding (its own head, the tensor it ties, or the base's)
        and its bias (its own or the base's; None without one)."""
        assert self.head_name is not None
        source = self.experts[k].source
        bias = None
        if self.head_bias_name is not None:
            bias = (
                source.load(self.head_bias_name, self.device)
                if source.has(self.head_bias_name)
                else self.base.load(self.head_bias_name, self.device)
            )
        if source.has(self.head_name):
            return source.load(self.head_name, self.device), bias
        tied = source.tied.get(self.head_name) or self.base.tied.get(self.head_name)
        if tied is not None and tied in own:
            return own[tied], bias
        return self.base.load(self.head_name, self.device), bias

    # ---------------------------------------------------------------------------------
    # Forward passes

    def _hidden(self, params: Mapping[str, torch.Tensor], inputs: Mapping[str, torch.Tensor]):
        """The backbone's last hidden state (``[B, T, h]``, float32)."""
        out = torch.func.functional_call(
            self.backbone, dict(params), args=(), kwargs={**inputs, **self.extra_inputs}
        )
        hidden = getattr(out, "last_hidden_state", None)
        if hidden is None:
            hidden = out[0]
        return hidden.to(torch.float32)

    def _output(
        self,
        params: Mapping[str, torch.Tensor],
        inputs: Mapping[str, torch.Tensor],
        mask: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """The output the linears are fitted to. Encoders: the last hidden state at the first
        position (``[B, h]``) or at every position, padding zeroed (``[B, T, h]``). Causal
        LMs: the last hidden state (``[B, T, h]``), which the head turns into next-token
        log-probabilities (:func:`next_token_log_probs`)."""
        hidden = self._hidden(params, inputs)
        if self.causal_lm:
            return hidden
        if self.output_request.tokens == "first":
            return hidden[:, 0]
        if mask is not None:
            hidden = hidden * mask[..., None].to(hidden.dtype)
        return hidden

    def _targets(self) -> list[list[torch.Tensor]]:
        """Each task's expert outputs on its calibration batches (one expert in memory):
        hidden states, or next-token log-probabilities for causal LMs."""
        targets = []
        for state in self.states:
            own = self._expert_params(state.index)
            head, bias = self._expert_head(state.index, own) if self.causal_lm else (None, None)
            outputs = []
            for inputs, mask in zip(state.inputs, state.masks):
                out = self._output(own, inputs, mask)
                outputs.append(out if head is None else next_token_log_probs(out, head, bias))
            targets.append(outputs)
            del own, head
            self._release()
        return targets

    @staticmethod
    def _sample_weight(state: TaskState) -> float:
        samples = sum(int(next(iter(inputs.values())).shape[0]) for inputs in state.inputs)
        if samples == 0:
            raise ModelInputError(f"task {state.name}: no calibration samples")
        return 1.0 / samples

    def _error(
        self, out: torch.Tensor, target: torch.Tensor, mask: Optional[torch.Tensor]
    ) -> float:
        """One batch's output error: ``Σ_j ‖f(x_j) − f_t(x_j)‖²``, or for causal LMs the
        per-token ``Σ_j Σ_τ KL(p_t ‖ p)`` over unmasked positions."""
        if not self.causal_lm:
            return float((out.detach() - target).double().pow(2).sum())
        assert self.head is not None
        return next_token_kl(
            next_token_log_probs(out.detach(), self.head, self.head_bias), target, mask
        )

    def _output_error(self, targets: list[list[torch.Tensor]]) -> float:
        """``Σ_t (1/N_t) Σ_j error_j`` of the model as it is now (exact; :meth:`_error`)."""
        total = 0.0
        for state, task_targets in zip(self.states, targets):
            weight = self._sample_weight(state)
            for inputs, mask, target in zip(state.inputs, state.masks, task_targets):
                total += weight * self._error(self._output(self.params, inputs, mask), target, mask)
        return total

    def _linearise(
        self,
        module_path: str,
        inputs: Mapping[str, torch.Tensor],
        mask: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One forward pass with the linear's output ``z`` replaced by ``z + ε`` (ε = 0,
        differentiable); returns the output, the linear's input and ε."""
        captured: dict[str, torch.Tensor] = {}

        def hook(
            module: torch.nn.Module, args: tuple[Any, ...], output: torch.Tensor
        ) -> torch.Tensor:
            captured["x"] = args[0].detach()
            perturbation = torch.zeros_like(output, requires_grad=True)
            captured["eps"] = perturbation
            return output + perturbation

        handle = self.backbone.get_submodule(module_path).register_forward_hook(hook)
        try:
            with torch.enable_grad():
                out = self._output(self.params, inputs, mask)
        finally:
            handle.remove()
        if "eps" not in captured:  # pragma: no cover - every block's linears run
            raise ExecutionError(f"the forward pass did not call {module_path}")
        return out, captured["x"], captured["eps"]

    @staticmethod
    def _output_grads(out: torch.Tensor, eps: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``[P, *eps.shape]``: ``∂(s_p · f)/∂ε`` for every sketch row, in batched backward
        passes of up to ``VJP_CHUNK`` rows (``is_grads_batched``)."""
        grads = []
        count = rows.shape[0]
        for start in range(0, count, VJP_CHUNK):
            chunk = rows[start : start + VJP_CHUNK].to(out.dtype)
            (grad,) = torch.autograd.grad(
                out,
                eps,
                grad_outputs=chunk,
                retain_graph=start + VJP_CHUNK < count,
                is_grads_batched=True,
            )
            grads.append(grad.detach())
        return torch.cat(grads)

    def _sketch(
        self,
        seed: int,
        out: torch.Tensor,
        target: torch.Tensor,
        mask: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], float]:
        """``(residual [B, P], rows [P, *out.shape], error gradient or None, error)`` of one
        batch, the error as :meth:`_error` gives it (from the same residual / log-probs).

        Encoders: Gaussian rows ``s_p`` (:func:`output_sketch`) and ``s_p · (f − f_t)``.
        Causal LMs: :func:`next_token_sketch`, and the exact gradient of the KL at the
        hidden state, ``(p − p_t) W`` per position."""
        if not self.causal_lm:
            residual = (out.detach() - target).to(torch.float64)
            rows = output_sketch(
                self.output_request,
                out.shape,
                mask if self.output_request.tokens == "all" else None,
                seed,
            ).to(self.device)
            sketched = torch.einsum("pb...,b...->bp", rows.to(torch.float64), residual)
            return sketched, rows, None, float(residual.pow(2).sum())
        assert self.head is not None
        hidden = out.detach()
        log_p = next_token_log_probs(hidden, self.head, self.head_bias)
        sketched, rows, error_grad = next_token_sketch(
            hidden,
            target,
            self.head,
            mask,
            self.output_request.sketch_rows,
            seed,
            log_p,
            self.head_bias,
        )
        return sketched, rows, error_grad, next_token_kl(log_p, target, mask)

    def _merge_linear(
        self,
        index: int,
        block: Any,
        group: Any,
        module: str,
        targets: list[list[torch.Tensor]],
    ) -> None:
        canonical = block.group_weight(module)
        name = self.plan.output_name(canonical)
        base = self.params[canonical]
        experts = [e.source.load(canonical, self.device) for e in self.experts]
        self._check_inputs(
            {canonical: base}, [{canonical: w} for w in experts], f"layer {block.index}"
        )
        flip = module in group.transposed  # a Conv1D: the fit takes out x in
        fit = self.method.model_output_fit(
            name,
            orient(base, flip),
            [orient(w, flip) for w in experts],
            [s.name for s in self.states],
            self.parameters,
        )
        del experts
        self._release()
        module_path = canonical[: -len(".weight")]
        error_before = 0.0
        for state, task_targets in zip(self.states, targets):
            weight = self._sample_weight(state)
            for b, (inputs, mask, target) in enumerate(
                zip(state.inputs, state.masks, task_targets)
            ):
                out, x, eps = self._linearise(module_path, inputs, mask)
                seed = sketch_seed(self.output_request.seed, index, state.index, b)
                sketched, rows, error_grad, error = self._sketch(seed, out, target, mask)
                error_before += weight * error
                if error_grad is not None:  # one more backward row: the exact gradient
                    rows = torch.cat([rows, error_grad.unsqueeze(0)])
                grads = self._output_grads(out, eps, rows)
                del out, eps, rows
                if error_grad is None:
                    fit.add_batch(x, grads, sketched, weight)
                else:
                    fit.add_batch(x, grads[:-1], sketched, weight, error_grad=grads[-1])
                del x, grads
        merged, diagnostics = fit.solve()
        merged = orient(merged, flip)
        self.check_merged(name, merged, base.shape)
        diagnostics["output_error_before"] = error_before
        self.params[canonical] = self.write(canonical, merged)
        record = {
            "layer": group_name([name], group.label),
            "block": block.index,
            "group": group.label,
            "weights": {name: diagnostics},
        }
        self.layer_diagnostics.append(record)
        LOG.info(
            "%s: J0 %.4g, J(d*) %.4g (linearised, sketched); output error before %.4g",
            name,
            diagnostics.get("J0", math.nan),
            diagnostics.get("J_opt", math.nan),
            error_before,
        )
