"""Publish a finished merge to the Hugging Face Hub in one command.

:func:`publish_folder` checks locally that the folder is a complete merge and that the repo
id is valid, then uses :class:`huggingface_hub.HfApi`: ``create_repo(exist_ok=True)`` (plus
``create_branch`` for ``--revision``) and ``upload_folder``, which sends every file in
**one commit**: LFS/Xet objects are uploaded first and the commit that references them is
created last, so an upload that fails half-way commits nothing.

What goes (:func:`select_upload_files`): the merge's own files, which ``run`` records in
``mergekit_ext_manifest.json`` as it writes the folder, the card's, and what ``--include``
names; never a hidden file nor a symbolic link. A manifest of the upload goes with it, and a
later publish deletes, in its commit, exactly the files that manifest names and the new
upload lacks (:func:`plan_remote`); files added to the repository by hand stay.

The card: the local ``README.md`` is written for the folder (its name as title, ``./NAME``
in the loading snippets). The uploaded copy is rendered again for the target repository
(:func:`card_to_upload`) and sent from a temporary view of the folder
(:func:`staged_folder`: links to the files, the new card), so the local folder is never
modified; ``keep_card`` uploads the local card as it is.

Large folders: above :data:`LARGE_FOLDER_BYTES` (50 GiB) the folder is sent with
``HfApi.upload_large_folder`` when the installed huggingface_hub has it (1.x): resumable,
several commits, no pull requests. huggingface_hub 2.x removed that method because its
``upload_folder`` is itself resumable with ``hf_xet`` installed (it commits folders of more
than :data:`ONE_COMMIT_MAX_FILES` files in batches); there we always use ``upload_folder``.

The token comes from ``token=`` (``--token``), else ``HF_TOKEN``, else the cached login
(``hf auth login``). It is never logged, printed or put in an error message: every message
goes through :func:`_scrub`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from mergekit_ext import merge_record
from mergekit_ext.errors import PublishError
from mergekit_ext.hub.http import HUB_TIMEOUT_S, bounded_hub_requests
from mergekit_ext.offline import hub_offline
from mergekit_ext.resources import format_bytes

LOG = logging.getLogger(__name__)

LARGE_FOLDER_BYTES = 50 * 1024**3
ONE_COMMIT_MAX_FILES = 256  # huggingface_hub 2.x's first commit batch with hf_xet
SAFETENSORS_INDEX = "model.safetensors.index.json"
MANIFEST_FILENAME = merge_record.MANIFEST_FILENAME
# What a merge writes, by name. Used only where no manifest says which files are the merge's:
# an output folder written by an older version (or by mergekit-yaml) uploads these, and a
# repository an older version published may see these deleted when a new upload lacks them.
# Task folders (``tasks/NAME/``, SyMerge) hold the same kinds of files. Images are the card's:
# those its README.md links to.
MERGE_FILE_NAMES = (
    "README.md", "config.json", "generation_config.json",
    "model.safetensors", "model-*-of-*.safetensors", SAFETENSORS_INDEX,
    "adapter_config.json", "adapter_model.safetensors",
    "mergekit_config.yml", merge_record.FILENAME, "mergekit_ext_diagnose.json",
    "mergekit_moe_config.yml",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model",
    "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
    "processor_config.json",
)  # fmt: skip
_TOKEN_PATTERN = re.compile(r"hf_[A-Za-z0-9_\-]{6,}")
_IMAGE_LINK = re.compile(r"!\[[^\]]*\]\((?!https?://)([^)\s]+)\)")


@dataclass(frozen=True)
class FolderFile:
    """One file to upload: its path in the repo (POSIX) and size in bytes."""

    path: str
    size: int


# ---------------------------------------------------------------------------- validation


def validate_repo_id(repo_id: str) -> None:
    """``owner/name`` with the Hub's rules (checked locally, before any network call)."""
    from huggingface_hub.utils import HFValidationError
    from huggingface_hub.utils import validate_repo_id as hf_validate

    if not isinstance(repo_id, str) or repo_id.count("/") != 1:
        raise PublishError(
            f"invalid repo id {repo_id!r}: use the form user/name or org/name (one '/')"
        )
    owner, name = repo_id.split("/")
    if not owner or not name:
        raise PublishError(f"invalid repo id {repo_id!r}: both the owner and the name are needed")
    try:
        hf_validate(repo_id)
    except HFValidationError as e:
        raise PublishError(
            f"invalid repo id {repo_id!r}: names may use letters, digits, '-', '_' and '.', "
            "must not start or end with '-' or '.', contain '--' or '..', and be at most 96 "
            f"characters ({' '.join(str(e).split())})"
        ) from None


def _safetensors_header(path: str) -> tuple[Optional[set[str]], Optional[str]]:
    """Tensor names of a safetensors file, or the reason it is unreadable or truncated.

    ``safetensors.safe_open`` reads only the header and refuses a file its header does not
    cover exactly, so a partially written shard is caught without loading any weights.
    """
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            return set(f.keys()), None
    except OSError as e:
        return None, f"unreadable ({e})"
    except SafetensorError as e:
        return None, f"truncated or corrupt ({e})"


def _check_weights(folder: str, label: str) -> list[str]:
    """Problems with the weights of one model folder (empty when complete)."""
    problems: list[str] = []
    index_path = os.path.join(folder, SAFETENSORS_INDEX)
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as fp:
                weight_map = json.load(fp)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            return [f"{label}{SAFETENSORS_INDEX} is unreadable ({e})"]
        by_shard: dict[str, set[str]] = {}
        for tensor, shard in weight_map.items():
            by_shard.setdefault(shard, set()).add(tensor)
        for shard in sorted(by_shard):
            shard_path = os.path.join(folder, shard)
            if not os.path.isfile(shard_path):
                problems.append(f"{label}{shard} (named in {SAFETENSORS_INDEX}) is missing")
                continue
            names, reason = _safetensors_header(shard_path)
            if reason:
                problems.append(f"{label}{shard} is {reason}")
            elif names is not None and not by_shard[shard] <= names:
                missing = sorted(by_shard[shard] - names)
                problems.append(
                    f"{label}{shard} lacks {len(missing)} tensor(s) the index names, "
                    f"e.g. {missing[0]}"
                )
        return problems
    if os.path.isfile(single):
        _, reason = _safetensors_header(single)
        return [f"{label}model.safetensors is {reason}"] if reason else []
    adapter = os.path.join(folder, "adapter_config.json")
    if os.path.isfile(adapter):
        weights = os.path.join(folder, "adapter_model.safetensors")
        if not os.path.isfile(weights):
            return [f"{label}adapter_model.safetensors is missing (adapter_config.json is there)"]
        _, reason = _safetensors_header(weights)
        return [f"{label}adapter_model.safetensors is {reason}"] if reason else []
    return [f"{label}model.safetensors (or {SAFETENSORS_INDEX} and its shards) is missing"]


def check_complete(out_dir: str) -> list[str]:
    """Everything missing for ``out_dir`` to be a complete merge; empty when complete.

    Checks ``config.json``, every shard the safetensors index names (or the single
    ``model.safetensors``) with a header/size check, ``README.md`` and its front matter,
    the images the card links to, and each SyMerge task folder in ``tasks/``.
    """
    if not os.path.isdir(out_dir):
        return [f"{out_dir} is not a folder"]
    problems: list[str] = []
    config_path = os.path.join(out_dir, "config.json")
    if not os.path.isfile(config_path):
        if not os.path.isfile(os.path.join(out_dir, "adapter_config.json")):
            problems.append("config.json is missing")
    else:
        try:
            with open(config_path, encoding="utf-8") as fp:
                json.load(fp)
        except (OSError, ValueError) as e:
            problems.append(f"config.json is unreadable ({e})")
    problems.extend(_check_weights(out_dir, ""))

    readme = os.path.join(out_dir, "README.md")
    if not os.path.isfile(readme):
        from mergekit_ext.hub.card.tools import card_source, no_card_source

        if card_source(out_dir) is not None:
            problems.append(
                "README.md (the model card) is missing: run `mergekit-ext card OUT_DIR`"
            )
        else:
            problems.append(
                "README.md (the model card) is missing and cannot be built: "
                + no_card_source(out_dir)
                + ", or write README.md yourself"
            )
    else:
        from huggingface_hub import ModelCard

        try:
            text = Path(readme).read_text(encoding="utf-8")
            ModelCard(text)
        except Exception as e:  # noqa: BLE001 - OSError, yaml.YAMLError, ValueError
            reason = " ".join(str(e).split())
            problems.append(
                f"README.md front matter is invalid ({reason}): run `mergekit-ext card`"
            )
            text = ""
        for link in _IMAGE_LINK.findall(text):
            if not os.path.isfile(os.path.join(out_dir, link)):
                problems.append(f"{link} (linked from README.md) is missing")

    tasks_dir = os.path.join(out_dir, "tasks")
    if os.path.isdir(tasks_dir):
        for task in sorted(os.listdir(tasks_dir)):
            folder = os.path.join(tasks_dir, task)
            if not os.path.isdir(folder):
                continue
            label = f"tasks/{task}/"
            if not os.path.isfile(os.path.join(folder, "config.json")) and not os.path.isfile(
                os.path.join(folder, "adapter_config.json")
            ):
                problems.append(f"{label}config.json is missing")
            problems.extend(_check_weights(folder, label))
    return problems


def is_merge_file_name(path: str) -> bool:
    """``path`` (POSIX, relative to the folder or repository) has the name of a file a merge
    writes (:data:`MERGE_FILE_NAMES`), at the top or in a task folder ``tasks/NAME/``."""
    import fnmatch

    parts = path.split("/")
    if not (len(parts) == 1 or (len(parts) == 3 and parts[0] == "tasks")):
        return False
    return any(fnmatch.fnmatchcase(parts[-1], name) for name in MERGE_FILE_NAMES)


def _card_links(text: str) -> set[str]:
    return {link.removeprefix("./") for link in _IMAGE_LINK.findall(text)}


@dataclass(frozen=True)
class UploadSelection:
    """Which files of an output folder ``publish`` sends, and which it leaves out, and why."""

    files: tuple[FolderFile, ...]
    #: the files sent only because ``--include`` named them (never deleted by a later publish)
    included: tuple[str, ...]
    #: (path, why) of every file or folder left out; folders end with "/"
    left_out: tuple[tuple[str, str], ...]
    #: how the merge's own files were known (the manifest, or their names)
    basis: str


def _matches(path: str, pattern: str) -> bool:
    """``--include`` patterns: shell patterns on the path (``*`` crosses folders), or a
    folder (``extra`` / ``extra/``) for everything in it."""
    import fnmatch

    pattern = pattern.removeprefix("./")
    folder = pattern.rstrip("/")
    return fnmatch.fnmatchcase(path, pattern) or path.startswith(folder + "/")


def select_upload_files(
    out_dir: str, include: Sequence[str] = (), card_text: Optional[str] = None
) -> UploadSelection:
    """The merge's own files in ``out_dir`` plus those ``include`` names.

    The merge's own: the files its manifest lists (:data:`MANIFEST_FILENAME`, written by
    ``run`` once everything else was written), else, for a folder without one (an older
    version, ``mergekit-yaml``), the files with the names a merge writes
    (:data:`MERGE_FILE_NAMES`); and the card's: ``README.md``, the images ``card_text``
    (default: the local README.md) links to, ``mergekit_ext_diagnose.json`` and
    ``mergekit_ext_eval.json`` (the results ``card --eval`` or ``run --eval`` saved: the card's
    table and model-index are rendered from it, so the repository keeps its source). Never sent,
    even when ``include`` names them: symbolic links (to files or folders, inside or outside
    ``out_dir``: never followed), hidden files and folders (``.env``, ``.DS_Store``,
    ``.cache/``), the local manifest (the upload carries its own) and ``README.md.bak*``.
    Raises :class:`PublishError` when an ``include`` pattern matches no file that may go.
    """
    root = Path(out_dir).expanduser().resolve()
    manifest = merge_record.load_manifest(str(root))
    own = set(manifest["files"]) if manifest is not None else None
    basis = (
        f"{MANIFEST_FILENAME} (the files the merge wrote)"
        if own is not None
        else f"no {MANIFEST_FILENAME} (an older version or another tool wrote the folder): "
        "the files with the names a merge writes"
    )
    if card_text is None:
        readme = root / "README.md"
        card_text = readme.read_text(encoding="utf-8") if readme.is_file() else ""
    card_files = {
        "README.md",
        "mergekit_ext_diagnose.json",
        merge_record.EVAL_FILENAME,
        *_card_links(card_text),
    }
    chosen: list[FolderFile] = []
    included: list[str] = []
    left_out: list[tuple[str, str]] = []
    used: set[str] = set()
    for dirpath, dirs, names in os.walk(root, followlinks=False):
        here = Path(dirpath)
        rel_dir = here.relative_to(root).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        for name in sorted(dirs):
            if os.path.islink(here / name):
                left_out.append((f"{prefix}{name}/", "a symbolic link: links are never followed"))
            elif name.startswith("."):
                left_out.append((f"{prefix}{name}/", "a hidden folder: never uploaded"))
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and not (here / d).is_symlink())
        for name in sorted(names):
            rel, full = prefix + name, here / name
            why = ""
            if rel == MANIFEST_FILENAME:
                continue  # the upload carries its own manifest (what this publish sent)
            if full.is_symlink():
                if (
                    rel in card_files
                    or (own is not None and rel in own)
                    or (own is None and is_merge_file_name(rel))
                ):  # the upload would lack a file of the merge: say so rather than skip it
                    raise PublishError(
                        f"{out_dir}/{rel} is a symbolic link: publish never follows links, and "
                        "the merge needs that file. Replace the link with the file itself"
                    )
                why = "a symbolic link: never followed (its target is not uploaded)"
            elif name.startswith("."):
                why = "a hidden file: never uploaded (.env, .DS_Store, ...)"
            elif not full.is_file():
                why = "not a regular file"
            elif not prefix and name.startswith("README.md.bak"):
                why = "the copy of a hand-edited card that `card --force` replaced (local only)"
            elif rel in card_files or (own is not None and rel in own):
                pass
            elif own is None and is_merge_file_name(rel):
                pass
            else:
                patterns = [p for p in include if _matches(rel, p)]
                if not patterns:
                    why = "not written by the merge: pass --include to upload it"
                else:
                    used.update(patterns)
                    included.append(rel)
            if why:
                left_out.append((rel, why))
            else:
                chosen.append(FolderFile(rel, full.stat().st_size))
    unused = [p for p in include if p not in used]
    if unused:
        raise PublishError(
            f"--include {unused[0]!r} matches no file in {out_dir} that may be uploaded (the "
            "merge's own files go without it; hidden files and symbolic links never go): "
            "check the pattern, relative to OUT_DIR"
        )
    chosen.sort(key=lambda f: f.path)
    return UploadSelection(tuple(chosen), tuple(included), tuple(sorted(left_out)), basis)


def list_upload_files(out_dir: str, include: Sequence[str] = ()) -> list[FolderFile]:
    """The local files ``publish`` sends (:func:`select_upload_files`), without the
    manifest the upload adds."""
    return list(select_upload_files(out_dir, include).files)


# --------------------------------------------------------------------------------- token


def resolve_token(token: Optional[str]) -> tuple[Optional[str], str]:
    """The token and where it came from: ``--token``, else ``huggingface_hub.get_token()``
    (``HF_TOKEN``, then the cached login, as every Hub client reads them)."""
    if token:
        return token, "--token"
    from huggingface_hub import get_token

    found = get_token()
    if not found:
        return None, ""
    from_env = any(os.environ.get(v) for v in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"))
    return found, "HF_TOKEN" if from_env else "the cached login (hf auth login)"


def _scrub(text: str, token: Optional[str]) -> str:
    """Remove the token (and anything shaped like a Hub token) from a message."""
    if token:
        text = text.replace(token, "***")
    return _TOKEN_PATTERN.sub("hf_***", text)


# ------------------------------------------------------------------------------- helpers


def _default_commit_message(out_dir: str) -> str:
    from mergekit_ext import merge_record
    from mergekit_ext.hub.card.tools import card_source

    source = card_source(out_dir)
    if source == "moe":
        return "Upload MoE model built with mergekit-moe"
    if source == "lora":
        return "Upload LoRA adapter extracted with mergekit-extract-lora"
    method = merge_record.load(out_dir).get("method")
    return (
        f"Upload model merged with mergekit-ext ({method})"
        if method
        else ("Upload model merged with mergekit-ext")
    )


def _front_matter_text(card_text: str) -> str:
    from huggingface_hub import ModelCard

    return "---\n" + ModelCard(card_text).data.to_yaml() + "\n---"


def card_to_upload(
    out_dir: str,
    repo_id: str,
    *,
    keep_card: bool = False,
    template_dir: Optional[str] = None,
    replace_card: bool = False,
) -> str:
    """The ``README.md`` text that goes to ``repo_id``.

    Our own card, unedited (its last line is the hash mergekit-ext writes and still
    matches), is rendered again for the repository (title, loading snippets). A card that
    mergekit-ext did not write as it is now (mergekit's own README from ``mergekit-yaml``,
    a card edited by hand) is uploaded as it is unless ``replace_card``; so is the card of
    a folder that has no ``mergekit_config.yml`` to render one from, and any card with
    ``keep_card``.
    """
    from mergekit_ext.hub.card import card_is_unedited, render_card_for_repo
    from mergekit_ext.hub.card.tools import card_source

    readme = Path(out_dir, "README.md")
    if keep_card:
        return readme.read_text(encoding="utf-8")
    if card_source(out_dir) is None:
        LOG.info("%s has no config to render a card from: README.md goes as it is", out_dir)
        return readme.read_text(encoding="utf-8")
    if not card_is_unedited(str(readme)):
        if not replace_card:
            LOG.warning(
                "%s was not written by mergekit-ext as it is now (another tool's card, or "
                "edited by hand): it is uploaded as it is; pass --replace-card to upload the "
                "card mergekit-ext renders instead",
                readme,
            )
            return readme.read_text(encoding="utf-8")
        LOG.warning("%s is replaced on the Hub by the card mergekit-ext renders", readme)
    text = render_card_for_repo(out_dir, repo_id, template_dir=template_dir)
    missing = [link for link in _IMAGE_LINK.findall(text) if not Path(out_dir, link).is_file()]
    if missing:
        raise PublishError(
            f"the card rendered for {repo_id} links to {missing[0]}, which is not in {out_dir}: "
            "run `mergekit-ext card OUT_DIR` first, or pass --keep-card to upload README.md as it is"
        )
    return text


# Text files a merge or PEFT writes, which may name local paths (mergekit_config.yml and its
# comments, diagnostics, config.json's ``_name_or_path``, adapter configs, the card).
# Tokenizer and vocabulary files are sent untouched: "/usr" may be one of their tokens.
_TEXT_SUFFIXES = (".json", ".yml", ".yaml", ".md", ".txt")
_VERBATIM = ("tokenizer*", "vocab*", "merges.txt", "special_tokens_map.json",
             "added_tokens.json", "chat_template*", "preprocessor_config.json",
             SAFETENSORS_INDEX)  # fmt: skip


def _redactor(out_dir: str) -> Any:
    """The redactor of ``run`` (:func:`~mergekit_ext.hub.card.local_path_redactor`) for the
    config in ``out_dir``: the config's paths as written, then every other absolute path."""
    from mergekit_ext.errors import MergekitExtError
    from mergekit_ext.hub.card import CONFIG_FILENAME, local_path_redactor
    from mergekit_ext.hub.card.tools import MOE_CONFIG_FILENAME
    from mergekit_ext.yaml_input import load_yaml

    raw: Any = None
    config = Path(out_dir, CONFIG_FILENAME)
    if not config.is_file():  # mergekit-moe's copy of its config names the models the same way
        config = Path(out_dir, MOE_CONFIG_FILENAME)
    if config.is_file():
        try:
            raw = load_yaml(config.read_text(encoding="utf-8"), str(config))
        except (OSError, UnicodeDecodeError, MergekitExtError) as e:
            LOG.debug("%s not read for redaction: %s", config, e)
    return local_path_redactor(raw)


def _adapter_base(text: str, out_dir: str, repo_id: str) -> str:
    """A SyMerge task adapter names the merged body by its local path: on the Hub, that
    body is ``repo_id``, so the adapter loads from there. An adapter whose base is a local
    copy of a Hub model (``mergekit-extract-lora`` on an ``hf download --local-dir``
    folder) names that model's Hub id, as its card does."""
    try:
        config = json.loads(text)
        base = config.get("base_model_name_or_path")
    except (ValueError, AttributeError):
        return text
    if not isinstance(base, str) or not base:
        return text
    local = os.path.expanduser(base)
    if os.path.exists(local) and os.path.realpath(local) == os.path.realpath(out_dir):
        return text.replace(json.dumps(base), json.dumps(repo_id))
    if os.path.isdir(local):  # a local copy of a Hub model (hf download --local-dir): its id
        from mergekit_ext.merge_inputs import downloaded_hub_id

        hub_id, _, _ = downloaded_hub_id(local)
        if hub_id:
            return text.replace(json.dumps(base), json.dumps(hub_id))
    return text


def uploaded_bytes(out_dir: str, path: str, repo_id: str, redact: Any = None) -> Optional[bytes]:
    """What is uploaded for the file ``path`` of ``out_dir`` when it differs from the local
    file (None: the local bytes as they are). Every text file a merge writes goes through
    the same redaction (no absolute local path leaves the machine); a task adapter's base
    becomes ``repo_id``."""
    import fnmatch

    name = path.rsplit("/", 1)[-1]
    if not name.endswith(_TEXT_SUFFIXES) or any(fnmatch.fnmatch(name, p) for p in _VERBATIM):
        return None
    local = Path(out_dir, path).read_bytes()
    try:
        text = local.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if name == "adapter_config.json":
        text = _adapter_base(text, out_dir, repo_id)
    text = (redact or _redactor(out_dir))(text)
    data = text.encode("utf-8")
    return None if data == local else data


def _place(source: Path, target: Path) -> None:
    """``target`` shows ``source``'s bytes without copying them where the system allows."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        try:
            os.symlink(source, target)
        except OSError:
            import shutil

            shutil.copy2(source, target)


@contextlib.contextmanager
def staged_folder(
    out_dir: str,
    card_text: Optional[str],
    repo_id: Optional[str] = None,
    files: Optional[Sequence[FolderFile]] = None,
    manifest_text: Optional[str] = None,
) -> Iterator[str]:
    """A temporary view of ``files`` of ``out_dir`` (default: :func:`list_upload_files`)
    whose ``README.md`` is ``card_text`` (None: no README.md, the one on the Hub stays) and
    which holds the upload's manifest ``manifest_text``.

    Every other file is a hard link (or a symbolic link, or a copy across file systems
    without links) to the file in ``out_dir``, so ``upload_folder`` uploads exactly those
    files, in one commit, while ``out_dir`` itself is never modified; text files that name
    local paths are written redacted instead (:func:`uploaded_bytes`), the card too.
    """
    import tempfile

    from mergekit_ext.output import OutputError, check_write_path

    try:  # the staging folder is made in the temporary folder: never inside out_dir
        check_write_path(
            tempfile.gettempdir(),
            [out_dir],
            what="the upload's staging folder (in the temporary folder)",
            advice="set TMPDIR to a folder outside it",
        )
    except OutputError as e:
        raise PublishError(str(e)) from None
    source = Path(out_dir).expanduser().resolve()
    with tempfile.TemporaryDirectory(prefix="mergekit-ext-publish-") as staging:
        root = Path(staging)
        redact = _redactor(out_dir)
        for f in list_upload_files(out_dir) if files is None else files:
            if f.path in ("README.md", MANIFEST_FILENAME):
                continue
            changed = uploaded_bytes(out_dir, f.path, repo_id or "", redact) if repo_id else None
            if changed is None:
                _place(source / f.path, root / f.path)
            else:
                (root / f.path).parent.mkdir(parents=True, exist_ok=True)
                (root / f.path).write_bytes(changed)
        if card_text is not None:
            (root / "README.md").write_text(redact(card_text), encoding="utf-8")
        if manifest_text is not None:
            (root / MANIFEST_FILENAME).write_text(manifest_text, encoding="utf-8")
        yield staging


def choose_uploader(total_bytes: int, create_pr: bool, api: Any) -> str:
    """``upload_large_folder`` for folders above :data:`LARGE_FOLDER_BYTES` when available."""
    if total_bytes > LARGE_FOLDER_BYTES and not create_pr and hasattr(api, "upload_large_folder"):
        return "upload_large_folder"
    return "upload_folder"


def _root_causes(exc: BaseException) -> list[BaseException]:
    chain, seen = [], set()
    current: Optional[BaseException] = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _request_url(exc: BaseException) -> str:
    try:
        return str(exc.request.url)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - httpx raises RuntimeError when no request is attached
        return ""


def _network_error_types() -> tuple[type[BaseException], ...]:
    """Transport errors of the HTTP client huggingface_hub uses (httpx2 in 2.x, httpx in 1.x)."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    types: list[type[BaseException]] = [ConnectionError, TimeoutError, OfflineModeIsEnabled]
    for module in ("httpx2", "httpx", "requests"):
        try:
            client = __import__(module)
        except ImportError:
            continue
        for attr in ("TransportError", "ConnectionError", "Timeout"):
            cls = getattr(client, attr, None)
            if isinstance(cls, type) and issubclass(cls, BaseException):
                types.append(cls)
    return tuple(types)


def _is_network_error(exc: BaseException) -> bool:
    return isinstance(exc, _network_error_types())


@dataclass
class _Target:
    repo_id: str
    endpoint: str
    revision: str
    token: Optional[str]
    token_origin: str
    n_files: int
    timeout: float = HUB_TIMEOUT_S


def _publish_error(exc: BaseException, stage: str, target: _Target) -> PublishError:
    """A clear, token-free message for any failure of the Hub calls."""
    from huggingface_hub.errors import (
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, owner = target.repo_id, target.repo_id.split("/")[0]
    chain = _root_causes(exc)
    http = next((e for e in chain if isinstance(e, HfHubHTTPError)), None)
    network = next((e for e in chain if _is_network_error(e)), None)
    message: str
    if http is not None and http.response is not None:
        status = http.response.status_code
        server = " ".join((http.server_message or "").split())
        detail = f" (the Hub said: {server})" if server else ""
        if status == 401:
            message = (
                f"the Hub rejected the token from {target.token_origin} (HTTP 401 Unauthorized)"
                f"{detail}: log in again with `hf auth login`, set HF_TOKEN, or pass --token "
                "with a valid token"
            )
        elif status == 403:
            message = (
                f"no write access to {repo} (HTTP 403 Forbidden){detail}: the token from "
                f"{target.token_origin} cannot write to the namespace '{owner}'. Use a token "
                "with write permission (https://huggingface.co/settings/tokens) or a namespace "
                "you belong to"
            )
        elif isinstance(http, RevisionNotFoundError):
            message = f"branch '{target.revision}' of {repo} not found{detail}"
        elif isinstance(http, RepositoryNotFoundError):
            message = f"repository {repo} not found or not accessible with this token{detail}"
        else:
            message = f"the Hub answered HTTP {status} during {stage}{detail}"
    elif network is not None:
        reason = " ".join(str(network).split()) or type(network).__name__
        if "timeout" in type(network).__name__.lower() or isinstance(network, TimeoutError):
            reason = (
                f"no answer within {target.timeout:g} s ({type(network).__name__}); raise "
                "--hub-timeout if the Hub is just slow"
            )
        if stage in ("create", "branch", "read"):
            message = (
                f"cannot reach the Hub at {target.endpoint} ({reason}): check the network "
                "connection (or HF_ENDPOINT); nothing was uploaded"
            )
        else:
            message = f"the upload to {repo} failed half-way ({reason})"
            if "/commit/" in _request_url(network):
                message += (
                    ": the connection dropped while the commit was being sent, so the Hub may "
                    f"or may not have recorded it. Check {target.endpoint}/{repo}/commits/"
                    f"{target.revision} and re-run the same command (files that are already "
                    "there are skipped)"
                )
            elif target.n_files <= ONE_COMMIT_MAX_FILES:
                message += (
                    ". Nothing was committed: all files go into one commit that is created "
                    "only after every upload succeeded, so the repository is unchanged. Re-run "
                    "the same command to retry; large files already uploaded are not sent again"
                )
            else:
                message += (
                    f". Folders of more than {ONE_COMMIT_MAX_FILES} files are committed in "
                    "batches, so some files may already be committed; re-run the same command "
                    "to upload the rest"
                )
    else:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        message = f"publishing to {repo} failed during {stage}: {type(exc).__name__}: {reason}"
        if stage == "upload" and target.n_files <= ONE_COMMIT_MAX_FILES:
            message += "; nothing was committed. Re-run the same command to retry"
    return PublishError(_scrub(message, target.token))


# ------------------------------------------------------------------ the repository now


@dataclass(frozen=True)
class RemoteState:
    """What the repository holds before the upload (read with the Hub's API)."""

    exists: bool
    head: Optional[str] = None  # the commit of the branch (of main for a new branch)
    files: frozenset[str] = frozenset()
    manifest: Optional[Mapping[str, Any]] = None  # of an earlier publish
    card: Optional[str] = None  # README.md's text
    error: str = ""  # why it could not be read (the dry run goes on without it)


def _download_text(api: Any, repo_id: str, path: str, revision: str) -> Optional[str]:
    """A small text file of the repository (None: not UTF-8)."""
    from urllib.parse import quote

    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    # hf_hub_url's form, on api.endpoint (hf_hub_url keeps huggingface.co unless the
    # endpoint is the process's default one)
    url = f"{api.endpoint}/{repo_id}/resolve/{quote(revision, safe='')}/{quote(path)}"
    response = get_session().get(
        url, headers=build_hf_headers(token=api.token), follow_redirects=True
    )
    hf_raise_for_status(response)
    try:
        return response.content.decode("utf-8")
    except UnicodeDecodeError:
        return None


def read_remote(api: Any, repo_id: str, revision: str) -> RemoteState:
    """The files, commit, manifest and card of ``repo_id`` at ``revision`` (a branch that
    does not exist yet starts from main)."""
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        try:
            info = api.repo_info(repo_id, revision=revision, repo_type="model")
        except RevisionNotFoundError:
            info = api.repo_info(repo_id, revision="main", repo_type="model")
    except RepositoryNotFoundError:
        return RemoteState(exists=False)
    files = frozenset(s.rfilename for s in info.siblings or [])
    manifest = card = None
    if MANIFEST_FILENAME in files:
        text = _download_text(api, repo_id, MANIFEST_FILENAME, info.sha)
        manifest = merge_record.parse_manifest(text) if text is not None else None
    if "README.md" in files:
        card = _download_text(api, repo_id, "README.md", info.sha)
    return RemoteState(True, info.sha, files, manifest, card)


@dataclass(frozen=True)
class RemotePlan:
    """What the upload changes besides sending the files: deletions and the card."""

    deletions: tuple[str, ...]
    basis: str  # how the files of an earlier publish were known
    upload_card: bool  # False: README.md on the Hub was edited there and stays
    card_note: str  # what happens to README.md on the Hub, when worth saying
    card_sha256: Optional[str]  # of the README.md the repository holds after the upload


def _sha256(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def plan_remote(
    remote: RemoteState, uploading: set[str], card_text: str, replace_card: bool
) -> RemotePlan:
    """Which files of the repository the upload deletes, and whether its card is replaced.

    Deleted: exactly the files an earlier publish of ours wrote (the ``files`` of the
    manifest it uploaded) that this upload lacks, so a file dropped from the merge
    (``chat_template.jinja``, a shard, a task folder) leaves nothing stale behind; files
    added by hand, and those an earlier ``--include`` sent, stay. A repository an older
    version published (its diagnostics, no manifest): the files with the names a merge
    writes (:func:`is_merge_file_name`). Any other repository: nothing.

    The card: ``README.md`` on the Hub is replaced when it is the card an earlier publish
    uploaded (the manifest's ``card_sha256``) or a signed, unedited mergekit-ext card; one
    edited on the Hub (or written by someone else) stays unless ``replace_card``.
    """
    from mergekit_ext.hub.card import card_text_is_unedited

    sha = _sha256(card_text)
    if not remote.exists:
        return RemotePlan((), "a new repository: nothing to delete", True, "", sha)
    if remote.manifest is not None:
        ours = set(remote.manifest["files"])
        basis = f"the {MANIFEST_FILENAME} an earlier publish uploaded"
    elif merge_record.FILENAME in remote.files:
        ours = {f for f in remote.files if is_merge_file_name(f)}
        basis = (
            f"published by an older mergekit-ext (no {MANIFEST_FILENAME}): the files with the "
            "names a merge writes"
        )
    else:
        ours = set()
        basis = "no earlier mergekit-ext publish in the repository: nothing is deleted"
    keep = {"README.md", ".gitattributes", MANIFEST_FILENAME}
    deletions = tuple(sorted((ours & remote.files) - uploading - keep))

    remote_card = remote.card
    previous_sha = (remote.manifest or {}).get("card_sha256")
    if remote_card is None or remote_card == card_text:
        return RemotePlan(deletions, basis, True, "", sha)
    if _sha256(remote_card) == previous_sha or card_text_is_unedited(remote_card):
        return RemotePlan(deletions, basis, True, "", sha)
    if replace_card:
        note = "README.md on the Hub (edited there, or not mergekit-ext's) is replaced (--replace-card)"
        return RemotePlan(deletions, basis, True, note, sha)
    note = (
        "README.md on the Hub was edited there (or not written by mergekit-ext): it is kept "
        "as it is and the new card is not uploaded; pass --replace-card to replace it (the "
        "Hub keeps the old one in its history)"
    )
    kept_sha = previous_sha if isinstance(previous_sha, str) else None
    return RemotePlan(deletions, basis, False, note, kept_sha)


def upload_manifest(selection: UploadSelection, plan: RemotePlan) -> str:
    """The manifest uploaded with the files: what a later publish may delete."""
    import json as _json

    own = {f.path for f in selection.files} - set(selection.included)
    own.add(MANIFEST_FILENAME)
    if not plan.upload_card:
        own.discard("README.md")
    data = {
        "schema_version": merge_record.SCHEMA_VERSION,
        "written_by": "mergekit-ext publish",
        "files": sorted(own),
        "included": sorted(selection.included),
        "card_sha256": plan.card_sha256,
    }
    return _json.dumps(data, indent=2, sort_keys=True) + "\n"


# ------------------------------------------------------------------------------- publish


def _status(line: str) -> None:
    """What publishing is waiting for, on stderr (a Hub call can take a while)."""
    print(line, file=sys.stderr, flush=True)


def _deletion_lines(plan: RemotePlan) -> list[str]:
    if not plan.deletions:
        return [f"  none ({plan.basis})"]
    return [f"  (known from {plan.basis})", *(f"  {p}" for p in plan.deletions)]


def dry_run_report(
    out_dir: str,
    repo_id: str,
    files: Sequence[FolderFile],
    *,
    endpoint: str,
    private: bool,
    revision: Optional[str],
    create_pr: bool,
    commit_message: str,
    uploader: str,
    token_origin: str,
    card_text: str,
    selection: Optional[UploadSelection] = None,
    remote: Optional[RemoteState] = None,
    plan: Optional[RemotePlan] = None,
) -> str:
    total = sum(f.size for f in files)
    width = max((len(f"{f.size:,}") for f in files), default=1)
    included = set(selection.included) if selection else set()
    lines = [
        "Dry run: nothing was uploaded.",
        f"Repository:     {endpoint}/{repo_id} (model, {'private' if private else 'public'} "
        "if created now)",
        f"Branch:         {revision or 'main'}{' (created if missing)' if revision and revision != 'main' else ''}",
        f"Pull request:   {'yes' if create_pr else 'no'}",
        f"Commit message: {commit_message}",
        f"Upload:         {uploader}, {len(files)} files, {format_bytes(total)} ({total:,} bytes)"
        + (
            ", one commit"
            if uploader == "upload_folder" and len(files) <= ONE_COMMIT_MAX_FILES
            else ""
        ),
        "Token:          "
        + (
            f"found ({token_origin})"
            if token_origin
            else "not found: run `hf auth login`, set HF_TOKEN or pass --token"
        ),
        "",
        "Files:" + (f" (the merge's own known from {selection.basis})" if selection else ""),
        *(
            f"  {f.size:>{width},}  {format_bytes(f.size):>9}  {f.path}"
            + ("  (--include)" if f.path in included else "")
            for f in files
        ),
    ]
    if selection is not None:
        lines += ["", "Left out (not uploaded):"]
        lines += [f"  {path}: {why}" for path, why in selection.left_out] or ["  nothing"]
    lines += ["", "Deleted on the Hub (in the same commit):"]
    if remote is not None and remote.error:
        lines.append(f"  unknown: {repo_id} could not be read ({remote.error})")
    elif plan is not None:
        lines += _deletion_lines(plan)
        if plan.card_note:
            lines += ["", f"Card: {plan.card_note}"]
    lines += ["", "Card front matter (README.md, as uploaded):", _front_matter_text(card_text)]
    return "\n".join(lines)


def _endpoint(endpoint: Optional[str]) -> str:
    from huggingface_hub import constants

    return (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _write_access(whoami: Mapping[str, Any], repo_id: str) -> tuple[Optional[bool], str]:
    """Whether the token ``whoami`` describes can write to ``repo_id`` (None: cannot tell),
    and why, from the fields the Hub's ``/api/whoami-v2`` returns: the token's role
    (``read``, ``write``, ``fineGrained`` with scoped permissions), the user and the
    organisations it belongs to (``roleInOrg``)."""
    owner = repo_id.split("/")[0]
    user = str(whoami.get("name") or "")
    orgs = {
        str(o.get("name")): o.get("roleInOrg")
        for o in whoami.get("orgs") or []
        if isinstance(o, Mapping)
    }
    token = ((whoami.get("auth") or {}).get("accessToken")) or {}
    role = token.get("role") if isinstance(token, Mapping) else None
    if role == "read":
        return False, f"the token of '{user}' is read-only"
    if role == "write":
        if owner == user:
            return True, ""
        if owner not in orgs:
            return False, (
                f"the token belongs to '{user}', not to '{owner}', and '{user}' is not a "
                f"member of an organisation '{owner}' (log in as '{owner}', or use a "
                f"namespace of '{user}' such as {user}/{repo_id.split('/')[1]})"
            )
        if orgs[owner] == "read":
            return False, f"'{user}' has the read role in the organisation '{owner}'"
        return True, ""
    if role == "fineGrained":
        grants = (token.get("fineGrained") or {}).get("scoped") or []
        for grant in grants:
            if not isinstance(grant, Mapping):
                continue
            entity = grant.get("entity") or {}
            if entity.get("name") in (owner, repo_id):
                if "repo.write" in (grant.get("permissions") or []):
                    return True, ""
                return False, f"the fine-grained token has no repo.write permission on '{owner}'"
        return False, f"the fine-grained token grants no permission on '{owner}' or {repo_id}"
    return None, f"the Hub did not say what the token may do (role {role!r})"


def check_write_access(
    repo_id: str,
    token: Optional[str] = None,
    endpoint: Optional[str] = None,
    timeout: float = HUB_TIMEOUT_S,
) -> None:
    """Ask the Hub (``whoami``) whether the token is valid and may write to ``repo_id``'s
    namespace; raises :class:`PublishError` when it is not or may not, logs a warning when
    the answer does not tell."""
    from huggingface_hub import HfApi

    resolved, origin = resolve_token(token)  # the token as given: its origin is told
    endpoint = _endpoint(endpoint)
    target = _Target(repo_id, endpoint, "main", resolved, origin, 0, timeout)
    try:
        info = HfApi(endpoint=endpoint, token=resolved).whoami(token=resolved, cache=False)
    except Exception as e:  # noqa: BLE001 - mapped to a clear PublishError
        raise _publish_error(e, "create", target) from None
    writable, why = _write_access(info if isinstance(info, Mapping) else {}, repo_id)
    if writable is False:
        raise PublishError(
            _scrub(
                f"the token from {origin} cannot write to {repo_id}: {why}. Use a token with "
                "write permission on that namespace (https://huggingface.co/settings/tokens)",
                resolved,
            )
        )
    if writable is None:
        LOG.warning(
            "could not tell whether the token from %s may write to %s (%s); going on",
            origin,
            repo_id,
            why,
        )


def check_visibility(
    api: Any, target: _Target, private: bool, make_private: bool
) -> Optional[bool]:
    """Whether the existing repository is private (None: it does not exist yet). A
    ``--private`` upload to an existing public repository is refused unless
    ``make_private`` (``--make-private``), which asks the caller to change it first."""
    from huggingface_hub.errors import RepositoryNotFoundError

    if not (private or make_private):
        return None
    try:
        info = api.repo_info(target.repo_id, repo_type="model")
    except RepositoryNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001
        raise _publish_error(e, "create", target) from None
    if not info.private and not make_private:
        raise PublishError(
            f"{target.repo_id} already exists and is public: --private only sets the "
            "visibility of a new repository, so this upload would be public. Pass "
            "--make-private to make the repository private (through the Hub's settings) "
            "before uploading, or drop --private to upload to the public repository"
        )
    return bool(info.private)


def check_can_publish(
    repo_id: str,
    token: Optional[str] = None,
    *,
    private: bool = False,
    make_private: bool = False,
    revision: Optional[str] = None,
    create_pr: bool = False,
    endpoint: Optional[str] = None,
    timeout: Optional[float] = None,
) -> None:
    """What ``publish_folder`` would refuse, checked before a merge: the repo id and the
    options, offline mode, a token (``--token``, HF_TOKEN or a login) that the Hub accepts
    and that may write to the namespace (``whoami``), and ``--private`` on a public repo.
    Each Hub request gives up after ``timeout`` seconds without an answer."""
    from huggingface_hub import HfApi

    validate_repo_id(repo_id)
    _check_options(revision, create_pr)
    if hub_offline():
        raise PublishError(
            "--push-to-hub: HF_HUB_OFFLINE is set; unset it to publish, or drop --push-to-hub "
            "and run `mergekit-ext publish` later"
        )
    resolved, origin = resolve_token(token)
    if not resolved:
        raise PublishError(
            "--push-to-hub: not logged in to the Hugging Face Hub: run `hf auth login`, set "
            "HF_TOKEN, or pass --token (a token with write permission); nothing was merged"
        )
    try:
        with bounded_hub_requests(timeout) as bound:
            _status(f"--push-to-hub: checking the token and {repo_id} (each request gives up "
                    f"after {bound:g} s without an answer)")  # fmt: skip
            check_write_access(repo_id, token, endpoint, bound)
            endpoint = _endpoint(endpoint)
            target = _Target(repo_id, endpoint, revision or "main", resolved, origin, 0, bound)
            check_visibility(
                HfApi(endpoint=endpoint, token=resolved), target, private, make_private
            )
    except PublishError as e:
        raise PublishError(f"--push-to-hub: {e}; nothing was merged") from None


def _check_options(revision: Optional[str], create_pr: bool) -> None:
    if create_pr and revision not in (None, "main"):
        raise PublishError(
            "--create-pr opens a pull request against the main branch; drop --revision "
            f"({revision!r}) or drop --create-pr"
        )
    if revision is not None and not revision.strip():
        raise PublishError("--revision must name a branch")


class PublishResult(str):
    """What :func:`publish_folder` returns: the URL of the commit (or pull request) it made,
    or of the commit the branch already had when nothing changed; :attr:`summary` is the
    line to show."""

    repo_url: str
    changed: bool
    deleted: tuple[str, ...]
    summary: str

    def __new__(
        cls, url: str, *, repo_url: str, changed: bool, deleted: Sequence[str], summary: str
    ) -> PublishResult:
        result = super().__new__(cls, url)
        result.repo_url, result.changed, result.summary = repo_url, changed, summary
        result.deleted = tuple(deleted)
        return result


def publish_folder(
    out_dir: str,
    repo_id: str,
    *,
    private: bool = False,
    revision: Optional[str] = None,
    commit_message: Optional[str] = None,
    create_pr: bool = False,
    token: Optional[str] = None,
    dry_run: bool = False,
    endpoint: Optional[str] = None,
    keep_card: bool = False,
    template_dir: Optional[str] = None,
    timeout: Optional[float] = None,
    replace_card: bool = False,
    make_private: bool = False,
    include: Sequence[str] = (),
) -> str:
    """Upload the merge in ``out_dir`` to ``repo_id``; returns a :class:`PublishResult`
    (the commit or PR URL; the dry run's report with ``dry_run``).

    What goes: the merge's own files and those ``include`` names
    (:func:`select_upload_files`; never a hidden file nor a symbolic link), plus a manifest
    of them. The uploaded ``README.md`` is the card rendered for ``repo_id`` (the
    repository's name as title, ``repo_id`` in the loading snippets; ``template_dir`` as
    for ``card``); the local one, written for the folder, is left as it is. ``keep_card``
    uploads the local file unchanged instead; a card mergekit-ext did not write as it is
    now (mergekit's, one edited by hand) is uploaded unchanged unless ``replace_card``, and
    so is one edited on the Hub kept there (:func:`plan_remote`).

    Files an earlier publish of ours wrote that this one lacks are deleted in the same
    commit, each one named on stderr; nothing else in the repository is touched
    (:func:`plan_remote`). ``private`` creates a private repository; an existing public one
    is refused unless ``make_private``, which makes it private before anything is uploaded.

    With ``dry_run`` nothing is sent (the repository is only read) and the returned text
    lists the files, what is left out and why, what would be deleted, and the card's front
    matter. Raises :class:`PublishError` with a message that says what to do: invalid repo
    id, incomplete folder, not logged in, 401/403, network down, an upload that failed
    half-way. Every Hub request gives up after ``timeout`` seconds without an answer
    (:mod:`~mergekit_ext.hub.http`); each step is announced on stderr.
    """
    from huggingface_hub import HfApi

    validate_repo_id(repo_id)
    _check_options(revision, create_pr)
    problems = check_complete(out_dir)
    if problems:
        raise PublishError(
            f"{out_dir} is not a complete merge, refusing to publish: " + "; ".join(problems)
        )
    redact = _redactor(out_dir)
    card_text = redact(
        card_to_upload(
            out_dir,
            repo_id,
            keep_card=keep_card,
            template_dir=template_dir,
            replace_card=replace_card,
        )
    )
    selection = select_upload_files(out_dir, include, card_text)
    sizes = {"README.md": len(card_text.encode("utf-8"))}
    for f in selection.files:
        changed = (
            None if f.path == "README.md" else uploaded_bytes(out_dir, f.path, repo_id, redact)
        )
        if changed is not None:
            sizes[f.path] = len(changed)
    files = [FolderFile(f.path, sizes.get(f.path, f.size)) for f in selection.files]
    endpoint = _endpoint(endpoint)
    resolved, origin = resolve_token(token)
    api = HfApi(endpoint=endpoint, token=resolved)
    message = commit_message or _default_commit_message(out_dir)
    branch = "main" if create_pr else (revision or "main")

    if dry_run:
        remote = _read_for_dry_run(api, repo_id, branch, timeout, resolved)
        plan = plan_remote(remote, {f.path for f in files}, card_text, replace_card)
        files.append(FolderFile(MANIFEST_FILENAME, len(upload_manifest(selection, plan))))
        if not plan.upload_card:
            files = [f for f in files if f.path != "README.md"]
        total = sum(f.size for f in files)
        return _scrub(
            dry_run_report(
                out_dir,
                repo_id,
                files,
                endpoint=endpoint,
                private=private or make_private,
                revision=revision,
                create_pr=create_pr,
                commit_message=message,
                uploader=choose_uploader(total, create_pr, api),
                token_origin=origin,
                card_text=card_text,
                selection=selection,
                remote=remote,
                plan=plan,
            ),
            resolved,
        )

    if hub_offline():
        raise PublishError("HF_HUB_OFFLINE is set: unset it to publish to the Hub")
    if not resolved:
        raise PublishError(
            "not logged in to the Hugging Face Hub: run `hf auth login`, set HF_TOKEN, or pass "
            "--token (a token with write permission)"
        )
    target = _Target(repo_id, endpoint, revision or "main", resolved, origin, len(files) + 1)
    with bounded_hub_requests(timeout) as bound:
        target.timeout = bound
        return _create_and_upload(
            api, out_dir, card_text, target, selection, files, private, make_private, revision,
            message, commit_message, create_pr, replace_card,
        )  # fmt: skip


def _read_for_dry_run(
    api: Any, repo_id: str, branch: str, timeout: Optional[float], token: Optional[str]
) -> RemoteState:
    """The repository as it is, for the dry run; what could not be read is said, not raised."""
    if hub_offline():
        return RemoteState(exists=False, error="HF_HUB_OFFLINE is set")
    try:
        with bounded_hub_requests(timeout):
            return read_remote(api, repo_id, branch)
    except Exception as e:  # noqa: BLE001 - the dry run reports it
        target = _Target(repo_id, api.endpoint, branch, token, "", 0)
        return RemoteState(exists=False, error=str(_publish_error(e, "read", target)))


def _create_and_upload(
    api: Any,
    out_dir: str,
    card_text: str,
    target: _Target,
    selection: UploadSelection,
    files: list[FolderFile],
    private: bool,
    make_private: bool,
    revision: Optional[str],
    message: str,
    commit_message: Optional[str],
    create_pr: bool,
    replace_card: bool,
) -> PublishResult:
    repo_id, endpoint = target.repo_id, target.endpoint
    bound = f"each request gives up after {target.timeout:g} s without an answer"
    made_private = False
    if check_visibility(api, target, private, make_private) is False:
        try:
            api.update_repo_settings(repo_id, private=True, repo_type="model")
        except Exception as e:  # noqa: BLE001
            raise _publish_error(e, "settings", target) from None
        LOG.warning("%s was public: it is now private (--make-private)", repo_id)
        made_private = True
    _status(f"publishing: creating (or finding) {repo_id} at {endpoint} ({bound})")
    try:
        api.create_repo(repo_id, private=private or make_private, exist_ok=True, repo_type="model")
    except Exception as e:  # noqa: BLE001 - mapped to a clear PublishError
        raise _publish_error(e, "create", target) from None
    if revision and revision != "main" and not create_pr:
        _status(f"publishing: creating branch {revision} of {repo_id}")
        try:
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        except Exception as e:  # noqa: BLE001
            raise _publish_error(e, "branch", target) from None
    branch = "main" if create_pr else (revision or "main")
    try:
        remote = read_remote(api, repo_id, branch)
    except Exception as e:  # noqa: BLE001
        raise _publish_error(e, "read", target) from None
    plan = plan_remote(remote, {f.path for f in files}, card_text, replace_card)
    if plan.card_note:
        LOG.warning("%s", plan.card_note)
        _status(f"publishing: {plan.card_note}")
    if not plan.upload_card:
        files = [f for f in files if f.path != "README.md"]
    manifest = upload_manifest(selection, plan)
    total = sum(f.size for f in files) + len(manifest)
    uploader = choose_uploader(total, create_pr, api)
    LOG.info(
        "publishing %s to %s/%s (%d files, %s, %s)",
        out_dir, endpoint, repo_id, len(files) + 1, format_bytes(total), uploader,
    )  # fmt: skip
    for path in plan.deletions:  # every remote deletion is named
        _status(f"publishing: deleting {path} (an earlier publish wrote it; this one lacks it)")
    _status(
        f"publishing: uploading {len(files) + 1} files ({format_bytes(total)}) to {repo_id} "
        f"({bound})"
    )
    card = card_text if plan.upload_card else None
    with staged_folder(out_dir, card, repo_id, files, manifest) as staging:
        info = _upload(api, staging, target, revision, uploader, message, commit_message,
                       create_pr, plan.deletions)  # fmt: skip
    return _result(info, target, branch, remote, plan, create_pr, made_private)


def _result(
    info: Any,
    target: _Target,
    branch: str,
    remote: RemoteState,
    plan: RemotePlan,
    create_pr: bool,
    made_private: bool,
) -> PublishResult:
    """What happened, in one line: the repository, and the commit or pull request made, or
    that nothing changed (huggingface_hub skips an empty commit and opens no pull request)."""
    repo_url = f"{target.endpoint}/{target.repo_id}"
    if not hasattr(info, "commit_url"):  # upload_large_folder: several commits, one URL
        return PublishResult(info, repo_url=repo_url, changed=True, deleted=(),
                             summary=f"published: {repo_url} (branch {branch}: {info})")  # fmt: skip
    url = (info.pr_url if create_pr and info.pr_url else info.commit_url) or info.commit_url
    unchanged = (create_pr and not info.pr_url) or (
        not create_pr and remote.head is not None and info.oid == remote.head
    )
    if unchanged:
        summary = (
            f"nothing to publish: {repo_url} (branch {branch}) already holds these files, at "
            f"{info.commit_url}; no commit was made"
            + (" and no pull request opened" if create_pr else "")
            + ("; the repository was made private (--make-private)" if made_private else "")
        )
        return PublishResult(info.commit_url, repo_url=repo_url, changed=False, deleted=(),
                             summary=summary)  # fmt: skip
    what = f"pull request {url}" if create_pr else f"branch {branch}, commit {url}"
    summary = f"published: {repo_url} ({what})"
    if plan.deletions:
        summary += f"; deleted {len(plan.deletions)} file(s) an earlier publish wrote"
    LOG.info("published %s", url)
    return PublishResult(url, repo_url=repo_url, changed=True, deleted=plan.deletions,
                         summary=summary)  # fmt: skip


def _upload(
    api: Any,
    folder: str,
    target: _Target,
    revision: Optional[str],
    uploader: str,
    message: str,
    commit_message: Optional[str],
    create_pr: bool,
    deletions: Sequence[str],
) -> Any:
    """``upload_large_folder`` or ``upload_folder`` of ``folder``; the commit info (the
    branch's URL for ``upload_large_folder``)."""
    import glob

    repo_id, endpoint = target.repo_id, target.endpoint
    try:
        if uploader == "upload_large_folder":
            if commit_message:
                LOG.warning(
                    "upload_large_folder writes its own commit messages; --commit-message is ignored"
                )
            if deletions:
                LOG.warning(
                    "upload_large_folder cannot delete files: %s stay in %s beside the new "
                    "ones; remove them on the Hub",
                    ", ".join(deletions),
                    repo_id,
                )
            api.upload_large_folder(
                repo_id=repo_id, folder_path=folder, repo_type="model", revision=revision
            )
            return f"{endpoint}/{repo_id}/tree/{revision or 'main'}"
        with _quiet_empty_commit():
            return api.upload_folder(
                repo_id=repo_id,
                folder_path=folder,
                repo_type="model",
                revision=revision,
                commit_message=message,
                create_pr=create_pr,
                # exact paths: a name with * ? [ must not match others
                delete_patterns=[glob.escape(p) for p in deletions] or None,
            )
    except Exception as e:  # noqa: BLE001
        raise _publish_error(e, "upload", target) from None


@contextlib.contextmanager
def _quiet_empty_commit() -> Iterator[None]:
    """huggingface_hub warns "No files have been modified" (once per call on the way);
    the result line says it instead (:func:`_result`)."""

    def keep(record: logging.LogRecord) -> bool:
        return "No files have been modified" not in record.getMessage()

    logger = logging.getLogger("huggingface_hub.hf_api")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)
