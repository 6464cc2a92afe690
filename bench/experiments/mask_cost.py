"""What a grammar's mask costs per token, against one decoding step of the model.

The target worker computes each mask (llguidance) before the target's pass
rather than while llama.cpp decodes; this shows that is negligible. It walks
the extraction corpus's JSON Schemas, taking a random allowed token at each
step (so string bodies, numbers and keys are all visited), times every mask,
and times one-token decoding steps of the same model.

    python -m bench.experiments.mask_cost [--model qwen2.5-coder-1.5b] [--schemas 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from bench.common import model_path
from tandem.daemon.constraints.constraint import Grammars
from tandem.daemon.worker.llama_model import LlamaModel
from tandem.protocol import ResponseFormat

CORPUS = json.loads((Path(__file__).resolve().parents[1] / "corpus" / "extraction.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--schemas", type=int, default=6)
    args = ap.parse_args()
    model = LlamaModel(model_path(args.model), n_ctx=512)
    grammars = Grammars(model)
    grammars.tokenizer()
    mask_us: list[float] = []
    rng = np.random.default_rng(0)
    for item in CORPUS[: args.schemas]:
        c = grammars.compile(ResponseFormat("json_schema", json_schema={"name": "x", "schema": item["schema"]}))
        for _ in range(60):
            if c.stopped:
                break
            started = time.perf_counter()
            allowed = c.allowed()
            mask_us.append((time.perf_counter() - started) * 1e6)
            ids = np.flatnonzero(allowed)
            if not len(ids):
                break
            c.consume(int(rng.choice(ids)))
    model.clear()
    model.decode(model.tokenize("Hello, my name is", add_special=True))
    token = model.tokenize(" a", add_special=False)[0]
    step_ms: list[float] = []
    for _ in range(20):
        started = time.perf_counter()
        model.decode([token])
        step_ms.append((time.perf_counter() - started) * 1e3)
    mask, step = statistics.median(mask_us), statistics.median(step_ms)
    print(f"{args.model}: {len(mask_us)} masks over {args.schemas} schemas")
    print(f"mask: median {mask:.0f} us, p90 {np.percentile(mask_us, 90):.0f} us, max {max(mask_us):.0f} us")
    print(f"one-token decoding step: median {step:.1f} ms ({min(step_ms):.1f}-{max(step_ms):.1f})")
    p90 = float(np.percentile(mask_us, 90))
    print(f"median mask / median step: {mask / 1e3 / step:.2%}; p90 mask / step: {p90 / 1e3 / step:.2%}")


if __name__ == "__main__":
    main()
