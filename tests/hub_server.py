"""A local HTTP server that answers the part of the Hugging Face Hub API SpecDeck uses.

The machines the tests run on cannot reach huggingface.co, so the tests start this server on a
free port and give its address to ``huggingface_hub`` as the endpoint. It answers with the same
URLs, JSON fields and headers as the Hub (search, a repository's file tree, ``/resolve/`` with
HEAD metadata, ETags and byte ranges), serving real files from disk, so the real download code
runs end to end over real HTTP. Knobs let a test slow a transfer down, cut a connection, or
serve bytes that do not match the advertised checksum.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_THRESHOLD = 10 * 1024  # the Hub stores bigger files in LFS and gives their sha256


@dataclass
class HubRepo:
    id: str
    files: dict[str, bytes | Path]
    downloads: int = 0
    tags: tuple[str, ...] = ("gguf",)
    gated: bool = False

    def size(self, path: str) -> int:
        data = self.files[path]
        return data.stat().st_size if isinstance(data, Path) else len(data)

    def read(self, path: str, start: int, length: int) -> bytes:
        data = self.files[path]
        if isinstance(data, Path):
            with data.open("rb") as f:
                f.seek(start)
                return f.read(length)
        return data[start:start + length]


@dataclass
class HubServer:
    repos: dict[str, HubRepo] = field(default_factory=dict)
    rate: float | None = None  # bytes per second for file bodies; None = as fast as possible
    cut_after: int | None = None  # close the next file body after this many bytes, once
    corrupt: set[str] = field(default_factory=set)  # "repo/path" served with one flipped byte
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, path, Range
    _sha: dict[tuple[str, str], str] = field(default_factory=dict)

    def add(self, repo: HubRepo) -> None:
        self.repos[repo.id] = repo

    def sha256(self, repo: HubRepo, path: str) -> str:
        key = (repo.id, path)
        if key not in self._sha:
            digest = hashlib.sha256()
            for start in range(0, repo.size(path), 8 << 20):
                digest.update(repo.read(path, start, 8 << 20))
            self._sha[key] = digest.hexdigest()
        return self._sha[key]

    def start(self) -> str:
        """Serve on a free port in a daemon thread; returns the endpoint URL."""
        handler = type("Handler", (_Handler,), {"hub": self})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        return None

    def do_GET(self) -> None:
        self._route(head=False)

    def do_HEAD(self) -> None:
        self._route(head=True)

    def _route(self, head: bool) -> None:
        url = urlparse(self.path)
        self.hub.requests.append((self.command, url.path, self.headers.get("Range")))
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        if parts[:2] == ["api", "models"] and len(parts) == 2:
            return self._search(parse_qs(url.query))
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "tree":
            return self._tree("/".join(parts[2:4]))
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve("/".join(parts[:2]), "/".join(parts[4:]), head)
        self._error(404, "NotFound", "no such route")

    def _search(self, query: dict[str, list[str]]) -> None:
        text = query.get("search", [""])[0].lower()
        wanted = query.get("filter", [])
        found = [r for r in self.hub.repos.values()
                 if text in r.id.lower() and all(tag in r.tags for tag in wanted)]
        found.sort(key=lambda r: -r.downloads)
        limit = int(query.get("limit", ["1000"])[0])
        self._json([{"_id": r.id, "id": r.id, "modelId": r.id, "downloads": r.downloads, "likes": 0,
                     "tags": list(r.tags), "private": False} for r in found[:limit]])

    def _tree(self, repo_id: str) -> None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        entries = []
        for path in sorted(repo.files):
            size = repo.size(path)
            entry = {"type": "file", "oid": hashlib.sha1(path.encode()).hexdigest(), "size": size, "path": path}
            if size > LFS_THRESHOLD:
                entry["lfs"] = {"oid": self.hub.sha256(repo, path), "size": size, "pointerSize": 134}
            entries.append(entry)
        self._json(entries)

    def _resolve(self, repo_id: str, path: str, head: bool) -> None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        if repo.gated:
            return self._error(403, "GatedRepo", "Access to this model is restricted")
        if path not in repo.files:
            return self._error(404, "EntryNotFound", "Entry not found")
        size = repo.size(path)
        lfs = size > LFS_THRESHOLD
        etag = self.hub.sha256(repo, path) if lfs else hashlib.sha1(path.encode()).hexdigest()
        start = self._range_start()
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{etag}"')
        if lfs:
            self.send_header("X-Linked-Etag", f'"{etag}"')
            self.send_header("X-Linked-Size", str(size))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(size - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        self.end_headers()
        if not head:
            self._body(repo, path, start, size)

    def _range_start(self) -> int:
        value = self.headers.get("Range")
        if not value or not value.startswith("bytes="):
            return 0
        return int(value[len("bytes="):].split("-")[0] or 0)

    def _body(self, repo: HubRepo, path: str, start: int, size: int) -> None:
        hub, sent, chunk = self.hub, 0, 256 * 1024
        began = time.monotonic()
        for offset in range(start, size, chunk):
            data = repo.read(path, offset, chunk)
            if f"{repo.id}/{path}" in hub.corrupt and offset <= size // 2 < offset + len(data):
                i = size // 2 - offset
                data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]
            if hub.cut_after is not None and sent + len(data) > hub.cut_after:
                cut, hub.cut_after = hub.cut_after, None
                self.wfile.write(data[: max(0, cut - sent)])
                self.close_connection = True
                return
            try:
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                return  # the client cancelled
            sent += len(data)
            if hub.rate:
                time.sleep(max(0.0, sent / hub.rate - (time.monotonic() - began)))

    def _json(self, value: object) -> None:
        body = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
