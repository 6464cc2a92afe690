import sys
import tempfile

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from common import fmt, model_path, start_daemon, temp_socket, wait_quiet
from governor import load_all_kinds
from lookup_drafters import run

from tandem.client import Client

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
