"""`tandem pull hf.co/ORG/REPO[:QUANT]` against a local stand-in for the Hugging
Face hub (tests/fake_hub.py) serving SmolLM2's GGUF: ``huggingface_hub`` talks
to it through ``HF_ENDPOINT``, as it would to the hub; nothing reaches the
real one. Each test has a model store of its own."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fake_hub import FakeHub
from tests.shared_kernels import share_kernels

REPO = "tandem-test/SmolLM2-135M-Instruct-GGUF"
Q4 = "SmolLM2-135M-Instruct-Q4_1.gguf"
Q8 = "SmolLM2-135M-Instruct-Q8_0.gguf"  # (the same bytes under a second quant's name: a listing of two)


@pytest.fixture
def hub(smollm2_path):
    h = FakeHub()
    h.add(REPO, {Q4: smollm2_path, Q8: smollm2_path})
    h.start()
    yield h
    h.stop()


@pytest.fixture
def env(tmp_path, hub, cpu_kernels):
    share_kernels(tmp_path / "cache")
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "HF_"))},
        "XDG_CACHE_HOME": str(tmp_path / "cache"),  # the model store: this test's own
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_ENDPOINT": hub.url,
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }


def tandem(env: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def store(env: dict) -> Path:
    return Path(env["XDG_CACHE_HOME"]) / "tandem" / "models" / "hf" / REPO


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_pull_by_repo_and_quant_then_list_show_and_rm_with_no_network_for_what_is_there(env, hub, smollm2_path):
    done = tandem(env, "pull", f"hf.co/{REPO}:q4_1")
    assert done.returncode == 0, done.stderr
    assert "sha256 verified" in done.stderr
    path = store(env) / Q4
    assert sha256(path) == sha256(smollm2_path)
    assert hub.sent[f"{REPO}/{Q4}"] == smollm2_path.stat().st_size and f"{REPO}/{Q8}" not in hub.sent
    asked = len(hub.requests)
    again = tandem(env, "pull", f"hf.co/{REPO}:Q4_1")
    assert again.returncode == 0 and "already present" in again.stderr
    assert len(hub.requests) == asked  # pulled: not a single call to the hub
    listed = tandem(env, "list")
    assert f"hf.co/{REPO}:Q4_1" in listed.stdout and str(path) in listed.stdout
    shown = tandem(env, "show", f"hf.co/{REPO}:Q4_1")
    assert shown.returncode == 0, shown.stderr
    assert f"Hugging Face {REPO}" in shown.stdout and "Q4_1" in shown.stdout
    removed = tandem(env, "rm", f"hf.co/{REPO}:Q4_1")
    assert removed.returncode == 0, removed.stderr
    assert not path.exists() and not store(env).exists()
    assert f"hf.co/{REPO}" not in tandem(env, "list").stdout
    assert len(hub.requests) == asked


def test_a_missing_quant_names_the_quants_the_repository_has(env, hub):
    done = tandem(env, "pull", f"hf.co/{REPO}:Q5_K_M")
    assert done.returncode != 0
    assert "no Q5_K_M GGUF" in done.stderr and "Q4_1, Q8_0" in done.stderr and "tandem pull hf.co/" in done.stderr
    default = tandem(env, "pull", f"hf.co/{REPO}")  # Q4_K_M, the default, is not there either
    assert default.returncode != 0 and "no Q4_K_M GGUF (the default)" in default.stderr
    missing = tandem(env, "pull", "hf.co/tandem-test/no-such-repo")
    assert missing.returncode != 0 and "no repository tandem-test/no-such-repo" in missing.stderr
    assert not hub.sent and not store(env).exists()


def test_a_corrupted_download_is_refused_and_nothing_is_kept(env, hub):
    hub.repos[REPO][Q4].corrupt = True
    done = tandem(env, "pull", f"hf.co/{REPO}:Q4_1")
    assert done.returncode != 0
    assert "not the hub's" in done.stderr and "nothing kept" in done.stderr
    leftovers = [p for p in store(env).rglob("*") if p.is_file()] if store(env).exists() else []
    assert [p.name for p in leftovers if p.name != ".lock"] == []  # (the pulls' lock file may stay)
    serve = tandem(env, "show", f"hf.co/{REPO}:Q4_1")
    assert serve.returncode != 0 and "not pulled yet" in serve.stderr


def test_a_pull_killed_half_way_resumes_from_what_it_had(env, hub, smollm2_path):
    size = smollm2_path.stat().st_size
    hub.rate = size // 8  # about 8 s for the file: time to kill it half-way
    key = f"{REPO}/{Q4}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "pull", f"hf.co/{REPO}:Q4_1"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while hub.sent.get(key, 0) < size // 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    first = hub.sent[key]
    assert size // 2 <= first < size
    hub.rate = None
    done = tandem(env, "pull", f"hf.co/{REPO}:Q4_1")
    assert done.returncode == 0, done.stderr
    assert "resuming" in done.stderr
    second = hub.sent[key] - first
    assert second < size - size // 3  # the second pull fetched only what the first had not
    assert sha256(store(env) / Q4) == sha256(smollm2_path)
    assert not (store(env) / ".partial").exists()


def test_a_pulled_model_starts_with_the_hub_down_and_offline_mode_names_the_fix(env, hub, daemon_process):
    assert tandem(env, "pull", f"hf.co/{REPO}:Q4_1").returncode == 0
    hub.stop()
    d = daemon_process(f"hf.co/{REPO}:Q4_1", "--ctx-size", "512", env=env)
    try:
        d.wait_ready()
        with d.client() as c:
            assert c.status().model.name == f"hf.co/{REPO}:Q4_1"
            assert c.complete(prompt="The capital of France is", max_tokens=4, temperature=0).usage.completion_tokens
    finally:
        d.stop()
        d.cleanup()
    offline = tandem({**env, "HF_HUB_OFFLINE": "1"}, "pull", f"hf.co/{REPO}:Q8_0")
    assert offline.returncode != 0 and "HF_HUB_OFFLINE is set" in offline.stderr


def test_serve_pulls_a_hub_model_on_first_use(env, hub, daemon_process):
    d = daemon_process(f"hf.co/{REPO}:Q8_0", "--ctx-size", "512", env=env)
    try:
        d.wait_ready(timeout=120)
        with d.client() as c:
            assert c.status().model.name == f"hf.co/{REPO}:Q8_0"
    finally:
        d.stop()
        d.cleanup()
    assert (store(env) / Q8).is_file() and f"{REPO}/{Q8}" in hub.sent


def test_a_split_gguf_is_pulled_whole_and_served_from_its_first_part(env, hub, smollm2_path, tmp_path, daemon_process):
    from tests.gguf_split import split_gguf

    parts = split_gguf(smollm2_path, tmp_path / "src" / "SmolLM2-135M-Instruct-Q4_1.gguf", 3)
    assert len(parts) == 3
    hub.add("tandem-test/SmolLM2-split-GGUF", {f"Q4_1/{p.name}": p for p in parts})  # (in a folder, as some are)
    done = tandem(env, "pull", "hf.co/tandem-test/SmolLM2-split-GGUF")  # one quant there: that one
    assert done.returncode == 0, done.stderr
    assert "in 3 parts" in done.stderr
    folder = Path(env["XDG_CACHE_HOME"]) / "tandem" / "models" / "hf" / "tandem-test" / "SmolLM2-split-GGUF"
    assert sorted(p.name for p in folder.glob("*.gguf")) == [p.name for p in parts]
    assert all(sha256(folder / p.name) == sha256(p) for p in parts)
    hub.stop()
    d = daemon_process("hf.co/tandem-test/SmolLM2-split-GGUF", "--ctx-size", "512", env=env)
    try:
        d.wait_ready()
        with d.client() as c:
            split = c.complete(prompt="The capital of France is", max_tokens=8, temperature=0).text
    finally:
        d.stop()
        d.cleanup()
    whole = daemon_process(smollm2_path, "--ctx-size", "512")
    try:
        whole.wait_ready()
        with whole.client() as c:
            assert c.complete(prompt="The capital of France is", max_tokens=8, temperature=0).text == split
    finally:
        whole.stop()
        whole.cleanup()


def test_run_with_a_hub_model_starts_a_daemon_on_it_and_takes_its_name_in_any_spelling(env, hub, tmp_path):
    sock = str(tmp_path / "run.sock")
    env = {**env, "XDG_STATE_HOME": str(tmp_path / "state"), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    bad = tandem(env, "--socket", sock, "run", "--model", "hf.co/justone", "Hi")  # (no daemon: it would start one)
    assert bad.returncode != 0 and "hf.co/ORG/REPO" in bad.stderr and "Traceback" not in bad.stderr
    try:
        first = tandem(env, "--socket", sock, "run", "--model", f"hf.co/{REPO}:q4_1", "--max-tokens", "4", "Hi")
        assert first.returncode == 0, first.stderr  # pulled, started, answered
        again = tandem(
            env, "--socket", sock, "run", "--model", f"huggingface.co/{REPO}:Q4_1", "--max-tokens", "4", "Hi"
        )
        assert again.returncode == 0, again.stderr  # the daemon's hf.co/...:Q4_1 is the model asked for
    finally:
        tandem(env, "--socket", sock, "stop")
