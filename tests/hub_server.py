"""A stand-in for the Hugging Face Hub on 127.0.0.1, for tests: it serves model repositories laid out as the
Hub serves them, so the real `huggingface_hub` client (pointed at it through HF_ENDPOINT) downloads from it.

Only what the client calls for a model download is served (read from huggingface_hub's source):
- `GET /api/models/{repo}` and `/api/models/{repo}/revision/{rev}`: the model info, its `sha` (the commit
  the revision resolves to) and `siblings` (with `?blobs=true`: sizes, blob ids and LFS size/sha256);
- `HEAD`/`GET /{repo}/resolve/{rev}/{file}`: the file, with `X-Repo-Commit`, `ETag` (a git blob id; an LFS
  file's `X-Linked-Etag` is its sha256, and `X-Linked-Size` its size), `Content-Length` and `Range` support;
- errors as the Hub sends them: a status and `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound,
  GatedRepo), which the client turns into its own exception types.
Every request is logged (method, path, Range header) so a test can assert what was and was not fetched.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".model", ".onnx", ".gguf")


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    """A model repository: commits (sha -> files) and the branches or tags that point at them."""

    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    gated: bool = False

    def add_commit(self, files: dict[str, bytes], *branches: str) -> str:
        digest = hashlib.sha1()
        for name in sorted(files):
            digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
        sha = digest.hexdigest()
        self.commits[sha] = files
        for branch in branches:
            self.refs[branch] = sha
        return sha

    def resolve(self, revision: str) -> str | None:
        if revision in self.commits:
            return revision
        return self.refs.get(revision)


def files_of(directory: Path, **extra: bytes) -> dict[str, bytes]:
    """The files of a local model directory (relative names), plus `extra` ones (e.g. a `.bin` no merge needs)."""
    found = {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}
    return {**found, **{name.replace("__", "/"): data for name, data in extra.items()}}


class HubServer:
    """`with HubServer() as hub:` serves `hub.repos` at `hub.endpoint` until the block ends."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.log: list[tuple[str, str, str | None]] = []
        self.cut_once: dict[str, int] = {}  # file -> bytes its first full GET sends before the connection drops
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # quiet: the test reads `server.log`
                return None

            def do_GET(self) -> None:
                server._handle(self, head=False)

            def do_HEAD(self) -> None:
                server._handle(self, head=True)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def requested(self, method: str | None = None) -> list[str]:
        with self._lock:
            return [path for m, path, _ in self.log if method is None or m == method]

    # ----- the Hub's answers ---------------------------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        url = urlsplit(h.path)
        path = unquote(url.path)
        with self._lock:
            self.log.append((h.command, path, h.headers.get("Range")))
        if path.startswith("/api/models/"):
            self._model_info(h, url.path[len("/api/models/") :], "blobs=true" in url.query.lower())
            return
        parts = url.path.lstrip("/").split("/")
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id, revision, filename = f"{parts[0]}/{parts[1]}", unquote(parts[3]), unquote("/".join(parts[4:]))
            self._resolve(h, repo_id, revision, filename, head)
            return
        self._error(h, 404, "", head)

    def _repo(self, h: BaseHTTPRequestHandler, repo_id: str, head: bool = False) -> Repo | None:
        repo = self.repos.get(repo_id)
        if repo is None:
            self._error(h, 404, "RepoNotFound", head)
            return None
        if repo.gated:
            self._error(h, 403, "GatedRepo", head)
            return None
        return repo

    def _model_info(self, h: BaseHTTPRequestHandler, raw: str, blobs: bool) -> None:
        repo_id, _, revision = raw.partition("/revision/")
        repo_id, revision = unquote(repo_id), unquote(revision) or "main"
        repo = self._repo(h, repo_id)
        if repo is None:
            return
        sha = repo.resolve(revision)
        if sha is None:
            self._error(h, 404, "RevisionNotFound")
            return
        siblings = []
        for name, data in sorted(repo.commits[sha].items()):
            entry: dict[str, Any] = {"rfilename": name}
            if blobs:
                entry.update(size=len(data), blobId=_git_blob_id(data))
                if name.endswith(LFS_SUFFIXES):
                    entry["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
            siblings.append(entry)
        body = json.dumps({"id": repo_id, "modelId": repo_id, "sha": sha, "private": False, "siblings": siblings})
        self._send(h, 200, {"Content-Type": "application/json"}, body.encode(), head=False)

    def _resolve(self, h: BaseHTTPRequestHandler, repo_id: str, revision: str, filename: str, head: bool) -> None:
        repo = self._repo(h, repo_id, head)
        if repo is None:
            return
        sha = repo.resolve(revision)
        if sha is None:
            self._error(h, 404, "RevisionNotFound", head)
            return
        data = repo.commits[sha].get(filename)
        if data is None:
            self._error(h, 404, "EntryNotFound", head, {"X-Repo-Commit": sha})
            return
        base = filename.rsplit("/", 1)[-1]
        headers = {
            "X-Repo-Commit": sha,
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
            "Content-Disposition": f"inline; filename*=UTF-8''{base}; filename=\"{base}\";",
        }
        if filename.endswith(LFS_SUFFIXES):
            headers["X-Linked-Etag"] = f'"{hashlib.sha256(data).hexdigest()}"'
            headers["X-Linked-Size"] = str(len(data))
            headers["ETag"] = f'"{_git_blob_id(data)}"'
        else:
            headers["ETag"] = f'"{_git_blob_id(data)}"'
        start, end = 0, len(data)
        wanted = h.headers.get("Range")
        if wanted and wanted.startswith("bytes=") and not head:
            first, _, last = wanted[len("bytes=") :].partition("-")
            start, end = int(first or 0), min(int(last) + 1, len(data)) if last else len(data)
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
        status = 206 if wanted and not head else 200
        body = data[start:end]
        if not head and not start and f"{repo_id}/{filename}" in self.cut_once:
            sent = self.cut_once.pop(f"{repo_id}/{filename}")
            headers["Content-Length"] = str(len(body))
            h.send_response(200)
            for key, value in headers.items():
                h.send_header(key, value)
            h.end_headers()
            h.wfile.write(body[:sent])  # then the connection drops: the client must resume
            h.wfile.flush()
            h.close_connection = True
            return
        self._send(h, status, headers, body, head)

    def _error(
        self, h: BaseHTTPRequestHandler, status: int, code: str, head: bool = False, extra: dict[str, str] | None = None
    ) -> None:
        headers = {"Content-Type": "application/json", **(extra or {})}
        if code:
            headers["X-Error-Code"] = code
        body = json.dumps({"error": code or "not found"}).encode()
        self._send(h, status, headers, body, head)

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, headers: dict[str, str], body: bytes, head: bool) -> None:
        h.send_response(status)
        for key, value in headers.items():
            h.send_header(key, value)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)
