"""`python -m bench --quick`: the benchmark command works end to end (a smoke run, not a speed test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_benchmark_writes_a_report_with_tables_and_plots(tmp_path, smollm2_path):
    out = tmp_path / "report"
    run = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--no-peers", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = (out / "REPORT.md").read_text()
    for heading in (
        "## Machine and versions",
        "## Decoding",
        "## Governed against plain, bracketed",
        "## Latency as a streaming client sees it",
        "## Prefix cache",
        "## Memory",
        "## Plots",
    ):
        assert heading in report, heading
    assert "sha256 `" in report and "llama.cpp system info: `CPU :" in report
    for png in ("speedup_vs_k.png", "ttft_per_turn.png", "token_latency.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    results = json.loads((out / "results.json").read_text())
    systems = set(next(iter(results["decoding"].values())))
    assert systems >= {
        "plain",
        "model k=1",
        "model k=4",
        "model governed",
        "ngram k=4",
        "ngram governed",
        "suffix k=4",
        "suffix governed",
        "llama-cpp-python",
        "fast plain",
        "fast suffix governed",
    }
    assert set(results["decoding"]) == {"json", "support", "story", "code", "edit"}
    # every request produced tokens; the speculative ones drafted; greedy outputs equal plain's in the table
    for kind in results["decoding"].values():
        for name, runs in kind.items():
            assert all(s["tokens"] > 0 for run in runs for s in run), name
    # the bracketed comparison: every task, a governed request of each drafter between two plain ones
    assert set(results["bracketed"]) == {"json", "support", "story", "code", "edit"}
    for rows in results["bracketed"].values():
        assert rows and all(len(row["plain"]) == 2 for row in rows)
        governed = {"model governed", "ngram governed", "suffix governed", "control (plain)", "fast suffix governed"}
        assert all(set(row["ratio"]) == governed for row in rows)
        assert all(row["governed"]["control (plain)"]["rounds"] == 0 for row in rows)  # the control never drafts
        assert all(ratio > 0 for row in rows for ratio in row["ratio"].values())
    agent = results["prefix_cache"]["agent"]
    assert [row["turn"] for row in agent] == [1, 2, 3] and agent[-1]["cached_tokens"] > 0
    assert results["peak_rss"]["plain daemon"] > 0 and results["cache"]["pages"] > 0
    # PSS, read at each section's end: the bench's own processes' smaps are readable
    assert 0 < results["peak_pss"]["plain target"] <= results["peak_rss"]["plain target"]
    assert "| process | peak RSS MiB | PSS MiB |" in report
    # the control is a daemon of its own, plain, with the drafters' daemons' settings
    assert results["peak_rss"]["control target"] > 0 and "control drafter" not in results["peak_rss"]
    control = results["commands"]["tandem (control)"]
    assert "--drafter" not in control and "--cache-bytes 0 --state-dir" in control
    # the opt-in fast mode: a daemon of its own, its draft: off system never drafts, and the report says it is not exact
    fast = results["commands"]["tandem (fast)"]
    assert "--kernels fast --exact off --drafter suffix --draft-tokens 16 --cache-bytes 0" in fast, fast
    assert all(s["rounds"] == 0 for kind in results["decoding"].values() for run in kind["fast plain"] for s in run)
    assert results["fresh_lookup"] and "**Not exact:**" in report and "cache: false" in report
    # cache: false reached the daemons: a lookup or fast daemon kept nothing of the request before, the same prompt
    # a moment earlier included, while the model daemon's systems, sharing a daemon as they do, reuse its KV
    decoding = results["decoding"].values()
    fresh = ("ngram k=4", "ngram governed", "suffix k=4", "suffix governed", "fast plain", "fast suffix governed")
    assert all(s["cached"] == 0 for kind in decoding for n in fresh for run in kind[n] for s in run)
    assert any(s["cached"] > 0 for kind in decoding for run in kind["model governed"] for s in run)
    assert "; the fast mode's (not exact): " in report  # its outputs are not counted with the exact governors
    assert "control (plain)" in report.split("## Governed against plain, bracketed")[1].split("\n## ")[0]
    # --rewrite writes the same report again from results.json, measuring nothing
    (out / "REPORT.md").unlink()
    (out / "token_latency.png").unlink()
    again = subprocess.run(
        [sys.executable, "-m", "bench", "--rewrite", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "REPORT.md").read_text() == report
    assert (out / "token_latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = subprocess.run(
        [sys.executable, "-m", "bench", "--rewrite", str(tmp_path / "none")], cwd=ROOT, capture_output=True, text=True
    )
    assert missing.returncode != 0 and "results.json" in missing.stderr


def test_the_structured_output_benchmark_runs_and_every_constrained_output_validates(smollm2_path):
    run = subprocess.run(
        [sys.executable, "-m", "bench.experiments.structured", "--model", str(smollm2_path)]
        + ["--runs", "1", "--prompts", "2", "--llama-server", "/nonexistent/llama-server"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {line.split(" | ")[0].strip("| "): line for line in run.stdout.splitlines() if line.startswith("| c")}
    assert set(rows) == {"constrained", "constrained + jump-forward", "constrained + jump-forward + ngram"}
    assert all("| 2/2 |" in row for row in rows.values()), run.stdout


def bench(experiment: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m bench.experiments.EXPERIMENT ARGS...` from the repository root"""
    return run_module(f"bench.experiments.{experiment}", *args)


def run_module(module: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS...` from the repository root; it must exit 0"""
    run = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_the_tool_loop_and_mask_cost_benchmarks_run(smollm2_path):
    loop = bench("tool_loop", "--model", str(smollm2_path), "--turns", "2")
    turns = [line.split() for line in loop.stdout.splitlines() if line[:4].strip().isdigit()]
    assert [t[0] for t in turns] == ["1", "2"] and int(turns[1][2]) > 0, loop.stdout  # turn 2 hit the cache
    assert "reusable tokens from the cache" in loop.stdout
    cost = bench("mask_cost", "--model", str(smollm2_path), "--schemas", "1")
    assert "median mask / median step" in cost.stdout, cost.stdout


def test_the_verify_cost_benchmark_compares_four_settings_or_says_why_not(smollm2_path):
    from tandem.daemon.worker.llama_load import cpu_has_amx

    run = bench("verify_cost", "--model", str(smollm2_path), "--rounds", "1", "--widths", "1,2")
    if cpu_has_amx():  # extra buffers stay off on AMX CPUs (they crash there): nothing to compare, and it says so
        assert "this CPU has AMX" in run.stdout, run.stdout
        return
    tables = [line for line in run.stdout.splitlines() if line.startswith("| ") and "setting" not in line]
    # the daemon's setting first: passes of 3 rows on llama.cpp's own kernels over repacked weights, one pass
    # with tandem's (the bench loads them as a worker does) or where nothing is repacked (SmolLM2's Q4_1)
    first = next(line.split(" | ")[0][2:] for line in tables)
    # (SmolLM2's Q4_1: nothing llama.cpp repacks)
    assert first == "repacked (nothing to repack: one pass)", run.stdout
    assert "CPU kernels: tandem-" in run.stdout, run.stdout
    settings = [
        first,
        "not repacked",
        "repacked, one pass (--kernels fast)",
        "not repacked, one pass (--kernels fast --extra-buffers off)",
    ]
    assert [line.split(" | ")[0][2:] for line in tables] == settings * 3, run.stdout
    for line in tables:
        assert all(float(cell.split()[0]) > 0 for cell in line.strip("| ").split(" | ")[1:3]), line


def test_the_cold_governor_benchmark_makes_every_request_a_new_task(smollm2_path):
    run = bench(
        "cold_governor",
        *("--target", str(smollm2_path), "--drafter", str(smollm2_path)),
        *"--prompts 2 --tokens 8 --ctx-size 2048".split(),
    )
    rows = [
        line.split(" | ")
        for line in run.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| task |")
    ]
    names = [r[0][2:] for r in rows]
    assert names == ["json", "support", "the daemon's first task", "every request, geometric mean ±2 SE"], run.stdout
    assert all(len(r) == 6 and float(r[2].split()[0]) > 0 for r in rows), run.stdout
    assert run.stdout.splitlines()[2].endswith("| control (plain) |"), run.stdout  # the A/A column, last
    # the governor never changes the output
    assert "governed outputs identical to plain's: 6/6; the control's: 2/2" in run.stdout, run.stdout


def test_the_catch_up_benchmark_runs_one_task_bracketed_and_reports_the_drafters_catch_ups(tmp_path, smollm2_path):
    out = tmp_path / "catch-up"
    run = bench(
        "catch_up",
        *("--target", str(smollm2_path), "--drafter", str(smollm2_path)),
        *"--prompts 3 --tokens 8 --ctx-size 2048 --out".split(),
        str(out),
    )
    lines = run.stdout.splitlines()
    header = next(line for line in lines if line.startswith("| request |"))
    assert header == "| request | model governed | control (plain) | drafting rounds (model) |", run.stdout
    rows = [line.split(" | ") for line in lines if line[:4] in ("| 0 ", "| 1 ", "| 2 ")]
    assert len(rows) == 3 and all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows), run.stdout
    assert "governed outputs identical to plain's: 3/3; the control's: 3/3" in run.stdout, run.stdout
    assert "Catch-ups of 32 tokens or more the model daemon logged: " in run.stdout, run.stdout
    assert (out / "REPORT.md").read_text() in run.stdout + "\n"
    results = json.loads((out / "results.json").read_text())
    assert len(results["requests"]) == 3 and isinstance(results["catch_ups"], list)
    assert "ready" in (out / "model-daemon.log").read_text()  # the drafter's daemon's own log, kept


def test_the_prompt_overhead_benchmark_compares_the_daemon_with_in_process_prefill(smollm2_path):
    run = bench("prompt_overhead", "--model", str(smollm2_path), "--prompts", "2", "--words", "20")
    rows = [line.strip("| ").split(" | ") for line in run.stdout.splitlines() if line[:3].strip("| ").isdigit()]
    assert len(rows) == 2 and all(int(r[0]) > 20 and float(r[3]) > 0 for r in rows), run.stdout
    assert "daemon / in-process: median " in run.stdout, run.stdout


def test_the_step_kernels_benchmark_compares_reference_and_fast_one_token_steps(smollm2_path):
    run = bench("step_kernels", "--model", str(smollm2_path), "--rounds", "2", "--tokens", "8", "--context", "80")
    speeds = [line for line in run.stdout.splitlines() if " kernels: " in line]
    assert [line.split(" kernels:")[0] for line in speeds] == ["reference", "fast"], run.stdout
    assert all(float(line.split(": ")[1].split()[0]) > 0 for line in speeds), run.stdout
    assert "fast / reference: median " in run.stdout, run.stdout
    # (whether the two kinds round alike is this CPU's and llama.cpp's to say: it is reported, not asserted)
    assert "logits bit for bit the same in every step" in run.stdout or "logits first differ at step" in run.stdout


def test_the_lookup_drafter_benchmark_adds_the_fast_systems(smollm2_path):
    run = bench(
        "lookup_drafters",
        *("--target", str(smollm2_path), "--runs", "1", "--tokens", "12", "--kinds", "edit", "--prompts", "2"),
        *("--also-fast", "6"),
        "--fresh",
        "--also-stock",
    )
    assert "; fresh: every request with cache: false" in run.stdout, run.stdout
    # cache: false reached the daemons: each timed request follows the same prompt on the same daemon, whose KV
    # it would otherwise keep
    assert "Prompt tokens not read again (kept or restored from an earlier request), timed requests: 0" in run.stdout
    header = next(line for line in run.stdout.splitlines() if line.startswith("| task | plain decode"))
    stock = "| stock plain / plain | stock suffix governed / plain "
    assert header.endswith(stock + "| fast plain / plain | fast suffix k=6 governed / plain |"), run.stdout
    edit = next(line for line in run.stdout.splitlines() if line.startswith("| edit | "))  # the speed table's row
    assert len(edit.strip("|").split("|")) == 10 and float(edit.split(" | ")[-1].split()[0]) > 0, edit
    details = {line.split(" | ")[1]: line for line in run.stdout.splitlines() if line.startswith("| edit | ")}
    # the exact systems never change the output; the fast ones are listed, however they compare
    assert details["suffix governed"].endswith("| 2/2 |"), run.stdout
    assert "stock plain" in details and "stock suffix governed" in details, run.stdout
    # the edit re-emits a file of its prompt: the forced suffix drafter drafts from it, even with nothing remembered
    assert int(details["suffix forced"].split(" | ")[4]) > 0, run.stdout
    assert "fast plain" in details and "fast suffix k=6 governed" in details, run.stdout


def test_the_short_lane_benchmark_reports_both_lanes_and_equal_texts(tmp_path, smollm2_path):
    out = tmp_path / "lane"
    args = ["--model", str(smollm2_path), "--size", "1024", "--long-tokens", "64", "--short-tokens", "4"]
    run_module("bench.short_lane", *args, "--runs", "1", "--out", str(out))
    rows = json.loads((out / "results.json").read_text())
    assert [r["lane"] for r in rows] == ["on", "off"] and all(r["same_text"] for r in rows), rows
    on, off = rows
    assert on["paused"] > 0 and off["paused"] == 0  # the lane served it within the long request, or not
    assert on["short_during_reading"] > 0 and off["paused_reading"] == 0
    table = (out / "REPORT.md").read_text()
    assert "| on |" in table and "| off |" in table and "1/1" in table


def test_the_long_context_benchmark_asks_resident_systems_in_an_order_turned_each_run(tmp_path, smollm2_path):
    out = tmp_path / "long"
    args = ["--models", str(smollm2_path), "--sizes", "1024", "--runs", "2", "--tokens", "8"]
    run = run_module("bench.long_context", *args, "--systems", "tandem", "tandem fast", "--out", str(out), timeout=900)
    rows = json.loads((out / "results.json").read_text())
    # both started before the first measured request; run 1 asks tandem first, run 2 tandem fast first
    assert [(r["run"], r["system"]) for r in rows] == [
        (0, "tandem"),
        (0, "tandem fast"),
        (1, "tandem fast"),
        (1, "tandem"),
    ]
    assert run.stderr.index("starting tandem fast") < run.stderr.index(" 1024 run 1:")
    assert all(256 < r["prompt_tokens"] <= 1024 and r["decode"] and r["rss_mib"] > 0 for r in rows), rows
    report = (out / "REPORT.md").read_text()
    assert "| 1024 | tandem |" in report and "| 1024 | tandem fast |" in report
