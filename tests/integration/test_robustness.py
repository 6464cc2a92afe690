"""Bad input on the live socket gets typed errors and changes nothing; the daemon
survives its worker dying; startup refuses what it cannot serve."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from tandem.client import RequestFailed
from tandem.protocol import ErrorCode, FinishReason, decode, endpoint


@pytest.fixture
def raw(daemon):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(endpoint(daemon.socket))
    yield sock
    sock.close()


def body(**fields):
    return msgpack.packb(fields, use_bin_type=True)


GARBAGE = [
    ([b"status"], ErrorCode.MALFORMED_MESSAGE),
    ([b"status", b"\xc1"], ErrorCode.MALFORMED_MESSAGE),
    ([b"", b"status", body(id="a")], ErrorCode.MALFORMED_MESSAGE),
    ([b"status", msgpack.packb("just a string")], ErrorCode.MALFORMED_MESSAGE),
    ([b"explode", body(id="a")], ErrorCode.UNKNOWN_OP),
    ([b"generate", body(id="a", prompt=7)], ErrorCode.INVALID_REQUEST),
    ([b"generate", body(id="a", prompt="x", max_tokens=-1)], ErrorCode.INVALID_REQUEST),
    ([b"generate", body(id="a", prompt="x", draft="sometimes")], ErrorCode.INVALID_REQUEST),
    ([b"hello", body(id="a", protocol_version=[2, 0])], ErrorCode.UNSUPPORTED_VERSION),
    ([b"generate", body(id="a", prompt="x" * (5 * 2**20))], ErrorCode.MESSAGE_TOO_LARGE),
]


@pytest.mark.parametrize("frames,code", GARBAGE, ids=[f"{g[1].name}-{i}" for i, g in enumerate(GARBAGE)])
def test_bad_frames_get_error_replies_and_change_nothing(raw, client, frames, code):
    before = client.status()
    raw.send_multipart(frames)
    reply = decode(raw.recv_multipart(), replies=True)
    assert reply.op.value == "error" and reply.code == code, reply
    assert reply.name == code.name and reply.message
    after = client.status()
    assert after.state == "ready" and after.queue_length == before.queue_length
    assert after.requests == before.requests
    assert client.complete(prompt="ok?", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2


def test_unsupported_version_message_says_what_to_do(raw):
    raw.send_multipart([b"hello", body(id="v", protocol_version=[9, 1])])
    reply = decode(raw.recv_multipart(), replies=True)
    assert "9.1" in reply.message and "1.x" in reply.message


def test_worker_killed_mid_request_gives_typed_error_and_is_restarted(start_daemon):
    d = start_daemon("--ctx-size", "512")
    with d.client() as c:
        pid = c.status().worker_pids["target"]
        stream = c.generate(prompt="Go on:", max_tokens=3000, ignore_eos=True)
        it = iter(stream)
        next(it)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RequestFailed) as info:
            list(it)
        assert info.value.code == ErrorCode.WORKER_DIED and "retried" in info.value.message
        # a request sent while the worker restarts waits in the queue and is served after
        done = c.complete(prompt="After the crash:", max_tokens=4, ignore_eos=True)
        assert done.usage.completion_tokens == 4
        st = c.status()
        assert st.worker_restarts == 1 and st.worker_pids["target"] != pid and st.state == "ready"
        assert st.requests["error"] == 1


def test_second_daemon_on_the_same_socket_refuses(tandem_cli, daemon, smollm2_path):
    proc = tandem_cli(daemon.socket, "serve", "--model", str(smollm2_path))
    assert proc.returncode == 1
    assert "already serving" in proc.stderr and "tandem stop" in proc.stderr
    with daemon.client() as c:
        assert c.status().state == "ready"  # the first one is untouched


@pytest.mark.parametrize(
    "model,fragment",
    [("/nonexistent/model.gguf", "model file not found"), ("no-such-preset", "unknown model")],
)
@pytest.mark.slow  # seconds, no model: out of the fast subset
def test_missing_model_is_refused_with_a_clear_message(daemon_process, model, fragment):
    d = daemon_process(model)  # type: ignore[arg-type]
    try:
        assert d.proc.wait(60) == 1
        assert fragment in d.log()
        assert not d.socket.exists()
    finally:
        d.stop()
        d.cleanup()


@pytest.mark.slow  # seconds, no model: out of the fast subset
def test_a_file_that_is_not_a_model_fails_cleanly(daemon_process, tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file" * 100)
    d = daemon_process(bogus)
    try:
        assert d.proc.wait(60) == 1
        assert f"{bogus} is not a GGUF file" in d.log()  # (read before any worker starts)
        assert not d.socket.exists()
    finally:
        d.stop()
        d.cleanup()


def test_sigterm_with_running_and_queued_requests_answers_everyone(start_daemon):
    d = start_daemon("--ctx-size", "512", "--preempt-tokens", "0")  # (a queued request, not a lane's)
    with d.client() as a, d.client() as b:
        running = a.generate(prompt="Long:", max_tokens=3000, ignore_eos=True)
        it = iter(running)
        next(it)
        queued = b.generate(prompt="Queued:", max_tokens=5)
        while a.status().queue_length < 1:
            time.sleep(0.01)
        worker = a.status().worker_pids["target"]
        d.proc.send_signal(signal.SIGTERM)
        list(it)
        assert running.done.finish_reason == FinishReason.CANCELLED
        with pytest.raises(RequestFailed) as info:
            list(queued)
        assert info.value.code == ErrorCode.SHUTTING_DOWN
    assert d.proc.wait(30) == 0
    assert not d.socket.exists()
    assert list(d.dir.glob("*.ipc")) == [] and list(d.dir.glob(".*.ipc")) == []
    with pytest.raises(ProcessLookupError):
        os.kill(worker, 0)


def test_socket_location_and_permissions(short_tmpdir, smollm2_path):
    runtime = short_tmpdir()
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    env.pop("TANDEM_SOCKET", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "serve", "--model", str(smollm2_path), "--ctx-size", "256"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        socket = runtime / "tandem" / "tandem.sock"
        deadline = time.monotonic() + 30
        while not socket.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert socket.exists()
        assert stat.S_IMODE(socket.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(socket.stat().st_mode) == 0o600
        out = subprocess.run(
            [sys.executable, "-m", "tandem.cli", "status", "--json"], env=env, capture_output=True, text=True
        )
        assert out.returncode == 0 and str(socket) in out.stdout  # the client finds it the same way
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
