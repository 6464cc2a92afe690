"""Speculative decoding where the verify pass is nearly free: a GPU.

One prepared run for a machine with a GPU and llama-cpp-python built with one
(bench/gpu.sh builds it with CUDA and runs this). Through the daemon, every
layer of both models offloaded (``--gpu-layers all --drafter-gpu-layers all``):

- plain decoding of the target;
- the target/drafter pair with drafting forced (``draft: on``) and governed,
  at each ``--ks`` draft length, per task kind (bench/corpus.json and the
  copy-heavy edit), greedy: decode tok/s as a ratio to plain, outputs
  identical to plain, and the governor's choices (rounds drafting, its
  predicted speed-up and draft length);
- the prefix cache's restore with the KV on the GPU: a prompt sent again is
  read from pages (cached tokens) and answered as without the cache.

Writes report.md and results.json to ``--out``. Runs on a CPU too (there the
flags place nothing and the figures are this machine's, as bench/governor.py).

    python -m bench.experiments.gpu [--target qwen2.5-coder-1.5b] [--drafter qwen2.5-coder-0.5b] [--ks 2 4 6]
        [--runs 2] [--tokens 64] [--kinds json code story edit] [--out bench/results/DATE-gpu]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import fmt, model_path, start_daemon, temp_socket
from bench.governor import load_all_kinds, run_prompts
from tandem.client import Client

OFFLOAD = ("--gpu-layers", "all", "--drafter-gpu-layers", "all")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--kinds", nargs="+", default=["json", "code", "story", "edit"])
    ap.add_argument("--out", default=f"bench/results/{time.strftime('%Y-%m-%d')}-gpu")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target, drafter = model_path(args.target), model_path(args.drafter)
    corpus = load_all_kinds()
    common = ("--model", str(target), "--ctx-size", "4096", *OFFLOAD)
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    results: dict = {"machine": platform.node(), "target": target.name, "drafter": drafter.name, "ks": {}}
    sockets = {"plain": temp_socket("tdm-gpu-plain-")}
    procs = {"plain": start_daemon(sockets["plain"], *common)}
    try:
        for k in args.ks:
            sockets[k] = temp_socket(f"tdm-gpu-k{k}-")
            state = tempfile.mkdtemp(prefix="tdm-gpu-state-")
            procs[k] = start_daemon(
                sockets[k], *common, "--drafter", str(drafter), "--draft-tokens", str(k), "--state-dir", state
            )
        clients = {name: Client(sock) for name, sock in sockets.items()}
        st = clients["plain"].status()
        devices = ", ".join(f"{d.name} ({d.description})" for d in st.model.devices)
        say(f"# {target.name} with {drafter.name} on {devices}")
        say()
        say(f"target layers: {st.model.layers}; weights: {st.model.weights}")
        if st.model.gpu_note:
            say(f"note: {st.model.gpu_note}")
        for c in clients.values():
            c.complete(prompt="warm up", max_tokens=4, draft="off")

        say()
        say("## Plain decoding and speculative decoding, decode tok/s (median and range over runs)")
        say()
        say("| task | plain tok/s | k | forced / plain | governed / plain | identical (forced, governed) | governor |")
        say("|---|---|---|---|---|---|---|")
        for kind in args.kinds:
            prompts = corpus[kind][: args.prompts]
            plain_runs = []
            per_k = {k: {"forced": [], "governed": [], "same_f": 0, "same_g": 0, "rounds": 0} for k in args.ks}
            for _ in range(args.runs):
                base, _, _, base_ids = run_prompts(clients["plain"], prompts, args.tokens)
                plain_runs.append(base)
                for k in args.ks:
                    f, _, _, f_ids = run_prompts(clients[k], prompts, args.tokens, draft="on")
                    g, _, g_rounds, g_ids = run_prompts(clients[k], prompts, args.tokens)
                    row = per_k[k]
                    row["forced"].append(f / base)
                    row["governed"].append(g / base)
                    row["same_f"] += sum(a == b for a, b in zip(f_ids, base_ids))
                    row["same_g"] += sum(a == b for a, b in zip(g_ids, base_ids))
                    row["rounds"] += g_rounds
            for k in args.ks:
                row, gov = per_k[k], clients[k].status().governor
                choice = (
                    f"{gov.phase}; {gov.draft_rounds} drafting / {gov.plain_rounds} plain rounds; predicted "
                    f"{gov.predicted_speedup or 0:.2f}x at {gov.draft_length} per draft"
                    if gov
                    else "-"
                )
                n = args.runs * len(prompts)
                say(
                    f"| {kind} | {fmt(plain_runs, 1)} | {k} | {fmt(row['forced'])} | {fmt(row['governed'])} | "
                    f"{row['same_f']}/{n}, {row['same_g']}/{n} | {choice} |"
                )
                results["ks"].setdefault(str(k), {})[kind] = {
                    "plain_tok_s": plain_runs,
                    "forced_ratio": row["forced"],
                    "governed_ratio": row["governed"],
                    "identical_forced": row["same_f"],
                    "identical_governed": row["same_g"],
                    "outputs": n,
                    "governor": choice,
                }

        say()
        say("## Prefix cache restore with the KV on the device")
        say()
        long_prompt = [
            {"role": "system", "content": " ".join(corpus["code"][0][-1]["content"] for _ in range(6))},
            {"role": "user", "content": "Summarise the above in two sentences."},
        ]
        c = clients["plain"]
        fresh = c.complete(messages=long_prompt, max_tokens=48, temperature=0.0, cache=False)
        c.complete(messages=long_prompt, max_tokens=48, temperature=0.0)
        c.complete(messages=corpus["json"][0], max_tokens=8, temperature=0.0)  # the live KV holds another prompt
        before = c.status().cache
        again = c.complete(messages=long_prompt, max_tokens=48, temperature=0.0)
        after = c.status().cache
        from_pages = (after.tokens_from_cache - before.tokens_from_cache) - (
            after.tokens_from_live - before.tokens_from_live
        )
        same = again.text == fresh.text
        say(
            f"prompt {fresh.usage.prompt_tokens} tokens: TTFT "
            f"{fresh.timings.time_to_first_token_seconds * 1000:.0f} ms uncached, "
            f"{again.timings.time_to_first_token_seconds * 1000:.0f} ms with "
            f"{again.usage.cached_tokens} tokens from the cache ({from_pages} restored from pages); output "
            f"identical: {same}"
        )
        results["cache"] = {
            "prompt_tokens": fresh.usage.prompt_tokens,
            "cached_tokens": again.usage.cached_tokens,
            "restored_from_pages": from_pages,
            "ttft_uncached_s": fresh.timings.time_to_first_token_seconds,
            "ttft_cached_s": again.timings.time_to_first_token_seconds,
            "identical": same,
        }
        for cl in clients.values():
            cl.close()
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(60)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(
        f"\nwritten: {out}/report.md, {out}/results.json; median plain tok/s overall "
        f"{statistics.median(v for k in results['ks'].values() for t in k.values() for v in t['plain_tok_s']):.1f}"
    )


if __name__ == "__main__":
    main()
