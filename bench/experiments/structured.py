"""JSON extraction with a schema: what constraining costs, and what jump-forward and drafting give back.

Side by side in one run, on the extraction corpus (bench/corpus/extraction.json),
greedy, the same chat prompt for every system:

- unconstrained: the same request without response_format (tandem, --jump-forward off), so the
  prompts are identical and only the constraint differs;
- constrained: response_format json_schema, every token sampled one by one (--jump-forward off);
- constrained + jump-forward: grammar-forced tokens verified as drafts (the default);
- constrained + jump-forward + n-gram drafter (--drafter ngram);
- llama-server with the same response_format, where it is built (bench/build_llama_server.sh);
- tool-call-shaped output: the same prompts as a tool call (``tools`` with the schema as its
  parameters, ``tool_choice`` required), with and without jump-forward, and llama-server's own
  tool calls (``--jinja``) on the same request.

Reported per system: decode tok/s and time to first token (median and range
over the runs; each run's figure is the median over the prompts), and how many
outputs validate against their schema (jsonschema).

    python -m bench.experiments.structured [--model qwen2.5-coder-1.5b] [--runs 3] [--prompts 6] [--llama-server PATH]
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
from pathlib import Path

import jsonschema

from bench.common import fmt, model_path, start_daemon, temp_socket
from bench.prefix_cache import LlamaServer
from tandem.client import Client

CORPUS = json.loads((Path(__file__).resolve().parents[1] / "corpus" / "extraction.json").read_text())
SYSTEM = "Extract the facts from the user's text as one JSON object."
DEFAULT_LLAMA_SERVER = Path.home() / ".cache" / "tandem" / "llama-server" / "b11434" / "bin" / "llama-server"


def request(item: dict, constrained: bool) -> tuple[list[dict], dict | None]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": item["text"]}]
    rf = {"type": "json_schema", "json_schema": {"name": "facts", "schema": item["schema"], "strict": True}}
    return messages, rf if constrained else None


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def tandem_one(socket: Path, item: dict, constrained: bool, max_tokens: int) -> tuple[float, float, bool, int]:
    messages, rf = request(item, constrained)
    with Client(socket) as c:
        done = c.complete(messages=messages, response_format=rf, temperature=0.0, max_tokens=max_tokens)
    forced = done.draft.forced if done.draft is not None else 0
    t = done.timings
    return t.tokens_per_second, t.time_to_first_token_seconds, valid(done.text, item["schema"]), forced


def tool_request(item: dict) -> dict:
    """The extraction as one tool call: the schema is the tool's parameters."""
    tool = {
        "type": "function",
        "function": {"name": "record_facts", "description": SYSTEM, "parameters": item["schema"]},
    }
    messages = [{"role": "user", "content": item["text"]}]
    return {"messages": messages, "tools": [tool], "tool_choice": "required", "parallel_tool_calls": False}


def tandem_tool(socket: Path, item: dict, max_tokens: int) -> tuple[float, float, bool, int]:
    with Client(socket) as c:
        done = c.complete(**tool_request(item), temperature=0.0, max_tokens=max_tokens)
    calls = done.tool_calls
    ok = len(calls) == 1 and valid(calls[0].function.arguments, item["schema"])
    t = done.timings
    return t.tokens_per_second, t.time_to_first_token_seconds, ok, done.draft.forced if done.draft else 0


def server_one(server: LlamaServer, item: dict, max_tokens: int, tools: bool = False) -> tuple[float, float, bool, int]:
    messages, rf = request(item, True)
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "response_format": rf}
    if tools:
        body = {**tool_request(item), "max_tokens": max_tokens, "temperature": 0.0}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    reply = json.loads(conn.getresponse().read())
    conn.close()
    t = reply.get("timings", {})
    message = reply["choices"][0]["message"]
    text = message.get("content") or ""
    if tools:
        calls = message.get("tool_calls") or []
        text = calls[0]["function"]["arguments"] if len(calls) == 1 else ""
    ttft = t.get("prompt_ms", 0.0) / 1000 + (
        1000 / t["predicted_per_second"] / 1000 if t.get("predicted_per_second") else 0
    )
    return t.get("predicted_per_second", 0.0), ttft, valid(text, item["schema"]), 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=6, help="the first N prompts of the corpus")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--ctx-size", type=int, default=2048)
    ap.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA_SERVER)
    args = ap.parse_args()
    model = model_path(args.model)
    items = CORPUS[: args.prompts]
    base = ("--model", str(model), "--ctx-size", str(args.ctx_size), "--cache-bytes", "0")
    daemons = {
        "plain": (temp_socket("tdm-bs-"), (*base, "--jump-forward", "off")),
        "jump-forward": (temp_socket("tdm-bs-"), base),
        "jump-forward + ngram": (temp_socket("tdm-bs-"), (*base, "--drafter", "ngram")),
    }
    procs = [start_daemon(sock, *flags) for sock, flags in daemons.values()]
    systems = {
        "unconstrained": lambda it: tandem_one(daemons["plain"][0], it, False, args.max_tokens),
        "constrained": lambda it: tandem_one(daemons["plain"][0], it, True, args.max_tokens),
        "constrained + jump-forward": lambda it: tandem_one(daemons["jump-forward"][0], it, True, args.max_tokens),
        "constrained + jump-forward + ngram": lambda it: tandem_one(
            daemons["jump-forward + ngram"][0], it, True, args.max_tokens
        ),
        "tool call": lambda it: tandem_tool(daemons["plain"][0], it, args.max_tokens),
        "tool call + jump-forward": lambda it: tandem_tool(daemons["jump-forward"][0], it, args.max_tokens),
    }
    server = None
    if args.llama_server.exists():
        import os

        server = LlamaServer(args.llama_server, model, args.ctx_size, os.cpu_count() or 1, True, ("--jinja",))
        systems["llama-server json_schema"] = lambda it: server_one(server, it, args.max_tokens)
        systems["llama-server tool call"] = lambda it: server_one(server, it, args.max_tokens, tools=True)
    results = {name: {"tps": [], "ttft": [], "valid": 0, "forced": 0, "n": 0} for name in systems}
    try:
        for item in items:  # warm up each system once
            for fn in systems.values():
                fn(item)
            break
        for run in range(args.runs):
            for name, fn in systems.items():
                tps, ttft = [], []
                for item in items:
                    s, t, ok, forced = fn(item)
                    tps.append(s)
                    ttft.append(t)
                    r = results[name]
                    r["valid"] += ok
                    r["forced"] += forced
                    r["n"] += 1
                results[name]["tps"].append(statistics.median(tps))
                results[name]["ttft"].append(statistics.median(ttft))
            print(f"run {run + 1}/{args.runs} done", file=sys.stderr)
    finally:
        for p in procs:
            p.terminate()
        if server is not None:
            server.proc.terminate()
    base_tps = statistics.median(results["unconstrained"]["tps"])
    print(f"\n{args.model}, {len(items)} prompts, {args.runs} runs, greedy, max_tokens {args.max_tokens}\n")
    print("| system | decode tok/s | × unconstrained | TTFT s | valid | forced tokens/request |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        ratio = statistics.median(r["tps"]) / base_tps if base_tps else 0
        forced = r["forced"] / r["n"] if r["n"] else 0
        cells = [name, fmt(r["tps"], 1), f"{ratio:.2f}", fmt(r["ttft"], 3), f"{r['valid']}/{r['n']}", f"{forced:.1f}"]
        print("| " + " | ".join(cells) + " |")
    tool_base = statistics.median(results["tool call"]["tps"])
    for name in ("tool call + jump-forward", "llama-server tool call"):
        if name in results and tool_base:
            ratio = statistics.median(results[name]["tps"]) / tool_base
            print(f"\n{name}: {ratio:.2f}x the same tool calls sampled one by one (tandem, --jump-forward off)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
