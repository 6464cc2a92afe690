"""Every HTTP listener answers only a Host that names this machine exactly: a web
page that rebinds its own DNS name to 127.0.0.1 (``127.0.0.1.attacker.example``)
must not read the metrics or reach the bridge (the bridge's own case is in
tests/integration/test_openai_bridge.py)."""

from __future__ import annotations

import http.client
import os

import pytest

from tandem.daemon.config import is_loopback_host
from tandem.daemon.front.metrics import Metrics


@pytest.mark.parametrize(
    "host, ok",
    [
        ("127.0.0.1", True),
        ("127.0.0.1:8642", True),
        ("127.4.5.6:1", True),
        ("localhost", True),
        ("LOCALHOST:9464", True),
        ("[::1]", True),
        ("[::1]:9464", True),
        ("127.0.0.1.attacker.example", False),
        ("127.0.0.1.attacker.example:8642", False),
        ("localhost.attacker.example", False),
        ("127.0.0.1:80x", False),
        ("[::1]evil", False),
        ("::1", False),  # an IPv6 Host must be bracketed
        ("10.0.0.1", False),
        ("", False),
    ],
)
def test_only_exact_loopback_names_and_literals_are_loopback(host, ok):
    assert is_loopback_host(host) is ok


def get(addr: str, host: str) -> tuple[int, bytes]:
    name, _, port = addr.rpartition(":")
    conn = http.client.HTTPConnection(name.strip("[]"), int(port), timeout=10)
    conn.request("GET", "/metrics", headers={"Host": host})
    reply = conn.getresponse()
    body = reply.read()
    conn.close()
    return reply.status, body


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "[::1]:0"])
def test_the_metrics_endpoint_refuses_a_rebound_host(listen):
    import socket

    if ":" in listen.rpartition(":")[0] and not socket.has_ipv6:
        pytest.skip("this machine has no IPv6 loopback")  # the IPv4 case always runs
    live = dict(queue_depth=0, active=0, ready=1, memory={"daemon": 1, "target": 1}, uptime=1.0)
    metrics = Metrics(lambda: live)
    try:
        try:
            addr = metrics.serve(listen)
        except OSError as exc:
            if "::1" in listen:
                pytest.skip(f"no IPv6 loopback here: {exc}")
            raise
        status, body = get(addr, addr)
        assert status == 200 and b"tandem_" in body
        status, body = get(addr, "127.0.0.1.attacker.example:" + addr.rpartition(":")[2])
        assert status == 403 and b"loopback" in body
    finally:
        metrics.close()


def test_the_owner_of_a_loopback_connection_is_read_from_the_kernels_table(tmp_path):
    import socket

    from tandem.daemon.front.tcp_owner import NOT_FOUND, owner_uid

    srv = socket.socket(socket.AF_INET)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    client = socket.create_connection(srv.getsockname())
    conn, peer = srv.accept()
    try:
        assert owner_uid(peer, conn.getsockname()) == os.getuid()
        assert owner_uid(("127.0.0.1", 1), conn.getsockname()) == NOT_FOUND
    finally:
        client.close(), conn.close(), srv.close()
    # the kernel's spelling: 127.0.0.1:8642 -> 0100007F:21C2; uid in the 8th column
    (tmp_path / "tcp").write_text(
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 0100007F:9C40 0100007F:21C2 01 00000000:00000000 00:00000000 00000000  1234        0 1 1\n"
    )
    assert owner_uid(("127.0.0.1", 40000), ("127.0.0.1", 8642), proc=tmp_path) == 1234
    assert owner_uid(("::1", 40000), ("::1", 8642), proc=tmp_path) is None  # no tcp6 table: unknown


def test_a_dual_stack_client_to_an_ipv4_listener_is_found_in_tcp6():
    """Java and .NET open IPv6 sockets even for 127.0.0.1: the kernel lists them in
    tcp6 as ::ffff:127.0.0.1 while the listener sees an IPv4 peer."""
    import socket

    from tandem.daemon.front.tcp_owner import owner_uid

    srv = socket.socket(socket.AF_INET)
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    try:
        client = socket.socket(socket.AF_INET6)
        client.connect(("::ffff:127.0.0.1", srv.getsockname()[1]))
    except OSError as exc:
        srv.close()
        pytest.skip(f"this kernel has no dual-stack sockets: {exc}")
    conn, peer = srv.accept()
    try:
        assert owner_uid(peer, conn.getsockname()) == os.getuid()
        client.shutdown(socket.SHUT_WR)  # half-closed (FIN_WAIT): still the same owner
        assert owner_uid(peer, conn.getsockname()) == os.getuid()
    finally:
        client.close(), conn.close(), srv.close()
