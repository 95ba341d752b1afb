"""A model hub on this machine for the tests, which cannot reach huggingface.co: the few routes of the
Hub's HTTP API that `huggingface_hub.snapshot_download` calls (a repository's info at a revision, its
file tree, each file's metadata and bytes), answering errors with the Hub's `X-Error-Code` headers, so
the real client, pointed at it through HF_ENDPOINT, downloads, caches and fails as against the Hub.
Repositories are model directories the test wrote; a gated one needs a bearer token. Every file served
is counted."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

TOKEN = "hf_test_token"


@dataclass
class Repo:
    files: dict[str, bytes]
    gated: bool = False
    sha: str = ""

    def __post_init__(self):
        digest = hashlib.sha1(json.dumps(sorted((p, hashlib.sha1(b).hexdigest()) for p, b in self.files.items()))
                              .encode())
        self.sha = digest.hexdigest()


@dataclass
class Hub:
    repos: dict[str, Repo] = field(default_factory=dict)
    downloads: Counter = field(default_factory=Counter)
    """(repo id, file) -> times its bytes were sent."""

    def add(self, repo_id: str, model_dir: str | Path, gated: bool = False) -> Repo:
        root = Path(model_dir)
        files = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
        self.repos[repo_id] = Repo(files, gated)
        return self.repos[repo_id]


def serve(hub: Hub) -> tuple[ThreadingHTTPServer, str]:
    """The hub served on 127.0.0.1 (a thread of this process); returns the server and its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def do_HEAD(self):
            self._answer(send_body=False)

        def do_GET(self):
            self._answer(send_body=True)

        def _answer(self, send_body: bool) -> None:
            parts = [unquote(p) for p in urlparse(self.path).path.strip("/").split("/")]
            if parts[:2] == ["api", "models"] and len(parts) in (4, 6):  # api/models/org/name[/(revision|tree)/rev]
                repo_id, route, revision = "/".join(parts[2:4]), *(parts[4:6] or ["revision", "main"])
                repo = self._repo(repo_id, revision)
                if repo is None:
                    return
                if route == "revision":
                    body = {"id": repo_id, "sha": repo.sha, "siblings": [{"rfilename": p} for p in repo.files],
                            "private": False, "gated": "auto" if repo.gated else False}
                else:
                    body = [{"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                            for p, b in repo.files.items()]
                return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, send_body)
            if len(parts) >= 5 and parts[2] == "resolve":  # org/name/resolve/rev/path
                repo_id, revision, path = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                repo = self._repo(repo_id, revision)
                if repo is None:
                    return
                if path not in repo.files:
                    return self._error(404, "EntryNotFound")
                data = repo.files[path]
                if send_body:
                    hub.downloads[(repo_id, path)] += 1
                headers = {"X-Repo-Commit": repo.sha, "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                           "Content-Type": "application/octet-stream"}
                return self._send(200, data, headers, send_body)
            self._error(404, "RepoNotFound")

        def _repo(self, repo_id: str, revision: str) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(401, "RepoNotFound")
            elif repo.gated and self.headers.get("Authorization") != f"Bearer {TOKEN}":
                self._error(401, "GatedRepo")
            elif revision not in ("main", repo.sha):
                self._error(404, "RevisionNotFound")
            else:
                return repo
            return None

        def _error(self, status: int, code: str) -> None:
            self._send(status, json.dumps({"error": code}).encode(), {"X-Error-Code": code,
                                                                       "Content-Type": "application/json"}, True)

        def _send(self, status: int, body: bytes, headers: dict, send_body: bool) -> None:
            self.send_response(status)
            for name, value in {**headers, "Content-Length": str(len(body))}.items():
                self.send_header(name, value)
            self.end_headers()
            if send_body:
                self.wfile.write(body)

    return Handler
