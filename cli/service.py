"""``tandem service install|uninstall|status|unit``: the daemon as a systemd user service.

The unit (``deploy/tandem.service`` is this template rendered for a
``pip install --user`` layout) runs ``tandem serve`` with ``Type=notify``: the
daemon says READY=1 once the models are loaded and the socket is bound, pings
the watchdog from its main loop, and says STOPPING=1 on SIGTERM. Options come
from the config file (``tandem config show``); ``systemctl --user reload
tandem`` sends SIGHUP, which re-reads it.

The sandbox forbids network access beyond loopback, so a model must be on disk
before the service starts: ``install`` pulls the configured models first.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

from tandem.client import TandemError
from tandem.daemon import config

from .common import say

UNIT_NAME = "tandem.service"

UNIT_TEMPLATE = """\
# tandem: a private, local LLM daemon, as a systemd user service.
# Installed by `tandem service install`; options live in ~/.config/tandem/config.toml
# (`tandem config show`). `systemctl --user reload tandem` re-reads it (SIGHUP).
[Unit]
Description=tandem local LLM daemon (speculative decoding, prefix cache)
StartLimitIntervalSec=120
StartLimitBurst=5

[Service]
# READY=1 once the models are loaded and the socket is bound; STOPPING=1 on shutdown
Type=notify
NotifyAccess=main
ExecStart={exec_start} serve
ExecReload=/bin/kill -HUP $MAINPID
Restart=on-failure
RestartSec=2s
# exit 2 is a bad setting: restarting will not fix it (journalctl --user -u tandem says which)
RestartPreventExitStatus=2
# a large model takes a while to load; a model download asks for more time itself
TimeoutStartSec=5min
# SIGTERM: the running request is cancelled, queued ones get an error, the workers stop
TimeoutStopSec=30s
KillMode=mixed
# the daemon pings from its main loop; one that hangs is killed and restarted
WatchdogSec=30s
Environment=PYTHONUNBUFFERED=1
UMask=0077

# where it may write: the socket ($XDG_RUNTIME_DIR/tandem, made 0700 by the daemon), what it
# learns (~/.local/state/tandem), the model store (~/.cache/tandem); /dev/shm for the prefix cache.
# (systemd applies ProtectSystem= and PrivateTmp= to user units from version 253 on.)
ReadWritePaths=%t -%h/.local/state/tandem -%h/.cache/tandem
ProtectSystem=strict
PrivateTmp=yes
NoNewPrivileges=yes
# no network beyond loopback (the metrics endpoint on 127.0.0.1). A user manager may be unable
# to enforce the IP rules (they need cgroup BPF); the daemon itself opens nothing else either.
{sandbox}
[Install]
WantedBy=default.target
"""

SANDBOX = """\
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6
IPAddressDeny=any
IPAddressAllow=localhost
LockPersonality=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
SystemCallArchitectures=native
"""  # both units: loopback only, no privileges to gain

HTTP_UNIT_NAME = "tandem-http.service"

HTTP_UNIT_TEMPLATE = """\
# tandem's HTTP bridge (OpenAI, Ollama and Anthropic APIs on 127.0.0.1), as a systemd user
# service beside tandem.service, so an editor finds it after login. Installed by
# `tandem service install --http`; it serves only your user (see docs/security-and-reliability.md).
[Unit]
Description=tandem HTTP bridge (OpenAI, Ollama, Anthropic APIs on loopback)
Requires=tandem.service
After=tandem.service
PartOf=tandem.service

[Service]
Type=simple
ExecStart={exec_start} http --no-start --listen {listen}
Restart=on-failure
RestartSec=2s
# exit 2 is a bad setting (--listen): restarting will not fix it
RestartPreventExitStatus=2
Environment=PYTHONUNBUFFERED=1
UMask=0077
# it writes only its API key (~/.local/state/tandem) if --api-key asks for one
ReadWritePaths=-%h/.local/state/tandem
ProtectSystem=strict
PrivateTmp=yes
NoNewPrivileges=yes
{sandbox}
[Install]
WantedBy=default.target
"""

# deploy/tandem.service: the console script where `pip install --user` puts it
DEPLOY_EXEC_START = "%h/.local/bin/tandem"


def exec_start() -> str:
    """This installation's tandem: its interpreter, so a virtual environment needs no activation."""
    return f"{_quote(sys.executable)} -m tandem.cli"


def _quote(path: str) -> str:
    return f'"{path}"' if any(c.isspace() for c in path) else path


def render(command: Optional[str] = None) -> str:
    return UNIT_TEMPLATE.format(exec_start=command or exec_start(), sandbox=SANDBOX)


def render_http(command: Optional[str] = None, listen: str = "127.0.0.1:8642") -> str:
    return HTTP_UNIT_TEMPLATE.format(exec_start=command or exec_start(), listen=listen, sandbox=SANDBOX)


def unit_dir(environ=os.environ) -> Path:
    base = environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "systemd" / "user"


def systemctl_works() -> bool:
    """Whether a systemd user manager answers (not in a container without one, nor over plain ssh without lingering)."""
    if shutil.which("systemctl") is None:
        return False
    try:
        r = subprocess.run(["systemctl", "--user", "show-environment"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def _systemctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["systemctl", "--user", *args], capture_output=True, text=True, timeout=60)


def is_installed() -> bool:
    return (unit_dir() / UNIT_NAME).exists()


def writable_dirs() -> list[Path]:
    """What the unit lets the daemon write under home (ReadWritePaths=): they must exist first."""
    home = Path(os.path.expanduser("~"))
    return [home / ".local" / "state" / "tandem", home / ".cache" / "tandem"]


def install(say: Callable[[str], None], enable: bool = True, http: Optional[str] = None) -> int:
    """Write the daemon's unit (and, with ``http`` = a listen address, the bridge's), reload, enable, start."""
    for directory in writable_dirs():
        directory.mkdir(parents=True, exist_ok=True)
    units = [(UNIT_NAME, render())] + ([(HTTP_UNIT_NAME, render_http(listen=http))] if http else [])
    steps: list[tuple[str, ...]] = [("daemon-reload",)]
    restarts = []
    for name, text in units:
        path = unit_dir() / name
        path.parent.mkdir(parents=True, exist_ok=True)
        previous = path.read_text() if path.exists() else None
        path.write_text(text)
        say(f"{'updated' if previous not in (None, text) else 'wrote'} {path}")
        if enable:
            steps.append(("enable", "--now", name))
            if previous is not None:
                restarts.append(("restart", name))  # pick up a changed unit or tandem version
    return _run_steps(steps + restarts, say)


def uninstall(say: Callable[[str], None]) -> int:
    http = unit_dir() / HTTP_UNIT_NAME
    if http.exists():  # the bridge first: it needs the daemon
        steps_http: list[tuple[str, ...]] = [("disable", "--now", HTTP_UNIT_NAME)] if systemctl_works() else []
        code = _run_steps(steps_http, say)
        if code:
            return code
        http.unlink()
        say(f"removed {http}")
    path = unit_dir() / UNIT_NAME
    if not path.exists():
        say(f"{path} does not exist: the service is not installed")
        return _run_steps([("daemon-reload",)], say) if not http.exists() else 0
    steps: list[tuple[str, ...]] = [("disable", "--now", UNIT_NAME)]
    if systemctl_works():
        code = _run_steps(steps, say)
        if code:
            return code
        steps = []
    path.unlink()
    say(f"removed {path}")
    return _run_steps(steps + [("daemon-reload",)], say)


def status(say: Callable[[str], None]) -> int:
    path = unit_dir() / UNIT_NAME
    if not path.exists():
        say(f"not installed ({path} does not exist); install it with `tandem service install`")
        return 3
    say(f"installed: {path}")
    if not systemctl_works():
        say("no systemd user manager answers here; check it with: systemctl --user status tandem")
        return 0
    r = _systemctl("status", "--no-pager", UNIT_NAME)
    print(r.stdout, end="")
    return r.returncode


def _run_steps(steps: list[tuple[str, ...]], say: Callable[[str], None]) -> int:
    if not steps:
        return 0
    if not systemctl_works():
        say("no systemd user manager answers here (systemctl --user). Run these where one does:")
        for step in steps:
            say("  systemctl --user " + " ".join(shlex.quote(a) for a in step))
        return 0
    for step in steps:
        r = _systemctl(*step)
        say(
            "systemctl --user "
            + " ".join(step)
            + (" ... ok" if r.returncode == 0 else f" ... failed: {r.stderr.strip()}")
        )
        if r.returncode != 0:
            return 1
    return 0


# --------------------------------------------------------------------------- the command


def add_service(sub) -> None:
    p = sub.add_parser(
        "service",
        help="run the daemon as a systemd user service",
        description="Install, remove or inspect the systemd user service (~/.config/systemd/user/tandem.service, "
        "Type=notify with a watchdog, sandboxed to loopback). Its options come from the config file; "
        "`systemctl --user reload tandem` re-reads it.",
    )
    ssub = p.add_subparsers(dest="service_command", metavar="ACTION")
    pp = ssub.add_parser(
        "install", help="pull the configured models, write the unit, reload systemd, enable and start it"
    )
    pp.add_argument(
        "--no-start", action="store_true", help="write the unit and reload systemd, but do not enable or start it"
    )
    pp.add_argument(
        "--http",
        nargs="?",
        const="127.0.0.1:8642",
        default=None,
        metavar="HOST:PORT",
        help="also install the HTTP bridge as tandem-http.service (default address 127.0.0.1:8642), so editors "
        "find the OpenAI, Ollama and Anthropic APIs after login",
    )
    ssub.add_parser("uninstall", help="stop and disable the service (and the bridge's), remove the units")
    ssub.add_parser("status", help="whether the unit is installed, and systemctl's status of it")
    pu = ssub.add_parser("unit", help="print the unit this installation would write")
    pu.add_argument("--http", action="store_true", help="the bridge's unit (tandem-http.service)")


def cmd_service(args) -> int:
    if args.service_command == "install":
        return _install_command(args)
    if args.service_command == "uninstall":
        return uninstall(say)
    if args.service_command == "status":
        return status(say)
    if args.service_command == "unit":
        print(render_http() if args.http else render(), end="")
        return 0
    say("usage: tandem service {install [--no-start] | uninstall | status | unit}")
    return 2


def _install_command(args) -> int:
    from .autostart import daemon_answers

    st = args.settings
    if not args.no_start and daemon_answers(args.socket) and not is_installed():
        raise TandemError(
            f"a daemon already serves {args.socket} outside systemd; the service cannot start while it runs. "
            "Stop it with `tandem stop`, then install again"
        )
    local = [f"{k} (from {src})" for k, src in st.sources.items() if src.startswith(("flag", "environment"))]
    if local or args.config is not None or os.environ.get("TANDEM_CONFIG"):
        say(
            "note: the service reads only its config file, "
            f"{config.default_config_path()}; these settings of this shell will not reach it: "
            + ", ".join(
                local + (["--config / TANDEM_CONFIG"] if args.config or os.environ.get("TANDEM_CONFIG") else [])
            )
        )
    if args.http is not None:
        from tandem.bridge.server import parse_listen

        try:
            parse_listen(args.http)
        except ValueError as exc:
            raise TandemError(str(exc)) from None
    _pull_configured(st)
    return install(say, enable=not args.no_start, http=args.http)


def _pull_configured(settings) -> None:
    """The service may not reach the network: pull its models now."""
    from .autostart import ensure_pulled

    for name in (settings.values.model, settings.values.drafter):
        ensure_pulled(name, say, f"tandem: pulling '{name}' first (the service is sandboxed to loopback and cannot)")
    # ... nor fetch llama-cpp-python's sources for tandem's CPU kernels: built now (where that fails, the
    # service runs llama.cpp's own kernels and its log says why, as any daemon with --kernel-patch auto)
    from tandem.daemon import kernels

    if settings.values.kernel_patch != "off" and kernels.built() is None:
        try:
            kernels.check(
                settings.values.kernel_patch,
                say,
                "tandem: building tandem's CPU kernels first (the service cannot download their sources)",
            )
        except kernels.KernelBuildError as exc:  # (--kernel-patch on: the service would not start either)
            raise TandemError(str(exc)) from None
