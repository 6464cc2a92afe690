"""Prompt reading against llama-server at two pass sizes: is tandem's prefill gap its pass size?

    python -m bench.experiments.prefill_pass                  # Qwen2.5-Coder-0.5B, 4k prompts, 4 runs
    python -m bench.experiments.prefill_pass --size 16384 --runs 3 --ubatch 256 512

tandem reads a prompt in passes of up to 256 tokens (whole 64-token chunks, ``PREFILL_GROUP``),
llama-server in passes of ``-ub`` tokens (512 by default). Here a tandem daemon with its defaults and
one llama-server (vendored llama.cpp) per ``--ubatch`` stay resident together; each run sends every
system a new prompt (Claude Code's recorded request with this repository's files up to ``--size``
tokens, salted, cache off, as ``bench.long_context``), the order turned each run. Prefill tok/s is
prompt tokens / TTFT; the ratios are to llama-server at its default pass (512) in the same run.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Optional

import psutil

from bench.common import model_path
from bench.long_context import agent_prompts, med, run_systems, say, write_report


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--size", type=int, default=4096, help="prompt tokens (default 4096)")
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--ubatch", type=int, nargs="+", default=[256, 512], help="llama-server passes (-ub)")
    ap.add_argument("--threads", type=int, default=psutil.cpu_count() or 1, help="llama-server's (tandem: all cores)")
    ap.add_argument("--out", type=Path, default=None, help="write REPORT.md and results.json there")
    args = ap.parse_args(argv)
    if 512 not in args.ubatch:
        ap.error("--ubatch must include 512: the ratios are to llama-server's default pass")
    path = model_path(args.model)
    names = ["tandem"] + [f"llama-server -ub {ub}" for ub in args.ubatch]
    prompts = agent_prompts(path, [args.size], args.runs)
    rows = run_systems(names, path, [args.size], args.runs, 16, args.threads, prompts)
    peer = {r["run"]: r["prefill"] for r in rows if r["system"] == "llama-server -ub 512"}
    lines = [
        f"# Prefill by pass size: {Path(path).name}, {args.size}-token prompts, {args.runs} runs",
        "",
        "    python -m bench.experiments.prefill_pass " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "",
        "| system | prefill tok/s | / llama-server -ub 512 |",
        "|---|---|---|",
    ]
    for name in names:
        mine = [r for r in rows if r["system"] == name]
        ratio = [r["prefill"] / peer[r["run"]] for r in mine if r["run"] in peer]
        lines.append(f"| {name} | {med([r['prefill'] for r in mine], 1)} | {med(ratio)} |")
    print("\n".join(lines))
    if args.out is not None:
        say(f"report: {write_report(args.out, rows, lines)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
