"""The bridge's HTTP stack (aiohttp) as clients meet it: chunked request bodies,
a bridge that stops while a stream runs, many streams at once on one process."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import threading
import time
from urllib.parse import urlparse

import openai
import pytest

from tandem.protocol import MAX_MESSAGE_BYTES

COUNTING = "Count from 1 to 1000, one number per line:\n1\n2\n3\n"


def wait_for(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _status(daemon):
    with daemon.client() as c:
        return c.status()


def _connect(bridge) -> socket.socket:
    url = urlparse(bridge.url)
    return socket.create_connection((url.hostname, url.port), timeout=30)


def _read_answer(sock: socket.socket) -> tuple[int, bytes]:
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def _chunked(payload: bytes, piece: int = 7) -> bytes:
    out = b""
    for i in range(0, len(payload), piece):
        part = payload[i : i + piece]
        out += b"%x\r\n%s\r\n" % (len(part), part)
    return out + b"0\r\n\r\n"


CHUNKED_HEAD = (
    b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
)


@pytest.fixture(scope="module")
def bridge(bridge_process, daemon):
    b = bridge_process(daemon)
    yield b
    assert b.stop() == 0, "".join(b.lines)


def test_a_chunked_body_is_read(bridge):
    """What Node's fetch and others send for a streamed body (no Content-Length)."""
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}).encode()
    with _connect(bridge) as sock:
        sock.sendall(CHUNKED_HEAD % b"/v1/completions" + _chunked(body))
        status, answer = _read_answer(sock)
    assert status == 200, answer
    reply = json.loads(answer)
    assert reply["object"] == "text_completion" and reply["usage"]["completion_tokens"] >= 1


def test_a_chunked_body_past_the_limit_is_a_413_not_buffered(bridge):
    piece = b"x" * 65536
    with _connect(bridge) as sock:
        sock.sendall(CHUNKED_HEAD % b"/v1/completions")
        sent = 0
        try:
            while sent <= MAX_MESSAGE_BYTES + 2 * len(piece):  # the bridge answers (and closes) past the limit
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                sent += len(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            status, answer = _read_answer(sock)
        except ConnectionResetError:
            pytest.fail("the bridge reset the connection instead of answering 413")
    assert status == 413, answer
    assert "limit" in json.loads(answer)["error"]["message"]


def test_a_stopping_bridge_cancels_the_stream_it_serves(bridge_process, daemon):
    b = bridge_process(daemon)
    before = _status(daemon).requests.get("done_cancelled", 0)
    stream = b.openai().completions.create(model="any", prompt=COUNTING, max_tokens=4000, temperature=0, stream=True)
    got: list[str] = []

    def read() -> None:
        try:
            got.extend(e.choices[0].text for e in stream if e.choices)
        except openai.APIConnectionError:
            pass  # the stream was cut off: what a client of a stopped server sees

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    wait_for(lambda: len(got) > 3)
    b.proc.send_signal(signal.SIGTERM)
    assert b.proc.wait(15) == 0, "".join(b.lines)
    reader.join(10)
    assert not reader.is_alive(), "the client's stream did not end with the bridge"
    wait_for(lambda: _status(daemon).requests.get("done_cancelled", 0) == before + 1, 10)
    wait_for(lambda: _status(daemon).active is None, 10)
    assert not any("Traceback" in line for line in b.lines), "".join(b.lines)


def test_many_streams_at_once(bridge_process, daemon):
    """Forty streams at once, one bridge process: all are answered (queued by the
    daemon, streamed by the bridge), with no thread per connection to run out of."""
    b = bridge_process(daemon, "--max-connections", "64")
    try:
        results: list[str] = []
        errors: list[BaseException] = []

        def one(i: int) -> None:
            try:
                api = openai.OpenAI(base_url=b.url, api_key="unused", max_retries=0, timeout=300)
                text = "".join(
                    e.choices[0].text
                    for e in api.completions.create(
                        model="any", prompt=f"{i} + {i} =", max_tokens=2, temperature=0, stream=True
                    )
                    if e.choices
                )
                results.append(text)
            except openai.RateLimitError:
                results.append("(queue full)")  # the daemon's bounded queue: a 429, which is an answer too
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(40)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors[:3]
        assert len(results) == 40
        assert sum(r != "(queue full)" for r in results) >= 8  # the daemon's queue holds at least its default
    finally:
        assert b.stop() == 0, "".join(b.lines)


# --------------------------------------------------------------------------- a stream that waits

WAITING = {  # path, body, what its keep-alive looks like, how its stream ends
    "openai": (b"/v1/chat/completions", {"model": "m"}, b": keep-alive\n\n", b"data: [DONE]"),
    "anthropic": (b"/v1/messages", {"model": "claude-x"}, b'event: ping\ndata: {"type": "ping"}', b"message_stop"),
    "ollama": (
        b"/api/chat",
        {"model": "tandem"},
        b'{"role": "assistant", "content": ""}, "done": false}',
        b'"done": true',
    ),
}


def _post_stream(bridge, path: bytes, body: dict) -> socket.socket:
    payload = json.dumps(body).encode()
    sock = _connect(bridge)
    sock.sendall(
        b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
        b"Connection: close\r\n\r\n%s" % (path, len(payload), payload)
    )
    return sock


def _read_until(sock: socket.socket, marker: bytes, data: bytes = b"") -> bytes:
    while marker not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the stream ended before {marker!r}: {data[-2000:]!r}"
        data += chunk
    return data


@pytest.fixture
def busy(bridge, daemon):
    """The daemon busy with a long generation (so the next request waits in the queue); ``busy.stop()`` ends it."""
    stream = bridge.openai().completions.create(
        model="any", prompt=COUNTING, max_tokens=4000, temperature=0, stream=True
    )
    it = iter(stream)
    next(it)  # (it runs)

    class Busy:
        @staticmethod
        def stop() -> None:
            stream.close()
            wait_for(lambda: _status(daemon).active is None, 30)

    yield Busy
    Busy.stop()


@pytest.mark.parametrize("dialect", WAITING)
def test_a_stream_that_waits_starts_at_once_and_is_kept_alive(bridge, daemon, busy, dialect):
    """An agent gives up on a server that sends nothing (Qwen Code: 120 s without headers; Claude Code and
    Codex: 300 s without a byte): a stream that waits for a long prompt, or in the queue, starts anyway and
    sends its dialect's keep-alive until its first token, then runs as any stream."""
    path, extra, keepalive, end = WAITING[dialect]
    # (more than --preempt-tokens, 512: it waits in the queue, not in the short-request lane; it ends at EOS)
    body = {**extra, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 600, "stream": True}
    with _post_stream(bridge, path, body) as sock:
        head = _read_until(sock, b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        assert _status(daemon).queue_length == 1  # (the headers came while it waited: no token of it yet)
        data = _read_until(sock, keepalive, head)
        busy.stop()
        data = _read_until(sock, end, data)
    assert data.index(keepalive) < data.index(end)


def test_a_client_that_leaves_a_waiting_stream_cancels_its_request(bridge, daemon, busy):
    before = _status(daemon).requests.get("done_cancelled", 0)
    # (not short: it waits in the queue, not in the short-request lane)
    body = {"model": "m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 600, "stream": True}
    with _post_stream(bridge, b"/v1/chat/completions", body) as sock:
        _read_until(sock, b": keep-alive")
    wait_for(lambda: _status(daemon).requests.get("done_cancelled", 0) == before + 1, 30)
    st = _status(daemon)
    assert st.queue_length == 0 and st.active is not None  # the one that left is gone; the long one runs on


def test_a_request_that_comes_while_the_model_loads_waits_for_it(start_daemon, bridge_process):
    """As Ollama's: not a 503, and not a max_tokens error from the context size of 0 a loading daemon
    reports; /v1/models answers at once meanwhile."""
    d = start_daemon("--ctx-size", "1024", wait=False, fresh_probe=True)  # (its load checks: seconds of loading)
    wait_for(lambda: d.socket.exists(), 60)
    b = bridge_process(d)
    try:
        with d.client() as c:
            loading = c.status().state == "loading"
        url = urlparse(b.url)
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=300)
        conn.request("GET", "/v1/models")
        models = conn.getresponse()
        assert models.status == 200, models.read()
        models.read()
        body = {"model": "claude-haiku-x", "max_tokens": 32000, "messages": [{"role": "user", "content": "Hi"}]}
        conn.request("POST", "/v1/messages", json.dumps(body), {"Content-Type": "application/json"})
        answer = conn.getresponse()
        reply = json.loads(answer.read())
        assert answer.status == 200, reply
        assert reply["type"] == "message" and reply["usage"]["output_tokens"] >= 1
        assert loading, "the daemon was ready before the request came: this run did not test the wait"
    finally:
        assert b.stop() == 0, "".join(b.lines)
