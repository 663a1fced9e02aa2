"""A small HTTP server on 127.0.0.1 speaking the part of the Hugging Face Hub's HTTP API that
`huggingface_hub.snapshot_download` uses, so the real client code runs end to end (HF_ENDPOINT pointed here).

Routes (as the Hub serves them):
  GET  /api/models/{org}/{name}/revision/{rev}          repo info: id, sha (the commit the ref points at), siblings
  GET  /api/models/{org}/{name}/tree/{rev}[?recursive]  the file listing: type, path, size, oid, lfs {oid,size}
  HEAD /{org}/{name}/resolve/{rev}/{path}              X-Repo-Commit, ETag, Content-Length; LFS files answer
  GET  /{org}/{name}/resolve/{rev}/{path}              LFS files: 302 to the "CDN" (a second listener on
  GET  /lfs/<sha256>  (on 127.0.0.2)                   127.0.0.2) with X-Linked-Etag/X-Linked-Size, as the Hub does
Errors carry the Hub's X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo) and, for a bad
token, X-Error-Message "Invalid credentials in Authorization header" — the headers the client maps to its errors.

Not modelled: Xet storage (no X-Xet-* headers, so the client takes the plain HTTP path), real accounts and token
scopes, rate limits, pagination of long listings, CDN signatures.
"""
from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin")


@dataclass
class Repo:
    files: dict[str, bytes]  # path -> content at the one commit
    sha: str  # that commit
    refs: dict[str, str] = field(default_factory=dict)  # branch/tag -> sha ("main" always)
    token: str | None = None  # private: only this bearer token may read it
    gated: bool = False  # a valid token is still refused (terms not accepted)

    def resolve(self, revision: str) -> str | None:
        return revision if revision == self.sha else self.refs.get(revision)


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Authorization header)
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        # The "CDN" is another host (the client follows redirects on the Hub's host only, and keeps the token there).
        self._cdn = ThreadingHTTPServer(("127.0.0.2", 0), _handler(self))
        self._threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in (self._server, self._cdn)]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def cdn_url(self) -> str:
        return f"http://127.0.0.2:{self._cdn.server_address[1]}"

    def add_repo(self, repo_id: str, files: dict[str, bytes], *, token: str | None = None, gated: bool = False,
                 tags: tuple[str, ...] = ()) -> Repo:
        sha = hashlib.sha1(json.dumps(sorted((k, hashlib.sha256(v).hexdigest()) for k, v in files.items()))
                           .encode()).hexdigest()
        repo = Repo(files, sha, {"main": sha, **{t: sha for t in tags}}, token, gated)
        self.repos[repo_id] = repo
        return repo

    def add_folder(self, repo_id: str, folder: Path, **kwargs) -> Repo:
        files = {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        return self.add_repo(repo_id, files, **kwargs)

    def __enter__(self) -> FakeHub:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        for server in (self._server, self._cdn):
            server.shutdown()
            server.server_close()


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet test output
            pass

        def do_HEAD(self) -> None:
            self._route(body=False)

        def do_GET(self) -> None:
            self._route(body=True)

        def _route(self, body: bool) -> None:
            path = unquote(urlparse(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Authorization")))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
                repo_id, kind, revision = "/".join(parts[2:4]), parts[4], parts[5]
                repo = self._repo(repo_id, revision)
                if repo is not None:
                    self._api(repo_id, repo, kind, body)
            elif len(parts) >= 5 and parts[2] == "resolve":
                repo_id, revision, file_path = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                repo = self._repo(repo_id, revision)
                if repo is not None:
                    self._resolve(repo, file_path, body)
            elif len(parts) == 2 and parts[0] == "lfs":
                blob = next((c for r in hub.repos.values() for c in r.files.values()
                             if hashlib.sha256(c).hexdigest() == parts[1]), None)
                if blob is None:
                    self._error(404, "EntryNotFound", "no such LFS object")
                else:
                    self._send(200, blob if body else None, {"ETag": f'"{parts[1]}"', "Content-Length": len(blob)},
                               content_type="application/octet-stream")
            else:
                self._error(404, None, f"no route {path}")

        def _repo(self, repo_id: str, revision: str) -> Repo | None:
            repo = hub.repos.get(repo_id)
            auth = self.headers.get("Authorization")
            if repo is not None and repo.token is not None and auth != f"Bearer {repo.token}":
                if auth:  # a token that is not valid at all: the Hub says so instead of hiding the repo
                    self._error(401, None, "Invalid credentials in Authorization header")
                else:
                    self._error(401, "RepoNotFound", "Repository not found")
                return None
            if repo is None:
                self._error(401 if auth is None else 404, "RepoNotFound", "Repository not found")
                return None
            if repo.gated:
                self._error(403, "GatedRepo", "Access to this model is restricted")
                return None
            if repo.resolve(revision) is None:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                return None
            return repo

        def _api(self, repo_id: str, repo: Repo, kind: str, body: bool) -> None:
            if kind == "revision":
                payload = {"id": repo_id, "modelId": repo_id, "sha": repo.sha, "private": repo.token is not None,
                           "gated": False, "siblings": [{"rfilename": p} for p in sorted(repo.files)]}
            else:
                payload = [_tree_entry(p, c) for p, c in sorted(repo.files.items())]
            data = json.dumps(payload).encode()
            self._send(200, data if body else None, {"Content-Length": len(data)})

        def _resolve(self, repo: Repo, file_path: str, body: bool) -> None:
            content = repo.files.get(file_path)
            if content is None:
                self._error(404, "EntryNotFound", f"{file_path} does not exist")
                return
            headers = {"X-Repo-Commit": repo.sha, "Accept-Ranges": "bytes"}
            if file_path.endswith(LFS_SUFFIXES):
                sha256 = hashlib.sha256(content).hexdigest()
                headers.update({"Location": f"{hub.cdn_url}/lfs/{sha256}", "X-Linked-Etag": f'"{sha256}"',
                                "X-Linked-Size": len(content), "Content-Length": 0})
                self._send(302, None, headers)
                return
            headers.update({"ETag": f'"{_git_oid(content)}"', "Content-Length": len(content)})
            self._send(200, content if body else None, headers, content_type="application/octet-stream")

        def _error(self, status: int, code: str | None, message: str) -> None:
            data = json.dumps({"error": message}).encode()
            headers = {"X-Error-Message": message, "Content-Length": len(data)}
            if code:
                headers["X-Error-Code"] = code
            self._send(status, data if self.command != "HEAD" else None, headers)

        def _send(self, status: int, data: bytes | None, headers: dict, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            for key, value in headers.items():
                self.send_header(key, str(value))
            self.end_headers()
            if data:
                self.wfile.write(data)

    return Handler


def _git_oid(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def _tree_entry(path: str, content: bytes) -> dict:
    entry = {"type": "file", "path": path, "size": len(content), "oid": _git_oid(content)}
    if path.endswith(LFS_SUFFIXES):
        entry["lfs"] = {"oid": hashlib.sha256(content).hexdigest(), "size": len(content), "pointerSize": 134}
    return entry
