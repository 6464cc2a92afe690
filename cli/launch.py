"""``tandem launch claude|codex|qwen|opencode [ARGS...]``: run a coding agent on
the local model, unchanged, as Ollama's ``launch`` does.

It starts a daemon if none runs, serves the HTTP bridge on a free loopback port
for as long as the agent runs, and starts the agent with its environment (and,
for Codex, ``-c`` overrides) pointed at that bridge: base URL, key, the served
model under every name the agent asks for, the context the daemon has, and the
settings that keep the agent's prompts cacheable and its traffic on this
machine. Nothing is written to the agent's own config files. What is set for
each agent is in docs/agents.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from typing import Callable

from .common import autostart_args, connect, sampling_args, sampling_defaults, say

KEY_WHEN_NONE = "tandem"  # agents insist on a key; the bridge asks for none unless `--api-key on`
ROOM = 8192  # tokens of a session beyond an agent's first request, below which launch warns
LONG_TIMEOUT_MS = "3600000"  # a long prompt's first read: minutes on a laptop CPU (the bridge keeps streams alive)


@dataclass(frozen=True)
class Bridge:
    url: str  # http://127.0.0.1:PORT (no /v1)
    key: str
    model: str
    n_ctx: int


def claude_setup(b: Bridge) -> tuple[dict[str, str], list[str]]:
    env = {
        "ANTHROPIC_BASE_URL": b.url,
        "ANTHROPIC_AUTH_TOKEN": b.key,  # (sent as a bearer token; ANTHROPIC_API_KEY would ask for approval)
        "ANTHROPIC_MODEL": b.model,
        # its side requests (titles, summaries, subagents) name a tier; every tier is the served model
        "ANTHROPIC_DEFAULT_OPUS_MODEL": b.model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": b.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": b.model,
        "ANTHROPIC_SMALL_FAST_MODEL": b.model,
        "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(b.n_ctx),  # compact before the daemon's context is full
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",  # no per-session line at the prompt's start (the cache's enemy)
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",  # no telemetry, update checks or error reports
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "API_TIMEOUT_MS": LONG_TIMEOUT_MS,
    }
    return env, []


def codex_setup(b: Bridge) -> tuple[dict[str, str], list[str]]:
    provider = {
        "name": "tandem",
        "base_url": f"{b.url}/v1",
        "wire_api": "responses",
        "env_key": "TANDEM_API_KEY",
        "stream_idle_timeout_ms": int(LONG_TIMEOUT_MS),
    }
    table = "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in provider.items()) + "}"
    overrides = {
        "model_provider": '"tandem"',
        "model_providers.tandem": table,
        "model": json.dumps(b.model),  # a name Codex does not know: its plain Responses dialect, every tool
        "model_context_window": str(b.n_ctx),
    }
    args = [x for k, v in overrides.items() for x in ("-c", f"{k}={v}")]
    return {"TANDEM_API_KEY": b.key}, args


def qwen_setup(b: Bridge) -> tuple[dict[str, str], list[str]]:
    env = {
        "OPENAI_BASE_URL": f"{b.url}/v1",
        "OPENAI_API_KEY": b.key,
        "OPENAI_MODEL": b.model,
        "QWEN_CODE_API_TIMEOUT_MS": LONG_TIMEOUT_MS,
    }
    return env, []


def opencode_setup(b: Bridge) -> tuple[dict[str, str], list[str]]:
    config = {
        "$schema": "https://opencode.ai/config.json",
        "autoupdate": False,
        "share": "disabled",
        "provider": {
            "tandem": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "tandem",
                "options": {"baseURL": f"{b.url}/v1", "apiKey": b.key, "timeout": False},
                "models": {b.model: {"name": b.model, "limit": {"context": b.n_ctx, "output": 8192}}},
            }
        },
        "model": f"tandem/{b.model}",
        "small_model": f"tandem/{b.model}",
    }
    env = {
        "OPENCODE_CONFIG_CONTENT": json.dumps(config),
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",  # (models.dev: off the machine)
        "OPENCODE_DISABLE_SHARE": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    }
    return env, []


@dataclass(frozen=True)
class Agent:
    command: str  # the executable
    package: str  # where it comes from (npm)
    tested: str  # the version tandem's tests run
    first_prompt: int  # tokens of its first request, measured (its system prompt and tools)
    setup: Callable[[Bridge], tuple[dict[str, str], list[str]]]


AGENTS: dict[str, Agent] = {
    "claude": Agent("claude", "@anthropic-ai/claude-code", "2.1.328", 12_200, claude_setup),
    "codex": Agent("codex", "@openai/codex", "0.169.0", 10_100, codex_setup),
    "qwen": Agent("qwen", "@qwen-code/qwen-code", "0.15.10", 17_500, qwen_setup),
    "opencode": Agent("opencode", "opencode-ai", "1.18.33", 7_300, opencode_setup),
}


def add_launch(sub) -> None:
    p = sub.add_parser(
        "launch",
        help="run a coding agent (Claude Code, Codex, Qwen Code, opencode) on the local model",
        description="Start the agent with its base URL, key and model pointed at tandem: a daemon is started "
        "if none runs, and the HTTP bridge is served on a free loopback port while the agent runs. ARGS go to "
        "the agent unchanged (e.g. `tandem launch claude -p 'fix the failing test'`); tandem's own options go "
        "before the agent's name (`tandem launch --model qwen2.5-coder-1.5b codex`). The agent's own config "
        "files are not touched. Agents want a long context (their first request is 7-18k tokens): serve a "
        "model that has one, e.g. --model qwen2.5-coder-1.5b.",
    )
    p.add_argument("agent", choices=sorted(AGENTS), help="the agent to run (it must be installed: see its error)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the agent")
    autostart_args(p)
    sampling_args(p)
    p.add_argument("--verbose", action="store_true", help="log every HTTP request the agent makes to stderr")


def cmd_launch(args) -> int:
    from tandem.bridge import server as bridge_server
    from tandem.bridge.api_key import KeyFileError, key_path, required_key

    agent = AGENTS[args.agent]
    executable = shutil.which(agent.command)
    if executable is None:
        say(
            f"tandem: `{agent.command}` is not installed (or not on PATH). Install it with "
            f"`npm install -g {agent.package}` (tandem is tested with {agent.package}@{agent.tested})"
        )
        return 127
    try:
        api_key = required_key("auto", key_path())
    except (KeyFileError, OSError) as exc:
        say(f"tandem: {exc}")
        return 2
    with connect(args.socket, args.model, args.no_start, args.config) as client:
        model, n_ctx = client.server.model, client.status().model.n_ctx
    if n_ctx < agent.first_prompt + ROOM:
        say(
            f"tandem: the served model's context is {n_ctx:,} tokens, and {args.agent}'s first request alone is "
            f"about {agent.first_prompt:,}: it will soon run out of room. Serve a longer context: `tandem stop`, "
            "then a model trained on one (Qwen2.5-Coder: 32k) with --ctx-size, --kv-budget or --kv-type q8_0"
        )
    server = bridge_server.BridgeServer(
        ("127.0.0.1", 0), args.socket, model, verbose=args.verbose, api_key=api_key, sampling=sampling_defaults(args)
    )
    thread = threading.Thread(target=server.serve_forever, name="tandem-bridge", daemon=True)
    thread.start()
    url = bridge_server.url_of(server).removesuffix("/v1")
    env, pre_args = agent.setup(Bridge(url, api_key or KEY_WHEN_NONE, model, n_ctx))
    say(f"tandem: {args.agent} on {model} (context {n_ctx:,}) through {url}")
    try:
        env = {**os.environ, "PWD": os.getcwd(), **env}  # (opencode takes its project from PWD)
        agent_proc = subprocess.Popen([executable, *pre_args, *args.args], env=env)
        # Ctrl-C is the agent's (it gets it from the terminal too): tandem waits for it to end
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            return agent_proc.wait()
        finally:
            signal.signal(signal.SIGINT, previous)
    finally:
        server.stop()
        thread.join(timeout=15)
        server.server_close()
        sys.stderr.flush()
