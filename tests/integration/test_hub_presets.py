"""The hub presets and ``--drafter auto`` end to end: ``tandem pull qwen2.5-coder-7b`` from a local stand-in
for the Hugging Face hub (tests/fake_hub.py, through ``HF_ENDPOINT``; nothing reaches the real one),
serving a file with the 7B's vocabulary (Qwen2.5-Coder-0.5B's token list padded to 152,064 ids, as the
7B's is; a header only, so it is pulled, listed and checked, not served); then daemons that choose their
drafter themselves, seen through the socket."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tandem.daemon import models
from tandem.daemon.models.drafter_auto import choose
from tests.fake_hub import COMMIT, FakeHub
from tests.gguf_vocab import tokens_of, write_header_gguf
from tests.shared_kernels import share_kernels

REPO = "Qwen/Qwen2.5-Coder-7B-Instruct-GGUF"
FILE = "qwen2.5-coder-7b-instruct-q4_k_m.gguf"  # (lower case, as Qwen's own repositories name them)


@pytest.fixture
def hub():
    h = FakeHub().start()
    yield h
    h.stop()


@pytest.fixture
def env(tmp_path, hub):
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "HF_"))},
        "XDG_CACHE_HOME": str(tmp_path / "cache"),  # the model store: this test's own
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_ENDPOINT": hub.url,
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }


def tandem(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args], env=env, capture_output=True, text=True, timeout=300
    )


def test_a_hub_preset_is_pulled_listed_and_given_its_drafter_once_that_is_pulled(
    tmp_path, hub, env, coder_path, monkeypatch
):
    qwen = tokens_of(coder_path)
    assert len(qwen) == 151_936
    padded = qwen + [f"[PAD{len(qwen) + i}]".encode() for i in range(128)]  # 152,064: the 7B's vocabulary
    hub.add(REPO, {FILE: write_header_gguf(tmp_path / "src" / FILE, padded, "qwen2")})
    pulled = tandem(env, "pull", "qwen2.5-coder-7b")
    assert pulled.returncode == 0, pulled.stderr
    described = "qwen2.5-coder-7b: Qwen2.5-Coder-7B-Instruct, Q4_K_M: fill in the middle, tools"
    assert f"{described}, from hf.co/{REPO}:Q4_K_M" in pulled.stderr
    assert "sha256 verified" in pulled.stderr
    path = tmp_path / "cache" / "tandem" / "models" / "hf" / REPO / FILE
    assert path.is_file()
    asked = len(hub.requests)
    listed = tandem(env, "list")
    assert "qwen2.5-coder-7b" in listed.stdout and str(path) in listed.stdout
    assert f"hf.co/{REPO}" not in listed.stdout  # (listed once, under the preset's name)
    assert "not pulled (tandem pull NAME): smollm2-135m" in listed.stdout and "qwen3-coder-30b-a3b" in listed.stdout
    shown = tandem(env, "show", "qwen2.5-coder-7b")
    assert f"Hugging Face {REPO} at {COMMIT[:12]} (Q4_K_M" in shown.stdout  # the revision it got
    again = tandem(env, "pull", "qwen2.5-coder-7b")
    assert again.returncode == 0 and "already present" in again.stderr
    assert len(hub.requests) == asked  # pulled: no call to the hub, for list, show or pull

    monkeypatch.setenv("XDG_CACHE_HOME", env["XDG_CACHE_HOME"])
    name, target = models.resolve("qwen2.5-coder-7b")
    assert (name, target) == ("qwen2.5-coder-7b", path)
    none = choose("qwen2.5-coder-7b", name, target)
    assert none.path is None and none.why.endswith("to draft with one: tandem pull qwen2.5-coder-0.5b")
    models.preset_path("qwen2.5-coder-0.5b").symlink_to(coder_path)  # (as `tandem pull qwen2.5-coder-0.5b` leaves it)
    got = choose("qwen2.5-coder-7b", name, target)  # 151,936 ids for 152,064: the same tokenizer, padded
    assert (got.name, got.path) == ("qwen2.5-coder-0.5b", models.preset_path("qwen2.5-coder-0.5b"))
    assert got.why == "auto: qwen2.5-coder-0.5b, the drafter for qwen2.5-coder-7b"
    removed = tandem(env, "rm", "qwen2.5-coder-7b")
    assert removed.returncode == 0, removed.stderr
    assert not path.exists()


def test_a_preset_pinned_to_a_revision_pulls_that_revision(tmp_path, hub, monkeypatch):
    from tandem.daemon.models import hub_presets

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    pinned = replace(hub_presets.HUB_PRESETS["qwen2.5-coder-7b"], revision=COMMIT)
    monkeypatch.setitem(hub_presets.HUB_PRESETS, "qwen2.5-coder-7b", pinned)
    hub.add(REPO, {FILE: write_header_gguf(tmp_path / "src" / FILE, [b"a", b"b"], "qwen2")})
    lines: list[str] = []
    path = models.pull_any("qwen2.5-coder-7b", lines.append)
    assert hub.requests[0] == f"info {REPO}@{COMMIT}"  # the file list of that commit, not of main
    assert any(f"from hf.co/{REPO}:Q4_K_M at {COMMIT[:12]}" in line for line in lines)
    assert json.loads((path.parent / "Q4_K_M.json").read_text())["revision"] == COMMIT


def store_with(tmp_path: Path, links: dict[str, Path]) -> dict:
    """The environment of a daemon whose model store holds ``links`` (preset name -> file)."""
    cache = tmp_path / "cache"
    store = cache / "tandem" / "models"
    store.mkdir(parents=True)
    for preset, source in links.items():
        (store / models.PRESETS[preset].filename).symlink_to(source)
    share_kernels(cache)
    return {"XDG_CACHE_HOME": str(cache)}


def test_a_daemon_with_drafter_auto_takes_a_pulled_model_with_its_tokenizer(
    tmp_path, smollm2_path, coder_path, daemon_process, tandem_cli
):
    target = models.derive_f16(smollm2_path)  # SmolLM2 at F16: the Q4_1 file reads its tokens
    env = store_with(tmp_path, {"smollm2-135m": smollm2_path, "qwen2.5-coder-0.5b": coder_path})
    d = daemon_process(target, "--drafter", "auto", "--ctx-size", "512", env=env)
    try:
        d.wait_ready(300)  # (a busy machine: the load probe alone can take a minute)
        with d.client() as c:
            st = c.status()
            assert st.drafter == (
                f"smollm2-135m (auto: smollm2-135m, a pulled model with {target.name}'s tokenizer at 36% of its size)"
            )
            assert st.drafter_model is not None and st.drafter_model.n_vocab == st.model.n_vocab
            done = c.complete(prompt="def add(a, b):", max_tokens=8, temperature=0, draft="on")
            assert done.usage.completion_tokens and done.draft.drafted > 0
        shown = tandem_cli(d.socket, "status")
        assert "drafter:   smollm2-135m (auto: smollm2-135m, a pulled model" in shown.stdout
        assert f"drafter: auto: smollm2-135m, a pulled model with {target.name}'s tokenizer" in d.log()
    finally:
        d.stop()
        d.cleanup()


def test_a_daemon_with_drafter_auto_and_no_fitting_model_runs_without_one_and_says_so(
    tmp_path, smollm2_path, coder_path, daemon_process, tandem_cli
):
    env = store_with(tmp_path, {"qwen2.5-coder-0.5b": coder_path})  # another tokenizer only
    d = daemon_process(smollm2_path, "--drafter", "auto", "--ctx-size", "512", env=env)
    try:
        d.wait_ready(300)  # (a busy machine: the load probe alone can take a minute)
        with d.client() as c:
            st = c.status()
        why = f"auto: no drafter: no pulled model has {smollm2_path.name}'s tokenizer and at most half its size"
        assert st.drafter.startswith(f"none ({why}") and st.drafter_model is None and st.draft_tokens == 0
        assert "drafter:   none (auto: no drafter" in tandem_cli(d.socket, "status").stdout
        assert why in d.log()
    finally:
        d.stop()
        d.cleanup()
