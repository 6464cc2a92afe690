"""``tandem openai``: an OpenAI-compatible HTTP API on loopback, translated to the daemon's protocol.

Editor plugins and agents that speak the OpenAI API (``/v1/models``,
``/v1/completions`` with ``suffix`` for fill-in-the-middle,
``/v1/chat/completions``, ``stream: true`` as server-sent events) reach tandem
through this bridge. It is a translator, not a second server: every HTTP
request becomes one daemon request on its own connection, so the daemon's
queue, drafter, governor and prefix cache serve it, and an HTTP client that
goes away cancels its daemon request.

The HTTP side is the standard library's ``ThreadingHTTPServer``: no new
dependency for a few routes and one local user; a thread per connection suits
the blocking ``Client``; and the handler owns the raw socket, which is what
noticing a vanished client needs (a peek that reads end-of-file). It listens
on loopback only, refuses a Host header that is not loopback (a web page
cannot reach it by DNS rebinding) and a body that is not JSON (a web page
cannot post one without a CORS preflight, which it never answers).
"""

from __future__ import annotations

import json
import select
import socket
import sys
import threading
import time
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from tandem.protocol import MAX_MESSAGE_BYTES, MAX_TOKENS_LIMIT, ErrorCode, FinishReason

from .client import Client, Stream
from .core import assistant_message
from .errors import DaemonGone, DaemonNotRunning, DaemonTimeout, InvalidRequest, QueueFull, RequestFailed, TandemError

DEFAULT_LISTEN = "127.0.0.1:8642"
DEFAULT_IDLE_TIMEOUT = 60.0  # seconds a connection may stay silent (or stall a read or write) before it is closed
DEFAULT_MAX_CONNECTIONS = 64
POLL_SECONDS = 0.1  # how often a waiting handler looks whether its HTTP client is still there
OPENAI_COMPLETIONS_MAX_TOKENS = 16  # the API's default for /v1/completions

# The daemon's 1xx codes are the request's fault: 400. The others are ours.
_STATUS_OF_CODE = {
    ErrorCode.NOT_READY: HTTPStatus.SERVICE_UNAVAILABLE,
    ErrorCode.SHUTTING_DOWN: HTTPStatus.SERVICE_UNAVAILABLE,
    ErrorCode.WORKER_DIED: HTTPStatus.SERVICE_UNAVAILABLE,
    ErrorCode.DRAFTER_DIED: HTTPStatus.SERVICE_UNAVAILABLE,
}
_OPENAI_CODE = {  # where the API has a name for it
    ErrorCode.PROMPT_TOO_LONG: "context_length_exceeded",
}


class ApiError(Exception):
    """Answered as OpenAI's error shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        self.code = code

    @property
    def type(self) -> str:
        if self.status == HTTPStatus.TOO_MANY_REQUESTS:
            return "rate_limit_error"
        if self.status >= 500:
            return "server_error"
        if self.status == HTTPStatus.NOT_FOUND:
            return "not_found_error"
        if self.status == HTTPStatus.UNAUTHORIZED:
            return "authentication_error"
        return "invalid_request_error"

    def body(self, dialect: str = "openai") -> dict:
        if dialect == "ollama":
            return {"error": self.message}
        if dialect == "anthropic":
            from .anthropic_api import error_body

            return error_body(self.status, self.message)
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def of(cls, exc: TandemError) -> "ApiError":
        if isinstance(exc, QueueFull):
            return cls(HTTPStatus.TOO_MANY_REQUESTS, f"the daemon's queue is full: {exc}", code="queue_full")
        if isinstance(exc, RequestFailed):
            try:
                code = ErrorCode(exc.code)
            except ValueError:
                code = ErrorCode.INTERNAL
            status = (
                HTTPStatus.BAD_REQUEST if code < 200 else _STATUS_OF_CODE.get(code, HTTPStatus.INTERNAL_SERVER_ERROR)
            )
            return cls(status, exc.message, code=_OPENAI_CODE.get(code, exc.name.lower()))
        if isinstance(exc, InvalidRequest):
            return cls(HTTPStatus.BAD_REQUEST, str(exc))
        if isinstance(exc, DaemonNotRunning):
            return cls(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), code="daemon_not_running")
        if isinstance(exc, DaemonGone):
            return cls(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), code="daemon_gone")
        return cls(HTTPStatus.BAD_GATEWAY, str(exc), code="daemon_error")


# --------------------------------------------------------------------------- request translation


def _get(body: dict, key: str, kinds: tuple, default: Any = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = "/".join(
            {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}[k]
            for k in kinds
        )
        raise ApiError(HTTPStatus.BAD_REQUEST, f"'{key}' must be {names}, got {json.dumps(value)[:80]}", param=key)
    return value


def _refuse(
    body: dict, key: str, why: str, allowed: Callable[[Any], bool] = lambda v: v in (None, False, 0, [], {})
) -> None:
    if key in body and not allowed(body[key]):
        raise ApiError(HTTPStatus.BAD_REQUEST, f"'{key}' is not supported by tandem: {why}", param=key)


def _sampling(body: dict, default_max_tokens: int) -> dict:
    """The parameters /v1/completions and /v1/chat/completions share, as daemon request fields."""
    if _get(body, "n", (int,), 1) != 1:
        raise ApiError(HTTPStatus.BAD_REQUEST, "'n' must be 1: tandem generates one choice per request", param="n")
    _refuse(body, "logprobs", "no log-probabilities are returned")
    _refuse(body, "top_logprobs", "no log-probabilities are returned")
    _refuse(body, "logit_bias", "sampling cannot be biased per token")
    _refuse(body, "presence_penalty", "sampling has no penalties")
    _refuse(body, "frequency_penalty", "sampling has no penalties")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    elif stop is None:
        stop = []
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ApiError(HTTPStatus.BAD_REQUEST, "'stop' must be a string or an array of strings", param="stop")
    max_tokens = _get(body, "max_completion_tokens", (int,)) or _get(body, "max_tokens", (int,), default_max_tokens)
    params = dict(
        max_tokens=max_tokens,
        temperature=float(_get(body, "temperature", (int, float), 1.0)),
        top_p=float(_get(body, "top_p", (int, float), 1.0)),
        seed=_get(body, "seed", (int,)),
        stop=stop,
    )
    # tandem's own knobs, for clients that can add fields (openai: extra_body=...)
    for key, kinds in (
        ("top_k", (int,)),
        ("draft", (str,)),
        ("draft_tokens", (int,)),
        ("cache", (bool,)),
        ("ignore_eos", (bool,)),
    ):
        if body.get(key) is not None:
            params[key] = _get(body, key, kinds)
    if params["top_p"] == 0.0:  # the API allows 0; the daemon's nucleus must hold a token
        params["top_p"] = 1.0
        params["temperature"] = 0.0
    return params


def _chat_messages(body: dict) -> list[dict]:
    messages = _get(body, "messages", (list,))
    if not messages:
        raise ApiError(HTTPStatus.BAD_REQUEST, "'messages' is required: an array of {role, content}", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(
                HTTPStatus.BAD_REQUEST, f"messages[{i}] must be an object with a 'role'", param=f"messages[{i}]"
            )
        role = "system" if m["role"] == "developer" else m["role"]
        if role not in ("system", "user", "assistant", "tool"):
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                f"messages[{i}] has role {m['role']!r}; tandem takes system, developer, user, assistant and tool "
                "(the legacy 'function' role: send tool calls and tool results instead)",
                param=f"messages[{i}].role",
            )
        content = m.get("content")
        if content is None:
            content = ""
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ApiError(
                        HTTPStatus.BAD_REQUEST,
                        f"messages[{i}].content has a part that is not text; tandem's models read text only",
                        param=f"messages[{i}].content",
                    )
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                f"messages[{i}].content must be a string or an array of text parts",
                param=f"messages[{i}].content",
            )
        message: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = _tool_calls(m["tool_calls"], i)
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise ApiError(
                    HTTPStatus.BAD_REQUEST,
                    f"messages[{i}] is a tool result without a 'tool_call_id' (the id of the call it answers)",
                    param=f"messages[{i}].tool_call_id",
                )
            message["tool_call_id"] = m["tool_call_id"]
            if isinstance(m.get("name"), str):
                message["name"] = m["name"]
        out.append(message)
    return out


def _tool_calls(calls: Any, i: int) -> list[dict]:
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{where} must be an array of tool calls", param=where)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(call.get("id"), str)):
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                f'{where}[{j}] must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}',
                param=f"{where}[{j}]",
            )
        arguments = fn.get("arguments", "{}")
        if not isinstance(arguments, str):  # some clients send the object itself
            arguments = json.dumps(arguments, ensure_ascii=False)
        out.append({"id": call["id"], "function": {"name": fn["name"], "arguments": arguments}})
    return out


def _tools(body: dict) -> dict:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` as the daemon takes them."""
    tools = _get(body, "tools", (list,))
    if not tools:
        choice = body.get("tool_choice")
        if choice not in (None, "none", "auto"):
            raise ApiError(HTTPStatus.BAD_REQUEST, "'tool_choice' is given but 'tools' is not", param="tool_choice")
        return {}
    out = []
    for i, tool in enumerate(tools):
        if not (isinstance(tool, dict) and tool.get("type", "function") == "function"):
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                f'tools[{i}] must be {{"type": "function", "function": {{"name", "description", "parameters"}}}}',
                param=f"tools[{i}]",
            )
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ApiError(HTTPStatus.BAD_REQUEST, f"tools[{i}].function must be an object", param=f"tools[{i}]")
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})  # null: absent
    params: dict[str, Any] = {"tools": out}
    if body.get("tool_choice") is not None:
        params["tool_choice"] = body["tool_choice"]
    if body.get("parallel_tool_calls") is not None:
        params["parallel_tool_calls"] = _get(body, "parallel_tool_calls", (bool,))
    return params


@dataclass
class Call:
    """One translated request: what to start on the daemon and how to shape the answer."""

    kind: str  # "text_completion" or "chat.completion"
    start: Callable[[Client], Stream]
    stream: bool
    include_usage: bool


def completions_call(body: dict) -> Call:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError(
            HTTPStatus.BAD_REQUEST,
            "'prompt' must be a string (one prompt; token arrays are not supported)",
            param="prompt",
        )
    _refuse(body, "echo", "the prompt is not echoed back")
    _refuse(body, "best_of", "one choice is generated", allowed=lambda v: v in (None, 1))
    params = _sampling(body, OPENAI_COMPLETIONS_MAX_TOKENS)
    suffix = _get(body, "suffix", (str,))
    if suffix is not None:  # fill in the middle: the daemon's ``complete`` op
        for key, kinds in (("max_lines", (int,)), ("stop_at_blank_line", (bool,))):
            if body.get(key) is not None:
                params[key] = _get(body, key, kinds)
        start = lambda c: c.infill(prompt, suffix, **params)  # noqa: E731
    else:
        start = lambda c: c.generate(prompt=prompt, **params)  # noqa: E731
    return Call("text_completion", start, bool(_get(body, "stream", (bool,), False)), _include_usage(body))


def chat_call(body: dict) -> Call:
    messages = _chat_messages(body)
    _refuse(body, "functions", "the legacy 'functions' are not taken: send them as 'tools'")
    _refuse(body, "function_call", "the legacy 'function_call' is not taken: send 'tool_choice'")
    params = _sampling(body, MAX_TOKENS_LIMIT)  # the API's default: until the model stops or the context is full
    params.update(_tools(body))
    response_format = _response_format(body)
    if response_format is not None:
        params["response_format"] = response_format
    start = lambda c: c.generate(messages=messages, **params)  # noqa: E731
    return Call("chat.completion", start, bool(_get(body, "stream", (bool,), False)), _include_usage(body))


def _response_format(body: dict) -> Optional[dict]:
    """OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``), and
    tandem's own ``regex`` and ``grammar``, as the daemon takes it."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise ApiError(
            HTTPStatus.BAD_REQUEST,
            "'response_format' must be an object with a 'type': text, json_object, json_schema, regex or grammar",
            param="response_format",
        )
    keys = {"type", "json_schema", "pattern", "lark"}
    return {k: v for k, v in rf.items() if k in keys}


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _finish(reason: FinishReason) -> str:
    return {FinishReason.LENGTH: "length", FinishReason.TOOL_CALLS: "tool_calls"}.get(reason, "stop")


def _call_deltas(deltas) -> list[dict]:
    """One entry per call in a chunk, as OpenAI sends them (pieces of the same call merged)."""
    out: list[dict] = []
    for d in deltas:
        if out and out[-1]["index"] == d.index:
            out[-1]["function"]["arguments"] += d.arguments
        else:
            out.append(_call_delta(d))
    return out


def _call_delta(d) -> dict:
    """A streamed tool-call piece, as OpenAI streams it: the first has id, type and name."""
    if d.id is not None:
        return {
            "index": d.index,
            "id": d.id,
            "type": "function",
            "function": {"name": d.name, "arguments": d.arguments},
        }
    return {"index": d.index, "function": {"arguments": d.arguments}}


def _usage(done) -> dict:
    u = done.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


# --------------------------------------------------------------------------- HTTP


def _cancel_quietly(client: Client, request_id: str) -> None:
    """The HTTP client left: so does its daemon request (if the daemon is still there to be told)."""
    try:
        client.cancel(request_id)
    except TandemError:
        pass


class ClientGone(Exception):
    """The HTTP client closed its connection."""


class BridgeServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        address: tuple[str, int],
        socket_path: Path,
        model: str,
        verbose: bool = False,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        api_key: Optional[str] = None,
    ):
        """``address``: from parse_listen (loopback). ``api_key``: required of every request (None: not)."""
        self.socket_path = socket_path
        self.model = model  # the daemon's model when the bridge started (refreshed by /v1/models)
        self.verbose = verbose  # log every HTTP request
        self.idle_timeout = idle_timeout  # a connection silent this long (or this slow to read) is closed
        self.slots = threading.BoundedSemaphore(max_connections)  # one thread per connection, at most this many
        self.api_key = api_key  # every request must carry it (None: not required; see api_key.py)
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, Handler)

    def verify_request(self, request, client_address) -> bool:
        """Only the user who runs the bridge, checked as the connection is accepted (before
        it takes a slot or a thread): a loopback port is open to every user of the
        machine, so the connecting socket's owner is looked up (tcp_owner)."""
        from tandem.daemon.tcp_owner import refusal

        why = refusal(client_address, request.getsockname())
        if why is None:
            return True
        _answer_and_close(request, 403, "Forbidden", why, "invalid_request_error", "another_user")
        return False

    def handle_error(self, request, client_address) -> None:
        """A client that drops its connection (an editor or agent exiting) is not an error worth a traceback."""
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return
        super().handle_error(request, client_address)

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            # every slot is taken: say so and close, without a thread
            message = "the bridge has as many connections open as it serves (--max-connections); retry"
            _answer_and_close(request, 503, "Service Unavailable", message, "server_error", "too_many_connections")
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def _answer_and_close(request, status: int, reason: str, message: str, kind: str, code: str) -> None:
    """An error in OpenAI's shape on a connection that gets no handler thread, then close it."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    try:
        request.sendall(
            b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nConnection: close\r\nRetry-After: 1\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (status, reason.encode(), len(body), body)
        )
        request.shutdown(socket.SHUT_WR)
        # read what the client sent (briefly, a little): closing with unread data makes the
        # kernel send a reset, which can reach the client before it has read this answer
        request.settimeout(0.05)
        for _ in range(16):
            if not request.recv(4096):
                break
    except OSError:
        pass
    request.close()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: BridgeServer
    server_version = "tandem-openai"

    def setup(self) -> None:
        self.timeout = self.server.idle_timeout  # socketserver applies it to the connection
        super().setup()

    # ------------------------------------------------------------------ routes

    def do_GET(self) -> None:
        self._serve(self._get)

    def do_POST(self) -> None:
        self._serve(self._post)

    def do_DELETE(self) -> None:  # Ollama's /api/delete
        self._serve(self._post)

    def do_HEAD(self) -> None:  # what some Ollama clients probe before they start
        path = self.path.split("?", 1)[0].rstrip("/")
        self.send_response(HTTPStatus.OK if path in ("", "/api/version", "/health") else HTTPStatus.NOT_FOUND)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _get(self) -> None:
        from . import ollama_api

        path = self.path.split("?", 1)[0].rstrip("/")
        if path == "/api/version":
            self._json(HTTPStatus.OK, {"version": ollama_api.API_VERSION})
        elif path in ("/api/tags", "/api/ps"):
            self._json(HTTPStatus.OK, (ollama_api.tags if path == "/api/tags" else ollama_api.ps)(self))
        elif path == "/v1/models":
            model = self._model()
            self._json(HTTPStatus.OK, {"object": "list", "data": [model]})
        elif path.startswith("/v1/models/"):
            model = self._model()
            if path[len("/v1/models/") :] not in (model["id"], "tandem"):  # (chat takes model "tandem" too)
                raise ApiError(
                    HTTPStatus.NOT_FOUND,
                    f"no model {path[len('/v1/models/') :]!r}; this daemon serves {model['id']!r}",
                    param="model",
                )
            self._json(HTTPStatus.OK, model)
        elif path in ("", "/health"):
            self._json(HTTPStatus.OK, {"status": "ok", "model": self.server.model})
        else:
            raise ApiError(HTTPStatus.NOT_FOUND, f"no route GET {path}; try GET /v1/models")

    def _post(self) -> None:
        from . import ollama_api

        path = self.path.split("?", 1)[0].rstrip("/")
        if path.startswith("/api/"):
            ollama = {"/api/generate": ollama_api.generate, "/api/chat": ollama_api.chat}
            if path in ollama:
                return ollama[path](self, self._body())
            if path == "/api/show":
                return self._json(HTTPStatus.OK, ollama_api.show(self, self._body()))
            if path in ("/api/embed", "/api/embeddings"):
                raise ApiError(
                    HTTPStatus.NOT_IMPLEMENTED,
                    "tandem serves generation models only: it has no embedding model or path (use a dedicated "
                    "embedding server for /api/embed)",
                )
            manage = {"/api/pull": "tandem pull NAME", "/api/delete": "tandem rm NAME"}
            if path in manage or path in ("/api/push", "/api/create", "/api/copy") or path.startswith("/api/blobs"):
                raise ApiError(
                    HTTPStatus.NOT_IMPLEMENTED,
                    f"{path} is not served over HTTP: models are managed with the tandem command "
                    f"({manage.get(path, 'tandem models --help')})",
                )
            raise ApiError(HTTPStatus.NOT_FOUND, f"no route POST {path}")
        if path in ("/v1/messages", "/v1/messages/count_tokens"):
            from . import anthropic_api

            if path == "/v1/messages":
                return anthropic_api.messages(self, self._body())
            return self._json(HTTPStatus.OK, anthropic_api.count_tokens(self, self._body()))
        if path in ("/tokenize", "/detokenize", "/v1/tokenize"):
            return self._json(HTTPStatus.OK, self._tokens(path, self._body()))
        if self.command == "DELETE":
            raise ApiError(HTTPStatus.METHOD_NOT_ALLOWED, f"no route DELETE {path}")
        routes = {"/v1/completions": completions_call, "/v1/chat/completions": chat_call}
        if path not in routes:
            raise ApiError(
                HTTPStatus.NOT_FOUND, f"no route POST {path}; tandem serves /v1/completions and /v1/chat/completions"
            )
        call = routes[path](self._body())
        with Client(self.server.socket_path, timeout=None) as client:
            try:
                stream = call.start(client)
            except TandemError as exc:
                raise ApiError.of(exc) from None
            with stream:
                try:
                    if call.stream:
                        self._sse(call, stream)
                    else:
                        done = self._wait(stream)
                        self._json(HTTPStatus.OK, self._answer(call, stream.request_id, done))
                except (ClientGone, BrokenPipeError, ConnectionResetError):
                    _cancel_quietly(client, stream.request_id)  # the HTTP client left: so does its daemon request
                    self.close_connection = True

    # ------------------------------------------------------------------ plumbing

    def _serve(self, route: Callable[[], None]) -> None:
        self._body_read = False
        try:
            self._check_origin()
            self._check_key()
            route()
        except ApiError as exc:
            if not self._body_read and self.headers.get("Content-Length", "0") != "0":
                self.close_connection = True  # its body is still unread: the connection cannot go on
            self._json(exc.status, exc.body(self._dialect()))
        except (OverflowError, RecursionError) as exc:  # a number msgpack cannot carry, JSON nested too deep
            self.close_connection = True
            error = ApiError(HTTPStatus.BAD_REQUEST, f"the request has a value tandem cannot take: {exc}")
            body = error.body(self._dialect())
            self._json(HTTPStatus.BAD_REQUEST, body)
        except (BrokenPipeError, ConnectionResetError, TimeoutError, ClientGone):
            self.close_connection = True

    def _dialect(self) -> str:
        if self.path.startswith("/api/"):
            return "ollama"
        return "anthropic" if self.path.startswith("/v1/messages") else "openai"

    def _check_origin(self) -> None:
        from tandem.daemon.config import is_loopback_host

        host = (self.headers.get("Host") or "").strip().lower()
        if not is_loopback_host(host):
            raise ApiError(
                HTTPStatus.FORBIDDEN, f"Host {host!r} is not loopback: the bridge answers only clients on this machine"
            )
        origin = (self.headers.get("Origin") or "").strip().lower()
        scheme, _, rest = origin.partition("://")
        foreign = origin and (scheme not in ("http", "https") or not is_loopback_host(rest.split("/", 1)[0]))
        # a web page's request: browsers send Origin ("null" from sandboxed frames, data: pages and
        # redirects) and Sec-Fetch-Site; Ollama refuses foreign origins too (OLLAMA_ORIGINS)
        if foreign or (self.headers.get("Sec-Fetch-Site") or "").lower() == "cross-site":
            raise ApiError(
                HTTPStatus.FORBIDDEN,
                f"Origin {origin or '(cross-site)'!r} is not this machine: web pages may not use the bridge",
            )

    def _check_key(self) -> None:
        from .api_key import matches, presented

        key = self.server.api_key
        if key is not None and not matches(presented(self.headers), key):
            raise ApiError(
                HTTPStatus.UNAUTHORIZED,
                "this bridge requires its API key: send the key that `tandem key` prints as "
                "Authorization: Bearer KEY (an OpenAI client's api_key)",
                code="invalid_api_key",
            )

    def _body(self) -> dict:
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        # Ollama's API takes any type (its docs post with `curl -d`, a form type): the Origin check keeps
        # web pages out there; the OpenAI routes also refuse what a page can post without a preflight
        if ctype != "application/json" and not self.path.startswith("/api/"):
            raise ApiError(
                HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                f"send the body as Content-Type: application/json (got {ctype or 'none'!r})",
            )
        try:
            length = int(self.headers.get("Content-Length") or "")
        except ValueError:
            raise ApiError(HTTPStatus.LENGTH_REQUIRED, "a Content-Length header is required") from None
        if length < 0:
            self.close_connection = True
            raise ApiError(HTTPStatus.BAD_REQUEST, f"Content-Length must be a byte count >= 0, got {length}")
        if length > MAX_MESSAGE_BYTES:
            self.close_connection = True
            raise ApiError(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the body is {length:,} bytes; the limit is {MAX_MESSAGE_BYTES:,}"
            )
        raw = self.rfile.read(length)
        self._body_read = True
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # RecursionError: arrays or objects nested too deep
            raise ApiError(HTTPStatus.BAD_REQUEST, f"the body is not valid JSON: {exc or 'nested too deep'}") from None
        if not isinstance(body, dict):
            raise ApiError(HTTPStatus.BAD_REQUEST, "the body must be a JSON object")
        return body

    def _model(self) -> dict:
        try:
            with Client(self.server.socket_path) as client:
                hello = client.connect()
        except TandemError as exc:
            raise ApiError.of(exc) from None
        self.server.model = hello.model
        return {"id": hello.model, "object": "model", "created": 0, "owned_by": "tandem", "context_length": hello.n_ctx}

    # ------------------------------------------------------------------ for the dialect modules

    def daemon_hello(self):
        try:
            with Client(self.server.socket_path) as client:
                hello = client.connect()
        except TandemError as exc:
            raise ApiError.of(exc) from None
        self.server.model = hello.model
        return hello

    def send_json(self, status: int, body: dict) -> None:
        self._json(status, body)

    def start_stream(self, content_type: str) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", content_type)
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def write_line(self, obj: dict) -> None:
        """One NDJSON line."""
        self._write_chunk(json.dumps(obj, ensure_ascii=False).encode() + b"\n")

    def end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _tokens(self, path: str, body: dict) -> dict:
        """llama-server's /tokenize and /detokenize; /v1/tokenize: an OpenAI-style
        request's prompt or messages (and tools) counted as generate would read them."""
        try:
            with Client(self.server.socket_path) as client:
                if path == "/detokenize":
                    tokens = _get(body, "tokens", (list,), [])
                    if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
                        raise ApiError(HTTPStatus.BAD_REQUEST, "'tokens' must be an array of integers", param="tokens")
                    return {"content": client.detokenize(tokens)}
                if path == "/tokenize":
                    content = _get(body, "content", (str,))
                    if content is None:
                        raise ApiError(HTTPStatus.BAD_REQUEST, "'content' (the text) is required", param="content")
                    pieces = bool(_get(body, "with_pieces", (bool,), False))
                    reply = client.tokenize(
                        content,
                        add_special=bool(_get(body, "add_special", (bool,), False)),
                        parse_special=bool(_get(body, "parse_special", (bool,), True)),
                        with_pieces=pieces,
                    )
                    if pieces:
                        return {"tokens": [{"id": t, "piece": p} for t, p in zip(reply.tokens, reply.pieces)]}
                    return {"tokens": reply.tokens}
                if body.get("messages") is not None:
                    tools = _tools(body).get("tools")
                    reply = client.tokenize(messages=_chat_messages(body), tools=tools)
                else:
                    prompt = _get(body, "prompt", (str,))
                    if prompt is None:
                        raise ApiError(HTTPStatus.BAD_REQUEST, "give 'prompt' or 'messages'", param="prompt")
                    reply = client.tokenize(prompt, parse_special=True)
                return {"tokens": reply.tokens, "count": len(reply.tokens), "model": self.server.model}
        except TandemError as exc:
            raise ApiError.of(exc) from None

    def run_to_done(self, start):
        """One daemon request, waited for (cancelled if the HTTP client leaves)."""
        with Client(self.server.socket_path, timeout=None) as client:
            try:
                s = start(client)
            except TandemError as exc:
                raise ApiError.of(exc) from None
            with s:
                try:
                    return self._wait(s)
                except (ClientGone, BrokenPipeError, ConnectionResetError):
                    _cancel_quietly(client, s.request_id)
                    self.close_connection = True
                    raise ClientGone() from None

    def run_events(self, start, events) -> None:
        """One daemon request streamed as named server-sent events (Anthropic's):
        ``events.start()``, ``.chunk(chunk)`` and ``.finish(done)`` give (name, data) pairs."""
        with Client(self.server.socket_path, timeout=None) as client:
            try:
                s = start(client)
            except TandemError as exc:
                raise ApiError.of(exc) from None
            with s:
                started = False
                try:
                    try:
                        for chunk in self._chunks(s):
                            if not started:
                                self._start_sse()
                                self._named_events(events.start())
                                started = True
                            self._named_events(events.chunk(chunk))
                    except ApiError as exc:
                        if not started:
                            raise
                        self._named_events([("error", exc.body(self._dialect()))])
                        self.wfile.write(b"0\r\n\r\n")
                        return
                    if not started:
                        self._start_sse()
                        self._named_events(events.start())
                    self._named_events(events.finish(s.done))
                    self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except (ClientGone, BrokenPipeError, ConnectionResetError):
                    _cancel_quietly(client, s.request_id)
                    self.close_connection = True

    def _named_events(self, pairs) -> None:
        for name, data in pairs:
            self._write_chunk(f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode())

    def run_daemon_request(self, start, piece, final, stream: bool, content_type: str = "application/x-ndjson"):
        """One daemon request: ``start(client)`` starts it; streamed, each chunk's
        text goes out as ``piece(text)`` (one line), then ``final(done)``; not
        streamed, ``final(done)`` is the answer. An HTTP client that leaves
        cancels it; an error after the stream started is a last ``{"error"}`` line."""
        with Client(self.server.socket_path, timeout=None) as client:
            try:
                s = start(client)
            except TandemError as exc:
                raise ApiError.of(exc) from None
            with s:
                try:
                    if not stream:
                        self._json(HTTPStatus.OK, final(self._wait(s)))
                        return
                    started = False
                    try:
                        for chunk in self._chunks(s):
                            if not started:  # headers once the daemon took it: errors before are plain HTTP
                                self.start_stream(content_type)
                                started = True
                            if chunk.text:
                                self.write_line(piece(chunk.text))
                    except ApiError as exc:
                        if not started:
                            raise
                        self.write_line(exc.body(self._dialect()))
                        self.end_stream()
                        return
                    if not started:
                        self.start_stream(content_type)
                    last = final(s.done)
                    for line in last if isinstance(last, list) else [last]:
                        self.write_line(line)
                    self.end_stream()
                except (ClientGone, BrokenPipeError, ConnectionResetError):
                    _cancel_quietly(client, s.request_id)  # the HTTP client left: so does its daemon request
                    self.close_connection = True

    def _gone(self) -> bool:
        """Has the HTTP client closed its end? (Readable with nothing to read.)"""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _chunks(self, stream: Stream) -> Iterator:
        """The stream's chunks (the daemon streams even when the HTTP client does
        not: the chunks pace the checks); ClientGone if the HTTP client leaves
        meanwhile, noticed within POLL_SECONDS."""
        checked = time.monotonic()
        while True:
            try:
                chunk = stream.next_chunk(POLL_SECONDS)
            except DaemonTimeout:
                chunk = False
            except TandemError as exc:
                raise ApiError.of(exc) from None
            if chunk is None:
                return
            now = time.monotonic()
            if now - checked >= POLL_SECONDS:
                checked = now
                if self._gone():
                    raise ClientGone()
            if chunk is not False:
                yield chunk

    def _wait(self, stream: Stream):
        for _ in self._chunks(stream):
            pass
        return stream.done

    def _answer(self, call: Call, request_id: str, done) -> dict:
        reply = self._envelope(call, request_id)
        if call.kind == "chat.completion":
            message = assistant_message(done)
            if done.tool_calls:
                message["content"] = done.text or None
            choice = {"index": 0, "message": message, "logprobs": None}
        else:
            choice = {"index": 0, "text": done.text, "logprobs": None}
        choice["finish_reason"] = _finish(done.finish_reason)
        reply["choices"] = [choice]
        reply["usage"] = _usage(done)
        return reply

    def _envelope(self, call: Call, request_id: str, chunk: bool = False) -> dict:
        prefix = "chatcmpl-" if call.kind == "chat.completion" else "cmpl-"
        obj = call.kind + (".chunk" if chunk and call.kind == "chat.completion" else "")
        return {"id": prefix + request_id, "object": obj, "created": int(time.time()), "model": self.server.model}

    def _sse(self, call: Call, stream: Stream) -> None:
        chat = call.kind == "chat.completion"

        def event(delta: Optional[str], finish: Optional[str] = None, role: bool = False) -> dict:
            e = self._envelope(call, stream.request_id, chunk=True)
            if chat:
                d: dict = (
                    {"role": "assistant", "content": ""} if role else ({"content": delta} if delta is not None else {})
                )
                e["choices"] = [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]
            else:
                e["choices"] = [{"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}]
            return e

        started = False

        def start() -> None:
            # headers only once the daemon accepted the request: errors before it are plain HTTP errors
            nonlocal started
            if not started:
                self._start_sse()
                if chat:
                    self._send_event(event(None, role=True))
                started = True

        try:
            for chunk in self._chunks(stream):
                start()
                if chunk.text:
                    self._send_event(event(chunk.text))
                if chat and chunk.tool_calls:
                    e = self._envelope(call, stream.request_id, chunk=True)
                    delta = {"tool_calls": _call_deltas(chunk.tool_calls)}
                    e["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]
                    self._send_event(e)
        except ApiError as exc:
            if not started:
                raise
            self._send_event(exc.body())
            self._end_sse()
            return
        start()
        done = stream.done
        self._send_event(event(None, finish=_finish(done.finish_reason)))
        if call.include_usage:
            e = self._envelope(call, stream.request_id, chunk=True)
            e["choices"] = []
            e["usage"] = _usage(done)
            self._send_event(e)
        self._end_sse()

    def _start_sse(self) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _send_event(self, data: Any) -> None:
        self._write_chunk(f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode())

    def _write_chunk(self, payload: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(payload), payload))
        self.wfile.flush()

    def _end_sse(self) -> None:
        self._send_event("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _json(self, status: int, body: dict) -> None:
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        if status == HTTPStatus.TOO_MANY_REQUESTS:
            self.send_header("Retry-After", "1")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(payload)
        self.wfile.flush()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        if self.server.verbose:
            sys.stderr.write(f"tandem http: {self.address_string()} {format % args}\n")


# --------------------------------------------------------------------------- entry point


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
