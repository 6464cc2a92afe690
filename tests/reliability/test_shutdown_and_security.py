"""Shutdown loses nothing and leaves nothing; a crash leaves nothing that blocks
the next start; the socket is this user's only; nothing is pickled."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tandem.client import Client, DaemonNotRunning, RequestFailed
from tandem.protocol import ErrorCode, FinishReason

ROOT = Path(__file__).resolve().parents[2]


def shm_of(pid: int) -> list[Path]:
    """The prefix-cache arena (and index) a living daemon holds open: its names are unpredictable."""
    held = [Path(f.path) for f in psutil.Process(pid).open_files()]
    # a set: one file may be open on two descriptors
    arenas = {p for p in held if p.name.startswith("tandem-kv-") and p.suffix != ".index"}
    return sorted(p for a in arenas for p in (a, a.with_name(a.name + ".index")) if p.exists())


def gone(pids, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.05)
    return False


def busy_daemon(start_daemon):
    """A daemon with a request running and a full queue, from five clients."""
    d = start_daemon("--ctx-size", "512", "--max-queue", "4", "--cache-bytes", "16M", "--preempt-tokens", "0")
    clients = [d.client() for _ in range(5)]
    running = clients[0].generate(prompt="Long:", max_tokens=3000, ignore_eos=True)
    it = iter(running)
    next(it)
    queued = [c.generate(prompt=f"Queued {i}:", max_tokens=5) for i, c in enumerate(clients[1:])]
    while clients[0].status().queue_length < 4:
        time.sleep(0.01)
    st = clients[0].status()
    arena = shm_of(st.pid)
    assert arena
    return d, clients, running, it, queued, st, arena


def check_everyone_answered_and_nothing_left(d, clients, running, it, queued, st, arena):
    list(it)
    assert running.done.finish_reason == FinishReason.CANCELLED  # documented: the running request is cancelled
    for q in queued:
        with pytest.raises(RequestFailed) as info:
            list(q)
        assert info.value.code == ErrorCode.SHUTTING_DOWN
    for c in clients:
        c.close()
    assert d.proc.wait(30) == 0
    assert not d.socket.exists() and not d.socket.with_name(d.socket.name + ".lock").exists()
    assert [p.name for p in d.dir.glob("*.ipc")] == [] and [p.name for p in d.dir.glob(".*.ipc")] == []
    assert not any(p.exists() for p in arena)
    assert gone(st.worker_pids.values()), "a worker process outlived the daemon"


@contextlib.contextmanager
def serving(socket_path: Path, model: Path, *args: str):
    """`tandem serve` on ``socket_path``, ready; stopped (exit 0) afterwards."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tandem.cli",
            "--socket",
            str(socket_path),
            "serve",
            "--model",
            str(model),
            *args,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with Client(socket_path, connect_timeout=1) as c:
                    if c.status().state == "ready":
                        break
            except DaemonNotRunning:
                pass
            assert time.monotonic() < deadline and proc.poll() is None, "the new daemon did not start"
            time.sleep(0.1)
        yield proc
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


def restart_right_after(d, smollm2_path) -> None:
    with serving(d.socket, smollm2_path, "--ctx-size", "256"):
        with Client(d.socket) as c:
            assert c.complete(prompt="Back:", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2


def test_sigterm_with_a_running_request_and_a_full_queue(start_daemon, smollm2_path):
    d, *rest = busy_daemon(start_daemon)
    d.proc.send_signal(signal.SIGTERM)
    check_everyone_answered_and_nothing_left(d, *rest)
    restart_right_after(d, smollm2_path)


def test_tandem_stop_with_a_running_request_and_a_full_queue(start_daemon, smollm2_path):
    d, *rest = busy_daemon(start_daemon)
    out = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "--socket", str(d.socket), "stop"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "stopped the daemon" in out.stderr
    check_everyone_answered_and_nothing_left(d, *rest)
    restart_right_after(d, smollm2_path)


def test_a_crashed_daemon_leaves_nothing_that_blocks_the_next_start(start_daemon, smollm2_path):
    d = start_daemon("--ctx-size", "256", "--cache-bytes", "16M")
    with d.client() as c:
        c.complete(prompt="Fill the cache a little:", max_tokens=2)
        st = c.status()
    arena = shm_of(st.pid)
    assert [p.suffix for p in arena] == ["", ".index"], arena  # one arena, and its index, exist
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    assert gone(st.worker_pids.values()), "workers must die with the daemon (PR_SET_PDEATHSIG)"
    assert d.socket.exists()  # stale
    with serving(d.socket, smollm2_path, "--ctx-size", "256", "--cache-bytes", "16M"):
        assert not any(p.exists() for p in arena)  # the crashed daemon's shared memory was swept at start
        with Client(d.socket) as c:
            assert c.complete(prompt="Back:", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2


def test_a_socket_directory_others_can_write_is_refused(tandem_cli, short_tmpdir, smollm2_path):
    directory = short_tmpdir()
    os.chmod(directory, 0o777)
    out = tandem_cli(directory / "t.sock", "serve", "--model", str(smollm2_path))
    assert out.returncode == 1
    assert "writable by other users (mode 0777)" in out.stderr and f"chmod 700 {directory}" in out.stderr
    assert not (directory / "t.sock").exists()


def test_socket_0600_in_a_0700_directory(start_daemon):
    d = start_daemon("--ctx-size", "256")
    assert stat.S_IMODE(d.socket.stat().st_mode) == 0o600
    assert stat.S_IMODE(d.socket.parent.stat().st_mode) == 0o700


PEER = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
s.settimeout(10)
# a ZMTP 3 greeting, then wait: a refused peer is disconnected at once (maybe before it is sent)
try:
    s.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL" + b"\x00" * 16 + b"\x00" + b"\x00" * 31)
except (BrokenPipeError, ConnectionResetError):
    print("closed 0")
    sys.exit(0)
got = b""
try:
    while True:
        data = s.recv(4096)
        if not data:
            break
        got += data
except (socket.timeout, ConnectionResetError):
    print("timeout")
    sys.exit(0)
print("closed", len(got))
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run a client as another user; CI runs as root")
def test_a_peer_of_another_user_is_refused(start_daemon):
    d = start_daemon("--ctx-size", "256")
    # open the way for uid 65534 (a misconfiguration the uid check must survive)
    for p in (d.dir, d.socket.parent):
        os.chmod(p, 0o755)
    os.chmod(d.socket, 0o666)
    out = subprocess.run(
        ["/usr/bin/python3", "-c", PEER, str(d.socket)], capture_output=True, text=True, timeout=60, user=65534
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("closed"), out.stdout  # disconnected by the daemon, not left hanging
    assert "refused a connection from uid 65534" in d.log()
    with d.client() as c:
        assert c.status().state == "ready"
        assert c.complete(prompt="Mine:", max_tokens=2, ignore_eos=True).usage.completion_tokens == 2


def test_nothing_is_pickled_anywhere():
    forbidden = re.compile(
        r"^\s*(import (pickle|cPickle|dill|shelve|marshal)|from (pickle|dill|shelve|marshal) import"
        r"|import multiprocessing$|from multiprocessing import (Process|Pool|Queue|Manager|Pipe|get_context))"
        r"|multiprocessing\.(Process|Pool|Queue|Manager|Pipe|get_context)|pickle\.(loads?|dumps?)",
        re.MULTILINE,
    )
    offenders = []
    for folder in ("daemon", "client", "cli", "bridge", "protocol"):
        for path in (ROOT / folder).rglob("*.py"):
            for m in forbidden.finditer(path.read_text()):
                offenders.append(f"{path.relative_to(ROOT)}: {m.group(0).strip()}")
    assert offenders == []
