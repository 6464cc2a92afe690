"""Does greedy output through the daemon depend on the prefix cache or on drafting?

For every prompt of a corpus (bench/corpus.json, 32 prompts; ``--corpus heldout``:
bench/corpus_heldout.json, 24 prompts written for issue 45 and never tuned on),
all requests greedy, token ids compared with the reference (the daemon with the
drafter, its cache and drafting off):

- ``no_drafter`` another daemon on the same target without a drafter (first, on a
                 fresh disk tier, whose pages it writes); its exact steps, if any,
                 are its own load probe's decision
- ``disk``       the prompt restored from disk pages that daemon wrote (the memory
                 tier emptied first; all prompts before any other mode, which empties
                 the disk tier too; ``restored`` counts how many restored any: only
                 whole 64-token chunks are kept, so only prompts at least that long)
- ``cold``       cache on, emptied first (the prompt is prefilled and stored)
- ``warm``       the same request again (its prompt restored from pages)
- ``forced``     drafting every round (``draft: on``), cache off
- ``governed``   drafting as the governor decides (``draft: auto``), cache off
- ``turn2``      a second turn (the first answer plus a follow-up question) with the
                 first turn cached (its prompt and reply pages, written by one-token
                 steps or verify passes) against the same turn with the cache off

Every miss is shown with the first diverging position and the target's top-2
logit gap on the reference path there (computed in process with the daemon's
settings). A daemon whose probe found drafting inexact here decodes plainly and
says so (``draft_off``); the report counts those requests.

    python -m bench.exactness --target PRESET|PATH --drafter PRESET|PATH|ngram [--tokens 48]
        [--corpus main|heldout] [--serve-args "--kernels fast"] [--kinds json story]
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from collections import defaultdict
from pathlib import Path

from bench.common import model_path, start_daemon, temp_socket
from bench.fidelity import reference_engine, top2_gap
from tandem.client import Client

CORPORA = {"main": Path(__file__).with_name("corpus.json"), "heldout": Path(__file__).with_name("corpus_heldout.json")}
MODES = ("no_drafter", "disk", "cold", "warm", "forced", "governed", "turn2")
FOLLOW_UP = "Thanks. Now say the same in fewer words."


def ids(client: Client, messages, tokens: int, done_out: list | None = None, **params) -> tuple[list[int], str]:
    out: list[int] = []
    stream = client.generate(messages=messages, max_tokens=tokens, temperature=0.0, **params)
    for chunk in stream:
        out.extend(chunk.token_ids)
    done = stream.wait()
    if done_out is not None:
        done_out.append(done)
    return out, done.text


def each_prompt(corpus, kinds):
    for kind, prompts in corpus.items():
        if not kinds or kind in kinds:
            for i, messages in enumerate(prompts):
                yield kind, i, messages


def no_drafter_run(socket: Path, target: Path, extra: list[str], corpus, tokens: int, kinds):
    """The same target without a drafter, cache on (its pages go to the shared disk
    tier); stopped before the other daemon starts (one daemon writes a bucket)."""
    daemon = start_daemon(
        socket, "--model", str(target), "--drafter", "none", "--ctx-size", "4096", *extra, timeout=600
    )
    try:
        with Client(socket) as client:
            info = client.status().model
            got = {(kind, i): ids(client, messages, tokens)[0] for kind, i, messages in each_prompt(corpus, kinds)}
            time.sleep(3)  # idle: its pages are written to disk between requests
    finally:
        daemon.terminate()  # (and at shutdown)
        daemon.wait(60)
    return got, info


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def gap_engine(target: Path, serve_args: list[str]):
    """An in-process engine with the daemon's kernels, for top2_gap."""

    def value(flag: str, default: str) -> str:
        return serve_args[serve_args.index(flag) + 1] if flag in serve_args else default

    return reference_engine(
        str(target),
        value("--flash-attn", "on") == "on",
        n_ctx=4096,
        reference_kernels=value("--kernels", "mixed") != "fast",  # (mixed: its steps' kernels; gaps are a diagnostic)
    )


def run(client: Client, corpus, tokens: int, kinds, engine, plain: dict):
    same = defaultdict(lambda: defaultdict(int))  # kind -> mode -> identical count
    total = defaultdict(int)
    misses = []
    counts = defaultdict(int)  # restored: disk runs that restored pages; draft_off: drafted requests refused
    refs, disk = {}, {}
    # first, every prompt restored from the other daemon's files (before anything here clears the disk tier)
    for kind, i, messages in each_prompt(corpus, kinds):
        refs[kind, i] = ids(client, messages, tokens, cache=False, draft="off")
        client.cache_clear(memory_only=True)  # what it restores comes from the other daemon's files
        dones: list = []
        disk[kind, i] = ids(client, messages, tokens, dones, draft="off")[0]
        counts["restored"] += dones[-1].usage.cached_tokens > 0
    for kind, i, messages in each_prompt(corpus, kinds):
        total[kind] += 1
        ref, ref_text = refs[kind, i]
        dones = []
        got = {"no_drafter": plain[(kind, i)], "disk": disk[kind, i]}
        client.cache_clear()
        got["cold"] = ids(client, messages, tokens, draft="off")[0]
        got["warm"] = ids(client, messages, tokens, draft="off")[0]
        got["forced"] = ids(client, messages, tokens, dones, cache=False, draft="on")[0]
        got["governed"] = ids(client, messages, tokens, dones, cache=False, draft="auto")[0]
        counts["draft_off"] += sum(d.draft_off is not None for d in dones[-2:])
        counts["drafted"] += sum(d.draft is not None and d.draft.rounds > 0 for d in dones[-2:])
        turn2 = messages + [{"role": "assistant", "content": ref_text}, {"role": "user", "content": FOLLOW_UP}]
        ref2, _ = ids(client, turn2, tokens, cache=False, draft="off")
        got["turn2"] = ids(client, turn2, tokens, draft="off")[0]  # the first turn's pages are cached
        for mode in MODES:
            want, conv = (ref2, turn2) if mode == "turn2" else (ref, messages)
            if got[mode] == want:
                same[kind][mode] += 1
            else:
                pos = first_difference(want, got[mode])
                misses.append((kind, i, mode, pos, top2_gap(engine, conv, want[:pos])))
    return same, total, misses, counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--corpus", choices=sorted(CORPORA), default="main")
    ap.add_argument("--kinds", nargs="*", default=None)
    ap.add_argument("--serve-args", default="", help="more `tandem serve` flags, e.g. '--kernels fast'")
    ap.add_argument("--json", help="also write the counts here")
    args = ap.parse_args()
    target = model_path(args.target)
    drafter = args.drafter if args.drafter in ("ngram", "none") else str(model_path(args.drafter))
    extra = shlex.split(args.serve_args)
    corpus = json.loads(CORPORA[args.corpus].read_text())
    socket = temp_socket("tdm-exact-")
    started = time.perf_counter()
    plain, plain_info = no_drafter_run(socket, target, extra, corpus, args.tokens, args.kinds)
    daemon = start_daemon(
        socket, "--model", str(target), "--drafter", drafter, "--ctx-size", "4096", *extra, timeout=600
    )
    try:
        with Client(socket) as client:
            info = client.status().model
            engine = gap_engine(target, extra)
            same, total, misses, counts = run(client, corpus, args.tokens, args.kinds, engine, plain)
    finally:
        daemon.terminate()
        daemon.wait(30)
    print(
        f"target {target.name}, drafter {Path(drafter).name}, {args.tokens} tokens, corpus {args.corpus}, "
        f"serve args {extra or 'defaults'}, {time.perf_counter() - started:.0f} s; cpu: {cpu_kind()}"
    )
    for who, m in (("with the drafter", info), ("without a drafter", plain_info)):
        print(
            f"load probe ({who}): batch_invariant={m.batch_invariant} {m.batch_variant_paths or ''} "
            f"kernels={m.kernels} flash_attn={m.flash_attn} extra_buffers={m.extra_buffers} "
            f"exact_steps={m.exact_steps} draft_off={m.draft_off or 'no'}"
        )
    n = sum(total.values())
    print(
        f"disk runs that restored the other daemon's pages: {counts['restored']}/{n}; drafting requests that "
        f"drafted: {counts['drafted']}/{2 * n}, turned off as inexact: {counts['draft_off']}/{2 * n}"
    )
    print("| task | " + " | ".join(MODES) + " |")
    print("|---|" + "---|" * len(MODES))
    for kind in total:
        print(f"| {kind} | " + " | ".join(f"{same[kind][m]}/{total[kind]}" for m in MODES) + " |")
    print("| all | " + " | ".join(f"{sum(same[k][m] for k in total)}/{n}" for m in MODES) + " |")
    for kind, i, mode, pos, g in misses:
        print(f"  miss: {kind}[{i}] {mode}: first diverging token {pos}, top-2 logit gap there {g:.4f}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"same": same, "total": total, "misses": misses, "counts": counts}, indent=1)
        )


def cpu_kind() -> str:
    """The CPU's model name and its widest x86 vector features (what picks ggml's kernels)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile")
    return f"{name} ({', '.join(f for f in wanted if f in flags)})"


if __name__ == "__main__":
    main()
