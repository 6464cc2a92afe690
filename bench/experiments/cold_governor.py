"""A cold governor against plain decoding: every request a task its governor has never seen.

The governor keys a task by the prompt's first 16 tokens, so a prompt whose
system message starts with a new session number is a new task: its governor
starts from nothing (what it knows is the acceptance pooled over the tasks the
daemon saw before, and the machine's pass costs). Each such request runs
bracketed, as in `python -m bench --full`: plain, then the model, n-gram and
suffix drafters' daemons governed and a control (a second plain daemon started
as theirs are; in reverse order every other prompt), then plain again, each
once every system is idle; its ratio is its decode tok/s over the mean of the
two plain requests around it. The governed daemons start with an empty state
directory, so the first prompt is the daemon's first task too. The control
never drafts: its column is what this design measures for no cost at all.

One request is too noisy to resolve 2% on a shared machine (two requests
seconds apart differ by more): the figure is the geometric mean over all
prompts with ±2 standard errors.

    python -m bench.experiments.cold_governor [--target qwen2.5-coder-1.5b] [--drafter qwen2.5-coder-0.5b]
        [--prompts 20] [--tokens 48] [--out results/cold.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench.common import wait_quiet
from bench.governor import load_all_kinds
from bench.report import (
    CONTROL,
    LOOKUP,
    bracketed,
    bracketed_daemons,
    geometric_interval,
    governed_systems,
    identical_outputs,
    resolve_model,
    tandem_request,
)


def new_tasks(count: int) -> dict[str, list]:
    """``count`` prompts taken in turn from each task kind, each made a task of its
    own: a system message that begins with a session number no other prompt has."""
    kinds = load_all_kinds()
    out: dict[str, list] = {kind: [] for kind in kinds}
    taken = 0
    while taken < count:
        added = False
        for kind, prompts in kinds.items():
            i = len(out[kind])
            if taken >= count or i >= len(prompts):
                continue
            messages = [dict(m) for m in prompts[i]]
            tag = f"Session {taken + 1}."
            if messages[0]["role"] == "system":
                messages[0]["content"] = f"{tag} {messages[0]['content']}"
            else:
                messages.insert(0, {"role": "system", "content": f"{tag} You are a helpful assistant."})
            out[kind].append(messages)
            taken, added = taken + 1, True
        if not added:
            break
    return {kind: prompts for kind, prompts in out.items() if prompts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b", help="preset or .gguf path (default %(default)s)")
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b", help="preset or .gguf path (default %(default)s)")
    ap.add_argument("--prompts", type=int, default=20, help="new tasks, one request each (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=48, help="greedy tokens per request (default %(default)s)")
    ap.add_argument("--ctx-size", default="16384")
    ap.add_argument("--out", type=Path, default=None, help="also write every request's numbers here (JSON)")
    args = ap.parse_args()
    if args.prompts < 2:
        ap.error("--prompts: at least 2 (a geometric mean ±2 SE needs two)")
    target, drafter = resolve_model(args.target), resolve_model(args.drafter)
    kinds = new_tasks(args.prompts)
    base = ("--model", str(target), "--ctx-size", args.ctx_size)
    procs, clients = [], {}
    try:
        clients = bracketed_daemons(("plain", CONTROL, "model", *LOOKUP), base, drafter, "tdm-cold-", procs)
        quiet = [p.pid for p in procs]
        governed = governed_systems(clients, [{"role": "user", "content": "Say hi."}])
        reps = max(map(len, kinds.values()))
        data = bracketed(
            kinds,
            lambda m, n: tandem_request(clients["plain"], m, n),
            governed,
            reps,
            args.tokens,
            lambda: wait_quiet(quiet),
        )
    finally:
        for c in clients.values():
            c.close()
        for p in procs:
            p.terminate()
            p.wait(30)
    names = list(governed)
    rows = [row for kind_rows in data.values() for row in kind_rows]
    print(
        f"{target.name} (target), {drafter.name} (drafter); {len(rows)} requests, each a new task; "
        f"{args.tokens} greedy tokens; governed decode tok/s over the mean of the two plain requests around it\n"
    )
    print("| task | prompts | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for kind, kind_rows in data.items():
        cells = []
        for n in names:
            ratios = [r["ratio"][n] for r in kind_rows]
            drafting = sum(r["governed"][n]["rounds"] for r in kind_rows)
            cells.append(
                f"{statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f}); drafting rounds {drafting}"
            )
        print(f"| {kind} | {len(kind_rows)} | " + " | ".join(cells) + " |")
    first = next(iter(data.values()))[0]
    print("| the daemon's first task | 1 | " + " | ".join(f"{first['ratio'][n]:.2f}" for n in names) + " |")
    print(
        f"| every request, geometric mean ±2 SE | {len(rows)} | "
        + " | ".join(geometric_interval([r["ratio"][n] for r in rows]) for n in names)
        + " |"
    )
    print(f"\n{identical_outputs(rows, names)}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
