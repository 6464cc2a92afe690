"""What the metrics cost: the same daemon with the endpoint off and on, side by side.

Two daemons with the same model run at once, idle but for the request in flight;
requests alternate between them (this machine is shared and noisy, so only
ratios taken side by side mean anything). The daemon with metrics is scraped
every --scrape-interval seconds throughout, far more often than Prometheus
would (deploy/prometheus.yml: 5 s). Every request streams, so the daemon does
its per-chunk metric work. Reports generated tok/s of each (median and range),
the per-pair ratio, the time a scrape takes, and the daemon processes' RSS.

    python -m bench.experiments.metrics_overhead [--model PRESET|PATH] [--runs 20] [--tokens 96] [--scrape-interval 0.5]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import urllib.request
from pathlib import Path

import psutil

from bench.common import fmt, model_path, start_daemon, temp_socket
from tandem.client import Client

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a map.",
    "Explain, step by step, how a hash map handles collisions.",
    'def parse_config(path):\n    """Read a TOML file and return a dict."""\n',
]


def one_request(client: Client, prompt: str, tokens: int) -> float:
    start = time.perf_counter()
    n = 0
    stream = client.generate(prompt=prompt, max_tokens=tokens, temperature=0.0, ignore_eos=True)
    for chunk in stream:
        n += len(chunk.token_ids)
    return n / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--runs", type=int, default=20, help="requests per system (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--scrape-interval", type=float, default=0.5)
    args = ap.parse_args()
    model = str(model_path(args.model))
    common = ("--model", model, "--ctx-size", "1024", "--cache-bytes", "0")
    off_sock, on_sock = temp_socket("tdm-moff-"), temp_socket("tdm-mon-")
    off = start_daemon(off_sock, *common)  # start_daemon passes --metrics-addr off; the later flag wins for "on"
    on = start_daemon(on_sock, *common, "--metrics-addr", "127.0.0.1:0")
    scrapes: list[float] = []
    stop = threading.Event()
    try:
        with Client(off_sock) as c_off, Client(on_sock) as c_on:
            addr = c_on.status().metrics_addr
            assert addr and not c_off.status().metrics_addr

            def scraper() -> None:
                while not stop.is_set():
                    t = time.perf_counter()
                    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
                        r.read()
                    scrapes.append(time.perf_counter() - t)
                    stop.wait(args.scrape_interval)

            thread = threading.Thread(target=scraper, daemon=True)
            thread.start()
            for c in (c_off, c_on):  # warm-up
                one_request(c, PROMPTS[0], 8)
            rates: dict[str, list[float]] = {"off": [], "on": []}
            ratios = []
            for i in range(args.runs):
                prompt = PROMPTS[i % len(PROMPTS)]
                order = [("off", c_off), ("on", c_on)] if i % 2 == 0 else [("on", c_on), ("off", c_off)]
                pair = {}
                for name, c in order:
                    pair[name] = one_request(c, prompt, args.tokens)
                    rates[name].append(pair[name])
                ratios.append(pair["on"] / pair["off"])
                print(
                    f"run {i + 1:2}: off {pair['off']:6.1f} tok/s, on {pair['on']:6.1f} tok/s, on/off {ratios[-1]:.3f}",
                    flush=True,
                )
            stop.set()
            thread.join()
            rss = {
                name: psutil.Process(c.status().pid).memory_info().rss / 2**20
                for name, c in (("off", c_off), ("on", c_on))
            }
    finally:
        stop.set()
        for p in (off, on):
            p.terminate()
            p.wait(30)
    print()
    print(f"model {Path(model).name}, {args.runs} streamed requests of {args.tokens} tokens per system, alternating")
    print(f"metrics off: {fmt(rates['off'], 1)} tok/s")
    print(f"metrics on:  {fmt(rates['on'], 1)} tok/s, scraped every {args.scrape_interval} s ({len(scrapes)} scrapes)")
    print(f"on / off:    {fmt(ratios, 3)}")
    scrapes_ms = sorted(s * 1000 for s in scrapes)
    p99 = scrapes_ms[min(len(scrapes_ms) - 1, int(0.99 * len(scrapes_ms)))]
    print(f"scrape time: median {statistics.median(scrapes_ms):.1f} ms, P99 {p99:.1f} ms, max {scrapes_ms[-1]:.1f} ms")
    print(f"daemon RSS:  off {rss['off']:.0f} MiB, on {rss['on']:.0f} MiB (the front process only)")


if __name__ == "__main__":
    main()
