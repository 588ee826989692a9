"""Merge three MiniLM text classifiers into one body and compare it with the experts.

    python examples/minilm_text/demo.py [--method chain_of_merges|ace|...] [--cache-dir DIR]
                                        [--smoke]

1. Builds (first run, a few minutes on a 2-core CPU) or reuses the benchmark's text experts:
   all-MiniLM-L6-v2 fine-tuned on BBC news topics, tweet sentiment and fine-food reviews,
   each with its own head (``benchmarks/suites/text_suite.py``; everything ships in pip packages).
2. Fills the paths into ``merge.yaml`` (next to this script) and merges the three bodies
   with ``mergekit-ext run`` in a subprocess.
3. Prints each task's test accuracy of the merged body (with the task's own head) next to
   the pretrained body's and the expert's.

Everything is cached (experts, merge, scores), so a second run takes seconds.

``--smoke`` is the smallest setting, for CI: the benchmark's smoke text suite (MiniLM cut to
one layer, experts trained for 4 steps, 16 calibration texts of up to 48 tokens, 32 test
examples per task; a minute on a 2-core CPU). The same template, rendering and
``mergekit-ext run`` as the full demo; its accuracies mean nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time

import yaml

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO_ROOT)

from benchmarks.suites.cache import default_cache_dir  # noqa: E402
from benchmarks.suites.merging import run_merge_process  # noqa: E402
from benchmarks.suites.text_suite import TextSuite  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
LOG = logging.getLogger("demo")


def default_method() -> str:
    import mergekit_ext  # noqa: F401
    from mergekit_ext.methods.registry import all_method_names

    return "chain_of_merges" if "chain_of_merges" in all_method_names() else "ace"


def render_config(template_path: str, root: str, method: str, base_dir: str) -> dict:
    """The YAML with absolute paths under ``root``, ``base_dir`` as base model and ``method``."""
    import mergekit_ext  # noqa: F401
    from mergekit_ext.methods.registry import ext_method_info

    with open(template_path, encoding="utf-8") as fp:
        config = yaml.safe_load(fp)
    if method != config["merge_method"]:
        config["merge_method"] = method
        config.pop("parameters", None)  # the template's parameters belong to its own method
    info = ext_method_info(method)
    uses_data = bool(info and info.needs_calibration)
    config["base_model"] = base_dir
    for entry in config["models"]:
        entry["model"] = os.path.join(root, entry["model"])
        if uses_data:
            entry["calibration"]["path"] = os.path.join(root, entry["calibration"]["path"])
        else:
            entry.pop("calibration", None)
    if not uses_data:
        config.pop("calibration", None)
    return config


def cached_json(path: str, key: str, compute) -> dict:
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as fp:
            saved = json.load(fp)
        if saved.get("key") == key:
            return saved["value"]
    value = compute()
    with open(path, "w", encoding="utf-8") as fp:
        json.dump({"key": key, "value": value}, fp, indent=2)
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--method", default=None, help="merge method (default: chain_of_merges, else ace)"
    )
    parser.add_argument("--cache-dir", default=default_cache_dir())
    parser.add_argument("--config", default=os.path.join(HERE, "merge.yaml"))
    parser.add_argument(
        "--smoke", action="store_true", help="smallest setting: checks the merge path (CI)"
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    start = time.perf_counter()
    method = args.method or default_method()
    # absolute: the merge runs in a subprocess with the work folder as its directory
    suite = TextSuite(os.path.abspath(args.cache_dir), smoke=args.smoke)
    base_dir, base_record = suite.base()
    experts = {task: suite.expert("full", task) for task in suite.tasks}
    for task in suite.tasks:
        suite.calibration(task)
    LOG.info("experts ready after %.0fs", time.perf_counter() - start)

    config = render_config(args.config, suite.root, method, base_dir)
    if args.smoke and "calibration" in config:
        # the smoke suite writes fewer, shorter calibration texts than the template asks for
        config["calibration"].update(
            samples=suite.settings.calibration_samples, max_length=suite.settings.max_length
        )
    config_text = yaml.safe_dump(config, sort_keys=False)
    # The method's parameter defaults and the package version are part of the key: a new
    # default (or a new release) must not be answered from an old merge.
    import mergekit_ext
    from mergekit_ext.methods.registry import describe_method

    defaults = json.dumps(describe_method(method)["parameters"], sort_keys=True, default=str)
    key = hashlib.sha256(
        (
            config_text
            + "".join(e.record["hash"] for e in experts.values())
            + defaults
            + mergekit_ext.__version__
        ).encode()
    ).hexdigest()[:16]
    work = os.path.join(suite.root, "demo", method)
    os.makedirs(work, exist_ok=True)

    def merge_and_score() -> dict:
        run = run_merge_process(config, work, os.path.join(work, "merged"))
        if not run.ok:
            raise SystemExit(f"merge failed: {run.status} (log: {run.log_path})")
        LOG.info("merged in %.1fs (peak RSS %.0f MB)", run.wall_seconds, run.peak_rss_mb)
        return {
            "merged": suite.evaluate_body(os.path.join(work, "merged"), experts),
            "wall_seconds": run.wall_seconds,
            "peak_rss_mb": run.peak_rss_mb,
        }

    merged = cached_json(os.path.join(work, "scores.json"), key, merge_and_score)
    references = cached_json(
        os.path.join(suite.root, "demo", "reference_scores.json"),
        base_record["hash"] + "".join(e.record["hash"] for e in experts.values()),
        lambda: {
            "pretrained": suite.evaluate_body(base_dir, experts),
            "expert": {t: suite.evaluate_body(e.body, {t: e})[t] for t, e in experts.items()},
        },
    )

    print(
        f"\nmerge method: {method}  (merge {merged['wall_seconds']:.1f}s, peak RSS {merged['peak_rss_mb']:.0f} MB)"
    )
    print(f"{'task':<18}{'pretrained':>12}{'expert':>10}{'merged':>10}{'merged/expert':>15}")
    for task in suite.tasks:
        pre, exp, mer = (
            references["pretrained"][task],
            references["expert"][task],
            merged["merged"][task],
        )
        print(
            f"{task:<18}{100 * pre:>11.1f}%{100 * exp:>9.1f}%{100 * mer:>9.1f}%{100 * mer / exp:>14.1f}%"
        )
    avg = {
        k: sum(v.values()) / len(v)
        for k, v in (
            ("pre", references["pretrained"]),
            ("exp", references["expert"]),
            ("mer", merged["merged"]),
        )
    }
    print(
        f"{'average':<18}{100 * avg['pre']:>11.1f}%{100 * avg['exp']:>9.1f}%{100 * avg['mer']:>9.1f}%"
    )
    print(f"\ndone in {time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
