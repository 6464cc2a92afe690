"""A local stand-in for the parts of the Hugging Face hub that ``huggingface_hub``
calls to pull a GGUF: the repository's file list with each file's size and LFS
sha256 (``GET /api/models/ORG/REPO[/revision/REV]?blobs=True``) and the files
(``HEAD``/``GET /ORG/REPO/resolve/REV/PATH`` with ``ETag``, ``X-Linked-Etag``,
``X-Linked-Size``, ``X-Repo-Commit`` and ``Range``). It counts the bytes it
sends per file, can lie about a file's content (``corrupt``) and can send
slowly (``rate``: bytes a second) so that a pull can be killed half-way.
Tests point ``HF_ENDPOINT`` at it; nothing reaches the real hub."""

from __future__ import annotations

import asyncio
import hashlib
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from aiohttp import web

COMMIT = "0123456789abcdef0123456789abcdef01234567"
CHUNK = 1 << 20


@dataclass
class HubFile:
    source: Path
    sha256: str = ""
    corrupt: bool = False  # serve the file with its first byte changed (the listed sha256 stays)

    def __post_init__(self):
        if not self.sha256:
            h = hashlib.sha256()
            with open(self.source, "rb") as f:
                while block := f.read(CHUNK):
                    h.update(block)
            self.sha256 = h.hexdigest()

    @property
    def size(self) -> int:
        return self.source.stat().st_size


@dataclass
class FakeHub:
    repos: dict[str, dict[str, HubFile]] = field(default_factory=dict)  # "org/name" -> path in repo -> file
    sent: dict[str, int] = field(default_factory=dict)  # "org/name/path" -> bytes sent
    rate: Optional[int] = None  # bytes a second per response (None: as fast as it goes)
    requests: list[str] = field(default_factory=list)
    url: str = ""
    _runner: Optional[web.AppRunner] = None
    _loop: Optional[asyncio.AbstractEventLoop] = None
    _thread: Optional[threading.Thread] = None

    def add(self, repo: str, files: dict[str, Path]) -> None:
        self.repos.setdefault(repo, {}).update({p: HubFile(src) for p, src in files.items()})

    # ------------------------------------------------------------------ routes

    async def _info(self, request: web.Request) -> web.Response:
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        rev = request.match_info.get("rev")
        self.requests.append(f"info {repo}" + (f"@{rev}" if rev else ""))
        files = self.repos.get(repo)
        if files is None:
            return web.json_response(
                {"error": "Repository not found"}, status=404, headers={"X-Error-Code": "RepoNotFound"}
            )
        siblings = [
            {
                "rfilename": path,
                "size": f.size,
                "blobId": hashlib.sha1(path.encode()).hexdigest(),
                "lfs": {"size": f.size, "sha256": f.sha256, "pointerSize": 134},
            }
            for path, f in sorted(files.items())
        ]
        siblings.append({"rfilename": "README.md", "size": 10, "blobId": "0" * 40})
        return web.json_response({"id": repo, "modelId": repo, "sha": COMMIT, "private": False, "siblings": siblings})

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        path = request.match_info["path"]
        self.requests.append(f"{request.method} {repo}/{path} {request.headers.get('Range', '')}".strip())
        f = self.repos.get(repo, {}).get(path)
        if f is None:
            code = "RepoNotFound" if repo not in self.repos else "EntryNotFound"
            return web.Response(status=404, headers={"X-Error-Code": code}, text=code)
        size, start = f.size, 0
        rng = request.headers.get("Range", "")
        if rng.startswith("bytes="):
            start = int(rng[6:].split("-")[0])
        headers = {
            "ETag": f'"{f.sha256}"',
            "X-Linked-Etag": f'"{f.sha256}"',
            "X-Linked-Size": str(size),
            "X-Repo-Commit": COMMIT,
            "Accept-Ranges": "bytes",
            "Content-Length": str(size - start),
        }
        status = 200
        if start:
            status = 206
            headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
        response = web.StreamResponse(status=status, headers=headers)
        await response.prepare(request)
        if request.method == "HEAD":
            return response
        key = f"{repo}/{path}"
        with open(f.source, "rb") as src:
            src.seek(start)
            at = start
            step = CHUNK if self.rate is None else max(self.rate // 10, 1)
            while block := src.read(step):
                if f.corrupt and at == 0:
                    block = bytes([block[0] ^ 0xFF]) + block[1:]
                await response.write(block)
                self.sent[key] = self.sent.get(key, 0) + len(block)
                at += len(block)
                if self.rate is not None:
                    await asyncio.sleep(len(block) / self.rate)
        await response.write_eof()
        return response

    # ------------------------------------------------------------------ running

    def start(self) -> "FakeHub":
        app = web.Application()
        app.router.add_get("/api/models/{org}/{name}", self._info)
        app.router.add_get("/api/models/{org}/{name}/revision/{rev}", self._info)
        app.router.add_get("/{org}/{name}/resolve/{rev}/{path:.+}", self._resolve)  # (and HEAD)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        ready = threading.Event()

        def serve() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            self._runner = web.AppRunner(app)
            loop.run_until_complete(self._runner.setup())
            loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", port).start())
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop = None
