"""Why 32 tokens per prefix-cache page: what a page size costs in time to first
token for a follow-up prompt whose cached part ends at a random point.

A request reuses whole pages only, so a prompt that shares n tokens with the
cache restores floor(n / page) pages and prefills the rest again (page / 2
tokens on average). Small pages waste less prefill but mean more pages to
assemble per restore (per-page, per-layer slicing) and a bigger tree. This
measures both, in process with tandem's own PageStore on a real model:
restore + prefill of the remainder, for each page size, the same cut points.

    python -m bench.experiments.page_size --model qwen2.5-coder-0.5b --tokens 4000 --samples 5
"""

from __future__ import annotations

import argparse
import random
import time
from multiprocessing import shared_memory

from bench.common import fmt, model_path
from tandem.daemon.cache.page_store import PageStore
from tandem.daemon.cache.prefix_cache import ExtentAllocator, PageTree
from tandem.daemon.worker.llama_model import LlamaModel


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", type=int, default=4000, help="cached prompt length")
    ap.add_argument("--samples", type=int, default=5, help="random cut points (the same for every page size)")
    ap.add_argument("--pages", default="8,16,32,64,128,256")
    args = ap.parse_args()
    model = LlamaModel(model_path(args.model), n_ctx=args.tokens + 256)
    rng = random.Random(3)
    text = " ".join(
        rng.choice(["cache", "page", "token", "tree", "worker", "daemon", "reply", "arena"])
        for _ in range(4 * args.tokens)
    )
    tokens = model.tokenize(text, add_special=True)[: args.tokens]
    extra = model.tokenize(" and then the next turn asks a new question about it", add_special=False)
    cuts = [rng.randrange(args.tokens // 2, args.tokens) for _ in range(args.samples)]
    model.clear()
    model.decode(tokens)
    blob = model.seq_state()
    arena = shared_memory.SharedMemory(create=True, size=2 * len(blob) + (1 << 24))
    try:
        print(
            f"{model.path.name}: {args.tokens} cached tokens ({len(blob) / 2**20:.0f} MiB of KV), cut points {cuts}\n"
        )
        print("| page tokens | pages | restore ms | prefilled again (tokens, mean) | restore + prefill ms |")
        print("|---|---|---|---|---|")
        for page in [int(p) for p in args.pages.split(",")]:
            store = PageStore(PageTree(page, ExtentAllocator(arena.size)), arena.buf, model)
            store.probe_layout()
            model.clear()
            model.decode(tokens)
            store.store(tokens)
            restore_ms, total_ms, again = [], [], []
            for cut in cuts:
                prompt = tokens[:cut] + extra
                t0 = time.perf_counter()
                n = store.restore(prompt)
                t1 = time.perf_counter()
                model.decode(prompt[n:])
                t2 = time.perf_counter()
                store.release()
                restore_ms.append((t1 - t0) * 1000)
                total_ms.append((t2 - t0) * 1000)
                again.append(cut - n)
            print(
                f"| {page} | {store.tree.pages()} | {fmt(restore_ms, 1)} | {sum(again) / len(again):.0f} "
                f"| {fmt(total_ms, 0)} |",
                flush=True,
            )
            del store
    finally:
        arena.close()
        arena.unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
