"""QP with the paper's *model-output* objective, as an offline prototype on the vision suite.

The executor's ``qp_projection`` fits each linear weight to its own layer output:
``J_l(d) = Σ_j ‖δ(d) x_j + b_j‖²`` with ``b_j = (W_0 − W_t) x_j``. The paper (arXiv
2605.29101) states the same QP at the MODEL'S output: ``J(d) = Σ_j ‖A_j d + b_j‖²`` with
``b_j = f(x_j) − f_t(x_j)`` the current model's error against task t's expert and ``A_j`` the
linearised effect of each masked update on the output, recomputed after each merged layer.
For the diagonal basis, with ``z`` the linear's output (tokens x m) and ``g_o = ∂f_o/∂z``::

    A_j[o, (r, k)] = Σ_tok g_o[tok, r] · (Δ_k x_tok)[r]

so one vector-Jacobian product per output coordinate o (batched over all samples, which
are independent) gives every column. The directions no longer separate (the Jacobian mixes
output rows), so the normal matrix is dense ``mK x mK``; it is solved with the same ridge,
prior and box as the executor's method. Layers are merged in forward order; each weight is
linearised at the model merged so far (the not-yet-merged weights at the base, every other
tensor at the experts' mean, as the executor's ``fallback: mean``).

This does not fit the streaming executor: the executor holds one block and per-task
*Grams* (``Σ x xᵀ``), whereas ``A_j`` needs every sample's activations and a backward pass
through all later blocks for each output coordinate. It is measured here, end to end on the
suite's own scoring, to decide whether that redesign is worth it:

    python -m benchmarks.qp_model_output --cache-dir /tmp/wudi_bench/cache --threads 1
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import sys
import tempfile
import time
from typing import Any, Optional

import numpy as np
import torch

from benchmarks.cache import default_cache_dir
from benchmarks.run import configure_process, make_suite
from benchmarks.vision_suite import image_processor, to_pixel_values
from mergekit_ext.methods import qp_projection as qp

LOG = logging.getLogger("benchmarks.qp_model_output")

LINEARS = (  # transformers 5 ViT names, in forward order
    "attention.q_proj",
    "attention.k_proj",
    "attention.v_proj",
    "attention.o_proj",
    "mlp.fc1",
    "mlp.fc2",
)


def calibration_pixels(suite: Any, task: str) -> torch.Tensor:
    """The same images as the suite's calibration folder (same seed and order)."""
    data = suite.task(task)
    n = suite.settings.calibration_samples
    order = np.random.default_rng(suite.settings.seed).permutation(len(data.train_inputs))
    return to_pixel_values(data.train_inputs[order[:n]])


def cls_output(model: Any, pixels: torch.Tensor) -> torch.Tensor:
    return model(pixel_values=pixels).last_hidden_state[:, 0]


def output_jacobian_design(
    model: Any,
    linear: torch.nn.Linear,
    pixels: torch.Tensor,
    task_vectors: list[torch.Tensor],
    sketch: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``A`` ``[B, P, m, K]`` (see the module docstring) and the model output ``[B, O]``.

    ``sketch``: ``[P, B, O]`` Gaussian rows with variance 1/P (an independent sketch per
    sample, ``E[SᵀS] = I``), so that P vector-Jacobian products stand for the O exact ones;
    None: the O coordinates (exact, P = O)."""
    captured: dict[str, torch.Tensor] = {}

    def hook(module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        captured["x"] = inputs[0].detach()
        perturbation = torch.zeros_like(output, requires_grad=True)
        captured["eps"] = perturbation
        return output + perturbation

    handle = linear.register_forward_hook(hook)
    try:
        out = cls_output(model, pixels)
    finally:
        handle.remove()
    x, eps = captured["x"], captured["eps"]  # [B, T, in], [B, T, m]
    # P_k = Δ_k x per token: [K, B, T, m]
    projected = torch.stack([x @ tv.T.to(x.dtype) for tv in task_vectors])
    if sketch is None:
        sketch = torch.eye(out.shape[1])[:, None, :].expand(-1, out.shape[0], -1)
    num_rows = sketch.shape[0]
    design = torch.empty(
        pixels.shape[0], num_rows, eps.shape[-1], len(task_vectors), dtype=torch.float32
    )
    for i in range(num_rows):
        (grad,) = torch.autograd.grad((out * sketch[i]).sum(), eps, retain_graph=i + 1 < num_rows)
        design[:, i] = torch.einsum("btr,kbtr->brk", grad, projected)
    return design, out.detach()


def merge_model_output(
    base: Any,
    experts: list[Any],
    pixels: list[torch.Tensor],
    *,
    ridge: float,
    prior: float,
    bounds: Optional[tuple[float, float]],
    sketch_rows: Optional[int] = None,
    seed: int = 0,
) -> tuple[Any, list[dict[str, Any]]]:
    """The sequential model-output QP (diagonal basis); returns the merged body and per-weight
    diagnostics (model-output J before/after, J of task arithmetic's d = 1)."""
    merged = copy.deepcopy(base).eval()
    base_params = dict(base.named_parameters())
    expert_params = [dict(e.named_parameters()) for e in experts]
    linear_names = {f"layers.{i}.{n}.weight" for i in range(len(base.layers)) for n in LINEARS}
    with torch.no_grad():  # every other tensor: the experts' mean (fallback: mean)
        for name, param in merged.named_parameters():
            if name not in linear_names:
                param.copy_(torch.stack([p[name] for p in expert_params]).mean(0))
    with torch.no_grad():
        targets = [cls_output(e, x) for e, x in zip(experts, pixels)]
    all_pixels = torch.cat(pixels)
    counts = [x.shape[0] for x in pixels]
    sample_weight = torch.cat([torch.full((n,), 1.0 / n) for n in counts]).double()
    target = torch.cat(targets).double()
    diagnostics = []
    for layer_index in range(len(base.layers)):
        for linear_name in LINEARS:
            name = f"layers.{layer_index}.{linear_name}.weight"
            module = merged.get_submodule(f"layers.{layer_index}.{linear_name}")
            w0 = base_params[name].detach().double()
            task_vectors = [p[name].detach().double() - w0 for p in expert_params]
            sketch = None
            if sketch_rows is not None:
                generator = torch.Generator().manual_seed(seed + len(diagnostics))
                sketch = torch.randn(sketch_rows, *target.shape, generator=generator) / math.sqrt(
                    sketch_rows
                )
            design, out = output_jacobian_design(
                merged, module, all_pixels, [tv.float() for tv in task_vectors], sketch
            )
            b = out.double() - target  # [B, O]
            if sketch is not None:
                b = torch.einsum("pbo,bo->bp", sketch.double(), b)  # S b, matching S A
            flat = design.reshape(design.shape[0], design.shape[1], -1).double()  # [B, O, mK]
            weighted = flat * sample_weight.sqrt()[:, None, None]
            rows = weighted.reshape(-1, weighted.shape[-1])
            normal = rows.T @ rows
            rhs = -(rows.T @ (b * sample_weight.sqrt()[:, None]).reshape(-1))
            energy = float((b.pow(2).sum(-1) * sample_weight).sum())
            mu = ridge * float(normal.diagonal().mean())
            m, k = design.shape[2], design.shape[3]
            system = normal + mu * torch.eye(m * k, dtype=normal.dtype)
            if bounds is None:
                d = torch.linalg.solve(system, rhs + mu * prior)
            else:
                d, _ = qp.solve_box_qp(system[None], (rhs + mu * prior)[None], *bounds)
                d = d[0]

            def objective(vec: torch.Tensor, normal=normal, rhs=rhs, energy=energy) -> float:
                return float(vec @ normal @ vec - 2 * vec @ rhs + energy)

            d = d.reshape(m, k)
            with torch.no_grad():
                module.weight.copy_((w0 + qp.merged_update(task_vectors, d)).to(module.weight))
            diagnostics.append(
                {
                    "weight": name,
                    "J0": energy,
                    "J_opt_linearised": objective(d.reshape(-1)),
                    "J_task_arithmetic_linearised": objective(torch.ones(m * k, dtype=d.dtype)),
                    "d_mean": float(d.mean()),
                    "d_min": float(d.min()),
                    "d_max": float(d.max()),
                }
            )
            LOG.info(
                "%s: J0 %.4g, J(d*) %.4g, J(1) %.4g, mean d %.3f",
                name,
                energy,
                diagnostics[-1]["J_opt_linearised"],
                diagnostics[-1]["J_task_arithmetic_linearised"],
                diagnostics[-1]["d_mean"],
            )
    return merged, diagnostics


@torch.no_grad()
def output_error(model: Any, experts: list[Any], pixels: list[torch.Tensor]) -> float:
    """``Σ_t (1/N_t) Σ_j ‖f(x_j) − f_t(x_j)‖²``: the model-output J of a whole merge."""
    return float(
        sum(
            (cls_output(model, x) - cls_output(e, x)).double().pow(2).sum(-1).mean()
            for e, x in zip(experts, pixels)
        )
    )


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default=default_cache_dir())
    parser.add_argument("--out", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--samples", type=int, default=None, help="calibration images per task (default: all)"
    )
    parser.add_argument(
        "--sketch", type=int, default=None, help="random VJP rows per sample (default: exact)"
    )
    parser.add_argument("--smoke", action="store_true", help="the tiny smoke suite (code path)")
    parser.add_argument(
        "--settings",
        nargs="+",
        default=["ridge=1e-6,prior=0", "ridge=1e-2,prior=1", "ridge=1e-6,prior=0,bounds=0:1"],
        help="ridge=..,prior=..[,bounds=lo:hi] per merge",
    )
    args = parser.parse_args(argv)
    configure_process(args.threads)
    import transformers

    suite = make_suite("vision", args.cache_dir, args.smoke)
    base_dir, _ = suite.base()
    experts = {t: suite.expert("full", t) for t in suite.tasks}

    def load(folder: str) -> Any:
        return transformers.ViTModel.from_pretrained(folder, add_pooling_layer=False).eval()

    base = load(base_dir)
    expert_models = [load(e.body) for e in experts.values()]
    pixels = [calibration_pixels(suite, t)[: args.samples] for t in suite.tasks]
    rows = []
    with torch.no_grad():  # task arithmetic λ=1 on every tensor, as mergekit's
        ta = copy.deepcopy(base)
        for name, param in ta.named_parameters():
            base_value = dict(base.named_parameters())[name]
            param.add_(sum(dict(e.named_parameters())[name] - base_value for e in expert_models))
    with tempfile.TemporaryDirectory() as tmp:
        for label, model in (("pretrained body", base), ("task arithmetic λ=1", ta)):
            model.save_pretrained(os.path.join(tmp, "m"))
            image_processor().save_pretrained(os.path.join(tmp, "m"))
            scores = suite.evaluate_body(os.path.join(tmp, "m"), experts)
            rows.append(
                {
                    "label": label,
                    "scores": scores,
                    "output_J": output_error(model, expert_models, pixels),
                }
            )
        for setting in args.settings:
            options = dict(item.split("=") for item in setting.split(","))
            bounds = None
            if "bounds" in options:
                lo, hi = options["bounds"].split(":")
                bounds = (float(lo), float(hi))
            start = time.perf_counter()
            merged, diag = merge_model_output(
                base,
                expert_models,
                pixels,
                ridge=float(options.get("ridge", 1e-6)),
                prior=float(options.get("prior", 0.0)),
                bounds=bounds,
                sketch_rows=args.sketch,
            )
            seconds = time.perf_counter() - start
            merged.save_pretrained(os.path.join(tmp, "m"))
            image_processor().save_pretrained(os.path.join(tmp, "m"))
            scores = suite.evaluate_body(os.path.join(tmp, "m"), experts)
            rows.append(
                {
                    "label": f"QP model-output (diagonal), {setting}",
                    "scores": scores,
                    "output_J": output_error(merged, expert_models, pixels),
                    "merge_seconds": seconds,
                    "weights": diag,
                }
            )
            LOG.info("%s: %s", setting, scores)
    lines = [
        "### vision suite, QP with the model-output objective (offline prototype)",
        "",
        "Accuracy % per task with each expert's head; output J = Σ_t mean_j ‖f(x_j) − f_t(x_j)‖² "
        "on the calibration images (CLS output).",
        "",
        "| merge | " + " | ".join(suite.tasks) + " | avg | output J | merge s |",
        "|---|" + "---|" * (len(suite.tasks) + 3),
    ]
    for row in rows:
        values = [100 * row["scores"][t] for t in suite.tasks]
        lines.append(
            f"| {row['label']} | "
            + " | ".join(f"{v:.1f}" for v in values)
            + f" | {np.mean(values):.1f} | {row['output_J']:.4g} | "
            + (f"{row['merge_seconds']:.0f}" if "merge_seconds" in row else "")
            + " |"
        )
    lines += [
        "",
        f"Command: `python -m benchmarks.qp_model_output {' '.join(argv or sys.argv[1:])}`",
    ]
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, "qp_model_output_vision" + ("_smoke" if args.smoke else ""))
    with open(stem + ".md", "w", encoding="utf-8") as fp:
        fp.write("\n".join(lines) + "\n")
    # JSON lines, one merge per line: not a benchmark table (those are benchmarks/results/*.json)
    with open(stem + ".jsonl", "w", encoding="utf-8") as fp:
        fp.writelines(json.dumps(row) + "\n" for row in rows)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
