"""The asyncio client, for editor and agent integrations.

    from tandem.client import AsyncClient

    async with AsyncClient() as client:
        stream = await client.generate(prompt="def fib(n):", max_tokens=64, temperature=0)
        async for chunk in stream:
            print(chunk.text, end="")
        print(stream.done.finish_reason)

Several requests may run concurrently on one AsyncClient: replies are routed
by request id, and one reader at a time owns the socket.
"""

from __future__ import annotations

import asyncio
import os
from typing import AsyncIterator, Optional, Union

import zmq
import zmq.asyncio

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


class AsyncClient:
    def __init__(
        self,
        socket_path: Optional[Union[str, os.PathLike]] = None,
        timeout: Optional[float] = 600.0,
        connect_timeout: float = 5.0,
    ):
        self.socket_path = resolve_socket(socket_path)
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.server: Optional[HelloReply] = None
        self._zctx = zmq.asyncio.Context.instance()
        self._sock: Optional[zmq.asyncio.Socket] = None
        self._monitor: Optional[zmq.asyncio.Socket] = None  # the DEALER's disconnect events
        self._router = ReplyRouter()
        self._reading = asyncio.Lock()
        self._connecting = asyncio.Lock()

    async def connect(self) -> HelloReply:
        async with self._connecting:  # concurrent first calls share one handshake
            if self._sock is not None and dropped(self._monitor):
                self._drop()  # the connection dropped while idle (the daemon restarted?): connect afresh
            if self.server is not None:
                return self.server
            return await self._handshake()

    async def _handshake(self) -> HelloReply:
        check_socket_exists(self.socket_path)
        self._sock = self._zctx.socket(zmq.DEALER)
        dealer_options(self._sock)
        self._monitor = monitor_of(self._sock)
        self._sock.connect(endpoint(self.socket_path))
        try:
            reply = await self._request(hello_request(), self.connect_timeout)
        except (DaemonTimeout, DaemonGone):  # nothing accepted the connection, or it dropped at once
            self.close()
            raise DaemonNotRunning(f"nothing answers at {self.socket_path}; {START_HINT}") from None
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
        """As Client's: the waiting requests are lost; the next one connects afresh."""
        self._router.lose_all()
        self.close()

    def _daemon_gone(self) -> DaemonGone:
        self._drop()
        return DaemonGone(gone_message(self.socket_path))

    async def __aenter__(self) -> "AsyncClient":
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    async def _send(self, msg: Message) -> None:
        if self._sock is None or dropped(self._monitor):
            await self.connect()  # the connection dropped while idle: afresh (never during the handshake)
        self._router.expect(msg.id)  # InvalidRequest for an id in use
        for attempt in (1, 2):
            assert self._sock is not None
            try:  # never blocks: a pipe that cannot take it raises instead
                await self._sock.send_multipart(encode(msg), flags=zmq.NOBLOCK)
                return
            except zmq.Again:  # it dropped since we looked: nothing was sent
                self._router.forget(msg.id)
                self._drop()
                if attempt == 2:
                    raise DaemonGone(gone_message(self.socket_path)) from None
                await self.connect()
                self._router.expect(msg.id)

    async def _recv(self, request_id: str, timeout: Optional[float]) -> Message:
        async def read() -> Message:
            while True:
                buffered = self._router.pop(request_id)
                if buffered is not None:
                    return buffered
                async with self._reading:
                    if self._router.buffers.get(request_id):
                        continue  # another reader filed our reply meanwhile
                    if self._sock is None or request_id in self._router.lost:
                        raise DaemonGone(gone_message(self.socket_path))
                    poller = zmq.asyncio.Poller()
                    poller.register(self._sock, zmq.POLLIN)
                    poller.register(self._monitor, zmq.POLLIN)
                    try:
                        events = dict(await poller.poll())
                    except asyncio.CancelledError:
                        task = asyncio.current_task()
                        if self._sock is None and task is not None and not task.cancelling():
                            raise DaemonGone(gone_message(self.socket_path)) from None  # closed under us
                        raise
                    if self._sock in events or self._sock.get(zmq.EVENTS) & zmq.POLLIN:  # replies first
                        msg = self._router.accept(await self._sock.recv_multipart(), request_id)
                    else:  # a disconnect, and nothing it sent before is left unread
                        raise self._daemon_gone()
                if msg is not None:
                    return msg

        try:
            return await asyncio.wait_for(read(), timeout)
        except asyncio.TimeoutError:
            raise DaemonTimeout(f"no reply from the daemon at {self.socket_path} within {timeout} s") from None

    async def _request(self, msg: Message, timeout: Optional[float]) -> Message:
        await self._send(msg)
        try:
            return await self._recv(msg.id, timeout)
        finally:
            self._router.forget(msg.id)

    async def generate(
        self, prompt: Optional[str] = None, messages: Optional[list[MessageLike]] = None, **params
    ) -> "AsyncStream":
        hello = await self.connect()
        req = generate_request(prompt, messages, **params)
        check_daemon_speaks(hello, req)
        hidden = heard_often(hello, req, self.timeout)  # (as Client.generate)
        await self._send(req)
        return AsyncStream(self, req.id, hidden)

    async def complete(
        self, prompt: Optional[str] = None, messages: Optional[list[MessageLike]] = None, **params
    ) -> Done:
        return await (await self.generate(prompt, messages, stream=False, **params)).wait()

    async def infill(self, prefix: str, suffix: str = "", **params) -> "AsyncStream":
        """As Client.infill: fill in the middle between ``prefix`` and ``suffix``."""
        await self.connect()
        req = complete_request(prefix, suffix, **params)
        await self._send(req)
        return AsyncStream(self, req.id)

    async def status(self) -> StatusReply:
        await self.connect()
        reply = await self._request(Status(id=new_id()), self.connect_timeout)
        raise_for_terminal(reply)
        assert isinstance(reply, StatusReply)
        return reply

    async def cache_clear(self, timeout: Optional[float] = 600.0, memory_only: bool = False) -> CacheCleared:
        """Empty the daemon's prefix cache. It happens after the running request
        (if any), before the next queued one: hence the long default timeout.
        Both tiers: the shared memory and the page files on disk; with
        ``memory_only`` the disk keeps its pages.
        ``cache`` in the reply is None when the daemon has no prefix cache."""
        await self.connect()
        reply = await self._request(CacheClear(id=new_id(), memory_only=memory_only), timeout)
        raise_for_terminal(reply)
        assert isinstance(reply, CacheCleared)
        return reply

    async def tokenize(self, text: Optional[str] = None, messages=None, tools=None, **options) -> Tokenized:
        """As Client.tokenize."""
        req = tokenize_request(text, messages, tools, **options)
        check_daemon_counts(await self.connect(), req)
        reply = await self._request(req, self.connect_timeout)
        raise_for_terminal(reply)
        assert isinstance(reply, Tokenized)
        return reply

    async def count_tokens(self, prompt: Optional[str] = None, messages=None, **params) -> int:
        """As Client.count_tokens."""
        if messages is None:
            return len((await self.tokenize(prompt or "", parse_special=True)).tokens)
        return len((await self.tokenize(messages=messages, **counted(params))).tokens)

    async def detokenize(self, tokens: list[int]) -> str:
        await self.connect()
        reply = await self._request(Detokenize(id=new_id(), tokens=list(tokens)), self.connect_timeout)
        raise_for_terminal(reply)
        assert isinstance(reply, Detokenized)
        return reply.text

    async def embed(self, input=None, tokens=None, *, timeout: Optional[float] = 600.0, **options) -> Embedded:
        """As Client.embed."""
        hello = await self.connect()
        check_daemon_embeds(hello)
        reply = await self._request(embed_request(input, tokens, **options), timeout)
        raise_for_terminal(reply)
        assert isinstance(reply, Embedded)
        return reply

    async def cancel(self, request_id: str) -> bool:
        await self.connect()
        reply = await self._request(Cancel(id=new_id(), request_id=request_id), self.connect_timeout)
        raise_for_terminal(reply)
        assert isinstance(reply, CancelReply)
        return reply.found


class AsyncStream(StreamState):
    """As Stream, for asyncio: ``async for chunk in stream``; ``await
    stream.cancel()``; ``stream.close()`` or ``async with`` abandons it."""

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self

    async def __anext__(self) -> Chunk:
        while not self._finished:
            chunk = self._take(await self.client._recv(self.request_id, self.client.timeout))
            if chunk is not None and not self._hidden(chunk):
                return chunk
        raise StopAsyncIteration

    async def wait(self) -> Done:
        async for _ in self:
            pass
        assert self.done is not None
        return self.done

    async def cancel(self) -> Optional[Done]:
        if self._finished:
            return self.done
        await self.client.cancel(self.request_id)
        async for _ in self:
            pass
        return self.done

    async def __aenter__(self) -> "AsyncStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()
