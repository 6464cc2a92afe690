"""Plain greedy decoding through the daemon vs the same model in-process.

What the socket and the process boundary cost. For each prompt and run, in
alternating order (this machine is shared and noisy, so only ratios taken side
by side mean anything):

- daemon:    tandem.client.Client -> Unix socket -> daemon -> worker process
- llama-cpp: llama_cpp.Llama.create_completion in this process (what a user
             would otherwise write)
- bare:      a bare llama_decode + argmax loop in this process (no sampler, no
             detokenization): the floor

Each generates up to --tokens tokens greedily after the same prompt (the
prompts are chosen so the model does not stop early); throughput = generated
tokens / wall time from request to the last token, prefill included. Prints per-run ratios, then medians and ranges.

    python -m bench.experiments.plain_decoding [--model PATH|PRESET] [--runs 5] [--tokens 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

# Short OpenMP spin for the in-process model (as a model drafter's worker has), so neither
# side's idle threads steal the other's cores (FACTS.md).
os.environ.setdefault("GOMP_SPINCOUNT", "10000")

import llama_cpp  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import start_daemon, temp_socket  # noqa: E402
from tandem.client import Client  # noqa: E402
from tandem.daemon import models  # noqa: E402
from tandem.daemon.worker.llama_load import reference_llama  # noqa: E402
from tandem.daemon.worker.llama_model import LlamaModel  # noqa: E402

PROMPTS = [
    "The history of the printing press begins",
    "def merge_sort(items):\n",
    '{"users": [{"name": "Ada", "email": "ada@example.com"},',
]


def run_daemon(client: Client, prompt: str, tokens: int) -> tuple[float, str]:
    t0 = time.perf_counter()
    done = client.complete(prompt=prompt, max_tokens=tokens, temperature=0.0)
    wall = time.perf_counter() - t0
    return done.usage.completion_tokens / wall, done.text


def run_llama(llm: llama_cpp.Llama, prompt: str, tokens: int) -> tuple[float, str]:
    llm.reset()
    t0 = time.perf_counter()
    out = llm.create_completion(prompt, max_tokens=tokens, temperature=0.0)
    wall = time.perf_counter() - t0
    return out["usage"]["completion_tokens"] / wall, out["choices"][0]["text"]


def run_bare(model: LlamaModel, prompt: str, tokens: int) -> float:
    t0 = time.perf_counter()
    model.clear()
    logits = model.prefill(model.tokenize(prompt, add_special=True))
    for _ in range(tokens):
        logits = model.decode([int(np.argmax(logits))])[0]
    return tokens / (time.perf_counter() - t0)


def summary(name: str, values: list[float]) -> str:
    median, low, high = statistics.median(values), min(values), max(values)
    return f"{name:28} median {median:7.3f}   range {low:.3f} – {high:.3f}   (n={len(values)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=models.DEFAULT_MODEL, help="preset or .gguf path (default %(default)s)")
    ap.add_argument("--runs", type=int, default=5, help="runs per prompt and mode (default %(default)s)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per run (default %(default)s)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp threads, both sides")
    args = ap.parse_args()

    if args.model in models.PRESETS:
        models.pull(args.model)
    _, path = models.resolve(args.model)
    n_ctx = 2048
    socket = temp_socket("tdm-bench-")
    daemon = start_daemon(socket, "--model", str(path), "--ctx-size", str(n_ctx), "--threads", str(args.threads))
    llm = reference_llama(path, n_ctx, args.threads)
    # the daemon's target: mixed kernels (fast prefill), extra buffers as its default
    bare = LlamaModel(path, n_ctx=n_ctx, n_threads=args.threads, fast_prefill=True)
    ratios_llama, ratios_bare, tps = [], [], {"daemon": [], "llama-cpp": [], "bare": []}
    identical = 0
    try:
        with Client(socket) as client:
            run_daemon(client, PROMPTS[0], 8)  # warm-up
            run_llama(llm, PROMPTS[0], 8)
            print(
                f"model {path.name}, {args.tokens} tokens per run, {args.threads} threads, cpu count {os.cpu_count()}"
            )
            print(f"{'prompt':>6} {'run':>3} {'daemon':>9} {'llama-cpp':>10} {'bare':>9} {'d/llama':>8} {'d/bare':>7}")
            for pi, prompt in enumerate(PROMPTS):
                for run in range(args.runs):
                    # alternate which goes first, so drift affects both alike
                    if run % 2 == 0:
                        d, dtext = run_daemon(client, prompt, args.tokens)
                        ll, ltext = run_llama(llm, prompt, args.tokens)
                        b = run_bare(bare, prompt, args.tokens)
                    else:
                        b = run_bare(bare, prompt, args.tokens)
                        ll, ltext = run_llama(llm, prompt, args.tokens)
                        d, dtext = run_daemon(client, prompt, args.tokens)
                    identical += dtext == ltext
                    tps["daemon"].append(d)
                    tps["llama-cpp"].append(ll)
                    tps["bare"].append(b)
                    ratios_llama.append(d / ll)
                    ratios_bare.append(d / b)
                    print(f"{pi:>6} {run:>3} {d:9.1f} {ll:10.1f} {b:9.1f} {d / ll:8.3f} {d / b:7.3f}")
    finally:
        daemon.terminate()
        daemon.wait(30)
    print()
    for name, values in tps.items():
        print(summary(f"{name} tok/s", values))
    print(summary("daemon / llama-cpp", ratios_llama))
    print(summary("daemon / bare loop", ratios_bare))
    print(f"daemon output identical to llama-cpp's: {identical} of {len(ratios_llama)} runs")


if __name__ == "__main__":
    main()
