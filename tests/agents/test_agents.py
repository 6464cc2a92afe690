"""The coding agents people run, unchanged: Claude Code, Codex, Qwen Code and
opencode, installed from npm at the versions ``tandem launch`` is tested with
(bench/agent_clis.py), each run headless through ``tandem launch`` against one
daemon (Qwen2.5-Coder-0.5B, the smallest model that drives their tool loops,
with a 32k context) on a task in a fresh git repository.

Each must: get a 2xx for every HTTP request it makes; execute a tool call the
model made (the task's script leaves a file behind when it runs); and, from the
second request of its turn-taking on, find at least 90% of each prompt's tokens
in the prefix cache (the daemon's usage, as the bridge's --verbose log prints
it). Side requests (opencode's title) are told apart by their prompt: they do
not carry the agent's system prompt and tools.

The agents' first requests are 7-18k tokens: minutes of prompt reading on two
cores. One daemon serves every test of the session, and its disk tier keeps
what it read between runs of the suite.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.agent_clis import install
from tandem.cli.launch import AGENTS

CTX = 32768
MAIN_PROMPT = 3000  # tokens: an agent's own requests carry its system prompt and tools (7k and more)
AGENT_TIMEOUT = 1500  # seconds for one agent's session (its first prompt: minutes)
LOG_LINE = re.compile(
    r"tandem http: \S+ (?P<method>[A-Z]+) (?P<path>\S+) (?P<outcome>\d{3}|client gone|cancelled|500[^,]*)"
    r"(?:, prompt (?P<prompt>[\d,]+) tokens \((?P<cached>[\d,]+) cached\), (?P<generated>[\d,]+) generated)?"
)
TASK = (
    "Run the command `python3 mark.py` in this repository with your shell tool, then say what it printed. "
    "Do not do anything else."
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
def agent_daemon(daemon_process, coder_path, tmp_path_factory):
    d = daemon_process(coder_path, "--ctx-size", str(CTX), "--cache-bytes", "1G")
    d.wait_ready(300)
    yield d
    d.stop()
    d.cleanup()


def make_repo(root: Path) -> Path:
    repo = root / "repo"
    repo.mkdir()
    (repo / "mark.py").write_text(
        "from pathlib import Path\n\nPath(__file__).with_name('ran.txt').write_text('ran')\nprint('marked: 4217')\n"
    )
    (repo / "README.md").write_text("# calc\n\nA tiny repository for an agent to work in.\n")
    for cmd in (["git", "init", "-q"], ["git", "add", "."], ["git", "commit", "-qm", "start"]):
        subprocess.run(cmd, cwd=repo, check=True, env={**os.environ, **GIT_ID})
    return repo


GIT_ID = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


def agent_args(agent: str, repo: Path) -> list[str]:
    """Headless, one task, tools allowed without asking (the repository is a throw-away)."""
    if agent == "claude":
        return ["-p", TASK, "--output-format", "json", "--max-turns", "4", "--permission-mode", "bypassPermissions"]
    if agent == "codex":
        return ["exec", "--skip-git-repo-check", "-s", "workspace-write", TASK]
    if agent == "qwen":
        return ["-p", TASK, "--yolo"]
    return ["run", TASK]


def run_agent(d, bin_dir: Path, agent: str, root: Path) -> tuple[subprocess.CompletedProcess, list[Logged], Path]:
    repo = make_repo(root)
    home = root / "home"
    home.mkdir()
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(home),  # the agent's own settings and sessions: none of the user's
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "CODEX_HOME": str(home / ".codex"),
        "IS_SANDBOX": "1",  # (Claude Code refuses bypassPermissions as root otherwise)
        "NO_COLOR": "1",
    }
    cmd = [sys.executable, "-m", "tandem.cli", "--socket", str(d.socket), "launch", "--no-start", "--verbose"]
    done = subprocess.run(
        [*cmd, agent, *agent_args(agent, repo)],
        cwd=repo,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=AGENT_TIMEOUT,
    )
    return done, parse_log(done.stderr), repo


@pytest.mark.parametrize("agent", sorted(AGENTS))
def test_the_agent_runs_its_tool_loop_on_tandem_and_later_turns_read_the_cache(
    agent_daemon, agent_bin, agent, tmp_path
):
    done, requests, repo = run_agent(agent_daemon, agent_bin, agent, tmp_path)
    report = f"exit {done.returncode}\nstdout: {done.stdout[-3000:]}\nstderr: {done.stderr[-6000:]}"
    assert requests, report
    assert all(r.outcome.startswith("2") for r in requests), report
    assert done.returncode == 0, report
    assert (repo / "ran.txt").exists(), "the agent did not run the tool call\n" + report
    turns = [r for r in requests if r.prompt >= MAIN_PROMPT]
    assert len(turns) >= 2, report
    for r in turns[1:]:
        assert r.cached >= 0.9 * r.prompt, f"{r}\n{report}"
