"""The synchronous Python client.

    from tandem.client import Client

    with Client() as client:
        stream = client.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=64)
        for chunk in stream:
            print(chunk.text, end="", flush=True)
        print(stream.done.usage)

A ``Client`` owns one ZeroMQ DEALER socket; use it from one thread at a time.
"""

from __future__ import annotations

import os
import time
from typing import Iterator, Optional, Union

import zmq

from tandem.protocol import (
    CacheClear,
    CacheCleared,
    Cancel,
    CancelReply,
    Chunk,
    Detokenize,
    Detokenized,
    Done,
    Embedded,
    HelloReply,
    Message,
    Shutdown,
    Status,
    StatusReply,
    Tokenized,
    encode,
    endpoint,
)

from .core import (
    START_HINT,
    MessageLike,
    ReplyRouter,
    StreamState,
    check_daemon_counts,
    check_daemon_embeds,
    check_daemon_speaks,
    check_socket_exists,
    complete_request,
    counted,
    dealer_options,
    dropped,
    embed_request,
    generate_request,
    gone_message,
    heard_often,
    hello_request,
    monitor_of,
    new_id,
    raise_for_terminal,
    resolve_socket,
    tokenize_request,
)
from .errors import DaemonGone, DaemonNotRunning, DaemonTimeout


class Client:
    def __init__(
        self,
        socket_path: Optional[Union[str, os.PathLike]] = None,
        timeout: Optional[float] = 600.0,
        connect_timeout: float = 5.0,
    ):
        """``timeout``: seconds to wait for each reply (None = forever; a queued
        request may wait long). A generation is asked of the daemon streamed, with its
        prompt's progress, whatever the caller asked (``heard_often``; what it did not
        ask for it does not see): a prompt that takes longer than ``timeout`` to read,
        or an answer longer to write, is not silence. ``connect_timeout``: seconds for
        the handshake."""
        self.socket_path = resolve_socket(socket_path)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.server: Optional[HelloReply] = None
        self._zctx = zmq.Context.instance()
        self._sock: Optional[zmq.Socket] = None
        self._monitor: Optional[zmq.Socket] = None  # the DEALER's disconnect events
        self._router = ReplyRouter()

    # ------------------------------------------------------------------ connection

    def connect(self) -> HelloReply:
        """Connect and handshake (done automatically by the first request)."""
        if self._sock is not None and dropped(self._monitor):
            self._drop()  # the connection dropped while idle (the daemon restarted?): connect afresh
        if self.server is not None:
            return self.server
        check_socket_exists(self.socket_path)
        self._sock = self._zctx.socket(zmq.DEALER)
        dealer_options(self._sock)
        self._monitor = monitor_of(self._sock)
        self._sock.connect(endpoint(self.socket_path))
        hello = hello_request()
        try:
            reply = self._request(hello, self.connect_timeout)
        except (DaemonTimeout, DaemonGone):  # nothing accepted the connection, or it dropped at once
            self.close()
            raise DaemonNotRunning(
                f"nothing answers at {self.socket_path} (a stale socket from a daemon that died?); {START_HINT}"
            ) from None
        raise_for_terminal(reply)
        assert isinstance(reply, HelloReply)
        self.server = reply
        return reply

    def close(self) -> None:
        if self._sock is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close(linger=0)
            self._sock = None
        self.server = None

    def _drop(self) -> None:
        """The connection is gone: the requests waiting on it are lost (served or
        not, nobody knows); the next request connects afresh, checks and all."""
        self._router.lose_all()
        self.close()

    def _daemon_gone(self) -> DaemonGone:
        self._drop()
        return DaemonGone(gone_message(self.socket_path))

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing

    def _send(self, msg: Message) -> None:
        if self._sock is None or dropped(self._monitor):
            self.connect()  # the first request, or the connection dropped while idle: afresh
        self._router.expect(msg.id)  # InvalidRequest for an id in use
        for attempt in (1, 2):
            assert self._sock is not None
            try:  # never blocks: a pipe that cannot take it raises instead
                self._sock.send_multipart(encode(msg), flags=zmq.NOBLOCK)
                return
            except zmq.Again:  # it dropped since connect() looked: nothing was sent
                self._router.forget(msg.id)
                self._drop()
                if attempt == 2:
                    raise DaemonGone(gone_message(self.socket_path)) from None
                self.connect()
                self._router.expect(msg.id)

    def _recv(self, request_id: str, timeout: Optional[float]) -> Message:
        buffered = self._router.pop(request_id)
        if buffered is not None:
            return buffered
        if self._sock is None or request_id in self._router.lost:
            raise DaemonGone(gone_message(self.socket_path))
        deadline = None if timeout is None else time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            events = dict(poller.poll(None if remaining is None else int(remaining * 1000)))
            if self._sock in events:  # replies first: a daemon that answered, then closed, is not lost
                msg = self._router.accept(self._sock.recv_multipart(), request_id)
                if msg is not None:
                    return msg
            elif self._monitor in events:
                while self._sock.poll(0):  # what it sent before it went is still delivered
                    msg = self._router.accept(self._sock.recv_multipart(), request_id)
                    if msg is not None:
                        return msg
                raise self._daemon_gone()
            elif not events:
                raise DaemonTimeout(f"no reply from the daemon at {self.socket_path} within {timeout} s")

    def _request(self, msg: Message, timeout: Optional[float]) -> Message:
        self._send(msg)
        try:
            return self._recv(msg.id, timeout)
        finally:
            self._router.forget(msg.id)

    # ------------------------------------------------------------------ API

    def generate(
        self, prompt: Optional[str] = None, messages: Optional[list[MessageLike]] = None, **params
    ) -> "Stream":
        """Start a generation; iterate the returned Stream for chunks, then read ``.done``.
        Params: max_tokens, temperature, top_k, top_p, seed, stop, ignore_eos, request_id; progress=True:
        chunks with ``progress`` (no text) while the prompt is read (protocol 1.7)."""
        hello = self.connect()
        req = generate_request(prompt, messages, **params)
        check_daemon_speaks(hello, req)
        hidden = heard_often(hello, req, self.timeout)  # (the timeout is for silence, not for the whole request)
        self._send(req)
        return Stream(self, req.id, hidden)

    def complete(self, prompt: Optional[str] = None, messages: Optional[list[MessageLike]] = None, **params) -> Done:
        """Generate without streaming; returns the ``done`` message (``.text`` has the answer)."""
        return self.generate(prompt, messages, stream=False, **params).wait()

    def infill(self, prefix: str, suffix: str = "", **params) -> "Stream":
        """Fill in the middle (the ``complete`` op): the code between ``prefix`` (before
        the cursor) and ``suffix`` (after it). Needs a model with FIM tokens. Params as
        for generate, plus max_lines and stop_at_blank_line; greedy, 128 tokens and
        a stop at the first blank line by default. ``.wait()`` gives the ``done``."""
        self.connect()
        req = complete_request(prefix, suffix, **params)
        self._send(req)
        return Stream(self, req.id)

    def status(self) -> StatusReply:
        self.connect()
        reply = self._request(Status(id=new_id()), self.connect_timeout)
        raise_for_terminal(reply)
        assert isinstance(reply, StatusReply)
        return reply

    def cache_clear(self, timeout: Optional[float] = 600.0, memory_only: bool = False) -> CacheCleared:
        """Empty the daemon's prefix cache. It happens after the running request
        (if any), before the next queued one: hence the long default timeout.
        Both tiers: the shared memory and the page files on disk; with
        ``memory_only`` the disk keeps its pages.
        ``cache`` in the reply is None when the daemon has no prefix cache;
        QueueFull when as many clears as the daemon's max_queue wait already."""
        self.connect()
        reply = self._request(CacheClear(id=new_id(), memory_only=memory_only), timeout)
        raise_for_terminal(reply)
        assert isinstance(reply, CacheCleared)
        return reply

    def tokenize(
        self,
        text: Optional[str] = None,
        messages: Optional[list[MessageLike]] = None,
        tools: Optional[list] = None,
        **options,
    ) -> Tokenized:
        """The token ids of ``text``, or of ``messages`` (and ``tools``) as the chat
        template renders them for ``generate``. Options: add_special, parse_special,
        with_pieces (text); tool_choice, think, reasoning_effort, max_thinking_tokens
        (messages; a daemon older than 1.12 would not count them: InvalidRequest). Answered between
        decoding steps, never queued behind a request."""
        req = tokenize_request(text, messages, tools, **options)
        check_daemon_counts(self.connect(), req)
        reply = self._request(req, self.connect_timeout)
        raise_for_terminal(reply)
        assert isinstance(reply, Tokenized)
        return reply

    def count_tokens(self, prompt: Optional[str] = None, messages: Optional[list[MessageLike]] = None, **params) -> int:
        """How many prompt tokens a ``generate`` with these arguments would read
        (``tools``, ``tool_choice`` and the reasoning controls render into it; the rest does not)."""
        if messages is None:
            return len(self.tokenize(prompt or "", parse_special=True).tokens)
        return len(self.tokenize(messages=messages, **counted(params)).tokens)

    def detokenize(self, tokens: list[int]) -> str:
        self.connect()
        reply = self._request(Detokenize(id=new_id(), tokens=list(tokens)), self.connect_timeout)
        raise_for_terminal(reply)
        assert isinstance(reply, Detokenized)
        return reply.text

    def embed(
        self,
        input: Union[str, list[str], None] = None,
        tokens: Optional[list] = None,
        *,
        timeout: Optional[float] = 600.0,
        **options,
    ) -> Embedded:
        """Embedding vectors from the daemon's embedding model (``tandem serve --embedding-model``):
        ``input`` one text or a list of texts (``tokens``: token ids of that model instead), one
        vector per input in ``.embeddings``, unit length unless ``normalize=False``. Options:
        truncate (default True: an input longer than the model's context is cut; False: an error),
        dimensions (keep the first N), request_id. It waits in the embed queue, never behind a
        generation, and yields the cores to one that runs. ``RequestFailed`` with code
        NO_EMBEDDING_MODEL when the daemon has none."""
        hello = self.connect()
        check_daemon_embeds(hello)
        reply = self._request(embed_request(input, tokens, **options), timeout)
        raise_for_terminal(reply)
        assert isinstance(reply, Embedded)
        return reply

    def cancel(self, request_id: str) -> bool:
        """Cancel a queued or running request (any client's). True if it was found."""
        self.connect()
        reply = self._request(Cancel(id=new_id(), request_id=request_id), self.connect_timeout)
        raise_for_terminal(reply)
        assert isinstance(reply, CancelReply)
        return reply.found

    def shutdown(self) -> None:
        """Ask the daemon to stop (it finishes with every request answered)."""
        self.connect()
        raise_for_terminal(self._request(Shutdown(id=new_id()), self.connect_timeout))


class Stream(StreamState):
    """The chunks of one generation. Iterate it for chunks; afterwards ``done``
    holds the terminal message (an ``error``/``busy`` reply raises
    RequestFailed/QueueFull instead). ``cancel()`` stops the request and waits
    for its ``done``; ``close()`` (or leaving a ``with`` block, or dropping the
    stream) abandons an unfinished request: it is cancelled and its remaining
    replies are discarded."""

    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        chunk = self.next_chunk(self.client.timeout)
        if chunk is None:
            raise StopIteration
        return chunk

    def next_chunk(self, timeout: Optional[float]) -> Optional[Chunk]:
        """The next chunk, waiting at most ``timeout`` seconds (DaemonTimeout if
        none came; the stream goes on). None: the stream ended, ``done`` is set."""
        while not self._finished:
            chunk = self._take(self.client._recv(self.request_id, timeout))
            if not self._hidden(chunk):
                return chunk
        return None

    def wait(self) -> Done:
        """Read the stream to its end; the ``done``."""
        for _ in self:
            pass
        assert self.done is not None
        return self.done

    def cancel(self) -> Optional[Done]:
        """Cancel the request and read the stream to its end. Returns the ``done``."""
        if self._finished:
            return self.done
        self.client.cancel(self.request_id)
        for _ in self:
            pass
        return self.done

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
