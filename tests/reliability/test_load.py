"""Load, slow clients and vanished clients against the real daemon."""

from __future__ import annotations

import os
import statistics
import threading
import time

import psutil
import zmq

from tandem.protocol import Busy, Chunk, Done, Error, Generate, Status, decode, encode, endpoint

CLIENTS = 20
REQUESTS = 1_000
IN_FLIGHT = 3  # per client


def raw_client(path):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 120_000)
    sock.connect(endpoint(path))
    return sock


def test_twenty_clients_a_thousand_requests_one_terminal_each_fifo_bounded_responsive(start_daemon):
    # 60 in flight against a queue of 48: mostly served, some turned away with busy
    d = start_daemon("--ctx-size", "256", "--max-queue", "48")
    per_client = REQUESTS // CLIENTS
    terminals: dict[str, list] = {}  # request id -> terminal messages seen (must be exactly one)
    stray: list = []  # messages after a terminal, or for ids nobody sent
    # (poll round, Done): one thread receives every socket, so the rounds order what reached the clients;
    # answers that became readable in the same round are unordered among themselves
    received: list[tuple[int, Done]] = []
    failures: list[BaseException] = []

    def clients() -> None:
        """Twenty clients, each its own socket with up to IN_FLIGHT requests open, driven by one poller."""
        try:
            socks = [raw_client(d.socket) for _ in range(CLIENTS)]
            poller = zmq.Poller()
            for sock in socks:
                poller.register(sock, zmq.POLLIN)
            sent = [0] * CLIENTS
            open_ids: list[set[str]] = [set() for _ in range(CLIENTS)]

            def fill(n: int) -> None:
                while sent[n] < per_client and len(open_ids[n]) < IN_FLIGHT:
                    rid = f"c{n}-r{sent[n]}"
                    prompt = f"Client {n} asks {sent[n]}:"
                    socks[n].send_multipart(encode(Generate(id=rid, prompt=prompt, max_tokens=2, ignore_eos=True)))
                    open_ids[n].add(rid)
                    sent[n] += 1

            for n in range(CLIENTS):
                fill(n)
            rounds = 0
            while any(open_ids):
                ready = dict(poller.poll(120_000))
                assert ready, "no answer for 120 s"
                rounds += 1
                for n, sock in enumerate(socks):
                    if sock not in ready:
                        continue
                    while sock.poll(0, zmq.POLLIN):
                        msg = decode(sock.recv_multipart(), replies=True)
                        if msg.id not in open_ids[n]:
                            stray.append(msg)
                            continue
                        if isinstance(msg, Chunk):
                            continue
                        terminals.setdefault(msg.id, []).append(msg)
                        if isinstance(msg, Done):
                            received.append((rounds, msg))
                        open_ids[n].discard(msg.id)
                    fill(n)
            for sock in socks:
                sock.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)

    status_ms: list[float] = []
    stop = threading.Event()

    def poll_status() -> None:
        with d.client() as c:
            while not stop.is_set():
                t = time.perf_counter()
                c.status()
                status_ms.append((time.perf_counter() - t) * 1000)
                time.sleep(0.02)

    with d.client() as c:
        pid = c.status().pid
    before_rss = psutil.Process(pid).memory_info().rss
    poller = threading.Thread(target=poll_status)
    poller.start()
    started = time.monotonic()
    threads = [threading.Thread(target=clients)]
    for t in threads:
        t.start()
    peak_rss = before_rss
    while any(t.is_alive() for t in threads):
        peak_rss = max(peak_rss, psutil.Process(pid).memory_info().rss)
        time.sleep(0.2)
    for t in threads:
        t.join()
    stop.set()
    poller.join()
    elapsed = time.monotonic() - started
    assert not failures, failures

    # every request: exactly one terminal message, done, error or busy; nothing stray
    assert len(terminals) == REQUESTS and not stray
    assert all(len(v) == 1 for v in terminals.values())
    kinds = {"done": 0, "busy": 0, "error": 0}
    for (msg,) in terminals.values():
        kinds[{Done: "done", Busy: "busy", Error: "error"}[type(msg)]] += 1
    assert kinds["error"] == 0 and kinds["done"] > 0
    # FIFO: answers in the order the daemon took the requests (no answer reached a client in an earlier
    # poll round than the answer to a request taken before it), and that order has no gaps
    received.sort(key=lambda x: x[1].serial)
    serials = [done.serial for _, done in received]
    assert serials == list(range(serials[0], serials[0] + len(serials)))
    rounds = [r for r, _ in received]
    inversions = [(a, b) for a, b in zip(received, received[1:]) if b[0] < a[0]]
    assert rounds == sorted(rounds), [(a[1].serial, a[0], b[1].serial, b[0]) for a, b in inversions][:5]
    # bounded memory, responsive status
    with d.client() as c:
        st = c.status()
    after_rss = psutil.Process(pid).memory_info().rss
    assert st.requests.get("busy", 0) == kinds["busy"] and st.queue_length == 0 and st.active is None
    assert peak_rss - before_rss < 64 * 2**20, f"daemon RSS grew {(peak_rss - before_rss) / 2**20:.1f} MiB"
    p50 = statistics.median(status_ms)
    p99 = sorted(status_ms)[int(0.99 * (len(status_ms) - 1))]
    print(
        f"\n{REQUESTS} requests from {CLIENTS} clients in {elapsed:.1f} s: {kinds}; status latency over "
        f"{len(status_ms)} calls P50 {p50:.2f} ms, P99 {p99:.2f} ms, max {max(status_ms):.2f} ms; daemon RSS "
        f"{before_rss / 2**20:.1f} -> peak {peak_rss / 2**20:.1f} -> {after_rss / 2**20:.1f} MiB"
    )
    assert max(status_ms) < 2000  # answered while the model works; a functional bound, not a benchmark


def test_a_client_that_stops_reading_is_dropped_and_holds_nobody_up(start_daemon):
    # (the lane off: the other request would be served within the slow one's, not after it is dropped)
    d = start_daemon("--ctx-size", "512", "--client-queue", "64", "--preempt-tokens", "0")
    slow = raw_client(d.socket)
    slow.setsockopt(zmq.RCVHWM, 1)
    slow.setsockopt(zmq.RCVBUF, 4096)
    slow.send_multipart(encode(Generate(id="slow", prompt="Talk:", max_tokens=5000, ignore_eos=True)))
    with d.client() as c:
        while c.status().active is None:
            time.sleep(0.01)
        for i in range(3000):  # replies it will never read
            slow.send_multipart(encode(Status(id=f"s{i}")))
        started = time.monotonic()
        # its queue overflows: its request is cancelled, so this one is served long before 5,000 tokens
        done = c.complete(prompt="Meanwhile:", max_tokens=4, ignore_eos=True)
        waited = time.monotonic() - started
        st = c.status()
    assert done.usage.completion_tokens == 4
    assert st.requests.get("done_cancelled") == 1 and waited < 60
    assert "is not reading its replies; dropping it" in d.log()
    slow.close()


def test_fifty_clients_vanishing_mid_stream_cancel_their_requests(start_daemon):
    d = start_daemon("--ctx-size", "256", "--max-queue", "64")
    with d.client() as c:
        for i in range(50):
            sock = raw_client(d.socket)
            sock.setsockopt(zmq.LINGER, 5000)  # what it sent still goes out after close()
            sock.send_multipart(encode(Generate(id=f"v{i}", prompt="Stream:", max_tokens=2000, ignore_eos=True)))
            if i % 2 == 0:
                msg = decode(sock.recv_multipart(), replies=True)  # its stream started: it runs
                assert isinstance(msg, Chunk)
            sock.close()  # gone, mid-stream or before its request was even read
        deadline = time.monotonic() + 60
        while (st := c.status()).active is not None or st.queue_length:
            assert time.monotonic() < deadline, st
            time.sleep(0.05)
        assert st.requests.get("done_cancelled") == 50
        assert c.complete(prompt="Still here:", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3
    assert os.path.exists(d.socket)
