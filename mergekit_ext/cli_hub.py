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
    ``run --push-to-hub`` (declared once, here): ``private``, ``make_private``, ``revision``,
    ``commit_message``, ``create_pr``, ``token``, ``hub_timeout``."""
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
    help='Evaluation results JSON: [{"task", "dataset", "metrics": [{"type", "value"}]}] '
    "(written to the card and to its model-index)",
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

    A README.md edited by hand is never replaced silently: the command refuses, or with
    --force keeps it as README.md.bak (which `publish` does not upload).
    """
    from mergekit_ext.hub.card import keep_edited_card, load_eval_results, write_model_card

    _check_card_outputs(out_dir, [eval_path, template_dir], diagnose_config)
    if not force:  # refused before the (slow) diagnosis
        keep_edited_card(out_dir, force=False)
    results = load_eval_results(eval_path) if eval_path else None
    diagnosis = _diagnose(out_dir, diagnose_config, device) if diagnose_config else None
    backup = keep_edited_card(out_dir, force=force)
    path = write_model_card(
        out_dir,
        eval_results=results,
        name=name,
        repo_id=repo_id,
        template_dir=template_dir,
        diagnose=diagnosis,
        force=True,  # checked (and kept) just above
    )
    click.echo(f"model card written to {path}")
    if backup:
        click.echo(f"the README.md it replaced (edited by hand) is kept as {backup}")


def _check_card_outputs(
    out_dir: str, given: list[Optional[str]], diagnose_config: Optional[str]
) -> None:
    """What ``card`` writes (README.md, images/, the diagnosis) may not be nor lie inside
    a file it reads: ``--eval``, ``--template-dir``, and every input of ``--diagnose``."""
    import os

    from mergekit_ext.hub.card import DIAGNOSE_FILENAME, README_FILENAME
    from mergekit_ext.output import check_file_destination, check_write_path

    for name in (README_FILENAME, DIAGNOSE_FILENAME):  # files, written new (never a link)
        check_file_destination(os.path.join(out_dir, name))
    inputs = [p for p in given if p]
    if diagnose_config:
        from mergekit_ext.checks import local_input_paths
        from mergekit_ext.config import load_config

        inputs += local_input_paths(load_config(diagnose_config))
    for name in ("", README_FILENAME, "images", DIAGNOSE_FILENAME):
        check_write_path(
            os.path.join(out_dir, name) if name else out_dir,
            inputs,
            what="the model card",
            advice="the card is written into OUT_DIR (README.md, images/): keep --eval, "
            "--template-dir and the models and data of --diagnose outside it",
        )


def _diagnose(out_dir: str, config_path: str, device: str) -> dict[str, Any]:
    """Run ``mergekit-ext diagnose`` on ``out_dir``; the result is also saved next to it."""
    import json
    import os

    from mergekit_ext.config import load_config
    from mergekit_ext.diagnose import diagnose, format_table, jsonable
    from mergekit_ext.hub.card import DIAGNOSE_FILENAME, display_path
    from mergekit_ext.output import write_file

    result = diagnose(load_config(config_path), out_dir, device=device)
    result["config"] = os.path.basename(config_path)
    result["merged"] = os.path.basename(os.path.abspath(out_dir))  # no local path in a card

    def shown(label: str) -> str:
        return "+".join(display_path(p) for p in str(label).split("+"))

    refs = result.get("references") or {}
    rows = [
        result,
        *([refs["base"]] if refs.get("base") else []),
        *refs.get("experts", {}).values(),
    ]
    for row in rows:
        if row is not result:
            row["model"] = shown(row["model"])
        for task in row["tasks"].values():
            task["model"] = shown(task["model"])
    for data in (result.get("data") or {}).values():
        local = str(data["source"])
        data["source"] = display_path(local)
        data["note"] = data["note"].replace(local, data["source"])
    click.echo(format_table(result))
    write_file(
        os.path.join(out_dir, DIAGNOSE_FILENAME), json.dumps(jsonable(result), indent=2) + "\n"
    )
    return result


@click.command("publish")
@click.argument("out_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--repo-id", required=True, help="Target repository, user/name or org/name")
@publish_options
@click.option("--dry-run", is_flag=True, help="Check and list what would be uploaded, send nothing")
@click.option(
    "--endpoint", default=None, help="Hub endpoint (default: HF_ENDPOINT or huggingface.co)"
)
@click.option(
    "--keep-card",
    is_flag=True,
    help="Upload README.md as it is (default: our own unedited card is rendered again for "
    "the repository; any other card goes as it is)",
)
@click.option(
    "--replace-card",
    is_flag=True,
    help="Upload the card mergekit-ext renders even over a README.md it did not write as it "
    "is now (mergekit's card from mergekit-yaml, a card edited by hand)",
)
@click.option(
    "--template-dir",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="Your own card templates for the uploaded card (as for `card`)",
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
    mergekit-ext did not write (mergekit's own card) is uploaded as it is unless
    --replace-card. Weights, indexes and images/ of an earlier upload that this one does
    not contain are deleted in the same commit.
    """
    from mergekit_ext.hub.publish import publish_folder

    result = publish_folder(
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
    )
    click.echo(result if dry_run else f"published: {result}")


__all__ = ["card_command", "publish_command", "publish_options"]
