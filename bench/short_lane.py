"""A short request during a long generation, with the short-request lane and without (issue 49, part 4).

    python -m bench.short_lane                                    # Qwen2.5-Coder-0.5B, an 8k agent prompt, 3 runs
    python -m bench.short_lane --model qwen2.5-coder-1.5b --size 16384 --runs 3

The long request is an agent's turn at agent scale (bench/long_context.py's
prompt: Claude Code's recorded preamble and files read into the chat, salted
per run) writing ``--long-tokens`` greedy tokens, its prompt in the prefix
cache (an agent's next turn; read once per run, untimed); the short one is a
title request (a few lines, ``--short-tokens`` tokens), sent once the long one
has written 16 tokens, and once more while its prompt is read (the reading that
fills the cache, untimed itself). Per run and for each of the lane on (``--preempt-tokens
SHORT_TOKENS``: the long request, which asks for more, is not short; the default
is 512, more than an agent's title asks for and less than its turns) and off
(``--preempt-tokens 0``), one daemon each, in one run: the short request's
latency alone (an idle daemon; the mean of two) and during the long one, and
the long one's total time alone and with the short one in it. The issue's bars: the short
request during a long one within 1.5x its latency alone, and the long one's
time within its time alone plus the short one's. Output is compared too: each
request writes the same text alone and together.
"""

from __future__ import annotations

import argparse
import datetime
import random
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import psutil

from bench.common import cpu_model, model_path, start_daemon, temp_socket, wait_quiet
from bench.long_context import agent_prompt, med, say, write_report
from tandem.client import Client

BENCH = Path(__file__).resolve().parent
TITLE = [
    {"role": "system", "content": "Write a five-word title for the conversation. Reply with the title only."},
    {"role": "user", "content": "How do I make the daemon answer a short request while a long one runs?"},
]


def timed_request(
    sock: Path, out: dict, key: str, ready: Optional[threading.Event] = None, reading: bool = False, **kw
) -> None:
    """One request on its own connection; ``out[key]`` = (seconds, done). ``ready`` is set
    once it has written 16 tokens, or with ``reading``, once its prompt's reading has gone on
    for a second or more."""
    with Client(sock) as client:
        started = time.perf_counter()
        stream = client.generate(temperature=0.0, progress=reading, **kw)
        n = 0
        for chunk in stream:
            n += len(chunk.token_ids)
            if ready is not None and (n >= 16 or (reading and chunk.progress and chunk.progress.seconds >= 1)):
                ready.set()
        out[key] = (time.perf_counter() - started, stream.done)


def during(sock: Path, out: dict, long_key: str, short_key: str, reading: bool, long_kw: dict, short_kw: dict):
    """The long request, and the short one once it has written 16 tokens (or read for a second)."""
    ready = threading.Event()
    kw = dict(ready=ready, reading=reading, **long_kw)
    t = threading.Thread(target=timed_request, args=(sock, out, long_key), kwargs=kw)
    t.start()
    ready.wait(3600)
    timed_request(sock, out, short_key, **short_kw)
    t.join()


def one_run(sock: Path, pid: int, long_messages: list[dict], args) -> dict:
    long_kw = dict(messages=long_messages, max_tokens=args.long_tokens, ignore_eos=True)
    short_kw = dict(messages=TITLE, max_tokens=args.short_tokens, cache=False)
    out: dict = {}
    # the long prompt read once into the prefix cache, with a short request sent during its reading
    # (its time is not compared: a prompt read twice differs by more than that, in noise); both timed
    # long runs then restore it from its pages, after a short request each (which leaves nothing of it
    # live), and differ only in the short request within the second, sent between two of its steps
    during(sock, out, "warm", "short_during_reading", True, long_kw, short_kw)
    for alone in ("short_alone", "short_alone_2"):
        wait_quiet([pid])
        timed_request(sock, out, alone, **short_kw)
        wait_quiet([pid])
        if alone == "short_alone":
            timed_request(sock, out, "long_alone", **long_kw)
    during(sock, out, "long_with", "short_during", False, long_kw, short_kw)
    row = {key: seconds for key, (seconds, _) in out.items()}
    row["short_alone"] = (row.pop("short_alone") + row.pop("short_alone_2")) / 2
    shorts = ("short_during", "short_during_reading", "short_alone", "short_alone_2")
    row["same_text"] = (
        len({out[k][1].text for k in shorts}) == 1
        and out["long_with"][1].text == out["long_alone"][1].text == out["warm"][1].text
    )
    row["paused_reading"] = out["warm"][1].timings.paused_seconds
    row["paused"] = out["long_with"][1].timings.paused_seconds
    row["prompt_tokens"] = out["long_alone"][1].usage.prompt_tokens
    return row


def report(rows: list[dict], out: Path, command: str, model: str) -> Path:
    lines = [
        f"# A short request during a long generation: {model}",
        "",
        f"{datetime.date.today()}, {cpu_model()}, {psutil.cpu_count()} cores. Command: `{command}`",
        "",
        "| lane | long prompt tokens | short alone s | short during the reading s | short between steps s | "
        "between steps / alone | long alone s | long with short s | (long with) - (long alone) - (short alone) s "
        "| same text |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lane in ("on", "off"):
        mine = [r for r in rows if r["lane"] == lane]
        if not mine:
            continue
        lines.append(
            f"| {lane} | {med([r['prompt_tokens'] for r in mine], 0)} | {med([r['short_alone'] for r in mine])} "
            f"| {med([r['short_during_reading'] for r in mine])} | {med([r['short_during'] for r in mine])} "
            f"| {med([r['short_during'] / r['short_alone'] for r in mine])} "
            f"| {med([r['long_alone'] for r in mine], 1)} | {med([r['long_with'] for r in mine], 1)} "
            f"| {med([r['long_with'] - r['long_alone'] - r['short_alone'] for r in mine])} "
            f"| {sum(r['same_text'] for r in mine)}/{len(mine)} |"
        )
    return write_report(out, rows, lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="a preset or a .gguf path")
    ap.add_argument("--size", type=int, default=8192, help="the long request's prompt, in tokens (default 8192)")
    ap.add_argument("--long-tokens", type=int, default=128, help="tokens the long request writes (default 128)")
    ap.add_argument("--short-tokens", type=int, default=16, help="tokens the short request writes (default 16)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--lanes", nargs="+", default=["on", "off"], choices=["on", "off"])
    ap.add_argument("--out", type=Path, default=None, help="report directory (default bench/results/DATE-lane-MODEL)")
    args = ap.parse_args(argv)
    command = "python -m bench.short_lane " + " ".join(argv if argv is not None else sys.argv[1:])
    path = model_path(args.model)
    rows = []
    for lane in args.lanes:
        sock = temp_socket("tdm-lane-")
        serve = ["--model", str(path), "--ctx-size", str(args.size + 512), "--disk-cache-bytes", "0"]
        lane_args = ["--preempt-tokens", "0" if lane == "off" else str(args.short_tokens)]
        daemon = start_daemon(sock, *serve, *lane_args, timeout=900)
        try:
            with Client(sock) as client:
                prompts = [
                    agent_prompt(lambda m: client.count_tokens(messages=m), args.size, f"{r}-{random.random()}")
                    for r in range(args.runs)
                ]
                timed_request(sock, {}, "warm-up", messages=TITLE, max_tokens=4)
            for r in range(args.runs):
                row = one_run(sock, daemon.pid, prompts[r], args)
                row.update(lane=lane, run=r)
                rows.append(row)
                say(
                    f"  lane {lane} run {r + 1}: short alone {row['short_alone']:.2f} s, during the reading "
                    f"{row['short_during_reading']:.2f} s, between steps {row['short_during']:.2f} s; "
                    f"long alone {row['long_alone']:.1f} s, with {row['long_with']:.1f} s "
                    f"(paused {row['paused']:.2f} s); same text {row['same_text']}"
                )
        finally:
            daemon.terminate()
            daemon.wait(30)
    out = args.out or BENCH / "results" / f"{datetime.date.today()}-lane-{Path(args.model).name.removesuffix('.gguf')}"
    say(f"report: {report(rows, out, command, args.model)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
