"""``tandem http``: the HTTP bridge: OpenAI's, Ollama's and Anthropic's APIs on one loopback port.

Every HTTP request becomes one daemon request on its own connection, so the
daemon's queue, drafter, governor and prefix cache serve it; an HTTP client
that goes away cancels its daemon request. The dialects translate
(openai_bridge.py, ollama_api.py, anthropic_api.py; routes.py picks one, exchange.py is
what they read and write); this module is the HTTP
side, on aiohttp's low-level server: its parser (llhttp), keep-alive and
idle timeouts, chunked bodies both ways, graceful shutdown, and a handler task
that is cancelled the moment its connection is lost.

What it guarantees, each checked before a request is parsed or answered:
loopback only (parse_listen); the connecting socket's owner is the user who
runs the bridge (tcp_owner); at most --max-connections at once; a Host header
that is loopback (no DNS rebinding); no web page's Origin; the API key where
one is required; bodies of at most MAX_MESSAGE_BYTES, read within the idle
timeout; and a stream that its client stops reading is dropped after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from http import HTTPStatus
from pathlib import Path
from typing import Optional

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from .answers import ApiError, json_bytes
from .exchange import ClientGone, Exchange, dialect_of
from .routes import route

DEFAULT_LISTEN = "127.0.0.1:8642"
DEFAULT_IDLE_TIMEOUT = 60.0  # seconds a connection may stay silent (or stall a read or write) before it is closed
DEFAULT_MAX_CONNECTIONS = 64
SHUTDOWN_SECONDS = 2.0  # how long a stopping bridge lets running requests finish before it cancels them
MAX_HEADER_BYTES = 65536  # a request line or header longer than this is refused (the standard library's limit)
TOO_MANY = "the bridge has as many connections open as it serves (--max-connections); retry"


def _raw_answer(status: int, message: str, code: str) -> bytes:
    """A whole HTTP answer, for a connection refused before aiohttp sees it."""
    body = json_bytes(ApiError(status, message, code=code).body())
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\nConnection: close\r\n"
        f"Server: tandem\r\nRetry-After: 1\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class _Refused(asyncio.Protocol):
    """A refused connection: one answer, then what the client sends is read and
    dropped until it closes (or 1 s): closing with its request unread would make
    the kernel send a reset, which can reach the client before the answer."""

    def __init__(self, transport: asyncio.Transport, answer: bytes):
        transport.write(answer)
        if transport.can_write_eof():
            transport.write_eof()
        self._timer = asyncio.get_running_loop().call_later(1.0, transport.close)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        self._timer.cancel()
        return False  # close

    def connection_lost(self, exc) -> None:
        self._timer.cancel()


class _Gate(asyncio.Protocol):
    """Every accepted connection's first protocol: another user's connection,
    or one beyond --max-connections, gets one answer and no parser; the others
    are handed to aiohttp's request handler. Who owns the connecting socket is
    looked up in a thread (it reads /proc/net/tcp, which can be long), with the
    connection's reading paused meanwhile."""

    def __init__(self, bridge: "BridgeServer"):
        self.bridge = bridge

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        bridge = self.bridge
        if len(bridge.manager.connections) + bridge.admitting >= bridge.max_connections:
            transport.set_protocol(_Refused(transport, _raw_answer(503, TOO_MANY, "too_many_connections")))
            return
        transport.pause_reading()
        bridge.admitting += 1
        task = asyncio.get_running_loop().create_task(self._admit(transport))
        bridge.tasks.add(task)
        task.add_done_callback(bridge.tasks.discard)

    async def _admit(self, transport: asyncio.Transport) -> None:
        from tandem.daemon.front.tcp_owner import refusal

        bridge = self.bridge
        peer, local = transport.get_extra_info("peername"), transport.get_extra_info("sockname")
        try:
            try:
                why = await asyncio.to_thread(refusal, peer, local)
            except Exception as exc:  # noqa: BLE001 - whatever it was, this connection's owner is not known
                why = f"this listener serves only the user who runs it, and cannot tell who connects: {exc}"
        except BaseException:  # the bridge is stopping: this connection is not served
            transport.abort()
            raise
        finally:
            bridge.admitting -= 1
        if why is not None:
            transport.set_protocol(_Refused(transport, _raw_answer(403, why, "another_user")))
        elif bridge.stopping_now:
            message = "the bridge is stopping; retry when it is back"
            transport.set_protocol(_Refused(transport, _raw_answer(503, message, "shutting_down")))
        else:
            handler = _Handler(
                bridge.manager,
                loop=asyncio.get_running_loop(),
                keepalive_timeout=bridge.idle_timeout,  # also a new connection that sends nothing
                access_log=None,
                lingering_time=1.0,  # a body refused unread is read and dropped this long, then the connection closes
                max_line_size=MAX_HEADER_BYTES,
                max_field_size=MAX_HEADER_BYTES,
            )
            handler.bridge = bridge  # (for --verbose)
            transport.set_protocol(handler)
            handler.connection_made(transport)
        transport.resume_reading()

    def data_received(self, data: bytes) -> None:  # (reading is paused until the handover)
        pass


class _Handler(RequestHandler):
    """aiohttp's, with HTTP that does not parse answered in OpenAI's error shape (not text),
    and a body whose chunks stop parsing failing its reader (not leaving it waiting)."""

    def data_received(self, data: bytes) -> None:
        request, queued = self._current_request, len(self._messages)
        super().data_received(data)
        # A chunk header that does not parse, arriving after the request's headers, is queued as a parse
        # error for the *next* message, and the body being read never hears of it: it would wait for the
        # idle timeout and close unanswered. Fail its reader instead: the request gets its 400.
        if request is not None and len(self._messages) > queued:
            err = self._messages[-1][0]
            if not hasattr(err, "method") and getattr(err, "status", None) == 400:  # (aiohttp's _ErrInfo)
                request.content.set_exception(web.RequestPayloadError(f"bad chunk: {getattr(err, 'message', err)}"))

    def handle_error(self, request, status: int = 500, exc=None, message=None) -> web.StreamResponse:
        if status >= 500:  # a bug of ours: worth a traceback (even when the answer cannot say so)
            self.log_exception("tandem http: error handling a request", exc_info=exc)
        if request.writer.output_size > 0:  # an answer has started: another cannot follow it
            raise ConnectionError("the answer had started; the connection is closed instead")
        text = message or (str(exc) if exc else HTTPStatus(status).phrase)
        if status < 500:
            text = f"the request is not valid HTTP: {text.splitlines()[0] if text else status}"
        try:
            path = request.path
        except Exception:  # noqa: BLE001 - a request line that did not parse
            path = ""
        error = ApiError(status, text)
        resp = web.Response(
            status=status, body=json_bytes(error.body(dialect_of(path))), content_type="application/json"
        )
        resp.headers["Server"] = "tandem"
        resp.force_close()  # (what follows on the connection cannot be trusted to parse)
        bridge = getattr(self, "bridge", None)
        if bridge is not None and bridge.verbose:
            sys.stderr.write(f"tandem http: {request.remote} {status} {text}\n")
        return resp


class BridgeServer:
    """The listening socket is bound at construction (so an address in use is
    reported before anything starts); ``serve_forever`` runs the server until
    ``stop()`` (or SIGINT/SIGTERM, where it installs handlers)."""

    def __init__(
        self,
        address: tuple[str, int],
        socket_path: Path,
        model: str,
        verbose: bool = False,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        api_key: Optional[str] = None,
        sampling: Optional[dict] = None,
    ):
        """``address``: from parse_listen (loopback). ``api_key``: required of every request (None: not).
        ``sampling``: temperature, top_k, top_p for the requests that do not set them (see routes)."""
        self.socket_path = socket_path
        self.model = model  # the daemon's model when the bridge started (refreshed by each hello)
        self.verbose = verbose  # log every HTTP request
        self.idle_timeout = idle_timeout  # a connection silent this long (or this slow to read or write) is closed
        self.max_connections = max_connections
        self.api_key = api_key  # every request must carry it (None: not required; see api_key.py)
        self.sampling = dict(sampling or {})  # field -> value, for a request that sends no value of its own
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.socket.bind(address)
            self.socket.listen(128)
        except OSError:
            self.socket.close()
            raise
        self.socket.setblocking(False)
        self.server_address = self.socket.getsockname()
        self.manager: web.Server  # made in serve_forever, on its event loop
        self.tasks: set[asyncio.Task] = set()  # the connection checks and the requests being answered
        self.admitting = 0  # connections whose owner is being looked up (they count against max_connections)
        self._stopping: Optional[asyncio.Event] = None  # set by stop() or a signal
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    @property
    def stopping_now(self) -> bool:
        """The bridge is stopping: new connections are refused, answers close their connection."""
        return self._stopping is not None and self._stopping.is_set()

    def serve_forever(self) -> None:
        asyncio.run(self._serve())

    def stop(self) -> None:
        """From any thread: stop serving (running requests get SHUTDOWN_SECONDS, then are cancelled)."""
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)

    def server_close(self) -> None:
        self.socket.close()

    async def _serve(self) -> None:
        import signal

        loop = asyncio.get_running_loop()
        self._loop = loop
        self._stopping = asyncio.Event()
        self.manager = web.Server(self._handle, handler_cancellation=True)  # (bodies: Exchange._read, limited)
        listener = await loop.create_server(lambda: _Gate(self), sock=self.socket)
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):  # not the main thread
                loop.add_signal_handler(sig, self._stopping.set)
        try:
            await self._stopping.wait()
        finally:
            await self._shut_down(listener)

    async def _shut_down(self, listener: asyncio.AbstractServer) -> None:
        """No new connections; idle ones closed at once; running requests get
        SHUTDOWN_SECONDS to finish, then are cancelled (each cancels its daemon
        request, and is waited for)."""
        listener.close()
        running = {t for t in self.tasks if not t.done()}
        self.manager.pre_shutdown()  # (idle connections: their handlers end, and shutdown closes them now)
        closing = asyncio.ensure_future(self.manager.shutdown(SHUTDOWN_SECONDS))
        if running:
            _, late = await asyncio.wait(running, timeout=SHUTDOWN_SECONDS)
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=10)
        await asyncio.wait([closing], timeout=2 * SHUTDOWN_SECONDS)

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        task = asyncio.current_task()
        if task is not None:
            self.tasks.add(task)
        ex = Exchange(self, request)
        outcome = ""
        try:
            try:
                self._check_origin(request)
                self._check_key(request)
                await route(ex)
            except ApiError as exc:
                if ex.response is not None and ex.response.prepared:
                    raise ConnectionError("an error after the answer started") from exc  # (relay answers its own)
                ex.send_json(exc.status, exc.body(ex.dialect), headers=exc.headers)
            except (OverflowError, RecursionError) as exc:  # a number msgpack cannot carry, JSON nested too deep
                error = ApiError(HTTPStatus.BAD_REQUEST, f"the request has a value tandem cannot take: {exc}")
                ex.send_json(error.status, error.body(ex.dialect))
            assert ex.response is not None, f"{request.method} {request.path}: no answer"
            if not ex.response.prepared:  # a whole answer: written here, within the idle timeout
                if self.stopping_now:
                    ex.response.force_close()  # (keep-alive clients reconnect, and are told the bridge stops)
                async with ex.in_time():
                    await ex.response.prepare(request)
                    await ex.response.write_eof()
            outcome = str(ex.response.status)
            return ex.response
        except (ClientGone, ConnectionError):
            outcome = "client gone"
            if request.transport is not None:
                request.transport.close()
            raise asyncio.CancelledError() from None  # nothing more to answer, to no one
        except asyncio.CancelledError:
            outcome = "client gone" if request.transport is None or request.transport.is_closing() else "cancelled"
            raise
        except Exception:
            outcome = "500 (a bug: its traceback follows)"
            raise
        finally:
            ex.close()
            if task is not None:
                self.tasks.discard(task)
            if self.verbose:
                sys.stderr.write(
                    f"tandem http: {request.remote} {request.method} {request.path_qs} {outcome}{_usage(ex.done)}\n"
                )

    def _check_origin(self, request: web.BaseRequest) -> None:
        from tandem.daemon.config import is_loopback_host

        host = (request.headers.get("Host") or "").strip().lower()
        if not is_loopback_host(host):
            raise ApiError(
                HTTPStatus.FORBIDDEN, f"Host {host!r} is not loopback: the bridge answers only clients on this machine"
            )
        origin = (request.headers.get("Origin") or "").strip().lower()
        scheme, _, rest = origin.partition("://")
        foreign = origin and (scheme not in ("http", "https") or not is_loopback_host(rest.split("/", 1)[0]))
        # a web page's request: browsers send Origin ("null" from sandboxed frames, data: pages and
        # redirects) and Sec-Fetch-Site; Ollama refuses foreign origins too (OLLAMA_ORIGINS)
        if foreign or (request.headers.get("Sec-Fetch-Site") or "").lower() == "cross-site":
            raise ApiError(
                HTTPStatus.FORBIDDEN,
                f"Origin {origin or '(cross-site)'!r} is not this machine: web pages may not use the bridge",
            )

    def _check_key(self, request: web.BaseRequest) -> None:
        from .api_key import matches, presented

        if request.method in ("GET", "HEAD") and request.path.rstrip("/") in ("", "/health"):
            return  # a liveness probe needs no key (and is told nothing else)
        if self.api_key is not None and not matches(presented(request.headers), self.api_key):
            raise ApiError(
                HTTPStatus.UNAUTHORIZED,
                "this bridge requires its API key: send the key that `tandem key` prints as "
                "Authorization: Bearer KEY (an OpenAI client's api_key)",
                code="invalid_api_key",
            )


def _usage(done) -> str:
    """What a generation read and wrote, for --verbose: ", prompt 12,204 tokens (12,160 cached), 31 generated,
    first token after 1.52 s (0.01 s queued), 18.3 tok/s"."""
    if done is None or done.usage is None:
        return ""
    u, t = done.usage, done.timings
    line = f", prompt {u.prompt_tokens:,} tokens ({u.cached_tokens:,} cached), {u.completion_tokens:,} generated"
    if t is not None:
        line += (
            f", first token after {t.time_to_first_token_seconds:.2f} s ({t.queued_seconds:.2f} s queued), "
            f"{t.tokens_per_second:.1f} tok/s"
        )
    return line


def parse_listen(listen: str) -> tuple[str, int]:
    """HOST:PORT (loopback only) -> (host, port). Raises ValueError naming the fix."""
    from tandem.daemon.config import is_loopback

    host, sep, port = listen.rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--listen must be HOST:PORT, e.g. {DEFAULT_LISTEN}; got {listen!r}")
    if not is_loopback(listen):
        raise ValueError(
            f"--listen {listen} is not a loopback address; the bridge serves this machine only "
            f"(use 127.0.0.1:{port}; to reach it from elsewhere, tunnel: ssh -L {port}:127.0.0.1:{port} ...)"
        )
    return host, int(port)


def url_of(server: BridgeServer) -> str:
    host, port = server.server_address[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}/v1"
