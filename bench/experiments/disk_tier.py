"""The prefix cache's disk tier: an agent's first turn after a reboot, with and without it.

    python -m bench.experiments.disk_tier   # Qwen2.5-Coder-1.5B, ~3,000-token preamble, 3 runs
    python -m bench.experiments.disk_tier --model smollm2-135m --runs 2 --system-chars 4000

Each run builds a new agent conversation (bench/prefix_cache.py's: a system prompt
with tool schemas, the task, a tool output; about 3,000 tokens with the defaults)
and then, each in a daemon of its own started as a user starts it:

- **day 1** (disk tier on): the first turn, read whole; at once the second turn
  (its prompt extends the first), while the first turn's pages are still being
  written to disk: its TTFT shows what the writing costs the next request. Then
  ``tandem stop``, which writes what was left, and the shared-memory arena is gone.
- **after a reboot**, in turns (the order rotates each run):
  - *disk, warm*: a new daemon on the same disk tier, the first turn again: its
    pages come from the page files, which the OS still has in its page cache;
  - *disk, cold*: the same after the page files were dropped from the page cache
    (``posix_fadvise(DONTNEED)`` after ``sync``), as after a real reboot;
  - *no disk*: a daemon with ``--disk-cache-bytes 0``: the first turn read whole,
    then the second at once (the write cost's baseline).

Reported: median (min–max) over runs of each TTFT, the speedup of the first turn
after a reboot (no disk / disk), the second turn's TTFT with and without writes
pending, and the writes (pages, MiB, ms per page, MB/s), the stop's duration and
the reads. Goal (the disk-tier issue): first turn after a reboot >= 10x faster
with a 3,000-token preamble on Qwen2.5-Coder-1.5B; the writes do not show in the
next request's TTFT. Report: bench/results/<date>-<host>-disk/.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from bench.common import cpu_model, fmt, model_path, start_daemon, temp_socket
from bench.prefix_cache import Conversation, ttft_tandem
from tandem.client import Client

BENCH = Path(__file__).resolve().parents[1]  # bench/, whose results/ the default --out is in


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def daemon(model: Path, ctx: int, kv: Path | None, *extra: str):
    sock = temp_socket("tdm-disk-")
    env_kv = os.environ.get("TANDEM_DISK_CACHE_DIR")
    if kv is not None:
        os.environ["TANDEM_DISK_CACHE_DIR"] = str(kv)
    try:
        proc = start_daemon(sock, "--model", str(model), "--ctx-size", str(ctx), *extra)
    finally:
        if env_kv is None:
            os.environ.pop("TANDEM_DISK_CACHE_DIR", None)
        else:
            os.environ["TANDEM_DISK_CACHE_DIR"] = env_kv
    return proc, Client(sock)


def stop(proc, client: Client) -> float:
    started = time.perf_counter()
    client.close()
    proc.terminate()
    proc.wait(60)
    return time.perf_counter() - started


def drop_page_cache(kv: Path) -> None:
    os.sync()
    for p in kv.rglob("*.page"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def wait_written(client: Client, timeout: float = 120.0):
    """The disk tier once the worker has written everything (status after its cache_state)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        disk = client.status().cache.disk
        if last is not None and disk.pages_written == last.pages_written and disk.pages_written:
            return disk
        last = disk
        time.sleep(0.5)
    return last


def one_run(r: int, args, model: Path) -> dict:
    salt = f"disk-{r}-{random.Random(r).randrange(10**9)}"
    conv = Conversation(seed=2000 + r, salt=salt, system_chars=args.system_chars, tool_chars=args.tool_chars)
    turn1 = conv.next_prompt()
    turn2 = conv.next_prompt()
    kv = temp_socket("tdm-diskkv-").parent / "kv"
    row: dict = {"run": r}

    proc, client = daemon(model, args.ctx, kv)
    row["day1_ttft"], row["prompt_tokens"], _ = ttft_tandem(client, turn1, cache=True)
    row["turn2_ttft_disk"], row["turn2_tokens"], row["turn2_cached"] = ttft_tandem(client, turn2, cache=True)
    disk = wait_written(client)
    row["pages_written"], row["bytes_written"], row["write_seconds"] = (
        disk.pages_written,
        disk.bytes_written,
        disk.write_seconds,
    )
    row["stop_seconds"] = stop(proc, client)
    say(
        f"run {r + 1}: day 1 TTFT {row['day1_ttft']:.2f} s ({row['prompt_tokens']} tokens), turn 2 "
        f"{row['turn2_ttft_disk']:.2f} s; {disk.pages_written} pages written ({disk.bytes_written / 2**20:.0f} MiB "
        f"in {disk.write_seconds:.2f} s); stop {row['stop_seconds']:.2f} s"
    )

    order = ["disk warm", "disk cold", "no disk"]
    order = order[r % 3 :] + order[: r % 3]
    for system in order:
        if system == "no disk":
            proc, client = daemon(model, args.ctx, None, "--disk-cache-bytes", "0")
            row["no_disk_ttft"], _, _ = ttft_tandem(client, turn1, cache=True)
            row["turn2_ttft_no_disk"], _, _ = ttft_tandem(client, turn2, cache=True)
        else:
            if system == "disk cold":
                drop_page_cache(kv)
            proc, client = daemon(model, args.ctx, kv)
            key = "warm" if system == "disk warm" else "cold"
            row[f"{key}_ttft"], _, row[f"{key}_cached"] = ttft_tandem(client, turn1, cache=True)
            d = client.status().cache.disk
            row[f"{key}_pages_read"], row[f"{key}_read_seconds"] = d.pages_read, d.read_seconds
        stop(proc, client)
        prefix = {"disk warm": "warm_", "disk cold": "cold_", "no disk": "no_disk_"}[system]
        shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items() if k.startswith(prefix)}
        say(f"  {system:9s} " + json.dumps(shown))
    return row


def report(rows: list[dict], args, model: Path, started: str) -> str:
    def col(key):
        return [row[key] for row in rows]

    speed_warm = [row["no_disk_ttft"] / row["warm_ttft"] for row in rows]
    speed_cold = [row["no_disk_ttft"] / row["cold_ttft"] for row in rows]
    turn2 = [row["turn2_ttft_disk"] / row["turn2_ttft_no_disk"] for row in rows]
    ms_per_page = [1000 * row["write_seconds"] / row["pages_written"] for row in rows if row["pages_written"]]
    mbps = [row["bytes_written"] / row["write_seconds"] / 1e6 for row in rows if row["write_seconds"]]
    read_ms = [1000 * row["cold_read_seconds"] / max(1, row["cold_pages_read"]) for row in rows]
    lines = [
        "# The prefix cache's disk tier: the first turn after a reboot",
        "",
        f"Run {started} with `python -m bench.experiments.disk_tier --model {args.model} --runs {args.runs} "
        f"--system-chars {args.system_chars} --tool-chars {args.tool_chars}`; median (min–max) over runs. "
        "Method: bench/experiments/disk_tier.py's docstring.",
        "",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        f"- model: {model.name} ({model.stat().st_size >> 20} MiB), context {args.ctx}",
        f"- first turn: {fmt(col('prompt_tokens'), 0)} prompt tokens; the second: {fmt(col('turn2_tokens'), 0)}",
        "",
        "| figure | value |",
        "|---|---|",
        f"| first turn, day 1 (read whole), TTFT s | {fmt(col('day1_ttft'))} |",
        f"| first turn after a reboot, no disk tier, TTFT s | {fmt(col('no_disk_ttft'))} |",
        f"| first turn after a reboot, disk tier (page cache warm), TTFT s | {fmt(col('warm_ttft'), 3)} |",
        f"| first turn after a reboot, disk tier (page cache dropped), TTFT s | {fmt(col('cold_ttft'), 3)} |",
        f"| speedup, warm (no disk / disk) | {fmt(speed_warm, 1)}× |",
        f"| speedup, cold (no disk / disk) | {fmt(speed_cold, 1)}× |",
        f"| prompt tokens restored from disk (cold) | {fmt(col('cold_cached'), 0)} |",
        f"| read from disk, cold: ms per page | {fmt(read_ms)} |",
        f"| second turn at once, with pages being written, TTFT s | {fmt(col('turn2_ttft_disk'))} |",
        f"| second turn at once, no disk tier, TTFT s | {fmt(col('turn2_ttft_no_disk'))} |",
        f"| second turn: with writes / without | {fmt(turn2)} |",
        f"| pages written per first+second turn | {fmt(col('pages_written'), 0)} |",
        f"| MiB written | {fmt([row['bytes_written'] / 2**20 for row in rows], 0)} |",
        f"| write: ms per page / MB/s | {fmt(ms_per_page)} / {fmt(mbps, 0)} |",
        f"| `tandem stop` (writes what is left), s | {fmt(col('stop_seconds'))} |",
        "",
        f"Goal: first turn after a reboot >= 10× faster with the disk tier: "
        f"{'met' if statistics.median(speed_cold) >= 10 else 'not met'} (cold, median "
        f"{statistics.median(speed_cold):.1f}×); the writes do not show in the next request's TTFT: "
        f"with / without {statistics.median(turn2):.2f}.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--system-chars", type=int, default=10000, help="the preamble's size (10000: ~3,000 tokens)")
    ap.add_argument("--tool-chars", type=int, default=600)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    model = model_path(args.model)
    started = datetime.datetime.now().isoformat(timespec="minutes")
    rows = [one_run(r, args, model) for r in range(args.runs)]
    text = report(rows, args, model, started)
    out = args.out or BENCH / "results" / f"{datetime.date.today()}-{platform.node() or 'host'}-disk"
    out.mkdir(parents=True, exist_ok=True)
    (out / "REPORT.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"args": vars(args) | {"out": str(out)}, "rows": rows}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
