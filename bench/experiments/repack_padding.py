"""Can repacked weights keep output exact if every pass is padded to a multiple of 4 rows?

    python -m bench.experiments.repack_padding [--model qwen2.5-coder-1.5b]

llama.cpp's repacked Q4_K weights (``--extra-buffers on``) multiply 4 rows at a
time (gemm) and a leftover row alone (gemv), which round differently, so a
one-token step disagrees with a verify or jump-forward pass over several tokens
(docs/exact-output.md). The idea tried here: pad every pass with junk tokens
after the real ones to a multiple of 4 rows (then drop their KV), so every row
goes through the gemm. For 20 positions after a 70-token prompt (read with fast
prefill chunks, steps with the reference kernels, as the daemon does), it
compares the logits of each position computed as (a) a one-row step, (b) a step
padded to 4 rows, (c) a 5-token verify pass padded to 8, (d) the same unpadded,
(e) an 8-token pass; with extra buffers off and on, with the time per step.

Measured 2026-12-02 on the 2-core EPYC (AVX-512), Qwen2.5-Coder-1.5B Q4_K_M:
without extra buffers every shape agrees bit for bit (20/20), a step takes
33.6 ms and a padded one 87.3 ms; with them a step takes 28.1 ms, a padded one
64.2 ms, and padded passes agree with padded steps in only 5 (c) and 1 (e) of
20 positions: padding neither keeps repacked output exact nor pays.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tandem.daemon import models
from tandem.daemon.worker.llama_model import LlamaModel


class Probe:
    def __init__(self, path, extra_buffers: bool):
        self.m = LlamaModel(path, n_ctx=512, extra_buffers=extra_buffers, fast_prefill=True)
        code = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
        toks = self.m.tokenize(code * 3, add_special=True)[:90]
        self.base, self.rest = toks[:70], toks[70:90]

    def fresh(self) -> None:
        self.m.clear()
        self.m.prefill(self.base)

    def padded(self, seq, multiple: int = 4) -> list[int]:
        return list(seq) + [self.rest[0]] * ((-len(seq)) % multiple)

    def steps(self, pad_rows: bool) -> tuple[list, float]:
        m = self.m
        self.fresh()
        out, started = [], time.perf_counter()
        for t in self.rest:
            n0 = m.n_past
            out.append(m.decode(self.padded([t]) if pad_rows else [t], logits_for=[0])[0].copy())
            m.truncate(n0 + 1)
        return out, (time.perf_counter() - started) / len(self.rest)

    def passes(self, width: int, pad_rows: bool) -> list:
        m = self.m
        self.fresh()
        out, i = [], 0
        while i < len(self.rest):
            seq = self.rest[i : i + width]
            n0 = m.n_past
            rows = m.decode(self.padded(seq) if pad_rows else seq, logits_for=list(range(len(seq))))
            out += [r.copy() for r in rows]
            m.truncate(n0 + len(seq))
            i += len(seq)
        return out


def same(x, y) -> int:
    return sum(np.array_equal(p, q) for p, q in zip(x, y))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    args = ap.parse_args()
    path = models.pull(args.model)
    for extra_buffers in (False, True):
        p = Probe(path, extra_buffers)
        a, ta = p.steps(False)
        b, tb = p.steps(True)
        c, d, e = p.passes(5, True), p.passes(5, False), p.passes(8, True)
        n = len(p.rest)
        on = "on" if extra_buffers else "off"
        print(f"extra buffers {on}: step {ta * 1000:.1f} ms, padded step {tb * 1000:.1f} ms")
        print(f"  (b) padded step = (a) step: {same(b, a)}/{n}")
        print(f"  (c) 5-token pass padded to 8 = (b): {same(c, b)}/{n}, = (a): {same(c, a)}/{n}")
        print(f"  (d) 5-token pass unpadded = (a): {same(d, a)}/{n}")
        print(f"  (e) 8-token pass = (b): {same(e, b)}/{n}")
        p.m.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
