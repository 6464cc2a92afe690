"""What --kv-type costs: f16 against q8_0 and q4_0 KV caches, side by side in one run.

Per type, a daemon (Qwen2.5-Coder-0.5B by default, the context given, no prefix
cache) reads an agent-sized prompt (Claude Code's recorded system prompt,
about 10k tokens) and decodes after it: time to first token, decode tok/s at
that context, the target worker's resident memory. Then greedy answers to the
corpus (bench/corpus.json): how many are token for token f16's, and where the
others leave it (quality: a quantized cache changes the numbers every layer
reads back).

    python -m bench.experiments.kv_type [--model qwen2.5-coder-0.5b] [--ctx 32768] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench.common import fmt, model_path, start_daemon, temp_socket
from tandem.client import Client

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "tests" / "bridge" / "recorded" / "claude-code-2.1.328-first.json"
CORPUS = json.loads((ROOT / "bench" / "corpus.json").read_text())
TYPES = ("f16", "q8_0", "q4_0")


def agent_prompt() -> list[dict]:
    body = json.loads(RECORDED.read_text())
    body = body.get("body", body)
    system = "\n\n".join(b["text"] for b in body["system"] if isinstance(b, dict))
    tools = json.dumps(body["tools"])
    return [
        {"role": "system", "content": system + "\n\nTools:\n" + tools},
        {"role": "user", "content": "In one sentence: what are you?"},
    ]


def greedy(c: Client, messages: list[dict], n: int) -> list[int]:
    stream = c.generate(messages=messages, max_tokens=n, temperature=0.0, ignore_eos=True, cache=False)
    return [t for chunk in stream for t in chunk.token_ids]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    args = ap.parse_args(argv)
    model = model_path(args.model)
    long_prompt = agent_prompt()
    rows: dict[str, dict] = {}
    answers: dict[str, list[list[int]]] = {}
    for kv in TYPES:
        socket = temp_socket(f"tdm-kv-{kv}-")
        serve = ["--model", str(model), "--ctx-size", str(args.ctx), "--cache-bytes", "0", "--kv-type", kv]
        proc = start_daemon(socket, *serve, "--state-dir", str(socket.parent / "state"), timeout=600)
        try:
            with Client(socket) as c:
                ttft, tps, prompt = [], [], 0
                for _ in range(args.runs):
                    # (cache off: each run reads the whole prompt, not what the model kept from the run before)
                    stream = c.generate(
                        messages=long_prompt, max_tokens=64, temperature=0.0, ignore_eos=True, cache=False
                    )
                    for _chunk in stream:
                        pass
                    ttft.append(stream.done.timings.time_to_first_token_seconds)
                    tps.append(stream.done.timings.tokens_per_second)
                    prompt = stream.done.usage.prompt_tokens
                st = c.status()
                answers[kv] = [greedy(c, m, args.tokens) for prompts in CORPUS.values() for m in prompts]
            rows[kv] = {"ttft": ttft, "tps": tps, "prompt": prompt, "rss": st.memory_rss_bytes.get("target", 0)}
        finally:
            proc.terminate()
            proc.wait(60)
        print(f"{kv}: done", file=sys.stderr, flush=True)
    base = answers["f16"]
    print(f"# --kv-type on {model.name}, context {args.ctx:,}, {args.runs} runs\n")
    print("| type | prompt tokens | TTFT s | decode tok/s | target RSS MiB | answers = f16 | first difference |")
    print("|---|---|---|---|---|---|---|")
    for kv in TYPES:
        r = rows[kv]
        same = sum(a == b for a, b in zip(answers[kv], base))
        firsts = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(answers[kv], base)]
        where = [i for i in firsts if i is not None]
        at = f"token {statistics.median(where):.0f} (median)" if where else "-"
        print(
            f"| {kv} | {r['prompt']:,} | {fmt(r['ttft'])} | {fmt(r['tps'], 1)} | {r['rss'] / 2**20:,.0f} | "
            f"{same}/{len(base)} | {at} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
