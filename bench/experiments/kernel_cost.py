"""What batch invariance costs: prefill and decode speed of llama.cpp settings, side by side.

Each setting is a context of its own in this process (all resident at once);
rounds alternate between them so that the shared machine's noise falls on all
alike. A round prefills a prompt of --prompt tokens in one call and then
decodes --tokens tokens one at a time (greedy), as the daemon's plain path does.

    python -m bench.experiments.kernel_cost --model smollm2-135m [--rounds 5] [--prompt 512] [--tokens 64]
        [--settings new old fast-flash]

Settings: new = the defaults (reference kernels, flash attention, no extra
buffers); old = the previous defaults (fast kernels, no flash attention, extra
buffers auto: off on AMX CPUs, on elsewhere); fast-flash = fast kernels with
flash attention; new+eb = the defaults with extra buffers (repacking) on.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench.common import fmt, model_path

SETTINGS = {
    "new": dict(reference_kernels=True, flash_attn=True, extra_buffers=None),
    "old": dict(reference_kernels=False, flash_attn=False, extra_buffers=None),
    "fast-flash": dict(reference_kernels=False, flash_attn=True, extra_buffers=None),
    "new+eb": dict(reference_kernels=True, flash_attn=True, extra_buffers=True),
}
TEXT = (
    "The lighthouse keeper climbed the stairs every evening to light the lamp. "
    "def parse(line):\n    fields = []\n    for part in line.split(','):\n        fields.append(part.strip())\n"
)


def one_round(model, prompt: list[int], tokens: int) -> tuple[float, float]:
    model.clear()
    t0 = time.perf_counter()
    logits = model.decode(prompt)[0]
    t1 = time.perf_counter()
    for _ in range(tokens):
        logits = model.decode([int(np.argmax(logits))])[0]
    t2 = time.perf_counter()
    return len(prompt) / (t1 - t0), tokens / (t2 - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--settings", nargs="+", default=["new", "old", "fast-flash"], choices=list(SETTINGS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    import llama_cpp

    from tandem.daemon.worker.llama_model import LlamaModel

    path = model_path(args.model)
    models = {}
    for name in args.settings:
        models[name] = LlamaModel(path, n_ctx=args.prompt + args.tokens + 16, **SETTINGS[name])
    first = next(iter(models.values()))
    base = first.tokenize(TEXT * 64, add_special=True)
    prompt = base[: args.prompt]
    for m in models.values():  # warm up
        one_round(m, prompt[:64], 4)
    prefill = {n: [] for n in models}
    decode = {n: [] for n in models}
    for r in range(args.rounds):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for name in order:
            p, d = one_round(models[name], prompt, args.tokens)
            prefill[name].append(p)
            decode[name].append(d)
    print(llama_cpp.llama_print_system_info().decode().strip())
    print(f"{path.name}: {args.prompt}-token prefill, {args.tokens} one-token steps, {args.rounds} alternating rounds")
    print("| setting | extra buffers | prefill tok/s | decode tok/s | prefill vs old | decode vs old |")
    print("|---|---|---|---|---|---|")
    ref = "old" if "old" in models else args.settings[0]
    for name, m in models.items():
        rp = [a / b for a, b in zip(prefill[name], prefill[ref])]
        rd = [a / b for a, b in zip(decode[name], decode[ref])]
        print(
            f"| {name} | {'on' if m.extra_buffers else 'off'} | {fmt(prefill[name], 1)} | {fmt(decode[name], 1)} "
            f"| {fmt(rp)} | {fmt(rd)} |"
        )
    print(
        f"(ratios per round against '{ref}'; median (min–max); median decode of all: "
        f"{statistics.median(v for d in decode.values() for v in d):.1f} tok/s)"
    )


if __name__ == "__main__":
    main()
