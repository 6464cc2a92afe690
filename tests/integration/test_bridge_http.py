"""The bridge's HTTP stack (aiohttp) as clients meet it: chunked request bodies,
a bridge that stops while a stream runs, many streams at once on one process."""

from __future__ import annotations

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
