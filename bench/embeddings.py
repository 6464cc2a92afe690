"""Embeddings beside generation: does an indexing burst slow a running generation?

One daemon serves a target and, with ``--embedding-model``, an embedding model in
its own worker (SCHED_IDLE, paced by the daemon: see daemon/embedding/embed_worker.py).
Each round, in an order rotated per round (the machine is shared and drifts), one
greedy generation of ``--tokens`` tokens is streamed:

- ``alone``: nothing else runs;
- ``burst``: an indexing burst arrives once the generation has its first token
  (embed requests of ``--batch`` code-like chunks, sent back to back through the
  daemon until the generation ends);
- ``indexing``: the generation arrives while such a burst runs (it started a
  second before): what it costs the prompt (TTFT) and the decoding;
- ``neighbor``: the same burst computed by a separate embedding process at normal
  priority with every thread (this project's EmbeddingModel in a plain loop: what
  a second embedding server beside the daemon would do), for comparison.

Per condition: decode tok/s (the daemon's ``timings.tokens_per_second``), its
ratio to ``alone`` in the same round, the longest gap between two streamed
chunks (a step held up), the time to the first token, the inputs embedded
meanwhile, and the cores every other process on the machine used meanwhile
(rounds where they used more are reported apart: the machine is shared). Then
the embedding throughput with no generation: inputs/s and tokens/s. Medians and
ranges.

    python -m bench.embeddings [--target qwen2.5-coder-1.5b] [--embedding-model qwen2.5-coder-0.5b]
                               [--rounds 8] [--tokens 96] [--batch 4] [--out DIR]

A benchmark, not a test: figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.common import cpu_model, fmt, model_path, start_daemon, temp_socket
from tandem.client import Client

KINDS = ("alone", "burst", "indexing", "neighbor")
PROMPT = "Write a long, detailed story about a lighthouse keeper and a storm, in plain prose:\n\n"
CHUNK = (
    "def handle_{i}(request, session):\n"
    "    user = session.get_user(request.user_id)\n"
    "    if user is None or not user.active:\n"
    "        raise PermissionError('user {i} is not active')\n"
    "    items = [item for item in request.items if item.quantity > 0]\n"
    "    total = sum(item.price * item.quantity for item in items)\n"
    "    return {{'user': user.name, 'count': len(items), 'total': round(total, 2), 'batch': {i}}}\n"
)


def chunks(n: int, start: int = 0) -> list[str]:
    return [CHUNK.format(i=start + i) for i in range(n)]


class Burst:
    """Embed requests of ``batch`` chunks, back to back, on a thread of its own, until ``stop``."""

    def __init__(self, socket: Path, batch: int):
        self.socket, self.batch = socket, batch
        self.inputs = self.tokens = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with Client(self.socket) as c:
            i = 0
            while not self.stopping.is_set():
                r = c.embed(chunks(self.batch, i))
                self.inputs += len(r.embeddings)
                self.tokens += r.prompt_tokens
                i += self.batch

    def start(self) -> "Burst":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()


class Neighbor:
    """The same embedding model in a process of its own at normal priority, every thread: loaded
    first, it starts looping over bursts of inputs when ``start`` is called."""

    def __init__(self, path: Path, batch: int):
        code = (
            "import sys, itertools\n"
            "from tandem.daemon.embedding.llama_embed import EmbeddingModel\n"
            "from tandem.daemon.embedding.vectors import MAX_SEQS, next_batch\n"
            "from bench.embeddings import chunks\n"
            f"m = EmbeddingModel({str(path)!r})\n"
            "print('ready', flush=True)\n"
            "sys.stdin.readline()\n"
            "for i in itertools.count():\n"
            f"    seqs = [m.tokenize(t) for t in chunks({batch}, i * {batch})]\n"
            "    start = 0\n"
            "    while start < len(seqs):\n"
            "        end = next_batch([len(s) for s in seqs], start, m.n_ctx, MAX_SEQS)\n"
            "        m.embed(seqs[start:end])\n"
            "        start = end\n"
            f"    print({batch}, flush=True)\n"
        )
        env = {**os.environ, "GOMP_SPINCOUNT": "10000"}  # as tandem's embedding worker spins
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        assert self.proc.stdout.readline().strip() == "ready"
        self.inputs = 0
        self.thread = threading.Thread(target=self._count, daemon=True)
        self.thread.start()

    def start(self) -> None:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def _count(self) -> None:
        for line in self.proc.stdout:
            self.inputs += int(line)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def snapshot() -> tuple[float, float, float]:
    """(now, the machine's busy CPU seconds, this benchmark's own: itself, its daemon, its workers, a neighbor)."""
    import psutil

    t = psutil.cpu_times()
    busy = sum(t) - t.idle - t.iowait
    me = psutil.Process()
    own = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            c = proc.cpu_times()
            own += c.user + c.system
        except psutil.NoSuchProcess:
            continue
    return time.monotonic(), busy, own


def others_cores(before: tuple[float, float, float]) -> float:
    """Cores every other process (and the hypervisor's steal) used since ``before`` (a snapshot)."""
    after = snapshot()
    return max(0.0, (after[1] - before[1]) - (after[2] - before[2])) / max(after[0] - before[0], 1e-9)


def others_busy(seconds: float = 1.0) -> float:
    """Cores the other processes used over the next ``seconds``."""
    before = snapshot()
    time.sleep(seconds)
    return others_cores(before)


def wait_machine_quiet(limit: float, busy: float = 0.1) -> float:
    """Wait (at most ``limit`` seconds) until other processes use under ``busy`` of a core: the
    machine is shared, and another process's work would be measured as the burst's. Returns the
    cores they used at the last look."""
    deadline = time.monotonic() + limit
    while (used := others_busy()) >= busy and time.monotonic() < deadline:
        pass
    return used


def generate(socket: Path, tokens: int, on_first=None) -> tuple[float, float, float]:
    """(decode tok/s, the longest gap between two chunks with tokens, time to first token; seconds)."""
    with Client(socket) as c:
        stream = c.generate(prompt=PROMPT, max_tokens=tokens, temperature=0.0, ignore_eos=True, cache=False)
        last, gaps = None, []
        for chunk in stream:
            if not chunk.token_ids:
                continue
            now = time.perf_counter()
            if last is None and on_first is not None:
                on_first()
            elif last is not None:
                gaps.append(now - last)
            last = now
        t = stream.done.timings
        return t.tokens_per_second, max(gaps, default=0.0), t.time_to_first_token_seconds


def wait_embedder(socket: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    with Client(socket) as c:
        while c.status().embedding_model is None:
            if time.monotonic() > deadline:
                raise SystemExit(f"the embedding model did not load: {c.status().embedding}")
            time.sleep(0.2)


def run(args) -> dict:
    target, embedder = model_path(args.target), model_path(args.embedding_model)
    sock = temp_socket("tdm-emb-")
    log = open(sock.parent / "serve.log", "wb")
    daemon = start_daemon(
        sock,
        "--model",
        str(target),
        "--embedding-model",
        str(embedder),
        "--ctx-size",
        "2048",
        "--cache-bytes",
        "0",
        timeout=900,
        stderr=log,
    )
    results: dict = {kind: [] for kind in KINDS}
    try:
        wait_embedder(sock)
        with Client(sock) as c:
            c.embed(chunks(2))  # warm
            st = c.status()
            emb_ctx = st.embedding_model.n_ctx
            tokens_per_chunk = c.embed(chunks(1)).prompt_tokens
        generate(sock, 16)  # warm
        order = list(KINDS)
        for r in range(args.rounds):
            for kind in order[r % len(order) :] + order[: r % len(order)]:
                others = wait_machine_quiet(args.quiet_wait)
                started, before = time.perf_counter(), snapshot()
                if kind == "alone":
                    tps, gap, ttft = generate(sock, args.tokens)
                    inputs, during = 0, others_cores(before)
                elif kind in ("burst", "indexing"):
                    burst, ahead = Burst(sock, args.batch), 0
                    if kind == "indexing":  # the generation arrives while an indexing burst runs
                        burst.start()
                        time.sleep(1.0)
                        started, before, ahead = time.perf_counter(), snapshot(), burst.inputs
                    tps, gap, ttft = generate(sock, args.tokens, on_first=burst.start if kind == "burst" else None)
                    inputs, during = burst.inputs - ahead, others_cores(before)
                    burst.stop()
                else:
                    neighbor = Neighbor(embedder, args.batch)
                    time.sleep(0.5)
                    started, before = time.perf_counter(), snapshot()  # (its load is not the measurement)
                    tps, gap, ttft = generate(sock, args.tokens, on_first=neighbor.start)
                    inputs, during = neighbor.inputs, others_cores(before)
                    neighbor.stop()
                seconds = time.perf_counter() - started
                row = {
                    "round": r,
                    "tok_s": tps,
                    "max_gap_s": gap,
                    "ttft_s": ttft,
                    "inputs": inputs,
                    "seconds": seconds,
                    "others_cores_before": others,
                    "others_cores_during": during,
                }
                results[kind].append(row)
                print(
                    f"round {r} {kind:8s} {tps:6.2f} tok/s  longest step {gap * 1000:6.0f} ms  {inputs} inputs"
                    f"  (other processes: {others:.2f} cores before, {during:.2f} during)",
                    flush=True,
                )
        throughput = []
        with Client(sock) as c:
            for _ in range(args.rounds):
                wait_machine_quiet(args.quiet_wait)
                t0 = time.perf_counter()
                reply = c.embed(chunks(args.batch * 4))
                wall = time.perf_counter() - t0
                throughput.append({"inputs_s": len(reply.embeddings) / wall, "tokens_s": reply.prompt_tokens / wall})
    finally:
        daemon.terminate()
        daemon.wait(30)
        log.close()
        shutil.rmtree(sock.parent, ignore_errors=True)
    return {
        "target": target.name,
        "embedding_model": embedder.name,
        "embedding_context": emb_ctx,
        "tokens_per_chunk": tokens_per_chunk,
        "args": vars(args),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "load_average": os.getloadavg(),
        "rounds": results,
        "throughput": throughput,
    }


CLEAN = 0.2  # a round is clean where other processes used less than this many cores during each condition


def _table(rounds: dict, keep: set) -> list[str]:
    alone = {row["round"]: row["tok_s"] for row in rounds["alone"]}
    lines = [
        "| condition | decode tok/s | / alone (same round) | longest step ms | TTFT ms | inputs embedded meanwhile "
        "| other processes, cores |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind in KINDS:
        rows = [row for row in rounds[kind] if row["round"] in keep]
        if not rows:
            continue
        ratios = [row["tok_s"] / alone[row["round"]] for row in rows]
        lines.append(
            f"| {kind} | {fmt([r['tok_s'] for r in rows])} | {fmt(ratios, 3)} | "
            f"{fmt([r['max_gap_s'] * 1000 for r in rows], 0)} | {fmt([r['ttft_s'] * 1000 for r in rows], 0)} | "
            f"{fmt([r['inputs'] for r in rows], 0)} | "
            f"{fmt([r['others_cores_during'] for r in rows])} |"
        )
    return lines


def summary(data: dict) -> str:
    rounds = data["rounds"]
    every = {row["round"] for row in rounds["alone"]}
    clean = {
        r
        for r in every
        if all(row["others_cores_during"] < CLEAN for k in rounds for row in rounds[k] if row["round"] == r)
    }
    lines = [
        f"# Embeddings beside generation: {data['target']} generating, {data['embedding_model']} embedding",
        "",
        f"Every round ({len(every)}):",
        "",
        *_table(rounds, every),
        "",
        f"Clean rounds ({len(clean)}: other processes used under {CLEAN} of a core during each condition):",
        "",
        *(_table(rounds, clean) if clean else ["(none)"]),
    ]
    t = data["throughput"]
    lines += [
        "",
        f"Embedding alone ({data['args']['batch'] * 4} inputs of {data['tokens_per_chunk']} tokens a request): "
        f"{fmt([x['inputs_s'] for x in t], 1)} inputs/s, {fmt([x['tokens_s'] for x in t], 0)} tokens/s.",
        "",
        f"{data['args']['rounds']} rounds, {data['args']['tokens']} greedy tokens each, order rotated per round; "
        f"CPU: {data['cpu']}, {data['cores']} cores; load average at the end {data['load_average'][0]:.2f}.",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--embedding-model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, default=4, help="inputs per embed request of the burst")
    ap.add_argument(
        "--quiet-wait", type=float, default=120.0, help="seconds to wait for other processes to go quiet first"
    )
    ap.add_argument("--out", type=Path, help="a directory for results.json and summary.md")
    args = ap.parse_args(argv)
    data = run(args)
    text = summary(data)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(data, indent=1, default=str))
        (args.out / "summary.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
