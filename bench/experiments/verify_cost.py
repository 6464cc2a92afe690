"""What repacked weights do to a verify pass: the target's pass costs over 1..k+1
tokens with extra buffers on (steps split into passes of at most 3 rows, as the
daemon runs them), off, and on with a pass's rows in one llama_decode (as
``--kernels fast`` runs them, not exact), side by side in one process,
alternating rounds. A fourth setting, extra buffers off with the fast kernels and a
pass's rows in one llama_decode (``--kernels fast --extra-buffers off``, not exact),
shows llama.cpp's tiled K-quant kernel, which takes over from 8 rows; both
one-pass settings make passes of 16-32 rows cost much less than their rows' steps.

With repacking a one-token step is faster (Q4_K's repacked one-row kernel), but
every row of a verify pass goes through that one-row kernel, so a pass over
k+1 tokens costs about k+1 steps and drafting pays less. This prints both
settings' median (min-max) per width and what a round of ``w`` tokens that are
all accepted would give per token, against the same setting's one-token step.

    python -m bench.experiments.verify_cost [--model qwen2.5-coder-1.5b] [--rounds 3] [--widths 1,2,3,5,8]
    python -m bench.experiments.verify_cost --widths 1,2,3,5,8,12,16,24,32   # where the tiled kernel takes over
    python -m bench.experiments.verify_cost --kernel-patch off   # llama.cpp's own kernels (default: tandem's)

With tandem's CPU kernels (daemon/kernels) the daemon's setting is one pass whose rows each go through the
one-row kernel, the weights read once a pass: the first row of the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from bench.common import fmt, model_path
from tandem.daemon import kernels


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="preset or .gguf path (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default %(default)s)")
    ap.add_argument("--widths", type=lambda s: [int(w) for w in s.split(",")], default=[1, 2, 3, 5, 8])
    ap.add_argument(
        "--context",
        type=int,
        default=64,
        help="tokens already read before each pass (default %(default)s; the edit task's prompts are ~2,500: "
        "attention over them is shared by a pass's rows)",
    )
    ap.add_argument(
        "--kernel-patch",
        choices=("auto", "off"),
        default="auto",
        help="tandem's CPU kernels where built (auto, as a daemon runs them) or llama.cpp's own (off); one "
        "process holds one of them: run it once with each to compare",
    )
    args = ap.parse_args()
    kernels.preload(args.kernel_patch)  # before llama.cpp is loaded, as a worker does
    from tandem.daemon.drafting.governor import measure_pass_costs
    from tandem.daemon.worker.llama_load import cpu_has_amx
    from tandem.daemon.worker.llama_model import LlamaModel

    args.widths = sorted({1, *args.widths})  # (one token: what the others are compared with)
    if cpu_has_amx():
        print("this CPU has AMX: extra buffers stay off there (llama.cpp's AMX buffers crash); nothing to compare")
        return 0
    path = model_path(args.model)
    n_ctx = max(512, args.context + max(args.widths) + 64)
    exact = LlamaModel(path, n_ctx=n_ctx, fast_prefill=True, extra_buffers=True)
    # (with tandem's kernels the daemon's passes are one llama_decode whose rows go through the one-row kernel)
    repacked = f"repacked ({exact.step_rows}-row passes)" if exact.step_rows else "repacked (one pass, rows as steps)"
    if not exact.repacked:  # (a model with no type llama.cpp repacks, or a CPU with AMX: nothing is)
        repacked = "repacked (nothing to repack: one pass)"
    models = {
        repacked: exact,
        "not repacked": LlamaModel(path, n_ctx=n_ctx, fast_prefill=True, extra_buffers=False),
        # --kernels fast: repacked, a pass's rows in one llama_decode (4-row tiles: not exact, see Exact output)
        "repacked, one pass (--kernels fast)": LlamaModel(
            path, n_ctx=n_ctx, reference_kernels=False, extra_buffers=True
        ),
        # --kernels fast --extra-buffers off: K-quant rows tiled from 8 a pass (not exact either)
        "not repacked, one pass (--kernels fast --extra-buffers off)": LlamaModel(
            path, n_ctx=n_ctx, reference_kernels=False, extra_buffers=False
        ),
    }
    costs: dict[str, dict[int, list[float]]] = {name: {w: [] for w in args.widths} for name in models}
    try:
        for r in range(args.rounds):
            order = list(models) if r % 2 == 0 else list(reversed(models))
            for name in order:
                for w, seconds in measure_pass_costs(models[name], args.widths, reps=8, prefix=args.context).items():
                    costs[name][w].append(seconds * 1000)
    finally:
        for m in models.values():
            m.close()
    print(
        f"{path.name}; CPU kernels: {kernels.in_use()}; {args.context} tokens read before each pass; "
        f"{args.rounds} alternating rounds; "
        "ms per pass, median (min-max)\n"
    )
    print("| setting | " + " | ".join(f"{w} token(s)" for w in args.widths) + " | step ratio |")
    print("|---|" + "---|" * (len(args.widths) + 1))
    one = {name: statistics.median(costs[name][1]) for name in models}
    for name in models:
        cells = [fmt(costs[name][w], 1) for w in args.widths]
        print(f"| {name} | " + " | ".join(cells) + f" | {one[name] / one['not repacked']:.2f} |")
    print("\nms per token when a pass's tokens are all accepted (w tokens per pass of width w):\n")
    print("| setting | " + " | ".join(f"w={w}" for w in args.widths) + " |")
    print("|---|" + "---|" * len(args.widths))
    for name in models:
        per = [statistics.median(costs[name][w]) / w for w in args.widths]
        print(f"| {name} | " + " | ".join(f"{p:.1f}" for p in per) + " |")
    default = next(iter(models))
    print(f"\nthe same as a speedup over {default}'s one-token step (what plain decoding costs by default):\n")
    print("| setting | " + " | ".join(f"w={w}" for w in args.widths) + " |")
    print("|---|" + "---|" * len(args.widths))
    for name in models:
        per = [one[default] * w / statistics.median(costs[name][w]) for w in args.widths]
        print(f"| {name} | " + " | ".join(f"{p:.2f}" for p in per) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
