"""No request goes unanswered (issue 19, items 11 and 14): requests that reach
the socket while the daemon shuts down are answered SHUTTING_DOWN; a client
whose daemon vanished (killed, or frozen) learns it within seconds as
``DaemonGone``, and the bridge answers 503; a duplicate request id never ends
another request's stream; cache clears are coalesced, never a queue in front of
the requests."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from tandem.client import Client, DaemonGone, DaemonNotRunning, InvalidRequest, RequestFailed
from tandem.client import core as client_core
from tandem.protocol import ErrorCode, FinishReason


def test_requests_sent_while_the_daemon_shuts_down_all_get_an_answer(start_daemon):
    d = start_daemon("--ctx-size", "512", "--cache-bytes", "0")
    outcomes: list[str] = []
    stop = threading.Event()

    def keep_sending():
        with Client(d.socket, timeout=30) as c:
            while not stop.is_set():
                try:
                    c.complete(prompt="Hi", max_tokens=2)
                    outcomes.append("done")
                except RequestFailed as exc:
                    outcomes.append(ErrorCode(exc.code).name)
                except (DaemonGone, DaemonNotRunning):
                    outcomes.append("gone")
                    return
                except Exception as exc:  # DaemonTimeout above all: a request left without a reply
                    outcomes.append(f"{type(exc).__name__}: {exc}")
                    return

    with d.client() as c:
        running = c.generate(prompt="Long:", max_tokens=3000, ignore_eos=True)
        it = iter(running)
        next(it)
        senders = [threading.Thread(target=keep_sending) for _ in range(3)]
        for t in senders:
            t.start()
        time.sleep(0.5)
        d.proc.send_signal(signal.SIGTERM)
        list(it)
        assert running.done.finish_reason == FinishReason.CANCELLED
        for t in senders:
            t.join(60)
        stop.set()
    assert d.proc.wait(30) == 0
    odd = [o for o in outcomes if o not in ("done", "SHUTTING_DOWN", "gone")]
    assert odd == [], odd
    assert outcomes.count("gone") == 3  # each sender ended on the closed socket, told at once
    assert "SHUTTING_DOWN" in outcomes  # requests in the shutdown window were answered


def test_a_client_learns_within_seconds_that_its_daemon_was_killed(start_daemon):
    d = start_daemon("--ctx-size", "512", "--cache-bytes", "0")
    with d.client() as c:  # (timeout 600 s: the old client waited all of it)
        running = c.generate(prompt="Long:", max_tokens=3000, ignore_eos=True)
        it = iter(running)
        next(it)
        d.proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(DaemonGone, match="went away while this request was waiting"):
            list(it)
        assert time.monotonic() - t0 < 5
        with pytest.raises(DaemonNotRunning):
            c.status()  # the next request connects afresh (and finds no daemon)


def test_a_frozen_daemon_is_noticed_by_the_heartbeat(start_daemon, monkeypatch):
    monkeypatch.setattr(client_core, "HEARTBEAT_MS", 200)
    monkeypatch.setattr(client_core, "HEARTBEAT_TIMEOUT_MS", 1000)
    d = start_daemon("--ctx-size", "512", "--cache-bytes", "0")
    with d.client() as c:
        c.status()
        running = c.generate(prompt="Long:", max_tokens=3000, ignore_eos=True)
        it = iter(running)
        next(it)
        d.proc.send_signal(signal.SIGSTOP)  # the socket stays open; nothing answers
        try:
            t0 = time.monotonic()
            with pytest.raises(DaemonGone):
                list(it)
            assert time.monotonic() - t0 < 10
        finally:
            d.proc.send_signal(signal.SIGCONT)


def test_the_bridge_answers_503_when_its_daemon_dies_mid_request(start_daemon, bridge_process):
    d = start_daemon("--ctx-size", "512", "--cache-bytes", "0")
    bridge = bridge_process(d)
    body = json.dumps({"model": "x", "prompt": "Long:", "max_tokens": 3000, "ignore_eos": True}).encode()
    req = urllib.request.Request(bridge.url + "/completions", body, {"Content-Type": "application/json"})
    result: dict = {}

    def call():
        try:
            urllib.request.urlopen(req, timeout=60)
        except urllib.error.HTTPError as exc:
            result["status"], result["body"] = exc.code, json.loads(exc.read())

    t = threading.Thread(target=call)
    t.start()
    with d.client() as c:
        deadline = time.monotonic() + 30
        while c.status().active is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    try:
        d.proc.send_signal(signal.SIGKILL)
        t.join(30)
        assert not t.is_alive(), "the bridge kept the HTTP client waiting"
        assert result["status"] == 503 and result["body"]["error"]["code"] == "daemon_gone"
    finally:
        bridge.stop()


def test_a_duplicate_id_never_ends_the_running_stream(start_daemon):
    d = start_daemon("--ctx-size", "512", "--cache-bytes", "0")
    with d.client() as a, d.client() as b:
        running = a.generate(prompt="Count:", max_tokens=40, ignore_eos=True, request_id="same")
        with pytest.raises(InvalidRequest, match="'same' is in use by a request of this client"):
            a.generate(prompt="Again", max_tokens=2, request_id="same")  # refused before it is sent
        with pytest.raises(RequestFailed) as info:  # another connection: the daemon's error, routed to it
            b.complete(prompt="Again", max_tokens=2, request_id="same")
        assert info.value.code == ErrorCode.DUPLICATE_REQUEST_ID
        done = running.wait()
        assert done.finish_reason == FinishReason.LENGTH and done.usage.completion_tokens == 40


def test_cache_clears_are_coalesced_and_never_starve_requests(start_daemon):
    d = start_daemon("--ctx-size", "512", "--cache-bytes", "16M", "--max-queue", "8")
    with d.client() as c:
        c.complete(prompt="Fill the cache a little: " * 4, max_tokens=2)
        running = c.generate(prompt="Long:", max_tokens=600, ignore_eos=True)  # the clears arrive meanwhile
        it = iter(running)
        next(it)
        clients = [Client(d.socket) for _ in range(12)]
        results: list = [None] * 12

        def clear(i):
            try:
                results[i] = clients[i].cache_clear(timeout=60)
            except Exception as exc:
                results[i] = exc

        threads = [threading.Thread(target=clear, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # (all twelve are sent by now)
        assert c.status().active is not None, "the running request ended before the clears arrived"
        queued = c.generate(prompt="After the clears:", max_tokens=3)
        list(it)
        for t in threads:
            t.join(60)
        list(queued)
        assert queued.done.usage.completion_tokens == 3
        cleared = [r for r in results if not isinstance(r, Exception)]
        busy = [r for r in results if isinstance(r, Exception)]
        assert all(type(r).__name__ == "QueueFull" for r in busy), busy
        assert len(cleared) >= 8 and len(cleared) + len(busy) == 12
        for x in clients:
            x.close()
    assert d.log().count("prefix cache cleared") <= 3  # coalesced: the target ran a clear or two, not twelve


def test_a_client_whose_daemon_restarted_while_it_was_idle_connects_afresh(start_daemon, smollm2_path):
    """The connection dropped between requests: the next request is sent to the
    new daemon after the socket's checks, not refused and not lost."""
    d = start_daemon("--ctx-size", "256", "--cache-bytes", "0")
    with d.client() as c:
        first = c.status().pid
        assert d.stop() == 0
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tandem.cli",
                "--socket",
                str(d.socket),
                "serve",
                "--model",
                str(smollm2_path),
            ]
            + ["--ctx-size", "256", "--cache-bytes", "0"],
            env=d.env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    with Client(d.socket, connect_timeout=1) as probe:
                        if probe.status().state == "ready":
                            break
                except DaemonNotRunning:
                    pass
                assert time.monotonic() < deadline and proc.poll() is None, "the new daemon did not start"
                time.sleep(0.1)
            st = c.status()  # the same Client object
            assert st.pid != first and st.state == "ready"
            assert c.complete(prompt="Hi", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2
        finally:
            proc.terminate()
            proc.wait(30)
