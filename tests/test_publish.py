"""Publishing to the Hub with the real ``huggingface_hub`` client, end to end.

The Hugging Face Hub cannot be reached from the machines these tests run on, so
``tests/hub_server.py`` stands in for it: a small threaded HTTP server on 127.0.0.1 that
implements the routes ``create_repo``, ``create_branch`` and ``upload_folder`` call (repo
creation, README validation, preupload, the LFS batch API with "basic" uploads, and the
NDJSON commit). The client is pointed at it with ``endpoint=`` / ``HF_ENDPOINT`` and
runs unmodified: only its retry sleep is shortened, and its Xet path is switched off
(``HF_HUB_DISABLE_XET``) except in the one test that runs the default Xet-enabled
``upload_folder`` pipeline with regular (non-LFS) files.

Every test checks that the token never appears in anything printed or logged.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import socket
import types
from pathlib import Path

import click
import huggingface_hub
import huggingface_hub.constants as hf_constants
import huggingface_hub.utils._http as hf_http
import pytest
from click.testing import CliRunner
from hub_server import FakeHub, Fault, Token
from mergekit.merge import run_merge
from mergekit.options import MergeOptions

from mergekit_ext import merge_record
from mergekit_ext.cli_hub import publish_command
from mergekit_ext.config import parse_config
from mergekit_ext.errors import PublishError
from mergekit_ext.hub import publish as publish_mod
from mergekit_ext.hub.card import render_card_for_repo, write_model_card
from mergekit_ext.hub.publish import check_complete, list_upload_files, publish_folder

MANIFEST = merge_record.MANIFEST_FILENAME
WRITE_TOKEN = "hf_WriteTokenForTests0123456789abcdef"
READ_TOKEN = "hf_ReadOnlyTokenForTests0123456789abc"
BOB_TOKEN = "hf_BobTokenForTests0123456789abcdefgh"
ENV_TOKEN = "hf_EnvTokenForTests0123456789abcdefgh"
CACHED_TOKEN = "hf_CachedTokenForTests0123456789abcde"
ALL_TOKENS = (
    WRITE_TOKEN,
    READ_TOKEN,
    BOB_TOKEN,
    ENV_TOKEN,
    CACHED_TOKEN,
    "hf_NotAValidToken000000",
)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def merged(tiny_llama_set, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished ACE merge in several safetensors shards, with its model card."""
    out = tmp_path_factory.mktemp("publish") / "merged"
    experts = "".join(f"  - model: {e}\n" for e in tiny_llama_set.experts)
    yaml_text = (
        f"merge_method: ace\nbase_model: {tiny_llama_set.base}\nmodels:\n{experts}dtype: float32\n"
    )
    cfg = parse_config(yaml_text)
    with merge_record.collecting() as collector:
        run_merge(
            cfg.merge,
            str(out),
            options=MergeOptions(write_model_card=False, quiet=True, out_shard_size=20_000),
            config_source=yaml_text,
        )
    (out / "mergekit_config.yml").write_text(yaml_text)
    record = merge_record.MergeRecord("ace", sections=collector.sections)
    record.write(str(out), parameters={}, seed=0, config_sha256=cfg.sha256)
    write_model_card(str(out))
    return out


@pytest.fixture
def folder(merged: Path, tmp_path: Path) -> Path:
    """A private copy of the merge that a test may damage."""
    return Path(shutil.copytree(merged, tmp_path / "merged"))


@pytest.fixture
def client_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Online, legacy LFS path, no real login, no retry sleeps, quiet progress bars."""
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(tmp_path / "no-login" / "token"))
    monkeypatch.setattr(hf_http, "time", types.SimpleNamespace(sleep=lambda seconds: None))
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    huggingface_hub.utils.disable_progress_bars()
    yield
    huggingface_hub.utils.enable_progress_bars()


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch):
    """Connections may only go to 127.0.0.1: nothing leaves the machine."""
    attempts: list[object] = []
    connect = socket.socket.connect

    def guarded(self: socket.socket, address: object) -> None:
        host = address[0] if isinstance(address, tuple) else address
        if host not in ("127.0.0.1", "::1", "localhost"):
            attempts.append(address)
            raise ConnectionRefusedError(f"test blocked a connection to {address}")
        return connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", guarded)
    yield
    assert attempts == []


@pytest.fixture
def hub(client_env, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    tokens = {
        WRITE_TOKEN: Token("alice", orgs=("team",)),
        READ_TOKEN: Token("alice", write=False),
        BOB_TOKEN: Token("bob"),
        ENV_TOKEN: Token("alice"),
        CACHED_TOKEN: Token("alice"),
    }
    with FakeHub(tokens) as server:
        # huggingface_hub's best-effort telemetry (agent-harness registry) goes to
        # constants.ENDPOINT; point that at the stand-in too.
        monkeypatch.setattr(hf_constants, "ENDPOINT", server.url)
        yield server


@pytest.fixture(autouse=True)
def token_never_printed(capfd: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture):
    """Everything printed to stdout/stderr and every log record is free of tokens."""
    caplog.set_level(logging.DEBUG)
    huggingface_hub.utils.logging.set_verbosity_debug()
    yield
    huggingface_hub.utils.logging.set_verbosity_warning()
    captured = capfd.readouterr()
    for text in (captured.out, captured.err, caplog.text):
        for token in ALL_TOKENS:
            assert token not in text


def assert_files_arrived(hub: FakeHub, repo_id: str, folder: Path, branch: str = "main") -> None:
    """Exactly one new commit holds every file of the folder, byte for byte (text files with
    local paths redacted); its README.md is the card rendered for ``repo_id`` (the folder's
    own card is not changed)."""
    commits = hub.commits(repo_id, branch)
    assert len(commits) == 2, [c.summary for c in commits]  # the repo's initial commit + ours
    commit = commits[-1]
    local = {f.path for f in list_upload_files(str(folder))}
    assert set(commit.changed) == local | {MANIFEST} == set(commit.files)
    # the manifest uploaded with them names them: what a later publish may delete
    assert set(json.loads(commit.files[MANIFEST])["files"]) == local | {MANIFEST}
    for path in local - {"README.md"}:  # text files naming local paths: redacted (#28, 8)
        expected_bytes = publish_mod.uploaded_bytes(str(folder), path, repo_id)
        assert commit.files[path] == (expected_bytes or (folder / path).read_bytes()), path
    expected = render_card_for_repo(str(folder), repo_id).encode("utf-8")
    assert commit.files["README.md"] == expected


def error_of(excinfo: pytest.ExceptionInfo) -> str:
    message = str(excinfo.value)
    for token in ALL_TOKENS:
        assert token not in message
    return message


# ------------------------------------------------------------------------- successes


def test_publish_uploads_every_file_in_one_commit(hub: FakeHub, folder: Path) -> None:
    shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
    assert len(shards) >= 2 and (folder / "model.safetensors.index.json").is_file()
    url = publish_folder(str(folder), "alice/tiny-merge", token=WRITE_TOKEN, endpoint=hub.url)

    assert_files_arrived(hub, "alice/tiny-merge", folder)
    commit = hub.commits("alice/tiny-merge")[-1]
    assert url == f"{hub.url}/alice/tiny-merge/commit/{commit.oid}"
    assert commit.summary == "Upload model merged with mergekit-ext (ace)"
    # Binary files travelled through the LFS batch API, text files inside the commit.
    uploaded = set(hub.lfs_puts)
    for name in [*shards, "images/ace_gamma.png"]:
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() in uploaded, name
    for name in ("README.md", "config.json", "mergekit_config.yml"):
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() not in uploaded, name
    assert [r for r in hub.requests if "/commit/" in r[1]] == [
        ("POST", "/api/models/alice/tiny-merge/commit/main")
    ]
    assert hub.repos["alice/tiny-merge"].private is False


def test_uploaded_card_is_rendered_for_the_repo(hub: FakeHub, folder: Path) -> None:
    """Issue #14 item 8: the Hub copy names the repo; the local card is not touched."""
    from mergekit_ext.hub.card import write_model_card

    results = [{"task": "text-generation", "dataset": "wikitext", "metrics": [
        {"type": "perplexity", "value": 12.5}]}]  # fmt: skip
    write_model_card(str(folder), eval_results=results)
    local_before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    mtimes = {p: p.stat().st_mtime_ns for p in local_before}
    local_card = (folder / "README.md").read_text(encoding="utf-8")
    assert "# merged\n" in local_card and 'model_id = "./merged"' in local_card

    publish_folder(str(folder), "alice/tiny-merge", token=WRITE_TOKEN, endpoint=hub.url)
    uploaded = hub.commits("alice/tiny-merge")[-1].files["README.md"].decode("utf-8")
    assert "# tiny-merge\n" in uploaded and "# merged\n" not in uploaded
    assert 'model_id = "alice/tiny-merge"' in uploaded and "./merged" not in uploaded
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", uploaded)
    assert links and links == re.findall(r"!\[[^\]]*\]\(([^)]+)\)", local_card)
    files = hub.commits("alice/tiny-merge")[-1].files
    assert all(not os.path.isabs(link) and link in files for link in links)
    meta = huggingface_hub.ModelCard(uploaded).data.to_dict()  # the model-index is kept
    assert meta["model-index"][0]["results"][0]["metrics"][0]["value"] == 12.5
    # Only the card differs from the local card: everything else is rendered the same way.
    diff = [(a, b) for a, b in zip(local_card.splitlines(), uploaded.splitlines()) if a != b]
    assert {a for a, _ in diff} <= {
        "# merged", 'model_id = "./merged"', "- name: merged",
        "and run `mergekit-ext run mergekit_config.yml ./merged`.",
    }, diff  # fmt: skip
    # The local folder is exactly as it was: same files, bytes and modification times.
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == local_before
    assert {p: p.stat().st_mtime_ns for p in local_before} == mtimes

    publish_folder(str(folder), "alice/as-is", token=WRITE_TOKEN, endpoint=hub.url, keep_card=True)
    assert hub.commits("alice/as-is")[-1].files["README.md"] == local_before[folder / "README.md"]
    # A folder that is not a mergekit-ext merge has no card to render: its README goes as is.
    (folder / "mergekit_config.yml").unlink()
    publish_folder(str(folder), "alice/not-ours", token=WRITE_TOKEN, endpoint=hub.url)
    assert (
        hub.commits("alice/not-ours")[-1].files["README.md"] == local_before[folder / "README.md"]
    )


def test_publish_again_skips_unchanged_files(hub: FakeHub, folder: Path) -> None:
    publish_folder(str(folder), "alice/again", token=WRITE_TOKEN, endpoint=hub.url)
    puts = len(hub.lfs_puts)
    (folder / "mergekit_config.yml").write_text(
        "# edited\n" + (folder / "mergekit_config.yml").read_text()
    )
    publish_folder(str(folder), "alice/again", token=WRITE_TOKEN, endpoint=hub.url)
    commits = hub.commits("alice/again")
    # The card shows the configuration (now edited): the two text files changed, nothing else.
    assert len(commits) == 3
    # (and the manifest, which records the card's hash)
    assert sorted(commits[-1].changed) == sorted(["README.md", MANIFEST, "mergekit_config.yml"])
    assert len(hub.lfs_puts) == puts  # no LFS object was sent twice


def test_private_branch_and_commit_message(hub: FakeHub, folder: Path) -> None:
    url = publish_folder(
        str(folder),
        "team/tiny-merge",
        token=WRITE_TOKEN,
        endpoint=hub.url,
        private=True,
        revision="dev",
        commit_message="first merge",
    )
    assert hub.repos["team/tiny-merge"].private is True
    assert len(hub.commits("team/tiny-merge", "main")) == 1  # main untouched
    assert_files_arrived(hub, "team/tiny-merge", folder, branch="dev")
    assert hub.commits("team/tiny-merge", "dev")[-1].summary == "first merge"
    assert url.startswith(f"{hub.url}/team/tiny-merge/commit/")


def test_create_pr(hub: FakeHub, folder: Path) -> None:
    url = publish_folder(
        str(folder), "alice/pr-merge", token=WRITE_TOKEN, endpoint=hub.url, create_pr=True
    )
    assert url == f"{hub.url}/alice/pr-merge/discussions/1"
    repo = hub.repos["alice/pr-merge"]
    assert len(repo.pull_requests) == 1 and len(hub.commits("alice/pr-merge")) == 1
    with pytest.raises(PublishError, match="pull request against the main branch"):
        publish_folder(
            str(folder), "alice/pr-merge", token=WRITE_TOKEN, create_pr=True, revision="dev"
        )


def test_default_xet_client_path_with_regular_files(client_env, folder: Path, monkeypatch) -> None:
    """With hf_xet installed the client's default pipeline also commits everything at once."""
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_XET", False)
    with FakeHub({WRITE_TOKEN: Token("alice")}, lfs=False) as server:
        publish_folder(str(folder), "alice/xet-path", token=WRITE_TOKEN, endpoint=server.url)
        assert_files_arrived(server, "alice/xet-path", folder)
        assert server.lfs_puts == []


def test_token_from_environment_and_cached_login(hub: FakeHub, folder: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", ENV_TOKEN)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    publish_folder(str(folder), "alice/env-token")
    assert_files_arrived(hub, "alice/env-token", folder)

    monkeypatch.delenv("HF_TOKEN")
    token_file = Path(hf_constants.HF_TOKEN_PATH)
    token_file.parent.mkdir(parents=True)
    token_file.write_text(CACHED_TOKEN)
    publish_folder(str(folder), "alice/cached-login")
    assert_files_arrived(hub, "alice/cached-login", folder)


# ---------------------------------------------------------------------------- errors


def test_not_logged_in(hub: FakeHub, folder: Path) -> None:
    with pytest.raises(PublishError) as excinfo:
        publish_folder(str(folder), "alice/x", endpoint=hub.url)
    assert "not logged in" in error_of(excinfo) and "hf auth login" in str(excinfo.value)
    assert hub.requests == []


def test_invalid_token_401(hub: FakeHub, folder: Path) -> None:
    with pytest.raises(PublishError) as excinfo:
        publish_folder(str(folder), "alice/x", token="hf_NotAValidToken000000", endpoint=hub.url)
    message = error_of(excinfo)
    assert "401" in message and "hf auth login" in message
    assert hub.repos == {}


def test_no_write_access_403(hub: FakeHub, folder: Path) -> None:
    # Creating a repo in someone else's namespace.
    with pytest.raises(PublishError) as excinfo:
        publish_folder(str(folder), "bob/x", token=WRITE_TOKEN, endpoint=hub.url)
    message = error_of(excinfo)
    assert "403" in message and "no write access to bob/x" in message and "'bob'" in message
    assert hub.repos == {}
    # A read-only token on an existing repo: create_repo's 403 is tolerated by the client
    # (the repo exists), the upload itself is refused and nothing is committed.
    publish_folder(str(folder), "alice/exists", token=WRITE_TOKEN, endpoint=hub.url)
    with pytest.raises(PublishError) as excinfo:
        publish_folder(str(folder), "alice/exists", token=READ_TOKEN, endpoint=hub.url)
    assert "403" in error_of(excinfo)
    assert len(hub.commits("alice/exists")) == 2


@pytest.mark.parametrize(
    "repo_id",
    [
        "no-slash",
        "a/b/c",
        "alice/",
        "/name",
        "-alice/model",
        "alice/bad..name",
        "alice/na me",
        "alice/" + "x" * 97,
    ],
)
def test_invalid_repo_id_is_refused_locally(hub: FakeHub, folder: Path, repo_id: str) -> None:
    with pytest.raises(PublishError, match="invalid repo id"):
        publish_folder(str(folder), repo_id, token=WRITE_TOKEN, endpoint=hub.url)
    assert hub.requests == []


def test_network_down(client_env, folder: Path) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(PublishError) as excinfo:
        publish_folder(
            str(folder), "alice/x", token=WRITE_TOKEN, endpoint=f"http://127.0.0.1:{port}"
        )
    message = error_of(excinfo)
    assert "cannot reach the Hub" in message and "nothing was uploaded" in message


def test_connection_dropped_during_lfs_upload(hub: FakeHub, folder: Path) -> None:
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    oid = hashlib.sha256(shard.read_bytes()).hexdigest()
    fault = hub.add_fault(Fault("PUT", f"/lfs-objects/{oid}$", times=None))  # every retry too
    with pytest.raises(PublishError) as excinfo:
        publish_folder(str(folder), "alice/dropped", token=WRITE_TOKEN, endpoint=hub.url)
    message = error_of(excinfo)
    assert "failed half-way" in message and "Nothing was committed" in message
    assert "Re-run the same command" in message
    assert fault.hits == 6  # the client retried 5 times, then gave up
    assert len(hub.commits("alice/dropped")) == 1  # only the initial commit
    assert oid not in hub.lfs_objects

    hub.faults.clear()
    sent_before = set(hub.lfs_puts)
    publish_folder(str(folder), "alice/dropped", token=WRITE_TOKEN, endpoint=hub.url)
    assert_files_arrived(hub, "alice/dropped", folder)
    assert hub.lfs_puts.count(oid) == 1
    assert all(hub.lfs_puts.count(o) == 1 for o in sent_before)  # not sent again


def test_transient_drop_is_retried(hub: FakeHub, folder: Path) -> None:
    fault = hub.add_fault(Fault("PUT", "/lfs-objects/", times=1))
    publish_folder(str(folder), "alice/flaky", token=WRITE_TOKEN, endpoint=hub.url)
    assert fault.hits == 1
    assert_files_arrived(hub, "alice/flaky", folder)


def test_connection_dropped_while_committing(hub: FakeHub, folder: Path) -> None:
    hub.add_fault(Fault("POST", "/commit/", times=1))
    with pytest.raises(PublishError) as excinfo:
        publish_folder(str(folder), "alice/commit-drop", token=WRITE_TOKEN, endpoint=hub.url)
    message = error_of(excinfo)
    assert "while the commit was being sent" in message
    assert f"{hub.url}/alice/commit-drop/commits/main" in message
    assert len(hub.commits("alice/commit-drop")) == 1
    publish_folder(str(folder), "alice/commit-drop", token=WRITE_TOKEN, endpoint=hub.url)
    assert_files_arrived(hub, "alice/commit-drop", folder)


def test_server_error_status(hub: FakeHub, folder: Path) -> None:
    hub.add_fault(Fault("POST", "/preupload/", status=422, message="quota exceeded", times=None))
    with pytest.raises(PublishError) as excinfo:
        publish_folder(str(folder), "alice/quota", token=WRITE_TOKEN, endpoint=hub.url)
    assert "HTTP 422" in error_of(excinfo) and "quota exceeded" in str(excinfo.value)


# ------------------------------------------------------------------ incomplete folders


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100])


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        (lambda f: (f / "config.json").unlink(), "config.json is missing"),
        (
            lambda f: sorted(f.glob("model-*.safetensors"))[0].unlink(),
            "(named in model.safetensors.index.json) is missing",
        ),
        (lambda f: _truncate(sorted(f.glob("model-*.safetensors"))[-1]), "is truncated or corrupt"),
        (lambda f: (f / "README.md").unlink(), "README.md (the model card) is missing"),
        (
            lambda f: (f / "images" / "ace_gamma.png").unlink(),
            "images/ace_gamma.png (linked from README.md) is missing",
        ),
        (
            lambda f: (f / "README.md").write_text("---\n[unclosed\n---\n"),
            "README.md front matter is invalid",
        ),
        (
            lambda f: [p.unlink() for p in f.glob("model*.safetensors*")],
            "model.safetensors (or model.safetensors.index.json and its shards) is missing",
        ),
    ],
)
def test_incomplete_folder_is_refused(hub: FakeHub, folder: Path, damage, needle: str) -> None:
    assert check_complete(str(folder)) == []
    damage(folder)
    with pytest.raises(PublishError) as excinfo:
        publish_folder(str(folder), "alice/x", token=WRITE_TOKEN, endpoint=hub.url)
    message = error_of(excinfo)
    assert "not a complete merge" in message and needle in message
    assert hub.requests == []


def test_task_folders_are_checked(folder: Path) -> None:
    task = folder / "tasks" / "sentiment"
    task.mkdir(parents=True)
    (task / "config.json").write_text("{}")
    assert check_complete(str(folder)) == [
        "tasks/sentiment/model.safetensors (or model.safetensors.index.json and its shards) is missing"
    ]
    shutil.copy(sorted(folder.glob("model-*.safetensors"))[0], task / "model.safetensors")
    assert check_complete(str(folder)) == []


# ----------------------------------------------------------------------- dry run + CLI


def test_dry_run_lists_files_and_front_matter(hub: FakeHub, folder: Path) -> None:
    result = CliRunner().invoke(
        publish_command,
        [
            str(folder),
            "--repo-id",
            "alice/tiny",
            "--dry-run",
            "--token",
            WRITE_TOKEN,
            "--endpoint",
            hub.url,
        ],
    )
    assert result.exit_code == 0, result.output
    out = result.output
    assert WRITE_TOKEN not in out
    # nothing sent: the repository was only read (what it holds decides what is deleted)
    assert hub.requests and {method for method, _ in hub.requests} == {"GET"}
    assert "Deleted on the Hub (in the same commit):\n  none (a new repository" in out
    assert "Token:          found (--token)" in out
    card = render_card_for_repo(str(folder), "alice/tiny").encode("utf-8")
    sizes = {f.path: f.size for f in list_upload_files(str(folder))} | {"README.md": len(card)}
    for path in sizes:  # the sizes as uploaded: local paths redacted (issue #28, 8)
        redacted = publish_mod.uploaded_bytes(str(folder), path, "alice/tiny")
        if path != "README.md" and redacted is not None:
            sizes[path] = len(redacted)
    assert sizes["mergekit_config.yml"] < (folder / "mergekit_config.yml").stat().st_size
    for path, size in sizes.items():
        assert re.search(rf"^\s+{size:,}\s+.*\s{re.escape(path)}$", out, re.M), path
    manifest_size = int(re.search(rf"^\s+([\d,]+)\s.*\s{MANIFEST}$", out, re.M)[1].replace(",", ""))
    assert f"({sum(sizes.values()) + manifest_size:,} bytes), one commit" in out
    assert "Card front matter (README.md, as uploaded):\n---\n" in out
    assert "- mergekit-ext" in out and "pipeline_tag: text-generation" in out


def test_cli_publish_and_errors(hub: FakeHub, folder: Path) -> None:
    runner = CliRunner()
    args = [str(folder), "--repo-id", "alice/cli", "--endpoint", hub.url]
    result = runner.invoke(publish_command, [*args, "--token", WRITE_TOKEN])
    assert result.exit_code == 0, result.output
    # stdout is the URL alone; the steps go to stderr (issue #28: what publishing waits for)
    assert result.stdout.startswith(
        f"published: {hub.url}/alice/cli (branch main, commit {hub.url}/alice/cli/commit/"
    )
    assert "publishing: uploading" in result.stderr
    assert_files_arrived(hub, "alice/cli", folder)

    result = runner.invoke(publish_command, [*args, "--token", "hf_NotAValidToken000000"])
    assert result.exit_code == 1 and "401" in result.output
    assert "hf_NotAValidToken000000" not in result.output

    result = runner.invoke(
        publish_command, [str(folder), "--repo-id", "not a repo", "--token", WRITE_TOKEN]
    )
    assert result.exit_code == 1 and "invalid repo id" in result.output


def test_large_folders_use_upload_large_folder_when_available(monkeypatch) -> None:
    class OldClient:  # huggingface_hub 1.x
        def upload_large_folder(self) -> None: ...

    class NewClient:  # huggingface_hub 2.x: upload_folder is resumable itself
        pass

    monkeypatch.setattr(publish_mod, "LARGE_FOLDER_BYTES", 1000)
    assert publish_mod.choose_uploader(1001, False, OldClient()) == "upload_large_folder"
    assert publish_mod.choose_uploader(1000, False, OldClient()) == "upload_folder"
    assert (
        publish_mod.choose_uploader(1001, True, OldClient()) == "upload_folder"
    )  # PRs need one commit
    assert publish_mod.choose_uploader(10**12, False, NewClient()) == "upload_folder"


def test_scrub_removes_tokens() -> None:
    text = f"failed with {WRITE_TOKEN} and hf_someOtherToken123456"
    scrubbed = publish_mod._scrub(text, WRITE_TOKEN)
    assert WRITE_TOKEN not in scrubbed and "hf_someOtherToken123456" not in scrubbed


# ------------------------------------------------- `run --push-to-hub` (issue #11: 6 and 7)


def _run_config(tmp_path: Path, tiny_llama_set) -> Path:
    """A regmean merge of absolute local paths, calibration data included (both recorded)."""
    data = tmp_path / "texts.jsonl"
    data.write_text("".join(f'{{"text": "one two three {i}"}}\n' for i in range(8)))
    experts = "".join(f"  - model: {e}\n" for e in tiny_llama_set.experts)
    (tmp_path / "c.yml").write_text(
        f"merge_method: regmean\nbase_model: {tiny_llama_set.base}\nmodels:\n{experts}"
        f"calibration: {{path: {data}, samples: 4, max_length: 8}}\ndtype: float32\n"
    )
    return tmp_path / "c.yml"


def test_run_push_to_hub_uploads_no_local_path(
    hub: FakeHub, tiny_llama_set, tmp_path: Path, monkeypatch
) -> None:
    from mergekit_ext.cli import main

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    config = _run_config(tmp_path, tiny_llama_set)
    out = tmp_path / "merged"
    result = CliRunner().invoke(
        main, ["run", str(config), str(out), "--push-to-hub", "alice/m", "--token", WRITE_TOKEN]
    )
    assert result.exit_code == 0, result.output
    assert_files_arrived(hub, "alice/m", out)
    uploaded = hub.commits("alice/m", "main")[-1].files
    assert {"mergekit_config.yml", "mergekit_ext_diagnostics.json", "README.md"} <= set(uploaded)
    # The models and the data live under pytest's base folder, which names the user.
    local = str(tmp_path.parent).encode()
    assert local in config.read_bytes()
    leaks = [path for path, data in uploaded.items() if local in data]
    assert leaks == []
    diag = json.loads(uploaded["mergekit_ext_diagnostics.json"])
    assert diag["calibration"]["expert0"]["source"] == "texts.jsonl"


def test_every_uploaded_file_is_redacted(
    hub: FakeHub, tiny_bert_classifier_set, tmp_path: Path, monkeypatch
) -> None:
    """Issue #28 item 8: SyMerge --task-layers-only adapters name the merged body by its
    local path, and mergekit_config.yml keeps the YAML's comments: no absolute local path
    is uploaded, and each uploaded adapter names the repository as its base."""
    from mergekit_ext.cli import main

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    models = tiny_bert_classifier_set
    data = tmp_path / "texts.jsonl"
    data.write_text("".join(f'{{"text": "one two three {i}"}}\n' for i in range(8)))
    experts = "".join(f"  - model: {e}\n    name: t{i}\n" for i, e in enumerate(models.experts[:2]))
    config = tmp_path / "sy.yml"
    config.write_text(
        f"# experts fine-tuned from {models.base}, notes in {tmp_path}/notes.txt\n"
        f"merge_method: symerge\nbase_model: {models.base}  # {models.base}/config.json\n"
        f"models:\n{experts}calibration: {{path: {data}, samples: 4, max_length: 8}}\n"
        "parameters: {epochs: 1, seed: 0}\ndtype: float32\n"
    )
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "merged"  # absolute, as the user typed it
    args = ["run", str(config), str(out), "--task-layers-only"]
    result = CliRunner().invoke(main, [*args, "--push-to-hub", "alice/sy", "--token", WRITE_TOKEN])
    assert result.exit_code == 0, result.output
    # Locally the adapters name the body relative to the working directory, so they load.
    for task in ("t0", "t1"):
        local = json.loads((out / "tasks" / task / "adapter_config.json").read_text())
        assert local["base_model_name_or_path"] == "merged"
    uploaded = hub.commits("alice/sy", "main")[-1].files
    adapters = [p for p in uploaded if p.endswith("adapter_config.json")]
    assert sorted(adapters) == ["tasks/t0/adapter_config.json", "tasks/t1/adapter_config.json"]
    for path in adapters:
        assert json.loads(uploaded[path])["base_model_name_or_path"] == "alice/sy"
    assert b"# experts fine-tuned from base, notes in notes.txt" in uploaded["mergekit_config.yml"]
    # The models, the data and the output live under pytest's base folder, which names the
    # user; no uploaded file names it.
    local_root = str(tmp_path.parent).encode()
    leaks = [path for path, data in uploaded.items() if local_root in data]
    assert leaks == []
    # What went is what the run recorded in its manifest as it wrote the folder, plus an
    # uploaded manifest naming the same files.
    recorded = set(merge_record.load_manifest(str(out))["files"])
    assert recorded == {f.path for f in list_upload_files(str(out))}
    assert set(uploaded) == recorded | {MANIFEST}


def test_run_push_to_hub_is_checked_before_merging(
    client_env, tiny_llama_set, tmp_path: Path, monkeypatch
) -> None:
    from mergekit_ext.cli import main

    config = _run_config(tmp_path, tiny_llama_set)
    out = tmp_path / "merged"
    args = ["run", str(config), str(out), "--push-to-hub", "alice/m"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1
    assert "not logged in" in result.output and "nothing was merged" in result.output
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    result = CliRunner().invoke(main, [*args, "--token", WRITE_TOKEN])
    assert result.exit_code == 1 and "HF_HUB_OFFLINE is set" in result.output
    assert not out.exists() and not any(".partial-" in n for n in os.listdir(tmp_path))


def test_run_push_to_hub_failure_keeps_the_merge(
    hub: FakeHub, tiny_llama_set, tmp_path: Path, monkeypatch
) -> None:
    from mergekit_ext.cli import main

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    config = _run_config(tmp_path, tiny_llama_set)
    out = tmp_path / "merged"
    # The token may write (checked before merging); the Hub then fails the commit.
    hub.add_fault(Fault("POST", r"/commit/", status=403, times=None, message="quota exceeded"))
    options = ["--revision", "dev", "--private", "--commit-message", "merge v2"]
    result = CliRunner().invoke(
        main,
        [
            "run",
            str(config),
            str(out),
            "--push-to-hub",
            "alice/m",
            "--token",
            WRITE_TOKEN,
            *options,
        ],
    )
    assert result.exit_code == 1
    assert "403" in result.output
    assert f"the merge succeeded and is kept at {out}" in result.output
    # the retry goes where this push went (#50.5), the token is not repeated
    assert (
        f"mergekit-ext publish {out} --repo-id alice/m --private --revision dev "
        "--commit-message 'merge v2' --token YOUR_TOKEN`"
    ) in result.output
    assert check_complete(str(out)) == []


# ------------------------------------------------------------- issue #32: items 1 to 5


def _single_file_merge(folder: Path, tmp_path: Path) -> Path:
    """The same merge saved as one model.safetensors with other weights (an earlier merge),
    and an image of another method's card."""
    import torch
    from safetensors.torch import load_file, save_file

    old = Path(shutil.copytree(folder, tmp_path / "old"))
    index = json.loads((old / "model.safetensors.index.json").read_text())
    tensors: dict = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(old / shard)))
        (old / shard).unlink()
    (old / "model.safetensors.index.json").unlink()
    save_file(
        {k: torch.full_like(v, 0.5) for k, v in tensors.items()}, str(old / "model.safetensors")
    )
    (old / "images" / "old_method_plot.png").write_bytes(b"\x89PNG\r\n\x1a\n\0old")
    merge_record.write_manifest(str(old))  # as `run` records what it wrote
    return old


def test_republish_removes_stale_weights_and_images(hub: FakeHub, folder: Path, tmp_path) -> None:
    """Item 1: a sharded merge published over an earlier single-file merge leaves no old
    model.safetensors (nor old images) behind, in the same commit; a local snapshot of the
    repository loads the new weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    old = _single_file_merge(folder, tmp_path)
    publish_folder(str(old), "alice/re", token=WRITE_TOKEN, endpoint=hub.url)
    assert "model.safetensors" in hub.commits("alice/re")[-1].files
    # A file the owner added by hand, not a merge's: never deleted.
    hub.repos["alice/re"].branches["main"][-1].files["notes/eval.txt"] = b"mine"

    publish_folder(str(folder), "alice/re", token=WRITE_TOKEN, endpoint=hub.url)
    commits = hub.commits("alice/re")
    assert len(commits) == 3  # initial, old merge, new merge: the deletions are in the last
    hub_files = commits[-1].files
    assert "model.safetensors" not in hub_files
    assert "images/old_method_plot.png" not in hub_files
    assert {"model.safetensors", "images/old_method_plot.png"} <= set(commits[-1].changed)
    assert hub_files["notes/eval.txt"] == b"mine"
    assert set(hub_files) - {"notes/eval.txt"} == {
        f.path for f in list_upload_files(str(folder))
    } | {MANIFEST}

    snapshot = tmp_path / "snapshot"
    for path, data in hub_files.items():
        (snapshot / path).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / path).write_bytes(data)
    model = AutoModelForCausalLM.from_pretrained(str(snapshot))
    expected = {}
    for shard in sorted(folder.glob("model-*.safetensors")):
        expected.update(load_file(str(shard)))
    state = model.state_dict()
    for name, tensor in expected.items():
        assert name in state and state[name].equal(tensor), name
    assert not all(bool((t == 0.5).all()) for t in expected.values())


def test_private_on_an_existing_public_repo(hub: FakeHub, folder: Path) -> None:
    """Item 2: --private never uploads to a public repository without a word: refused
    before anything is sent, or made private first with --make-private."""
    publish_folder(str(folder), "alice/pub", token=WRITE_TOKEN, endpoint=hub.url)
    assert hub.repos["alice/pub"].private is False
    commits = len(hub.commits("alice/pub"))
    with pytest.raises(PublishError, match="already exists and is public") as excinfo:
        publish_folder(str(folder), "alice/pub", token=WRITE_TOKEN, endpoint=hub.url, private=True)
    assert "--make-private" in error_of(excinfo)
    assert len(hub.commits("alice/pub")) == commits and hub.repos["alice/pub"].private is False
    assert not [r for r in hub.requests if r[0] == "PUT" and r[1].endswith("/settings")]

    runner = CliRunner()
    args = [str(folder), "--repo-id", "alice/pub", "--endpoint", hub.url, "--token", WRITE_TOKEN]
    result = runner.invoke(publish_command, [*args, "--private", "--make-private"])
    assert result.exit_code == 0, result.output
    assert hub.repos["alice/pub"].private is True
    settings = [i for i, r in enumerate(hub.requests) if r[1] == "/api/models/alice/pub/settings"]
    upload = [i for i, r in enumerate(hub.requests) if "/alice/pub/preupload/" in r[1]]
    assert settings and settings[0] < upload[-1]  # private before the upload
    help_text = runner.invoke(publish_command, ["--help"]).output
    assert "--make-private" in help_text and "settings API" in help_text
    # A new repository with --private is created private, no settings call needed.
    publish_folder(str(folder), "alice/new-priv", token=WRITE_TOKEN, endpoint=hub.url, private=True)
    assert hub.repos["alice/new-priv"].private is True


@pytest.mark.parametrize(
    "token, fine, needle",
    [
        (READ_TOKEN, None, "read-only"),
        (BOB_TOKEN, None, "the token belongs to 'bob', not to 'alice'"),
        ("hf_NotAValidToken000000", None, "401"),
        ("hf_FineGrainedOther0123456789abcdefg", ("user:alice-other",), "grants no permission"),
    ],
)
def test_run_push_to_hub_checks_the_token_before_merging(
    hub: FakeHub, tiny_llama_set, tmp_path: Path, monkeypatch, token, fine, needle
) -> None:
    """Item 3: a wrong, read-only or foreign token fails before the merge (whoami)."""
    from mergekit_ext.cli import main

    if fine:
        hub.tokens[token] = Token("alice", kind="fineGrained", scopes=fine)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    config = _run_config(tmp_path, tiny_llama_set)
    out = tmp_path / "merged"
    result = CliRunner().invoke(
        main, ["run", str(config), str(out), "--push-to-hub", "alice/m", "--token", token]
    )
    assert result.exit_code == 1, result.output
    assert needle in result.output and "nothing was merged" in result.output
    assert token not in result.output
    assert not out.exists() and not any(".partial-" in n for n in os.listdir(tmp_path))
    assert ("GET", "/api/whoami-v2") in hub.requests


def test_write_access_from_whoami() -> None:
    """Item 3: what whoami's answer says about writing to a namespace."""
    from mergekit_ext.hub.publish import _write_access

    assert _write_access(Token("alice", orgs=("team",)).whoami(), "team/x")[0] is True
    assert _write_access(Token("alice").whoami(), "alice/x")[0] is True
    assert _write_access(Token("alice", write=False).whoami(), "alice/x")[0] is False
    fine = Token("alice", kind="fineGrained", scopes=("org:team",)).whoami()
    assert _write_access(fine, "team/x")[0] is True and _write_access(fine, "alice/x")[0] is False
    read_org = Token("alice", orgs=("team",)).whoami()
    read_org["orgs"][0]["roleInOrg"] = "read"
    assert _write_access(read_org, "team/x")[0] is False
    assert _write_access(Token("alice", whoami_auth=False).whoami(), "alice/x")[0] is None


def test_undeterminable_token_warns_and_publishes(
    hub: FakeHub, tiny_llama_set, tmp_path: Path, monkeypatch, caplog
) -> None:
    """Items 3 and 4: when whoami does not say what the token may do, a warning, not a
    refusal; `run --push-to-hub` prints the URL without -v and takes publish's options."""
    from mergekit_ext.cli import main

    vague = "hf_VagueTokenForTests0123456789abcdef"
    hub.tokens[vague] = Token("alice", whoami_auth=False)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    config = _run_config(tmp_path, tiny_llama_set)
    out = tmp_path / "merged"
    args = ["run", str(config), str(out), "--push-to-hub", "alice/m", "--token", vague]
    args += ["--revision", "dev", "--commit-message", "merge v2"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "could not tell whether the token" in caplog.text
    commit = hub.commits("alice/m", "dev")[-1]
    assert commit.summary == "merge v2" and len(hub.commits("alice/m", "main")) == 1
    # (the progress bars, on stderr in a terminal, share one stream with stdout here)
    # the merge comes first, then where it went (#50.4)
    assert result.output.index("merged model written") < result.output.index("published:")
    repo = re.escape(f"{hub.url}/alice/m")
    assert re.search(
        rf"published: {repo} \(branch dev, commit {repo}/commit/[0-9a-f]+\)\n", result.output
    )
    assert vague not in result.output

    result = CliRunner().invoke(
        main, ["run", str(config), str(tmp_path / "o2"), "--push-to-hub", "alice/m", "--token",
               WRITE_TOKEN, "--create-pr", "--overwrite"]
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert (
        f"published: {hub.url}/alice/m (pull request {hub.url}/alice/m/discussions/1)"
        in result.output
    )


def _hub_option_group() -> dict[str, click.Option]:
    """The options ``publish_options`` declares, by name (from a command made with it alone)."""
    from mergekit_ext.cli_hub import publish_options

    probe = publish_options(click.command("probe")(lambda **kwargs: None))
    return {p.name: p for p in probe.params if isinstance(p, click.Option)}


def _described(option: click.Option) -> tuple:
    """Everything that makes an option mean something: its flags, type, default, help."""
    return (
        tuple(option.opts),
        option.is_flag,
        option.type.to_info_dict(),
        option.default,
        option.help,
    )


def test_publish_options_are_one_group() -> None:
    """#49.4, #50.11: `run` and `publish` share every publishing option, declared once:
    the same flags, types, defaults and help in both commands."""
    from mergekit_ext.cli import main

    group = _hub_option_group()
    assert {"endpoint", "keep_card", "replace_card", "template_dir", "token", "revision"} <= set(
        group
    )
    for command in (main.commands["run"], publish_command):
        options = {p.name: p for p in command.params if isinstance(p, click.Option)}
        assert set(group) <= set(options), command.name
        for name, option in group.items():
            assert _described(options[name]) == _described(option), (command.name, name)
    for flag in (["--revision", "dev"], ["--endpoint", "http://127.0.0.1:9"], ["--keep-card"]):
        result = CliRunner().invoke(main, ["run", "c.yml", "out", *flag])
        assert result.exit_code == 2 and "only apply with --push-to-hub" in result.output, flag


def test_run_push_to_hub_takes_the_card_options(
    hub: FakeHub, tiny_llama_set, tmp_path: Path
) -> None:
    """#50.11: `run --push-to-hub` with --endpoint (no HF_ENDPOINT), --template-dir,
    --replace-card and --keep-card does what `publish` does with them."""
    from mergekit_ext.cli import main

    assert "HF_ENDPOINT" not in os.environ  # --endpoint alone must reach the stand-in
    experts = "".join(f"  - model: {e}\n" for e in tiny_llama_set.experts)
    config = tmp_path / "c.yml"
    config.write_text(f"merge_method: linear\nmodels:\n{experts}parameters: {{weight: 1.0}}\n")
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "causal_lm.md.j2").write_text(
        "---\n{{ card_data }}\n---\n# {{ name }}, from our own template\n"
    )
    out = tmp_path / "merged"
    hub_args = ["--push-to-hub", "alice/opts", "--token", WRITE_TOKEN, "--endpoint", hub.url]
    hub_args += ["--template-dir", str(templates)]

    def run(*extra: str):
        result = CliRunner().invoke(main, ["run", str(config), str(out), "--overwrite",
                                           *hub_args, *extra])  # fmt: skip
        assert result.exit_code == 0, result.output
        return result, hub.commits("alice/opts")[-1].files["README.md"]

    _, card = run()
    assert card.startswith(b"---\n") and b"# opts, from our own template\n" in card
    local = (out / "README.md").read_bytes()
    assert b"from our own template" not in local  # the templates shape the uploaded card only

    edited = card + b"\nMMLU 41.2 (by hand)\n"
    _add_by_hand(hub, "alice/opts", {"README.md": edited})
    config.write_text(config.read_text() + "dtype: float32\n")  # a change to upload
    result, card = run()
    assert card == edited and "README.md on the Hub was edited there" in result.stderr

    _, card = run("--replace-card", "--keep-card")
    assert card == (out / "README.md").read_bytes() and b"MMLU 41.2" not in card
    assert b"from our own template" not in card  # --keep-card: the local card as it is


def test_foreign_card_is_kept(hub: FakeHub, folder: Path) -> None:
    """Item 5: mergekit-yaml's own README is uploaded as it is unless --replace-card."""
    theirs = (
        "---\nbase_model:\n- a/b\nlibrary_name: transformers\ntags:\n- mergekit\n- merge\n"
        "---\n# merged\n\nThis is a merge of pre-trained language models created using "
        "[mergekit](https://github.com/cg123/mergekit).\n"
    )
    (folder / "README.md").write_text(theirs, encoding="utf-8")
    publish_folder(str(folder), "alice/theirs", token=WRITE_TOKEN, endpoint=hub.url)
    assert hub.commits("alice/theirs")[-1].files["README.md"].decode() == theirs

    runner = CliRunner()
    args = [str(folder), "--repo-id", "alice/theirs", "--endpoint", hub.url, "--token", WRITE_TOKEN]
    result = runner.invoke(publish_command, [*args, "--replace-card"])
    assert result.exit_code == 0, result.output
    uploaded = hub.commits("alice/theirs")[-1].files["README.md"].decode()
    assert "mergekit-ext" in uploaded and uploaded != theirs
    assert (folder / "README.md").read_text(encoding="utf-8") == theirs  # local file untouched


# ----------------------------------------------------- issues #49.4, #49.5 and #50: what goes


SECRET = "HF_TOKEN=hf_SecretInDotEnv0123456789abcdefgh\n"


def _clutter(folder: Path) -> None:
    """What lands in an output folder besides the merge: a secret, system clutter, notes,
    links out of the folder (to a file and to a folder), a hidden cache."""
    (folder / ".env").write_text(SECRET)
    (folder / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (folder / "notes.txt").write_text("try a lower temperature\n")
    (folder / "leak.txt").symlink_to("/etc/hostname")
    (folder / "linked").symlink_to("/etc", target_is_directory=True)
    (folder / ".cache" / "huggingface").mkdir(parents=True)
    (folder / ".cache" / "huggingface" / "token").write_text("hf_CachedInFolder0123456789abcd\n")


def test_only_the_merge_files_go(hub: FakeHub, folder: Path) -> None:
    """#49.5: a secret, clutter, notes and links in OUT_DIR are never uploaded; the dry
    run lists each one and why; --include sends what the user names (never a hidden file
    or a link)."""
    merge_files = {f.path for f in list_upload_files(str(folder))}
    _clutter(folder)
    args = [str(folder), "--repo-id", "alice/clean", "--endpoint", hub.url, "--token", WRITE_TOKEN]
    dry = CliRunner().invoke(publish_command, [*args, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "Left out (not uploaded):" in dry.output
    for line in (
        "  .env: a hidden file: never uploaded",
        "  .DS_Store: a hidden file: never uploaded",
        "  .cache/: a hidden folder: never uploaded",
        "  leak.txt: a symbolic link: never followed",
        "  linked/: a symbolic link: links are never followed",
        "  notes.txt: not written by the merge: pass --include to upload it",
    ):
        assert line in dry.output, line
    assert "hf_SecretInDotEnv" not in dry.output

    result = CliRunner().invoke(publish_command, args)
    assert result.exit_code == 0, result.output
    uploaded = hub.commits("alice/clean")[-1].files
    assert set(uploaded) == merge_files | {MANIFEST}
    hostname = Path("/etc/hostname").read_bytes() if Path("/etc/hostname").is_file() else None
    for path, data in uploaded.items():
        assert b"hf_SecretInDotEnv" not in data and b"hf_CachedInFolder" not in data, path
        assert hostname is None or data != hostname, path

    result = CliRunner().invoke(publish_command, [*args, "--include", "notes.txt"])
    assert result.exit_code == 0, result.output
    uploaded = hub.commits("alice/clean")[-1].files
    assert uploaded["notes.txt"] == b"try a lower temperature\n"
    manifest = json.loads(uploaded[MANIFEST])
    assert manifest["included"] == ["notes.txt"] and "notes.txt" not in manifest["files"]
    for pattern in (".env", "leak.txt", "linked/*", "nothing-*"):
        result = CliRunner().invoke(publish_command, [*args, "--include", pattern])
        assert result.exit_code == 1 and "matches no file" in result.output, pattern
    # a file of the merge replaced by a link is refused, not skipped (nor followed)
    (folder / "config.json").rename(folder / "elsewhere.json")
    (folder / "config.json").symlink_to(folder / "elsewhere.json")
    result = CliRunner().invoke(publish_command, args)
    assert result.exit_code == 1 and "config.json is a symbolic link" in result.output


def test_the_manifest_decides_not_the_names(hub: FakeHub, folder: Path) -> None:
    """#49.5: with the manifest `run` writes, a file added afterwards is left out even when
    its name is one a merge writes; without a manifest (an older version's folder) the
    names decide."""
    merge_record.write_manifest(str(folder), written_by="mergekit-ext run")
    recorded = set(merge_record.load_manifest(str(folder))["files"])
    (folder / "vocab.txt").write_text("[PAD]\n")
    selection = publish_mod.select_upload_files(str(folder))
    assert {f.path for f in selection.files} == recorded
    assert ("vocab.txt", "not written by the merge: pass --include to upload it") in (
        selection.left_out
    )
    assert selection.basis.startswith(MANIFEST)
    (folder / MANIFEST).unlink()
    selection = publish_mod.select_upload_files(str(folder))
    assert {f.path for f in selection.files} == recorded | {"vocab.txt"}
    assert selection.basis.startswith(f"no {MANIFEST}")


HAND_ADDED = {
    "my_lora.safetensors": b"\0lora",
    "extra/vision.safetensors": b"\0vision",
    "images/my_photo.png": b"\x89PNG\r\n\x1a\n\0me",
    "pytorch_model.bin": b"\0pickle",
    "adapter_model.bin": b"\0adapter",
    "notes/eval.txt": b"mine",
}


def _add_by_hand(hub: FakeHub, repo_id: str, files: dict, branch: str = "main") -> None:
    """Files the owner uploaded through the website (a commit of their own)."""
    repo = hub.repos[repo_id]
    head = repo.branches[branch][-1]
    repo.branches[branch].append(
        type(head)(
            hashlib.sha1(repr(files).encode()).hexdigest(),
            "by hand",
            {**head.files, **files},
            tuple(files),
        )  # fmt: skip
    )


def test_republish_deletes_only_what_an_earlier_publish_wrote(
    hub: FakeHub, folder: Path, tmp_path: Path
) -> None:
    """#49.4: a re-merge published over a merge plus files added by hand deletes the old
    merge's files it lacks, names each one (dry run and run), and keeps every hand-added file."""
    publish_folder(str(folder), "alice/keep", token=WRITE_TOKEN, endpoint=hub.url)
    _add_by_hand(hub, "alice/keep", HAND_ADDED)
    before = set(hub.commits("alice/keep")[-1].files)
    remerge = _single_file_merge(folder, tmp_path)  # one model.safetensors, no shards
    gone = sorted(p for p in before if p.startswith("model-") or p == SAFETENSORS_INDEX)
    assert len(gone) >= 3

    args = [str(remerge), "--repo-id", "alice/keep", "--endpoint", hub.url, "--token", WRITE_TOKEN]
    dry = CliRunner().invoke(publish_command, [*args, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    listed = dry.output.split("Deleted on the Hub (in the same commit):\n")[1].split("\n\n")[0]
    assert listed.splitlines()[1:] == [f"  {p}" for p in gone]
    assert f"known from the {MANIFEST} an earlier publish uploaded" in listed

    result = CliRunner().invoke(publish_command, args)
    assert result.exit_code == 0, result.output
    for path in gone:
        assert f"publishing: deleting {path} (an earlier publish wrote it" in result.stderr
    assert f"deleted {len(gone)} file(s) an earlier publish wrote" in result.stdout
    after = hub.commits("alice/keep")[-1].files
    assert not set(gone) & set(after)
    for path, data in HAND_ADDED.items():
        assert after[path] == data, path
    assert len(hub.commits("alice/keep")) == 4  # the deletions are in the publish's commit


SAFETENSORS_INDEX = "model.safetensors.index.json"


def test_republish_over_an_older_publish_without_manifest(hub: FakeHub, folder: Path) -> None:
    """#49.4: a repository an older version published (its diagnostics, no manifest):
    only files with the names a merge writes are deleted; hand-added ones stay."""
    publish_folder(str(folder), "alice/old", token=WRITE_TOKEN, endpoint=hub.url)
    repo = hub.repos["alice/old"]
    head = repo.branches["main"][-1]
    del head.files[MANIFEST]  # as an older version left it
    head.files["model.safetensors"] = b"\0stale single file"
    head.files["chat_template.jinja"] = b"{{ old }}"
    _add_by_hand(hub, "alice/old", HAND_ADDED)
    result = publish_folder(str(folder), "alice/old", token=WRITE_TOKEN, endpoint=hub.url)
    assert sorted(result.deleted) == ["chat_template.jinja", "model.safetensors"]
    after = hub.commits("alice/old")[-1].files
    assert "model.safetensors" not in after and "chat_template.jinja" not in after
    assert all(after[p] == d for p, d in HAND_ADDED.items())


def _with_task_adapters(folder: Path, tmp_path: Path) -> Path:
    """A SyMerge output: the body plus tasks/NAME/ adapters (config and weights)."""
    import torch
    from safetensors.torch import save_file

    sy = Path(shutil.copytree(folder, tmp_path / "sy"))
    for task in ("t0", "t1"):
        (sy / "tasks" / task).mkdir(parents=True)
        (sy / "tasks" / task / "adapter_config.json").write_text('{"peft_type": "LORA"}\n')
        save_file({"w": torch.zeros(2)}, str(sy / "tasks" / task / "adapter_model.safetensors"))
    merge_record.write_manifest(str(sy))
    return sy


def test_republish_removes_whole_task_folders(hub: FakeHub, folder: Path, tmp_path) -> None:
    """#49.4: a `ties` merge published over a SyMerge one removes each task folder whole
    (config and weights), not the weights alone."""
    publish_folder(str(_with_task_adapters(folder, tmp_path)), "alice/sy", token=WRITE_TOKEN,
                   endpoint=hub.url)  # fmt: skip
    assert "tasks/t0/adapter_config.json" in hub.commits("alice/sy")[-1].files
    merge_record.write_manifest(str(folder))
    publish_folder(str(folder), "alice/sy", token=WRITE_TOKEN, endpoint=hub.url)
    assert not [p for p in hub.commits("alice/sy")[-1].files if p.startswith("tasks/")]


def test_stale_tokenizer_files_are_removed(hub: FakeHub, folder: Path) -> None:
    """#50.1: the chat template of an earlier merge goes when the re-merge has none; a
    file of the same kind added by hand stays."""
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m }}{% endfor %}")
    merge_record.write_manifest(str(folder))
    publish_folder(str(folder), "alice/chat", token=WRITE_TOKEN, endpoint=hub.url)
    assert "chat_template.jinja" in hub.commits("alice/chat")[-1].files
    _add_by_hand(hub, "alice/chat", {"chat_template_tool_use.jinja": b"{{ tools }}"})
    (folder / "chat_template.jinja").unlink()
    merge_record.write_manifest(str(folder))
    result = publish_folder(str(folder), "alice/chat", token=WRITE_TOKEN, endpoint=hub.url)
    assert result.deleted == ("chat_template.jinja",)
    after = hub.commits("alice/chat")[-1].files
    assert "chat_template.jinja" not in after and "chat_template_tool_use.jinja" in after


def test_card_edited_on_the_hub_is_kept(hub: FakeHub, folder: Path) -> None:
    """#50.3: a README edited on the Hub is not replaced without a word: the rest goes,
    the card stays and the output says so; --replace-card replaces it."""
    publish_folder(str(folder), "alice/card", token=WRITE_TOKEN, endpoint=hub.url)
    edited = (
        hub.commits("alice/card")[-1]
        .files["README.md"]
        .replace(b"---\n", b"---\nlicense: apache-2.0\n", 1)
        + b"\n## Evaluation\n\nMMLU 41.2 (by hand)\n"
    )
    _add_by_hand(hub, "alice/card", {"README.md": edited})
    (folder / "mergekit_config.yml").write_text(
        "# v2\n" + (folder / "mergekit_config.yml").read_text()
    )
    args = [str(folder), "--repo-id", "alice/card", "--endpoint", hub.url, "--token", WRITE_TOKEN]
    dry = CliRunner().invoke(publish_command, [*args, "--dry-run"])
    assert "Card: README.md on the Hub was edited there" in dry.output
    result = CliRunner().invoke(publish_command, args)
    assert result.exit_code == 0, result.output
    assert "README.md on the Hub was edited there" in result.stderr
    after = hub.commits("alice/card")[-1].files
    assert after["README.md"] == edited
    assert after["mergekit_config.yml"].startswith(b"# v2\n")
    # still edited next time (the manifest does not take the kept card for ours)
    result = CliRunner().invoke(publish_command, [*args, "--dry-run"])
    assert "Card: README.md on the Hub was edited there" in result.output

    result = CliRunner().invoke(publish_command, [*args, "--replace-card"])
    assert result.exit_code == 0, result.output
    replaced = hub.commits("alice/card")[-1].files["README.md"]
    assert b"MMLU 41.2" not in replaced and replaced == render_card_for_repo(
        str(folder), "alice/card"
    ).encode("utf-8")


@pytest.mark.parametrize(
    "options, branch",
    [([], "main"), (["--revision", "dev"], "dev"), (["--create-pr"], "main"),
     (["--private", "--make-private"], "main")],
)  # fmt: skip
def test_nothing_changed_is_said(hub: FakeHub, folder: Path, options, branch) -> None:
    """#50.4: publishing what the repository already holds makes no commit (nor pull
    request) and says so, once; `published:` names the repository and the commit."""
    args = [str(folder), "--repo-id", "alice/same", "--endpoint", hub.url, "--token", WRITE_TOKEN]
    first = [o for o in options if o != "--create-pr" and o not in ("--private", "--make-private")]
    result = CliRunner().invoke(publish_command, [*args, *first])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"published: {hub.url}/alice/same (branch {branch}, commit ")
    commits = len(hub.commits("alice/same", branch))

    result = CliRunner().invoke(publish_command, [*args, *options])
    assert result.exit_code == 0, result.output
    head = hub.commits("alice/same", branch)[-1].oid
    assert result.stdout.startswith(
        f"nothing to publish: {hub.url}/alice/same (branch {branch}) already holds these "
        f"files, at {hub.url}/alice/same/commit/{head}; no commit was made"
    ), result.stdout
    assert "published:" not in result.output
    assert "No files have been modified" not in result.output
    assert len(hub.commits("alice/same", branch)) == commits
    if "--create-pr" in options:
        assert "no pull request opened" in result.stdout
        assert hub.repos["alice/same"].pull_requests == []
    if "--make-private" in options:
        assert "the repository was made private" in result.stdout
        assert hub.repos["alice/same"].private is True


def test_retry_command_repeats_every_option() -> None:
    """#50.5: the `publish` command suggested after a failed push goes where the push went."""
    from mergekit_ext.hub.actions import HubActions
    from mergekit_ext.runner import RunOptions

    run = RunOptions(push_to_hub="alice/m", hub_private=True, hub_revision="dev",
                     hub_commit_message="merge v2, it's better", hub_token=WRITE_TOKEN,
                     hub_timeout=5.0, hub_make_private=True)  # fmt: skip
    command = HubActions().publish_command("out dir", run)
    assert command == (
        "mergekit-ext publish 'out dir' --repo-id alice/m --private --make-private --revision "
        "dev --commit-message 'merge v2, it'\"'\"'s better' --hub-timeout 5 --token YOUR_TOKEN"
    )
    pr = HubActions().publish_command("out", RunOptions(push_to_hub="a/b", hub_create_pr=True))
    assert pr == "mergekit-ext publish out --repo-id a/b --create-pr"
    card = RunOptions(push_to_hub="a/b", hub_endpoint="http://127.0.0.1:9", hub_keep_card=True,
                      hub_replace_card=True, hub_template_dir="my cards")  # fmt: skip
    assert HubActions().publish_command("out", card) == (
        "mergekit-ext publish out --repo-id a/b --endpoint http://127.0.0.1:9 --keep-card "
        "--replace-card --template-dir 'my cards'"
    )


def test_token_origin_is_told(hub: FakeHub, tiny_llama_set, tmp_path: Path, monkeypatch) -> None:
    """#50.6: a token from HF_TOKEN is called that (not --token)."""
    from mergekit_ext.cli import main

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", READ_TOKEN)
    config = _run_config(tmp_path, tiny_llama_set)
    result = CliRunner().invoke(main, ["run", str(config), str(tmp_path / "o"),
                                       "--push-to-hub", "alice/m"])  # fmt: skip
    assert result.exit_code == 1
    assert "the token from HF_TOKEN cannot write to alice/m" in result.output
    assert "--token" not in result.output.split("cannot write")[0]


def test_sizes_use_one_formatter(hub: FakeHub, folder: Path) -> None:
    """#50.12: `publish` counts bytes in 1000s, like the run's summary."""
    from mergekit_ext.resources import format_bytes

    (folder / "notes.txt").write_bytes(b"x" * 1_500_000)
    args = [str(folder), "--repo-id", "alice/s", "--dry-run", "--include", "notes.txt"]
    result = CliRunner().invoke(publish_command, [*args, "--endpoint", hub.url])
    assert re.search(r"^\s+1,500,000\s+1\.50 MB  notes\.txt  \(--include\)$", result.output, re.M)
    assert format_bytes(1_500_000) == "1.50 MB"


def test_publish_carries_the_saved_evaluation(hub: FakeHub, folder: Path) -> None:
    """Issue #52 item 3: results saved by ``card --eval`` (here a results file as lm-eval
    0.4.13's own tracker writes it) are on the uploaded card, its model-index named for the
    repo, and their file goes with it (local paths redacted); a later ``card`` without ``--eval`` keeps them."""
    raw = (Path(__file__).parent / "data" / "lm_eval_0.4.13_results.json").read_text("utf-8")
    write_model_card(str(folder), eval_results=json.loads(raw))
    saved = folder / merge_record.EVAL_FILENAME
    assert saved.is_file()

    publish_folder(str(folder), "alice/evaluated", token=WRITE_TOKEN, endpoint=hub.url)
    files = hub.commits("alice/evaluated")[-1].files
    uploaded = files["README.md"].decode("utf-8")
    (index,) = huggingface_hub.ModelCard(uploaded).data.to_dict()["model-index"]
    assert index["name"] == "evaluated"
    (entry,) = index["results"]
    assert entry["task"]["name"] == "tiny_mc" and entry["metrics"][0]["value"] == 0.2
    assert entry["source"]["name"] == "lm-evaluation-harness 0.4.13"
    assert "| tiny_mc" in uploaded  # the table, not only the metadata
    # lm-eval's own file names the model and data by local path: redacted on the way up
    assert b"/tmp/evalh_try" in saved.read_bytes()
    sent = json.loads(files[merge_record.EVAL_FILENAME])
    assert "/tmp/evalh_try" not in json.dumps(sent)
    assert sent["results"] == json.loads(raw)["results"]

    write_model_card(str(folder))  # no --eval: the saved results stay on the card
    assert "| tiny_mc" in (folder / "README.md").read_text("utf-8")
