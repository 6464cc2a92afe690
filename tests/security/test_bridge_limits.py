"""Hostile HTTP input to the bridge: every case gets a 4xx in OpenAI's error shape
(not a dropped connection, not a buffered body past the limit), idle connections
are closed, and the number of connections is bounded."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlparse

import pytest


@pytest.fixture(scope="module")
def bridge(bridge_process, daemon):
    """With its defaults (what a user runs)."""
    b = bridge_process(daemon)
    yield b
    assert b.stop() == 0, "".join(b.lines)


@pytest.fixture(scope="module")
def tight(bridge_process, daemon):
    """With a short idle timeout and few connections, so the tests of those are quick."""
    b = bridge_process(daemon, "--idle-timeout", "1", "--max-connections", "3")
    yield b
    assert b.stop() == 0, "".join(b.lines)


def connect(bridge) -> socket.socket:
    url = urlparse(bridge.url)
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    return sock


def exchange(bridge, head: bytes, body: bytes = b"") -> tuple[int, dict]:
    with connect(bridge) as sock:
        sock.sendall(head + body)
        status, _, answer = _answer(sock)
    return status, json.loads(answer or b"{}")


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def post(body: bytes, length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % n
    )


def test_a_negative_content_length_is_a_400_and_nothing_is_buffered(bridge):
    status, body = exchange(bridge, post(b"", length=-1), b"x" * 100_000)
    assert status == 400 and "Content-Length" in body["error"]["message"]


def test_json_nested_too_deep_is_a_400(bridge):
    deep = b"[" * 100_000 + b"]" * 100_000
    status, body = exchange(bridge, post(deep), deep)
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


def test_a_number_too_large_to_send_is_a_400(bridge):
    raw = json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 10**400}
    ).encode()
    status, body = exchange(bridge, post(raw), raw)
    assert status == 400 and body["error"]["message"]


def test_an_idle_connection_is_closed(tight):
    with connect(tight) as sock:
        started = time.monotonic()
        sock.settimeout(10)
        assert sock.recv(1) == b""  # the bridge closed it
        assert time.monotonic() - started < 5


def test_connections_beyond_the_limit_get_503_and_the_bridge_recovers(tight):
    bridge = tight
    held = [connect(bridge) for _ in range(3)]
    try:
        time.sleep(0.2)
        with connect(bridge) as extra:
            reply = extra.recv(4096)
        assert reply.startswith(b"HTTP/1.1 503") and b"too_many_connections" in reply
    finally:
        for s in held:
            s.close()
    time.sleep(1.5)  # the held connections are closed
    status, _ = exchange(bridge, b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert status == 200


def _answer(sock: socket.socket) -> tuple[int, dict, bytes]:
    """One whole answer: (status, headers, body)."""
    data = b""
    while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + _length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    return int(lines[0].split(" ", 2)[1]), headers, body


def test_a_body_that_cannot_be_read_is_a_400_with_no_traceback(bridge):
    """A Content-Encoding that lies, and chunks that do not parse: the client's fault, answered as such."""
    raw = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    head = post(raw).replace(b"Content-Type", b"Content-Encoding: gzip\r\nContent-Type")
    status, body = exchange(bridge, head, raw)
    assert status == 400 and "cannot be read" in body["error"]["message"]
    chunked = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"
    )
    status, body = exchange(bridge, chunked)
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    with connect(bridge) as sock:  # the bad chunk after the headers, as the body is being read: 400, not a hang
        sock.sendall(chunked.split(b"zz")[0] + b'5\r\n{"con\r\n')
        time.sleep(0.3)
        sock.sendall(b"zz\r\nxx\r\n0\r\n\r\n")
        sock.settimeout(10)
        status, _, answer = _answer(sock)
    assert status == 400 and "cannot be read" in json.loads(answer)["error"]["message"]
    time.sleep(0.2)
    assert not any("Traceback" in line for line in bridge.lines), "".join(bridge.lines)


def test_expect_100_continue_is_answered_before_the_body(bridge):
    """What curl sends before a body over 1 MiB: without the interim answer it waits a second, every time."""
    raw = json.dumps({"content": "hello " * 200_000}).encode()
    with connect(bridge) as sock:
        sock.sendall(
            b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Expect: 100-continue\r\nContent-Length: %d\r\n\r\n" % len(raw)
        )
        sock.settimeout(5)
        interim = sock.recv(25)  # (within the timeout: no body has been sent yet)
        assert interim.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"), interim
        sock.sendall(raw)
        status, _, body = _answer(sock)
    assert status == 200 and len(json.loads(body)["tokens"]) >= 200_000


def test_methods_the_bridge_does_not_serve_get_405_with_allow(bridge):
    for head, allow in (
        (b"PUT /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n", "POST"),
        (b"DELETE /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", "POST"),
        (b"OPTIONS /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://127.0.0.1\r\n\r\n", "GET, HEAD"),
        (b"GET /api/delete HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", "DELETE, POST"),
    ):
        with connect(bridge) as sock:
            sock.sendall(head)
            status, headers, body = _answer(sock)
        assert status == 405 and headers["allow"] == allow, head
        error = json.loads(body)["error"]  # (Ollama's shape for /api: a string)
        assert (error if isinstance(error, str) else error["message"]).startswith("no route")
    with connect(bridge) as sock:  # a path that is not served at all: 404, whatever the method
        sock.sendall(b"PUT /nowhere HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n")
        assert _answer(sock)[0] == 404


def test_an_empty_body_is_a_400_and_no_length_a_411(bridge):
    status, body = exchange(bridge, post(b""))
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = exchange(
        bridge, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\r\n"
    )
    assert status == 411 and "Content-Length" in body["error"]["message"]


def test_head_answers_without_a_body(bridge):
    with connect(bridge) as sock:
        sock.sendall(b"HEAD / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        sock.settimeout(5)
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and rest == b""
