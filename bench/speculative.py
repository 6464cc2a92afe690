"""Speculative decoding on this machine: the lab's table, end to end through the socket.

For each task kind of bench/corpus.json (json extraction, support replies,
stories, code) and each draft length k, greedy, end to end through the socket,
in rotating order per run. Two daemons run side by side: "plain" has no
drafter (one-token steps: what a user gets without drafting); the other has
the drafter, with the draft length set per request (k = 0 there shows what
exact mode costs on steps without drafts).

- tok/s (median of --runs, range), speedup = tok/s / plain tok/s of the same run
- alpha = accepted / drafted, tokens per round
- outputs identical to plain (k = 0) greedy
- the cost model's prediction: tokens per round / (1 + k*c), c = drafter step /
  target step (the lab's; it assumes verifying k+1 tokens costs one step), and
  a refined one with the measured cost of one target pass over k+1 tokens:
  tokens per round * t(1) / (t(k+1) + k * t_draft)

    python -m bench.speculative --target PRESET|PATH --drafter PRESET|PATH|ngram [--runs 3] [--prompts 3] [--tokens 48]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench.common import fmt, model_path, start_daemon, temp_socket
from bench.fidelity import load_corpus
from tandem.client import Client

KS = [1, 2, 4, 6]


def pass_costs_ms(path: Path, widths: list[int], n: int = 12, role: str = "target") -> dict[int, float]:
    """Median time (ms) of one decode pass over w tokens, after a 64-token prefix:
    the daemon's own measurement (governor.measure_pass_costs) on a fresh model
    with the daemon's settings for ``role`` (a target with --kernels mixed: fast
    prefill, repacked weights where the CPU allows them, steps of up to 3 rows
    over them; a drafter: the reference kernels, no repacking)."""
    from tandem.daemon.drafting.governor import measure_pass_costs
    from tandem.daemon.worker.llama_model import LlamaModel

    m = LlamaModel(path, n_ctx=512, fast_prefill=role == "target")
    try:
        return {w: seconds * 1000 for w, seconds in measure_pass_costs(m, widths, reps=n, prefix=64).items()}
    finally:
        m.close()


def run_kind(client: Client, prompts, k: int, tokens: int, p_min: float = 0.0):
    t0 = time.perf_counter()
    generated = drafted = accepted = rounds = 0
    ids = []
    for messages in prompts:
        stream = client.generate(
            messages=messages, max_tokens=tokens, temperature=0.0, draft_tokens=k, draft_p_min=p_min
        )
        ids.append([t for c in stream for t in c.token_ids])
        done = stream.done
        generated += done.usage.completion_tokens
        if done.draft:
            drafted += done.draft.drafted
            accepted += done.draft.accepted
            rounds += done.draft.rounds
    return generated / (time.perf_counter() - t0), drafted, accepted, rounds, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=3, help="prompts per task kind (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--exact", choices=["auto", "off"], default="auto")
    ap.add_argument("--ks", type=int, nargs="+", default=KS, help="draft lengths (default %(default)s)")
    ap.add_argument("--p-min", type=float, default=0.0, help="draft_p_min for every request (default 0 = off)")
    args = ap.parse_args()

    target = model_path(args.target)
    drafter = None if args.drafter == "ngram" else model_path(args.drafter)
    ks = args.ks
    widths = sorted({1, 2, *[k + 1 for k in ks]})
    target_ms = pass_costs_ms(target, widths)
    draft_ms = pass_costs_ms(drafter, [1], role="drafter")[1] if drafter else 0.0
    c = draft_ms / target_ms[1]
    print(
        f"target {target.name}; drafter {drafter.name if drafter else 'ngram'}; exact {args.exact}; "
        f"draft_p_min {args.p_min}; {args.prompts} prompts per kind, {args.tokens} tokens, {args.runs} runs"
    )
    print("one target pass: " + ", ".join(f"{w} tok {ms:.1f} ms" for w, ms in target_ms.items()))
    print(f"one drafter step: {draft_ms:.1f} ms; c = {c:.3f}")

    socket, plain_socket = temp_socket("tdm-spec-"), temp_socket("tdm-plain-")
    daemon = start_daemon(
        socket,
        "--model",
        str(target),
        "--drafter",
        str(drafter) if drafter else "ngram",
        "--exact",
        args.exact,
        "--ctx-size",
        "2048",
    )
    plain_daemon = start_daemon(plain_socket, "--model", str(target), "--ctx-size", "2048")
    corpus = load_corpus()
    try:
        with Client(socket) as client, Client(plain_socket) as plain_client:
            client.complete(prompt="warm up", max_tokens=4)
            plain_client.complete(prompt="warm up", max_tokens=4)
            info = client.status().model
            exact_steps = bool(info and info.exact_steps)
            print(f"exact steps: {exact_steps} (batch-invariant target: {info.batch_invariant if info else None})")
            print()
            print(
                "| kind | plain tok/s | k | speedup | alpha | tokens/round | identical | predicted (lab) "
                "| predicted (measured passes) |"
            )
            print("|---|---|---|---|---|---|---|---|---|")
            for kind, prompts in corpus.items():
                prompts = prompts[: args.prompts]
                ks_all = [0, *ks]  # 0: the drafter daemon with drafting off
                tps = {k: [] for k in ["plain", *ks_all]}
                speedups = {k: [] for k in ks_all}
                agg = {k: [0, 0, 0] for k in ks_all}
                identical = {k: 0 for k in ks_all}
                for r in range(args.runs):
                    order = ["plain", *ks_all]
                    order = order[r % len(order) :] + order[: r % len(order)]
                    results = {
                        k: run_kind(
                            plain_client if k == "plain" else client,
                            prompts,
                            0 if k == "plain" else k,
                            args.tokens,
                            args.p_min,
                        )
                        for k in order
                    }
                    for k, (rate, drafted, accepted, rounds, ids) in results.items():
                        tps[k].append(rate)
                        if k != "plain":
                            speedups[k].append(rate / results["plain"][0])
                            agg[k][0] += drafted
                            agg[k][1] += accepted
                            agg[k][2] += rounds
                            identical[k] += sum(a == b for a, b in zip(ids, results["plain"][4]))
                for k in ks_all:
                    drafted, accepted, rounds = agg[k]
                    alpha = accepted / drafted if drafted else float("nan")
                    per_round = (accepted + rounds) / rounds if rounds else 1.0
                    lab = per_round / (1 + k * c)
                    refined = per_round * target_ms[1] / (target_ms[max(k + 1, 2 if exact_steps else 1)] + k * draft_ms)
                    print(
                        f"| {kind} | {fmt(tps['plain'], 1)} | {k} | {fmt(speedups[k])} | {alpha:.2f} "
                        f"| {per_round:.2f} | "
                        f"{identical[k]}/{args.runs * len(prompts)} | {lab:.2f} | {refined:.2f} |"
                    )
    finally:
        for proc in (daemon, plain_daemon):
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
