"""Which llama.cpp settings make a model's logits independent of the batch shape?

For each model and setting, decode the same text under several schedules and
compare the logits at the same position bit for bit. Each schedule stands for
one of tandem's paths:

- ``prefill``       the whole text in one llama_decode (reference)
- ``page-split``    32 tokens, then the rest: a prefix-cache hit (restore, prefill the rest)
- ``tail-1``        all but the last token, then a one-token step (plain decoding)
- ``verify-5``      all but the last 5, then 5 rows at once (a verify pass at k = 4)
- ``chunks-7``      batches of 7 tokens (a small --batch-size)

at a short context (the KV view below 512 cells) and at a long one (past 512
cells, where llama.cpp's CPU flash attention splits one-token steps across
threads). A setting is batch-invariant for a model when every schedule gives
the reference's logits exactly.

    python -m bench.experiments.batch_invariance [--models smollm2-135m qwen2.5-coder-1.5b ...]
        [--flash on off] [--tiled-mm on off] [--extra-buffers auto off]

Each setting runs in its own process (llama.cpp reads GGML_CPU_TILED_MM once).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from itertools import product
from pathlib import Path

TEXT = (
    "The lighthouse keeper climbed the stairs every evening to light the lamp, counting the steps aloud. "
    'def parse(line):\n    """Split a CSV line into fields."""\n    fields = []\n    for part in line.split(","):\n'
    "        fields.append(part.strip())\n    return fields\n"
)


def schedules(n: int) -> dict[str, list[int]]:
    return {
        "page-split": [32, n - 32],
        "tail-1": [n - 1, 1],
        "verify-5": [n - 5, 5],
        "chunks-7": [7] * (n // 7) + ([n % 7] if n % 7 else []),
    }


def run_one(model_path: str, flash: bool, extra_buffers, lengths: list[int], ref_kernels: bool) -> dict:
    import numpy as np

    from tandem.daemon.worker.llama_model import LlamaModel

    model = LlamaModel(
        model_path,
        n_ctx=1024,
        n_batch=512,
        flash_attn=flash,
        extra_buffers=extra_buffers,
        reference_kernels=ref_kernels,
    )
    base = model.tokenize(TEXT, add_special=True)
    out = {}
    for n in lengths:
        tokens = (base * (n // len(base) + 1))[:n]
        model.clear()
        ref = model.decode(tokens)[0]
        for name, widths in schedules(n).items():
            model.clear()
            at = 0
            for w in widths:
                got = model.decode(tokens[at : at + w], logits_for=range(w))[-1]
                at += w
            diff = float(np.max(np.abs(got - ref)))
            same_top = int(np.argmax(got)) == int(np.argmax(ref))
            out[f"{name}@{n}"] = {
                "identical": bool(np.array_equal(got, ref)),
                "max_abs_diff": diff,
                "same_argmax": same_top,
            }
    model.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
    ap.add_argument("--f16", action="store_true", help="also SmolLM2 F16 (the test target)")
    ap.add_argument("--flash", nargs="+", default=["on", "off"])
    ap.add_argument("--tiled-mm", nargs="+", default=["on", "off"], help="GGML_CPU_TILED_MM (K-quant tiled matmul)")
    ap.add_argument("--extra-buffers", nargs="+", default=["auto"], help="auto, on, off")
    ap.add_argument("--ref-kernels", nargs="+", default=["on", "off"], help="ggml's reference (row-by-row) CPU kernels")
    ap.add_argument("--lengths", nargs="+", type=int, default=[100, 600])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.child:
        spec = json.loads(args.child)
        print(json.dumps(run_one(**spec)))
        return

    from bench.common import model_path
    from tandem.daemon import models

    paths = {m: str(model_path(m)) for m in args.models}
    if args.f16:
        paths["smollm2-135m-f16"] = str(models.derive_f16(model_path("smollm2-135m")))
    import llama_cpp

    print(llama_cpp.llama_print_system_info().decode())
    results = []
    for (name, path), flash, tiled, eb, ref in product(
        paths.items(), args.flash, args.tiled_mm, args.extra_buffers, args.ref_kernels
    ):
        spec = dict(
            model_path=path,
            flash=flash == "on",
            extra_buffers={"auto": None, "on": True, "off": False}[eb],
            lengths=args.lengths,
            ref_kernels=ref == "on",
        )
        env = {**os.environ, "GGML_CPU_TILED_MM": "1" if tiled == "on" else "0"}
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(spec)], env=env, capture_output=True, text=True
        )
        if proc.returncode != 0:
            print(
                f"{name} flash={flash} tiled-mm={tiled} extra-buffers={eb} ref-kernels={ref}: "
                f"FAILED {proc.stderr[-400:]}"
            )
            continue
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        bad = {k: v for k, v in res.items() if not v["identical"]}
        verdict = (
            "INVARIANT"
            if not bad
            else "differs: "
            + ", ".join(
                f"{k} ({v['max_abs_diff']:.3g}{'' if v['same_argmax'] else ', argmax changed'})" for k, v in bad.items()
            )
        )
        print(
            f"{name:22} flash={flash:3} tiled-mm={tiled:3} extra-buffers={eb:4} ref-kernels={ref:3}: {verdict}",
            flush=True,
        )
        results.append(
            {"model": name, "flash": flash, "tiled_mm": tiled, "extra_buffers": eb, "ref_kernels": ref, "checks": res}
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
