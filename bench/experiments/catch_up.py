"""What catching a model drafter up for probes costs, on a task that starts plain.

A task predicted not to gain from drafting starts plain, and its model drafter
does not read its prompts. A probe then needs the drafter to read what it
lacks first (the prompt and what was decoded before the probe). The governor
has plain rounds pay for that in advance, at ``catch_up_share`` (1%) of their
time (see daemon/drafting/governor.py). This runs many requests of one task (every
system message begins with the same sentence, so each prompt's first 16 tokens
are the same and one governor serves them all), each bracketed as in `python -m bench --full`:
plain, then the model drafter's daemon governed and a control (a second plain
daemon started as the drafter's is), then plain again, once every system is
idle. It reports each request's governed / plain decode rate, which requests
drafted, and every catch-up the drafter's daemon logged (tokens read, seconds,
the governor's prediction), with their total against that daemon's decode time.

    python -m bench.experiments.catch_up [--target qwen2.5-coder-1.5b] [--drafter qwen2.5-coder-0.5b]
        [--prompts 24] [--tokens 192] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from bench.common import cpu_model, temp_socket, wait_quiet
from bench.governor import load_all_kinds
from bench.report import (
    CONTROL,
    bracketed,
    bracketed_daemons,
    geometric_interval,
    governed_systems,
    identical_outputs,
    resolve_model,
    tandem_request,
)

CAUGHT_UP = re.compile(r"caught up on (\d+) tokens in ([0-9.]+) s(?: \(predicted ([0-9.]+) s\))?")


# (more than 16 tokens: the governor's task key is a prompt's first 16, template header included)
SHARED = "You are a careful assistant, answering one user on their own machine. Keep to what they ask."


def one_task(count: int) -> list:
    """``count`` prompts taken in turn from each task kind, made one task: each
    system message (one is added where a prompt has none) begins with ``SHARED``."""
    kinds = list(load_all_kinds().values())
    out, i = [], 0
    while len(out) < count and any(i < len(k) for k in kinds):
        for k in kinds:
            if i < len(k) and len(out) < count:
                messages = [dict(m) for m in k[i]]
                if messages[0]["role"] == "system":
                    messages[0]["content"] = f"{SHARED} {messages[0]['content']}"
                else:
                    messages.insert(0, {"role": "system", "content": SHARED})
                out.append(messages)
        i += 1
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b", help="preset or .gguf path (default %(default)s)")
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b", help="preset or .gguf path (default %(default)s)")
    ap.add_argument("--prompts", type=int, default=24, help="requests, all one task (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=192, help="greedy tokens per request (default %(default)s)")
    ap.add_argument("--ctx-size", default="4096")
    ap.add_argument("--out", type=Path, default=None, help="write REPORT.md, results.json and the daemon's log here")
    args = ap.parse_args()
    if args.prompts < 2:
        ap.error("--prompts: at least 2 (a geometric mean ±2 SE needs two)")
    target, drafter = resolve_model(args.target), resolve_model(args.drafter)
    prompts = one_task(args.prompts)
    base = ("--model", str(target), "--ctx-size", args.ctx_size)
    procs, clients = [], {}
    log_dir = args.out or Path(temp_socket("tdm-catchup-log-").parent)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "model-daemon.log"
    try:
        with open(log_path, "w") as log:
            clients = bracketed_daemons(
                ("plain", CONTROL, "model"), base, drafter, "tdm-catchup-", procs, {"model": log}
            )
            governed = governed_systems(clients, [{"role": "user", "content": "Say hi."}])
            quiet = [p.pid for p in procs]  # (each daemon's process tree: its workers too)
            data = bracketed(
                {"one task": prompts},
                lambda m, n: tandem_request(clients["plain"], m, n),
                governed,
                len(prompts),
                args.tokens,
                lambda: wait_quiet(quiet),
            )["one task"]
            governor = clients["model"].status().governor
    finally:
        for c in clients.values():
            c.close()
        for p in procs:
            p.terminate()
            p.wait(30)
    names = list(governed)
    catch_ups = [
        {"tokens": int(m[1]), "seconds": float(m[2]), "predicted": float(m[3]) if m[3] else None}
        for m in CAUGHT_UP.finditer(log_path.read_text())
    ]
    model_decode = sum(s["seconds"] - s["ttft"] for s in (r["governed"]["model governed"] for r in data))
    lines = [
        "# Catching a model drafter up for probes",
        "",
        f"`python -m bench.experiments.catch_up --prompts {args.prompts} --tokens {args.tokens}` on {cpu_model()}: "
        f"{target.name} (target), {drafter.name} (drafter); {len(data)} requests of one task, {args.tokens} greedy "
        "tokens each; governed decode tok/s over the mean of the two plain requests around it.",
        "",
        "| request | " + " | ".join(names) + " | drafting rounds (model) |",
        "|---|" + "---|" * (len(names) + 1),
    ]
    for i, r in enumerate(data):
        cells = " | ".join(f"{r['ratio'][n]:.3f}" for n in names)
        lines.append(f"| {i} | {cells} | {r['governed']['model governed']['rounds']} |")
    means = " | ".join(geometric_interval([r["ratio"][n] for r in data]) for n in names)
    lines.append(f"| geometric mean ±2 SE | {means} | |")
    spent = sum(c["seconds"] for c in catch_ups)
    lines += [
        "",
        identical_outputs(data, names) + ".",
        "",
        f"Catch-ups of 32 tokens or more the model daemon logged: {len(catch_ups)}, "
        f"{spent:.2f} s in all, {100 * spent / max(model_decode, 1e-9):.2f}% of its {model_decode:.0f} s of decoding "
        f"(probes: {governor.probes}, failed: {governor.failed_probes}).",
        "",
        "| tokens read | seconds | predicted |",
        "|---|---|---|",
        *[
            f"| {c['tokens']} | {c['seconds']:.2f} | {c['predicted']:.2f} |"
            if c["predicted"] is not None
            else f"| {c['tokens']} | {c['seconds']:.2f} | – |"
            for c in catch_ups
        ],
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out is not None:
        (args.out / "REPORT.md").write_text(report)
        meta = {**vars(args), "out": str(args.out)}
        (args.out / "results.json").write_text(
            json.dumps({"requests": data, "catch_ups": catch_ups, "args": meta}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
