"""Start a daemon in the background when ``tandem run`` finds none."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from tandem.client import Client, DaemonNotRunning, TandemError
from tandem.daemon import config


def state_dir() -> Path:
    return config.default_state_dir()


def daemon_answers(socket_path: Path) -> bool:
    try:
        with Client(socket_path, connect_timeout=2.0) as client:
            client.connect()
        return True
    except DaemonNotRunning:
        return False


def ensure_pulled(name: str, say, why: str) -> None:
    """Pull preset or ``hf.co/`` model ``name`` in the foreground, with progress, unless it is there
    (saying ``why`` first)."""
    from tandem.daemon import models  # the daemon side is only needed to start one

    try:
        if models.needs_pull(name):
            say(why)
            models.pull_any(name, progress=say, show_progress=sys.stderr.isatty())
    except models.ModelError as exc:  # (also a malformed hf.co/ name)
        raise TandemError(str(exc)) from None


def build_kernels(say, config_file: Optional[Path] = None) -> None:
    """tandem's CPU kernels, built in the foreground with progress where the daemon would build them at
    its start (--kernel-patch auto or on: once per llama-cpp-python and CPU)."""
    from tandem.daemon import config, kernels

    try:
        setting = config.load({}, config_file).values.kernel_patch
    except config.ConfigError:
        return  # (the daemon says what is wrong with the file)
    if setting == "off" or kernels.built() is not None:
        return
    try:
        kernels.check(
            setting,
            say,
            "tandem: building tandem's CPU kernels first (once for this llama-cpp-python and CPU; about a minute)",
        )
    except kernels.KernelBuildError as exc:
        raise TandemError(str(exc)) from None


def start_daemon(
    socket_path: Path,
    model: str,
    say=lambda line: print(line, file=sys.stderr, flush=True),
    config_file: Optional[Path] = None,
) -> int:
    """Pull the model if needed (in the foreground, with progress), then spawn
    ``tandem serve`` detached, and wait until it answers. Returns its pid."""
    ensure_pulled(model, say, f"tandem: pulling the model '{model}' first")
    build_kernels(say, config_file)
    log_dir = state_dir()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / "daemon.log"
    cmd = [sys.executable, "-m", "tandem.cli", "--socket", str(socket_path)]
    if config_file is not None:
        cmd += ["--config", str(config_file)]  # the rest of the settings: as this command read them
    cmd += ["serve", "--model", model]
    with open(log_path, "ab") as log:
        start = log.tell()  # this daemon's lines start here: an earlier daemon's failure is not its
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True
        )
    say(f"tandem: no daemon was running; starting one in the background (model {model}, log {log_path})")

    def own_lines() -> list[str]:
        with open(log_path, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace").splitlines()

    deadline = time.monotonic() + 300  # loading a large model takes a while
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = own_lines()[-5:] or ["(it wrote nothing)"]
            raise TandemError(f"the daemon exited at start (code {proc.returncode}):\n  " + "\n  ".join(tail))
        if socket_path.exists() and daemon_answers(socket_path):
            state, failure = _state(socket_path)
            if state == "ready":  # "started" only once the model is loaded
                say(f"tandem: started it (pid {proc.pid}, socket {socket_path}); stop it with `tandem stop`")
                return proc.pid
            if state == "failed":
                raise TandemError(f"the daemon exited at start: {failure} (log: {log_path})")
        time.sleep(0.1)
    raise TandemError(f"the daemon was not ready within 300 s; see {log_path}")


def _state(socket_path: Path) -> tuple[str, str]:
    try:
        with Client(socket_path, connect_timeout=2) as client:
            st = client.status()
        return st.state, st.failure
    except TandemError:
        return "starting", ""
