"""llama.cpp's RPC backend through the daemon: SmolLM2 split across two
rpc-server processes on 127.0.0.1 (`tandem serve --rpc A,B`), greedy output
identical to the same daemon without them, and the prefix cache restoring KV
that lives on the servers.

It needs llama-cpp-python built with GGML_RPC and an rpc-server from the same
llama.cpp: `bench/build_rpc.sh` builds both (and `bench/build_rpc.sh --test`
runs this file). Where either is missing the tests skip, saying so; the
start-up errors of `--rpc` without them are tested in test_devices.py."""

from __future__ import annotations

import socket
import struct
import threading
import time
from pathlib import Path

import llama_cpp
import pytest

from tandem.client import RequestFailed
from tandem.daemon.models.devices import rpc_server_binary, start_rpc_server
from tandem.protocol import ErrorCode

SYSTEM = "You are a terse assistant for a small software team. Answer in one or two sentences. " * 4
PROMPTS = [
    [{"role": "user", "content": "Name three uses of a hash map."}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "system", "content": "Answer in one sentence."}, {"role": "user", "content": "What is a mutex?"}],
]

if not llama_cpp.llama_supports_rpc():
    pytest.skip(
        "llama-cpp-python was built without llama.cpp's RPC backend: bench/build_rpc.sh rebuilds it with "
        'CMAKE_ARGS="-DGGML_RPC=on" and builds a matching rpc-server',
        allow_module_level=True,
    )


def _server_binary() -> Path:
    binary = rpc_server_binary()
    if binary is None:
        pytest.skip("no rpc-server of this llama.cpp: bench/build_rpc.sh builds one")
    return binary


@pytest.fixture(scope="module")
def rpc_servers(free_port):
    """Two rpc-servers on 127.0.0.1, each with the CPU device and 1 thread."""
    binary = _server_binary()
    ports = [free_port() for _ in range(2)]
    procs = [start_rpc_server(binary, port) for port in ports]
    try:
        yield [f"127.0.0.1:{port}" for port in ports]
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)


def _replies(d, **params) -> list:
    with d.client() as c:
        return [c.complete(messages=m, max_tokens=48, temperature=0.0, **params) for m in PROMPTS]


def _replies_to(d, messages) -> str:
    with d.client() as c:
        return c.complete(messages=messages, max_tokens=32, temperature=0.0, cache=False).text


def test_a_model_split_across_two_rpc_servers_answers_as_a_local_one(
    start_daemon, rpc_servers, tandem_cli, page_restore
):
    # (where there is a local GPU too, llama.cpp would split the layers between it and the servers)
    local = start_daemon("--ctx-size", "512", "--threads", "1", "--device", "none")
    servers = ",".join(rpc_servers)
    remote = start_daemon("--ctx-size", "512", "--threads", "1", "--rpc", servers, "--device", "RPC0,RPC1")
    with remote.client() as c:
        m = c.status().model
    rpc = {d.name: d.description for d in m.devices if d.kind == "rpc"}
    assert sorted(rpc.values()) == sorted(rpc_servers)
    # every layer on the two servers (llama.cpp splits them by the memory each reports)
    assert set(m.layers) == set(rpc) and sum(m.layers.values()) == m.n_layers == 31
    assert all(n > 0 for n in m.layers.values())
    assert any(name.startswith("RPC") for name in m.weights)
    assert "RPC" not in m.gpu_note  # RPC servers are not a GPU backend that lacks its device
    out = tandem_cli(remote.socket, "status").stdout
    assert f"({rpc_servers[0]}" in out and " on RPC" in out

    want = [r.text for r in _replies(local, cache=False)]
    got = _replies(remote, cache=False)
    assert [r.text for r in got] == want and all(r.usage.completion_tokens > 0 for r in got)
    # the prefix cache: KV copied out of the servers into pages, and back into them, with the same output
    long = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a mutex?"}]
    with remote.client() as c:
        fresh, restored, from_pages = page_restore(c, long, PROMPTS[0])
    assert restored == fresh == _replies_to(local, long) and from_pages >= 64
    assert "Traceback" not in remote.log()


def test_a_server_that_goes_away_fails_the_request_and_the_daemon_comes_back_with_it(start_daemon, free_port):
    """llama.cpp's RPC client aborts its process when a server disconnects: the
    request gets an error, the daemon lives, and its restarted target waits for
    the server, so a server started again brings it back without a restart."""
    port = free_port()
    binary = _server_binary()
    server = start_rpc_server(binary, port)
    try:
        d = start_daemon("--ctx-size", "512", "--rpc", f"127.0.0.1:{port}")
        with d.client() as c:
            want = c.complete(prompt="Hello", max_tokens=8, temperature=0.0, cache=False).text
            server.kill()
            server.wait(10)
            with pytest.raises(RequestFailed) as info:
                c.complete(prompt="Hello", max_tokens=8, temperature=0.0, cache=False)
            assert info.value.code == ErrorCode.WORKER_DIED
            deadline = time.monotonic() + 30
            while f"cannot reach the rpc-server at 127.0.0.1:{port}" not in d.log():
                assert time.monotonic() < deadline, d.log()[-3000:]
                time.sleep(0.2)
            assert "waiting up to 300 s" in d.log() and c.status().state == "loading"
            server = start_rpc_server(binary, port)
            deadline = time.monotonic() + 60
            while c.status().state != "ready":
                assert time.monotonic() < deadline, d.log()[-3000:]
                time.sleep(0.2)
            assert c.complete(prompt="Hello", max_tokens=8, temperature=0.0, cache=False).text == want
        assert d.proc.poll() is None
    finally:
        server.kill()
        server.wait(10)


def test_a_server_another_daemon_holds_is_named_busy(start_daemon, daemon_process, smollm2_path, rpc_servers):
    """An rpc-server serves one client at a time: a second daemon gets an error, not a hang."""
    first = start_daemon("--ctx-size", "512", "--rpc", rpc_servers[0])
    second = daemon_process(smollm2_path, "--ctx-size", "512", "--rpc", rpc_servers[0])
    try:
        assert second.proc.wait(60) == 1
        assert f"the rpc-server at {rpc_servers[0]} does not answer" in second.log()
        assert "serves one client at a time" in second.log()
    finally:
        second.stop()
        second.cleanup()
    with first.client() as c:  # the first one is unharmed
        assert c.complete(prompt="Hello", max_tokens=4, temperature=0.0).usage.completion_tokens > 0


def test_a_server_of_another_protocol_version_is_refused_by_name(daemon_process, smollm2_path):
    """A server that answers HELLO with another major version (a fake one here): a clear error."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]

    def answer():
        conn, _ = listener.accept()
        with conn:
            conn.recv(1 + 8 + 24)
            conn.sendall(struct.pack("<Q", 28) + bytes([6, 1, 0, 0]) + bytes(24))

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    d = daemon_process(smollm2_path, "--ctx-size", "512", "--rpc", f"127.0.0.1:{port}")
    try:
        assert d.proc.wait(60) == 1
        assert "speaks RPC protocol 6.1.0" in d.log() and "bench/build_rpc.sh" in d.log()
    finally:
        d.stop()
        d.cleanup()
        listener.close()
