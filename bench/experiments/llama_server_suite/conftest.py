"""Replaces llama.cpp's tools/server/tests/conftest.py when bench/experiments/llama_server_suite.py
runs that suite: its ServerProcess starts tandem (a daemon and `tandem http` on
the port the test asked for) or the real llama-server, on local models.

What is adapted, for both servers alike (they serve the same local models,
not the tiny ones the suite downloads from Hugging Face):
- the model: each preset's Hugging Face repository maps to a local model
  (MODELS below); a preset with none (embeddings, vision, the router) is not run;
- ``match_regex``: it checks one model's words; here it checks that there is text.
Nothing else: every assertion about status codes, fields and shapes stands.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

sys.modules.setdefault("wget", types.ModuleType("wget"))  # the suite's downloader; every model here is local

import pytest  # noqa: E402
import utils  # noqa: E402

TARGET = os.environ.get("TANDEM_SUITE_TARGET", "tandem")  # "tandem" or "llama-server"
MODELS: dict[str, str] = json.loads(os.environ["TANDEM_SUITE_MODELS"])  # Hugging Face repo -> local .gguf
LLAMA_SERVER = os.environ.get("TANDEM_SUITE_LLAMA_SERVER", "")
WORK = Path(tempfile.mkdtemp(prefix="tandem-suite-"))
atexit.register(shutil.rmtree, WORK, ignore_errors=True)


def _words(regex: str, text: str) -> bool:
    """The suite's match_regex names the words of its tiny story model: any text passes here."""
    return isinstance(text, str) and text != ""


utils.match_regex = _words
_original_start = utils.ServerProcess.start
_original_stop = utils.ServerProcess.stop


def _local_model(server) -> str:
    path = MODELS.get(server.model_hf_repo or "") or MODELS.get(server.model_hf_file or "")
    if path is None:
        pytest.skip(f"no local model stands in for {server.model_hf_repo}/{server.model_hf_file}")
    return path


def _start(self, timeout_seconds: int = utils.DEFAULT_HTTP_TIMEOUT) -> None:
    model = _local_model(self)
    if TARGET == "llama-server":
        self.model_hf_repo = self.model_hf_file = None
        self.model_file = model
        self.server_path = LLAMA_SERVER
        return _original_start(self, timeout_seconds)
    run = Path(tempfile.mkdtemp(dir=WORK))
    os.chmod(run, 0o700)
    env = {**os.environ, "XDG_STATE_HOME": str(run / "state"), "XDG_RUNTIME_DIR": str(run)}
    if self.api_key:
        key = run / "state" / "tandem" / "api-key"
        key.parent.mkdir(parents=True)
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, self.api_key.encode())
        os.close(fd)
    sock = run / "tandem.sock"
    cli = [sys.executable, "-m", "tandem.cli", "--socket", str(sock)]
    serve = [*cli, "serve", "--model", model, "--metrics-addr", "off", "--state-dir", str(run / "state")]
    if self.n_ctx:
        serve += ["--ctx-size", str(self.n_ctx)]
    self._tandem_log = log = open(run / "tandem.log", "w")
    self._tandem_daemon = subprocess.Popen(serve, stdout=log, stderr=log, env=env)
    utils.server_instances.add(self)  # stopped after the test, whatever happens next
    deadline = time.monotonic() + timeout_seconds
    from tandem.client import Client

    while True:
        if self._tandem_daemon.poll() is not None:
            raise RuntimeError(f"tandem serve exited: {(run / 'tandem.log').read_text()[-2000:]}")
        try:
            with Client(sock, connect_timeout=1) as c:
                if c.status().state == "ready":
                    break
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("tandem serve did not become ready")
        time.sleep(0.1)
    bridge = [*cli, "http", "--listen", f"{self.server_host}:{self.server_port}", "--no-start"]
    bridge += ["--api-key", "on" if self.api_key else "off"]
    self.process = subprocess.Popen(bridge, stdout=log, stderr=log, env=env)
    while True:
        try:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
            if self.make_request("GET", "/health", headers=headers).status_code == 200:
                self.ready = True
                return
        except Exception:
            pass
        if self.process.poll() is not None:
            raise RuntimeError(f"tandem http exited: {(run / 'tandem.log').read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError("tandem http did not answer /health")
        time.sleep(0.05)


def _stop(self) -> None:
    daemon = getattr(self, "_tandem_daemon", None)
    _original_stop(self)  # the bridge (or llama-server)
    if daemon is not None:
        daemon.terminate()
        try:
            daemon.wait(20)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(5)
        self._tandem_daemon = None
        self._tandem_log.close()


utils.ServerProcess.start = _start
utils.ServerProcess.stop = _stop


@pytest.fixture(autouse=True)
def stop_server_after_each_test():
    yield
    for server in set(utils.server_instances):
        server.stop()
