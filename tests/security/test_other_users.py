"""Another local user reaches neither the bridge nor the metrics endpoint: a
loopback TCP port is open to every user of the machine, so each listener looks
up who owns the connecting socket (/proc/net/tcp) and answers another uid with
403. The other user is uid 65534 (nobody), which needs root to become."""

from __future__ import annotations

import os
import subprocess

import pytest

from tandem.daemon.front.metrics import Metrics

pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="acting as another user (uid 65534) needs root")


def get_as(uid: int, host: str, port: int, path: str) -> str:
    """``curl`` (a system binary another user can run) as ``uid``: "STATUS BODY"."""

    def become():
        os.setgid(uid)
        os.setuid(uid)

    out = subprocess.run(
        ["curl", "-s", "-w", "\\n%{http_code}", f"http://{host}:{port}{path}"],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=become if uid != os.getuid() else None,
        cwd="/",
    )
    assert out.returncode == 0, out.stderr
    body, _, status = out.stdout.rpartition("\n")
    return f"{status} {body}"


def test_the_metrics_endpoint_serves_only_its_user():
    live = dict(queue_depth=0, active=0, ready=1, memory={"daemon": 1, "target": 1}, uptime=1.0)
    metrics = Metrics(lambda: live)
    try:
        host, _, port = metrics.serve("127.0.0.1:0").rpartition(":")
        assert get_as(os.getuid(), host, int(port), "/metrics").startswith("200 ")
        other = get_as(65534, host, int(port), "/metrics")
        assert other.startswith("403 ") and "uid 65534" in other and "tandem_" not in other
    finally:
        metrics.close()


def test_metrics_other_users_lets_another_user_scrape():
    """A packaged Prometheus runs as its own user: metrics_other_users = on lets it in."""
    live = dict(queue_depth=0, active=0, ready=1, memory={"daemon": 1, "target": 1}, uptime=1.0)
    metrics = Metrics(lambda: live)
    try:
        host, _, port = metrics.serve("127.0.0.1:0", other_users=True).rpartition(":")
        assert get_as(65534, host, int(port), "/metrics").startswith("200 ")
    finally:
        metrics.close()


def test_the_bridge_serves_only_its_user(daemon, bridge_process):
    bridge = bridge_process(daemon)
    try:
        host, _, rest = bridge.url.removeprefix("http://").partition(":")
        port = int(rest.split("/")[0])
        assert get_as(os.getuid(), host, port, "/v1/models").startswith("200 ")
        other = get_as(65534, host, port, "/v1/models")
        assert other.startswith("403 ") and "uid 65534" in other, other
    finally:
        assert bridge.stop() == 0
