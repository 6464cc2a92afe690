"""An rpc-server on loopback must be the user's own: a loopback port is open to
every user, and a server started by another (on the port of yours while it was
down) would get the prompts' activations. Before llama.cpp connects, the daemon
looks up who owns the server's socket (/proc/net/tcp) and refuses another
uid's unless rpc_leaves_machine. The other user is uid 65534 (nobody), which
needs root to become."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import struct

import llama_cpp
import pytest

from tandem.daemon.models.devices import DeviceError, _reachable

needs_root = pytest.mark.skipif(os.getuid() != 0, reason="acting as another user (uid 65534) needs root")


def _serve_hello(port: int, ready_w: int) -> None:
    """In a forked child, as the uid it was set to: answer llama.cpp's RPC HELLO
    (protocol 7.0) to every connection on 127.0.0.1:port."""
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen(8)
    os.write(ready_w, b"1")
    while True:
        c, _ = s.accept()
        c.recv(1 + 8 + 24)
        c.sendall(struct.pack("<Q", 28) + bytes([7, 0, 0, 0]) + bytes(24))
        c.close()


@pytest.fixture
def server_of(free_port):
    """``server_of(uid)``: a HELLO-answering server of that uid (its socket created
    as that uid, as /proc/net/tcp then says); returns its HOST:PORT."""
    pids = []

    def start(uid: int) -> str:
        port = free_port()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: become uid, then listen (a socket is its creator's)
            try:
                os.close(r)
                os.setgid(uid)
                os.setuid(uid)
                _serve_hello(port, w)
            finally:
                os._exit(0)
        os.close(w)
        pids.append(pid)
        assert os.read(r, 1) == b"1"
        os.close(r)
        return f"127.0.0.1:{port}"

    yield start
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


@needs_root
def test_another_users_rpc_server_is_refused(server_of):
    theirs = server_of(65534)
    with pytest.raises(DeviceError, match=r"is a process of uid 65534, not yours \(uid 0\).*rpc_leaves_machine"):
        _reachable(theirs)
    _reachable(theirs, other_users=True)  # the user said they trust it
    _reachable(server_of(os.getuid()))  # one's own is fine


@needs_root
def test_the_daemon_will_not_start_on_another_users_rpc_server(server_of, daemon_process, smollm2_path):
    theirs = server_of(65534)
    d = daemon_process(smollm2_path, "--ctx-size", "512", "--rpc", theirs)
    try:
        assert d.proc.wait(60) == 1
        if llama_cpp.llama_supports_rpc():
            assert f"the rpc-server at {theirs} is a process of uid 65534, not yours" in d.log()
        else:  # it stops before: no RPC backend to use (tests/integration/test_devices.py)
            assert "built without llama.cpp's RPC backend" in d.log()
    finally:
        d.stop()
        d.cleanup()


def test_the_owner_check_reads_the_kernels_table(tmp_path):
    """Without root: the same check against a /proc/net/tcp that lists the
    server's end of our connection as another uid's, then as ours."""
    from tandem.daemon.front.tcp_owner import _hex_address
    from tandem.daemon.models.devices import _same_user

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        with socket.create_connection(listener.getsockname()) as sock:
            peer, local = sock.getpeername(), sock.getsockname()
            endpoint = f"{peer[0]}:{peer[1]}"

            def table(uid: int) -> None:
                ip = ipaddress.ip_address
                row = f"0: {_hex_address(ip(peer[0]), peer[1])} {_hex_address(ip(local[0]), local[1])} 01 0 0 0 {uid}"
                (tmp_path / "tcp").write_text("  sl  local_address rem_address   st ...\n" + row + "\n")

            table(os.getuid() + 1)
            with pytest.raises(DeviceError, match=f"is a process of uid {os.getuid() + 1}, not yours"):
                _same_user(endpoint, sock, proc=tmp_path)
            table(os.getuid())
            _same_user(endpoint, sock, proc=tmp_path)
            (tmp_path / "tcp").write_text("  sl  local_address rem_address   st ...\n")  # not listed: unknown
            with pytest.raises(DeviceError, match="a process of an unknown user"):
                _same_user(endpoint, sock, proc=tmp_path)
