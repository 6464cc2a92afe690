"""The fast kernels (``--kernels fast --exact off``), alone and with the suffix drafter at 16
tokens, on open text: json, support, story and code, against the default daemon.

Three daemons on Qwen2.5-Coder-1.5B: plain (defaults), fast plain, fast suffix k16; 3
prompts per task, 96 tokens, an untimed pass then 3 rotated runs, every request once all
daemons are idle. Prints decode tok/s over plain's (median, range), drafting rounds and how
many outputs equal the default plain daemon's. The same prompts repeat in every run, so the
suffix drafter copies its own earlier answers. Results:
bench/results/2026-12-05-epyc-fast-other/REPORT.md.

    python -m bench.experiments.fast_other
"""

import argparse
import tempfile

from bench.common import fmt, model_path, start_daemon, temp_socket, wait_quiet
from bench.experiments.lookup_drafters import run
from bench.governor import load_all_kinds
from tandem.client import Client


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    target = model_path("qwen2.5-coder-1.5b")
    corpus = load_all_kinds(agent=True)
    common = ("--model", str(target), "--ctx-size", "4096")
    fast = common + ("--kernels", "fast", "--exact", "off")
    cfg = {
        "plain": common,
        "fast plain": fast,
        "fast suffix k16": fast + ("--drafter", "suffix", "--draft-tokens", "16", "--state-dir", tempfile.mkdtemp()),
    }
    socks = {n: temp_socket("tdm-fo-") for n in cfg}
    procs = {n: start_daemon(socks[n], *a) for n, a in cfg.items()}
    try:
        cl = {n: Client(s) for n, s in socks.items()}
        for kind in ("json", "support", "story", "code"):
            prompts = corpus[kind][:3]
            for n in cl:
                run(cl[n], prompts, 96)
            res = {n: [] for n in cl}
            for r in range(3):
                order = list(cl)[r % 3 :] + list(cl)[: r % 3]
                for n in order:
                    wait_quiet([p.pid for p in procs.values()])
                    res[n].append(run(cl[n], prompts, 96))
            p = [x["tps"] for x in res["plain"]]
            out = []
            for n in list(cl)[1:]:
                same = sum(a == b for x, y in zip(res[n], res["plain"]) for a, b in zip(x["ids"], y["ids"]))
                rounds = sum(x["rounds"] for x in res[n])
                out.append(f"{n} {fmt([x['tps'] / q for x, q in zip(res[n], p)])} rounds {rounds} same {same}/9")
            fs = fmt([a["tps"] / b["tps"] for a, b in zip(res["fast suffix k16"], res["fast plain"])])
            print(f"{kind}: plain {fmt(p, 1)} | " + " | ".join(out) + f" | fast suffix / fast plain {fs}", flush=True)
    finally:
        for pr in procs.values():
            pr.terminate()
            pr.wait(30)


if __name__ == "__main__":
    main()
