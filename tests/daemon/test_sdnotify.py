"""sd_notify against a real datagram socket, as systemd listens for it."""

from __future__ import annotations

import os
import socket
import uuid

import pytest

from tandem.daemon.front import sdnotify


@pytest.fixture
def listener(tmp_path):
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2)
    yield path, sock
    sock.close()


def test_from_environment_sends_to_a_path_and_clears_the_variables(listener):
    path, sock = listener
    env = {"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "4000000", "WATCHDOG_PID": str(os.getpid())}
    n = sdnotify.Notifier.from_environment(env)
    assert env == {}  # workers started later must not inherit them
    assert n.watchdog_interval == 2.0
    n.ready("serving x")
    assert sdnotify.parse(sock.recv(4096)) == {"READY": "1", "STATUS": "serving x"}
    n.stopping()
    assert sdnotify.parse(sock.recv(4096))["STOPPING"] == "1"
    n.reloading()
    msg = sdnotify.parse(sock.recv(4096))
    assert msg["RELOADING"] == "1" and int(msg["MONOTONIC_USEC"]) > 0
    n.extend_timeout(120)
    assert sdnotify.parse(sock.recv(4096)) == {"EXTEND_TIMEOUT_USEC": "120000000"}


def test_watchdog_pings_only_when_due(listener):
    path, sock = listener
    n = sdnotify.Notifier(str(path), watchdog_usec=2_000_000)  # ping every second
    n.watchdog(now=100.0)
    assert sdnotify.parse(sock.recv(4096)) == {"WATCHDOG": "1"}
    n.watchdog(now=100.5)  # not due
    n.watchdog(now=101.0)
    assert sdnotify.parse(sock.recv(4096)) == {"WATCHDOG": "1"}
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        sock.recv(4096)  # exactly two pings


def test_abstract_socket_names():
    name = f"tandem-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(2)
    try:
        sdnotify.Notifier.from_environment({"NOTIFY_SOCKET": "@" + name}).ready("ok")
        assert sdnotify.parse(sock.recv(4096))["READY"] == "1"
    finally:
        sock.close()


def test_outside_systemd_everything_is_a_no_op():
    n = sdnotify.Notifier.from_environment({})
    assert not n.enabled and n.send(ready=1) is False
    n.watchdog()


def test_a_watchdog_meant_for_another_process_is_ignored(listener):
    path, _ = listener
    n = sdnotify.Notifier.from_environment(
        {"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}
    )
    assert n.enabled and n.watchdog_interval == 0


def test_a_vanished_socket_is_logged_once_and_never_raises(tmp_path, caplog):
    n = sdnotify.Notifier(str(tmp_path / "gone"))
    assert n.send(ready=1) is False and n.send(status="x") is False
    assert sum("could not notify systemd" in r.message for r in caplog.records) == 1
