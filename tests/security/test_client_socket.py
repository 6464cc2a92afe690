"""The client sends nothing to a socket another user could have put in its place:
a socket directory that is not the user's or that others may write in, a socket
file of another user, or a listener that runs as another user (SO_PEERCRED)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tandem.client import Client, UntrustedSocket


class FakeDaemon:
    """A listening Unix socket that records whether anyone connected (and what they sent)."""

    def __init__(self, path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(os.fspath(path))
        self.sock.listen(4)
        self.sock.settimeout(0.5)

    def received(self) -> bytes:
        try:
            conn, _ = self.sock.accept()
        except TimeoutError:
            return b""
        conn.settimeout(0.5)
        try:
            return conn.recv(4096) or b"(connected)"
        except TimeoutError:
            return b"(connected)"
        finally:
            conn.close()

    def close(self):
        self.sock.close()


def refused(path, match: str) -> None:
    with pytest.raises(UntrustedSocket, match=match) as info:
        with Client(path, connect_timeout=2) as c:
            c.complete(prompt="SECRET = 'hunter2'", max_tokens=1)
    assert str(path.parent) in str(info.value) or str(path) in str(info.value)
    assert "Nothing was sent" in str(info.value)


@pytest.mark.slow  # seconds, no model: out of the fast subset
def test_a_socket_in_a_directory_others_can_write_is_refused(short_tmpdir):
    d = short_tmpdir()
    os.chmod(d, 0o777)  # as /tmp/tandem-<uid> would be if another user made it first
    fake = FakeDaemon(d / "tandem.sock")
    try:
        refused(fake.path, "writable by other users")
        assert fake.received() == b""  # not even a connection
    finally:
        fake.close()
    out = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "--socket", str(fake.path), "run", "--no-start", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "writable by other users" in out.stderr and f"chmod 700 {d}" in out.stderr


needs_root = pytest.mark.skipif(os.getuid() != 0, reason="making a file of another uid needs root")


@needs_root
def test_a_socket_of_another_user_is_refused(short_tmpdir):
    d = short_tmpdir()
    fake = FakeDaemon(d / "tandem.sock")
    try:
        os.chown(fake.path, 65534, -1)
        refused(fake.path, "belongs to uid 65534")
        os.chown(fake.path, os.getuid(), -1)
        os.chown(d, 65534, -1)
        refused(fake.path, "socket directory .* belongs to uid 65534")
        assert fake.received() == b""
    finally:
        fake.close()


@needs_root
def test_a_listener_running_as_another_user_is_refused(short_tmpdir):
    """The socket file and its directory are ours, but the process behind it is not."""
    d = short_tmpdir()
    path = d / "tandem.sock"
    code = (
        "import os, socket, sys, time\n"
        "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1])\n"  # the file is ours (root's)
        "os.setuid(65534); s.listen(4)\n"  # SO_PEERCRED records who listens
        "print('up', flush=True)\n"
        "c, _ = s.accept(); time.sleep(1)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        refused(path, "runs as uid 65534")
    finally:
        proc.kill()
        proc.wait()
