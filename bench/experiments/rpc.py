"""A model split across llama.cpp rpc-servers on loopback vs the same model local.

Starts three rpc-server processes on 127.0.0.1 (the binary bench/build_rpc.sh
builds, or $TANDEM_RPC_SERVER; an rpc-server serves one client at a time) and
three daemons on the same model: local, ``--rpc A`` (every layer on one
server) and ``--rpc B,C`` (split across two).
Per run, in rotating order, each answers the same prompts greedily; reported
per system: decode tok/s (completion tokens after the first / generation
seconds) and time to first token, median and range over the runs, as ratios to
local, and whether the outputs are identical to local. On loopback this
measures what RPC itself costs (the graph split, the transfers, the servers'
own threads), not a bigger machine: the servers run on the same cores.

Needs llama-cpp-python built with GGML_RPC (bench/build_rpc.sh).

    python -m bench.experiments.rpc [--model PRESET|PATH] [--runs 3] [--tokens 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys

import llama_cpp

from bench.common import cpu_model, fmt, free_port, model_path, start_daemon, temp_socket
from tandem.client import Client
from tandem.daemon.models.devices import rpc_server_binary, start_rpc_server

PROMPTS = [
    [{"role": "user", "content": "Write a Python function that parses an ISO date."}],
    [{"role": "user", "content": "Explain what a race condition is, with an example."}],
]


def run(client: Client, tokens: int) -> tuple[float, float, list[str]]:
    """(decode tok/s, median TTFT seconds, texts) over the prompts."""
    decode_tokens, decode_seconds, ttfts, texts = 0, 0.0, [], []
    for messages in PROMPTS:
        done = client.complete(messages=messages, max_tokens=tokens, temperature=0.0, cache=False)
        decode_tokens += max(done.usage.completion_tokens - 1, 0)
        decode_seconds += done.timings.generation_seconds
        ttfts.append(done.timings.time_to_first_token_seconds)
        texts.append(done.text)
    return decode_tokens / decode_seconds, statistics.median(ttfts), texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="threads of each rpc-server and of each daemon")
    args = ap.parse_args()
    if not llama_cpp.llama_supports_rpc():
        sys.exit("llama-cpp-python was built without GGML_RPC: run bench/build_rpc.sh")
    binary = rpc_server_binary()
    if binary is None:
        sys.exit("no rpc-server: run bench/build_rpc.sh (or set TANDEM_RPC_SERVER)")
    model = model_path(args.model)
    ports = [free_port() for _ in range(3)]
    servers = [start_rpc_server(binary, port, args.threads) for port in ports]
    addrs = [f"127.0.0.1:{port}" for port in ports]
    common = ("--model", str(model), "--ctx-size", "1024", "--threads", str(args.threads), "--cache-bytes", "0")
    systems = {"local": (), "rpc x1": ("--rpc", addrs[0]), "rpc x2": ("--rpc", ",".join(addrs[1:]))}
    procs, clients = {}, {}
    try:
        for name, extra in systems.items():
            sock = temp_socket("tdm-rpc-")
            procs[name] = start_daemon(sock, *common, *extra)
            clients[name] = Client(sock)
            clients[name].complete(prompt="warm up", max_tokens=4)
        print(f"{model.name}; {cpu_model()}; {args.runs} runs of {len(PROMPTS)} prompts, {args.tokens} tokens")
        print(f"rpc-server {binary}; threads {args.threads} per server and daemon")
        for name in systems:
            layers = clients[name].status().model.layers
            print(f"  {name}: layers {layers}")
        dec = {s: [] for s in systems}
        ttft = {s: [] for s in systems}
        identical = {s: 0 for s in systems}
        for r in range(args.runs):
            order = list(systems)
            order = order[r % len(order) :] + order[: r % len(order)]
            res = {s: run(clients[s], args.tokens) for s in order}
            for s, (d, t, texts) in res.items():
                dec[s].append(d)
                ttft[s].append(t)
                identical[s] += sum(a == b for a, b in zip(texts, res["local"][2]))
        print()
        print("| system | decode tok/s | decode / local | TTFT ms | TTFT / local | outputs identical to local |")
        print("|---|---|---|---|---|---|")
        for s in systems:
            d_ratio = [a / b for a, b in zip(dec[s], dec["local"])]
            t_ratio = [a / b for a, b in zip(ttft[s], ttft["local"])]
            print(
                f"| {s} | {fmt(dec[s], 1)} | {fmt(d_ratio)} | {fmt([t * 1000 for t in ttft[s]], 0)} | "
                f"{fmt(t_ratio)} | {identical[s]}/{args.runs * len(PROMPTS)} |"
            )
    finally:
        for c in clients.values():
            c.close()
        for p in procs.values():
            p.terminate()
            p.wait(30)
        for p in servers:
            p.terminate()
            p.wait(10)


if __name__ == "__main__":
    main()
