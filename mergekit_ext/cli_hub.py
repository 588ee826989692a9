"""``mergekit-ext card`` and ``mergekit-ext publish`` (registered on the group in ``cli.py``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Optional

import click

from mergekit_ext.console import cli_errors
from mergekit_ext.hub.http import hub_timeout_option

LOG = logging.getLogger(__name__)


# one error style with the other commands: `error: ...` on one line, the traceback with -v
_user_errors = cli_errors(lambda kwargs: kwargs.get("verbose", 0))


def publish_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """The options that say how a merge goes to the Hub, shared by ``publish`` and
    ``run --push-to-hub`` (declared once, here, with one help text each): ``private``,
    ``make_private``, ``revision``, ``commit_message``, ``create_pr``, ``token``,
    ``endpoint``, ``keep_card``, ``replace_card``, ``template_dir``, ``hub_timeout``."""
    options = [
        click.option(
            "--private",
            is_flag=True,
            help="Create the repository as private. An existing public repository is refused "
            "(the upload would be public) unless --make-private",
        ),
        click.option(
            "--make-private",
            is_flag=True,
            help="Make the repository private through the Hub's settings API before "
            "uploading (also when it already exists and is public)",
        ),
        click.option("--revision", default=None, help="Branch to commit to (created if missing)"),
        click.option("--commit-message", default=None, help="Commit message"),
        click.option("--create-pr", is_flag=True, help="Open a pull request instead of committing"),
        click.option(
            "--token", default=None, help="Hub token (default: HF_TOKEN, then the cached login)"
        ),
        click.option(
            "--endpoint", default=None, help="Hub endpoint (default: HF_ENDPOINT or huggingface.co)"
        ),
        click.option(
            "--keep-card",
            is_flag=True,
            help="Upload README.md as it is (default: our own unedited card is rendered again "
            "for the repository; any other card goes as it is)",
        ),
        click.option(
            "--replace-card",
            is_flag=True,
            help="Upload the card mergekit-ext renders even over a README.md it did not write "
            "as it is now (mergekit's card from mergekit-yaml, a card edited by hand, locally "
            "or on the Hub)",
        ),
        click.option(
            "--template-dir",
            type=click.Path(exists=True, file_okay=False),
            default=None,
            help="Your own card templates for the uploaded card (as for `card`)",
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return hub_timeout_option(f)


@click.command("card")
@click.argument("out_dir", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--eval",
    "eval_path",
    type=click.Path(dir_okay=False),
    default=None,
    help="Evaluation results: the --output of `mergekit-ext eval`, lm-evaluation-harness's "
    'results JSON, or [{"task", "dataset", "metrics": [{"type", "value"}]}] (a table on the '
    "card, the merge's numbers in its model-index; kept as mergekit_ext_eval.json)",
)
@click.option("--name", default=None, help="Title of the card (default: the folder name)")
@click.option(
    "--repo-id", default=None, help="Hub repo id used in the loading snippet (default: the folder)"
)
@click.option(
    "--template-dir",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="Folder with your own causal_lm.md.j2 / vision.md.j2 / encoder.md.j2",
)
@click.option(
    "--diagnose",
    "diagnose_config",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Merge YAML whose experts (with calibration data) to compare OUT_DIR with "
    "(`mergekit-ext diagnose`); adds an agreement section and writes "
    "mergekit_ext_diagnose.json",
)
@click.option(
    "--device", default="cpu", show_default=True, help="With --diagnose: cpu | cuda | auto"
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace a README.md edited by hand (or not written by mergekit-ext); it is kept as "
    "README.md.bak",
)
@click.option("-v", "--verbose", count=True, help="Show logs (-vv: debug) and tracebacks")
@_user_errors
def card_command(
    out_dir: str,
    eval_path: Optional[str],
    name: Optional[str],
    repo_id: Optional[str],
    template_dir: Optional[str],
    diagnose_config: Optional[str],
    device: str,
    force: bool,
    verbose: int,
) -> None:
    """Rebuild README.md (and images/) of the finished merge in OUT_DIR, offline.

    OUT_DIR is the output of `mergekit-ext run` or `mergekit-yaml` (mergekit_config.yml),
    of `mergekit-moe` (mergekit_moe_config.yml) or of `mergekit-extract-lora` (a PEFT
    adapter; the fine-tuned model is read from the command its README.md records).

    A README.md edited by hand is never replaced silently: the command refuses, or with
    --force keeps it as README.md.bak (which `publish` does not upload).
    """
    from mergekit_ext.api import write_card
    from mergekit_ext.diagnose import format_table

    result = write_card(
        out_dir,
        eval_results=eval_path,
        name=name,
        repo_id=repo_id,
        template_dir=template_dir,
        diagnose_config=diagnose_config,
        device=device,
        force=force,
    )
    if result.diagnosis is not None:
        click.echo(format_table(result.diagnosis))
    click.echo(f"model card written to {result.path}")
    if result.backup:
        click.echo(f"the README.md it replaced (edited by hand) is kept as {result.backup}")


@click.command("publish")
@click.argument("out_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--repo-id", required=True, help="Target repository, user/name or org/name")
@publish_options
@click.option(
    "--include",
    "include",
    multiple=True,
    metavar="PATTERN",
    help="Also upload the files of OUT_DIR this pattern matches (relative path, * crosses "
    "folders, a folder name takes its files; repeatable). Without it only the merge's own "
    "files go; hidden files and symbolic links never go",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Check and list what would be uploaded, what is left out and why, and what would "
    "be deleted on the Hub; send nothing",
)
@click.option("-v", "--verbose", count=True, help="Show logs (-vv: debug) and tracebacks")
@_user_errors
def publish_command(
    out_dir: str,
    repo_id: str,
    private: bool,
    make_private: bool,
    revision: Optional[str],
    commit_message: Optional[str],
    create_pr: bool,
    token: Optional[str],
    include: tuple[str, ...],
    dry_run: bool,
    endpoint: Optional[str],
    keep_card: bool,
    replace_card: bool,
    template_dir: Optional[str],
    hub_timeout: float,
    verbose: int,
) -> None:
    """Upload the finished merge in OUT_DIR to the Hugging Face Hub in one commit.

    The uploaded model card is rendered for the repository (its name as title, REPO_ID in
    the loading snippets); README.md in OUT_DIR is left as it is. A README.md that
    mergekit-ext did not write (mergekit's own card), or one edited on the Hub, stays as it
    is unless --replace-card.

    Only the merge's own files go (those the merge recorded in mergekit_ext_manifest.json,
    and the card's), plus what --include names; hidden files and symbolic links never go.
    Files an earlier publish of mergekit-ext wrote that this upload lacks are deleted in
    the same commit, each one named; files added to the repository by hand stay.
    """
    from mergekit_ext.api import publish

    result = publish(
        out_dir,
        repo_id,
        private=private,
        revision=revision,
        commit_message=commit_message,
        create_pr=create_pr,
        token=token,
        dry_run=dry_run,
        endpoint=endpoint,
        keep_card=keep_card,
        template_dir=template_dir,
        timeout=hub_timeout,
        replace_card=replace_card,
        make_private=make_private,
        include=include,
    )
    click.echo(result if dry_run else getattr(result, "summary", f"published: {result}"))


__all__ = ["card_command", "publish_command", "publish_options"]
