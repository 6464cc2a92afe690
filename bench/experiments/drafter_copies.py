"""What a drafter's copy (``--drafter-quantize``) keeps and what it saves: for the drafter file
as given and each copy, how often the target's greedy token is the drafter's greedy guess
(teacher-forced: the drafter reads the target's own output), and what a drafter step costs,
loaded as the daemon loads a drafter (reference kernels, weights repacked where llama.cpp
repacks them) and as it was loaded before 2026-12-07 (not repacked).

    python -m bench.experiments.drafter_copies      # Qwen2.5-Coder-1.5B, its 0.5B as the drafter

Prompts: two of each kind (code, edit, story, agent) from the governor's corpus, in Qwen's
ChatML; the target's 96 greedy tokens are produced with tandem's kernels (``LlamaModel``).
Agreement is the share of those tokens the drafter would have guessed given the ones before
(its acceptance at one draft a round; a round of k drafts keeps a run of them).
Each model is loaded in a child process of its own, one after the other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import model_path
from bench.governor import load_all_kinds

KINDS = ("code", "edit", "story", "agent")
SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def chatml(messages: list[dict]) -> str:
    text = "" if messages[0]["role"] == "system" else f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
    for m in messages:
        text += f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
    return text + "<|im_start|>assistant\n"


def child(job: dict) -> dict:
    """In a process of its own: load one model and do ``job``."""
    from tandem.daemon import kernels

    kernels.preload("auto")
    import numpy as np

    from tandem.daemon.worker.llama_model import LlamaModel

    if job["do"] == "generate":  # the target as the daemon runs it (--kernels mixed)
        model = LlamaModel(job["path"], n_ctx=8192, fast_prefill=True)
        outs = []
        for text in job["prompts"]:
            model.clear()
            prompt = model.tokenize(text, add_special=False, parse_special=True)
            logits = model.prefill(prompt)
            out: list[int] = []
            while len(out) < job["tokens"]:
                token = int(np.argmax(logits))
                out.append(token)
                if model.is_eog(token):
                    break
                logits = model.decode([token])[0]
            outs.append((prompt, out))
        return {"outs": outs}
    model = LlamaModel(job["path"], n_ctx=8192, reference_kernels=True, extra_buffers=job["repack"])
    agree = {}
    model.use_reference(False)  # (faster; the agreement hardly depends on how the drafter's KV rounds)
    for kind, (prompt, out) in zip(job["kinds"], job["outs"]):
        model.clear()
        rows = model.decode(prompt + out, logits_for=range(len(prompt) - 1, len(prompt) + len(out) - 1))
        hits = int(sum(int(np.argmax(row)) == t for row, t in zip(rows, out)))
        a = agree.setdefault(kind, [0, 0])
        a[0] += hits
        a[1] += len(out)
    model.clear()
    model.decode(job["outs"][0][0])
    model.use_reference(True)  # (its steps, the reference kernels)
    steps = []
    for token in job["outs"][0][1][:30]:
        started = time.perf_counter()
        model.decode([token])
        steps.append(time.perf_counter() - started)
    return {"agree": agree, "step_ms": 1000 * statistics.median(steps)}


def run_child(job: dict) -> dict:
    with tempfile.NamedTemporaryFile("w+", suffix=".json") as f:
        json.dump(job, f)
        f.flush()
        out = subprocess.run(
            [sys.executable, "-m", "bench.experiments.drafter_copies", "--child", f.name],
            capture_output=True,
            text=True,
            check=True,
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--drafter", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=2, help="prompts per kind")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(Path(args.child).read_text()))))
        return 0
    from tandem.daemon import models
    from tandem.daemon.models.gguf_meta import weight_profile

    corpus = load_all_kinds(agent=True)
    kinds = [k for k in KINDS for _ in corpus[k][: args.prompts]]
    prompts = [chatml(m) for k in KINDS for m in corpus[k][: args.prompts]]
    target, drafter = model_path(args.target), model_path(args.drafter)
    files = {"as given": drafter, "Q4_0 copy": models.derive(drafter, "Q4_0", progress=print)}
    outs = run_child({"do": "generate", "path": str(target), "prompts": prompts, "tokens": args.tokens})["outs"]
    print(f"target {target.name}; {len(prompts)} prompts, {args.tokens} greedy tokens each\n")
    print("| drafter | bits/weight | " + " | ".join(f"agreement {k}" for k in KINDS) + " | step ms, repacked | not |")
    print("|---|---|" + "---|" * len(KINDS) + "---|---|")
    for name, path in files.items():
        res = {
            repack: run_child({"do": "agree", "path": str(path), "kinds": kinds, "outs": outs, "repack": repack})
            for repack in (True, False)
        }
        agree = res[True]["agree"]
        cells = [f"{agree[k][0] / agree[k][1]:.2f}" for k in KINDS]
        print(
            f"| {name} ({path.name}) | {weight_profile(path)[1]:.2f} | "
            + " | ".join(cells)
            + f" | {res[True]['step_ms']:.1f} | {res[False]['step_ms']:.1f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
