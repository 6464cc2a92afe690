"""The coding agents people run, unchanged: Claude Code, Codex, Qwen Code and
opencode, installed from npm at the versions ``tandem launch`` is tested with
(bench/agent_clis.py), each run headless through ``tandem launch`` against one
daemon (Qwen2.5-Coder-0.5B, the smallest model that drives their tool loops,
with a 32k context) in a fresh git repository, asked to run its script with the
agent's shell tool.

Each must get a 2xx for every HTTP request it makes; make a second request of
its own, which carries the result of a tool call the model made and the agent
ran; and from that second request on find in the prefix cache all of the
turn before's prompt, down to its last whole 64-token chunk (the daemon's
usage, as the bridge's --verbose log prints it): what is new in a turn is the
model's answer as the agent re-renders it and the tool's output. Side
requests (opencode's title, Qwen Code's next-speaker check) are told apart by
size: they are shorter than the agent's first turn. Whether a 0.5B
model calls a tool at all turns on small things in its 6-18k-token prompt (the
date, a path): a test runs up to three sessions, each checked in full, until
one has a tool call run. Claude Code, which sends no temperature, runs with
``tandem launch --temperature 0`` (at Anthropic's default of 1 its sessions
were a draw). Whether the model gets the call right (the script's
side effect) is printed, not asserted: that is the model's skill, not tandem's.

The agents' first requests are 6-18k tokens: minutes of prompt reading on two
cores. One daemon serves every test of the session, and its disk tier (kept in
~/.cache/tandem/test-agents-kv) carries the agents' preambles to the next run.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.agent_clis import install
from bench.agents import agent_args, agent_env, make_repo
from tandem.cli.launch import AGENTS

CTX = 32768
MAIN_PROMPT = 3000  # tokens: an agent's own requests carry its system prompt and tools (7k and more)
# seconds for one agent session: Qwen Code's 17.7k-token first prompt read cold took 490-680 s here, and its
# turns after it more (killed at 900 s once, with other work on the machine); a limit for a hang, not for speed
AGENT_TIMEOUT = 1500
ATTEMPTS = 3
CHUNK = 64  # tokens: exact mode reads a prompt in 64-token chunks, and the cache keeps whole chunks
# Qwen Code's 17.8k-token prompt: the 0.5B model called the tool in one session of four measured here
# (2026-12-06); the others it answered in text. For it the test asserts what tandem does (every request
# answered, its turns from the cache) and prints whether a call was run; a larger model is needed to assert it
UNRELIABLE_CALLS = {"qwen"}
# Claude Code sends no temperature: at Anthropic's default of 1 the 0.5B model called its tool in some sessions
# and wrote text in others (CI failed on three such sessions in a row, 2026-12-07); greedy, it calls it
LAUNCH_OPTIONS = {"claude": ["--temperature", "0"]}
LOG_LINE = re.compile(
    r"tandem http: \S+ (?P<method>[A-Z]+) (?P<path>\S+) (?P<outcome>\d{3}|client gone|cancelled|500[^,]*)"
    r"(?:, prompt (?P<prompt>[\d,]+) tokens \((?P<cached>[\d,]+) cached\), (?P<generated>[\d,]+) generated)?"
)


@dataclass
class Logged:
    method: str
    path: str
    outcome: str
    prompt: int = 0
    cached: int = 0
    generated: int = 0


def parse_log(text: str) -> list[Logged]:
    out = []
    for m in LOG_LINE.finditer(text):
        n = {k: int(m[k].replace(",", "")) for k in ("prompt", "cached", "generated") if m[k]}
        out.append(Logged(m["method"], m["path"], m["outcome"], **n))
    return out


@pytest.fixture(scope="session")
def agent_bin() -> Path:
    return install()


@pytest.fixture(scope="session")
def agent_daemon(daemon_process, coder_path):
    kept = Path.home() / ".cache" / "tandem" / "test-agents-kv"
    d = daemon_process(
        coder_path,
        "--ctx-size",
        str(CTX),
        "--cache-bytes",
        "1G",
        "--disk-cache-dir",
        str(kept),
        "--disk-cache-bytes",
        "1G",
    )
    d.wait_ready(300)
    yield d
    wait_for_disk_tier(d)
    d.stop()
    d.cleanup()


def wait_for_disk_tier(d, limit: float = 60.0) -> None:
    """Let the daemon write the last session's pages to its disk tier, as it does in idle time, before it is
    stopped (a stopping worker writes for 3 s: not a 17k-token prompt's pages after a session's others), so
    that the next run reads the agents' preambles from disk. The status shows the tier's counts once it has
    written what was waiting; nothing waiting: ``limit`` seconds."""

    def written():
        with d.client() as c:
            cache = c.status().cache
        return cache.disk.pages_written if cache is not None and cache.disk is not None else None

    before = written()
    deadline = time.monotonic() + limit
    while before is not None and time.monotonic() < deadline and written() == before:
        time.sleep(1.0)


def run_agent(d, bin_dir: Path, agent: str, root: Path) -> tuple[subprocess.CompletedProcess, list[Logged], Path]:
    repo = make_repo(root)
    env = agent_env(root, bin_dir)
    cmd = [sys.executable, "-m", "tandem.cli", "--socket", str(d.socket), "launch", "--no-start", "--verbose"]
    cmd += LAUNCH_OPTIONS.get(agent, [])
    proc = subprocess.Popen(
        [*cmd, agent, *agent_args(agent)],
        cwd=repo,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the agent and what it runs: killed together if it overruns
    )
    try:
        out, err = proc.communicate(timeout=AGENT_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n(killed after {AGENT_TIMEOUT} s)"
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done, parse_log(err), repo


def main_turns(requests: list[Logged]) -> list[Logged]:
    """The agent's own turns: its first request that carries its system prompt and tools, and each
    later one at least as long (a turn re-sends the conversation); side requests are shorter."""
    first = next((r for r in requests if r.prompt >= MAIN_PROMPT), None)
    return [r for r in requests if first is not None and r.prompt >= first.prompt]


@pytest.mark.parametrize("agent", sorted(AGENTS))
def test_the_agent_runs_its_tool_loop_on_tandem_and_later_turns_read_the_cache(agent_daemon, agent_bin, agent):
    # a 0.5B model's choice to call a tool turns on small things in the prompt (a path, the date): up to three
    # sessions, each in a folder of its own (the same ones in every run: /tmp/tandem-agent-AGENT-N) and each
    # checked in full, until one has a tool call run
    attempts = 1 if agent in UNRELIABLE_CALLS else ATTEMPTS  # (another session could not fail the test)
    for attempt in range(1, attempts + 1):
        root = Path(tempfile.gettempdir()) / f"tandem-agent-{agent}-{attempt}"
        done, requests, repo = run_agent(agent_daemon, agent_bin, agent, root)
        report = f"exit {done.returncode}\nstdout: {done.stdout[-3000:]}\nstderr: {done.stderr[-6000:]}"
        print(f"\n{agent} #{attempt}: " + "; ".join(f"{r.prompt} ({r.cached} cached) +{r.generated}" for r in requests))
        assert requests, report
        assert all(r.outcome.startswith("2") for r in requests), report
        assert done.returncode == 0 or (agent == "claude" and "error_max_turns" in done.stdout), report
        turns = main_turns(requests)
        for prev, r in zip(turns, turns[1:]):  # the turn before's prompt, down to its last whole chunk
            assert r.cached >= prev.prompt // CHUNK * CHUNK, f"{r} after {prev}\n{report}"
        if len(turns) >= 2:  # a second turn of its own: it ran a tool call the model made and sent the result
            break
    else:
        if agent not in UNRELIABLE_CALLS:
            pytest.fail(f"in {attempts} sessions the model made no tool call the agent ran\n{report}")
        print(f"{agent}: the 0.5B model made no tool call this time (see UNRELIABLE_CALLS)")
        return
    print(f"{agent}: the script ran: {(repo / 'ran.txt').exists()}")
    shutil.rmtree(root, ignore_errors=True)
