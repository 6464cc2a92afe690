"""What the HTTP bridge costs per request, per dialect, and under concurrent load.

One daemon (SmolLM2-135M Q4_1) and one bridge (`tandem http`). Each round, in
turn: a one-token greedy generation through the daemon's socket (the Python
client), then the same request through each dialect of the bridge (OpenAI chat,
Ollama chat, Anthropic messages; not streamed, then streamed), and a tokenize
(which never waits for the model: the HTTP path alone). The per-request
overhead is the bridge's median minus the socket's, all measured side by side
in one run. Then ``--concurrency`` clients each send tokenizes at once, for
the bridge's throughput with many connections.

``--compare DIR`` also runs a second bridge, from another checkout's
``tandem`` package (a directory holding tandem/client, tandem/bridge, tandem/daemon,
tandem/protocol), in front of the same daemon, measured in the same rounds:
two HTTP stacks side by side.

    python -m bench.experiments.bridge_overhead [--rounds 30] [--concurrency 32] [--compare DIR]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.common import fmt, model_path, start_daemon, temp_socket
from tandem.client import Client

MESSAGES = [{"role": "user", "content": "Say yes."}]


def start_bridge(socket_path: Path, src: str | None) -> tuple[subprocess.Popen, str, int]:
    env = dict(os.environ)
    if src:
        env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "--socket", str(socket_path), "openai", "--listen", "127.0.0.1:0"]
        + ["--no-start", "--max-connections", "256"],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    first = proc.stderr.readline()
    m = re.search(r"http://(127\.0\.0\.1):(\d+)/v1", first)
    if m is None:
        proc.kill()
        raise SystemExit(f"the bridge did not start: {first}")
    threading.Thread(target=lambda: proc.stderr.read(), daemon=True).start()
    return proc, m.group(1), int(m.group(2))


def requests() -> dict[str, tuple[str, dict]]:
    one = {"max_tokens": 1, "temperature": 0}
    return {
        "openai chat": ("/v1/chat/completions", {"model": "tandem", "messages": MESSAGES, **one}),
        "openai chat, streamed": (
            "/v1/chat/completions",
            {"model": "tandem", "messages": MESSAGES, "stream": True, **one},
        ),
        "ollama chat": (
            "/api/chat",
            {"model": "tandem", "messages": MESSAGES, "stream": False, "options": {"num_predict": 1, "temperature": 0}},
        ),
        "ollama chat, streamed": (
            "/api/chat",
            {"model": "tandem", "messages": MESSAGES, "stream": True, "options": {"num_predict": 1, "temperature": 0}},
        ),
        "anthropic messages": ("/v1/messages", {"model": "tandem", "messages": MESSAGES, **one}),
        "anthropic messages, streamed": (
            "/v1/messages",
            {"model": "tandem", "messages": MESSAGES, "stream": True, **one},
        ),
        "tokenize": ("/tokenize", {"content": "Say yes."}),
    }


def post(conn: http.client.HTTPConnection, path: str, body: dict) -> float:
    payload = json.dumps(body).encode()
    started = time.perf_counter()
    conn.request("POST", path, payload, {"Content-Type": "application/json", "Host": "127.0.0.1"})
    resp = conn.getresponse()
    data = resp.read()
    elapsed = time.perf_counter() - started
    if resp.status != 200:
        raise SystemExit(f"{path}: {resp.status} {data[:200]!r}")
    return elapsed


def socket_request(c: Client) -> float:
    started = time.perf_counter()
    c.generate(messages=MESSAGES, max_tokens=1, temperature=0).wait()
    return time.perf_counter() - started


def socket_tokenize(c: Client) -> float:
    started = time.perf_counter()
    c.tokenize("Say yes.")
    return time.perf_counter() - started


def concurrent(host: str, port: int, clients: int, each: int) -> float:
    """Tokenizes per second with ``clients`` keep-alive connections at once
    (ConnectionError if any connection fails)."""
    barrier = threading.Barrier(clients + 1)
    errors: list[BaseException] = []

    def run() -> None:
        conn = http.client.HTTPConnection(host, port, timeout=60)
        try:
            barrier.wait()
            for _ in range(each):
                post(conn, "/tokenize", {"content": "Say yes."})
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            conn.close()

    threads = [threading.Thread(target=run) for _ in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise ConnectionError(f"{len(errors)} of {clients} connections failed, the first with {errors[0]!r}")
    return clients * each / (time.perf_counter() - started)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--compare", metavar="DIR", help="also a bridge from this directory's tandem package")
    args = ap.parse_args()

    sock = temp_socket("bridge")
    daemon = start_daemon(sock, "--model", str(model_path("smollm2-135m")), "--drafter", "none")
    bridges = {"this checkout": start_bridge(sock, None)}
    if args.compare:
        bridges[args.compare] = start_bridge(sock, args.compare)
    try:
        table = requests()
        times: dict[str, dict[str, list[float]]] = {b: {name: [] for name in table} for b in bridges}
        direct: dict[str, list[float]] = {"generate": [], "tokenize": []}
        conns = {b: http.client.HTTPConnection(host, port, timeout=60) for b, (_, host, port) in bridges.items()}
        with Client(sock) as c:
            for r in range(args.rounds + 2):
                sample = {"generate": socket_request(c), "tokenize": socket_tokenize(c)}
                per = {b: {name: post(conns[b], path, body) for name, (path, body) in table.items()} for b in bridges}
                if r >= 2:  # the first two warm up
                    for k, v in sample.items():
                        direct[k].append(v)
                    for b in bridges:
                        for name, v in per[b].items():
                            times[b][name].append(v)
        for conn in conns.values():
            conn.close()
        ms = lambda values: [v * 1000 for v in values]  # noqa: E731
        print(f"{args.rounds} rounds; ms, median (range)\n")
        print(f"through the socket: generate {fmt(ms(direct['generate']))}, tokenize {fmt(ms(direct['tokenize']))}\n")
        names = list(bridges)
        print("| request | " + " | ".join(f"{b}: ms | over the socket" for b in names) + " |")
        print("|---|" + "---|---|" * len(names))
        for name in table:
            ref = statistics.median(direct["tokenize" if name == "tokenize" else "generate"]) * 1000
            cells = []
            for b in names:
                values = ms(times[b][name])
                cells += [fmt(values), f"{statistics.median(values) - ref:+.2f}"]
            print(f"| {name} | " + " | ".join(cells) + " |")
        print()
        for b, (_, host, port) in bridges.items():
            try:
                rates = [concurrent(host, port, args.concurrency, 20) for _ in range(3)]
                print(f"{b}: {args.concurrency} connections at once: {fmt(rates, 0)} tokenizes/s (3 runs)")
            except ConnectionError as exc:
                print(f"{b}: {args.concurrency} connections at once: {exc}")
    finally:
        for proc, _, _ in bridges.values():
            proc.terminate()
            proc.wait(10)
        daemon.terminate()
        daemon.wait(30)


if __name__ == "__main__":
    main()
