"""Every path a command writes is guarded (issue #28: 1, 3, 4, 9, 16), with real folders.

The user's working folder, models and helpers come from ``test_safety``: models under
``m/``, calibration data, notes, plugins and an ACE config in a temporary folder.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import stat
import subprocess
import sys

import pytest
import test_safety
import yaml
from safetensors.torch import load_file
from test_safety import _env, _invoke, _leftovers, _snapshot

from mergekit_ext import output

# the user's working folder of test_safety (conftest's user_work, plus data, notes, plugins,
# ace.yml)
work = test_safety.work


def _merged(work, name: str = "out") -> None:
    result = _invoke(["run", "ace.yml", name], cwd=None)
    assert result.exit_code == 0, result.output


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# --------------------------------------------- 1. every written path, the same rule


def test_diagnose_outputs_may_not_touch_any_input(work, monkeypatch):
    """``--json``/``--plots`` inside an expert folder or the merged folder are refused."""
    monkeypatch.chdir(work)
    _merged(work)
    before = _snapshot(work)
    cases = [
        (["--json", "m/expert_a/config.json"], "--json to m/expert_a/config.json", "m/expert_a"),
        (["--json", "m/base/new.json"], "lies inside the input m/base", "m/base"),
        (["--json", "out/mergekit_ext_diagnostics.json"], "lies inside the input out", "out"),
        (["--plots", "m/expert_b"], "--plots to m/expert_b: it is the input m/expert_b", ""),
        (["--plots", "out/images"], "--plots to out/images: it lies inside the input out", ""),
        (["--json", "data/texts.jsonl"], "it is the input data/texts.jsonl", ""),
    ]
    for extra, expected, _ in cases:
        result = _invoke(["diagnose", "out", "ace.yml", *extra])
        assert result.exit_code == 1, (extra, result.output)
        assert "refusing to write" in result.output and expected in result.output, result.output
        assert "card MERGED_DIR --diagnose" in result.output
    assert _snapshot(work) == before


def test_card_may_not_write_into_an_input_of_its_diagnosis(work, monkeypatch):
    """``card OUT --diagnose CFG`` where OUT is a model CFG reads: refused, OUT untouched."""
    monkeypatch.chdir(work)
    _merged(work)
    config = yaml.safe_load((work / "ace.yml").read_text())
    config["models"][0]["model"] = "out"
    (work / "reads_out.yml").write_text(yaml.safe_dump(config))
    before = _snapshot(work)
    result = _invoke(["card", "out", "--diagnose", "reads_out.yml"])
    assert result.exit_code == 1, result.output
    assert "refusing to write the model card to out: it is the input out" in result.output
    assert _snapshot(work) == before


def test_publish_staging_is_never_inside_the_folder(work, monkeypatch, tmp_path):
    """A TMPDIR inside OUT_DIR would put the staging folder into the upload itself."""
    from mergekit_ext.errors import PublishError
    from mergekit_ext.hub.publish import staged_folder

    monkeypatch.chdir(work)
    _merged(work)
    monkeypatch.setattr("tempfile.tempdir", str(work / "out" / "images"))
    before = _snapshot(work)
    with pytest.raises(PublishError, match="lies inside the input"):
        with staged_folder(str(work / "out"), "---\nlicense: mit\n---\n"):
            pass
    assert _snapshot(work) == before


# ------------------------------------------------------------ 3. tokenizer_source


def test_tokenizer_source_is_an_input(work, monkeypatch):
    """``run CFG OUT --overwrite`` where OUT is the tokenizer source is refused."""
    monkeypatch.chdir(work)
    _merged(work, "earlier")  # a mergekit-ext output: --overwrite could replace it
    (work / "earlier" / "my_notes.txt").write_text("keep\n")
    # A token's source counts too (issue #49.2: a bare ``source: M`` was missed and
    # ``--overwrite`` replaced the folder, the user's file in it included).
    token = {"tokenizer": {"source": "base", "tokens": {"the": {"source": "earlier"}}}}
    picked = {"the": {"source": {"kind": "model_token", "model": "earlier", "token": "the"}}}
    for tokenizer in (
        {"tokenizer_source": "earlier"},
        {"tokenizer": {"source": "earlier"}},
        token,
        {"tokenizer": {"source": "base", "tokens": picked}},
    ):
        config = yaml.safe_load((work / "ace.yml").read_text())
        config.update(tokenizer)
        (work / "tok.yml").write_text(yaml.safe_dump(config))
        before = _snapshot(work)
        result = _invoke(["run", "tok.yml", "earlier", "--overwrite"])
        assert result.exit_code == 1, result.output
        assert "it is the input earlier" in result.output
        assert "tokenizer source" in result.output
        assert _snapshot(work) == before
        result = _invoke(["run", "tok.yml", "earlier/sub"])
        assert result.exit_code == 1 and "lies inside the input earlier" in result.output


# -------------------------------------------- 4. an existing empty folder, a mount point


def test_existing_empty_folder_is_written_in_place(work, monkeypatch):
    monkeypatch.chdir(work)
    (work / "vol").mkdir()
    os.chmod(work / "vol", 0o770)
    inode = os.stat(work / "vol").st_ino
    result = _invoke(["run", "ace.yml", "vol"])  # no --overwrite needed: nothing to replace
    assert result.exit_code == 0, result.output
    assert os.stat(work / "vol").st_ino == inode  # the same folder, not a renamed one
    assert stat.S_IMODE(os.stat(work / "vol").st_mode) == 0o770  # its mode is the user's
    assert load_file(str(work / "vol" / "model.safetensors"))
    assert not [n for n in os.listdir(work / "vol") if ".partial-" in n]
    assert _leftovers(work) == []


@pytest.mark.parametrize("errnum", [errno.EBUSY, errno.EXDEV], ids=["EBUSY", "EXDEV"])
def test_failed_final_rename_leaves_no_hidden_merge(work, monkeypatch, errnum):
    """A rename the system refuses (EBUSY: a mount point; EXDEV) discards the temporary
    folder, restores the earlier output and says what to do."""
    monkeypatch.chdir(work)
    _merged(work)
    before = _snapshot(work / "out")
    rename = os.rename

    def refusing(src, dst, *args, **kwargs):
        if ".partial-" in os.path.basename(str(src)) and str(dst).endswith(os.sep + "out"):
            raise OSError(errnum, os.strerror(errnum))
        return rename(src, dst, *args, **kwargs)

    monkeypatch.setattr(output.os, "rename", refusing)
    result = _invoke(["run", "ace.yml", "out", "--overwrite"])
    assert result.exit_code == 1, result.output
    assert "could not be renamed to out" in result.output
    assert "out/merged" in result.output and "merge was discarded" in result.output
    assert _snapshot(work / "out") == before
    assert _leftovers(work) == [] and not (work / ".out.lock").exists()


def _unshare_works() -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount --make-rprivate / && mount -t tmpfs none /mnt"],
        capture_output=True,
    )
    return probe.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _unshare_works(), reason="needs root and mount namespaces (unshare -m)")
def test_mount_point_out_dir(work):
    """A bind mount as OUT_DIR, as ``docker run -v host:/out``: the first merge is written in
    place, a second one with --overwrite is refused before merging, with the workaround."""
    (work / "host").mkdir()
    (work / "out").mkdir()
    script = (
        "mount --make-rprivate / && mount --bind host out && "
        f"{sys.executable} -m mergekit_ext run ace.yml out; echo first=$?; "
        f"{sys.executable} -m mergekit_ext run ace.yml out --overwrite; echo second=$?"
    )
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script],
        cwd=work,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    text = proc.stdout + proc.stderr
    assert "first=0" in text and "second=1" in text, text
    assert "is a mount point holding an earlier merge" in text and "out/merged" in text
    assert "mergekit_ext_diagnostics.json" in os.listdir(work / "host")  # the merge, in place
    assert load_file(str(work / "host" / "model.safetensors"))
    assert not [n for n in os.listdir(work / "host") if n.startswith(".")]
    assert _leftovers(work) == []


# --------------------------------------------------------------- 9. the umask


@pytest.mark.parametrize(
    "umask, folder_mode, file_mode",
    [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)],
    ids=["022", "077"],
)
def test_every_file_follows_the_umask(work, monkeypatch, umask, folder_mode, file_mode):
    monkeypatch.chdir(work)
    old = os.umask(umask)
    try:
        result = _invoke(["run", "ace.yml", "out"])
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    modes = {}
    for folder, _, files in os.walk(work / "out"):
        modes[folder] = stat.S_IMODE(os.stat(folder).st_mode)
        for name in files:
            modes[os.path.join(folder, name)] = stat.S_IMODE(
                os.stat(os.path.join(folder, name)).st_mode
            )
    assert str(work / "out" / "model.safetensors") in modes
    wrong = {
        p: oct(m) for p, m in modes.items() if m != (folder_mode if os.path.isdir(p) else file_mode)
    }
    assert wrong == {}


# ------------------------------------------------- 16. long paths and leftovers


def test_longest_legal_out_name_works(work, monkeypatch):
    monkeypatch.chdir(work)
    name = "m" * 240
    result = _invoke(["run", "ace.yml", name])
    assert result.exit_code == 0, result.output
    assert load_file(str(work / name / "model.safetensors"))
    assert _leftovers(work) == [] and not [n for n in os.listdir(work) if n.endswith(".lock")]
    stem = output.leftover_stem(name)
    assert len(f".{stem}.partial-4194304-abcdefgh") <= 255
    assert output.leftover_stem("m" * 241) != stem  # two long names never share a lock


def test_too_long_path_fails_before_creating_anything(work, monkeypatch):
    monkeypatch.chdir(work)
    before = _snapshot(work)
    deep = os.path.join(*(["d" * 240] * 20), "out")
    result = _invoke(["run", "ace.yml", deep])
    assert result.exit_code == 1, result.output
    assert "file system's limit of 4096 bytes per path" in result.output
    result = _invoke(["run", "ace.yml", "n" * 256])
    assert result.exit_code == 1 and "more than the 255" in result.output
    assert _snapshot(work) == before


def test_leftovers_are_never_followed_nor_deleted_silently(work, monkeypatch, caplog):
    """A symlinked partial is not followed nor reported as removed; an ``.old-`` folder is
    named at every run and never deleted."""
    monkeypatch.chdir(work)
    _merged(work)
    pid = _dead_pid()
    (work / "elsewhere").mkdir()
    (work / "elsewhere" / "precious.txt").write_text("mine\n")
    os.symlink("elsewhere", work / f".out.partial-{pid}-abcdefgh")
    (work / f".out.old-{pid}-abcdefgh").mkdir()
    (work / f".out.old-{pid}-abcdefgh" / "model.safetensors").write_text("previous\n")
    (work / f".out.partial-{pid}-real0000").mkdir()
    caplog.set_level(logging.WARNING, logger="mergekit_ext.output")
    for _ in range(2):
        caplog.clear()
        result = _invoke(["run", "ace.yml", "out", "--overwrite"])
        assert result.exit_code == 0, result.output
        text = caplog.text
        assert f"removed {work}/.out.partial-{pid}-abcdefgh" not in text
        assert "a symbolic link; mergekit-ext never follows nor removes it" in text
        assert f".out.old-{pid}-abcdefgh holds a previous out" in text
        assert "never removed automatically" in text
    assert os.path.islink(work / f".out.partial-{pid}-abcdefgh")
    assert (work / "elsewhere" / "precious.txt").read_text() == "mine\n"
    assert (work / f".out.old-{pid}-abcdefgh" / "model.safetensors").exists()
    assert not (work / f".out.partial-{pid}-real0000").exists()  # a real leftover: removed


# ---------------------------------------------------- 2. a README.md edited by hand


def test_card_never_replaces_a_hand_edited_readme(work, monkeypatch):
    from mergekit_ext.hub.card import card_is_unedited
    from mergekit_ext.hub.publish import card_to_upload, list_upload_files

    monkeypatch.chdir(work)
    _merged(work)
    readme = work / "out" / "README.md"
    assert card_is_unedited(str(readme))
    result = _invoke(["card", "out"])  # our own, unedited card: rebuilt
    assert result.exit_code == 0, result.output

    edited = readme.read_text(encoding="utf-8").replace("# out", "# My model, described by me")
    readme.write_text(edited, encoding="utf-8")
    before = _snapshot(work)
    result = _invoke(["card", "out"])
    assert result.exit_code == 1, result.output
    assert "README.md was edited by hand" in result.output and "--force" in result.output
    assert "--keep-card" in result.output
    assert _snapshot(work) == before

    result = _invoke(["card", "out", "--force"])
    assert result.exit_code == 0, result.output
    assert f"kept as {os.path.join('out', 'README.md.bak')}" in result.output
    assert (work / "out" / "README.md.bak").read_text(encoding="utf-8") == edited
    assert card_is_unedited(str(readme)) and "described by me" not in readme.read_text()
    assert "README.md.bak" not in {f.path for f in list_upload_files(str(work / "out"))}

    # A card another tool wrote (no signature) is protected the same way; publish
    # --keep-card uploads it as it is.
    readme.write_text("---\nlicense: mit\n---\n# Written elsewhere\n", encoding="utf-8")
    result = _invoke(["card", "out"])
    assert result.exit_code == 1 and "not written by mergekit-ext" in result.output
    kept = card_to_upload(str(work / "out"), "alice/m", keep_card=True)
    assert kept == "---\nlicense: mit\n---\n# Written elsewhere\n"
    assert _invoke(["card", "out", "--force"]).exit_code == 0
    assert (work / "out" / "README.md.bak2").read_text().endswith("# Written elsewhere\n")


# ------------------- issue #49.1, .3: files are written new; caches follow the same rule


def test_no_file_is_written_through_a_link(work, monkeypatch, tmp_path):
    """``diagnose --json`` onto a hard link of an expert's config.json, ``card --force`` with
    a README.md that links to an input or outside OUT: refused naming the file, the linked
    file unchanged (they used to be overwritten through the link)."""
    monkeypatch.chdir(work)
    _merged(work)
    os.link(work / "m" / "expert_a" / "config.json", work / "hard.json")
    outside = tmp_path / "outside.txt"
    outside.write_text("mine\n")
    before = _snapshot(work / "m"), outside.read_text()
    result = _invoke(["diagnose", "out", "ace.yml", "--json", "hard.json"])
    assert result.exit_code == 1, result.output
    assert "refusing to write hard.json: it has 2 hard links" in result.output
    readme = work / "out" / "README.md"
    readme.unlink()
    for target in ("../m/expert_a/config.json", str(outside), "missing.md"):
        readme.symlink_to(target)
        result = _invoke(["card", "out", "--force"])
        assert result.exit_code == 1, result.output
        assert f"refusing to write out/README.md: it is a symbolic link (to {target})" in (
            result.output
        )
        readme.unlink()
    readme.mkdir()  # a folder where the card goes: named as such, not "edited by hand"
    result = _invoke(["card", "out", "--force"])
    assert result.exit_code == 1 and "out/README.md: it is a folder" in result.output
    assert "edited by hand" not in result.output
    readme.rmdir()
    (work / "hard.json").unlink()
    assert (_snapshot(work / "m"), outside.read_text()) == before
    # accepted: an existing plain file is replaced by a new file (another inode)
    (work / "d.json").write_text("old\n")
    inode = os.stat(work / "d.json").st_ino
    result = _invoke(["diagnose", "out", "ace.yml", "--json", "d.json"])
    assert result.exit_code == 0, result.output
    assert '"merged": "out"' in (work / "d.json").read_text()
    assert os.stat(work / "d.json").st_ino != inode
    result = _invoke(["card", "out"])
    assert result.exit_code == 0 and readme.is_file() and not readme.is_symlink()
    assert not [n for n in os.listdir(work / "out") if n.endswith(".tmp")]


def test_write_file_replaces_and_never_follows(tmp_path):
    path = tmp_path / "f.txt"
    output.write_file(str(path), "one\n")
    os.chmod(path, 0o600)
    output.write_file(str(path), b"two\n")
    assert path.read_text() == "two\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~output.current_umask()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep\n")
    link = tmp_path / "link.txt"
    link.symlink_to(victim)
    with pytest.raises(output.OutputError, match="link.txt: it is a symbolic link"):
        output.write_file(str(link), "x")
    os.link(victim, tmp_path / "second.txt")
    with pytest.raises(output.OutputError, match="second.txt: it has 2 hard links"):
        output.write_file(str(tmp_path / "second.txt"), "x")
    assert victim.read_text() == "keep\n"
    assert sorted(os.listdir(tmp_path)) == ["f.txt", "link.txt", "second.txt", "victim.txt"]


def test_lora_merge_cache_may_not_lie_inside_an_input(work, monkeypatch):
    """``--lora-merge-cache`` inside an expert wrote a full merged model into it."""
    monkeypatch.chdir(work)
    before = _snapshot(work)
    for cache in ("m/expert_a/cache", "m/base", "data"):
        result = _invoke(["run", "ace.yml", "out", "--lora-merge-cache", cache])
        assert result.exit_code == 1, result.output
        assert f"refusing to write --lora-merge-cache to {cache}" in result.output
    result = _invoke(["run", "ace.yml", "out", "--transformers-cache", "m/expert_b/hf"])
    assert result.exit_code == 1 and "--transformers-cache to m/expert_b/hf" in result.output
    assert _snapshot(work) == before
    result = _invoke(["run", "ace.yml", "out", "--lora-merge-cache", "cache"])
    assert result.exit_code == 0, result.output


# ------------------------------------ issue #49.7, .8: a signal after the rename; the lock

SIGNAL_AFTER = """
import os
import signal

import {module} as target

_original = target.{name}


def _then_sigterm(*args, **kwargs):
    result = _original(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)
    return result


target.{name} = _then_sigterm
"""


@pytest.mark.parametrize(
    "module, name",
    [("mergekit_ext.output", "_rename_into"), ("mergekit_ext.resources", "summary_line")],
)
def test_sigterm_after_the_final_rename_says_the_output_is_whole(work, monkeypatch, module, name):
    """``--overwrite`` killed by SIGTERM just after the final rename (or while the closing
    lines print) exited 143 with no message: now it says the output is written."""
    monkeypatch.chdir(work)
    _merged(work)
    (work / "plugins" / "late.py").write_text(SIGNAL_AFTER.format(module=module, name=name))
    code, text = test_safety._finish(
        test_safety._cli(
            "run",
            "ace.yml",
            "out",
            "--overwrite",
            "--plugin",
            "plugins/late.py",
            cwd=work,
            env=_env(),
        )
    )
    assert code == 143, text
    assert f"terminated (SIGTERM) after the merge was complete: {work / 'out'} is written" in text
    assert "no output was written" not in text
    assert load_file(str(work / "out" / "model.safetensors"))
    assert (work / "out" / output.MARKER_FILE).is_file()
    assert _leftovers(work) == [] and not (work / ".out.lock").exists()


def test_a_lock_that_is_not_a_plain_file_is_refused_and_kept(work, monkeypatch):
    """A ``.OUT.lock`` symbolic link (to a user file, or dangling) or folder: refused naming
    it, nothing touched (the link was deleted by the failed run, ELOOP/EISDIR shown)."""
    monkeypatch.chdir(work)
    lock = work / ".out.lock"
    for make, kind in (
        (lambda: lock.symlink_to("notes/todo.txt"), "a symbolic link (to notes/todo.txt)"),
        (lambda: lock.symlink_to("nowhere"), "a symbolic link (to nowhere)"),
        (lambda: lock.mkdir(), "a folder"),
    ):
        make()
        before = sorted(os.listdir(work)), (work / "notes" / "todo.txt").read_text()
        result = _invoke(["run", "ace.yml", "out"])
        assert result.exit_code == 1, result.output
        assert f"the lock file {lock} is {kind}" in result.output
        assert (sorted(os.listdir(work)), (work / "notes" / "todo.txt").read_text()) == before
        assert os.path.lexists(lock)
        lock.rmdir() if lock.is_dir() and not lock.is_symlink() else lock.unlink()
    _merged(work)  # a plain stale lock file left by a killed merge is fine
    lock.write_text("12345\n")
    result = _invoke(["run", "ace.yml", "out2"])
    assert result.exit_code == 0, result.output


@pytest.mark.skipif(not _unshare_works(), reason="needs root and mount namespaces (unshare -m)")
def test_read_only_out_parent_is_named(work):
    """A read-only folder holding OUT_DIR gave the raw errno on the internal lock name."""
    (work / "ro").mkdir()
    script = (
        "mount --make-rprivate / && mount --bind ro ro && mount -o remount,ro,bind ro && "
        f"{sys.executable} -m mergekit_ext run ace.yml ro/out"
    )
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script],
        cwd=work,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "cannot write beside ro/out (Read-only file system)" in proc.stderr
    assert f"({work / 'ro'}) must be writable" in proc.stderr
    assert ".lock" not in proc.stderr
