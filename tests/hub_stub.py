"""A small local stand-in for the Hugging Face Hub HTTP API, for tests (no network here).

It serves exactly the endpoints that ``huggingface_hub``'s client uses for
``create_repo``, ``create_branch``, ``upload_file``/``create_commit`` (README metadata
validation, ``preupload`` and the NDJSON ``commit``), ``model_info``/``repo_info``,
``list_repo_tree``/``list_repo_files`` (``upload_folder``'s ``delete_patterns``) and
``hf_hub_download`` (``HEAD`` + ``GET`` on ``/{repo}/resolve/{revision}/{path}``), with the
Hub's error codes (``X-Error-Code: RepoNotFound | RevisionNotFound | EntryNotFound``).
Every file is uploaded inline ("regular" upload mode); there is no LFS/Xet storage.

Repos are kept in memory as git-like commits (full snapshots) on branches, so revisions,
pull-request refs (``create_pr``) and subfolders behave as on the Hub. Writes need an
``Authorization: Bearer`` header (any token); private repos need it for reads too.

    with HubStub() as hub:               # binds 127.0.0.1 on a free port
        api = HfApi(endpoint=hub.endpoint, token="hf_dummy")
        ...
        hub.files("user/repo")           # {path: bytes} at the head of main
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob (what the Hub reports as a regular file's oid)."""
    return hashlib.sha1(b"blob %d\x00" % len(data) + data).hexdigest()


class _HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra


class HubStub:
    """In-memory Hub: ``start()`` serves it on ``127.0.0.1:<free port>``; ``endpoint`` is its URL."""

    def __init__(self) -> None:
        self.repos: dict[str, dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, in order
        self._lock = threading.RLock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> str:
        stub = self

        class Handler(_Handler):
            hub = stub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="hub-stub", daemon=True)
        self._thread.start()
        return self.endpoint

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self) -> HubStub:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        if self._server is None:
            raise RuntimeError("the stub is not running")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    # ------------------------------------------------------------------ inspection
    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """Files of ``repo_id`` at ``revision`` (a branch, PR ref or commit sha)."""
        with self._lock:
            return dict(self._snapshot(repo_id, revision)["files"])

    def commits(self, repo_id: str, revision: str = "main") -> list[str]:
        """Commit messages from ``revision`` back to the repo's creation."""
        with self._lock:
            repo = self._repo(repo_id)
            sha: str | None = self._resolve(repo, revision)
            out = []
            while sha is not None:
                commit = repo["commits"][sha]
                out.append(commit["message"])
                sha = commit["parent"]
            return out

    # ------------------------------------------------------------------ model
    def _repo(self, repo_id: str) -> dict[str, Any]:
        repo = self.repos.get(repo_id)
        if repo is None:
            raise _HubError(404, f"Repository {repo_id} not found", "RepoNotFound")
        return repo

    @staticmethod
    def _resolve(repo: dict[str, Any], revision: str) -> str:
        if revision in repo["branches"]:
            return repo["branches"][revision]
        if revision in repo["commits"]:
            return revision
        raise _HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def _snapshot(self, repo_id: str, revision: str) -> dict[str, Any]:
        repo = self._repo(repo_id)
        return repo["commits"][self._resolve(repo, revision)]

    def _new_commit(
        self, repo: dict[str, Any], parent: str | None, files: dict[str, bytes], message: str
    ) -> str:
        sha = hashlib.sha1(f"{parent}:{message}:{uuid.uuid4()}".encode()).hexdigest()
        repo["commits"][sha] = {"parent": parent, "files": files, "message": message}
        return sha

    def create_repo(self, repo_id: str, private: bool = False) -> None:
        with self._lock:
            if repo_id in self.repos:  # the Hub's 409 body carries the url; the client reads it
                raise _HubError(409, "You already created this model repo", url=f"{self.endpoint}/{repo_id}")
            repo: dict[str, Any] = {"private": private, "branches": {}, "commits": {}, "prs": 0}
            repo["branches"]["main"] = self._new_commit(
                repo, None, {".gitattributes": GITATTRIBUTES}, "initial commit"
            )
            self.repos[repo_id] = repo


class _Handler(BaseHTTPRequestHandler):
    hub: HubStub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
        pass

    # ------------------------------------------------------------------ plumbing
    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(
        self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, head: bool = False
    ) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head and body:
            self.wfile.write(body)

    def _json(self, status: int, payload: Any, head: bool = False) -> None:
        self._send(status, json.dumps(payload).encode(), {"Content-Type": "application/json"}, head=head)

    def _authorized(self) -> bool:
        return (self.headers.get("Authorization") or "").startswith("Bearer ")

    def _require_auth(self) -> None:
        if not self._authorized():
            raise _HubError(401, "Invalid credentials in Authorization header")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        self.hub.requests.append((method, url.path))
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        parts = url.path.strip("/").split("/")  # still percent-encoded: a quoted revision is one part
        body = self._body() if method == "POST" else b""
        try:
            with self.hub._lock:
                self._route(method, parts, query, body)
        except _HubError as err:
            headers = {"Content-Type": "application/json"}
            if err.code:
                headers["X-Error-Code"] = err.code
            payload = {"error": err.message, **err.extra}
            self._send(err.status, json.dumps(payload).encode(), headers, head=method == "HEAD")

    def do_GET(self) -> None:  # noqa: N802
        self._dispatch("GET")

    def do_HEAD(self) -> None:  # noqa: N802
        self._dispatch("HEAD")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    # ------------------------------------------------------------------ routes
    def _route(self, method: str, parts: list[str], query: dict[str, str], body: bytes) -> None:
        hub = self.hub
        if method == "POST" and parts == ["api", "repos", "create"]:
            self._require_auth()
            payload = json.loads(body or b"{}")
            if payload.get("type", "model") != "model":
                raise _HubError(400, "the stub only hosts model repos")
            name, org = payload["name"], payload.get("organization")
            repo_id = f"{org}/{name}" if org else f"user/{name}"
            hub.create_repo(
                repo_id, private=payload.get("visibility") == "private" or bool(payload.get("private"))
            )
            return self._json(200, {"url": f"{hub.endpoint}/{repo_id}", "name": repo_id})
        if method == "POST" and parts == ["api", "validate-yaml"]:
            return self._json(200, {"errors": [], "warnings": []})
        if len(parts) >= 4 and parts[:2] == ["api", "models"]:
            repo_id = f"{parts[2]}/{parts[3]}"
            rest = parts[4:]
            repo = hub._repo(repo_id)
            if repo["private"] and not self._authorized():
                raise _HubError(404, f"Repository {repo_id} not found", "RepoNotFound")
            if method == "GET" and (not rest or rest[0] == "revision"):
                revision = unquote(rest[1]) if len(rest) > 1 else "main"
                return self._model_info(repo_id, revision)
            if method == "GET" and len(rest) >= 2 and rest[0] == "tree":
                return self._tree(repo_id, unquote(rest[1]), unquote("/".join(rest[2:])), query)
            if method == "POST" and len(rest) == 2 and rest[0] == "preupload":
                self._require_auth()
                return self._preupload(repo_id, unquote(rest[1]), json.loads(body or b"{}"))
            if method == "POST" and len(rest) == 2 and rest[0] == "commit":
                self._require_auth()
                return self._commit(repo_id, unquote(rest[1]), body, query.get("create_pr") == "1")
            if method == "POST" and len(rest) == 2 and rest[0] == "branch":
                self._require_auth()
                return self._create_branch(repo_id, unquote(rest[1]), json.loads(body or b"{}"))
        if method in ("GET", "HEAD") and len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve_file(
                f"{parts[0]}/{parts[1]}", unquote(parts[3]), unquote("/".join(parts[4:])), method
            )
        raise _HubError(404, f"the stub has no route for {method} /{'/'.join(parts)}")

    def _model_info(self, repo_id: str, revision: str) -> None:
        hub = self.hub
        repo = hub._repo(repo_id)
        sha = hub._resolve(repo, revision)
        files = repo["commits"][sha]["files"]
        return self._json(
            200,
            {
                "_id": repo_id,
                "id": repo_id,
                "modelId": repo_id,
                "sha": sha,
                "private": repo["private"],
                "disabled": False,
                "gated": False,
                "tags": [],
                "siblings": [{"rfilename": path, "size": len(data)} for path, data in sorted(files.items())],
            },
        )

    def _tree(self, repo_id: str, revision: str, path: str, query: dict[str, str]) -> None:
        """``list_repo_tree`` (``list_repo_files``, ``upload_folder``'s ``delete_patterns``): one page, the
        files under ``path`` (all of them where ``recursive``, else its own files and folders)."""
        hub = self.hub
        repo = hub._repo(repo_id)
        files = repo["commits"][hub._resolve(repo, revision)]["files"]
        prefix = path.strip("/") + "/" if path.strip("/") else ""
        recursive = query.get("recursive", "").lower() == "true"
        entries, folders = [], set()
        for name, data in sorted(files.items()):
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix) :]
            if "/" in rest and not recursive:
                folders.add(prefix + rest.split("/", 1)[0])
                continue
            entries.append({"type": "file", "path": name, "oid": git_blob_sha1(data), "size": len(data)})
        entries += [{"type": "directory", "path": folder, "oid": ""} for folder in sorted(folders)]
        if prefix and not entries:
            raise _HubError(404, f"Entry not found: {path}", "EntryNotFound")
        return self._json(200, entries)

    def _preupload(self, repo_id: str, revision: str, payload: dict[str, Any]) -> None:
        hub = self.hub
        repo = hub._repo(repo_id)
        files = repo["commits"][hub._resolve(repo, revision)]["files"]
        out = []
        for entry in payload.get("files", []):
            path = entry["path"]
            oid = git_blob_sha1(files[path]) if path in files else None
            out.append({"path": path, "uploadMode": "regular", "shouldIgnore": False, "oid": oid})
        return self._json(200, {"files": out, "commitOid": hub._resolve(repo, revision)})

    def _commit(self, repo_id: str, revision: str, body: bytes, create_pr: bool) -> None:
        hub = self.hub
        repo = hub._repo(repo_id)
        parent = hub._resolve(repo, revision)
        if revision not in repo["branches"]:
            raise _HubError(400, f"can only commit to a branch; {revision!r} is not one", "RevisionNotFound")
        files = dict(repo["commits"][parent]["files"])
        message = ""
        for line in body.splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                message = value.get("summary", "")
                if value.get("parentCommit") not in (None, parent):
                    raise _HubError(412, "parent commit is not the head of the branch")
            elif key == "file":
                if value.get("encoding") != "base64":
                    raise _HubError(400, "the stub expects base64 file content")
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "deletedFile":
                if value["path"] not in files:
                    raise _HubError(404, "A file with this name doesn't exist", "EntryNotFound")
                del files[value["path"]]
            elif key == "deletedFolder":
                prefix = value["path"].rstrip("/") + "/"
                for path in [p for p in files if p.startswith(prefix)]:
                    del files[path]
            else:
                raise _HubError(422, f"the stub does not support commit operation {key!r} (LFS/copy)")
        sha = hub._new_commit(repo, parent, files, message)
        result: dict[str, Any] = {"commitUrl": f"{hub.endpoint}/{repo_id}/commit/{sha}", "commitOid": sha}
        if create_pr:
            repo["prs"] += 1
            number = repo["prs"]
            repo["branches"][f"refs/pr/{number}"] = sha
            result["pullRequestUrl"] = f"{hub.endpoint}/{repo_id}/discussions/{number}"
        else:
            repo["branches"][revision] = sha
        return self._json(200, result)

    def _create_branch(self, repo_id: str, branch: str, payload: dict[str, Any]) -> None:
        hub = self.hub
        repo = hub._repo(repo_id)
        if branch in repo["branches"]:
            raise _HubError(409, f"Reference already exists: refs/heads/{branch}")
        repo["branches"][branch] = hub._resolve(repo, payload.get("startingPoint") or "main")
        return self._json(200, {})

    def _resolve_file(self, repo_id: str, revision: str, path: str, method: str) -> None:
        hub = self.hub
        repo = hub._repo(repo_id)
        if repo["private"] and not self._authorized():
            raise _HubError(404, f"Repository {repo_id} not found", "RepoNotFound")
        sha = hub._resolve(repo, revision)
        files = repo["commits"][sha]["files"]
        if path not in files:
            raise _HubError(404, f"Entry not found: {path}", "EntryNotFound")
        data = files[path]
        headers = {
            "X-Repo-Commit": sha,
            "ETag": f'"{git_blob_sha1(data)}"',
            "Content-Type": "application/octet-stream",
            "Accept-Ranges": "bytes",
        }
        status = 200
        ranged = self.headers.get("Range")
        if ranged and ranged.startswith("bytes=") and method == "GET":
            start_text, _, end_text = ranged[6:].partition("-")
            start = int(start_text or 0)
            end = int(end_text) if end_text else len(data) - 1
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            data, status = data[start : end + 1], 206
        return self._send(status, data, headers, head=method == "HEAD")
