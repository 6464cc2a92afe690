"""What the sync and asyncio clients share: building requests, reading replies,
and routing replies to the request they belong to."""

from __future__ import annotations

import collections
import os
import socket
import stat
import struct
import uuid
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import zmq
import zmq.asyncio

from tandem.protocol import (
    PROTOCOL_VERSION,
    Busy,
    Cancel,
    ChatMessage,
    Chunk,
    Complete,
    Decoding,
    Done,
    Embed,
    Error,
    Generate,
    Hello,
    Message,
    ProtocolError,
    ResponseFormat,
    Tokenize,
    Tool,
    decode,
    default_socket_path,
    encode,
    from_map,
)

from .errors import DaemonNotRunning, InvalidRequest, QueueFull, RequestFailed, TandemError, UntrustedSocket

MessageLike = Union[ChatMessage, dict]

START_HINT = 'start one with `tandem serve` (or just `tandem run "..."`, which starts one for you)'


HEARTBEAT_MS = 2_000  # ZeroMQ pings the daemon this often while connected...
HEARTBEAT_TIMEOUT_MS = 15_000  # ...and drops the connection after this long without an answer


def dealer_options(sock) -> None:
    """The client's DEALER: no linger; ZeroMQ's heartbeat, so a daemon that is
    gone or frozen without closing the connection is noticed within
    ``HEARTBEAT_TIMEOUT_MS`` (its I/O thread answers the pings however busy the
    daemon's models are). ZeroMQ's own reconnection stays on: with it off, the
    replies a daemon sent just before it closed would be dropped unread. The
    client never uses a reconnected pipe: a disconnect event (``dropped``) makes
    it report the requests that were waiting and connect afresh, checks and all."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)


def monitor_of(sock):
    """The DEALER's disconnect events, on an inproc address of its own (pyzmq's
    default is derived from the fd, which is reused: 'Address already in use')."""
    return sock.get_monitor_socket(zmq.EVENT_DISCONNECTED, addr=f"inproc://tandem-monitor-{uuid.uuid4().hex}")


def dropped(monitor) -> bool:
    """Has the connection dropped (a disconnect event waits on ``monitor``)? Without blocking, sync or asyncio."""
    return bool(monitor.get(zmq.EVENTS) & zmq.POLLIN)


def gone_message(path: Path) -> str:
    return (
        f"the daemon at {path} went away while this request was waiting for its reply (it stopped or crashed, "
        f"or did not answer ZeroMQ's heartbeat for {HEARTBEAT_TIMEOUT_MS // 1000} s); the request is lost: "
        f"retry it once a daemon runs again ({START_HINT})"
    )


def new_id() -> str:
    return uuid.uuid4().hex


def resolve_socket(socket_path: Optional[Union[str, os.PathLike]]) -> Path:
    return Path(socket_path) if socket_path is not None else default_socket_path()


def check_socket_exists(path: Path) -> None:
    """The socket is there and only this user could have put it there (its directory
    is ours and no one else may write in it, the socket is ours), and the process
    that answers on it runs as this user: before anything is sent, since a prompt
    may be the user's code. Raises DaemonNotRunning or UntrustedSocket."""
    if not path.exists():
        raise DaemonNotRunning(f"no tandem daemon is running at {path}; {START_HINT}")
    uid = os.getuid()
    directory = path.parent
    st = directory.stat()
    if st.st_uid != uid:
        raise UntrustedSocket(
            f"the socket directory {directory} belongs to uid {st.st_uid}, not you (uid {uid}): another user may "
            "be listening there. Nothing was sent. Set XDG_RUNTIME_DIR, or give a socket in a directory of your "
            "own (--socket or TANDEM_SOCKET)"
        )
    if stat.S_IMODE(st.st_mode) & 0o022:
        raise UntrustedSocket(
            f"the socket directory {directory} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}): "
            f"one of them could have put their own socket there. Nothing was sent. Run `chmod 700 {directory}` "
            "and restart the daemon, or use a directory of your own (--socket or TANDEM_SOCKET)"
        )
    st = path.lstat()  # the socket itself, never what a link points to
    if not stat.S_ISSOCK(st.st_mode):
        raise UntrustedSocket(
            f"{path} is not a socket ({'a symbolic link' if stat.S_ISLNK(st.st_mode) else 'another kind of file'}): "
            f"it is not your daemon's. Nothing was sent. Remove it (rm {path}) and start your own: {START_HINT}"
        )
    owner = st.st_uid
    if owner != uid:
        raise UntrustedSocket(
            f"the socket {path} belongs to uid {owner}, not you (uid {uid}): it is not your daemon. Nothing was "
            f"sent. Remove it (rm {path}) and start your own: {START_HINT}"
        )
    peer = peer_uid(path)
    if peer is not None and peer != uid:
        raise UntrustedSocket(
            f"the process listening on {path} runs as uid {peer}, not you (uid {uid}). Nothing was sent. "
            f"Stop it, or use a socket of your own (--socket or TANDEM_SOCKET)"
        )


def peer_uid(path: Path) -> Optional[int]:
    """The uid of the process that accepts connections on ``path`` (SO_PEERCRED), or
    None where it cannot be learned (nothing accepts, or the platform has no SO_PEERCRED)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(2.0)
        try:
            probe.connect(os.fspath(path))
            creds = probe.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("iII"))  # struct ucred
        except OSError:
            return None  # nothing accepts: the zmq connection will say the daemon is not running
        _pid, uid, _gid = struct.unpack("iII", creds)
        return uid


def hello_request() -> Hello:
    return Hello(id=new_id(), protocol_version=list(PROTOCOL_VERSION), client_name="tandem-python")


def generate_request(
    prompt: Optional[str] = None,
    messages: Optional[Iterable[MessageLike]] = None,
    **params: Any,
) -> Generate:
    chat = None
    if messages is not None:
        chat = [_as(ChatMessage, m, f"messages[{i}]") for i, m in enumerate(messages)]
    if params.get("tools") is not None:
        params["tools"] = [_as(Tool, t, f"tools[{i}]") for i, t in enumerate(params["tools"])]
    request_id = params.pop("request_id", None) or new_id()
    params = _response_format(params)
    return _checked(Generate(id=request_id, prompt=prompt, messages=chat, **params))


# generate's arguments that change its chat prompt (tokenize's options): the rest renders no token of it
TOKENIZE_1_12 = ("tool_choice", "think", "reasoning_effort", "max_thinking_tokens")  # tokenize's options since 1.12
COUNTED = ("tools", *TOKENIZE_1_12)


def counted(params: dict) -> dict:
    """Of a generate's arguments, those that change its chat prompt's tokens (``tokenize``'s options)."""
    return {k: params[k] for k in COUNTED if params.get(k) is not None}


def tokenize_request(
    text: Optional[str] = None, messages: Optional[Iterable[MessageLike]] = None, tools: Any = None, **options: Any
) -> Tokenize:
    chat = None
    if messages is not None:
        chat = [_as(ChatMessage, m, f"messages[{i}]") for i, m in enumerate(messages)]
    tool_list = [_as(Tool, t, f"tools[{i}]") for i, t in enumerate(tools)] if tools else None
    return _checked(Tokenize(id=new_id(), text=text, messages=chat, tools=tool_list, **options))


def embed_request(
    input: Union[str, Iterable[str], None] = None, tokens: Optional[Iterable[Any]] = None, **options: Any
) -> Embed:
    """An embed request: ``input`` one text or a list of them, or ``tokens`` one list of token ids
    or a list of such lists. Options: truncate, dimensions, normalize, request_id."""
    texts = [input] if isinstance(input, str) else list(input or [])
    ids = list(tokens or [])
    if ids and all(isinstance(t, int) for t in ids):
        ids = [ids]  # one input's tokens
    request_id = options.pop("request_id", None) or new_id()
    if not all(isinstance(t, str) for t in texts):
        raise InvalidRequest("invalid request: 'input' must be a text or a list of texts")
    if not all(isinstance(t, list) and all(isinstance(i, int) for i in t) for t in ids):
        raise InvalidRequest("invalid request: 'tokens' must be a list of token ids or a list of such lists")
    return _checked(Embed(id=request_id, input=texts, tokens=ids, **options))


RESTART_HINT = "restart it from this tandem (tandem service restart, or stop it and run tandem serve{serve})"


def _older(hello: Any, what: str, serve: str = "") -> InvalidRequest:
    """The error for a daemon whose protocol is older than a request needs; ``what``: what it does instead."""
    major, minor = hello.protocol_version[:2]
    hint = RESTART_HINT.format(serve=serve)
    return InvalidRequest(f"the daemon speaks protocol {major}.{minor}, which {what}: {hint}")


def check_daemon_embeds(hello: Any) -> None:
    """Refuse to send embed to a daemon that has no such op (its minor is below 1.8)."""
    if tuple(hello.protocol_version[:2]) < (1, 8):
        raise _older(hello, "has no embed op", " --embedding-model MODEL")


def check_daemon_speaks(hello: Any, req: Decoding) -> None:
    """Refuse to send tools to a daemon that would silently ignore them (its minor is below 1.1)."""
    if getattr(req, "tools", None) and tuple(hello.protocol_version[:2]) < (1, 1):
        raise _older(hello, "ignores tools")


def uncounted(hello: Any, options: dict) -> list[str]:
    """Of tokenize's ``options`` (those set), the ones the daemon would count the prompt without: the 1.12
    options, for an older daemon."""
    if tuple(hello.protocol_version[:2]) >= (1, 12):
        return []
    return [k for k in TOKENIZE_1_12 if options.get(k) is not None]


def check_daemon_counts(hello: Any, req: Tokenize) -> None:
    """Refuse to send tokenize's 1.12 options to an older daemon: it would count the prompt without them."""
    given = uncounted(hello, {k: getattr(req, k, None) for k in TOKENIZE_1_12})
    if given:
        raise _older(hello, f"counts a prompt without {', '.join(given)}")


def heard_often(hello: Any, req: Decoding, timeout: Optional[float]) -> tuple[bool, bool]:
    """Make ``req`` one the daemon answers at least every second or so: streamed, with its prompt's
    progress, where the daemon can (1.7+) and the client waits at most ``timeout`` seconds for each reply
    (a 32k-token prompt takes minutes on a laptop's CPU, and so can a long answer: neither is a silent
    daemon). Returns what the caller did not ask for and must not see: (progress chunks, any chunks)."""
    if timeout is None or not isinstance(req, Generate) or tuple(hello.protocol_version[:2]) < (1, 7):
        return False, False
    hide_progress, hide_chunks = not req.progress, not req.stream
    req.stream = req.progress = True
    return hide_progress, hide_chunks


def _as(cls: type, value: Any, where: str) -> Any:
    """A message, tool, ... given as a map (OpenAI's shape) made the protocol's dataclass."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, dict):
        raise InvalidRequest(f"invalid request: '{where}' must be a map or a {cls.__name__}")
    try:
        return from_map(cls, value, where + ".")
    except ValueError as exc:
        raise InvalidRequest(f"invalid request: {exc}") from None


def assistant_message(done: Done) -> dict:
    """The model's turn as a message to append to the history: its text and its tool
    calls exactly as ``done`` gave them (so the next turn's prompt re-renders the
    tokens it generated, and the prefix cache serves them)."""
    message: dict = {"role": "assistant", "content": done.text}
    if done.reasoning:
        message["reasoning"] = done.reasoning  # (templates that show it get it back; others drop it)
    if done.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in done.tool_calls
        ]
    return message


def complete_request(prefix: str, suffix: str = "", **params: Any) -> Complete:
    request_id = params.pop("request_id", None) or new_id()
    return _checked(Complete(id=request_id, prefix=prefix, suffix=suffix, **params))


def _response_format(params: dict) -> dict:
    """``response_format`` may be given as a map (OpenAI's shape): made a ResponseFormat."""
    rf = params.get("response_format")
    if isinstance(rf, dict):
        try:
            params = {**params, "response_format": ResponseFormat(**rf)}
        except TypeError as exc:
            raise InvalidRequest(f"invalid request: 'response_format': {exc}") from None
    return params


def _checked(req: Decoding) -> Any:
    try:
        req.check()
    except ValueError as exc:
        raise InvalidRequest(f"invalid request: {exc}") from None
    return req


def raise_for_terminal(msg: Message) -> None:
    """Turn an ``error`` or ``busy`` reply into the matching exception."""
    if isinstance(msg, Error):
        raise RequestFailed(msg.code, msg.name, msg.message, msg.id)
    if isinstance(msg, Busy):
        raise QueueFull(msg.message, msg.queue_length, msg.max_queue)


class ReplyRouter:
    """Buffers replies per request id, so several requests can share one socket.

    It also knows which ids are in use: a request still expecting replies, or
    one abandoned (``abandon``) whose terminal message has not come yet (its
    late replies are dropped); ``expect`` refuses those, since a second request
    with a live id would get the first one's replies. ``lose_all`` marks every
    request still waiting as lost with its connection (what is buffered for it
    is still delivered)."""

    def __init__(self) -> None:
        self.buffers: dict[str, collections.deque] = {}
        self.draining: set[str] = set()  # abandoned, still running in the daemon
        self.lost: set[str] = set()  # waiting when the connection dropped

    def expect(self, request_id: str) -> None:
        if request_id in self.buffers or request_id in self.draining:
            raise InvalidRequest(
                f"request id {request_id!r} is in use by a request of this client that has not finished; give "
                "each request a new id (or leave request_id out)"
            )
        self.lost.discard(request_id)
        self.buffers[request_id] = collections.deque()

    def forget(self, request_id: str) -> None:
        self.buffers.pop(request_id, None)

    def abandon(self, request_id: str) -> None:
        """Stop waiting for a request the daemon still runs: drop its replies until its terminal one."""
        buffered = self.buffers.pop(request_id, None)
        if buffered is not None and all(isinstance(m, Chunk) for m in buffered):
            self.draining.add(request_id)

    def lose_all(self) -> None:
        self.lost |= set(self.buffers)
        self.draining.clear()  # (that connection is gone, and its requests with it)

    def pop(self, request_id: str) -> Optional[Message]:
        buf = self.buffers.get(request_id)
        return buf.popleft() if buf else None

    def accept(self, frames: list[bytes], waiting_for: str) -> Optional[Message]:
        """Decode one reply; return it if it is for ``waiting_for``, else buffer it."""
        try:
            msg = decode(frames, replies=True)
        except ProtocolError as exc:
            raise TandemError(f"the daemon sent a message this client cannot read: {exc.message}") from None
        rid = getattr(msg, "id", None)
        if rid in self.draining:
            if not isinstance(msg, Chunk):
                self.draining.discard(rid)  # its terminal message: the id is free again
            return None
        if rid == waiting_for or (rid is None and isinstance(msg, Error)):
            return msg
        if rid in self.buffers:
            self.buffers[rid].append(msg)
        return None  # a reply to a request nobody waits for any more


class StreamState:
    """What Stream and AsyncStream share: reading one generation's replies and
    abandoning it. ``client`` has ``_router`` and ``_sock``."""

    def __init__(self, client, request_id: str, hidden: tuple[bool, bool] = (False, False)):
        self.client = client
        self.request_id = request_id
        self.done: Optional[Done] = None
        self.text = ""
        self._finished = False
        self._hide_progress, self._hide_chunks = hidden  # (heard_often: asked for the caller, not by it)

    def _hidden(self, chunk: Optional[Chunk]) -> bool:
        return chunk is not None and (self._hide_chunks or (self._hide_progress and chunk.progress is not None))

    @property
    def finished(self) -> bool:
        """Has its last reply been read (or has it been abandoned)?"""
        return self._finished

    def _take(self, msg: Message) -> Optional[Chunk]:
        """A chunk is returned; the terminal message ends the stream (None), or
        raises for ``error``/``busy``."""
        if isinstance(msg, Chunk):
            self.text += msg.text
            return msg
        self._finished = True
        self.client._router.forget(self.request_id)
        raise_for_terminal(msg)
        if not isinstance(msg, Done):
            raise TandemError(f"unexpected {msg.op.value} message in a generate stream")
        self.done = msg
        return None

    def close(self) -> None:
        """Abandon the request if it is still running (no waiting): it is
        cancelled and its remaining replies are discarded."""
        if self._finished:
            return
        self._finished = True
        router, sock = self.client._router, self.client._sock
        if sock is None or self.request_id in router.lost:
            router.forget(self.request_id)  # its connection is gone, and the request with it
            return
        router.abandon(self.request_id)
        if isinstance(sock, zmq.asyncio.Socket):
            sock = zmq.Socket.shadow(sock.underlying)  # a plain send, not a Future nobody awaits
        try:
            sock.send_multipart(encode(Cancel(id=new_id(), request_id=self.request_id)), zmq.NOBLOCK)
        except zmq.Again:
            router.forget(self.request_id)  # the connection is gone: so is the request

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
