"""The coding-agent CLIs at the versions tandem is tested with (``tandem launch``'s
table), installed from npm into a cache folder once: for tests/agents and
bench/agents.py. ``python -m bench.agent_clis`` installs them and prints the
folder their commands are in (.ci/run calls it).

The folder is ``$TANDEM_AGENTS_DIR``, else ``~/.cache/tandem/agents/<versions>``:
a new pin installs beside the old one, and an installed set is never fetched again.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tandem.cli.launch import AGENTS

INSTALL_TIMEOUT = 900  # seconds: four packages, one of them a 100 MB binary


class AgentInstallError(RuntimeError):
    pass


def packages() -> list[str]:
    return [f"{a.package}@{a.tested}" for a in AGENTS.values()]


def agents_dir() -> Path:
    if os.environ.get("TANDEM_AGENTS_DIR"):
        return Path(os.environ["TANDEM_AGENTS_DIR"])
    digest = hashlib.sha256(" ".join(sorted(packages())).encode()).hexdigest()[:12]
    return Path.home() / ".cache" / "tandem" / "agents" / digest


def installed(directory: Path) -> bool:
    return all((directory / "node_modules" / ".bin" / a.command).exists() for a in AGENTS.values())


def install(directory: Path | None = None) -> Path:
    """The folder the pinned agents' commands are in, installing them first if need be."""
    directory = directory or agents_dir()
    bin_dir = directory / "node_modules" / ".bin"
    if installed(directory):
        return bin_dir
    npm = shutil.which("npm")
    if npm is None:
        raise AgentInstallError("npm is not installed: apt-get install nodejs npm (node 18 or later)")
    directory.mkdir(parents=True, exist_ok=True)
    cmd = [npm, "install", "--no-audit", "--no-fund", "--loglevel=error", "--prefix", str(directory), *packages()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT)
    if done.returncode != 0:
        raise AgentInstallError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    claude = directory / "node_modules" / "@anthropic-ai" / "claude-code" / "install.cjs"
    if not (bin_dir / "claude").exists() and claude.exists():  # (npm skips postinstall scripts in some setups)
        subprocess.run(["node", str(claude)], cwd=claude.parent, capture_output=True, timeout=300)
    if not installed(directory):
        missing = [a.command for a in AGENTS.values() if not (bin_dir / a.command).exists()]
        raise AgentInstallError(
            f"npm installed {', '.join(packages())} but {', '.join(missing)} is missing in {bin_dir}"
        )
    return bin_dir


if __name__ == "__main__":
    try:
        print(install())
    except (AgentInstallError, subprocess.TimeoutExpired) as exc:
        print(f"bench.agent_clis: {exc}", file=sys.stderr)
        sys.exit(1)
