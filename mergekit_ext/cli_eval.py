"""``mergekit-ext eval`` (registered on the group in ``cli.py``): lm-evaluation-harness and
classification accuracy on merged folders, their base and their experts (issue #52)."""

from __future__ import annotations

import os
from typing import Any, Optional

import click

from mergekit_ext.console import cli_errors

_user_errors = cli_errors(lambda kwargs: kwargs.get("verbose", 0))


def _limit(value: Optional[str]) -> Optional[float]:
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        raise click.BadParameter(f"{value!r}: a number of examples (20) or a share (0.1)") from None
    if number <= 0:
        raise click.BadParameter("must be positive")
    return int(number) if number >= 1 else number


INCLUDE_PATH_HELP = (
    "Folder (or file) of your own lm-eval task YAMLs: local or private data, offline "
    "(repeatable). A YAML's data_files are relative to where you run, as in lm-eval"
)
LIMIT_HELP = "Examples per task (N, or a share < 1); for a quick look"


def _split_tasks(value: Optional[str]) -> tuple[str, ...]:
    return tuple(t.strip() for t in (value or "").split(",") if t.strip())


def run_eval_options(command: Any) -> Any:
    """``run``'s evaluation options: ``eval``'s lm-eval options under an ``--eval`` prefix,
    with the same meaning and help (declared here, next to ``eval``'s)."""
    options = [
        click.option(
            "--eval",
            "eval_tasks",
            default=None,
            metavar="T1,T2",
            callback=lambda ctx, param, value: _split_tasks(value),
            help="After merging, run these lm-evaluation-harness tasks on the merge (as "
            "`mergekit-ext eval`) and put the results on its card and model-index; needs "
            "pip install 'mergekit-ext[eval]'",
        ),
        click.option(
            "--eval-include-path",
            multiple=True,
            type=click.Path(exists=True),
            help="With --eval: " + INCLUDE_PATH_HELP,
        ),
        click.option(
            "--eval-limit",
            default=None,
            callback=lambda ctx, param, value: _limit(value),
            help="With --eval: " + LIMIT_HELP,
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


@click.command("eval")
@click.argument("model_dirs", nargs=-1, type=click.Path(exists=True, file_okay=False))
@click.option(
    "--tasks",
    default=None,
    help="lm-evaluation-harness tasks, comma-separated (causal LMs; needs "
    "pip install 'mergekit-ext[eval]')",
)
@click.option(
    "--include-path",
    multiple=True,
    type=click.Path(exists=True),
    help=INCLUDE_PATH_HELP,
)
@click.option(
    "--data",
    multiple=True,
    metavar="[TASK=]PATH",
    help="Labelled data for classifiers (encoders, ViT/CLIP/SigLIP): a .jsonl/.csv/.parquet "
    "file with text and label columns, an image folder with one subfolder per class, or a Hub "
    "dataset id when online. TASK is the expert (of --with-inputs) whose head scores it "
    "(repeatable)",
)
@click.option(
    "--with-inputs",
    "with_inputs",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    metavar="CONFIG.yml",
    help="Also evaluate the base model and each expert of this merge config (the table "
    "shows the merge beside what it came from; --data tasks use the experts' heads)",
)
@click.option(
    "--output",
    "-o",
    default="eval_results.json",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="Results file for `mergekit-ext card OUT --eval`; lm-eval's own results JSON of "
    "each model goes to <output>_lm_eval/",
)
@click.option("--limit", default=None, help=LIMIT_HELP)
@click.option(
    "--num-fewshot", type=int, default=None, help="Few-shot examples (default: the task's)"
)
@click.option(
    "--batch-size", default="8", show_default=True, help="Batch size (lm-eval: also 'auto')"
)
@click.option("--device", default="cpu", show_default=True, help="cpu | cuda | cuda:N | mps")
@click.option("--dtype", default=None, help="lm-eval: the models' dtype (float32, bfloat16, auto)")
@click.option("--split", default=None, help="--data: the split of a Hub dataset (default: test)")
@click.option("--text-field", default=None, help="--data: the text column (default: text)")
@click.option("--label-field", default=None, help="--data: the label column (default: label)")
@click.option("--image-field", default=None, help="--data: the image column (default: image)")
@click.option("-v", "--verbose", count=True, help="Show logs (-vv: debug) and tracebacks")
@_user_errors
def eval_command(
    model_dirs: tuple[str, ...],
    tasks: Optional[str],
    include_path: tuple[str, ...],
    data: tuple[str, ...],
    with_inputs: Optional[str],
    output: str,
    limit: Optional[str],
    num_fewshot: Optional[int],
    batch_size: str,
    device: str,
    dtype: Optional[str],
    split: Optional[str],
    text_field: Optional[str],
    label_field: Optional[str],
    image_field: Optional[str],
    verbose: int,
) -> None:
    """Evaluate merged models (MODEL_DIR...) and, with --with-inputs, their base and experts.

    Causal LMs run lm-evaluation-harness (--tasks, offline with --include-path); classifiers
    are scored on labelled data (--data) with each expert's own head. The table is printed,
    the results are written to --output: `mergekit-ext card OUT --eval OUTPUT` puts them on
    the model card and into its model-index.
    """
    from mergekit_ext.evaluate import evaluate
    from mergekit_ext.hub.card.evaluation import format_eval_table, read_eval_results

    result = evaluate(
        list(model_dirs),
        tasks=list(_split_tasks(tasks)),
        data=list(data),
        with_inputs=with_inputs,
        output=output,
        include_path=list(include_path),
        limit=_limit(limit),
        num_fewshot=num_fewshot,
        batch_size=int(batch_size) if batch_size.isdigit() else batch_size,
        device=device,
        dtype=dtype,
        split=split,
        text_field=text_field,
        label_field=label_field,
        image_field=image_field,
    )
    merges = [m["name"] for m in result["models"] if m["role"] == "merge"]
    for name in merges:
        click.echo(format_eval_table(read_eval_results(result, name, where=output)))
    click.echo(f"results written to {output}")
    if len(model_dirs) == 1:
        click.echo(f"on the model card: mergekit-ext card {model_dirs[0]} --eval {output}")
    lm_dir = os.path.splitext(output)[0] + "_lm_eval"
    if os.path.isdir(lm_dir):
        click.echo(f"lm-eval's own results files: {lm_dir}/")


__all__ = ["eval_command"]
