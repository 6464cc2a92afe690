"""What a patch to tandem's CPU kernels does to a verify pass: the target's pass
costs over 1..w tokens (the daemon's default setting: repacked weights, a pass's
rows in one llama_decode, exact) with the kernels built from this tree's patch,
from an earlier revision's (``--before REV``: git show REV:daemon/kernels/ggml_cpu.patch,
built into its own directory of the kernels cache, about a minute the first time)
and llama.cpp's own, each in its own process (one process holds one CPU backend),
alternating rounds. Prints ms per pass, median (min-max), and the same in one-token
steps of that build: what a fully accepted drafting round of w tokens costs.

    python -m bench.experiments.kernel_rows --before 541d734 [--model qwen2.5-coder-1.5b] [--rounds 3]

Each build's own tests of exactness are tests/daemon/test_kernels.py and the daemon's load probe; this only
times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import fmt, model_path
from tandem.daemon import kernels

# one process per build and round: load the library as a worker does, then time passes
CHILD = """
import json, sys
from pathlib import Path
from tandem.daemon import kernels
lib = sys.argv[1]
if lib != "off":
    kernels.built = lambda: Path(lib)
    assert kernels.preload("on") is not None
from tandem.daemon.drafting.governor import measure_pass_costs
from tandem.daemon.worker.llama_model import LlamaModel
widths = [int(w) for w in sys.argv[3].split(",")]
model = LlamaModel(sys.argv[2], n_ctx=max(512, int(sys.argv[4]) + max(widths) + 64), fast_prefill=True,
                   extra_buffers=True)
costs = measure_pass_costs(model, widths, reps=int(sys.argv[5]), prefix=int(sys.argv[4]))
ms = {w: s * 1000 for w, s in costs.items()}
print(json.dumps({"in_use": kernels.in_use(), "step_rows": model.step_rows, "ms": ms}))
"""


def build_at(rev: str) -> Path:
    """tandem's kernels built from the patch of git revision ``rev`` (kept in the kernels cache, by its key)."""
    text = subprocess.run(
        ["git", "show", f"{rev}:daemon/kernels/ggml_cpu.patch"], capture_output=True, text=True, check=True
    ).stdout
    with tempfile.TemporaryDirectory() as tmp:
        patch = Path(tmp) / "ggml_cpu.patch"
        patch.write_text(text)
        kept = kernels.PATCH
        kernels.PATCH = patch
        try:
            return kernels.built() or kernels.build(say=lambda line: print(f"[{rev}] {line}", file=sys.stderr))
        finally:
            kernels.PATCH = kept


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="preset or .gguf path (default %(default)s)")
    ap.add_argument("--before", metavar="REV", help="also the kernels of this git revision's patch")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default %(default)s)")
    ap.add_argument("--reps", type=int, default=4, help="passes of each width a round; their median counts")
    ap.add_argument("--widths", default="1,2,3,4,5,8,12,16")
    ap.add_argument("--context", type=int, default=64, help="tokens read before each pass (default %(default)s)")
    args = ap.parse_args()
    widths = sorted({1, *(int(w) for w in args.widths.split(","))})
    path = model_path(args.model)
    builds = {"this tree": kernels.built() or kernels.build(say=lambda line: print(line, file=sys.stderr))}
    if args.before:
        builds[f"patch of {args.before}"] = build_at(args.before)
    builds["llama.cpp's own"] = "off"
    costs: dict[str, dict[int, list[float]]] = {name: {w: [] for w in widths} for name in builds}
    names: dict[str, str] = {}
    for r in range(args.rounds):
        for name in builds if r % 2 == 0 else reversed(builds):
            done = subprocess.run(
                [sys.executable, "-c", CHILD, str(builds[name]), str(path), ",".join(map(str, widths)),
                 str(args.context), str(args.reps)],
                capture_output=True, text=True, timeout=1800,
            )  # fmt: skip
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            out = json.loads(done.stdout.strip().splitlines()[-1])
            names[name] = out["in_use"] + (f", steps cut into passes of {out['step_rows']}" if out["step_rows"] else "")
            for w, ms in out["ms"].items():
                costs[name][int(w)].append(ms)
    print(
        f"{path.name}; {args.context} tokens read before each pass; {args.rounds} alternating rounds of "
        f"{args.reps} passes a width; the daemon's default setting (repacked weights); ms per pass, median (min-max)\n"
    )
    print("| kernels | " + " | ".join(f"{w} token(s)" for w in widths) + " |")
    print("|---|" + "---|" * len(widths))
    for name in builds:
        print(f"| {name} ({names[name]}) | " + " | ".join(fmt(costs[name][w], 1) for w in widths) + " |")
    print("\nthe same in one-token steps of the same kernels (median / median): a fully accepted round's cost\n")
    print("| kernels | " + " | ".join(f"w={w}" for w in widths) + " |")
    print("|---|" + "---|" * len(widths))
    for name in builds:
        one = statistics.median(costs[name][1])
        print(f"| {name} | " + " | ".join(f"{statistics.median(costs[name][w]) / one:.2f}" for w in widths) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
