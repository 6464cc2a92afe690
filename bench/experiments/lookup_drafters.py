"""Drafters without a model, side by side: prompt lookup (``ngram``) vs suffix
matching (``suffix``) on copy-heavy work.

Tasks (bench/corpus_edit.json): ``edit``, a code-editing tool re-emitting a
file with one change; ``agent``, an agent's turn that writes back a file it read
earlier in the conversation, with other files of the project in between (so a
short match is ambiguous). Five systems in one run, the order rotated per run:
tandem plain, each drafter forced on (every round drafts) and governed (the
governor decides, its state fresh at the start; an untimed first pass over
each task warms every system and shows the governor the task). Reported per task: decode
tok/s as a ratio to plain (median and range over runs), acceptance (accepted /
drafted) and tokens per round of the forced systems, outputs identical to plain.

Then a replay without the target: plain decoding's greedy tokens, drafted
against by each drafter offline (a round proposes up to k tokens after the
context, accepts the longest prefix that matches what plain decoding produced,
and adds one more). It gives tokens per target pass, drafted tokens per pass,
and the speedup the target's measured pass costs predict; its figures do not
depend on the machine's load.

    python -m bench.experiments.lookup_drafters [--target qwen2.5-coder-1.5b] [--runs 3] [--tokens 160]
        [--kinds edit agent]
    python -m bench.experiments.lookup_drafters --tokens 256 --also-fast 16 [--fresh]

``--also-fast K`` adds two systems that give up exact output for speed:
``--kernels fast --exact off`` without a drafter, and with the suffix drafter
governed at up to K tokens a round (``--draft-tokens K``). With the fast kernels
a verify pass is one ``llama_decode`` and llama.cpp's tiled kernels make a pass
of 16-32 rows cost 9–15 one-token steps, not 16–32 (``verify_cost.py``), so long copies pay;
but greedy text can then differ from plain decoding's at near-ties (the
identical-to-plain column counts it). Every request starts once all daemons are
idle (``wait_quiet``).

``--also-stock`` adds plain decoding and the suffix drafter governed on llama.cpp's own CPU kernels
(``--kernel-patch off``): the defaults run tandem's (daemon/kernels), whose verify passes over repacked
weights are one ``llama_decode`` reading the weights once, where llama.cpp's are cut into passes of 3 rows.

``--fresh`` sends every request with ``cache: false``: after each one a daemon
forgets what it read and what its drafter remembers of earlier prompts and
replies (the suffix drafter's reply memory), so a drafter can copy only from
the request's own prompt and what it has written so far, not from its own
answer to the same prompt in an earlier run. Decode tok/s does not include
the prefill, so plain decoding is measured the same way.
"""

from __future__ import annotations

import argparse
import tempfile

from bench.common import fmt, model_path, start_daemon, temp_socket, wait_quiet
from bench.governor import load_all_kinds
from tandem.client import Client
from tandem.daemon.drafting.ngram import NgramDrafter
from tandem.daemon.drafting.suffix import SuffixDrafter

DRAFTERS = ("ngram", "suffix")


def run(client: Client, prompts, tokens: int, **params) -> dict:
    """Decode tok/s over the prompts, drafted and accepted tokens, rounds, token ids per prompt,
    and the prompt tokens the daemon did not read (kept or restored from an earlier request)."""
    decode_tokens, seconds, drafted, accepted, rounds, ids, cached = 0, 0.0, 0, 0, 0, [], 0
    for messages in prompts:
        stream = client.generate(messages=messages, max_tokens=tokens, temperature=0.0, **params)
        ids.append([t for c in stream for t in c.token_ids])
        done = stream.done
        decode_tokens += max(done.usage.completion_tokens - 1, 0)
        seconds += done.timings.generation_seconds
        cached += done.usage.cached_tokens
        if done.draft:
            drafted += done.draft.drafted
            accepted += done.draft.accepted
            rounds += done.draft.rounds
    return {
        "tps": decode_tokens / seconds,
        "drafted": drafted,
        "accepted": accepted,
        "rounds": rounds,
        "decode_tokens": decode_tokens,
        "ids": ids,
        "cached": cached,
    }


def replay(drafter, prompt: list[int], output: list[int], k: int) -> tuple[int, int, list[int]]:
    """(target passes, drafted tokens, draft width of each pass) to produce ``output``
    after ``prompt`` with this drafter, greedy: the first token comes from the prefill."""
    drafter.begin("replay", prompt, None)
    i, passes, drafted, widths = 1, 0, 0, []
    while i < len(output):
        drafts, _ = drafter.propose(prompt + output[:i], min(k, len(output) - i - 1) or 1, 0.0)
        n = 0
        while n < len(drafts) and i + n < len(output) and drafts[n] == output[i + n]:
            n += 1
        passes += 1
        drafted += len(drafts)
        widths.append(len(drafts) + 1)
        i += n + 1
    drafter.finished(prompt + output, len(prompt))
    return passes, drafted, widths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--k", type=int, default=4, help="draft tokens per round (default %(default)s)")
    ap.add_argument("--kinds", nargs="+", default=["edit", "agent"])
    ap.add_argument("--prompts", type=int, default=0, metavar="N", help="only each task's first N prompts (0: all)")
    ap.add_argument("--ctx-size", default="4096")
    ap.add_argument(
        "--also-fast",
        type=int,
        default=0,
        metavar="K",
        help="also --kernels fast --exact off, plain and with the suffix drafter governed at up to K tokens "
        "a round (not exact)",
    )
    ap.add_argument(
        "--fresh",
        action="store_true",
        help="send every request with cache: false, so no daemon keeps anything of one request for the next "
        "(the drafters copy only from the request itself)",
    )
    ap.add_argument(
        "--also-stock",
        action="store_true",
        help="also plain and the suffix drafter governed on llama.cpp's own CPU kernels (--kernel-patch off), "
        "against the defaults' tandem kernels, whose verify passes read the weights once (exact either way)",
    )
    args = ap.parse_args()

    target = model_path(args.target)
    corpus = load_all_kinds(agent=True)
    model = ("--model", str(target), "--ctx-size", args.ctx_size)
    common = (*model, "--draft-tokens", str(args.k))
    sockets = {"plain": temp_socket("tdm-lk-plain-"), **{d: temp_socket(f"tdm-lk-{d}-") for d in DRAFTERS}}
    procs = {}
    replays: dict[str, dict[str, list]] = {}
    try:  # every daemon started is stopped, also when a later one fails to start
        procs["plain"] = start_daemon(sockets["plain"], *common)
        for d in DRAFTERS:
            state = tempfile.mkdtemp(prefix="tdm-lk-state-")
            procs[d] = start_daemon(sockets[d], *common, "--drafter", d, "--state-dir", state)
        if args.also_fast:
            fast = (*model, "--kernels", "fast", "--exact", "off")
            for name, extra in (
                ("fast plain", ()),
                ("fast suffix", ("--drafter", "suffix", "--draft-tokens", str(args.also_fast))),
            ):
                sockets[name] = temp_socket("tdm-lk-fast-")
                state = tempfile.mkdtemp(prefix="tdm-lk-state-")
                procs[name] = start_daemon(sockets[name], *fast, *extra, "--state-dir", state)
        if args.also_stock:
            stock = (*common, "--kernel-patch", "off")
            for name, extra in (("stock plain", ()), ("stock suffix", ("--drafter", "suffix"))):
                sockets[name] = temp_socket("tdm-lk-stock-")
                state = tempfile.mkdtemp(prefix="tdm-lk-state-")
                procs[name] = start_daemon(sockets[name], *stock, *extra, "--state-dir", state)
        print(
            f"target {target.name}; k {args.k}; {args.tokens} tokens; {args.runs} runs; kinds {' '.join(args.kinds)}"
            + (f"; fast systems: --kernels fast --exact off, suffix k {args.also_fast}" if args.also_fast else "")
            + ("; fresh: every request with cache: false" if args.fresh else "")
        )
        clients = {s: Client(p) for s, p in sockets.items()}
        for c in clients.values():
            c.complete(prompt="warm up", max_tokens=4, draft="off")
        fresh = {"cache": False} if args.fresh else {}
        systems = {"plain": (clients["plain"], fresh)}
        for d in DRAFTERS:
            systems[f"{d} forced"] = (clients[d], {"draft": "on", **fresh})
            systems[f"{d} governed"] = (clients[d], fresh)
        if args.also_stock:
            systems["stock plain"] = (clients["stock plain"], fresh)
            systems["stock suffix governed"] = (clients["stock suffix"], fresh)
        if args.also_fast:
            systems["fast plain"] = (clients["fast plain"], fresh)
            systems[f"fast suffix k={args.also_fast} governed"] = (clients["fast suffix"], fresh)
        print()
        print("| task | plain decode tok/s | " + " | ".join(f"{s} / plain" for s in list(systems)[1:]) + " |")
        print("|---|---|" + "---|" * (len(systems) - 1))
        details, cached = [], 0
        for kind in args.kinds:
            prompts = corpus[kind][: args.prompts or None]
            res: dict[str, list[dict]] = {s: [] for s in systems}
            for client, params in systems.values():  # untimed: warms every system, and the governors meet the task
                run(client, prompts, args.tokens, **params)
            for r in range(args.runs):
                order = list(systems)[r % len(systems) :] + list(systems)[: r % len(systems)]
                for s in order:
                    client, params = systems[s]
                    wait_quiet([proc.pid for proc in procs.values()])
                    res[s].append(run(client, prompts, args.tokens, **params))
            cached += sum(x["cached"] for runs in res.values() for x in runs)
            plain = [x["tps"] for x in res["plain"]]
            cells = [fmt([x["tps"] / p for x, p in zip(res[s], plain)]) for s in list(systems)[1:]]
            print(f"| {kind} | {fmt(plain, 1)} | " + " | ".join(cells) + " |")
            for s in list(systems)[1:]:
                drafted = sum(x["drafted"] for x in res[s])
                accepted = sum(x["accepted"] for x in res[s])
                rounds = sum(x["rounds"] for x in res[s])
                same = sum(a == b for x, y in zip(res[s], res["plain"]) for a, b in zip(x["ids"], y["ids"]))
                alpha = accepted / drafted if drafted else 0
                per_round = (accepted + rounds) / rounds if rounds else 0
                details.append(
                    f"| {kind} | {s} | {alpha:.2f} | {per_round:.2f} | {rounds} | {same}/{len(res[s]) * len(prompts)} |"
                )
            prompt_ids = [clients["plain"].tokenize(messages=m).tokens for m in prompts]
            replays[kind] = {"prompts": prompt_ids, "outputs": res["plain"][0]["ids"]}
        print()
        print(
            "| task | system | accepted / drafted | tokens per drafting round | drafting rounds | identical to plain |"
        )
        print("|---|---|---|---|---|---|")
        print("\n".join(details))
        print()
        print(f"Prompt tokens not read again (kept or restored from an earlier request), timed requests: {cached}")
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(30)

    from bench.speculative import pass_costs_ms

    costs = pass_costs_ms(target, list(range(1, args.k + 2)))
    print()
    print("Replay of plain decoding's tokens (no target; predicted speedup from the target's measured pass costs: ")
    print("  " + ", ".join(f"{w} tok {ms:.1f} ms" for w, ms in costs.items()) + ")")
    print()
    print("| task | drafter | tokens per target pass | drafted per pass | accepted / drafted | predicted speedup |")
    print("|---|---|---|---|---|---|")
    for kind, data in replays.items():
        for name, make in (("ngram", NgramDrafter), ("suffix", SuffixDrafter)):
            drafter = make()
            passes = drafted = tokens = 0
            cost = 0.0
            for prompt, output in zip(data["prompts"], data["outputs"]):
                if args.fresh:
                    drafter.forget()  # as cache: false leaves it
                p, d, widths = replay(drafter, prompt, output, args.k)
                passes, drafted, tokens = passes + p, drafted + d, tokens + len(output) - 1
                cost += sum(costs[w] for w in widths)
            accepted = tokens - passes
            print(
                f"| {kind} | {name} | {tokens / passes:.2f} | {drafted / passes:.2f} | "
                f"{accepted / drafted if drafted else 0:.2f} | {tokens * costs[1] / cost:.2f} |"
            )


if __name__ == "__main__":
    main()
