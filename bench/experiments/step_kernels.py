"""What tandem's exact decoding steps cost: one-token steps with ggml's reference
(row-by-row) kernels, as ``--kernels mixed`` runs every step, against the same
steps with its fast kernels, in-process, alternating.

The target worker's ``LlamaModel`` (mixed kernels, repacked weights where
llama.cpp has them) reads a prompt in its chunks, then decodes ``--tokens``
greedy tokens one at a time, from the same prompt, with one kind of kernels and
then the other (the order flips each round; one short run of each first, not counted). Reported: tok/s of each, the
ratio fast / reference per round, and from which step the two give other
logits. One-row fast steps would be exact too in a daemon that never verifies
several tokens in a pass, but they are not the kernels a verify pass's rows
agree with, so a daemon with a drafter and one without would write different
text; this measures what keeping one kind of step everywhere costs.

    python -m bench.experiments.step_kernels [--model smollm2-135m] [--rounds 8] [--tokens 96] [--context 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from bench.common import model_path
from tandem.daemon.worker.llama_model import LlamaModel

FILLER = "The town kept its records in a tall stone building near the harbour, and every family had a drawer there. "


def decode_greedy(model: LlamaModel, start: int, first: int, n: int, reference: bool) -> tuple[float, list[np.ndarray]]:
    """From KV position ``start``, ``n`` one-token steps from ``first`` with the
    reference kernels or the fast ones: their seconds, and the logits of each."""
    model.truncate(start)
    model.use_reference(reference)  # (a step's kernels; prefill switches them itself)
    token, logits = first, []
    try:
        started = time.perf_counter()
        for _ in range(n):
            row = model.decode([token])[0]
            token = int(np.argmax(row))
            logits.append(row)
        return time.perf_counter() - started, logits
    finally:
        model.use_reference(True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a preset or a .gguf path")
    ap.add_argument("--rounds", type=int, default=8, help="rounds, each one run of both kinds of steps")
    ap.add_argument("--tokens", type=int, default=96, help="steps per run")
    ap.add_argument("--context", type=int, default=200, help="prompt tokens (about) before the steps")
    ap.add_argument("--ctx-size", type=int, default=4096)
    args = ap.parse_args()

    model = LlamaModel(model_path(args.model), n_ctx=args.ctx_size, fast_prefill=True)
    if not model.prefill_chunk:
        sys.exit("this llama.cpp has no CPU backend whose kernels can be switched: nothing to compare")
    prompt: list[int] = []
    while len(prompt) < args.context:
        prompt = model.tokenize(FILLER * (len(prompt) // 20 + 1) + "Write a short story.", add_special=True)
    if len(prompt) + args.tokens > model.n_ctx:
        sys.exit(f"{len(prompt)} + {args.tokens} tokens do not fit the context of {model.n_ctx}: raise --ctx-size")
    first = int(np.argmax(model.prefill(prompt)))
    for reference in (True, False):  # a warm-up run of each kind, not counted: the first steps after a prefill
        decode_greedy(model, len(prompt), first, min(args.tokens, 8), reference)
    speed: dict[str, list[float]] = {"reference": [], "fast": []}
    logits: dict[str, list[np.ndarray]] = {}
    for r in range(args.rounds):
        for kind in ("reference", "fast") if r % 2 == 0 else ("fast", "reference"):
            seconds, rows = decode_greedy(model, len(prompt), first, args.tokens, kind == "reference")
            speed[kind].append(args.tokens / seconds)
            logits.setdefault(kind, rows)
            time.sleep(0.2)
    model.close()
    print(f"{args.model}: {len(prompt)} prompt tokens, {args.tokens} one-token steps, {args.rounds} rounds")
    for kind, values in speed.items():
        print(f"{kind} kernels: {statistics.median(values):.1f} tok/s ({min(values):.1f}-{max(values):.1f})")
    ratios = [f / r for f, r in zip(speed["fast"], speed["reference"])]
    print(f"fast / reference: median {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
    same = [np.array_equal(a, b) for a, b in zip(logits["reference"], logits["fast"])]
    first_diff = same.index(False) if False in same else None
    print(
        "logits bit for bit the same in every step"
        if first_diff is None
        else f"logits first differ at step {first_diff} (KV position {len(prompt) + first_diff})"
    )


if __name__ == "__main__":
    main()
