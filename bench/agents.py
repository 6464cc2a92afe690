"""A real agent session on tandem, per agent: ``python -m bench.agents``.

Each agent CLI (bench/agent_clis.py's pinned versions) runs headless through
``tandem launch`` on the same task in a fresh git repository, against a fresh
daemon (Qwen2.5-Coder-1.5B, a 32k context, no disk tier: the first request is
read cold). From the bridge's --verbose lines: per request, prompt tokens, the
share the cache served, time to first token, decode tok/s; and the session's
wall time. Later turns are read against the time their new tokens alone take
at the first request's prefill rate (goal: TTFT <= 1.1x that).

With ``--llama-server PATH`` (bench/build_llama_server.sh vendored builds one),
each agent also runs against llama-server serving the same file with the same
context, in the same run (it speaks all four dialects: Anthropic Messages,
Responses and chat completions): its log gives each request's prompt tokens
read and decode rate.

    python -m bench.agents --agents opencode,qwen --out bench/results/DATE-agents
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.agent_clis import install
from bench.common import free_port, start_daemon
from tandem.cli.launch import AGENTS, Bridge

# Claude Code with its core tools only: with all of them a 0.5B model may start background subagents (its
# Agent tool), each a session of its own that runs long after the turn limit
CLAUDE_TOOLS = ["--tools", "Bash,Read,Edit,Write"]
# Each agent is asked to run the repository's script with its own shell tool, named: Qwen2.5-Coder-0.5B
# under a 6-18k-token system prompt calls tools when told which (asked only to "run" the script, it
# mostly explains how one would). tests/agents runs the same sessions.
TASKS = {
    "claude": 'Call the Bash tool with {"command": "python3 mark.py"}.',
    "codex": 'Call exec_command with the arguments {"cmd": "python3 mark.py"}.',
    "qwen": "Call the run_shell_command tool to run python3 mark.py",
    "opencode": 'Call the bash tool with {"command": "python3 mark.py", "description": "run mark.py"}.',
}
LINE = re.compile(
    r"tandem http: \S+ (?P<method>[A-Z]+) (?P<path>\S+) (?P<outcome>\S+), prompt (?P<prompt>[\d,]+) tokens "
    r"\((?P<cached>[\d,]+) cached\), (?P<generated>[\d,]+) generated, first token after (?P<ttft>[\d.]+) s "
    r"\((?P<queued>[\d.]+) s queued\), (?P<tps>[\d.]+) tok/s"
)
LLAMA_PROMPT = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
LLAMA_EVAL = re.compile(r"(?<!prompt )\beval time =\s*([\d.]+) ms /\s*(\d+) (?:tokens|runs)")


def agent_args(agent: str) -> list[str]:
    """Headless, one task, tools allowed without asking (the repository is a throw-away)."""
    task = TASKS[agent]
    return {
        "claude": [
            "-p",
            task,
            "--output-format",
            "json",
            "--max-turns",
            "3",
            "--permission-mode",
            "bypassPermissions",
            *CLAUDE_TOOLS,
        ],
        "codex": ["exec", "--skip-git-repo-check", "-s", "workspace-write", task],
        "qwen": ["-p", task, "--yolo", "--max-session-turns", "3"],
        "opencode": ["run", task],
    }[agent]


GIT_ID = {  # and a fixed date: the same commit hash, which the agents show the model, in every run
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@t",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@t",
    "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z",
    "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z",
}


def make_repo(root: Path) -> Path:
    """A fresh git repository ``root/repo`` with the script the task runs (what was there: removed)."""
    repo = root / "repo"
    shutil.rmtree(repo, ignore_errors=True)
    repo.mkdir(parents=True)
    (repo / "mark.py").write_text(
        "from pathlib import Path\n\nPath(__file__).with_name('ran.txt').write_text('ran')\nprint('marked: 4217')\n"
    )
    (repo / "README.md").write_text("# calc\n\nA tiny repository for an agent to work in.\n")
    for cmd in (["git", "init", "-q"], ["git", "add", "."], ["git", "commit", "-qm", "start"]):
        subprocess.run(cmd, cwd=repo, check=True, env={**os.environ, **GIT_ID})
    return repo


def agent_env(root: Path, bin_dir: Path) -> dict[str, str]:
    """The agent's own, fresh HOME and config folders, in ``root`` (its repository: ``root/repo``):
    none of the user's settings and sessions."""
    home = root / "home"
    shutil.rmtree(home, ignore_errors=True)
    (home / ".codex").mkdir(parents=True)
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PWD": str(root / "repo"),  # (opencode takes its project from PWD, not from its working directory)
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "CODEX_HOME": str(home / ".codex"),
        "IS_SANDBOX": "1",  # (Claude Code refuses bypassPermissions as root otherwise)
        "NO_COLOR": "1",
    }


def run_on_tandem(agent: str, socket: Path, bin_dir: Path, timeout: float) -> dict:
    root = Path(tempfile.mkdtemp(prefix=f"tdm-agent-{agent}-"))
    repo = make_repo(root)
    cmd = [sys.executable, "-m", "tandem.cli", "--socket", str(socket), "launch", "--no-start", "--verbose", agent]
    start = time.monotonic()
    done = subprocess.run(
        [*cmd, *agent_args(agent)],
        cwd=repo,
        env=agent_env(root, bin_dir),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    requests = [
        {
            "outcome": m["outcome"],
            "prompt": int(m["prompt"].replace(",", "")),
            "cached": int(m["cached"].replace(",", "")),
            "generated": int(m["generated"].replace(",", "")),
            "ttft": float(m["ttft"]),
            "tps": float(m["tps"]),
        }
        for m in LINE.finditer(done.stderr)
    ]
    return {
        "exit": done.returncode,
        "wall_s": time.monotonic() - start,
        "requests": requests,
        "ran": (repo / "ran.txt").exists(),
        "stdout_tail": done.stdout[-2000:],
        "stderr_tail": done.stderr[-4000:],
    }


def run_on_llama_server(agent: str, server: str, model: Path, ctx: int, bin_dir: Path, timeout: float) -> dict:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
    proc = subprocess.Popen(
        [server, "-m", str(model), "-c", str(ctx), "--jinja", "--host", "127.0.0.1", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            probe = subprocess.run(["curl", "-sf", f"{url}/health"], capture_output=True)
            if probe.returncode == 0:
                break
            time.sleep(1)
        root = Path(tempfile.mkdtemp(prefix=f"tdm-agent-{agent}-llama-"))
        repo = make_repo(root)
        env, pre = AGENTS[agent].setup(Bridge(url, "none", model.name, ctx))
        start = time.monotonic()
        done = subprocess.run(
            [AGENTS[agent].command, *pre, *agent_args(agent)],
            cwd=repo,
            env={**agent_env(root, bin_dir), **env},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        wall = time.monotonic() - start
    finally:
        proc.terminate()
        proc.wait(30)
    text = Path(log.name).read_text(errors="replace")
    prompts = [(float(ms), int(n)) for ms, n in LLAMA_PROMPT.findall(text)]
    evals = [(float(ms), int(n)) for ms, n in LLAMA_EVAL.findall(text)]
    return {
        "exit": done.returncode,
        "stdout_tail": done.stdout[-2000:],
        "stderr_tail": done.stderr[-4000:],
        "wall_s": wall,
        "prompt_reads": [{"tokens": n, "ms": ms} for ms, n in prompts],
        "decode_tps": [n / ms * 1000 for ms, n in evals if ms > 0],
        "ran": (repo / "ran.txt").exists(),
    }


def later_turns(requests: list[dict]) -> list[dict]:
    """Each later request's TTFT against the time its new tokens take at the first request's rate."""
    if not requests or requests[0]["ttft"] <= 0:
        return []
    rate = requests[0]["prompt"] / requests[0]["ttft"]  # tokens a second, read cold
    out = []
    for r in requests[1:]:
        new = r["prompt"] - r["cached"]
        alone = new / rate
        out.append({"new_tokens": new, "ttft": r["ttft"], "ratio": r["ttft"] / alone if alone > 0 else None})
    return out


def report(results: dict) -> str:
    lines = [
        f"# Agent sessions: {results['model']}, context {results['ctx']:,}",
        "",
        "| agent | server | request | prompt | cached | TTFT s | decode tok/s | wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for agent, r in results["tandem"].items():
        for i, q in enumerate(r["requests"], 1):
            share = q["cached"] / q["prompt"] if q["prompt"] else 0
            wall = f"{r['wall_s']:.0f}" if i == 1 else ""
            lines.append(
                f"| {agent} | tandem | {i} | {q['prompt']:,} | {q['cached']:,} ({share:.0%}) | {q['ttft']:.1f} | "
                f"{q['tps']:.1f} | {wall} |"
            )
        ratios = [t["ratio"] for t in later_turns(r["requests"]) if t["ratio"] is not None]
        if ratios:
            lines.append(
                f"| {agent} | tandem | later turns: TTFT / time of the new tokens alone, median "
                f"{statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f}) | | | | | |"
            )
    for agent, r in results.get("llama-server", {}).items():
        reads = ", ".join(f"{p['tokens']:,} in {p['ms'] / 1000:.1f} s" for p in r["prompt_reads"])
        tps = f"{statistics.median(r['decode_tps']):.1f}" if r["decode_tps"] else "-"
        lines.append(f"| {agent} | llama-server | prompt reads: {reads} | | | | {tps} | {r['wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--agents", default=",".join(AGENTS))
    ap.add_argument("--llama-server", default=None, metavar="PATH", help="also run each agent against it")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from tandem.daemon import models

    model = models.pull(args.model) if args.model in models.PRESETS else Path(args.model)
    bin_dir = install()
    results: dict = {"model": model.name, "ctx": args.ctx, "tandem": {}, "llama-server": {}}
    for agent in args.agents.split(","):
        work = Path(tempfile.mkdtemp(prefix="tdm-bench-agents-"))
        socket = work / "t.sock"
        serve = ["--model", str(model), "--ctx-size", str(args.ctx), "--state-dir", str(work / "state")]
        daemon = start_daemon(socket, *serve, "--disk-cache-bytes", "0", timeout=600)
        try:
            results["tandem"][agent] = run_on_tandem(agent, socket, bin_dir, args.timeout)
        finally:
            daemon.terminate()
            daemon.wait(60)
        if args.llama_server:
            results["llama-server"][agent] = run_on_llama_server(
                agent, args.llama_server, model, args.ctx, bin_dir, args.timeout
            )
        print(report(results), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        (args.out / "REPORT.md").write_text(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
