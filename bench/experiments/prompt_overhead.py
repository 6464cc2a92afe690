"""What the daemon adds to reading a new prompt: its prompt time against the same
worker code's prefill in-process.

Each round sends the daemon (no drafter, as a user starts it) a chat prompt it
has not seen, then reads a token list of the same length with
``LlamaModel.prefill`` in this process (the code the target worker runs, the
same defaults: mixed kernels, repacked weights where llama.cpp has them),
alternating, each once the daemon is idle. The daemon's figure is its
``prompt_seconds`` (tokenizing, the chat template, the prefix cache's lookup
and the prefill); the ratio near 1.0 means a TTFT gap to another server is in
llama.cpp's kernels, not in tandem.

    python -m bench.experiments.prompt_overhead [--model qwen2.5-coder-1.5b] [--prompts 6] [--words 60]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench.common import model_path, start_daemon, temp_socket, wait_quiet
from tandem.client import Client
from tandem.daemon.worker.llama_model import LlamaModel

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="preset or .gguf path (default %(default)s)")
    ap.add_argument("--prompts", type=int, default=6, help="rounds, a new prompt each (default %(default)s)")
    ap.add_argument("--words", type=int, default=60, help="words per prompt (default %(default)s: ~250 tokens)")
    args = ap.parse_args()
    if args.prompts < 1:
        ap.error("--prompts: at least 1")
    path = model_path(args.model)
    sock = temp_socket("tdm-prompt-")
    proc = start_daemon(sock, "--model", str(path), "--ctx-size", "4096")
    client = Client(sock)
    model = LlamaModel(path, n_ctx=4096, fast_prefill=True)
    ratios = []
    try:
        print(f"{path.name}; daemon prompt_seconds against in-process LlamaModel.prefill, alternating\n")
        print("| prompt tokens | daemon ms | in-process ms | daemon / in-process |")
        print("|---|---|---|---|")
        for i in range(args.prompts):
            text = " ".join(WORDS[(i * 7 + j) % len(WORDS)] + str(j * (i + 3)) for j in range(args.words))
            wait_quiet([proc.pid])
            done = client.complete(messages=[{"role": "user", "content": text}], max_tokens=1, temperature=0.0)
            n = done.usage.prompt_tokens
            tokens = model.tokenize(f"{text} {text} {text}", add_special=True)[:n]
            model.clear()
            started = time.perf_counter()
            model.prefill(tokens)
            local = time.perf_counter() - started
            ratios.append(done.timings.prompt_seconds / local)
            print(f"| {n} | {done.timings.prompt_seconds * 1000:.0f} | {local * 1000:.0f} | {ratios[-1]:.2f} |")
    finally:
        model.close()
        client.close()
        proc.terminate()
        proc.wait(30)
    print(f"\ndaemon / in-process: median {statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
