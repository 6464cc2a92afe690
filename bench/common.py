"""Shared by the benchmarks: start `tandem serve` on a private socket and wait for it."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tandem.client import Client
from tandem.daemon import models


def model_path(name: str) -> Path:
    """A preset (pulled if needed) or a path to a .gguf file."""
    return models.pull(name) if name in models.PRESETS else Path(name)


def cpu_model() -> str:
    """The CPU's model name, from /proc/cpuinfo ("unknown" elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def fmt(values: list[float], digits: int = 2) -> str:
    """median (min–max)"""
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}–{max(values):.{digits}f})"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def temp_socket(prefix: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp")) / "b.sock"


# What the daemons' load checks found (daemon/worker/invariance.py: keyed by model file, settings and CPU),
# handed to each later daemon of a run that is given a fresh --state-dir, as a restarted daemon finds them
# in its own: the daemons a benchmark compares read prompts the same way, and none spends its start on them
# (tests/conftest.py hands them on between the test daemons of a session the same way). Where
# $TANDEM_BENCH_VERDICTS names a file, they are read from it and written back to it: a test session shares
# them so with the benchmarks it runs as subprocesses (a fresh daemon's checks take 7-15 s on two cores).
VERDICTS: dict = {}
VERDICTS_FILE = "batch-invariance.json"
VERDICTS_ENV = "TANDEM_BENCH_VERDICTS"


def _shared_verdicts() -> Path | None:
    path = os.environ.get(VERDICTS_ENV)
    return Path(path) if path else None


def _read_verdicts(path: Path) -> None:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    if isinstance(found, dict):
        VERDICTS.update({k: v for k, v in found.items() if isinstance(v, dict)})


def _state_dir(serve_args: tuple) -> Path | None:
    args = list(serve_args)
    return Path(args[args.index("--state-dir") + 1]) if "--state-dir" in args[:-1] else None


def start_daemon(socket: Path, *serve_args: str, timeout: float = 180, stderr=None) -> subprocess.Popen:
    """`tandem serve SERVE_ARGS` in a subprocess; returns once it reports ready.
    Its prefix cache's disk tier goes beside the socket (a fresh directory: one
    benchmark's pages never serve another's first request), unless set. Its log
    goes to ``stderr`` (an open file), or nowhere. With a ``--state-dir``, the
    load checks' verdicts earlier daemons of this run found are put there first
    (``VERDICTS``)."""
    state = _state_dir(serve_args)
    if state is not None:
        seed_verdicts(state)
    proc = _spawn(socket, serve_args, stderr)
    _wait_ready(proc, socket, timeout)
    if state is not None:
        keep_verdicts(state)
    return proc


def stop_daemon(proc: subprocess.Popen, wait: float = 30.0) -> None:
    """Stop a daemon ``start_daemon`` started: terminate, and kill it if it is not gone within ``wait`` s."""
    proc.terminate()
    try:
        proc.wait(wait)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def seed_verdicts(state: Path) -> None:
    """Put the verdicts found so far (``VERDICTS``) into a daemon's state directory ``state``,
    unless it has its own file."""
    shared = _shared_verdicts()
    if shared is not None:
        _read_verdicts(shared)
    if VERDICTS and not (state / VERDICTS_FILE).exists():
        state.mkdir(parents=True, exist_ok=True)
        (state / VERDICTS_FILE).write_text(json.dumps(VERDICTS))


def keep_verdicts(state: Path) -> None:
    """Add what a daemon with the state directory ``state`` found to ``VERDICTS`` (and to the shared file)."""
    _read_verdicts(state / VERDICTS_FILE)
    shared = _shared_verdicts()
    if shared is not None and VERDICTS:
        _read_verdicts(shared)  # (another process's, since)
        part = shared.with_name(f"{shared.name}.{os.getpid()}")
        part.write_text(json.dumps(VERDICTS))
        part.replace(shared)


def _spawn(socket: Path, serve_args: tuple, stderr) -> subprocess.Popen:
    env = dict(os.environ)
    env.setdefault("TANDEM_DISK_CACHE_DIR", str(socket.parent / "kv"))
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tandem.cli",
            "--socket",
            str(socket),
            "serve",
            "--metrics-addr",
            "off",
            *serve_args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL if stderr is None else stderr,
        env=env,
    )


def _wait_ready(proc: subprocess.Popen, socket: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the daemon exited with {proc.returncode}")
        if socket.exists():
            try:
                with Client(socket, connect_timeout=1) as c:
                    if c.status().state == "ready":
                        return
            except Exception:
                pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the daemon did not become ready")


def wait_quiet(pids: list[int], limit: float = 60.0, busy: float = 0.1) -> float:
    """Wait until the process trees of ``pids`` use under ``busy`` of a core (over
    0.2 s), at most ``limit`` seconds; returns the seconds waited. Between two
    measured requests: work a system does after a reply (tandem settles the turn
    and writes cache pages between requests) must not slow the next system down."""
    import psutil

    def sample() -> dict[int, float]:
        out = {}
        for pid in pids:
            try:
                root = psutil.Process(pid)
                for p in [root, *root.children(recursive=True)]:
                    t = p.cpu_times()
                    out[p.pid] = t.user + t.system
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return out

    started = time.monotonic()
    while time.monotonic() - started < limit:
        before = sample()
        time.sleep(0.2)
        after = sample()
        used = sum(after[pid] - before[pid] for pid in after.keys() & before.keys())
        if used < busy * 0.2:
            return time.monotonic() - started
    print(f"  (still busy after {limit:.0f} s: measuring anyway)", flush=True)
    return time.monotonic() - started
