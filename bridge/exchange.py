"""One HTTP request being answered (Exchange): what the dialect modules read (the
body, within the size limit and the idle timeout) and write (a whole JSON answer,
a stream), and their daemon connection, whose request is cancelled when the HTTP
client goes away. The server (server.py) makes one per request; routes.py hands it
to a dialect. It knows the server only as ``Served``, so nothing here imports the
server or a dialect."""

from __future__ import annotations

import asyncio
import contextlib
import json
from http import HTTPStatus
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Protocol

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from tandem.client.aio import AsyncClient, AsyncStream
from tandem.client.errors import TandemError
from tandem.protocol import MAX_MESSAGE_BYTES

from .answers import ApiError, json_bytes

LOAD_WAIT = 600.0  # seconds a request waits for a model that is loading
LOAD_POLL = 0.25
HEADERS_AFTER = 2.0  # seconds a stream waits for its first chunk before it starts without it
KEEPALIVE_EVERY = 10.0  # then a keep-alive this often until the first chunk
SSE_COMMENT = b": keep-alive\n\n"  # (a comment: every SSE client skips it)
_WAITING = object()  # what _kept_alive yields while a chunk is awaited


def _retrieved(future: asyncio.Future) -> None:
    """A done callback that reads a cancelled future's outcome (nothing left unretrieved)."""
    if not future.cancelled():
        future.exception()


class Served(Protocol):
    """What an Exchange reads of the server that made it."""

    socket_path: Path
    model: str
    idle_timeout: float
    api_key: Optional[str]
    sampling: dict


Start = Callable[[AsyncClient], Awaitable[AsyncStream]]


class ClientGone(Exception):
    """The HTTP client closed its connection, or stopped reading for the idle timeout."""


def dialect_of(path: str) -> str:
    if path.startswith("/api/"):
        return "ollama"
    return "anthropic" if path.startswith("/v1/messages") else "openai"


class Exchange:
    """One HTTP request being answered: what the dialect modules read and write."""

    def __init__(self, server: Served, request: web.BaseRequest):
        self.server = server
        self.request = request
        self.method = request.method
        self.path = request.path.rstrip("/")
        self.dialect = dialect_of(self.path)
        self.response: Optional[web.StreamResponse] = None
        self.request_id = ""  # the daemon request's, once started
        self.done = None  # its Done, once it ends
        self._client: Optional[AsyncClient] = None
        self._last_write = 0.0  # (the event loop's clock) when the stream last wrote

    # ------------------------------------------------------------------ reading

    async def body(self) -> dict:
        request = self.request
        ctype = request.content_type.lower()
        # Ollama's API takes any type (its docs post with `curl -d`, a form type): the Origin check keeps
        # web pages out there; the other routes also refuse what a page can post without a preflight
        if ctype != "application/json" and self.dialect != "ollama":
            sent = request.headers.get("Content-Type") or "none"
            raise ApiError(
                HTTPStatus.UNSUPPORTED_MEDIA_TYPE, f"send the body as Content-Type: application/json (got {sent!r})"
            )
        if "Content-Length" not in request.headers and "Transfer-Encoding" not in request.headers:
            raise ApiError(HTTPStatus.LENGTH_REQUIRED, "a Content-Length header is required (or a chunked body)")
        length = request.content_length
        if length is not None and length > MAX_MESSAGE_BYTES:
            raise ApiError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the body is {length:,} bytes; the limit is {MAX_MESSAGE_BYTES:,}"
            )
        if request.headers.get("Expect", "").lower() == "100-continue" and request.version >= (1, 1):
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # (curl asks before a large body)
            request.writer.output_size = 0
        raw = await self._read(request)
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # RecursionError: arrays or objects nested too deep
            raise ApiError(HTTPStatus.BAD_REQUEST, f"the body is not valid JSON: {exc or 'nested too deep'}") from None
        if not isinstance(body, dict):
            raise ApiError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
        return body

    async def _read(self, request: web.BaseRequest) -> bytes:
        """The body, each read within the idle timeout (a slow body is fine, a stalled one is not)."""
        parts, size = [], 0
        try:
            while True:
                async with asyncio.timeout(self.server.idle_timeout):
                    part = await request.content.readany()
                if not part:
                    return b"".join(parts)
                size += len(part)
                if size > MAX_MESSAGE_BYTES:  # a chunked body past the limit
                    raise ApiError(
                        HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                        f"the body is over the limit of {MAX_MESSAGE_BYTES:,} bytes",
                    )
                parts.append(part)
        except TimeoutError:
            raise ClientGone() from None  # a body that stalls is a client that left
        except (web.RequestPayloadError, HttpProcessingError) as exc:  # bad chunking, a Content-Encoding that lies
            request.content.feed_eof()  # nothing more is read from it (aiohttp would read on, and fail again)
            request.protocol.close()  # (after this answer: the rest of the connection cannot be trusted)
            raise ApiError(HTTPStatus.BAD_REQUEST, f"the body cannot be read: {exc}") from None

    # ------------------------------------------------------------------ the daemon

    @contextlib.asynccontextmanager
    async def daemon(self) -> AsyncIterator[AsyncClient]:
        """The request's connection to the daemon (one per HTTP request, made on
        first use; closed by close()); its errors as ApiError."""
        try:
            if self._client is None:
                self._client = AsyncClient(self.server.socket_path, timeout=None)
            hello = await self._client.connect()
            self.server.model = hello.model
            yield self._client
        except TandemError as exc:
            raise ApiError.of(exc) from None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    async def hello(self, wait: bool = True):
        """The daemon's hello, once its model is loaded: a request that comes while
        it loads (or restarts its worker) waits for it, as Ollama's do, up to
        ``LOAD_WAIT`` seconds; a daemon whose model failed is a 503 that says why.
        Without ``wait``, the hello as it is (a context size of 0 while it loads)."""
        async with self.daemon() as client:
            if client.server.n_ctx or not wait:
                return client.server
            loop = asyncio.get_running_loop()
            deadline = loop.time() + LOAD_WAIT
            while (st := await client.status()).state == "loading" and loop.time() < deadline:
                await asyncio.sleep(LOAD_POLL)
        if st.state != "ready":
            why = (
                f"the model did not load: {st.failure}"
                if st.state == "failed"
                else f"the model is still loading after {LOAD_WAIT:.0f} s; retry later (tandem status shows it)"
                if st.state == "loading"
                else "the daemon is stopping; retry when it is back"
            )
            raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, why)
        self.close()  # (a new hello: the one of the connection made while it loaded has no context size)
        self._client = None
        async with self.daemon() as client:
            return client.server

    async def status(self):
        async with self.daemon() as client:
            return await client.status()

    @contextlib.asynccontextmanager
    async def daemon_request(self, start: Start) -> AsyncIterator[AsyncIterator]:
        """One daemon request: ``start(client)`` starts it; yields its chunks (the
        stream's ``done`` once they end: ``self.done``). If the HTTP client leaves
        (or stops reading), the daemon request is cancelled."""
        async with self.daemon() as client:
            stream = await start(client)
            self.request_id = stream.request_id
            try:
                yield self._chunks(stream)
            except (asyncio.CancelledError, ClientGone, ConnectionError):
                if not stream.finished:  # the HTTP client left: so does its daemon request
                    with contextlib.suppress(TandemError, asyncio.TimeoutError):
                        await asyncio.shield(asyncio.wait_for(client.cancel(stream.request_id), 5.0))
                raise
            finally:
                stream.close()

    async def _chunks(self, stream: AsyncStream) -> AsyncIterator:
        while True:
            try:
                chunk = await stream.__anext__()
            except StopAsyncIteration:
                self.done = stream.done
                return
            except TandemError as exc:
                raise ApiError.of(exc) from None
            yield chunk

    async def run_to_done(self, start: Start):
        """One daemon request, waited for."""
        async with self.daemon_request(start) as chunks:
            async for _ in chunks:
                pass
        return self.done

    async def relay(
        self,
        start: Start,
        content_type: str,
        opening: Callable[[], list[bytes]],
        each: Callable[[Any], list[bytes]],
        closing: Callable[[Any], list[bytes]],
        failing: Callable[[ApiError], list[bytes]],
        keepalive: Callable[[], list[bytes]] = lambda: [SSE_COMMENT],
    ) -> None:
        """One daemon request streamed: the response starts with ``opening()`` at
        the first chunk, or once the request has waited ``HEADERS_AFTER`` seconds
        for it (a long prompt being read, a request queued), whichever is first;
        then ``keepalive()`` whenever ``KEEPALIVE_EVERY`` seconds pass without a write,
        so that an agent that gives up on a silent server (Qwen Code after 120 s
        without headers, Claude Code and Codex after 300 s without a byte) waits
        for a prompt of any length, and a client that left is noticed at the next
        write. Each chunk is written as ``each(chunk)``, the end as
        ``closing(done)``; an error before the start is a plain HTTP error, after
        it ``failing(error)``."""
        async with self.daemon_request(start) as chunks:
            started = False
            try:
                async with contextlib.aclosing(self._kept_alive(chunks)) as kept:
                    async for chunk in kept:
                        await self._relay_one(chunk, started, content_type, opening, each, keepalive)
                        started = True
            except ApiError as exc:
                if not started:
                    raise
                await self.write(*failing(exc))
                await self.end_stream()
                return
            if not started:
                await self.start_stream(content_type, opening())
            await self.write(*closing(self.done))
            await self.end_stream()

    async def _relay_one(self, chunk, started: bool, content_type: str, opening, each, keepalive) -> None:
        if not started:
            await self.start_stream(content_type, opening())
        pieces = keepalive() if chunk is _WAITING else each(chunk)
        if not pieces and asyncio.get_running_loop().time() - self._last_write >= KEEPALIVE_EVERY:
            pieces = keepalive()  # (chunks that write nothing: text held back, a long tool call being written)
        await self.write(*pieces)

    @staticmethod
    async def _kept_alive(chunks: AsyncIterator) -> AsyncIterator:
        """``chunks``, with ``_WAITING`` after ``HEADERS_AFTER`` seconds without the first
        and every ``KEEPALIVE_EVERY`` seconds without the next."""
        it = chunks.__aiter__()
        wait = HEADERS_AFTER
        while True:
            pending = asyncio.ensure_future(it.__anext__())
            try:
                while not (await asyncio.wait({pending}, timeout=wait))[0]:
                    yield _WAITING
                    wait = KEEPALIVE_EVERY
                try:
                    chunk = pending.result()
                except StopAsyncIteration:
                    return
            finally:
                if not pending.done():  # (the client left, or the bridge stops)
                    pending.add_done_callback(_retrieved)
                    pending.cancel()
                elif not pending.cancelled():
                    pending.exception()  # (retrieved: an error it ended with is raised above, or moot)
            wait = KEEPALIVE_EVERY
            yield chunk

    # ------------------------------------------------------------------ writing

    def send_json(self, status: int, body: Any, headers: Optional[dict] = None) -> None:
        headers = {"Server": "tandem", **(headers or {})}
        if status in (HTTPStatus.TOO_MANY_REQUESTS, HTTPStatus.SERVICE_UNAVAILABLE):
            headers["Retry-After"] = "1"
        self.response = web.Response(
            status=int(status), body=json_bytes(body), content_type="application/json", headers=headers
        )

    async def start_stream(self, content_type: str, first: list[bytes] = ()) -> None:
        headers = {"Content-Type": content_type, "Cache-Control": "no-cache", "Server": "tandem"}
        resp = web.StreamResponse(status=200, headers=headers)
        resp.enable_chunked_encoding()
        self.response = resp
        async with self.in_time():
            await resp.prepare(self.request)
        await self.write(*first)

    async def write(self, *pieces: bytes) -> None:
        if pieces:
            async with self.in_time():
                await self.response.write(b"".join(pieces))
            self._last_write = asyncio.get_running_loop().time()

    async def end_stream(self) -> None:
        async with self.in_time():
            await self.response.write_eof()

    @contextlib.asynccontextmanager
    async def in_time(self):
        """A client that stops reading blocks our writes: past the idle timeout, it has left."""
        try:
            async with asyncio.timeout(self.server.idle_timeout):
                yield
        except TimeoutError:
            raise ClientGone() from None
