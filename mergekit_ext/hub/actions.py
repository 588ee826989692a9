"""The hub wing's part of a merge, which the entry points hand to the runner.

:class:`HubActions` implements :class:`mergekit_ext.runner.HubWing`: the runner sits below
the hub (docs/architecture.md) and calls these without importing the hub; ``cli.py`` and
``api.py`` pass an instance to :func:`mergekit_ext.runner.run_merge_config`. ``run`` is the
runner's ``RunOptions`` (its ``push_to_hub`` and ``hub_*`` fields).
"""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any, Optional

LOG = logging.getLogger(__name__)


class HubActions:
    """Model card and upload through :mod:`mergekit_ext.hub.card` and :mod:`~mergekit_ext.hub.publish`."""

    def check_can_publish(self, run: Any) -> None:
        """``--push-to-hub``: what ``publish`` would refuse, checked before anything merges."""
        from mergekit_ext.hub.publish import check_can_publish

        check_can_publish(
            run.push_to_hub,
            run.hub_token,
            private=run.hub_private,
            make_private=run.hub_make_private,
            revision=run.hub_revision,
            create_pr=run.hub_create_pr,
            endpoint=run.hub_endpoint,
            timeout=run.hub_timeout,
        )

    def write_model_card(
        self,
        folder: str,
        name: str,
        repo_id: Optional[str],
        *,
        config: Any,
        config_text: str,
        diagnostics: dict[str, Any],
    ) -> None:
        """README.md into the merge's temporary folder (nothing of the user's to keep),
        rendered from the run's config, config copy and diagnostics in memory. A failure
        costs the card, never the merge (it may have taken hours): the merge is written
        without README.md and images/, and the warning says how to write them later."""
        from mergekit_ext.hub.card import MergeInMemory, write_model_card

        merge = MergeInMemory(config, config_text, diagnostics)
        try:
            write_model_card(folder, name=name, repo_id=repo_id, force=True, merge=merge)
        except Exception as e:  # noqa: BLE001 (a template or plot error: keep the merge)
            # no half-written card or plots beside the merge (its own temporary folder)
            shutil.rmtree(os.path.join(folder, "images"), ignore_errors=True)
            if os.path.isfile(os.path.join(folder, "README.md")):
                os.remove(os.path.join(folder, "README.md"))
            LOG.warning(
                "writing the model card failed (%s: %s); the merge is written without one — "
                "write it later with `mergekit-ext card OUT`",
                type(e).__name__,
                e,
            )

    def publish(self, out_path: str, run: Any) -> str:
        """Upload ``out_path`` to ``run.push_to_hub`` in one commit; returns the line that
        says what happened (the repository and the commit, or that nothing changed)."""
        from mergekit_ext.hub.publish import publish_folder

        result = publish_folder(
            out_path,
            run.push_to_hub,
            private=run.hub_private,
            make_private=run.hub_make_private,
            revision=run.hub_revision,
            commit_message=run.hub_commit_message,
            create_pr=run.hub_create_pr,
            token=run.hub_token,
            endpoint=run.hub_endpoint,
            keep_card=run.hub_keep_card,
            replace_card=run.hub_replace_card,
            template_dir=run.hub_template_dir,
            timeout=run.hub_timeout,
        )
        return str(getattr(result, "summary", f"published: {result}"))

    def publish_command(self, out_path: str, run: Any) -> str:
        """``mergekit-ext publish`` with every publishing option ``run`` was given, so that a
        retry goes where the failed upload was going (never ``main`` instead of a branch);
        the token itself is never printed."""
        import shlex

        from mergekit_ext.hub.http import HUB_TIMEOUT_S

        words = ["mergekit-ext", "publish", out_path, "--repo-id", run.push_to_hub]
        words += ["--private"] if run.hub_private else []
        words += ["--make-private"] if run.hub_make_private else []
        words += ["--revision", run.hub_revision] if run.hub_revision else []
        words += ["--commit-message", run.hub_commit_message] if run.hub_commit_message else []
        words += ["--create-pr"] if run.hub_create_pr else []
        words += ["--endpoint", run.hub_endpoint] if run.hub_endpoint else []
        words += ["--keep-card"] if run.hub_keep_card else []
        words += ["--replace-card"] if run.hub_replace_card else []
        words += ["--template-dir", run.hub_template_dir] if run.hub_template_dir else []
        if run.hub_timeout is not None and run.hub_timeout != HUB_TIMEOUT_S:
            words += ["--hub-timeout", f"{run.hub_timeout:g}"]
        command = shlex.join(words)
        return command + (" --token YOUR_TOKEN" if run.hub_token else "")
