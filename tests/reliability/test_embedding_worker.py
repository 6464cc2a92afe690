"""The embedding worker dies at any moment, and the daemon does not: killed while it
loads (loaded again), killed while it computes a request (that request gets
WORKER_DIED, generation goes on, the next embed works once it is back, the restart
is counted), and a file it cannot load (embeddings off, said why, the daemon
serves on)."""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request

import pytest

from tandem.client import RequestFailed
from tandem.protocol import ErrorCode

BIG = ["The quick brown fox jumps over the lazy dog, again and again. " * 20 + str(i) for i in range(256)]


def wait_for(predicate, timeout: float = 120.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def metric(addr: str, line_start: str) -> float:
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(line_start + " "):
                return float(line.split()[-1])
    raise AssertionError(f"{line_start} not exported")


def test_killed_while_loading_and_mid_request_the_daemon_serves_on(start_daemon, coder_path):
    # Qwen2.5-Coder-0.5B as the embedding model: it loads for seconds, and 256 long inputs take minutes
    d = start_daemon("--ctx-size", "1024", "--embedding-model", str(coder_path), wait=False)
    with d.client(connect_timeout=10) as c:
        pid = wait_for(lambda: d.socket.exists() and c.status().worker_pids.get("embedding"), what="its worker")
        assert "(loading)" in c.status().embedding
        os.kill(pid, signal.SIGKILL)  # while it loads
        d.wait_ready(400)  # (a session's first daemon runs the target's load probe: minutes on a busy machine)
        st = wait_for(lambda: (s := c.status()).embedding_model is not None and s, 180, "the embedding model")
        assert st.embedding == coder_path.name and st.worker_pids["embedding"] != pid and st.state == "ready"

        outcome: dict = {}

        def embed_big():
            with d.client() as other:
                try:
                    outcome["reply"] = other.embed(BIG)
                except RequestFailed as exc:
                    outcome["error"] = exc

        t = threading.Thread(target=embed_big)
        t.start()
        time.sleep(1.5)  # it is computing (minutes of work)
        os.kill(st.worker_pids["embedding"], signal.SIGKILL)
        t.join(60)
        err = outcome["error"]
        assert err.code == ErrorCode.WORKER_DIED and "embedding worker" in err.message and "retried" in err.message
        # the daemon and generation are unaffected, at once
        assert c.status().state == "ready"
        assert c.complete(prompt="Hello", max_tokens=4, temperature=0).usage.completion_tokens == 4
        wait_for(lambda: c.status().embedding_model is not None, 180, "the restarted embedding model")
        assert len(c.embed(["back again"]).embeddings) == 1
        st = c.status()
        assert st.worker_restarts >= 2 and st.requests["embed_error"] >= 1
        assert metric(st.metrics_addr, 'tandem_worker_restarts_total{role="embedding"}') == 2
        assert metric(st.metrics_addr, 'tandem_embedding_requests_total{outcome="error"}') >= 1


def test_a_file_it_cannot_load_turns_embeddings_off_and_the_daemon_serves_on(start_daemon, short_tmpdir):
    bad = short_tmpdir() / "not-a-model.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    d = start_daemon("--ctx-size", "1024", "--embedding-model", str(bad), wait=False)
    d.wait_ready(400)
    with d.client() as c:
        st = wait_for(lambda: "(off:" in (s := c.status()).embedding and s, 60, "embeddings off")
        assert st.state == "ready" and "not-a-model.gguf" in st.embedding
        with pytest.raises(RequestFailed) as info:
            c.embed("x")
        assert info.value.code == ErrorCode.NOT_READY and "embeddings are off" in info.value.message
        assert "restart the daemon" in info.value.message
        assert c.complete(prompt="Hello", max_tokens=4, temperature=0).usage.completion_tokens == 4
