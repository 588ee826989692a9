"""A loopback stand-in for the few Hugging Face Hub routes that ``create_repo`` and
``upload_folder`` use, so that the real ``huggingface_hub`` client can be tested end to end on
machines that cannot reach the Hub.

Routes (as called by huggingface_hub 2.x, see ``hf_api.py``, ``_commit_api.py``, ``lfs.py``):

- ``POST /api/repos/create``                          create a repo (409 if it exists)
- ``GET  /api/models/{ns}/{name}[/revision/{rev}]``   repo info (``create_repo`` on 403)
- ``POST /api/validate-yaml``                         README front matter check
- ``POST /api/models/{ns}/{name}/preupload/{rev}``    upload mode per file (regular / lfs)
- ``POST /{ns}/{name}.git/info/lfs/objects/batch``    LFS batch API ("basic" transfer)
- ``PUT  /lfs-objects/{oid}``                         LFS object upload (sha256 checked)
- ``POST /{ns}/{name}.git/info/lfs/objects/verify``   LFS verify
- ``POST /api/models/{ns}/{name}/commit/{rev}``       NDJSON commit (base64 files + LFS refs)
- ``POST /api/models/{ns}/{name}/branch/{branch}``    create a branch
- ``GET  /api/models/{ns}/{name}/tree/{rev}``         list the files (``delete_patterns``)
- ``GET  /api/whoami-v2``                             the token's user, orgs and role
- ``PUT  /api/models/{ns}/{name}/settings``           change the visibility
- ``GET  /{ns}/{name}/resolve/{rev}/{path}``          a file's content (a branch or commit)

Files whose sample contains a NUL byte (binary: safetensors, PNG) or that are larger than
10 MB go through LFS, the others are sent base64-encoded inside the commit, like the Hub.
The client's Xet path is not emulated: tests set ``HF_HUB_DISABLE_XET`` (the legacy LFS
protocol is what the client falls back to without ``hf_xet``).

Faults can be injected per route: an HTTP status, or a dropped connection (the server reads
part of the request body and closes the socket without answering).

The server is bounded: it binds 127.0.0.1 on a free port, refuses bodies above
``MAX_BODY_BYTES``, times out idle connections, and is stopped by :meth:`FakeHub.stop`
(or the context manager).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional
from urllib.parse import parse_qs, unquote, urlsplit

MAX_BODY_BYTES = 64 * 1024 * 1024
LFS_SIZE_THRESHOLD = 10 * 1024 * 1024
CONNECTION_TIMEOUT_S = 15.0


def git_blob_sha1(data: bytes) -> str:
    """``git hash-object`` of a regular file (the oid the Hub reports for non-LFS files)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Token:
    user: str
    write: bool = True
    orgs: tuple[str, ...] = ()
    # "fineGrained": whoami lists scoped permissions (``scopes``) instead of a role
    kind: str = "classic"
    scopes: tuple[str, ...] = ()  # entities ("user:NAME" / "org:NAME") the token may write to
    # False: whoami answers without ``auth`` (what a client cannot interpret)
    whoami_auth: bool = True

    def can_write(self, namespace: str) -> bool:
        return self.write and (namespace == self.user or namespace in self.orgs)

    def whoami(self) -> dict[str, Any]:
        """The ``/api/whoami-v2`` answer, shaped like the Hub's."""
        role = "write" if self.write else "read"
        orgs = [{"name": o, "type": "org", "roleInOrg": "write"} for o in self.orgs]
        answer: dict[str, Any] = {"type": "user", "name": self.user, "orgs": orgs}
        if not self.whoami_auth:
            return answer
        token: dict[str, Any] = {"displayName": "tests", "role": role}
        if self.kind == "fineGrained":
            token["role"] = "fineGrained"
            token["fineGrained"] = {
                "global": [],
                "scoped": [
                    {
                        "entity": {"type": s.split(":")[0], "name": s.split(":")[1]},
                        "permissions": ["repo.content.read", "repo.write"],
                    }
                    for s in self.scopes
                ],
            }
        answer["auth"] = {"type": "access_token", "accessToken": token}
        return answer


@dataclass
class Commit:
    oid: str
    summary: str
    files: dict[str, bytes]  # the full tree after this commit
    changed: tuple[str, ...]


@dataclass
class Repo:
    repo_id: str
    private: bool
    branches: dict[str, list[Commit]] = field(default_factory=dict)
    pull_requests: list[Commit] = field(default_factory=list)

    def head(self, branch: str) -> Optional[Commit]:
        commits = self.branches.get(branch)
        return commits[-1] if commits else None

    def tree(self, branch: str) -> dict[str, bytes]:
        head = self.head(branch)
        return dict(head.files) if head else {}


@dataclass
class Fault:
    """Answer requests matching ``method`` + ``path`` (regex) with ``status`` or a drop."""

    method: str
    path: str
    status: Optional[int] = None  # None: drop the connection mid-request
    times: Optional[int] = 1  # None: forever
    message: str = "injected fault"
    hits: int = 0


class FakeHub:
    """State of the stand-in Hub plus the HTTP server serving it."""

    def __init__(self, tokens: dict[str, Token], *, lfs: bool = True) -> None:
        self.tokens = tokens
        self.lfs = lfs  # False: every file is "regular" (base64 in the commit)
        self.repos: dict[str, Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}
        self.lfs_puts: list[str] = []  # oids, one per completed PUT
        self.requests: list[tuple[str, str]] = []
        self.faults: list[Fault] = []
        self.lock = threading.Lock()
        self._server: Optional[ThreadingHTTPServer] = None
        self._thread: Optional[threading.Thread] = None
        self.url = ""

    # -------------------------------------------------------------------- lifecycle

    def start(self) -> str:
        hub = self

        class Handler(_HubHandler):
            state = hub

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        server.request_queue_size = 16
        self._server = server
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = self._thread = None

    def __enter__(self) -> FakeHub:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------- inspection

    def commits(self, repo_id: str, branch: str = "main") -> list[Commit]:
        repo = self.repos.get(repo_id)
        return list(repo.branches.get(branch, [])) if repo else []

    def add_fault(self, fault: Fault) -> Fault:
        with self.lock:
            self.faults.append(fault)
        return fault

    def match_fault(self, method: str, path: str) -> Optional[Fault]:
        with self.lock:
            for fault in self.faults:
                if fault.method == method and re.search(fault.path, path):
                    if fault.times is not None and fault.hits >= fault.times:
                        continue
                    fault.hits += 1
                    return fault
        return None


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, code: Optional[str] = None, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra


_REPO = r"(?P<ns>[A-Za-z0-9][\w.\-]*)/(?P<name>[A-Za-z0-9][\w.\-]*)"
_ROUTES: list[tuple[str, re.Pattern[str], str]] = [
    ("POST", re.compile(r"^/api/repos/create$"), "create_repo"),
    ("POST", re.compile(r"^/api/validate-yaml$"), "validate_yaml"),
    ("GET", re.compile(rf"^/api/models/{_REPO}(?:/revision/(?P<rev>[^/]+))?$"), "repo_info"),
    ("POST", re.compile(rf"^/api/models/{_REPO}/preupload/(?P<rev>[^/]+)$"), "preupload"),
    ("POST", re.compile(rf"^/{_REPO}\.git/info/lfs/objects/batch$"), "lfs_batch"),
    ("POST", re.compile(rf"^/{_REPO}\.git/info/lfs/objects/verify$"), "lfs_verify"),
    ("PUT", re.compile(r"^/lfs-objects/(?P<oid>[0-9a-f]{64})$"), "lfs_put"),
    ("POST", re.compile(rf"^/api/models/{_REPO}/commit/(?P<rev>[^/]+)$"), "commit"),
    ("POST", re.compile(rf"^/api/models/{_REPO}/branch/(?P<branch>[^/]+)$"), "create_branch"),
    ("GET", re.compile(rf"^/api/models/{_REPO}/tree/(?P<rev>[^/]+)/?$"), "tree"),
    ("GET", re.compile(r"^/api/whoami-v2$"), "whoami"),
    ("PUT", re.compile(rf"^/api/models/{_REPO}/settings$"), "settings"),
    ("GET", re.compile(rf"^/{_REPO}/resolve/(?P<rev>[^/]+)/(?P<file>.+)$"), "resolve"),
]


class _HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = CONNECTION_TIMEOUT_S
    state: FakeHub

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass  # quiet: tests inspect FakeHub.requests instead

    # ---------------------------------------------------------------------- plumbing

    def do_GET(self) -> None:  # noqa: N802 - stdlib naming
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        path, query = url.path, parse_qs(url.query)
        hub = self.state
        with hub.lock:
            hub.requests.append((method, path))
        fault = hub.match_fault(method, path)
        if fault is not None and fault.status is None:
            self._drop()
            return
        try:
            if fault is not None:
                self._read_body()
                raise _HTTPError(fault.status or 500, fault.message)
            for route_method, pattern, handler in _ROUTES:
                match = pattern.match(path)
                if route_method == method and match:
                    body = self._read_body()
                    status, payload = getattr(self, f"_{handler}")(match, query, body)
                    if isinstance(payload, bytes):
                        self._send_bytes(status, payload)
                    else:
                        self._send_json(status, payload)
                    return
            self._read_body()
            raise _HTTPError(404, f"no route for {method} {path}")
        except _HTTPError as e:
            headers = {"X-Error-Message": e.message}
            if e.code:
                headers["X-Error-Code"] = e.code
            self._send_json(e.status, {"error": e.message, **e.extra}, headers)

    def _drop(self) -> None:
        """Read part of the request body, then close the socket without answering."""
        length = int(self.headers.get("Content-Length") or 0)
        try:
            if length:
                self.rfile.read(min(length, max(1, length // 2)))
            elif self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                self.rfile.readline()
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.close_connection = True

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks, total = [], 0
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                total += size
                if total > MAX_BODY_BYTES:
                    raise _HTTPError(413, "request body too large")
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            raise _HTTPError(413, "request body too large")
        return self.rfile.read(length) if length else b""

    def _send_bytes(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_json(self, status: int, payload: Any, headers: Optional[dict] = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    # ------------------------------------------------------------------------ auth

    def _token(self) -> Token:
        auth = self.headers.get("Authorization", "")
        token = auth[len("Bearer ") :] if auth.startswith("Bearer ") else ""
        info = self.state.tokens.get(token)
        if info is None:
            raise _HTTPError(401, "Invalid credentials in Authorization header")
        return info

    def _writable_repo(self, match: re.Match[str]) -> Repo:
        token = self._token()
        repo_id = f"{match['ns']}/{match['name']}"
        repo = self.state.repos.get(repo_id)
        if repo is None:
            raise _HTTPError(404, "Repository not found", "RepoNotFound")
        if not token.can_write(match["ns"]):
            raise _HTTPError(403, f"You don't have the rights to write to {repo_id}")
        return repo

    @staticmethod
    def _branch(repo: Repo, rev: str) -> str:
        branch = unquote(rev)
        if branch not in repo.branches:
            raise _HTTPError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
        return branch

    # ---------------------------------------------------------------------- routes

    def _create_repo(self, match: re.Match[str], query: dict, body: bytes) -> tuple[int, Any]:
        token = self._token()
        payload = json.loads(body or b"{}")
        namespace = payload.get("organization") or token.user
        repo_id = f"{namespace}/{payload['name']}"
        if not token.can_write(namespace):
            raise _HTTPError(
                403,
                f'You don\'t have the rights to create a model under the namespace "{namespace}"',
            )
        with self.state.lock:
            if repo_id in self.state.repos:
                raise _HTTPError(
                    409, "You already created this model repo", url=f"{self.state.url}/{repo_id}"
                )
            repo = Repo(repo_id, private=payload.get("visibility") == "private")
            initial = Commit(git_blob_sha1(repo_id.encode()), "initial commit", {}, ())
            repo.branches["main"] = [initial]
            self.state.repos[repo_id] = repo
        return 200, {"url": f"{self.state.url}/{repo_id}", "name": repo_id, "id": repo_id}

    def _validate_yaml(self, match: re.Match[str], query: dict, body: bytes) -> tuple[int, Any]:
        import yaml

        content = json.loads(body or b"{}").get("content", "")
        found = re.match(r"^---\s*\n(.*?)\n---\s*\n", content, re.S)
        try:
            meta = yaml.safe_load(found.group(1)) if found else {}
        except yaml.YAMLError as e:
            raise _HTTPError(400, f"invalid YAML: {e}") from None
        if meta is not None and not isinstance(meta, dict):
            raise _HTTPError(400, "metadata must be a mapping")
        return 200, {"errors": [], "warnings": []}

    def _repo_info(self, match: re.Match[str], query: dict, body: bytes) -> tuple[int, Any]:
        repo_id = f"{match['ns']}/{match['name']}"
        repo = self.state.repos.get(repo_id)
        if repo is None:
            raise _HTTPError(404, "Repository not found", "RepoNotFound")
        branch = self._branch(repo, match["rev"] or "main")
        head = repo.head(branch)
        return 200, {
            "id": repo_id,
            "sha": head.oid if head else None,
            "private": repo.private,
            "siblings": [{"rfilename": p} for p in sorted(repo.tree(branch))],
        }

    def _preupload(self, match: re.Match[str], query: dict, body: bytes) -> tuple[int, Any]:
        repo = self._writable_repo(match)
        branch = "main" if query.get("create_pr") else self._branch(repo, match["rev"])
        tree = repo.tree(branch)
        files = []
        for f in json.loads(body)["files"]:
            sample = base64.b64decode(f["sample"])
            lfs = self.state.lfs and (b"\0" in sample or f["size"] > LFS_SIZE_THRESHOLD)
            existing = tree.get(f["path"])
            oid = None
            if existing is not None:
                oid = hashlib.sha256(existing).hexdigest() if lfs else git_blob_sha1(existing)
            files.append(
                {
                    "path": f["path"],
                    "uploadMode": "lfs" if lfs else "regular",
                    "shouldIgnore": False,
                    "oid": oid,
                }
            )
        return 200, {
            "files": files,
            "commitOid": repo.head(branch).oid if repo.head(branch) else None,
        }

    def _lfs_batch(self, match: re.Match[str], query: dict, body: bytes) -> tuple[int, Any]:
        self._writable_repo(match)
        payload = json.loads(body)
        base = f"{self.state.url}/{match['ns']}/{match['name']}.git/info/lfs/objects"
        objects = []
        for obj in payload["objects"]:
            entry: dict[str, Any] = {"oid": obj["oid"], "size": obj["size"]}
            if obj["oid"] not in self.state.lfs_objects:
                entry["actions"] = {
                    "upload": {"href": f"{self.state.url}/lfs-objects/{obj['oid']}"},
                    "verify": {"href": f"{base}/verify"},
                }
            objects.append(entry)
        return 200, {"transfer": "basic", "objects": objects}

    def _lfs_put(self, match: re.Match[str], query: dict, body: bytes) -> tuple[int, Any]:
        oid = match["oid"]
        if hashlib.sha256(body).hexdigest() != oid:
            raise _HTTPError(400, "content does not match the oid")
        with self.state.lock:
            self.state.lfs_objects[oid] = body
            self.state.lfs_puts.append(oid)
        return 200, {}

    def _lfs_verify(self, match: re.Match[str], query: dict, body: bytes) -> tuple[int, Any]:
        self._token()
        payload = json.loads(body)
        stored = self.state.lfs_objects.get(payload["oid"])
        if stored is None or len(stored) != payload["size"]:
            raise _HTTPError(404, f"object {payload['oid']} not found")
        return 200, {}

    def _tree(self, match: re.Match[str], query: dict, body: bytes) -> tuple[int, Any]:
        repo = self.state.repos.get(f"{match['ns']}/{match['name']}")
        if repo is None:
            raise _HTTPError(404, "Repository not found", "RepoNotFound")
        if repo.private:
            self._writable_repo(match)
        files = repo.tree(self._branch(repo, match["rev"]))
        return 200, [
            {"type": "file", "path": p, "size": len(c), "oid": git_blob_sha1(c)}
            for p, c in sorted(files.items())
        ]

    def _resolve(self, match: re.Match[str], query: dict, body: bytes) -> tuple[int, Any]:
        """A file at a branch or at a commit (``hf_hub_url``'s ``resolve`` route)."""
        repo = self.state.repos.get(f"{match['ns']}/{match['name']}")
        if repo is None:
            raise _HTTPError(404, "Repository not found", "RepoNotFound")
        if repo.private:
            self._writable_repo(match)
        rev = unquote(match["rev"])
        commits = [c for b in repo.branches.values() for c in b if c.oid == rev]
        files = commits[0].files if commits else repo.tree(self._branch(repo, rev))
        path = unquote(match["file"])
        if path not in files:
            raise _HTTPError(404, f"{path} not found", "EntryNotFound")
        return 200, files[path]

    def _whoami(self, match: re.Match[str], query: dict, body: bytes) -> tuple[int, Any]:
        return 200, self._token().whoami()

    def _settings(self, match: re.Match[str], query: dict, body: bytes) -> tuple[int, Any]:
        repo = self._writable_repo(match)
        payload = json.loads(body or b"{}")
        if "visibility" in payload:
            repo.private = payload["visibility"] == "private"
        elif "private" in payload:
            repo.private = bool(payload["private"])
        return 200, {}

    def _create_branch(self, match: re.Match[str], query: dict, body: bytes) -> tuple[int, Any]:
        repo = self._writable_repo(match)
        branch = unquote(match["branch"])
        with self.state.lock:
            if branch in repo.branches:
                raise _HTTPError(409, f"branch {branch} already exists")
            repo.branches[branch] = list(repo.branches["main"])
        return 200, {}

    def _commit(self, match: re.Match[str], query: dict, body: bytes) -> tuple[int, Any]:
        repo = self._writable_repo(match)
        create_pr = bool(query.get("create_pr"))
        branch = "main" if create_pr else self._branch(repo, match["rev"])
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise _HTTPError(400, "the commit payload must start with a header")
        summary = lines[0]["value"]["summary"]
        changes: dict[str, bytes] = {}
        deleted: list[str] = []
        for line in lines[1:]:
            value = line["value"]
            if line["key"] == "file":
                if value.get("encoding") != "base64":
                    raise _HTTPError(400, "regular files must be base64-encoded")
                changes[value["path"]] = base64.b64decode(value["content"])
            elif line["key"] == "lfsFile":
                stored = self.state.lfs_objects.get(value["oid"])
                if stored is None:
                    raise _HTTPError(422, f"LFS object {value['oid']} was never uploaded")
                changes[value["path"]] = stored
            elif line["key"] == "deletedFile":
                deleted.append(value["path"])
            else:
                raise _HTTPError(400, f"unsupported operation {line['key']}")
        with self.state.lock:
            files = repo.tree(branch)
            for path in deleted:
                if path not in files:
                    raise _HTTPError(404, f"cannot delete {path}: not in the repository")
                del files[path]
            files.update(changes)
            parent = repo.head(branch)
            digest = hashlib.sha1(
                (parent.oid if parent else "").encode()
                + summary.encode()
                + b"".join(
                    p.encode() + hashlib.sha256(c).digest() for p, c in sorted(changes.items())
                )
            ).hexdigest()
            commit = Commit(digest, summary, files, tuple(sorted([*changes, *deleted])))
            if create_pr:
                repo.pull_requests.append(commit)
                number = len(repo.pull_requests)
                pr_url = f"{self.state.url}/{repo.repo_id}/discussions/{number}"
            else:
                repo.branches[branch].append(commit)
                pr_url = None
        return 200, {
            "commitUrl": f"{self.state.url}/{repo.repo_id}/commit/{digest}",
            "commitOid": digest,
            "pullRequestUrl": pr_url,
        }
