"""Inline completion in an editor: repeated fill-in-the-middle (``complete``)
requests on one ~3,000-token file while the cursor moves down it, time to first
token (TTFT) with the prefix cache and without, through the daemon's socket.

Each step the cursor is one line further down (the user wrote a line): the
request sends the file, prefix = the text before the cursor, suffix = the text
after it. In the FIM prompt the suffix follows the prefix
(``<|fim_prefix|> prefix <|fim_suffix|> suffix <|fim_middle|>``), so with the
cache the file up to the previous cursor is restored from pages and the rest
(the new line and the suffix) is prefilled. Two ways an editor sends the file:

- ``whole file``: the full suffix, to the end of the file;
- ``suffix cut``: the suffix cut to ``--suffix-lines`` lines (what editor
  plugins such as Continue send: the cursor's neighbourhood).

Cache on (``cache: true``) and off (``cache: false``) run on one daemon,
alternating which goes first each step, so drift on a shared machine hits both.
The first step of each way starts from an empty cache and is reported apart;
the summary is over the later (warm) steps: median (min–max).

    python -m bench.experiments.fim --model qwen2.5-coder-1.5b --steps 6
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from bench.common import fmt, model_path, start_daemon, temp_socket
from tandem.client import Client

NOUNS = ["order", "invoice", "user", "session", "record", "packet", "event", "metric", "token", "account"]
VERBS = ["parse", "validate", "merge", "render", "load", "store", "filter", "count", "encode", "normalize"]


def python_file(target_chars: int, seed: int = 7) -> str:
    """A plausible Python module: imports, then small functions of a few shapes."""
    rng = random.Random(seed)
    parts = ['"""Helpers for the billing pipeline."""\n\nimport json\nimport re\nfrom dataclasses import dataclass\n']
    i = 0
    while sum(map(len, parts)) < target_chars:
        noun, verb = rng.choice(NOUNS), rng.choice(VERBS)
        name = f"{verb}_{noun}s_{i}"
        shape = i % 3
        if shape == 0:
            parts.append(
                f"\ndef {name}(items, limit={rng.randint(2, 99)}):\n"
                f'    """{verb.capitalize()} up to `limit` {noun}s and return them."""\n'
                f"    result = []\n    for item in items[:limit]:\n"
                f'        if item.get("{noun}_id") is None:\n            continue\n'
                f"        result.append(item)\n    return result\n"
            )
        elif shape == 1:
            parts.append(
                f"\n@dataclass\nclass {noun.capitalize()}{i}:\n    {noun}_id: int\n    name: str\n"
                f"    weight: float = {rng.random():.2f}\n\n    def to_json(self) -> str:\n"
                f'        return json.dumps({{"id": self.{noun}_id, "name": self.name}})\n'
            )
        else:
            parts.append(
                f'\ndef {name}(text):\n    pattern = re.compile(r"{noun}-(\\d+)")\n'
                f"    return [int(m.group(1)) for m in pattern.finditer(text)]\n"
            )
        i += 1
    return "".join(parts)


def ttft(client: Client, prefix: str, suffix: str, cache: bool, max_tokens: int) -> dict:
    started = time.perf_counter()
    stream = client.infill(prefix, suffix, cache=cache, max_tokens=max_tokens)
    first = None
    for chunk in stream:
        if first is None and chunk.token_ids:
            first = time.perf_counter() - started
    done = stream.done
    return dict(
        ttft=first if first is not None else time.perf_counter() - started,
        prompt_tokens=done.usage.prompt_tokens,
        cached_tokens=done.usage.cached_tokens,
        text=done.text,
    )


def run_way(
    client: Client, lines: list[str], start: int, steps: int, suffix_lines: int, max_tokens: int, say
) -> list[dict]:
    client.cache_clear()
    rows = []
    for step in range(steps):
        cursor = start + step
        prefix = "".join(lines[:cursor])
        rest = lines[cursor:]
        suffix = "".join(rest[:suffix_lines] if suffix_lines else rest)
        order = (True, False) if step % 2 == 0 else (False, True)
        got = {cache: ttft(client, prefix, suffix, cache, max_tokens) for cache in order}
        on, off = got[True], got[False]
        row = dict(
            step=step,
            cursor_line=cursor + 1,
            prompt_tokens=on["prompt_tokens"],
            cached_tokens=on["cached_tokens"],
            ttft_cache=on["ttft"],
            ttft_no_cache=off["ttft"],
            same_text=on["text"] == off["text"],
        )
        rows.append(row)
        say(
            f"  step {step}: line {row['cursor_line']}, prompt {row['prompt_tokens']} tok, "
            f"cached {row['cached_tokens']}, "
            f"TTFT {row['ttft_cache']:.2f} s with cache, {row['ttft_no_cache']:.2f} s without"
        )
    return rows


def summary(rows: list[dict]) -> dict:
    warm = rows[1:]
    return dict(
        cold_ttft_cache=rows[0]["ttft_cache"],
        ttft_cache=[r["ttft_cache"] for r in warm],
        ttft_no_cache=[r["ttft_no_cache"] for r in warm],
        speedup=[r["ttft_no_cache"] / r["ttft_cache"] for r in warm],
        cached_share=[r["cached_tokens"] / r["prompt_tokens"] for r in warm],
        prompt_tokens=statistics.median(r["prompt_tokens"] for r in rows),
        identical=sum(r["same_text"] for r in rows),
        steps=len(rows),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default="qwen2.5-coder-1.5b", help="preset or .gguf with FIM tokens (default %(default)s)"
    )
    ap.add_argument(
        "--file-chars", type=int, default=11_000, help="size of the file (default %(default)s: ~3,000 tokens)"
    )
    ap.add_argument("--steps", type=int, default=6, help="cursor positions per way (default %(default)s)")
    ap.add_argument("--suffix-lines", type=int, default=20, help="the cut suffix's lines (default %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per completion (default %(default)s)")
    ap.add_argument("--ctx-size", type=int, default=8192)
    ap.add_argument("--out", type=Path, default=None, help="write the rows and summary as JSON here")
    args = ap.parse_args()

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    path = model_path(args.model)
    lines = python_file(args.file_chars).splitlines(keepends=True)
    start = len(lines) * 2 // 3  # the cursor starts two thirds down the file
    sock = temp_socket("tdm-fim-")
    proc = start_daemon(sock, "--model", str(path), "--ctx-size", str(args.ctx_size))
    results = {}
    try:
        with Client(sock, timeout=None) as client:
            for way, suffix_lines in (
                ("whole file", 0),
                (f"suffix cut to {args.suffix_lines} lines", args.suffix_lines),
            ):
                say(f"{way}:")
                rows = run_way(client, lines, start, args.steps, suffix_lines, args.max_tokens, say)
                results[way] = dict(rows=rows, summary=summary(rows))
    finally:
        proc.terminate()
        proc.wait(30)
    print(
        f"\nFIM on {path.name}: {len(lines)}-line file, cursor from line {start + 1} down one line per step; "
        f"{args.steps} steps, this machine's seconds\n"
    )
    print(
        "| suffix sent | prompt tokens | cached share | TTFT with cache | TTFT without | speedup "
        "| cold TTFT | same text |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for way, r in results.items():
        s = r["summary"]
        print(
            f"| {way} | {s['prompt_tokens']:.0f} | {fmt(s['cached_share'])} | {fmt(s['ttft_cache'])} s | "
            f"{fmt(s['ttft_no_cache'])} s | {fmt(s['speedup'])}× | {s['cold_ttft_cache']:.2f} s | "
            f"{s['identical']}/{s['steps']} |"
        )
    if args.out:
        args.out.write_text(json.dumps(dict(model=path.name, file_lines=len(lines), results=results), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
