"""Client and AsyncClient over a real ZeroMQ socket, against a scripted fake daemon in a thread (no model):
handshake, streaming, routing, terminal errors, timeouts and a missing daemon."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Optional

import pytest
import zmq

from tandem.client import (
    AsyncClient,
    Client,
    DaemonNotRunning,
    DaemonTimeout,
    InvalidRequest,
    QueueFull,
    RequestFailed,
    TandemError,
)
from tandem.protocol import (
    PROTOCOL_VERSION,
    Busy,
    CacheClear,
    CacheCleared,
    Cancel,
    CancelReply,
    Chunk,
    Complete,
    Done,
    Error,
    ErrorCode,
    FinishReason,
    Generate,
    Hello,
    HelloReply,
    Message,
    PromptProgress,
    Shutdown,
    ShutdownReply,
    Status,
    StatusReply,
    Timings,
    Tokenize,
    Tokenized,
    Usage,
    decode,
    encode,
    endpoint,
)

Reply = Message | list | float  # a message, raw frames to send as they are, or seconds to pause
Script = Callable[[Message], Optional[Iterable[Reply]]]

SHORT = 0.3  # seconds: the timeout of the tests that wait for a daemon that does not answer


def hello_reply(msg: Hello) -> HelloReply:
    return HelloReply(
        id=msg.id, protocol_version=list(PROTOCOL_VERSION), daemon_version="0.0-fake", model="fake-model", n_ctx=512
    )


def done(request_id: str, text: str, reason: FinishReason = FinishReason.STOP, tokens: int = 1) -> Done:
    return Done(
        id=request_id,
        text=text,
        finish_reason=reason,
        usage=Usage(4, tokens),
        timings=Timings(0.01, 0.01, 0.02, 50.0, 0.0),
    )


def chunks_then_done(request_id: str, *texts: str) -> list[Message]:
    out: list[Message] = [Chunk(id=request_id, text=t, token_ids=[i]) for i, t in enumerate(texts)]
    return out + [done(request_id, "".join(texts), tokens=len(texts))]


def status_reply(request_id: str) -> StatusReply:
    return StatusReply(
        id=request_id,
        state="ready",
        daemon_version="0.0-fake",
        pid=4242,
        uptime_seconds=1.5,
        socket_path="/fake",
        model=None,
        active=None,
        queue_length=2,
        max_queue=16,
        requests={"done_stop": 3},
        tokens={"prompt": 10, "completion": 20},
        memory_rss_bytes={"daemon": 1},
        worker_pids={"target": 4243},
        worker_restarts=0,
    )


class FakeDaemon:
    """A ROUTER socket on a short ipc:// path, in a thread. It answers hello itself (unless
    ``hello`` says otherwise: None = never) and every other decoded request with ``script(request)``'s
    replies (a float in them pauses that many seconds); ``received`` lists the requests in arrival order."""

    def __init__(self, script: Script, hello: Optional[Callable[[Hello], Reply]] = hello_reply):
        self.dir = Path(tempfile.mkdtemp(prefix="tdm-fake-", dir="/tmp"))  # a Unix socket path has <= 107 bytes
        self.socket_path = self.dir / "d.sock"
        self.script = script
        self.hello = hello
        self.received: list[Message] = []
        self.failures: list[BaseException] = []
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint(self.socket_path))
        self._thread = threading.Thread(target=self._serve, name="fake-daemon", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(10):
                continue
            identity, *frames = self._sock.recv_multipart()
            try:
                msg = decode(frames)
                self.received.append(msg)
                if isinstance(msg, Hello):
                    replies = [] if self.hello is None else [self.hello(msg)]
                else:
                    replies = self.script(msg) or []
                for reply in replies:
                    if isinstance(reply, float):
                        time.sleep(reply)
                    else:
                        self._sock.send_multipart([identity, *(reply if isinstance(reply, list) else encode(reply))])
            except BaseException as exc:  # reported by the fixture: a broken script must fail its test
                self.failures.append(exc)
        self._sock.close(linger=0)

    def requests(self, cls: type) -> list:
        return [m for m in self.received if isinstance(m, cls)]

    def wait_for(self, cls: type, timeout: float = 2.0) -> list:
        deadline = time.monotonic() + timeout
        while not self.requests(cls) and time.monotonic() < deadline:
            time.sleep(0.005)
        return self.requests(cls)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def fake_daemon():
    """Factory: fake_daemon(script, hello=...) -> a running FakeDaemon, stopped at teardown."""
    started: list[FakeDaemon] = []

    def start(script: Script = lambda msg: None, **kw) -> FakeDaemon:
        d = FakeDaemon(script, **kw)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()
    for d in started:
        assert not d.failures, d.failures


def streams_hello(msg: Message):
    """Generate/Complete: three chunks "Hel", "lo", "!" then done."""
    if isinstance(msg, (Generate, Complete)):
        return chunks_then_done(msg.id, "Hel", "lo", "!")
    return None


def interleaves_two(script_state: list):
    """Holds the first generate; on the second, answers both with their replies interleaved."""

    def script(msg: Message):
        if not isinstance(msg, Generate):
            return None
        script_state.append(msg)
        if len(script_state) < 2:
            return None
        a, b = (m.id for m in script_state)
        return [
            Chunk(id=b, text="b1", token_ids=[1]),
            Chunk(id=a, text="a1", token_ids=[2]),
            Chunk(id=b, text="b2", token_ids=[3]),
            done(a, "a1"),
            Chunk(id=a, text="late", token_ids=[9]),
            done(b, "b1b2", tokens=2),
        ]

    return script


# --------------------------------------------------------------------------- Client: connection


def test_connect_handshakes_once_and_keeps_the_servers_hello(fake_daemon):
    d = fake_daemon()
    with Client(d.socket_path, timeout=5) as c:
        reply = c.connect()
        assert isinstance(reply, HelloReply)
        assert (reply.model, reply.n_ctx, reply.daemon_version) == ("fake-model", 512, "0.0-fake")
        assert c.server is reply
        assert c.connect() is reply
    hellos = d.requests(Hello)
    assert len(hellos) == 1
    assert hellos[0].protocol_version == list(PROTOCOL_VERSION) and hellos[0].client_name == "tandem-python"
    assert c.server is None and c._sock is None  # leaving the block closed it


def test_a_daemon_refusing_the_protocol_version_raises_request_failed(fake_daemon):
    refuse = lambda m: Error.of(m.id, ErrorCode.UNSUPPORTED_VERSION, "this daemon speaks 2.x")  # noqa: E731
    d = fake_daemon(hello=refuse)
    with Client(d.socket_path, timeout=5) as c:
        with pytest.raises(RequestFailed) as info:
            c.connect()
        assert (info.value.code, info.value.name) == (103, "UNSUPPORTED_VERSION")
        assert "2.x" in str(info.value)
        assert c.server is None


def test_counting_with_1_12_options_on_an_older_daemon_is_refused_not_miscounted(fake_daemon):
    """A 1.11 daemon would count the prompt without tool_choice or the reasoning controls: a wrong
    count, silently. The client refuses before sending; a count without them still goes."""
    old = lambda m: dataclasses.replace(hello_reply(m), protocol_version=[1, 11])  # noqa: E731
    tokens = lambda m: [Tokenized(id=m.id, tokens=[1, 2])]  # noqa: E731
    d = fake_daemon(tokens, hello=old)
    chat = [{"role": "user", "content": "hi"}]
    with Client(d.socket_path, timeout=5) as c:
        with pytest.raises(InvalidRequest, match=r"protocol 1\.11.*think, reasoning_effort.*tandem service restart"):
            c.count_tokens(messages=chat, think=True, reasoning_effort="low")
        assert c.count_tokens(messages=chat, temperature=0.5) == 2
    assert len(d.requests(Tokenize)) == 1

    async def aio():
        async with AsyncClient(d.socket_path, timeout=5) as c:
            with pytest.raises(InvalidRequest, match="tool_choice"):
                await c.count_tokens(messages=chat, tool_choice="none")

    asyncio.run(aio())


def test_no_socket_file_raises_daemon_not_running_naming_the_path(tmp_path):
    missing = tmp_path / "nobody.sock"
    with Client(missing, timeout=5) as c:
        with pytest.raises(DaemonNotRunning, match="tandem serve") as info:
            c.connect()
        assert str(missing) in str(info.value)
        with pytest.raises(DaemonNotRunning):
            c.generate(prompt="hi")
        assert c._sock is None


def test_a_socket_nobody_answers_on_raises_daemon_not_running_after_the_connect_timeout(fake_daemon):
    d = fake_daemon(hello=None)
    with Client(d.socket_path, timeout=5, connect_timeout=SHORT) as c:
        t0 = time.monotonic()
        with pytest.raises(DaemonNotRunning, match="nothing answers"):
            c.connect()
        assert SHORT * 0.8 <= time.monotonic() - t0 < SHORT + 2
        assert c._sock is None and c.server is None


# --------------------------------------------------------------------------- Client: streams


def test_a_streamed_generate_yields_the_chunks_in_order_then_done(fake_daemon):
    d = fake_daemon(streams_hello)
    with Client(d.socket_path, timeout=5) as c:
        stream = c.generate(prompt="say hello", max_tokens=3, temperature=0.0, request_id="g-1")
        assert stream.request_id == "g-1"
        assert [ch.text for ch in stream] == ["Hel", "lo", "!"]
        assert stream.text == "Hello!"
        assert stream.done.text == "Hello!" and stream.done.finish_reason is FinishReason.STOP
        assert stream.done.usage.completion_tokens == 3
        assert list(stream) == []  # finished: iterating again yields nothing
    (req,) = d.requests(Generate)
    assert (req.id, req.prompt, req.max_tokens, req.temperature, req.stream) == ("g-1", "say hello", 3, 0.0, True)


def reads_then_streams(m):
    """A daemon reading a long prompt (progress chunks, asked for or not) and then answering."""
    if not isinstance(m, Generate):
        return None
    reading = [PromptProgress(total=9, cached=0, processed=n, seconds=n / 3) for n in (3, 6)]
    return [Chunk(id=m.id, text="", token_ids=[], progress=p) for p in reading] + chunks_then_done(
        m.id, "whole ", "answer"
    )


def test_complete_is_streamed_underneath_so_a_long_prompt_is_not_silence(fake_daemon):
    """The client's timeout is for each reply: complete() asks for the stream and the prompt's progress
    (a 32k-token prompt takes minutes to read on a laptop) and returns the done. A client that waits
    forever asks for no stream."""
    d = fake_daemon(reads_then_streams)
    with Client(d.socket_path, timeout=5) as c:
        result = c.complete(messages=[{"role": "user", "content": "Hi"}])
    assert result.text == "whole answer"
    (req,) = d.requests(Generate)
    assert req.stream and req.progress and req.messages[0].content == "Hi"
    with Client(d.socket_path, timeout=None) as c:
        assert c.complete(prompt="Hi").text == "whole answer"
    assert d.requests(Generate)[-1].stream is False


def test_a_stream_shows_progress_chunks_only_to_who_asked_for_them(fake_daemon):
    d = fake_daemon(reads_then_streams)
    with Client(d.socket_path, timeout=5) as c:
        assert [ch.text for ch in c.generate(prompt="Hi")] == ["whole ", "answer"]
        assert [ch.progress.processed for ch in c.generate(prompt="Hi", progress=True) if ch.progress] == [3, 6]
        quiet = c.generate(prompt="Hi", stream=False)
        assert list(quiet) == [] and quiet.done.text == "whole answer"
        s = c.generate(prompt="Hi")
        assert s.next_chunk(5).text == "whole " and s.next_chunk(5).text == "answer" and s.next_chunk(5) is None
    assert all(r.progress and r.stream for r in d.requests(Generate))

    async def from_asyncio():
        async with AsyncClient(d.socket_path, timeout=5) as ac:
            return [ch.text async for ch in await ac.generate(prompt="Hi")]

    assert asyncio.run(from_asyncio()) == ["whole ", "answer"]


def test_infill_sends_complete_with_prefix_and_suffix_and_streams_it(fake_daemon):
    d = fake_daemon(streams_hello)
    with Client(d.socket_path, timeout=5) as c:
        assert c.infill("def f():\n    return ", "\n", max_lines=1).wait().text == "Hello!"
    (req,) = d.requests(Complete)
    assert (req.prefix, req.suffix, req.max_lines) == ("def f():\n    return ", "\n", 1)


def test_replies_of_two_streams_on_one_client_reach_their_own_stream(fake_daemon):
    d = fake_daemon(interleaves_two([]))
    with Client(d.socket_path, timeout=5) as c:
        a = c.generate(prompt="a")
        b = c.generate(prompt="b")
        assert [ch.text for ch in a] == ["a1"] and a.done.text == "a1"
        assert [ch.text for ch in b] == ["b1", "b2"] and b.done.text == "b1b2"
        assert a.request_id not in c._router.buffers  # the chunk after a's done was dropped


def test_an_invalid_request_is_refused_before_anything_is_sent(fake_daemon):
    d = fake_daemon(streams_hello)
    with Client(d.socket_path, timeout=5) as c:
        with pytest.raises(InvalidRequest, match="'top_p'"):
            c.generate(prompt="x", top_p=2.0)
        assert c.generate(prompt="y").wait().text == "Hello!"  # the client stays usable
    assert [m.prompt for m in d.requests(Generate)] == ["y"]


@pytest.mark.parametrize("name", ["generate", "infill"])
def test_an_error_reply_raises_request_failed_with_its_code(fake_daemon, name):
    d = fake_daemon(
        lambda m: (
            [Error.of(m.id, ErrorCode.FIM_UNSUPPORTED, "the model has no FIM tokens")]
            if isinstance(m, (Generate, Complete))
            else None
        )
    )
    with Client(d.socket_path, timeout=5) as c:
        stream = getattr(c, name)("x")
        with pytest.raises(RequestFailed) as info:
            next(stream)
        assert (info.value.code, info.value.name, info.value.request_id) == (108, "FIM_UNSUPPORTED", stream.request_id)
        assert list(stream) == [] and stream.done is None


def test_an_error_after_some_chunks_ends_the_stream_with_request_failed(fake_daemon):
    def script(m):
        if isinstance(m, Generate):
            return [Chunk(id=m.id, text="par", token_ids=[1]), Error.of(m.id, ErrorCode.WORKER_DIED, "it died")]
        return None

    d = fake_daemon(script)
    with Client(d.socket_path, timeout=5) as c:
        stream = c.generate(prompt="x")
        assert next(stream).text == "par"
        with pytest.raises(RequestFailed, match="WORKER_DIED"):
            next(stream)
        assert stream.text == "par"


def test_an_error_without_an_id_reaches_the_waiting_request(fake_daemon):
    d = fake_daemon(
        lambda m: [Error.of(None, ErrorCode.MALFORMED_MESSAGE, "no readable id")] if isinstance(m, Generate) else None
    )
    with Client(d.socket_path, timeout=5) as c:
        with pytest.raises(RequestFailed) as info:
            c.complete(prompt="x")
    assert info.value.code == 100 and info.value.request_id is None


def test_busy_raises_queue_full_with_the_queue(fake_daemon):
    d = fake_daemon(
        lambda m: (
            [Busy(id=m.id, queue_length=9, max_queue=8, message="the queue is full; retry")]
            if isinstance(m, Generate)
            else None
        )
    )
    with Client(d.socket_path, timeout=5) as c:
        with pytest.raises(QueueFull, match="retry") as info:
            c.complete(prompt="x")
    assert (info.value.queue_length, info.value.max_queue) == (9, 8)


def test_a_reply_the_client_cannot_read_raises_tandem_error(fake_daemon):
    d = fake_daemon(lambda m: [[b"chunk", b"\xc1"]] if isinstance(m, Generate) else None)
    with Client(d.socket_path, timeout=5) as c:
        with pytest.raises(TandemError, match="cannot read"):
            next(c.generate(prompt="x"))


def test_a_daemon_that_never_answers_raises_daemon_timeout_after_the_timeout(fake_daemon):
    d = fake_daemon()  # answers hello, nothing else
    with Client(d.socket_path, timeout=SHORT) as c:
        stream = c.generate(prompt="x")
        t0 = time.monotonic()
        with pytest.raises(DaemonTimeout, match=f"within {SHORT} s"):
            next(stream)
        assert SHORT * 0.8 <= time.monotonic() - t0 < SHORT + 2
        with pytest.raises(DaemonTimeout):  # status waits connect_timeout; make it short too
            c.connect_timeout = SHORT
            c.status()


@pytest.mark.slow  # seconds, no model: out of the fast subset
def test_replies_for_other_requests_do_not_extend_the_timeout(fake_daemon):
    def script(m):
        if isinstance(m, Generate) and m.prompt == "chatty":  # 1 s of chunks, then done
            return [Chunk(id=m.id, text=".", token_ids=[1]), 0.05] * 20 + [done(m.id, "." * 20)]
        return None  # "silent": never answered

    d = fake_daemon(script)
    with Client(d.socket_path, timeout=SHORT) as c:
        chatty = c.generate(prompt="chatty")
        silent = c.generate(prompt="silent")
        t0 = time.monotonic()
        with pytest.raises(DaemonTimeout):
            next(silent)
        assert time.monotonic() - t0 < SHORT + 0.6  # the chatty stream goes on for 1 s
        assert chatty.wait().text == "." * 20  # its chunks were kept meanwhile


def test_next_chunk_times_out_and_the_stream_goes_on(fake_daemon):
    gate = threading.Event()

    def script(m):
        if isinstance(m, Generate):
            gate.wait(5)  # holds the daemon until the client has timed out once
            return chunks_then_done(m.id, "late")
        return None

    d = fake_daemon(script)
    with Client(d.socket_path, timeout=5) as c:
        stream = c.generate(prompt="x")
        with pytest.raises(DaemonTimeout):
            stream.next_chunk(0.1)
        gate.set()
        assert stream.next_chunk(5).text == "late"
        assert stream.next_chunk(5) is None and stream.done.text == "late"
        assert stream.next_chunk(5) is None


# --------------------------------------------------------------------------- Client: cancel, status, control


def test_stream_cancel_sends_cancel_and_reads_to_the_cancelled_done(fake_daemon):
    def script(m):
        if isinstance(m, Generate):
            return [Chunk(id=m.id, text="x", token_ids=[1])]
        if isinstance(m, Cancel):
            return [
                CancelReply(id=m.id, request_id=m.request_id, found=True),
                done(m.request_id, "x", FinishReason.CANCELLED),
            ]
        return None

    d = fake_daemon(script)
    with Client(d.socket_path, timeout=5) as c:
        stream = c.generate(prompt="x")
        result = stream.cancel()
        assert result is stream.done and result.finish_reason is FinishReason.CANCELLED
        assert stream.text == "x"  # the chunk that came before the cancel reply was buffered, not lost
        assert stream.cancel() is result
    (cancel,) = d.requests(Cancel)
    assert cancel.request_id == stream.request_id


def test_closing_an_unfinished_stream_cancels_it_without_waiting(fake_daemon):
    d = fake_daemon()
    with Client(d.socket_path, timeout=5) as c:
        with c.generate(prompt="x") as stream:
            pass
        (cancel,) = d.wait_for(Cancel)
        assert cancel.request_id == stream.request_id
        assert stream.request_id not in c._router.buffers and list(stream) == []


def test_cancel_returns_whether_the_daemon_found_the_request(fake_daemon):
    d = fake_daemon(
        lambda m: (
            [CancelReply(id=m.id, request_id=m.request_id, found=m.request_id == "known")]
            if isinstance(m, Cancel)
            else None
        )
    )
    with Client(d.socket_path, timeout=5) as c:
        assert c.cancel("known") is True
        assert c.cancel("unknown") is False


def test_status_cache_clear_and_shutdown_return_their_replies(fake_daemon):
    def script(m):
        if isinstance(m, Status):
            return [status_reply(m.id)]
        if isinstance(m, CacheClear):
            return [CacheCleared(id=m.id, pages=3, bytes=3 * 4096)]
        if isinstance(m, Shutdown):
            return [ShutdownReply(id=m.id)]
        return None

    d = fake_daemon(script)
    with Client(d.socket_path, timeout=5) as c:
        st = c.status()
        assert (st.state, st.pid, st.queue_length) == ("ready", 4242, 2)
        assert (st.requests, st.worker_pids) == ({"done_stop": 3}, {"target": 4243})
        cleared = c.cache_clear()
        assert (cleared.pages, cleared.bytes, cleared.cache) == (3, 12288, None)
        assert c.shutdown() is None
        assert c._router.buffers == {}  # each answered request is forgotten
    assert [type(m) for m in d.received] == [Hello, Status, CacheClear, Shutdown]


def test_a_shutdown_refused_with_an_error_raises_request_failed(fake_daemon):
    d = fake_daemon(
        lambda m: [Error.of(m.id, ErrorCode.SHUTTING_DOWN, "already stopping")] if isinstance(m, Shutdown) else None
    )
    with Client(d.socket_path, timeout=5) as c:
        with pytest.raises(RequestFailed, match="SHUTTING_DOWN"):
            c.shutdown()


# --------------------------------------------------------------------------- AsyncClient


def test_async_streamed_generate_yields_the_chunks_in_order_then_done(fake_daemon):
    d = fake_daemon(streams_hello)

    async def main():
        async with AsyncClient(d.socket_path, timeout=5) as c:
            assert c.server.model == "fake-model"
            stream = await c.generate(prompt="say hello", max_tokens=3)
            texts = [ch.text async for ch in stream]
            return texts, stream.text, stream.done

    texts, text, result = asyncio.run(main())
    assert texts == ["Hel", "lo", "!"] and text == "Hello!"
    assert result.text == "Hello!" and result.finish_reason is FinishReason.STOP
    (req,) = d.requests(Generate)
    assert req.prompt == "say hello" and req.max_tokens == 3


def test_async_error_reply_raises_request_failed(fake_daemon):
    d = fake_daemon(
        lambda m: (
            [Error.of(m.id, ErrorCode.PROMPT_TOO_LONG, "too long (--ctx-size)")] if isinstance(m, Generate) else None
        )
    )

    async def main():
        async with AsyncClient(d.socket_path, timeout=5) as c:
            stream = await c.generate(prompt="x")
            with pytest.raises(RequestFailed) as info:
                await stream.wait()
            return info.value, stream

    err, stream = asyncio.run(main())
    assert (err.code, err.name, err.request_id) == (105, "PROMPT_TOO_LONG", stream.request_id)
    assert stream._finished and stream.done is None


def test_async_busy_raises_queue_full(fake_daemon):
    d = fake_daemon(
        lambda m: [Busy(id=m.id, queue_length=3, max_queue=2, message="full")] if isinstance(m, Generate) else None
    )

    async def main():
        async with AsyncClient(d.socket_path, timeout=5) as c:
            with pytest.raises(QueueFull) as info:
                await c.complete(prompt="x")
            return info.value

    err = asyncio.run(main())
    assert (err.queue_length, err.max_queue) == (3, 2)
    assert d.requests(Generate)[0].progress  # (complete is streamed underneath: heard_often)


def test_async_concurrent_streams_each_get_their_own_replies(fake_daemon):
    d = fake_daemon(interleaves_two([]))

    async def main():
        async with AsyncClient(d.socket_path, timeout=5) as c:
            a = await c.generate(prompt="a")
            b = await c.generate(prompt="b")

            async def read(s):
                return [ch.text async for ch in s], s.done.text

            return await asyncio.gather(read(a), read(b))

    assert asyncio.run(main()) == [(["a1"], "a1"), (["b1", "b2"], "b1b2")]


def test_async_status_and_cancel(fake_daemon):
    def script(m):
        if isinstance(m, Status):
            return [status_reply(m.id)]
        if isinstance(m, Cancel):
            return [CancelReply(id=m.id, request_id=m.request_id, found=False)]
        return None

    d = fake_daemon(script)

    async def main():
        async with AsyncClient(d.socket_path, timeout=5) as c:
            return (await c.status()).pid, await c.cancel("gone")

    assert asyncio.run(main()) == (4242, False)


def test_async_daemon_that_never_answers_raises_daemon_timeout(fake_daemon):
    d = fake_daemon()

    async def main():
        async with AsyncClient(d.socket_path, timeout=SHORT) as c:
            stream = await c.generate(prompt="x")
            t0 = time.monotonic()
            with pytest.raises(DaemonTimeout, match=f"within {SHORT} s"):
                await stream.__anext__()
            return time.monotonic() - t0

    assert SHORT * 0.8 <= asyncio.run(main()) < SHORT + 2


def test_async_missing_or_silent_daemon_raises_daemon_not_running(fake_daemon, tmp_path):
    silent = fake_daemon(hello=None)

    async def connect(path):
        c = AsyncClient(path, timeout=5, connect_timeout=SHORT)
        try:
            with pytest.raises(DaemonNotRunning) as info:
                await c.connect()
            assert c._sock is None and c.server is None
            return str(info.value)
        finally:
            c.close()

    assert "tandem serve" in asyncio.run(connect(tmp_path / "nobody.sock"))
    assert "nothing answers" in asyncio.run(connect(silent.socket_path))
