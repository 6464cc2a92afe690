"""tandem against llama.cpp's own server, side by side, on the same model file.

    python -m bench --peer                        # SmolLM2-135M and Qwen2.5-Coder-1.5B, 3 runs: ~10 minutes here
    python -m bench --peer --models smollm2-135m --runs 5
    python -m bench --peer --also-vendored        # a third system: llama-server built from tandem's own llama.cpp

Both run as a user would start them, with their defaults: ``tandem serve --model M
--ctx-size C`` (no drafter) and ``llama-server -m M -c C -t N -tb N`` (its prompt
cache on, flash attention auto), with ``--no-repack`` on CPUs with AMX for both
(tandem's ``--extra-buffers auto`` turns repacking off there: it crashes). tandem
is asked over its socket with its Python client, llama-server over HTTP on
127.0.0.1 (its OpenAI chat endpoint, streamed); greedy, ``ignore_eos``, so both
write the same number of tokens. For each prompt kind, the two systems take turns
(the order flips each run), so drift on a shared machine hits both alike:

- **new**: a ~200-token chat prompt neither has seen (a salt in its first words);
- **repeated**: the same prompt again (an editor re-sending, a retried request);
- **extended**: that conversation with the system's own reply and a new user turn
  appended (an agent's next turn);
- **prefill**: a new ~1,000-token prompt, 2 tokens written: prompt tokens / TTFT.

Decode tok/s is what a streaming client sees after the first token: (tokens - 1)
/ (last chunk - first chunk), over the new, repeated and extended requests.
Reported: median (min–max) over runs of each figure and of the tandem /
llama-server ratio taken within a run. Goals (the performance issue): decode >=
1.0x, TTFT <= 1.1x llama-server on every prompt kind. The report, with the
machine and both builds' CPU features, goes to bench/results/<date>-<host>-peer/.

``--also-vendored`` adds llama-server built from the llama.cpp vendored in the
installed llama-cpp-python's sdist (``bench/build_llama_server.sh vendored``): the
same llama.cpp tandem runs, served by llama.cpp's own server. tandem / that server
is what tandem's own code costs or gains; that server / llama-server b11434 is what
the llama.cpp version accounts for.
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import random
import re
import socket as socketlib
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from bench.common import cpu_model, model_path, start_daemon, temp_socket, wait_quiet
from bench.prefix_cache import LlamaServer
from tandem.client import Client

BENCH = Path(__file__).resolve().parent
DEFAULT_MODELS = ["smollm2-135m", "qwen2.5-coder-1.5b"]
KINDS = ["new", "repeated", "extended", "prefill"]
VENDORED = "llama-server (vendored)"
SYSTEMS = ["tandem", "llama-server", "tandem fast", VENDORED]
GOALS = {"decode": 1.0, "ttft": 1.1}  # tandem / llama-server: decode at least, TTFT at most

TOPICS = (
    "a lighthouse keeper who collects shipwrecked clocks",
    "the first winter of a city built on a frozen lake",
    "a cartographer mapping a library that rearranges itself",
    "two rival bakers in a mountain village during a storm",
    "a courier who delivers letters between ships at sea",
    "an old robot tending a greenhouse on an empty station",
)
FILLER = (
    "The town kept its records in a tall stone building near the harbour, and every family had a drawer there. "
    "Traders arrived in spring with salt, copper wire and news from the coast; in autumn they left with wool, "
    "dried fish and the letters nobody trusted to the post. The school had one teacher, who also repaired the "
    "radios, and the bell in the square rang twice at noon because the first ring was always early. "
)


def chat_prompt(rng: random.Random, salt: str, filler_repeats: int) -> list[dict]:
    topic = rng.choice(TOPICS)
    body = " ".join(FILLER for _ in range(filler_repeats))
    return [
        {
            "role": "user",
            "content": f"Request {salt}. Background: {body}\nWrite a short story about {topic}, "
            "in plain prose, without a title.",
        }
    ]


class Sample(dict):
    """ttft, seconds, tokens, prompt_tokens, decode (tok/s after the first token), text"""


def measure(pieces: Callable, started: float) -> tuple[Optional[float], Optional[float], int]:
    """(first chunk time, last chunk time, chunks) of a stream of non-empty pieces"""
    first = last = None
    n = 0
    for piece in pieces:
        if not piece:
            continue
        now = time.perf_counter()
        first = first if first is not None else now
        last = now
        n += 1
    return first, last, n


def tandem_request(client: Client, messages: list[dict], tokens: int) -> Sample:
    started = time.perf_counter()
    stream = client.generate(messages=messages, max_tokens=tokens, temperature=0.0, ignore_eos=True)
    first, last, _ = measure((len(c.token_ids) for c in stream), started)
    done = stream.done
    n = done.usage.completion_tokens
    return Sample(
        ttft=first - started,
        seconds=last - started,
        tokens=n,
        prompt_tokens=done.usage.prompt_tokens,
        cached_tokens=done.usage.cached_tokens,
        decode=(n - 1) / (last - first) if n > 1 and last > first else None,
        text=done.text,
    )


def server_request(port: int, messages: list[dict], tokens: int) -> Sample:
    body = json.dumps(
        {
            "messages": messages,
            "max_tokens": tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    started = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"llama-server answered {resp.status}: {resp.read()[:300]!r}")
    final: dict = {}
    text: list[str] = []

    def pieces():
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if event.get("usage"):
                final.update(event["usage"])
            if event.get("timings"):
                final["timings"] = event["timings"]
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    text.append(piece)
                    yield piece

    first, last, chunks = measure(pieces(), started)
    conn.close()
    n = int(final.get("completion_tokens") or final.get("timings", {}).get("predicted_n") or chunks)
    timings = final.get("timings", {})
    return Sample(
        ttft=first - started,
        seconds=last - started,
        tokens=n,
        prompt_tokens=int(final.get("prompt_tokens") or -1),
        cached_tokens=int(timings.get("cache_n", -1)),
        decode=(n - 1) / (last - first) if n > 1 and last > first else None,
        text="".join(text),
    )


# --------------------------------------------------------------------------- builds and machine


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                keep = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx_vnni")
                return [f for f in keep if f in flags] + sorted(f for f in flags if f.startswith("amx"))
    except OSError:
        pass
    return []


def server_system_info(log_path: str, binary: Path) -> str:
    """llama-server's CPU features as built: its log's 'system_info' line, which newer servers print only
    at a higher verbosity, else ``llama_print_system_info`` from the libllama beside the binary, asked in
    a child process (two libllamas in one process would clash)."""
    try:
        m = re.search(r"system_info: (.*)", Path(log_path).read_text(errors="replace"))
        if m:
            return m.group(1).strip()
    except OSError:
        pass
    lib = binary.parent / "libllama.so"
    code = (
        "import ctypes, sys; f = ctypes.CDLL(sys.argv[1]).llama_print_system_info; "
        "f.restype = ctypes.c_char_p; print(f().decode())"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code, str(lib)],
            env={**os.environ, "LD_LIBRARY_PATH": str(binary.parent)},
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


# --------------------------------------------------------------------------- one model


def vendored_server() -> Path:
    """llama-server built from the llama.cpp in the installed llama-cpp-python's sdist."""
    import llama_cpp

    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tandem" / "llama-server"
    binary = root / f"llama-cpp-python-{llama_cpp.__version__}" / "bin" / "llama-server"
    if not binary.is_file():
        raise SystemExit(f"no llama-server at {binary}: build it with `bench/build_llama_server.sh vendored`")
    return binary


def bench_model(
    name: str,
    server_bin: Path,
    runs: int,
    tokens: int,
    ctx: int,
    threads: int,
    also_fast: bool = False,
    vendored_bin: Optional[Path] = None,
) -> dict:
    import llama_cpp

    path = model_path(name)
    say(f"{name}: {path.name}")
    sock = temp_socket("tdm-peer-")
    serve_args = ["--model", str(path), "--ctx-size", str(ctx)]
    daemon = start_daemon(sock, *serve_args)
    server = fast_daemon = vendored = None
    try:
        server = LlamaServer(server_bin, path, ctx, threads, flash_attn=None)
        client = Client(sock)
        systems = {
            "tandem": lambda m, n: tandem_request(client, m, n),
            "llama-server": lambda m, n, port=server.port: server_request(port, m, n),
        }
        if also_fast:
            fast_sock = temp_socket("tdm-peerf-")
            fast_daemon = start_daemon(fast_sock, *serve_args, "--kernels", "fast")
            fast_client = Client(fast_sock)
            systems["tandem fast"] = lambda m, n: tandem_request(fast_client, m, n)
        if vendored_bin is not None:
            vendored = LlamaServer(vendored_bin, path, ctx, threads, flash_attn=None)
            systems[VENDORED] = lambda m, n, port=vendored.port: server_request(port, m, n)
        for fn in systems.values():  # warm up: first-request costs are not what is compared
            fn([{"role": "user", "content": "Say hi."}], 4)
        rows: list[dict] = []
        for r in range(runs):
            rng = random.Random(r)
            salt = f"{r}-{rng.randrange(10**9)}"
            order = list(systems)[r % len(systems) :] + list(systems)[: r % len(systems)]  # rotated each run
            prompt = chat_prompt(rng, salt, filler_repeats=2)
            long_prompt = chat_prompt(rng, salt + "-long", filler_repeats=11)
            replies: dict[str, str] = {}
            for kind in KINDS:
                for system in order:
                    if kind == "new" or kind == "repeated":
                        messages, n = prompt, tokens
                    elif kind == "extended":
                        messages = prompt + [
                            {"role": "assistant", "content": replies[system]},
                            {"role": "user", "content": "Now tell the same story from another character's view."},
                        ]
                        n = tokens
                    else:
                        messages, n = long_prompt, 2
                    procs = (daemon, fast_daemon, server.proc, vendored.proc if vendored else None)
                    waited = wait_quiet([p.pid for p in procs if p is not None])
                    s = systems[system](messages, n)
                    s["waited_before"] = waited
                    if kind == "new":
                        replies[system] = s["text"]
                    rows.append({"run": r, "kind": kind, "system": system, **s})
                    say(
                        f"  run {r + 1} {kind:9s} {system:12s} ttft {s['ttft'] * 1000:8.1f} ms  "
                        f"prompt {s['prompt_tokens']:5d} (cached {s['cached_tokens']})  "
                        + (f"decode {s['decode']:.1f} tok/s" if s["decode"] else "")
                    )
        status = client.status()
        client.close()
        return {
            "model": name,
            "file": path.name,
            "bytes": path.stat().st_size,
            "commands": {
                "tandem": "tandem serve " + " ".join(serve_args),
                "llama-server": " ".join(server.command),
                **({"tandem fast": "tandem serve " + " ".join(serve_args) + " --kernels fast"} if also_fast else {}),
                **({VENDORED: " ".join(vendored.command)} if vendored else {}),
            },
            "builds": {
                "tandem": llama_cpp.llama_print_system_info().decode().strip(),
                "llama-server": server_system_info(server.log.name, server_bin),
                **({VENDORED: server_system_info(vendored.log.name, vendored_bin)} if vendored else {}),
            },
            "tandem_settings": {
                "flash_attn": status.model.flash_attn if status.model else None,
                "kernels": status.model.kernels if status.model else None,
            },
            "rows": rows,
        }
    finally:
        for srv in (server, vendored):
            if srv is not None:
                srv.stop()
        for proc in (daemon, fast_daemon):
            if proc is not None:
                proc.terminate()
                proc.wait(30)


# --------------------------------------------------------------------------- the report


def med(values: list[float], digits: int = 2) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def figures(result: dict) -> dict:
    """Per figure: {'tandem': [per run], 'llama-server': [...], 'ratio': [...]}"""
    rows = result["rows"]
    runs = sorted({r["run"] for r in rows})

    def one(run, kind, system, key):
        return next(r[key] for r in rows if r["run"] == run and r["kind"] == kind and r["system"] == system)

    out: dict = {}
    for system in sorted({r["system"] for r in rows}, key=SYSTEMS.index):
        decode = [
            statistics.median(one(run, k, system, "decode") for k in ("new", "repeated", "extended")) for run in runs
        ]
        out.setdefault("decode tok/s", {})[system] = decode
        for kind in ("new", "repeated", "extended", "prefill"):
            out.setdefault(f"TTFT {kind} (ms)", {})[system] = [one(run, kind, system, "ttft") * 1000 for run in runs]
        out.setdefault("prefill tok/s", {})[system] = [
            one(run, "prefill", system, "prompt_tokens") / one(run, "prefill", system, "ttft") for run in runs
        ]
    for fig in out.values():
        for system in [s for s in fig if s.startswith("tandem")]:
            fig[f"{system} ratio"] = [a / b for a, b in zip(fig[system], fig["llama-server"])]
        if VENDORED in fig:
            fig["tandem / vendored"] = [a / b for a, b in zip(fig["tandem"], fig[VENDORED])]
            fig["vendored / llama-server"] = [a / b for a, b in zip(fig[VENDORED], fig["llama-server"])]
    return out


def goal_of(figure: str) -> Optional[tuple[str, float]]:
    if figure == "decode tok/s":
        return (">=", GOALS["decode"])
    if figure in ("TTFT new (ms)", "TTFT repeated (ms)", "TTFT extended (ms)"):
        return ("<=", GOALS["ttft"])
    return None


def write_report(results: dict, out_dir: Path) -> Path:
    m = results["machine"]
    lines = [
        "# tandem vs llama-server, side by side",
        "",
        f"Run {results['started'][:16]} → {results['finished'][:16]} with `{results['command']}`: "
        f"{results['runs']} alternating runs, greedy, {results['tokens']} tokens (`ignore_eos`), "
        f"context {results['ctx']}, {results['threads']} threads each. Median (min–max) over runs; "
        "ratios are tandem / llama-server within a run. Method: bench/peer.py's docstring.",
        "",
        f"- machine: {m['cpu']}, {m['cores']} cores; CPU flags: {', '.join(m['cpu_flags'])}",
        f"- tandem {m['tandem']}, llama-cpp-python {m['llama_cpp_python']}; llama-server {results['server']}",
    ]
    if results.get("builds_note"):
        lines.append(f"- {results['builds_note']}")
    for result in results["models"]:
        figs = figures(result)
        fast = "tandem fast" in result["commands"]
        vend = VENDORED in result["commands"]
        lines += [
            "",
            f"## {result['model']} ({result['file']}, {result['bytes'] / 2**20:,.0f} MiB)",
            "",
            f"- tandem: `{result['commands']['tandem']}` (flash attention "
            f"{'on' if result['tandem_settings']['flash_attn'] else 'off'}, "
            f"{result['tandem_settings']['kernels']} kernels)",
            f"- llama-server: `{result['commands']['llama-server']}`",
            f"- tandem's llama.cpp build: `{result['builds']['tandem']}`",
            f"- llama-server's build: `{result['builds']['llama-server']}`",
        ]
        if vend:
            lines += [
                f"- llama-server from tandem's own llama.cpp (the vendored one): `{result['commands'][VENDORED]}`, "
                f"build `{result['builds'][VENDORED]}`",
            ]
        lines += [
            "",
            "| figure | tandem | llama-server | tandem / llama-server | goal | met |"
            + (" tandem `--kernels fast` | fast / llama-server |" if fast else "")
            + (" llama-server (vendored) | tandem / vendored | vendored / llama-server |" if vend else ""),
            "|---|---|---|---|---|---|" + ("---|---|" if fast else "") + ("---|---|---|" if vend else ""),
        ]
        for name, fig in figs.items():
            goal = goal_of(name)
            ratio = statistics.median(fig["tandem ratio"])
            met = "–"
            if goal is not None:
                met = "yes" if (ratio >= goal[1] if goal[0] == ">=" else ratio <= goal[1]) else "**no**"
            digits = 1 if "ms" in name or "prefill tok/s" in name else 2
            lines.append(
                f"| {name} | {med(fig['tandem'], digits)} | {med(fig['llama-server'], digits)} | "
                f"{med(fig['tandem ratio'])} | {f'{goal[0]} {goal[1]:.1f}×' if goal else '–'} | {met} |"
                + (f" {med(fig['tandem fast'], digits)} | {med(fig['tandem fast ratio'])} |" if fast else "")
                + (
                    f" {med(fig[VENDORED], digits)} | {med(fig['tandem / vendored'])} | "
                    f"{med(fig['vendored / llama-server'])} |"
                    if vend
                    else ""
                )
            )
        cached = [
            (r["kind"], r["system"], r["prompt_tokens"], r["cached_tokens"])
            for r in result["rows"]
            if r["run"] == 0 and r["kind"] != "prefill"
        ]
        lines += [
            "",
            "Prompt tokens and tokens each took from its cache (run 1; llama-server's `cache_n`): "
            + "; ".join(f"{k} {s} {p}/{c}" for k, s, p, c in cached)
            + ".",
        ]
        waits = [r["waited_before"] for r in result["rows"] if "waited_before" in r]
        if waits:
            lines += [
                "",
                f"Each request waited until every system was idle (the work before it, e.g. tandem settling the "
                f"turn it had just answered): median {statistics.median(waits):.2f} s, at most {max(waits):.2f} s. "
                "A client that sends its next turn sooner gets less of what settling gives.",
            ]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "REPORT.md").write_text("\n".join(lines) + "\n")
    return out_dir / "REPORT.md"


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run(args: argparse.Namespace, server_bin: Path, out: Optional[Path]) -> Path:
    import llama_cpp

    from tandem.daemon.version import __version__

    threads = os.cpu_count() or 2
    results = {
        "command": "python -m bench --peer"
        + (f" --models {','.join(args.models)}" if args.models else "")
        + (" --also-fast" if args.also_fast else "")
        + (" --also-vendored" if args.also_vendored else ""),
        "started": datetime.datetime.now().isoformat(),
        "runs": args.runs,
        "tokens": args.tokens,
        "ctx": args.ctx,
        "threads": threads,
        "server": str(server_bin),
        "machine": {
            "cpu": cpu_model(),
            "cores": os.cpu_count(),
            "cpu_flags": cpu_flags(),
            "tandem": __version__,
            "llama_cpp_python": llama_cpp.__version__,
        },
        "models": [],
    }
    vendored_bin = vendored_server() if args.also_vendored else None
    if vendored_bin is not None:
        results["vendored_server"] = str(vendored_bin)
    for name in args.models or DEFAULT_MODELS:
        results["models"].append(
            bench_model(name, server_bin, args.runs, args.tokens, args.ctx, threads, args.also_fast, vendored_bin)
        )
    results["finished"] = datetime.datetime.now().isoformat()
    out = out or BENCH / "results" / f"{datetime.date.today().isoformat()}-{socketlib.gethostname()}-peer"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return write_report(results, out)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--models",
        type=lambda s: s.split(","),
        default=None,
        metavar="A,B",
        help=f"with --peer: models (presets or .gguf paths; default {','.join(DEFAULT_MODELS)})",
    )
    ap.add_argument("--tokens", type=int, default=96, help="with --peer: tokens per request (default 96)")
    ap.add_argument("--ctx", type=int, default=4096, help="with --peer: context size of both (default 4096)")
    ap.add_argument(
        "--also-fast",
        action="store_true",
        help="with --peer: a third system, tandem with --kernels fast (not batch-invariant: what exactness costs)",
    )
    ap.add_argument(
        "--also-vendored",
        action="store_true",
        help="with --peer: one more system, llama-server built from the llama.cpp that tandem runs "
        "(bench/build_llama_server.sh vendored): separates what tandem's code costs from what the llama.cpp "
        "version does",
    )
