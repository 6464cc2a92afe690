"""bench.common's load-check verdicts, handed from one daemon's state directory to the next and, through
$TANDEM_BENCH_VERDICTS, between processes (a test session and the benchmarks it runs). Pure file logic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import common

ROOT = Path(__file__).resolve().parents[2]
FOUND = {"abc fast_prefill chunk=64": {"exact": True}}


def test_what_one_process_found_seeds_another_processs_daemon(tmp_path, monkeypatch):
    shared = tmp_path / "verdicts.json"
    monkeypatch.setenv(common.VERDICTS_ENV, str(shared))
    monkeypatch.setattr(common, "VERDICTS", {})
    first = tmp_path / "first"
    first.mkdir()
    (first / common.VERDICTS_FILE).write_text(json.dumps({**FOUND, "junk": 3}))
    common.keep_verdicts(first)
    assert json.loads(shared.read_text()) == FOUND  # (what is not a verdict is not handed on)
    later = tmp_path / "later"  # a daemon another process starts: seeded from the shared file
    code = f"from pathlib import Path; from bench import common; common.seed_verdicts(Path({str(later)!r}))"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
    assert json.loads((later / common.VERDICTS_FILE).read_text()) == FOUND


def test_a_daemon_with_its_own_verdicts_keeps_them_and_a_bad_shared_file_is_ignored(tmp_path, monkeypatch):
    shared = tmp_path / "verdicts.json"
    shared.write_text("{not json")
    monkeypatch.setenv(common.VERDICTS_ENV, str(shared))
    monkeypatch.setattr(common, "VERDICTS", dict(FOUND))
    own = tmp_path / "own"
    own.mkdir()
    (own / common.VERDICTS_FILE).write_text("{}")
    common.seed_verdicts(own)
    assert (own / common.VERDICTS_FILE).read_text() == "{}"
    common.keep_verdicts(own)
    assert json.loads(shared.read_text()) == FOUND
