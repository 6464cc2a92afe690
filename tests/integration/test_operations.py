"""Operations against the real daemon: metrics that agree with status and the
requests' own stats, systemd notification and watchdog, SIGHUP reload,
SIGTERM, and zero egress."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.client import Client, RequestFailed
from tandem.daemon.front import sdnotify
from tandem.protocol import ErrorCode

SYSTEM = "You are a terse assistant for a build system. Answer in one short sentence. " * 3


def scrape(addr: str) -> dict[tuple[str, tuple], float]:
    """Every sample of the endpoint: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        text = r.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_metrics_agree_with_status_and_with_each_requests_done(start_daemon):
    d = start_daemon("--ctx-size", "512", "--drafter", "ngram", "--draft-tokens", "4", "--cache-bytes", "32M")
    dones = []
    with d.client(timeout=None) as c:  # (no timeout: complete() asks for no stream, whose accounting is below)
        assert c.status().metrics_addr.startswith("127.0.0.1:")
        code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
        for i in range(3):  # the same start each time: prefix cache hits after the first
            dones.append(c.complete(prompt=SYSTEM + code * 2 + f"# variant {i}\ndef", max_tokens=24, temperature=0.0))
        dones.append(c.complete(prompt="Count: 1 2 3 4 5 6 7 8 9 10 11 12", max_tokens=16, temperature=0.0, draft="on"))
        dones.append(c.complete(prompt="Stop at the period. The sky is", max_tokens=40, temperature=0.0, stop=["."]))
        with pytest.raises(RequestFailed) as info:
            c.complete(prompt="word " * 2000, max_tokens=4)
        assert info.value.code == ErrorCode.PROMPT_TOO_LONG
        st = c.status()
        m = scrape(st.metrics_addr)

    # requests by how they ended
    for reason in ("stop", "length", "cancelled"):
        assert value(m, "tandem_requests_total", reason=reason) == st.requests.get(f"done_{reason}", 0)
        assert st.requests.get(f"done_{reason}", 0) == sum(x.finish_reason.value == reason for x in dones)
    assert value(m, "tandem_requests_total", reason="error") == st.requests["error"] == 1
    assert value(m, "tandem_requests_total", reason="busy") == 0
    # tokens
    assert value(m, "tandem_prompt_tokens_total") == st.tokens["prompt"] == sum(x.usage.prompt_tokens for x in dones)
    assert (
        value(m, "tandem_generated_tokens_total")
        == st.tokens["completion"]
        == sum(x.usage.completion_tokens for x in dones)
    )
    cached = sum(x.usage.cached_tokens for x in dones)
    assert cached > 0 and value(m, "tandem_cached_prompt_tokens_total") == cached
    # drafting
    rounds = sum(x.draft.rounds for x in dones if x.draft)
    assert rounds > 0 and value(m, "tandem_draft_rounds_total") == st.draft.rounds == rounds
    assert value(m, "tandem_drafted_tokens_total") == st.draft.drafted == sum(x.draft.drafted for x in dones if x.draft)
    assert (
        value(m, "tandem_accepted_tokens_total") == st.draft.accepted == sum(x.draft.accepted for x in dones if x.draft)
    )
    for i, n in enumerate(st.draft.accepted_per_position):
        if n:
            assert value(m, "tandem_accepted_tokens_by_position_total", position=str(i + 1)) == n
    assert value(m, "tandem_draft_acceptance_rate") == pytest.approx(st.draft.acceptance_rate)
    # the governor, as status last saw it
    g = st.governor
    assert value(m, "tandem_governor_drafting") == (1 if g.drafting else 0)
    if g.plain_tokens_per_second is not None:
        assert value(m, "tandem_governor_plain_tokens_per_second") == pytest.approx(g.plain_tokens_per_second)
    # latency histograms
    first_tokens = [x.timings.time_to_first_token_seconds for x in dones if x.usage.completion_tokens]
    assert value(m, "tandem_time_to_first_token_seconds_count") == len(first_tokens)
    assert value(m, "tandem_time_to_first_token_seconds_sum") == pytest.approx(sum(first_tokens))
    # complete() does not stream: each request counts its tokens after the first at their mean
    later = sum(x.usage.completion_tokens - 1 for x in dones if x.usage.completion_tokens > 1)
    assert value(m, "tandem_token_latency_seconds_count") == later
    assert value(m, "tandem_token_latency_seconds_sum") == pytest.approx(
        sum(x.timings.generation_seconds for x in dones)
    )
    assert value(m, "tandem_token_latency_seconds_bucket", le="+Inf") == value(m, "tandem_token_latency_seconds_count")
    # prefix cache
    assert value(m, "tandem_prefix_cache_hits_total") == st.cache.hits >= 2
    assert value(m, "tandem_prefix_cache_misses_total") == st.cache.misses
    assert value(m, "tandem_prefix_cache_evictions_total") == st.cache.evictions
    assert value(m, "tandem_prefix_cache_pages") == st.cache.pages
    assert value(m, "tandem_prefix_cache_bytes") == st.cache.bytes_used
    assert value(m, "tandem_prefix_cache_budget_bytes") == st.cache.bytes_budget == 32 << 20
    # the present
    assert value(m, "tandem_queue_depth") == 0 and value(m, "tandem_active_requests") == 0
    assert value(m, "tandem_ready") == 1
    assert value(m, "tandem_worker_restarts_total", role="target") == st.worker_restarts == 0
    for process in ("daemon", "target"):
        assert value(m, "tandem_resident_memory_bytes", process=process) > 10 << 20
    assert all(name.startswith("tandem_") for name, _ in m)


def test_a_worker_restart_is_counted(start_daemon):
    d = start_daemon("--ctx-size", "256")
    with d.client() as c:
        os.kill(c.status().worker_pids["target"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while c.status().worker_restarts == 0 or c.status().state != "ready":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert c.complete(prompt="Hi", max_tokens=2).usage.completion_tokens == 2
        addr = c.status().metrics_addr
        before = value(scrape(addr), "tandem_token_latency_seconds_count")
        # a streamed request: each chunk's tokens after the first chunk count their share of its gap
        chunks = [ch for ch in c.generate(prompt="Once upon a time", max_tokens=12, ignore_eos=True) if ch.token_ids]
        m = scrape(addr)
    assert value(m, "tandem_worker_restarts_total", role="target") == 1
    assert value(m, "tandem_token_latency_seconds_count") - before == 12 - len(chunks[0].token_ids)


def serve_cli(short_tmpdir, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    d = short_tmpdir()
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", "--socket", str(d / "t.sock"), "serve", "--ctx-size", "256", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_remote_metrics_address_is_refused_unless_allowed(short_tmpdir, smollm2_path, start_daemon):
    out = serve_cli(short_tmpdir, "--model", str(smollm2_path), "--metrics-addr", "0.0.0.0:9464")
    assert out.returncode == 2
    assert "not a loopback address" in out.stderr and "metrics_allow_remote" in out.stderr
    d = start_daemon("--ctx-size", "256", "--metrics-addr", "0.0.0.0:0", "--metrics-allow-remote", "on")
    assert "not loopback: other machines can read them" in d.log()


def test_a_metrics_port_in_use_names_the_fix(short_tmpdir, smollm2_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        out = serve_cli(short_tmpdir, "--model", str(smollm2_path), "--metrics-addr", f"127.0.0.1:{port}")
    finally:
        taken.close()
    assert out.returncode == 1
    assert f"cannot serve metrics on 127.0.0.1:{port}" in out.stderr and "--metrics-addr off" in out.stderr


def test_the_default_metrics_port_when_taken_falls_back_to_a_free_one(start_daemon):
    taken = socket.socket()
    try:
        taken.bind(("127.0.0.1", 9464))  # or someone else holds it already: the same situation
        taken.listen()
    except OSError:
        pass
    try:
        d = start_daemon("--ctx-size", "256", env={"TANDEM_METRICS_ADDR": ""})  # unset: the default address
        with d.client() as c:
            addr = c.status().metrics_addr
    finally:
        taken.close()
    assert addr.startswith("127.0.0.1:") and addr != "127.0.0.1:9464"
    assert "the default metrics address 127.0.0.1:9464 is in use" in d.log()
    assert value(scrape(addr), "tandem_ready") == 1


# --------------------------------------------------------------------------- systemd notification


class NotifyListener:
    """What systemd does with $NOTIFY_SOCKET: a datagram socket, read on a thread.
    When READY=1 arrives, the daemon's socket is asked for its status at once."""

    def __init__(self, directory: Path):
        self.path = directory / "notify"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(self.path))
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, dict]] = []
        self.state_at_ready: list[str] = []
        self.daemon_socket: Path | None = None
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while self.running:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            msg = sdnotify.parse(data)
            self.messages.append((time.monotonic(), msg))
            if msg.get("READY") == "1" and self.daemon_socket is not None:
                with Client(self.daemon_socket, connect_timeout=5) as c:
                    self.state_at_ready.append(c.status().state)

    def wait_for(self, key: str, count: int = 1, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while sum(key in m for _, m in self.messages) < count:
            assert time.monotonic() < deadline, f"no {key} in {self.messages}"
            time.sleep(0.05)

    def count(self, key: str) -> int:
        return sum(key in m for _, m in self.messages)

    def close(self):
        self.running = False
        self.thread.join()
        self.sock.close()


def test_notify_ready_watchdog_reload_and_stop(daemon_process, short_tmpdir, smollm2_path, arena_of):
    work = short_tmpdir()
    listener = NotifyListener(work)
    cfg = work / "config.toml"
    cfg.write_text("max_queue = 5\n")
    d = daemon_process(
        smollm2_path,
        "--ctx-size",
        "256",
        "--cache-bytes",
        "16M",
        env={"NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": "1000000", "TANDEM_CONFIG": str(cfg)},
    )
    listener.daemon_socket = d.socket
    try:
        listener.wait_for("READY")
        # READY=1 only once the models are loaded and the socket answers; the listener
        # records READY before its status request returns, so wait for that answer
        deadline = time.monotonic() + 10
        while not listener.state_at_ready and time.monotonic() < deadline:
            time.sleep(0.02)
        assert listener.state_at_ready == ["ready"]
        assert "STATUS" in listener.messages[0][1] and "loading" in listener.messages[0][1]["STATUS"]
        with d.client() as c:
            st = c.status()
            assert st.max_queue == 5
            pid, worker = st.pid, st.worker_pids["target"]
        # the watchdog is pinged from the main loop, every half period
        pings = listener.count("WATCHDOG")
        time.sleep(2.2)
        assert listener.count("WATCHDOG") - pings >= 3
        # no worker speaks for the daemon: the variables are not inherited
        assert "NOTIFY_SOCKET" not in psutil.Process(worker).environ()

        # SIGHUP: reloadable settings apply, the others are named as needing a restart
        cfg.write_text('max_queue = 2\nlog_level = "debug"\npage_tokens = 32\n')
        os.kill(pid, signal.SIGHUP)
        listener.wait_for("RELOADING")
        listener.wait_for("READY", count=2)
        with d.client() as c:
            st = c.status()
            assert st.max_queue == 2 and st.state == "ready" and st.worker_pids["target"] == worker  # models kept
        log = d.log()
        assert "max_queue 5 -> 2" in log and "log_level info -> debug" in log
        assert "page_tokens changed; restart the daemon to apply" in log
        # a broken file changes nothing
        cfg.write_text('max_queue = "lots"\n')
        os.kill(pid, signal.SIGHUP)
        listener.wait_for("RELOADING", count=2)
        listener.wait_for("READY", count=3)
        with d.client() as c:
            assert c.status().max_queue == 2
        assert "the settings did not load, nothing changed" in d.log()
        # nor does a file that is not text (it used to kill the daemon)
        cfg.write_bytes(b"max_queue = 3\n\xff\xfe\n")
        os.kill(pid, signal.SIGHUP)
        listener.wait_for("RELOADING", count=3)
        listener.wait_for("READY", count=4)
        with d.client() as c:
            assert c.status().max_queue == 2 and c.complete(prompt="Hi", max_tokens=2).usage.completion_tokens
        assert "is not UTF-8" in d.log()

        # SIGTERM: STOPPING=1, exit 0, socket and shared memory gone, no worker left
        shm = arena_of(pid)
        assert shm.exists()
        assert d.stop() == 0, d.log()
        assert listener.count("STOPPING") == 1
        assert not d.socket.exists() and not shm.exists()
        assert not psutil.pid_exists(worker)
    finally:
        d.stop()
        listener.close()
        d.cleanup()


# --------------------------------------------------------------------------- zero egress


def inet_sockets(pids: list[int]) -> list:
    out = []
    for pid in pids:
        out += [(pid, c) for c in psutil.Process(pid).net_connections(kind="inet")]
    return out


def test_zero_egress_only_unix_sockets_and_the_loopback_metrics_listener(start_daemon, smollm2_path):
    from tandem.daemon import models

    target = models.derive_f16(smollm2_path)
    # draft: on and --exact off, so that both models work during the request whatever the governor has
    # learnt on a loaded machine (it drafted nowhere once, on a busy Xeon) and whatever the load probe finds
    d = start_daemon(
        "--drafter", str(smollm2_path), "--ctx-size", "512", "--cache-bytes", "32M", "--exact", "off", model=target
    )
    with d.client() as c:
        st = c.status()
        pids = [st.pid, *st.worker_pids.values()]
        assert len(pids) == 3  # daemon, target, drafter
        stream = c.generate(prompt=SYSTEM + "Say something.", max_tokens=24, temperature=0.0, draft="on")
        seen_during = []
        for i, _ in enumerate(stream):
            if i == 2:
                seen_during = inet_sockets(pids)  # mid-request, while both models work
        assert stream.done.draft is not None and stream.done.draft.rounds > 0
        scrape(st.metrics_addr)
        after = inet_sockets(pids)
    port = int(st.metrics_addr.rpartition(":")[2])
    for pid, conn in seen_during + after:
        # the only inet socket is the metrics listener in the daemon, on loopback
        assert pid == st.pid, f"worker {pid} holds an inet socket: {conn}"
        assert conn.type == socket.SOCK_STREAM, conn
        assert conn.laddr.ip == "127.0.0.1" and conn.laddr.port == port, conn
        assert not conn.raddr or conn.raddr.ip == "127.0.0.1", conn  # an accepted scrape, never outbound
    assert any(conn.status == psutil.CONN_LISTEN for _, conn in after)
    # and every other socket of theirs is a Unix socket
    for pid in pids:
        for conn in psutil.Process(pid).net_connections(kind="all"):
            assert conn.family in (socket.AF_UNIX, socket.AF_INET, socket.AF_INET6), conn
