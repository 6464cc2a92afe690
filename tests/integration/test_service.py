"""The systemd user unit: it verifies, and `tandem service` installs and removes it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.cli import service

ROOT = Path(__file__).resolve().parents[2]


def verify(short_tmpdir, unit_text: str) -> subprocess.CompletedProcess:
    """systemd-analyze verify --user on the unit, in a scratch directory (Debian: apt-get install systemd)."""
    assert shutil.which("systemd-analyze"), "systemd-analyze is missing: apt-get install systemd"
    work = short_tmpdir()
    runtime = work / "runtime"
    runtime.mkdir(mode=0o700)
    (work / service.UNIT_NAME).write_text(unit_text)
    return subprocess.run(
        ["systemd-analyze", "verify", "--user", str(work / service.UNIT_NAME)],
        capture_output=True,
        text=True,
        env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)},
        timeout=60,
    )


def test_the_unit_this_installation_writes_verifies_cleanly(short_tmpdir):
    out = verify(short_tmpdir, service.render())
    assert out.returncode == 0 and out.stderr == "", out.stderr


def test_verification_catches_a_broken_unit(short_tmpdir):
    bad = service.render().replace("Type=notify", "Type=notifyy")
    out = verify(short_tmpdir, bad)
    assert "Failed to parse service type" in out.stderr
    missing = verify(short_tmpdir, service.render("/nonexistent/tandem"))
    assert missing.returncode != 0 and "is not executable" in missing.stderr


def test_the_unit_is_type_notify_with_a_watchdog_and_loopback_only():
    unit = service.render()
    for line in (
        "Type=notify",
        "NotifyAccess=main",
        "WatchdogSec=",
        "Restart=on-failure",
        "ExecReload=/bin/kill -HUP $MAINPID",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6",
        "IPAddressDeny=any",
        "IPAddressAllow=localhost",
        "PrivateTmp=yes",
        "ProtectSystem=strict",
        "NoNewPrivileges=yes",
        "KillMode=mixed",
    ):
        assert line in unit
    assert f"ExecStart={sys.executable} -m tandem.cli serve" in unit


def test_deploy_file_is_the_template_rendered_for_a_user_install():
    assert (ROOT / "deploy" / "tandem.service").read_text() == service.render(service.DEPLOY_EXEC_START)


def tandem(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_install_refuses_while_a_daemon_runs_outside_systemd(start_daemon, tmp_path):
    d = start_daemon("--ctx-size", "256")
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config"), "TANDEM_SOCKET": str(d.socket)}
    out = tandem("service", "install", env=env)
    assert out.returncode == 1 and "Stop it with `tandem stop`" in out.stderr
    assert not (tmp_path / "config" / "systemd" / "user" / "tandem.service").exists()
    with d.client() as c:
        assert c.status().state == "ready"  # untouched


def test_install_and_uninstall_without_a_user_manager_write_the_unit_and_print_the_commands(
    short_tmpdir, tmp_path, smollm2_path
):
    if service.systemctl_works():
        pytest.fail("a systemd user manager answers here: this test would install a real service; run it in CI")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")},
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "TANDEM_SOCKET": str(short_tmpdir() / "none.sock"),
    }
    unit = tmp_path / "config" / "systemd" / "user" / "tandem.service"
    out = tandem("service", "status", env=env)
    assert out.returncode == 3 and "not installed" in out.stderr
    out = tandem("service", "install", env=env)
    assert out.returncode == 0, out.stderr
    assert unit.read_text() == service.render()
    assert (
        "systemctl --user daemon-reload" in out.stderr and "systemctl --user enable --now tandem.service" in out.stderr
    )
    out = tandem("service", "status", env=env)
    assert out.returncode == 0 and f"installed: {unit}" in out.stderr
    assert tandem("service", "unit", env=env).stdout == service.render()
    out = tandem("service", "uninstall", env=env)
    assert out.returncode == 0 and not unit.exists()
    assert "systemctl --user daemon-reload" in out.stderr


def test_the_bridges_unit_verifies_and_follows_the_daemon(short_tmpdir):
    """Issue 20, item 6: the HTTP bridge as a second user unit, started after the daemon's."""
    work = short_tmpdir()
    runtime = work / "runtime"
    runtime.mkdir(mode=0o700)
    (work / service.UNIT_NAME).write_text(service.render())
    (work / service.HTTP_UNIT_NAME).write_text(service.render_http())
    out = subprocess.run(
        ["systemd-analyze", "verify", "--user", str(work / service.HTTP_UNIT_NAME)],
        capture_output=True,
        text=True,
        env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)},
        timeout=60,
    )
    assert out.returncode == 0 and out.stderr == "", out.stderr
    unit = service.render_http(listen="127.0.0.1:9000")
    for line in (
        "Requires=tandem.service",
        "After=tandem.service",
        "http --no-start --listen 127.0.0.1:9000",
        "IPAddressDeny=any",
        "IPAddressAllow=localhost",
        "NoNewPrivileges=yes",
    ):
        assert line in unit, line


def test_install_http_writes_both_units_and_uninstall_removes_both(short_tmpdir, tmp_path, smollm2_path):
    if service.systemctl_works():
        pytest.fail("a systemd user manager answers here: this test would install a real service; run it in CI")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")},
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
        "TANDEM_SOCKET": str(short_tmpdir() / "none.sock"),
    }
    units = tmp_path / "config" / "systemd" / "user"
    out = tandem("service", "install", "--http", "localhost:9100", env=env)
    assert out.returncode == 0, out.stderr
    assert (units / "tandem-http.service").read_text() == service.render_http(listen="localhost:9100")
    assert "systemctl --user enable --now tandem-http.service" in out.stderr
    assert tandem("service", "unit", "--http", env=env).stdout == service.render_http()
    bad = tandem("service", "install", "--http", "0.0.0.0:9100", env=env)
    assert bad.returncode == 1 and "not a loopback address" in bad.stderr
    out = tandem("service", "uninstall", env=env)
    assert (
        out.returncode == 0 and not (units / "tandem-http.service").exists() and not (units / "tandem.service").exists()
    )
