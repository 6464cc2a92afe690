"""One benchmark run, one report: tandem against plain decoding, its own drafters,
llama-cpp-python in-process and llama.cpp's llama-server, on this machine.

    python -m bench --quick            # a few minutes (SmolLM2 F16 target, Q4_1 drafter); CI runs it
    python -m bench --full             # Qwen2.5-Coder 1.5B target, 0.5B drafter, 3 runs: about 90 minutes here
    python -m bench --full --llama-server PATH   # include llama-server (bench/build_llama_server.sh builds it)
    python -m bench --peer             # tandem vs llama-server alone, SmolLM2 and Qwen2.5-Coder-1.5B (bench/peer.py)

Every system runs in one process tree at once and idles while another works; in
each run the order of systems rotates per task, so drift on a shared machine
hits all of them alike. Conclusions use ratios taken side by side; absolute
times are this machine's. The report goes to bench/results/<date>-<machine>/:
REPORT.md, results.json and PNG plots.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import http.client
import json
import math
import os
import platform
import socket as socketlib
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import psutil

from bench import peer
from bench.common import cpu_model, model_path, start_daemon, temp_socket, wait_quiet
from bench.governor import load_all_kinds
from bench.prefix_cache import Ideal, LlamaServer, agent_loop, interleaved
from bench.speculative import pass_costs_ms
from tandem.client import Client

BENCH = Path(__file__).resolve().parent

PRESETS = {
    "quick": dict(
        target="smollm2-135m-f16",
        drafter="smollm2-135m",
        prompts=1,
        tokens=24,
        runs=1,
        ks=[1, 4],
        turns=3,
        sessions=2,
        brackets=1,
        system_chars=1500,
        tool_chars=500,
        ctx=4096,
    ),
    "full": dict(
        target="qwen2.5-coder-1.5b",
        drafter="qwen2.5-coder-0.5b",
        prompts=1,
        tokens=48,
        runs=3,
        ks=[1, 2, 4, 6],
        turns=4,
        sessions=3,
        brackets=6,
        system_chars=8000,
        tool_chars=2500,
        ctx=16384,
    ),
}
LOOKUP = ("ngram", "suffix")  # drafters without a model, each in its own daemon
# A second plain daemon, started as the drafters' daemons are (no prefix cache, a fresh state directory),
# measured in the bracketed section as a governed system is: what a system that never drafts measures
# against plain there, the noise floor a governed row is read against (an A/A test).
CONTROL = "control"
CONTROL_COLUMN = "control (plain)"
# The opt-in mode that gives up exact output for speed on copy-heavy text
# (docs/speculative-decoding.md: "Copying fast, not exact"):
# llama.cpp's fast kernels, one-pass verification, the suffix drafter governed at up to 16 tokens a round.
# Its daemon runs "fast plain" (draft: off) and "fast suffix governed"; their outputs may differ from plain's.
FAST = "fast"
FAST_ARGS = ("--kernels", "fast", "--exact", "off", "--drafter", "suffix", "--draft-tokens", "16")
# The decoding table's requests to the daemons with a lookup drafter (and the fast one) go with cache: false:
# the daemon forgets the request afterwards, the suffix drafter's memory of replies included, so a drafter
# copies only from the request itself, not from its own answer to the same prompt a moment before.
FRESH = {"cache": False}
FAST_GOVERNED = "fast suffix governed"  # its name as a system, in the decoding table and the bracketed section
DEFAULT_LLAMA_SERVER = Path.home() / ".cache" / "tandem" / "llama-server" / "b11434" / "bin" / "llama-server"


def resolve_model(name: str) -> Path:
    if name == "smollm2-135m-f16":
        from tandem.daemon import models

        return models.derive_f16(model_path("smollm2-135m"))
    return model_path(name)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))] if s else float("nan")


def med(values: list[float]) -> str:
    """median (min–max), or the single value"""
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


# --------------------------------------------------------------------------- what one request gives


@dataclass
class Sample:
    tokens: int
    seconds: float
    ttft: float
    gaps: list[float] = field(default_factory=list)  # per token after the first, as the client saw them
    text: str = ""
    ids: list[int] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    cached: int = 0  # prompt tokens the daemon did not prefill (restored from pages, or kept from the request before)


def tandem_request(client: Client, messages, tokens: int, **params) -> Sample:
    started = time.perf_counter()
    last, ttft, gaps, ids = None, None, [], []
    stream = client.generate(messages=messages, max_tokens=tokens, temperature=0.0, **params)
    for chunk in stream:
        if not chunk.token_ids:
            continue
        now = time.perf_counter()
        if last is None:
            ttft = now - started
        else:
            gaps += [(now - last) / len(chunk.token_ids)] * len(chunk.token_ids)
        last = now
        ids += chunk.token_ids
    done = stream.done
    d = done.draft
    return Sample(
        tokens=done.usage.completion_tokens,
        seconds=time.perf_counter() - started,
        ttft=ttft or 0.0,
        gaps=gaps,
        text=done.text,
        ids=ids,
        drafted=d.drafted if d else 0,
        accepted=d.accepted if d else 0,
        rounds=d.rounds if d else 0,
        cached=done.usage.cached_tokens,
    )


def streamed_sample(started: float, pieces) -> Sample:
    """A Sample from text pieces as a streaming peer delivers them (no token ids: one piece, one token)."""
    last, ttft, gaps, text, n = None, None, [], "", 0
    for piece in pieces:
        if not piece:
            continue
        now = time.perf_counter()
        if last is None:
            ttft = now - started
        else:
            gaps.append(now - last)
        last, text, n = now, text + piece, n + 1
    return Sample(tokens=n, seconds=time.perf_counter() - started, ttft=ttft or 0.0, gaps=gaps, text=text)


class InProcess:
    """llama-cpp-python in this process: what a user would otherwise write."""

    def __init__(self, path: Path, n_ctx: int):
        from tandem.daemon.worker.llama_load import reference_llama

        # the worker's threads, with --kernels reference's settings (reference kernels, no extra buffers)
        self.llm = reference_llama(path, n_ctx)

    def request(self, messages, tokens: int) -> Sample:
        started = time.perf_counter()
        parts = self.llm.create_chat_completion(messages=messages, max_tokens=tokens, temperature=0.0, stream=True)
        return streamed_sample(started, (part["choices"][0]["delta"].get("content") for part in parts))


class ServerChat:
    """llama-server's OpenAI chat endpoint, streamed."""

    def __init__(self, server: LlamaServer):
        self.server = server

    def request(self, messages, tokens: int) -> Sample:
        body = json.dumps({"messages": messages, "max_tokens": tokens, "temperature": 0.0, "stream": True})
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=600)
        started = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()

        def pieces():
            for raw in resp:
                line = raw.decode().strip()
                if line.startswith("data:") and line != "data: [DONE]":
                    yield (json.loads(line[5:]).get("choices") or [{}])[0].get("delta", {}).get("content")

        sample = streamed_sample(started, pieces())
        conn.close()
        return sample


# --------------------------------------------------------------------------- the machine


def machine() -> dict:
    import llama_cpp

    from tandem.daemon.version import __version__

    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "llama_system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "tandem": __version__,
        "llama_cpp_python": llama_cpp.__version__,
    }


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


class RssSampler:
    """Peak resident memory of given processes (by label), sampled every 0.25 s;
    and their PSS where ``sample_pss()`` is called (at the end of each section:
    reading smaps costs tens of ms for a large process, too much to do four times
    a second beside the requests being timed)."""

    def __init__(self):
        self.pids: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.peak_pss: dict[str, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.25):
            for label, pid in list(self.pids.items()):
                try:
                    rss = psutil.Process(pid).memory_info().rss
                except psutil.Error:
                    continue
                self.peak[label] = max(self.peak.get(label, 0), rss)

    def sample_pss(self) -> None:
        """PSS counts a page mapped by n processes (the prefix cache's arena) or
        twice by one (the model file under a prompt reader) as 1/n in each."""
        for label, pid in list(self.pids.items()):
            try:
                pss = getattr(psutil.Process(pid).memory_full_info(), "pss", None)
            except (psutil.Error, OSError):
                continue
            if pss is not None:
                self.peak_pss[label] = max(self.peak_pss.get(label, 0), pss)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


# --------------------------------------------------------------------------- the run


def run(preset: str, out_dir: Path, llama_server: Optional[Path], runs: Optional[int]) -> Path:
    p = dict(PRESETS[preset])
    if runs:
        p["runs"] = runs
    target, drafter = resolve_model(p["target"]), resolve_model(p["drafter"])
    corpus = {kind: prompts[: p["prompts"]] for kind, prompts in load_all_kinds().items()}
    ks = p["ks"]
    results: dict = {
        "preset": preset,
        "params": p,
        "machine": machine(),
        "started": datetime.datetime.now().isoformat(),
        "fresh_lookup": True,  # the decoding table's lookup and fast requests went with cache: false
    }
    results["models"] = {
        "target": {"name": p["target"], "file": target.name, "bytes": target.stat().st_size, "sha256": sha256(target)},
        "drafter": {
            "name": p["drafter"],
            "file": drafter.name,
            "bytes": drafter.stat().st_size,
            "sha256": sha256(drafter),
        },
    }
    say(
        f"bench {preset}: target {target.name}, drafter {drafter.name}, {p['runs']} run(s), "
        f"{sum(map(len, corpus.values()))} prompts in {len(corpus)} tasks"
    )

    # one pass over 1 and k+1 tokens; one drafter step (the lab's cost model)
    widths = sorted({1, *[k + 1 for k in ks]})
    target_ms = pass_costs_ms(target, widths)
    draft_ms = pass_costs_ms(drafter, [1], role="drafter")[1]
    results["pass_ms"] = {"target": target_ms, "drafter_step": draft_ms}
    say(
        "pass costs: "
        + ", ".join(f"{w} tok {ms:.1f} ms" for w, ms in target_ms.items())
        + f"; drafter step {draft_ms:.1f} ms"
    )

    rss = RssSampler()
    procs, servers, commands = [], [], {}
    ctx = str(p["ctx"])
    try:
        base = ("--model", str(target), "--ctx-size", ctx)
        # plain; the bracketed section's control (a plain daemon started as the drafters' are); the drafters'
        clients = bracketed_daemons(("plain", CONTROL, "model", *LOOKUP), base, drafter, "tdm-b", procs)
        clients[FAST] = fast_daemon(base, procs)
        for name, c in clients.items():
            st = c.status()
            rss.pids[f"{name} daemon"] = st.pid
            for role, pid in st.worker_pids.items():
                rss.pids[f"{name} {role}"] = pid
            commands[f"tandem ({name})"] = " ".join(
                [
                    "tandem serve",
                    *base,
                    *(["--drafter", str(drafter)] if name == "model" else []),
                    *(["--drafter", name] if name in LOOKUP else []),
                    *(FAST_ARGS if name == FAST else []),
                    *(["--cache-bytes", "0", "--state-dir", "<a new directory>"] if name != "plain" else []),
                ]
            )
        systems: dict[str, callable] = {"plain": lambda m, n: tandem_request(clients["plain"], m, n)}
        for k in ks:
            systems[f"model k={k}"] = lambda m, n, k=k: tandem_request(
                clients["model"], m, n, draft="on", draft_tokens=k
            )
        systems["model governed"] = lambda m, n: tandem_request(clients["model"], m, n, draft="auto")
        for name in LOOKUP:
            systems[f"{name} k=4"] = lambda m, n, c=clients[name]: tandem_request(
                c, m, n, draft="on", draft_tokens=4, **FRESH
            )
            systems[f"{name} governed"] = lambda m, n, c=clients[name]: tandem_request(c, m, n, draft="auto", **FRESH)
        systems["fast plain"] = lambda m, n: tandem_request(clients[FAST], m, n, draft="off", **FRESH)
        systems[FAST_GOVERNED] = lambda m, n: tandem_request(clients[FAST], m, n, draft="auto", **FRESH)
        inproc = InProcess(target, int(ctx))
        systems["llama-cpp-python"] = inproc.request
        commands["llama-cpp-python"] = (
            f"llama_cpp.Llama({target.name!r}, n_ctx={ctx}, n_threads=<all cores>, use_extra_bufts=False, "
            "reference kernels).create_chat_completion(stream=True)"
        )
        if llama_server is not None:
            threads = os.cpu_count() or 2
            plain_server = LlamaServer(llama_server, target, int(ctx), threads, flash_attn=False)
            servers.append(plain_server)
            commands["llama-server"] = " ".join(plain_server.command)
            systems["llama-server"] = ServerChat(plain_server).request
            spec = LlamaServer(
                llama_server,
                target,
                int(ctx),
                threads,
                flash_attn=False,
                extra=(
                    "-md",
                    str(drafter),
                    "--spec-type",
                    "draft-simple",
                    "--spec-draft-n-max",
                    str(max(ks)),
                    "--spec-draft-n-min",
                    "1",
                ),
            )
            servers.append(spec)
            commands["llama-server (speculative)"] = " ".join(spec.command)
            systems["llama-server spec"] = ServerChat(spec).request
            rss.pids["llama-server"] = plain_server.proc.pid

        # every request starts once every system is idle: the plain daemon settles a turn after its reply
        # (reads it again into cache pages), which must not run beside the next system's request
        quiet = [proc.pid for proc in procs] + [s.proc.pid for s in servers]

        # governed against plain first, while the governors know nothing: bracketed, many prompts per task
        hello = [{"role": "user", "content": "Say hi."}]
        governed = governed_systems(clients, hello)
        results["bracketed"] = bracketed(
            load_all_kinds(), systems["plain"], governed, p["brackets"], p["tokens"], lambda: wait_quiet(quiet)
        )
        rss.sample_pss()

        for fn in systems.values():  # warm up every system once
            fn(hello, 4)

        decoding: dict = {kind: {name: [] for name in systems} for kind in corpus}

        def measured(name, messages):
            wait_quiet(quiet)
            return systems[name](messages, p["tokens"])

        for r in range(p["runs"]):
            for t, (kind, prompts) in enumerate(corpus.items()):
                names = list(systems)
                shift = (r + t) % len(names)
                for name in names[shift:] + names[:shift]:
                    samples = [measured(name, messages) for messages in prompts]
                    decoding[kind][name].append([s.__dict__ for s in samples])
            say(f"decoding run {r + 1}/{p['runs']} done")
        results["decoding"] = decoding
        rss.sample_pss()

        # prefix cache: an agent re-sending a growing prompt, and interleaved sessions
        args = argparse.Namespace(
            turns=p["turns"], sessions=p["sessions"], system_chars=p["system_chars"], tool_chars=p["tool_chars"]
        )
        ideal = Ideal(target, int(ctx), flash_attn=False)

        def settled():  # as an agent running a tool between turns: what tandem does after a reply finishes
            wait_quiet(quiet)

        agent_rows, inter_rows = [], []
        for r in range(p["runs"]):
            agent_loop(r, args, clients["plain"], ideal, servers[0] if servers else None, agent_rows, settled)
            interleaved(r, args, clients["plain"], servers[0] if servers else None, inter_rows, settled)
        results["prefix_cache"] = {"agent": agent_rows, "interleaved": inter_rows}
        rss.sample_pss()
        st = clients["plain"].status()
        results["cache"] = (
            {"bytes_used": st.cache.bytes_used, "pages": st.cache.pages, "budget": st.cache.bytes_budget}
            if st.cache
            else None
        )
        for c in clients.values():
            c.close()
    finally:
        rss.close()
        for s in servers:
            s.stop()
        for proc in procs:
            proc.terminate()
            proc.wait(30)
    results["peak_rss"] = rss.peak
    results["peak_pss"] = rss.peak_pss
    results["commands"] = commands
    results["finished"] = datetime.datetime.now().isoformat()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    write_report(results, out_dir)
    return out_dir / "REPORT.md"


def governed_systems(clients: dict, hello: list) -> dict:
    """Each drafter's daemon in ``clients`` as a governed system ("model governed",
    ...), and the control daemon, where ``clients`` has one, as "control (plain)";
    every daemon in ``clients`` warmed up first with ``draft: off`` (teaching no governor)."""
    for c in clients.values():
        tandem_request(c, hello, 4, draft="off")
    out = {
        f"{name} governed": (lambda m, n, c=clients[name]: tandem_request(c, m, n, draft="auto"))
        for name in ("model", *LOOKUP)
        if name in clients
    }
    if CONTROL in clients:
        out[CONTROL_COLUMN] = lambda m, n, c=clients[CONTROL]: tandem_request(c, m, n, draft="auto")
    if FAST in clients:  # not exact: its outputs are counted apart (identical_outputs)
        out[FAST_GOVERNED] = lambda m, n, c=clients[FAST]: tandem_request(c, m, n, draft="auto")
    return out


def bracketed_daemons(names, base: tuple, drafter: Path, prefix: str, procs: list, logs: Optional[dict] = None) -> dict:
    """Start the daemons a bracketed comparison needs, each on its own socket: "plain";
    the control and each drafter's ("model" or a lookup drafter) with the drafters'
    settings (no prefix cache, a fresh state directory: their governors learn from
    nothing, so each task's first request is a cold governor's). Each process is
    added to ``procs`` as it starts, so a caller's cleanup stops those started
    before one that failed. ``logs``: name -> an open file for that daemon's log.
    Returns their clients."""
    clients = {}
    for name in names:
        sock = temp_socket(f"{prefix}{name}-")
        extra = [] if name in ("plain", CONTROL) else ["--drafter", str(drafter) if name == "model" else name]
        fresh = [] if name == "plain" else ["--cache-bytes", "0", "--state-dir", str(sock.parent / "state")]
        procs.append(start_daemon(sock, *base, *extra, *fresh, stderr=(logs or {}).get(name)))
        clients[name] = Client(sock)
    return clients


def fast_daemon(base: tuple, procs: list) -> Client:
    """The daemon of the opt-in fast, not exact mode (FAST_ARGS), started as the
    drafters' daemons are (no prefix cache, a fresh state directory); added to
    ``procs`` as it starts. Returns its client."""
    sock = temp_socket("tdm-bfast-")
    fresh = ("--cache-bytes", "0", "--state-dir", str(sock.parent / "state"))
    procs.append(start_daemon(sock, *base, *FAST_ARGS, *fresh))
    return Client(sock)


def bracketed(kinds: dict, plain, governed: dict, reps: int, tokens: int, quiet) -> dict:
    """Governed / plain, each governed request measured between two plain ones.

    Per task kind, ``reps`` brackets, each on the next prompt of the kind (at most as
    many brackets as the kind has prompts, so no daemon sees a prompt twice: the
    suffix drafter would copy its own earlier answer). A bracket is plain, the
    governed systems (in reverse order every other bracket), plain again, all on
    the bracket's prompt. Each governed request's ratio is its decode rate over
    the mean of the two plain requests around it, which takes out this shared
    machine's drift (its speed moves by 10-25% from one minute to the next). The
    first bracket of each kind is a cold governor's if the daemons started with
    no learnt state."""
    out: dict = {}
    names = list(governed)
    for kind, prompts in kinds.items():
        rows = []
        for i, messages in enumerate(prompts[: max(1, reps)]):
            quiet()
            before = plain(messages, tokens)
            samples = {}
            for name in names if i % 2 == 0 else names[::-1]:
                quiet()
                samples[name] = governed[name](messages, tokens)
            quiet()
            after = plain(messages, tokens)
            ref = (decode_rate([before.__dict__]) + decode_rate([after.__dict__])) / 2
            rows.append(
                {
                    "prompt": i,
                    "plain": [before.__dict__, after.__dict__],
                    "governed": {name: s.__dict__ for name, s in samples.items()},
                    "ratio": {name: decode_rate([s.__dict__]) / ref for name, s in samples.items()},
                }
            )
        out[kind] = rows
        say(f"governed vs plain, bracketed: {kind} done ({len(rows)} prompts)")
    return out


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the report


def decode_rate(run: list[dict]) -> float:
    """Tokens per second after the first token, over a run's requests: the prefill
    is left out (systems that share a daemon find a re-sent prompt already read,
    which would favour whichever comes second; TTFT is reported on its own)."""
    return sum(s["tokens"] - 1 for s in run) / max(1e-9, sum(s["seconds"] - s["ttft"] for s in run))


def summarize(results: dict) -> dict:
    """Per task and system: tok/s per run, speedup vs plain per run, alpha, tokens per round, identical outputs."""
    out: dict = {}
    t_ms = {int(k): v for k, v in results["pass_ms"]["target"].items()}
    d_ms = results["pass_ms"]["drafter_step"]
    for kind, systems in results["decoding"].items():
        plain_runs = systems["plain"]
        plain_rate = [decode_rate(run) for run in plain_runs]
        row = {}
        for name, runs in systems.items():
            rates = [decode_rate(run) for run in runs]
            drafted = sum(s["drafted"] for run in runs for s in run)
            accepted = sum(s["accepted"] for run in runs for s in run)
            rounds = sum(s["rounds"] for run in runs for s in run)
            same = sum(
                (s["ids"] == b["ids"]) if s["ids"] else (s["text"] == b["text"])
                for run, prun in zip(runs, plain_runs)
                for s, b in zip(run, prun)
            )
            per_round = (accepted + rounds) / rounds if rounds else None
            k = int(name.split("k=")[1]) if "k=" in name else None
            model = None
            if per_round and k and name.startswith("model"):
                model = {
                    "lab": per_round / (1 + k * d_ms / t_ms[1]),
                    "passes": per_round * t_ms[1] / (t_ms[k + 1] + k * d_ms),
                }
            row[name] = {
                "tok_s": rates,
                "speedup": [a / b for a, b in zip(rates, plain_rate)],
                "alpha": accepted / drafted if drafted else None,
                "tokens_per_round": per_round,
                "identical": same,
                "outputs": sum(len(run) for run in runs),
                "predicted": model,
                "k": k,
            }
        out[kind] = row
    return out


def geometric_interval(ratios: list[float]) -> str:
    """The geometric mean of ratios and ±2 standard errors of its logarithm: whether
    the samples resolve a difference of a few percent."""
    if len(ratios) < 2:
        return "–"
    logs = [math.log(r) for r in ratios]
    mean, se = statistics.fmean(logs), statistics.stdev(logs) / math.sqrt(len(logs))
    return f"{math.exp(mean):.3f} ({math.exp(mean - 2 * se):.3f}–{math.exp(mean + 2 * se):.3f})"


def bracketed_section(data: dict, p: dict) -> list[str]:
    names = list(next(iter(data.values()))[0]["governed"])
    lines = [
        "",
        "## Governed against plain, bracketed",
        "",
        f"Before the table above, on daemons whose governors had learnt nothing: per task, up to {p['brackets']} "
        f"prompts (each once), {p['tokens']} greedy tokens; for each prompt plain, then every governed system, then "
        "plain again. A governed request's ratio is its decode tok/s over the mean of the two plain requests around "
        "it. Median (min–max) over the task's prompts; cold: the task's first prompt, the first time that daemon's "
        "governor saw the task (the governor keys a task by the prompt's first 16 tokens: story and code, with no "
        "system prompt, begin with the chat template's default one and share a state, so code's first prompt is "
        "not cold); drafting: the governed requests' drafting rounds, of all their rounds."
        + (
            f" {CONTROL_COLUMN}: a second plain daemon, started with the drafters' daemons' settings (no prefix "
            "cache, a fresh state directory; no drafter, so no drafter process) and measured as they are: what a "
            "system that never drafts measures here, against which a governed cell is read (an A/A test; where it "
            "is not 1.00, neither is a governed cell that did not draft)."
            if CONTROL_COLUMN in names
            else ""
        )
        + (
            f" {FAST_GOVERNED}: the opt-in mode that is not exact (`{' '.join(FAST_ARGS)}`), on a daemon of its "
            "own started as the drafters' are; its ratio is against exact plain, so it holds what the fast kernels "
            "change as well as what drafting gains; its outputs are counted apart."
            if FAST_GOVERNED in names
            else ""
        ),
        "",
        "| task | prompts | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    every = {name: [] for name in names}
    for kind, rows in data.items():
        cells = []
        for name in names:
            ratios = [row["ratio"][name] for row in rows]
            every[name] += ratios
            drafting = sum(row["governed"][name]["rounds"] for row in rows)
            steps = sum(row["governed"][name]["tokens"] - 1 - row["governed"][name]["accepted"] for row in rows)
            cells.append(f"{med(ratios)}; cold {ratios[0]:.2f}; drafting {drafting}/{steps}")
        lines.append(f"| {kind} | {len(rows)} | " + " | ".join(cells) + " |")
    count = sum(map(len, data.values()))
    lines.append(f"| every task | {count} | " + " | ".join(med(every[n]) for n in names) + " |")
    gm = " | ".join(geometric_interval(every[n]) for n in names)
    lines.append("| every task, geometric mean ±2 SE | | " + gm + " |")
    same = identical_outputs([row for rows in data.values() for row in rows], names)
    lines += ["", f"{same[0].upper()}{same[1:]}."]
    return lines


def identical_outputs(rows: list[dict], names: list[str]) -> str:
    """How many of the bracketed rows' governed outputs, and apart from them the
    control's, equal the first plain request's."""

    def count(systems: list[str]) -> str:
        same = sum(row["governed"][n]["text"] == row["plain"][0]["text"] for row in rows for n in systems)
        return f"{same}/{len(rows) * len(systems)}"

    exact = [n for n in names if n not in (CONTROL_COLUMN, FAST_GOVERNED)]
    out = f"governed outputs identical to plain's: {count(exact)}"
    out += f"; the control's: {count([CONTROL_COLUMN])}" if CONTROL_COLUMN in names else ""
    return out + (f"; the fast mode's (not exact): {count([FAST_GOVERNED])}" if FAST_GOVERNED in names else "")


def write_report(results: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m, p = results["machine"], results["params"]
    summary = summarize(results)
    systems = list(next(iter(results["decoding"].values())))
    lines = [
        f"# tandem benchmark report: {results['preset']} preset",
        "",
        f"Run {results['started'][:16]} → {results['finished'][:16]} with `python -m bench --{results['preset']}`. "
        f"Absolute times are this machine's; conclusions use ratios taken side by side in the same run "
        f"(median and min–max over {p['runs']} run(s); systems alternate per task and run).",
        "",
        "## Machine and versions",
        "",
        f"- CPU: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB",
        f"- llama.cpp system info: `{m['llama_system_info']}`",
        f"- tandem {m['tandem']}, llama-cpp-python {m['llama_cpp_python']}, Python {m['python']}, {m['platform']}",
    ]
    for role, model in results["models"].items():
        lines.append(
            f"- {role}: `{model['name']}` ({model['file']}, {model['bytes']:,} bytes, sha256 `{model['sha256']}`)"
        )
    lines += ["", "Systems and their exact commands:", ""]
    lines += [f"- **{name}**: `{cmd}`" for name, cmd in results["commands"].items()]
    tm = results["pass_ms"]
    lines += [
        "",
        "## Decoding",
        "",
        f"Greedy, {p['tokens']} tokens per prompt, {p['prompts']} prompt(s) per task, streamed. One target pass: "
        + ", ".join(f"{w} token(s) {ms:.1f} ms" for w, ms in tm["target"].items())
        + f"; one drafter step {tm['drafter_step']:.1f} ms "
        + f"(c = {tm['drafter_step'] / tm['target'][min(tm['target'], key=int)]:.3f}).",
        "tok/s is decoding after the first token (the prefill is left out: TTFT is below). "
        "Speedup is tok/s over `plain` (tandem without a drafter) in the same run. Predicted: the lab's cost model "
        "(tokens per round / (1 + k·c)) and the same with the measured pass over k+1 tokens.",
        "Each cell is one request per prompt and run, taken up to minutes apart from plain's: this resolves what "
        "forced drafting costs or gains, not a governed row's 2% (the machine's speed drifts by more between "
        "requests); the governed rows are measured in the bracketed section below.",
    ]
    if results.get("fresh_lookup"):
        lines += [
            "",
            "The requests to the daemons with a lookup drafter (ngram, suffix, fast) go with `cache: false`: after "
            "each one the daemon forgets what its model read and what its drafter remembers (the suffix drafter's "
            "memory of earlier replies), so a drafter copies only from the request's own prompt and output, not "
            "from its answer to the same prompt in the system or the run before. Their governors still learn from "
            "these requests; with nothing left in the KV cache they do not re-measure pass costs in idle time "
            "between them (they keep the costs of the bracketed section's requests or of the load).",
        ]
    if any(name.startswith("fast ") for name in systems):
        lines += [
            "",
            "**Not exact:** `fast plain` and `fast suffix governed` are the opt-in mode that gives up exact output "
            f"for speed (`{' '.join(FAST_ARGS)}`, docs/speculative-decoding.md: Copying fast, not exact); "
            "`fast plain` is its daemon "
            "with `draft: off`. Their text may differ from plain's (the identical column counts it).",
        ]
    lines += [
        "",
        "| task | system | tok/s | speedup | α | tokens/round | identical to plain | predicted (lab / passes) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, rows in summary.items():
        for name in systems:
            r = rows[name]
            pred = f"{r['predicted']['lab']:.2f} / {r['predicted']['passes']:.2f}" if r["predicted"] else "–"
            alpha = f"{r['alpha']:.2f}" if r["alpha"] is not None else "–"
            tpr = f"{r['tokens_per_round']:.2f}" if r["tokens_per_round"] else "–"
            lines.append(
                f"| {kind} | {name} | {med(r['tok_s'])} | {med(r['speedup'])} | {alpha} | {tpr} | "
                f"{r['identical']}/{r['outputs']} | {pred} |"
            )
    if results.get("bracketed"):
        lines += bracketed_section(results["bracketed"], p)
    # latency
    lines += [
        "",
        "## Latency as a streaming client sees it",
        "",
        "| system | TTFT P50 s | per-token P50 ms | P90 ms | P99 ms |",
        "|---|---|---|---|---|",
    ]
    gaps_by_system = {}
    for name in systems:
        ttfts = [s["ttft"] for kind in results["decoding"].values() for run in kind[name] for s in run]
        gaps = [g * 1000 for kind in results["decoding"].values() for run in kind[name] for s in run for g in s["gaps"]]
        gaps_by_system[name] = gaps
        if gaps:
            lines.append(
                f"| {name} | {statistics.median(ttfts):.3f} | {statistics.median(gaps):.1f} "
                f"| {pct(gaps, 0.9):.1f} | {pct(gaps, 0.99):.1f} |"
            )
    lines += [
        "",
        "Per-token latency of a drafting system is bursty: a round's accepted tokens arrive together. "
        "TTFT: the systems that share a daemon (model k=1 … governed"
        + ("" if results.get("fresh_lookup") else ", ngram k=4 and governed, suffix k=4 and governed")
        + ") run one after another on the same prompt, so all but the first of them get a re-sent "
        "prompt, whose KV and logits the model still holds (a few ms)"
        + (
            "; the lookup and fast daemons' requests forget theirs (cache: false)"
            if results.get("fresh_lookup")
            else ""
        )
        + "; llama-server keeps its prompt cache too. "
        "New and cached prompts' TTFT are measured by `python -m bench --peer` and in the prefix cache section.",
        "",
    ]
    # prefix cache
    agent = results["prefix_cache"]["agent"]
    cols = [c for c in ("tandem", "no_cache", "ideal", "llama_server") if agent and c in agent[0]]
    lines += [
        "## Prefix cache",
        "",
        f"Agent loop: a {p['system_chars']:,}-character system prompt, then {p['turns']} turns each "
        f"adding a {p['tool_chars']:,}-character tool output; TTFT per turn (s), median (min–max) over runs. "
        "Each request starts once every system is idle, as after an agent's tool call: tandem has settled the "
        "turn before (read its tail into cache pages) by then.",
        "",
        "| turn | prompt tokens | " + " | ".join(cols) + " | no cache / tandem | tandem / ideal |",
        "|---|---|" + "---|" * (len(cols) + 2),
    ]
    turns = sorted({row["turn"] for row in agent})
    per_turn = {}
    for turn in turns:
        rows = [row for row in agent if row["turn"] == turn]
        per_turn[turn] = {c: [row[c] for row in rows] for c in cols}
        ratio_nc = [row["no_cache"] / row["tandem"] for row in rows]
        ratio_id = [row["tandem"] / row["ideal"] for row in rows]
        lines.append(
            f"| {turn} | {rows[0]['prompt_tokens']:,} | "
            + " | ".join(med(per_turn[turn][c]) for c in cols)
            + f" | {med(ratio_nc)} | {med(ratio_id)} |"
        )
    inter = results["prefix_cache"]["interleaved"]
    if inter:
        icols = [c for c in ("tandem", "llama_server") if c in inter[0]]
        lines += [
            "",
            f"Interleaved: {p['sessions']} sessions taking turns; TTFT (s) per turn over sessions and runs.",
            "",
            "| turn | " + " | ".join(icols) + " |",
            "|---|" + "---|" * len(icols),
        ]
        for turn in sorted({row["turn"] for row in inter}):
            rows = [row for row in inter if row["turn"] == turn]
            lines.append(f"| {turn} | " + " | ".join(med([row[c] for row in rows]) for c in icols) + " |")
    # memory
    lines += [
        "",
        "## Memory",
        "",
        "Resident memory during the run: peak RSS, sampled every 0.25 s, and the largest PSS read at the end of "
        "each section. RSS counts every page a process maps: the prefix cache's arena in each process that maps "
        "it, and a model file twice in a target with a prompt reader; PSS counts a page mapped n times as 1/n in "
        "each mapping. Here every daemon's target, llama-server and the benchmark's own in-process "
        "llama-cpp-python map the same model file, so a target's PSS is lower than it would be alone.",
        "",
        "| process | peak RSS MiB | PSS MiB |",
        "|---|---|---|",
    ]
    pss = results.get("peak_pss", {})  # (not in reports from before 2026-12-04)
    lines += [
        f"| {label} | {rss / 2**20:,.0f} | " + (f"{pss[label] / 2**20:,.0f} |" if label in pss else "– |")
        for label, rss in sorted(results["peak_rss"].items())
    ]
    if results.get("cache"):
        c = results["cache"]
        lines += [
            "",
            f"Prefix cache at the end: {c['pages']:,} pages, {c['bytes_used'] / 2**20:,.0f} MiB of a "
            f"{c['budget'] / 2**20:,.0f} MiB budget.",
        ]

    # plots
    kinds = list(summary)
    fig, axes = plt.subplots(1, len(kinds), figsize=(3.2 * len(kinds), 3.2), sharey=True)
    for ax, kind in zip(axes if len(kinds) > 1 else [axes], kinds):
        rows = [(r["k"], r) for name, r in summary[kind].items() if name.startswith("model k=")]
        ks = [k for k, _ in rows]
        meds = [statistics.median(r["speedup"]) for _, r in rows]
        lo = [statistics.median(r["speedup"]) - min(r["speedup"]) for _, r in rows]
        hi = [max(r["speedup"]) - statistics.median(r["speedup"]) for _, r in rows]
        ax.errorbar(ks, meds, yerr=[lo, hi], marker="o", label="measured")
        ax.plot(
            ks,
            [r["predicted"]["passes"] if r["predicted"] else float("nan") for _, r in rows],
            "--",
            label="cost model (passes)",
        )
        ax.plot(
            ks,
            [r["predicted"]["lab"] if r["predicted"] else float("nan") for _, r in rows],
            ":",
            label="cost model (lab)",
        )
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_title(kind)
        ax.set_xlabel("k")
    (axes[0] if len(kinds) > 1 else axes).set_ylabel("speedup over plain")
    (axes[0] if len(kinds) > 1 else axes).legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "speedup_vs_k.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for c in cols:
        ax.plot(turns, [statistics.median(per_turn[t][c]) for t in turns], marker="o", label=c.replace("_", " "))
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT, s (this machine)")
    ax.set_title("Agent loop: time to first token per turn")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "ttft_per_turn.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, gaps in gaps_by_system.items():
        if gaps and (
            name in ("plain", "model governed", "llama-cpp-python", "llama-server") or name == f"model k={max(p['ks'])}"
        ):
            s = sorted(gaps)
            ax.plot(s, [i / len(s) for i in range(1, len(s) + 1)], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("per-token latency, ms (this machine)")
    ax.set_ylabel("fraction of tokens")
    ax.set_title("Per-token latency, streamed")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "token_latency.png", dpi=110)
    plt.close(fig)
    lines += [
        "",
        "## Plots",
        "",
        "![speedup vs k](speedup_vs_k.png)",
        "",
        "![TTFT per turn](ttft_per_turn.png)",
        "",
        "![per-token latency](token_latency.png)",
        "",
    ]
    (out_dir / "REPORT.md").write_text("\n".join(lines) + "\n")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="a few minutes, small models (the CI smoke run)")
    g.add_argument("--full", action="store_true", help="the real pair, 3 runs (the committed report)")
    g.add_argument(
        "--peer",
        action="store_true",
        help="tandem vs llama-server only: decode, TTFT (new, repeated, extended prompt), prefill (bench/peer.py)",
    )
    ap.add_argument("--runs", type=int, default=None, help="override the preset's number of runs")
    ap.add_argument(
        "--llama-server",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"include llama-server (default with --full: {DEFAULT_LLAMA_SERVER} if it exists)",
    )
    ap.add_argument("--no-peers", action="store_true", help="leave llama-server out even if it is there")
    ap.add_argument("--out", type=Path, default=None, help="report directory (default bench/results/<date>-<machine>)")
    ap.add_argument(
        "--rewrite",
        type=Path,
        default=None,
        metavar="DIR",
        help="measure nothing: write DIR/REPORT.md and its plots again from DIR/results.json (after the report's "
        "text or tables change)",
    )
    peer.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.rewrite is not None:
        data = args.rewrite / "results.json"
        if not data.is_file():
            raise SystemExit(f"no {data}: --rewrite takes a report directory that `python -m bench` wrote")
        write_report(json.loads(data.read_text()), args.rewrite)
        print(args.rewrite / "REPORT.md")
        return 0
    if args.peer:
        server = args.llama_server or DEFAULT_LLAMA_SERVER
        if not server.exists():
            raise SystemExit(f"no llama-server at {server}; build it with bench/build_llama_server.sh")
        args.runs = args.runs or 3
        print(peer.run(args, server, args.out))
        return 0
    preset = "full" if args.full else "quick"
    server = args.llama_server
    if server is None and preset == "full" and DEFAULT_LLAMA_SERVER.exists():
        server = DEFAULT_LLAMA_SERVER
    if args.no_peers:
        server = None
    if server is not None and not server.exists():
        raise SystemExit(
            f"no llama-server at {server}; build it with bench/build_llama_server.sh or leave --llama-server out"
        )
    out = args.out or BENCH / "results" / f"{datetime.date.today().isoformat()}-{socketlib.gethostname()}-{preset}"
    report = run(preset, out, server, args.runs)
    print(report)
    return 0
