"""Prefix cache: time to first token (TTFT) of an agent loop and of interleaved
sessions, through the daemon's socket, with the cache on and off, against the
ideal and against llama.cpp's llama-server with its prompt cache.

The agent loop: a ~4,000-token system prompt with tool definitions and a task,
then 6 turns, each re-sending everything before it plus the agent's last reply
and ~1,200 tokens of tool output (turn 1 already holds the first tool output).
Each turn is timed as a streaming client sees it: request sent -> first chunk.

Systems, alternated turn by turn so that drift on a shared machine hits all:
- ``tandem``: the daemon with its prefix cache (default budget);
- ``no cache``: the same daemon, each request sent with ``cache: false``;
- ``ideal``: this process holds the model (tandem's own llama.cpp wrapper,
  same threads and batch) with the previous turn still in its KV cache, and
  prefills only the new tokens: what a perfect, free cache would give;
- ``llama-server`` (with ``--llama-server PATH``): llama.cpp's server with its
  default prompt cache (``cache_prompt``, slots and its RAM cache), bound to
  127.0.0.1, same model, context and threads. Its command line is printed.

Interleaved sessions: ``--sessions`` agents (an editor with several buffers),
each with its own system prompt, take turns: turn 1 of each, then turn 2 of
each, ... TTFT with tandem and with llama-server.

Every run uses fresh prompts (a salt in the first line), so nothing carries
over between runs. Reports median (min–max) over ``--runs``.

    bench/build_llama_server.sh     # once, ~10 minutes
    python -m bench.prefix_cache --model qwen2.5-coder-0.5b --runs 3 \\
        --llama-server ~/.cache/tandem/llama-server/b11434/bin/llama-server
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import shlex
import statistics
import subprocess
import time
from pathlib import Path
from typing import Optional

from bench.common import fmt, free_port, model_path, start_daemon, temp_socket
from tandem.client import Client
from tandem.daemon.worker.llama_load import cpu_has_amx

TOOLS = [
    (
        "read_file",
        "Read a file of the repository and return its text with line numbers.",
        ["path", "start_line", "end_line"],
    ),
    (
        "write_file",
        "Replace the whole content of a file. Use only for new files or complete rewrites.",
        ["path", "content"],
    ),
    ("apply_patch", "Apply a unified diff to the working tree; fails if a hunk does not apply cleanly.", ["patch"]),
    (
        "run_tests",
        "Run the test suite or a subset of it and return the report, failures first.",
        ["selector", "timeout_seconds"],
    ),
    (
        "grep",
        "Search the repository for a regular expression and return matching lines with paths.",
        ["pattern", "path_glob"],
    ),
    ("list_dir", "List a directory, with file sizes and modification times.", ["path", "depth"]),
    ("git_diff", "Show the diff of the working tree against HEAD or another revision.", ["revision", "paths"]),
    ("git_log", "Show recent commits touching the given paths.", ["paths", "max_count"]),
    (
        "run_command",
        "Run a shell command in the sandbox and return its exit code, stdout and stderr.",
        ["command", "cwd"],
    ),
    ("open_issue", "Read an issue of the tracker with its comments.", ["number"]),
    ("search_docs", "Search the project's documentation and return the best matching sections.", ["query", "limit"]),
    ("lint", "Run the linters on the given paths and return their findings.", ["paths", "fix"]),
]
RULES = [
    "Read before you write: never change a file you have not read in this session.",
    "Keep changes minimal and focused on the task; do not reformat unrelated code.",
    "Run the relevant tests after every change and read their output before going on.",
    "When a test fails, find the cause before changing the test; never weaken an assertion to make it pass.",
    "Prefer the project's existing helpers and patterns over new abstractions.",
    "Explain each tool call in one sentence before making it.",
    "Stop and ask when the task is ambiguous or a change would touch public interfaces.",
    "Never print secrets, tokens or credentials, even if a file contains them.",
]
WORDS = (
    "config parser worker queue socket cache page token model daemon client request reply status error retry "
    "timeout buffer stream chunk batch prefix tree node leaf budget evict lock index arena layout state"
).split()


def system_prompt(rng: random.Random, salt: str, target_chars: int) -> str:
    project = f"{rng.choice(WORDS)}-{rng.choice(WORDS)}-{rng.randrange(1000)}"
    parts = [f"Session {salt}. You are a coding agent working in the repository '{project}'.", "", "## Tools", ""]
    i = 0
    while sum(len(p) + 1 for p in parts) < target_chars:
        name, desc, params = TOOLS[i % len(TOOLS)]
        variant = i // len(TOOLS)
        schema = {
            "name": name if variant == 0 else f"{name}_v{variant + 1}",
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {
                    p: {
                        "type": "string",
                        "description": f"The {p.replace('_', ' ')} ({rng.choice(WORDS)} {rng.choice(WORDS)}).",
                    }
                    for p in params
                },
                "required": params[:1],
            },
        }
        parts.append(json.dumps(schema, indent=1))
        if i % 3 == 2:
            parts.append("Rule: " + RULES[(i // 3) % len(RULES)])
        i += 1
    return "\n".join(parts)


def tool_output(rng: random.Random, target_chars: int) -> str:
    kind = rng.choice(["tests", "file", "grep"])
    lines: list[str] = []
    n = 0
    while sum(len(x) + 1 for x in lines) < target_chars:
        n += 1
        a, b, c = rng.choice(WORDS), rng.choice(WORDS), rng.choice(WORDS)
        if kind == "tests":
            verdict = rng.choice(["PASSED", "PASSED", "PASSED", "FAILED", "SKIPPED"])
            lines.append(f"tests/test_{a}.py::test_{b}_{c}_{n} {verdict} [{rng.randrange(100)}%]")
        elif kind == "file":
            lines.append(
                f"{n:4d}  def {a}_{b}(self, {c}: int = {rng.randrange(64)}) -> {rng.choice(['int', 'str', 'None'])}:"
            )
        else:
            lines.append(f"src/{a}/{b}.py:{rng.randrange(1, 900)}:    self.{c} = {a}({b}, {rng.randrange(10)})")
    return "\n".join(lines)


class Conversation:
    """One agent's prompts, turn by turn (ChatML, as Qwen2.5 and SmolLM2 use)."""

    def __init__(self, seed: int, salt: str, system_chars: int, tool_chars: int):
        self.rng = random.Random(seed)
        self.tool_chars = tool_chars
        self.text = (
            f"<|im_start|>system\n{system_prompt(self.rng, salt, system_chars)}<|im_end|>\n"
            "<|im_start|>user\nThe test suite fails on the main branch; find out why and fix it.<|im_end|>\n"
        )
        self.turns = 0

    def next_prompt(self) -> str:
        """The prompt of the next turn: what was sent before, the agent's reply
        to it (turns after the first) and a new tool output."""
        if self.turns:
            self.text += f"<|im_start|>assistant\nI will call {self.rng.choice(TOOLS)[0]} next.<|im_end|>\n"
        self.text += f"<|im_start|>user\nTool output:\n{tool_output(self.rng, self.tool_chars)}<|im_end|>\n"
        self.turns += 1
        return self.text + "<|im_start|>assistant\n"


# ---------------------------------------------------------------------------- systems


def ttft_tandem(client: Client, prompt: str, cache: bool) -> tuple[float, int, int]:
    """(seconds to the first chunk, prompt tokens, cached tokens)"""
    started = time.perf_counter()
    stream = client.generate(prompt=prompt, max_tokens=4, temperature=0.0, cache=cache, ignore_eos=True)
    first = None
    for _ in stream:
        if first is None:
            first = time.perf_counter() - started
    done = stream.done
    return (
        first if first is not None else time.perf_counter() - started,
        done.usage.prompt_tokens,
        done.usage.cached_tokens,
    )


class Ideal:
    """The model in this process, keeping the previous prompt in its KV cache."""

    def __init__(self, path: Path, n_ctx: int, flash_attn: bool):
        from tandem.daemon.worker.llama_model import LlamaModel

        self.model = LlamaModel(path, n_ctx=n_ctx, flash_attn=flash_attn)
        self.tokens: list[int] = []

    def ttft(self, prompt: str) -> tuple[float, int]:
        """(seconds to prefill what is new and pick a token, new tokens)"""
        import numpy as np

        tokens = self.model.tokenize(prompt, add_special=True, parse_special=True)
        keep = 0
        while keep < min(len(tokens), len(self.tokens)) - 1 and tokens[keep] == self.tokens[keep]:
            keep += 1
        self.model.truncate(keep)
        started = time.perf_counter()
        logits = self.model.decode(tokens[keep:])[0]
        int(np.argmax(logits))
        seconds = time.perf_counter() - started
        self.tokens = tokens
        return seconds, len(tokens) - keep

    def forget(self) -> None:
        self.model.clear()
        self.tokens = []


class LlamaServer:
    def __init__(
        self,
        binary: Path,
        model: Path,
        n_ctx: int,
        threads: int,
        flash_attn: Optional[bool],
        extra: tuple[str, ...] = (),
    ):
        """``flash_attn`` None: llama-server's own default (auto)."""
        self.port = free_port()
        self.command = [
            str(binary),
            "-m",
            str(model),
            "-c",
            str(n_ctx),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--no-webui",
        ]
        if flash_attn is not None:
            self.command += ["-fa", "on" if flash_attn else "off"]
        if cpu_has_amx():
            self.command.append("--no-repack")  # like tandem's --extra-buffers auto: AMX repacking crashes
        self.command += extra
        env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}
        self.log = open(Path("/tmp") / f"llama-server-{self.port}.log", "wb")
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"llama-server exited with {self.proc.returncode}; see {self.log.name}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise SystemExit("llama-server did not become ready")

    def ttft(self, prompt: str) -> tuple[float, int]:
        """(seconds to the first streamed token, prompt tokens it processed)"""
        body = json.dumps(
            {
                "prompt": prompt,
                "n_predict": 4,
                "temperature": 0.0,
                "stream": True,
                "cache_prompt": True,
                "ignore_eos": True,
            }
        )
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        started = time.perf_counter()
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        first, processed = None, -1
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if first is None and event.get("content"):
                first = time.perf_counter() - started
            if event.get("stop"):
                processed = int(event.get("timings", {}).get("prompt_n", -1))
                break
        conn.close()
        return first if first is not None else time.perf_counter() - started, processed

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# ---------------------------------------------------------------------------- workloads


def agent_loop(run, args, client, ideal, server, rows, quiet=lambda: None):
    """``quiet``: called before each measured request (the full report waits there until every
    system's processes are idle, so what one does after a reply does not slow the next one down)."""
    conv = Conversation(
        seed=1000 + run, salt=f"{run}-agent", system_chars=args.system_chars, tool_chars=args.tool_chars
    )
    ideal.forget()
    for turn in range(1, args.turns + 1):
        prompt = conv.next_prompt()
        row = {"run": run, "turn": turn}
        quiet()
        row["tandem"], row["prompt_tokens"], row["cached_tokens"] = ttft_tandem(client, prompt, cache=True)
        quiet()
        row["no_cache"], _, _ = ttft_tandem(client, prompt, cache=False)
        quiet()
        row["ideal"], row["new_tokens"] = ideal.ttft(prompt)
        if server is not None:
            quiet()
            row["llama_server"], row["server_prefilled"] = server.ttft(prompt)
        rows.append(row)
        print(
            "  agent", json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True
        )


def interleaved(run, args, client, server, rows, quiet=lambda: None):
    convs = [
        Conversation(
            seed=2000 + 10 * run + s, salt=f"{run}-s{s}", system_chars=args.system_chars, tool_chars=args.tool_chars
        )
        for s in range(args.sessions)
    ]
    for turn in range(1, args.turns + 1):
        for s, conv in enumerate(convs):
            prompt = conv.next_prompt()
            row = {"run": run, "turn": turn, "session": s}
            quiet()
            row["tandem"], row["prompt_tokens"], row["cached_tokens"] = ttft_tandem(client, prompt, cache=True)
            if server is not None:
                quiet()
                row["llama_server"], row["server_prefilled"] = server.ttft(prompt)
            rows.append(row)
            print(
                "  interleaved",
                json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}),
                flush=True,
            )


# ---------------------------------------------------------------------------- report


def per_turn_table(rows, systems) -> list[str]:
    out = [
        "| turn | prompt tokens | new tokens | "
        + " | ".join(f"{s} TTFT s" for s in systems)
        + " | no cache / tandem | no cache / ideal | tandem vs ideal |",
        "|---|---|---|" + "---|" * (len(systems) + 3),
    ]
    for turn in sorted({r["turn"] for r in rows}):
        rs = [r for r in rows if r["turn"] == turn]
        cells = [fmt([r[s] for r in rs]) for s in systems]
        speedup = [r["no_cache"] / r["tandem"] for r in rs]
        ideal_speedup = [r["no_cache"] / r["ideal"] for r in rs]
        of_ideal = [r["ideal"] / r["tandem"] for r in rs]
        out.append(
            f"| {turn} | {statistics.median(r['prompt_tokens'] for r in rs):,.0f} | "
            f"{statistics.median(r['new_tokens'] for r in rs):,.0f} | "
            + " | ".join(cells)
            + f" | {fmt(speedup, 1)}× | {fmt(ideal_speedup, 1)}× | {fmt(of_ideal)} |"
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="preset or .gguf path (default %(default)s)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--sessions", type=int, default=3, help="interleaved sessions (0: skip that workload)")
    ap.add_argument("--system-chars", type=int, default=13_000, help="system prompt size (~4,000 Qwen tokens)")
    ap.add_argument("--tool-chars", type=int, default=3_600, help="tool output per turn (~1,200 Qwen tokens)")
    ap.add_argument("--ctx-size", type=int, default=16_384)
    ap.add_argument(
        "--interleaved-runs", type=int, default=None, help="runs of the interleaved workload (default --runs)"
    )
    ap.add_argument(
        "--first-run", type=int, default=0, help="number of the first run (its prompts' salt), to add runs later"
    )
    ap.add_argument(
        "--flash-attn",
        choices=["on", "off"],
        default="on",
        help="for every system (tandem serve --flash-attn, llama-server -fa, the ideal); on: 20%% faster prefill here",
    )
    ap.add_argument("--llama-server", type=Path, default=None, help="llama-server binary (bench/build_llama_server.sh)")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args()

    path = model_path(args.model)
    threads = os.cpu_count() or 1
    sock = temp_socket("tdm-pc-")
    fa = args.flash_attn == "on"
    serve_args = ["--model", str(path), "--ctx-size", str(args.ctx_size), "--flash-attn", args.flash_attn]
    daemon = start_daemon(sock, *serve_args)
    server = LlamaServer(args.llama_server, path, args.ctx_size, threads, fa) if args.llama_server else None
    ideal = Ideal(path, args.ctx_size, fa)
    inter_runs = args.runs if args.interleaved_runs is None else args.interleaved_runs
    agent_rows: list[dict] = []
    inter_rows: list[dict] = []
    try:
        with Client(sock) as client:
            for run in range(args.first_run, args.first_run + args.runs):
                print(f"run {run + 1} of {args.first_run + args.runs}", flush=True)
                agent_loop(run, args, client, ideal, server, agent_rows)
                if args.sessions and run - args.first_run < inter_runs:
                    interleaved(run, args, client, server, inter_rows)
            cache = client.status().cache
    finally:
        daemon.terminate()
        daemon.wait(30)
        if server is not None:
            server.stop()

    systems = ["tandem", "no_cache", "ideal"] + (["llama_server"] if server else [])
    print(f"\n## Agent loop: {path.name}, {args.runs} runs, TTFT per turn, median (min–max)\n")
    print("\n".join(per_turn_table(agent_rows, systems)))
    later = [r for r in agent_rows if r["turn"] >= 2]
    runs = range(args.first_run, args.first_run + args.runs)
    by_run = lambda key: [statistics.mean(r[key] for r in later if r["run"] == run) for run in runs]  # noqa: E731
    summary = {
        "turns 2+: no cache / tandem": [a / b for a, b in zip(by_run("no_cache"), by_run("tandem"))],
        "turns 2+: ideal / tandem (1.0 = ideal)": [a / b for a, b in zip(by_run("ideal"), by_run("tandem"))],
    }
    if server:
        summary["turns 2+: llama-server / tandem"] = [a / b for a, b in zip(by_run("llama_server"), by_run("tandem"))]
    if inter_rows:
        ilater = [r for r in inter_rows if r["turn"] >= 2]
        print(f"\n## {args.sessions} interleaved sessions, {inter_runs} runs, turns 2+, mean TTFT per run\n")
        t = [statistics.mean(r["tandem"] for r in ilater if r["run"] == run) for run in runs[:inter_runs]]
        print(f"tandem: {fmt(t)} s")
        if server:
            s = [statistics.mean(r["llama_server"] for r in ilater if r["run"] == run) for run in runs[:inter_runs]]
            print(f"llama-server: {fmt(s)} s")
            summary["interleaved turns 2+: llama-server / tandem"] = [a / b for a, b in zip(s, t)]
            print(
                "llama-server prompt tokens it prefilled, turns 2+: median "
                f"{statistics.median(r['server_prefilled'] for r in ilater):,.0f}"
            )
    print("\n## Summary (per run: mean over turns 2+ first, then median (min–max) over runs)\n")
    for k, v in summary.items():
        print(f"- {k}: {fmt(v)}×")
    if cache is not None:
        print(
            f"\ncache at the end: {cache.pages:,} pages, {cache.bytes_used / 2**20:.0f} MiB "
            f"of {cache.bytes_budget / 2**20:.0f} MiB, "
            f"{cache.evictions} evictions"
        )
    if server:
        print(f"\nllama-server command: {shlex.join(server.command)}")
    print(f"tandem command: tandem serve {shlex.join(serve_args)}")
    if args.out:
        args.out.write_text(json.dumps({"agent": agent_rows, "interleaved": inter_rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
