"""The `tandem` command as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

# seconds for one command; one that starts a daemon loads a model (27 s alone here; 126 s once, with a compiler
# running beside the suite): the limit catches a hang, not a slow machine
TIMEOUT = 300


def tandem(*args: str, socket=None, env=None, input=None, timeout=TIMEOUT) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **(env or {})}
    full_env.pop("TANDEM_SOCKET", None)
    if socket is not None:
        full_env["TANDEM_SOCKET"] = str(socket)
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args],
        capture_output=True,
        text=True,
        env=full_env,
        input=input,
        timeout=timeout,
    )


@pytest.mark.slow  # seconds, no model: out of the fast subset
def test_help_explains_the_commands():
    out = tandem("--help")
    assert out.returncode == 0
    for command in ("serve", "run", "chat", "status", "stop", "models"):
        assert command in out.stdout
    serve = tandem("serve", "--help").stdout
    assert "--model" in serve and "--ctx-size" in serve and "--max-queue" in serve


def test_run_json_matches_the_client(daemon, client):
    out = tandem(
        "run", "--raw", "--json", "--temperature", "0", "--max-tokens", "20", "The sky is", socket=daemon.socket
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result) >= {"text", "finish_reason", "usage", "timings", "request_id"}
    assert result["text"] == client.complete(prompt="The sky is", max_tokens=20, temperature=0.0).text
    assert result["usage"]["completion_tokens"] <= 20


def test_run_streams_a_chat_answer(daemon, client):
    out = tandem(
        "run",
        "--temperature",
        "0",
        "--max-tokens",
        "24",
        "--system",
        "Be brief.",
        "Name a fruit.",
        socket=daemon.socket,
    )
    assert out.returncode == 0, out.stderr
    expected = client.complete(
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}],
        max_tokens=24,
        temperature=0.0,
    ).text
    assert out.stdout == expected + "\n"


def test_run_reads_the_prompt_from_stdin(daemon, client):
    out = tandem("run", "-", "--raw", "--temperature", "0", "--max-tokens", "8", socket=daemon.socket, input="2 + 2 =")
    assert out.returncode == 0, out.stderr
    assert out.stdout == client.complete(prompt="2 + 2 =", max_tokens=8, temperature=0.0).text + "\n"


def test_run_reports_request_errors_clearly(daemon):
    out = tandem("run", "--raw", "--max-tokens", "4", "word " * 1500, socket=daemon.socket)
    assert out.returncode == 1
    assert "PROMPT_TOO_LONG" in out.stderr and "--ctx-size" in out.stderr


def test_status_human_and_json(daemon):
    out = tandem("status", socket=daemon.socket)
    assert out.returncode == 0, out.stderr
    for field in ("state:", "model:", "queue:", "memory:", " up "):
        assert field in out.stdout
    st = json.loads(tandem("status", "--json", socket=daemon.socket).stdout)
    assert st["state"] == "ready" and st["memory_rss_bytes"]["target"] > 50 * 2**20
    # PSS where Linux can say (smaps), no more than RSS, and what the human line shows
    assert set(st["memory_pss_bytes"]) == set(st["memory_rss_bytes"])
    for process, pss in st["memory_pss_bytes"].items():
        assert 0 < pss <= st["memory_rss_bytes"][process], process
    assert " MiB PSS (RSS " in out.stdout


def test_chat_keeps_the_conversation(daemon):
    out = tandem(
        "chat", "--temperature", "0", "--max-tokens", "12", socket=daemon.socket, input="Hello!\nAnd again?\n/exit\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("> ") == 3  # two turns answered, then /exit


@pytest.mark.slow  # seconds, no model: out of the fast subset
def test_without_a_daemon_commands_say_how_to_start_one(short_tmpdir):
    socket = short_tmpdir() / "none.sock"
    out = tandem("status", socket=socket)
    assert out.returncode == 1 and "tandem serve" in out.stderr
    out = tandem("run", "--no-start", "hi", socket=socket)
    assert out.returncode == 1 and "tandem serve" in out.stderr
    out = tandem("stop", socket=socket)
    assert out.returncode == 1 and "no tandem daemon" in out.stderr  # nothing was stopped: not a success


def test_run_starts_a_daemon_when_none_runs_and_stop_stops_it(short_tmpdir, smollm2_path):
    base = short_tmpdir()
    socket = base / "auto.sock"
    env = {"XDG_STATE_HOME": str(base / "state")}
    try:
        out = tandem("run", "--raw", "--temperature", "0", "--max-tokens", "5", "Hello", socket=socket, env=env)
        assert out.returncode == 0, out.stderr
        assert "starting one in the background" in out.stderr and "started it (pid" in out.stderr
        assert "tandem stop" in out.stderr
        assert out.stdout.strip()
        pid = json.loads(tandem("status", "--json", socket=socket).stdout)["pid"]
        again = tandem("run", "--raw", "--max-tokens", "3", "Hi", socket=socket, env=env)
        assert again.returncode == 0 and "started" not in again.stderr  # reuses the running daemon
        out = tandem("stop", socket=socket)
        assert out.returncode == 0 and "stopped" in out.stderr
        assert not socket.exists()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().split()[2] == "Z":
                        break  # exited; only waiting to be reaped by init
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the daemon process did not exit after `tandem stop`")
    finally:
        tandem("stop", socket=socket)


@pytest.mark.slow  # seconds, no model: out of the fast subset
def test_a_failed_auto_start_shows_its_own_log_lines_only(short_tmpdir, tmp_path):
    """A failed start used to print "started one" and then an earlier daemon's failure from the log."""
    base = short_tmpdir()
    state = base / "state"
    (state / "tandem").mkdir(parents=True)
    (state / "tandem" / "daemon.log").write_text("tandem serve: AN EARLIER DAEMON'S FAILURE\n")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(64))  # exists, so the start gets as far as loading it
    out = tandem("run", "--model", str(broken), "hi", socket=base / "s.sock", env={"XDG_STATE_HOME": str(state)})
    assert out.returncode == 1
    assert "the daemon exited at start" in out.stderr and "EARLIER DAEMON" not in out.stderr
    assert "started it" not in out.stderr


@pytest.mark.slow  # seconds, no model: out of the fast subset
def test_models_list_and_bad_pull():
    out = tandem("models", "list")
    assert out.returncode == 0
    for name in ("smollm2-135m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
        assert name in out.stdout
    bad = tandem("models", "pull", "gpt-5")
    assert bad.returncode == 1 and "unknown preset" in bad.stderr and "smollm2-135m" in bad.stderr
