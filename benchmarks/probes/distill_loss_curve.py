"""The per-step losses of `block_distillation`'s steps, block by block (issue #51).

Runs ``mergekit-ext run CONFIG OUT`` in this process with the refinement's gradient callback
wrapped, so that every step's task losses are recorded; after each block it writes
``--json`` (one record per block: its steps' mean task loss, the seconds its refinement took,
the calibration error before and after) and prints the mean loss of each pass over the
calibration batches (``--pass-steps`` steps, the batches of a task). ``--blocks N`` stops the
merge after N blocks (nothing is written to OUT then): the first blocks are what a schedule or
step-size question needs, at a fraction of a whole merge's time. ``--errors-every N`` also
measures the block's calibration error (all batches, the weights as written: what
``distill_min_gain`` and ``distill_checkpoints`` decide on) after every N steps.

    python -m benchmarks.probes.distill_loss_curve CONFIG OUT --json curve.json \\
        [--blocks 2] [--pass-steps 8] [--errors-every 50]

The schedule measurements of docs/methods.md ("The step-size schedule on an LM") are this
probe on lm_full's block-distillation YAML with ``distill_schedule`` / ``distill_lr`` set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any, Optional


class _Enough(Exception):
    """Raised after ``--blocks`` blocks to stop the merge."""


def pass_means(losses: list[float], pass_steps: int) -> list[float]:
    """The mean loss of each run of ``pass_steps`` steps (the last may be shorter)."""
    return [
        sum(losses[i : i + pass_steps]) / len(losses[i : i + pass_steps])
        for i in range(0, len(losses), max(1, pass_steps))
    ]


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config")
    parser.add_argument("out")
    parser.add_argument("--json", required=True, help="write the per-block records here")
    parser.add_argument("--blocks", type=int, default=None, help="stop after this many blocks")
    parser.add_argument("--pass-steps", type=int, default=8, help="steps per printed mean")
    parser.add_argument(
        "--errors-every", type=int, default=0, help="the calibration error every N steps (0: no)"
    )
    args = parser.parse_args(argv)

    import mergekit_ext.methods.block_distillation as bd
    from mergekit_ext.cli import main as cli

    records: list[dict[str, Any]] = []
    refine = bd.BlockDistillation.refine

    def recording(self: Any, block: Any) -> Any:
        losses: list[float] = []
        errors: list[tuple[int, float]] = []  # (steps taken, mean calibration error)
        gradient = block.gradient

        def step(weights: Any, index: int) -> Any:
            if args.errors_every and index and index % args.errors_every == 0:
                measured = block.errors(weights)
                errors.append((index, sum(measured.values()) / max(len(measured), 1)))
            grads, task_losses = gradient(weights, index)
            losses.append(sum(task_losses) / max(len(task_losses), 1))
            return grads, task_losses

        start = time.perf_counter()
        result = refine(self, dataclasses.replace(block, gradient=step))
        record = {
            "block": block.name,
            "seconds": time.perf_counter() - start,
            "error_before": result[1]["error_before"],
            "error_refined": result[1].get("error_refined"),
            "steps": result[1].get("steps"),
            "errors": errors,
            "losses": losses,
        }
        records.append(record)
        with open(args.json, "w", encoding="utf-8") as fp:
            json.dump(records, fp)
        means = ", ".join(f"{m:.3g}" for m in pass_means(losses, args.pass_steps))
        if errors:
            means += "; errors: " + ", ".join(f"{i}: {e:.4g}" for i, e in errors)
        print(
            f"{block.name}: {len(losses)} steps in {record['seconds']:.1f}s, error "
            f"{record['error_before']:.4g} -> {record['error_refined']}; pass means: {means}",
            flush=True,
        )
        if args.blocks is not None and len(records) >= args.blocks:
            raise _Enough
        return result

    bd.BlockDistillation.refine = recording  # type: ignore[method-assign]
    try:
        cli(["run", args.config, args.out], standalone_mode=False)
    except (_Enough, SystemExit):
        # the CLI reports the stop as an error and exits (nothing written to OUT)
        if args.blocks is None or len(records) < args.blocks:
            raise
        print(f"stopped after {len(records)} blocks on purpose; records in {args.json}")
    finally:
        bd.BlockDistillation.refine = refine  # type: ignore[method-assign]


if __name__ == "__main__":
    main(sys.argv[1:])
