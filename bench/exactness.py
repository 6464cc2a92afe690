"""Does greedy output through the daemon depend on the prefix cache or on drafting?

For every prompt of the 32-prompt corpus (bench/corpus.json), one daemon with a
drafter and the prefix cache, all requests greedy, token ids compared with the
reference (cache off, drafting off):

- ``cold``       cache on, emptied first (the prompt is prefilled and stored)
- ``warm``       the same request again (its prompt restored from pages)
- ``forced``     drafting every round (``draft: on``), cache off
- ``governed``   drafting as the governor decides (``draft: auto``), cache off
- ``turn2``      a second turn (the first answer plus a follow-up question) with the
                 first turn cached (its prompt and reply pages, written by one-token
                 steps or verify passes) against the same turn with the cache off

Every miss is shown with the first diverging position and the target's top-2
logit gap on the reference path there (computed in process with the daemon's
settings).

    python bench/exactness.py --target PRESET|PATH --drafter PRESET|PATH|ngram [--tokens 48]
        [--serve-args "--kernels fast"] [--kinds json story]
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from collections import defaultdict
from pathlib import Path

from common import model_path, start_daemon, temp_socket
from fidelity import reference_engine, top2_gap

from tandem.client import Client

CORPUS = Path(__file__).with_name("corpus.json")
MODES = ("cold", "warm", "forced", "governed", "turn2")
FOLLOW_UP = "Thanks. Now say the same in fewer words."


def ids(client: Client, messages, tokens: int, **params) -> tuple[list[int], str]:
    out: list[int] = []
    done = None
    stream = client.generate(messages=messages, max_tokens=tokens, temperature=0.0, **params)
    for chunk in stream:
        out.extend(chunk.token_ids)
    done = stream.wait()
    return out, done.text


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


def run(client: Client, corpus, tokens: int, kinds, engine):
    same = defaultdict(lambda: defaultdict(int))  # kind -> mode -> identical count
    total = defaultdict(int)
    misses = []
    for kind, prompts in corpus.items():
        if kinds and kind not in kinds:
            continue
        for i, messages in enumerate(prompts):
            total[kind] += 1
            ref, ref_text = ids(client, messages, tokens, cache=False, draft="off")
            client.cache_clear()
            got = {"cold": ids(client, messages, tokens, draft="off")[0]}
            got["warm"] = ids(client, messages, tokens, draft="off")[0]
            got["forced"] = ids(client, messages, tokens, cache=False, draft="on")[0]
            got["governed"] = ids(client, messages, tokens, cache=False, draft="auto")[0]
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
    return same, total, misses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", default="ngram")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--kinds", nargs="*", default=None)
    ap.add_argument("--serve-args", default="", help="more `tandem serve` flags, e.g. '--kernels fast'")
    ap.add_argument("--json", help="also write the counts here")
    args = ap.parse_args()
    target = model_path(args.target)
    drafter = args.drafter if args.drafter in ("ngram", "none") else str(model_path(args.drafter))
    extra = shlex.split(args.serve_args)
    socket = temp_socket("tdm-exact-")
    daemon = start_daemon(
        socket, "--model", str(target), "--drafter", drafter, "--ctx-size", "4096", *extra, timeout=600
    )
    started = time.perf_counter()
    try:
        with Client(socket) as client:
            info = client.status().model
            engine = gap_engine(target, extra)
            same, total, misses = run(client, json.loads(CORPUS.read_text()), args.tokens, args.kinds, engine)
    finally:
        daemon.terminate()
        daemon.wait(30)
    print(
        f"target {target.name}, drafter {Path(drafter).name}, {args.tokens} tokens, serve args {extra or 'defaults'}, "
        f"{time.perf_counter() - started:.0f} s"
    )
    print(
        f"load probe: batch_invariant={info.batch_invariant} {info.batch_variant_paths or ''} "
        f"kernels={info.kernels} flash_attn={info.flash_attn} exact_steps={info.exact_steps}"
    )
    print("| task | " + " | ".join(MODES) + " |")
    print("|---|" + "---|" * len(MODES))
    for kind in total:
        print(f"| {kind} | " + " | ".join(f"{same[kind][m]}/{total[kind]}" for m in MODES) + " |")
    n = sum(total.values())
    print("| all | " + " | ".join(f"{sum(same[k][m] for k in total)}/{n}" for m in MODES) + " |")
    for kind, i, mode, pos, g in misses:
        print(f"  miss: {kind}[{i}] {mode}: first diverging token {pos}, top-2 logit gap there {g:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"same": same, "total": total, "misses": misses}, indent=1))


if __name__ == "__main__":
    main()
