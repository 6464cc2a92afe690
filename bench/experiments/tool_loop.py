"""An agent's tool loop: how much of each turn's prompt the prefix cache serves.

A coding agent re-sends the whole history every turn: the system prompt, the
tools, every call the model made and every result. tandem re-renders the calls
through the chat template; when that gives back the tokens the model generated,
the cache serves everything up to the new tool result. This runs a 6-turn loop
(greedy; each turn's calls answered with a made-up result) and reports, per
turn, the prompt, the tokens restored from the cache, and the share of what
the previous turn had read and written (the most the cache can hold of it,
to the last full page).

    python -m bench.experiments.tool_loop [--model qwen2.5-coder-0.5b] [--turns 6] [--choice required]
"""

from __future__ import annotations

import argparse

from bench.common import model_path, start_daemon, temp_socket
from tandem.client import Client, assistant_message

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the project",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "maxLength": 80}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the project's tests; returns the failures",
            "parameters": {"type": "object", "properties": {"pattern": {"type": "string", "maxLength": 40}}},
        },
    },
]
SYSTEM = (
    "You are a coding agent working in a Python project. Read the files you need with read_file, "
    "run the tests with run_tests, and fix what fails. " * 4
)
TASK = "The test test_parse in tests/test_cli.py fails. Find out why."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--choice", default="required", help="tool_choice: required (every turn calls) or auto")
    args = ap.parse_args()
    sock = temp_socket("tdm-tl-")
    proc = start_daemon(sock, "--model", str(model_path(args.model)), "--ctx-size", "4096")
    try:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
        previous = None
        total_cached = total_reusable = total_prompt = 0
        print(f"{args.model}, tool_choice {args.choice}, {args.turns} turns")
        print("turn  prompt  cached  reusable  share  calls")
        with Client(sock) as c:
            page = c.status().cache.page_tokens
            for turn in range(1, args.turns + 1):
                done = c.complete(
                    messages=messages,
                    tools=TOOLS,
                    tool_choice=args.choice,
                    parallel_tool_calls=False,
                    temperature=0.0,
                    max_tokens=120,
                )
                u = done.usage
                reusable = 0
                if previous is not None:  # what the last turn read and wrote, to its last full page
                    reusable = (previous.prompt_tokens + previous.completion_tokens) // page * page
                    total_cached += min(u.cached_tokens, reusable)
                    total_reusable += reusable
                    total_prompt += u.prompt_tokens
                share = f"{u.cached_tokens / reusable:5.0%}" if reusable else "    -"
                calls = ", ".join(f"{t.function.name}({t.function.arguments})" for t in done.tool_calls)
                print(
                    f"{turn:4}  {u.prompt_tokens:6}  {u.cached_tokens:6}  {reusable:8}  {share}  {calls or done.text!r}"
                )
                previous = u
                messages.append(assistant_message(done))
                for t in done.tool_calls:
                    result = f"(turn {turn}) {t.function.name}: 40 lines; line 12: def parse(argv): ..."
                    messages.append({"role": "tool", "tool_call_id": t.id, "content": result})
                if not done.tool_calls:
                    messages.append({"role": "user", "content": "Go on."})
        if total_reusable:
            print(
                f"turns 2-{args.turns}: {total_cached}/{total_reusable} reusable tokens from the cache "
                f"({total_cached / total_reusable:.1%}); of all their prompt tokens {total_cached / total_prompt:.1%}"
            )
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
