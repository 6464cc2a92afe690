"""Shared by the benchmarks: start `tandem serve` on a private socket and wait for it."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem.client import Client


def temp_socket(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp")) / "b.sock"


def start_daemon(socket: Path, *serve_args: str, timeout: float = 180) -> subprocess.Popen:
    """`tandem serve SERVE_ARGS` in a subprocess; returns once it reports ready."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.client.cli", "--socket", str(socket), "serve", *serve_args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the daemon exited with {proc.returncode}")
        if socket.exists():
            try:
                with Client(socket, connect_timeout=1) as c:
                    if c.status().state == "ready":
                        return proc
            except Exception:
                pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the daemon did not become ready")
