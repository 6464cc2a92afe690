"""The daemon's logic imports without llama-cpp-python: the engine, the scheduler,
the supervisor and the prefix cache can be read, run and tested without a model
runtime (only the llama.cpp model's modules, llama_model.py, llama_load.py, llama_decode.py
and prompt_reader.py, chat.py's compile step and the workers' loading load it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

PURE = [
    "tandem.protocol",
    "tandem.protocol.internal",
    "tandem.client",
    "tandem.daemon.worker.engine",
    "tandem.daemon.worker.rounds",
    "tandem.daemon.worker.prompts",
    "tandem.daemon.worker.pass_timing",
    "tandem.daemon.worker.load_checks",
    "tandem.daemon.drafting.interfaces",
    "tandem.daemon.front.scheduler",
    "tandem.daemon.front.supervisor",
    "tandem.daemon.front.server",
    "tandem.daemon.serve",
    "tandem.daemon.front.restart_policy",
    "tandem.daemon.drafting.governor",
    "tandem.daemon.drafting.speculative",
    "tandem.daemon.drafting.sampler",
    "tandem.daemon.drafting.ngram",
    "tandem.daemon.drafting.drafter_client",
    "tandem.daemon.cache.prefix_cache",
    "tandem.daemon.cache.page_store",
    "tandem.daemon.cache.kv_pages",
    "tandem.daemon.cache.page_file",
    "tandem.daemon.front.metrics",
    "tandem.daemon.config",
    "tandem.daemon.worker.worker_config",
    "tandem.daemon.worker.worker_main",
    "tandem.daemon.worker.target_worker",
    "tandem.daemon.drafting.drafter_worker",
    "tandem.daemon.embedding.vectors",
    "tandem.daemon.embedding.embed_worker",
    "tandem.daemon.front.embed_queue",
    "tandem.daemon.front.embedder",
    "tandem.daemon.models.chat",
]

BLOCK = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "llama_cpp" or name.startswith("llama_cpp."):
            raise ImportError("llama_cpp is blocked by this test")
sys.meta_path.insert(0, Block())
import importlib
for name in sys.argv[1:]:
    importlib.import_module(name)
assert not any(m == "llama_cpp" or m.startswith("llama_cpp.") for m in sys.modules)
print("ok")
"""


def test_the_logic_modules_import_with_llama_cpp_blocked():
    out = subprocess.run([sys.executable, "-c", BLOCK, *PURE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_blocker_blocks():
    out = subprocess.run(
        [sys.executable, "-c", BLOCK, "tandem.daemon.worker.llama_model"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0 and "llama_cpp is blocked" in out.stderr


@pytest.mark.slow  # the model-free unit tests run again (about 15 s)
def test_the_model_free_unit_tests_pass_without_llama_cpp():
    """tests/daemon, tests/protocol and tests/client less the model tests, with llama_cpp blocked
    (tests/conftest.py blocks it under TANDEM_TEST_WITHOUT_LLAMA_CPP)."""
    root = Path(__file__).resolve().parents[2]
    itself = "tests/daemon/test_pure_imports.py::test_the_model_free_unit_tests_pass_without_llama_cpp"
    args = ["-q", "-m", "not model", *"-p no:cacheprovider -x tests/daemon tests/protocol tests/client".split()]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", *args, "--deselect", itself],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TANDEM_TEST_WITHOUT_LLAMA_CPP": "1"},
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " failed" not in out.stdout
