"""The governor on this machine: governed throughput / plain throughput, per task.

Three systems, end to end through the socket, greedy, in rotating order per run:
- plain: a daemon without a drafter (what a user gets without drafting);
- governed: a daemon with the drafter and the governor. Its state starts fresh;
  a first pass over each task (all three systems, reported on its own: what a
  new task costs while the governor learns) is followed by the ``--runs``
  timed runs, which find the state the first pass left (as a user's daemon
  finds what it learned, kept across restarts) and go on learning;
- forced: the same daemon, every round drafting (``draft: on``), which shows
  what the governor saves where drafting does not pay and whether it keeps
  the gain where it does.

Per task kind (bench/corpus.json: json, support, story, code; and
bench/corpus_edit.json: a copy-heavy code edit), ``--prompts`` prompts of
``--tokens`` tokens each. Reported: decode tok/s (completion tokens after the
first / generation seconds, which is where drafting acts) as a ratio to plain,
median of ``--runs`` with range; the same for end-to-end tok/s (wall clock,
prefill included); the share of governed rounds that drafted; governed outputs
identical to plain.

``--alternate A,B`` adds a second part: requests alternate between two kinds
(A B A B ...), on a governed daemon with one state per task and on one with a
single state for all requests, against plain.

    python -m bench.governor --target PRESET|PATH --drafter PRESET|PATH|ngram|suffix [--runs 3] [--prompts 3]
        [--tokens 64]
        [--kinds json support story code edit] [--alternate edit,story --cycles 4]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench.common import fmt, model_path, start_daemon, temp_socket, wait_quiet
from bench.fidelity import load_corpus
from tandem.client import Client

EDIT_CORPUS = Path(__file__).with_name("corpus_edit.json")


def load_all_kinds(agent: bool = False) -> dict[str, list]:
    """The task corpus and the copy-heavy edit; ``agent``: also the agent's turns
    (bench/experiments/lookup_drafters.py's second task)."""
    corpus = load_corpus()
    corpus.update(json.loads(EDIT_CORPUS.read_text()))
    if not agent:
        corpus.pop("agent", None)
    return corpus


def run_prompts(client: Client, prompts, tokens: int, quiet=(), **params):
    """Returns (decode tok/s, end-to-end tok/s, drafting rounds, token ids per prompt).
    Each request starts once the process trees of ``quiet`` (pids) are idle: a
    daemon settles a turn after its reply, which must not run beside another
    system's request."""
    wall = 0.0  # the requests' own time, not the waits between them
    generated = decode_tokens = 0
    decode_seconds = 0.0
    draft_rounds = 0
    ids = []
    for messages in prompts:
        if quiet:
            wait_quiet(list(quiet))
        t0 = time.perf_counter()
        stream = client.generate(messages=messages, max_tokens=tokens, temperature=0.0, **params)
        ids.append([t for c in stream for t in c.token_ids])
        wall += time.perf_counter() - t0
        done = stream.done
        generated += done.usage.completion_tokens
        decode_tokens += max(done.usage.completion_tokens - 1, 0)
        decode_seconds += done.timings.generation_seconds
        if done.draft:
            draft_rounds += done.draft.rounds
    return decode_tokens / decode_seconds, generated / wall, draft_rounds, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=3, help="prompts per task kind (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--kinds", nargs="+", default=["json", "support", "story", "code", "edit"])
    ap.add_argument("--alternate", default="", help="two kinds to alternate, e.g. edit,story")
    ap.add_argument("--cycles", type=int, default=4, help="A-B pairs in the alternating part (default %(default)s)")
    ap.add_argument("--ctx-size", default="2048")
    ap.add_argument("--draft-tokens", type=int, help="the drafting daemon's --draft-tokens (default: its own)")
    args = ap.parse_args()

    target = model_path(args.target)
    drafter = args.drafter if args.drafter in ("ngram", "suffix") else str(model_path(args.drafter))
    corpus = load_all_kinds()
    state = Path(tempfile.mkdtemp(prefix="tdm-gov-state-"))
    print(
        f"target {target.name}; drafter {Path(drafter).name}; {args.prompts} prompts per kind, "
        f"{args.tokens} tokens, {args.runs} runs"
    )

    sockets = {"plain": temp_socket("tdm-plain-"), "governed": temp_socket("tdm-gov-")}
    procs = {
        "plain": start_daemon(sockets["plain"], "--model", str(target), "--ctx-size", args.ctx_size),
        "governed": start_daemon(
            sockets["governed"],
            "--model",
            str(target),
            "--drafter",
            drafter,
            "--ctx-size",
            args.ctx_size,
            "--state-dir",
            str(state),
            *(["--draft-tokens", str(args.draft_tokens)] if args.draft_tokens is not None else []),
        ),
    }
    try:
        with Client(sockets["plain"]) as plain, Client(sockets["governed"]) as governed:
            for c in (plain, governed):
                c.complete(prompt="warm up", max_tokens=4, draft="off")
            systems = {
                "plain": (plain, {}),
                "governed": (governed, {}),
                "forced": (governed, {"draft": "on"}),
            }
            print()
            print(
                "| task | plain decode tok/s | governed / plain, first pass | governed / plain | forced on / plain "
                "| governed / plain, end to end | forced / plain, end to end | governed rounds drafting "
                "| identical to plain | governor after |"
            )
            print("|---|---|---|---|---|---|---|---|---|---|")
            for kind in args.kinds:
                prompts = corpus[kind][: args.prompts]
                dec = {s: [] for s in systems}
                e2e = {s: [] for s in systems}
                identical = 0
                drafting_rounds = 0
                quiet = [proc.pid for proc in procs.values()]
                first = {
                    s: run_prompts(systems[s][0], prompts, args.tokens, quiet=quiet, **systems[s][1]) for s in systems
                }
                first_ratio = first["governed"][0] / first["plain"][0]
                for r in range(args.runs):
                    order = list(systems)
                    order = order[r % len(order) :] + order[: r % len(order)]
                    res = {
                        s: run_prompts(systems[s][0], prompts, args.tokens, quiet=quiet, **systems[s][1]) for s in order
                    }
                    for s, (d, e, _, _) in res.items():
                        dec[s].append(d)
                        e2e[s].append(e)
                    drafting_rounds += res["governed"][2]
                    identical += sum(a == b for a, b in zip(res["governed"][3], res["plain"][3]))
                g = governed.status().governor
                base_dec, base_e2e = dec["plain"], e2e["plain"]
                ratio = lambda xs, base: [x / b for x, b in zip(xs, base)]  # noqa: E731
                total_rounds = g.plain_rounds + g.draft_rounds if g else 0
                print(
                    f"| {kind} | {fmt(base_dec, 1)} | {first_ratio:.2f} | {fmt(ratio(dec['governed'], base_dec))} | "
                    f"{fmt(ratio(dec['forced'], base_dec))} | {fmt(ratio(e2e['governed'], base_e2e))} | "
                    f"{fmt(ratio(e2e['forced'], base_e2e))} | "
                    f"{g.draft_rounds if g else 0}/{total_rounds} | {identical}/{args.runs * len(prompts)} | "
                    f"{g.phase if g else '-'}; its estimates: plain {g.plain_tokens_per_second or 0:.1f}, drafting "
                    f"{g.draft_tokens_per_second or 0:.1f} tok/s; {g.failed_probes if g else 0}/{g.probes if g else 0} "
                    "probes failed |"
                )
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(30)
    if args.alternate:
        alternate(args, target, drafter, corpus)


def alternate(args, target: Path, drafter: str, corpus) -> None:
    """A user alternating two tasks: per-task governor states vs one state."""
    a, b = args.alternate.split(",")
    sockets = {s: temp_socket(f"tdm-alt-{s}-") for s in ("plain", "per-task", "one-state")}
    common = ("--model", str(target), "--ctx-size", args.ctx_size)
    procs = {
        "plain": start_daemon(sockets["plain"], *common),
        "per-task": start_daemon(
            sockets["per-task"], *common, "--drafter", drafter, "--state-dir", tempfile.mkdtemp(prefix="tdm-gov-")
        ),
        "one-state": start_daemon(
            sockets["one-state"],
            *common,
            "--drafter",
            drafter,
            "--governor-per-task",
            "off",
            "--state-dir",
            tempfile.mkdtemp(prefix="tdm-gov-"),
        ),
    }
    try:
        clients = {s: Client(p) for s, p in sockets.items()}
        for c in clients.values():
            c.complete(prompt="warm up", max_tokens=4, draft="off")
        # decode tokens and seconds per system per kind, over the whole alternating sequence
        totals = {s: {k: [0, 0.0] for k in (a, b)} for s in clients}
        per_cycle = {s: {k: [] for k in (a, b)} for s in clients}
        for cycle in range(args.cycles):
            for kind in (a, b):
                messages = corpus[kind][cycle % len(corpus[kind])]
                order = list(clients)
                order = order[cycle % 3 :] + order[: cycle % 3]
                for s in order:
                    done = clients[s].complete(messages=messages, max_tokens=args.tokens, temperature=0.0)
                    n = max(done.usage.completion_tokens - 1, 0)
                    totals[s][kind][0] += n
                    totals[s][kind][1] += done.timings.generation_seconds
                    per_cycle[s][kind].append(n / done.timings.generation_seconds)
        print()
        print(f"Alternating {a} and {b}, {args.cycles} cycles, {args.tokens} tokens per request: decode tok/s / plain")
        print()
        print(f"| system | {a}: overall | {a}: per request | {b}: overall | {b}: per request |")
        print("|---|---|---|---|---|")
        for s in ("per-task", "one-state"):
            cells = []
            for kind in (a, b):
                overall = (totals[s][kind][0] / totals[s][kind][1]) / (
                    totals["plain"][kind][0] / totals["plain"][kind][1]
                )
                ratios = [x / y for x, y in zip(per_cycle[s][kind], per_cycle["plain"][kind])]
                cells += [f"{overall:.2f}", " ".join(f"{x:.2f}" for x in ratios)]
            print(f"| {s} | " + " | ".join(cells) + " |")
        for c in clients.values():
            c.close()
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
