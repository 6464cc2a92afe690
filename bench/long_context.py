"""tandem against llama-server at the context sizes agents live at (issue 49, part 1).

    python -m bench.long_context                                   # Qwen2.5-Coder-0.5B, 4k/16k/32k, 3 runs
    python -m bench.long_context --models qwen2.5-coder-1.5b --sizes 16384 --runs 3

Prompts are a real agent's first request made as long as asked: Claude Code's
recorded system prompt and tools (tests/bridge/recorded), its first user turn,
and then source files of this repository "read" into the conversation until the
prompt has SIZE tokens (counted by tandem's chat template; llama-server renders
the same GGUF template). A salt in the first line makes every request a new
prompt: nothing is served from a cache. The systems are started together and
stay resident (idle while another is measured); each run of a size asks them
one after another, in an order turned by one each run: tandem with its
defaults, tandem with llama.cpp's CPU kernels as installed (``--kernel-patch off``;
the defaults run tandem's, daemon/kernels), tandem ``--kernels fast``, and
llama-server built from the vendored llama.cpp (``bench/build_llama_server.sh vendored``), all greedy with
``ignore_eos`` so they write the same number of tokens (``--systems`` also
takes ``tandem no-reader``: ``--prompt-reader off``, what the reader costs and
gives). Per request: TTFT,
prefill tok/s (prompt tokens / TTFT), decode tok/s after the first token, the
P99 of the gaps between streamed tokens, and the memory of the system's
processes after it (RSS summed, and PSS: what is mapped twice counted once; the
systems are resident together and map the same model file, so PSS shares its pages
out among them: compare RSS across systems, PSS only within one report).
Reported as medians (min-max) over runs, and the ratios to llama-server within
each run and size.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import random
import shlex
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Callable, Optional

import psutil

from bench.common import cpu_model, model_path, start_daemon, stop_daemon, temp_socket, wait_quiet
from bench.peer import vendored_server
from bench.prefix_cache import LlamaServer
from tandem.client import Client

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RECORDED = ROOT / "tests" / "bridge" / "recorded" / "claude-code-2.1.328-first.json"
SOURCES = ("daemon", "bridge", "client", "protocol", "cli")
SYSTEMS = ("tandem", "tandem stock-kernels", "tandem fast", "tandem no-reader", "llama-server")


def agent_preamble() -> tuple[str, str]:
    """Claude Code's first request: (its system prompt with its tools' specs, its first user text)."""
    body = json.loads(RECORDED.read_text())["body"]
    system = "\n".join(b.get("text", "") for b in body["system"] if isinstance(b, dict))
    tools = "\n".join(json.dumps(t, ensure_ascii=False) for t in body["tools"])
    first = body["messages"][0]["content"]
    user = first if isinstance(first, str) else "".join(b.get("text", "") for b in first if isinstance(b, dict))
    return f"{system}\n\n# Tools\n{tools}", user


def source_files() -> list[tuple[str, str]]:
    out = []
    for folder in SOURCES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            out.append((str(path.relative_to(ROOT)), path.read_text()))
    return out


def agent_prompt(count: Callable[[list[dict]], int], size: int, salt: str) -> list[dict]:
    """A chat of about ``size`` tokens (at most): the agent's preamble (its first part, for a size
    below it: Claude Code's is ~9k tokens), then files read into it."""
    system, user = agent_preamble()
    files = source_files()
    messages = [{"role": "system", "content": f"Session {salt}.\n{system}"}, {"role": "user", "content": user}]
    while count(messages) > size - 128:  # (a size below the agent's preamble: its first part)
        system = system[: int(len(system) * 0.8)]
        messages[0]["content"] = f"Session {salt}.\n{system}"
    shown: list[str] = []
    ask = "\n\nThat is the code. Explain in a few sentences what the daemon does with a request."
    for name, text in files:
        trial = shown + [f"=== {name} ===\n{text}"]
        candidate = messages[:1] + [{"role": "user", "content": user + "\n\n" + "\n".join(trial) + ask}]
        if count(candidate) > size - 128:  # (room to answer): a file too long for what is left is skipped
            continue
        shown = trial
    return messages[:1] + [{"role": "user", "content": user + "\n\n" + "\n".join(shown) + ask}]


def agent_prompts(path: Path, sizes: list[int], runs: int) -> dict[int, list[list[dict]]]:
    """``runs`` new prompts (``agent_prompt``) of each size, counted by tandem's template for the
    model at ``path`` (a daemon of its own, stopped after)."""
    sock = temp_socket("tdm-count-")
    counter = start_daemon(sock, "--model", str(path), "--ctx-size", str(max(sizes) + 256), timeout=900)
    try:
        with Client(sock) as client:
            count = lambda m: client.count_tokens(messages=m)  # noqa: E731
            return {
                size: [agent_prompt(count, size, f"{size}-{r}-{random.random()}") for r in range(runs)]
                for size in sizes
            }
    finally:
        stop_daemon(counter)


def timed(pieces) -> list[float]:
    """The times of a stream's non-empty pieces."""
    return [time.perf_counter() for piece in pieces if piece]


def figures(started: float, times: list[float], prompt_tokens: int) -> dict:
    gaps = [b - a for a, b in zip(times, times[1:])]
    first, last = times[0], times[-1]
    return {
        "ttft": first - started,
        "prefill": prompt_tokens / (first - started),
        "decode": (len(times) - 1) / (last - first) if len(times) > 1 and last > first else None,
        "p99_gap_ms": 1000 * sorted(gaps)[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else None,
        "prompt_tokens": prompt_tokens,
    }


def tandem_request(client: Client, messages: list[dict], tokens: int) -> dict:
    started = time.perf_counter()
    stream = client.generate(
        messages=messages, max_tokens=tokens, temperature=0.0, ignore_eos=True, cache=False, progress=True
    )  # (progress: the daemon says it is reading: a 32k prompt takes longer than the client's 600 s timeout)
    times = timed(len(c.token_ids) for c in stream)
    return figures(started, times, stream.done.usage.prompt_tokens)


def server_request(port: int, messages: list[dict], tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    body["cache_prompt"] = False
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    started = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"llama-server answered {resp.status}: {resp.read()[:300]!r}")
    usage: dict = {}

    def pieces():
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            usage.update(event.get("usage") or {})
            for choice in event.get("choices") or []:
                yield (choice.get("delta") or {}).get("content")

    times = timed(pieces())
    conn.close()
    return figures(started, times, int(usage.get("prompt_tokens") or -1))


def memory_mib(pid: int) -> dict[str, float]:
    """The memory of ``pid`` and its children: RSS summed, and PSS (a page mapped
    twice, by two processes or twice in one, counted once: tandem's worker maps the
    model file for its steps and again for its prompt reader)."""
    proc = psutil.Process(pid)
    procs = [proc, *proc.children(recursive=True)]
    rss = sum(p.memory_info().rss for p in procs)
    pss = sum(getattr(p.memory_full_info(), "pss", 0) for p in procs)
    return {"rss_mib": rss / 2**20, "pss_mib": pss / 2**20 or None}


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def start_system(system: str, path: Path, ctx: int, tokens: int, threads: int, stack: ExitStack):
    """Start ``system``, stopped when ``stack`` closes: (ask(messages) -> figures, its pid)."""
    if system.startswith("llama-server"):  # ("llama-server -ub 256": what follows are its own options)
        server = LlamaServer(vendored_server(), path, ctx, threads, flash_attn=None, extra=tuple(system.split()[1:]))
        stack.callback(server.stop)
        return (lambda m: server_request(server.port, m, tokens)), server.proc.pid
    args = ["--model", str(path), "--ctx-size", str(ctx), "--cache-bytes", "0", "--disk-cache-bytes", "0"]
    args += ["--kernels", "fast"] if "fast" in system else []
    args += ["--kernel-patch", "off"] if "stock" in system else []  # llama.cpp's CPU kernels as installed
    args += ["--prompt-reader", "off"] if "no-reader" in system else []  # (its memory, its speed)
    sock = temp_socket("tdm-long-")
    daemon = start_daemon(sock, *args, timeout=900)
    stack.callback(stop_daemon, daemon)
    client = stack.enter_context(Client(sock))
    return (lambda m: tandem_request(client, m, tokens)), daemon.pid


def run_systems(systems: list[str], path: Path, sizes: list[int], runs: int, tokens: int, threads: int, prompts):
    """Every system started and resident together; each run of a size asks them one after another, the
    order turned by one each run, so that the shared machine's drift falls on all of them alike."""
    rows = []
    with ExitStack() as stack:
        asks = {}
        for system in systems:
            say(f"  starting {system}")
            asks[system] = start_system(system, path, max(sizes) + 256, tokens, threads, stack)
            asks[system][0]([{"role": "user", "content": "Say hi."}])  # (warm-up: first-request costs)
        pids = [pid for _, pid in asks.values()]
        turns = 0  # (counted across sizes: with runs a multiple of the systems, each is first as often)
        for size in sizes:
            for r in range(runs):
                turn, turns = turns % len(systems), turns + 1
                for system in systems[turn:] + systems[:turn]:
                    ask, pid = asks[system]
                    wait_quiet(pids)
                    s = ask(prompts[size][r])
                    s.update(system=system, size=size, run=r, **memory_mib(pid))
                    rows.append(s)
                    say(
                        f"  {system:16s} {size:6d} run {r + 1}: prompt {s['prompt_tokens']} ttft {s['ttft']:.1f} s "
                        f"prefill {s['prefill']:.0f} tok/s decode {s['decode'] or 0:.2f} tok/s "
                        f"p99 gap {s['p99_gap_ms'] or 0:.0f} ms rss {s['rss_mib']:.0f} MiB "
                        f"pss {s['pss_mib'] or 0:.0f} MiB"
                    )
    return rows


def med(values: list, digits: int = 2) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def report(model: str, rows: list[dict], out: Path, command: str) -> Path:
    lines = [
        f"# {model} at agent context sizes: tandem and llama-server (vendored llama.cpp)",
        "",
        f"{datetime.date.today()}, {cpu_model()}, {psutil.cpu_count()} cores. Command: `{command}`",
        "",
        "| size | system | prompt tokens | TTFT s | prefill tok/s | decode tok/s | P99 gap ms | RSS MiB | PSS MiB | "
        "decode / llama-server | prefill / llama-server |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size in sorted({r["size"] for r in rows}):
        peer = {r["run"]: r for r in rows if r["size"] == size and r["system"] == "llama-server"}
        for system in SYSTEMS:
            mine = [r for r in rows if r["size"] == size and r["system"] == system]
            if not mine:
                continue
            ratio_d = [r["decode"] / peer[r["run"]]["decode"] for r in mine if r["run"] in peer and r["decode"]]
            ratio_p = [r["prefill"] / peer[r["run"]]["prefill"] for r in mine if r["run"] in peer]
            tokens, ttft = med([r["prompt_tokens"] for r in mine], 0), med([r["ttft"] for r in mine], 1)
            lines.append(
                f"| {size} | {system} | {tokens} | {ttft} "
                f"| {med([r['prefill'] for r in mine], 0)} | {med([r['decode'] for r in mine])} "
                f"| {med([r['p99_gap_ms'] for r in mine], 0)} | {med([r['rss_mib'] for r in mine], 0)} "
                f"| {med([r.get('pss_mib') for r in mine], 0)} "
                f"| {med(ratio_d)} | {med(ratio_p)} |"
            )
    return write_report(out, rows, lines)


def write_report(out: Path, rows: list[dict], lines: list[str]) -> Path:
    """``rows`` as out/results.json and ``lines`` as out/REPORT.md; the report's path."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    path = out / "REPORT.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-0.5b"], help="presets or .gguf paths")
    ap.add_argument("--sizes", nargs="+", type=int, default=[4096, 16384, 32768], help="prompt sizes in tokens")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="tokens written per request (default 64)")
    ap.add_argument("--threads", type=int, default=psutil.cpu_count() or 1)
    ap.add_argument("--systems", nargs="+", default=[s for s in SYSTEMS if s != "tandem no-reader"], choices=SYSTEMS)
    ap.add_argument("--out", type=Path, default=None, help="report directory (default bench/results/DATE-long-MODEL)")
    args = ap.parse_args(argv)
    command = "python -m bench.long_context " + shlex.join(argv if argv is not None else sys.argv[1:])
    for model in args.models:
        path = model_path(model)
        prompts = agent_prompts(path, args.sizes, args.runs)
        say(f"{model}: {', '.join(args.systems)}")
        rows = run_systems(args.systems, path, args.sizes, args.runs, args.tokens, args.threads, prompts)
        out = args.out or BENCH / "results" / f"{datetime.date.today()}-long-{Path(model).name.removesuffix('.gguf')}"
        say(f"report: {report(model, rows, out, command)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
