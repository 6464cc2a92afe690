"""Workers that die or hang mid-request: a typed error for that request, a
restart with backoff, the queue kept and served, the prefix cache kept, the
restart counted; a drafter that keeps dying is switched off; a target that
cannot come back fails the daemon clearly."""

from __future__ import annotations

import os
import shutil
import signal
import time
import urllib.request

import pytest

from tandem.client import RequestFailed
from tandem.protocol import ErrorCode, FinishReason

PREAMBLE = "You are a careful assistant for a build system. Keep answers short and exact. " * 6


def wait_for(predicate, timeout: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def metric(addr: str, line_start: str) -> float:
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(line_start + " "):
                return float(line.split()[-1])
    raise AssertionError(f"{line_start} not exported")


@pytest.fixture
def pair(smollm2_path):
    from tandem.daemon import models

    return models.derive_f16(smollm2_path), smollm2_path


def test_target_killed_mid_request_queue_kept_cache_kept_restart_counted(start_daemon):
    # (the lane off: the short requests wait in the queue, which is what is tested)
    d = start_daemon("--ctx-size", "1024", "--cache-bytes", "32M", "--preempt-tokens", "0")
    with d.client() as a, d.client() as b:
        warm = a.complete(prompt=PREAMBLE + "First question?", max_tokens=4, temperature=0.0)
        running = a.generate(prompt=PREAMBLE + "Tell a long story.", max_tokens=2000, ignore_eos=True)
        it = iter(running)
        next(it)
        queued = [b.generate(prompt=PREAMBLE + f"Question {i}?", max_tokens=6, temperature=0.0) for i in range(3)]
        wait_for(lambda: a.status().queue_length == 3, what="3 queued")
        st = a.status()
        os.kill(st.worker_pids["target"], signal.SIGKILL)
        with pytest.raises(RequestFailed) as info:
            list(it)
        assert info.value.code == ErrorCode.WORKER_DIED
        assert "died (exit code -9)" in info.value.message and "may be retried" in info.value.message
        # the queue waited for the new worker and is served in order, from the cache the dead worker filled
        dones = []
        for q in queued:
            list(q)
            dones.append(q.done)
        assert [x.finish_reason for x in dones] == [FinishReason.LENGTH] * 3
        assert [x.serial for x in dones] == sorted(x.serial for x in dones)
        chunk = st.model.prefill_chunk or 16  # what is reused: whole prefill chunks (mixed kernels), else pages
        assert all(x.usage.cached_tokens >= (warm.usage.prompt_tokens - 16) // chunk * chunk > 0 for x in dones)
        after = a.status()
        assert after.worker_restarts == 1 and after.worker_pids["target"] != st.worker_pids["target"]
        assert after.state == "ready" and after.requests["error"] == 1
        assert metric(after.metrics_addr, 'tandem_worker_restarts_total{role="target"}') == 1


def test_drafter_killed_mid_request_restarted_and_drafting_again(start_daemon, pair):
    target, drafter = pair
    d = start_daemon(
        "--drafter",
        str(drafter),
        "--ctx-size",
        "1024",
        "--governor",
        "off",
        "--cache-bytes",
        "0",
        "--preempt-tokens",
        "0",  # (the short request waits in the queue)
        model=target,
    )
    with d.client() as a, d.client() as b:
        # long enough that the death is noticed (within about a second) well before the end
        count = dict(prompt="Count slowly: one, two,", max_tokens=800, ignore_eos=True, temperature=0.0)
        plain = a.complete(**count, draft="off").text
        running = a.generate(**count, draft="on")
        it = iter(running)
        next(it)
        queued = b.generate(prompt="The capital of France is", max_tokens=8, temperature=0.0)
        wait_for(lambda: a.status().queue_length == 1, what="1 queued")
        st = a.status()
        old = st.worker_pids["drafter"]
        os.kill(old, signal.SIGKILL)
        list(it)  # the request goes on with plain decoding: nothing streamed is lost
        assert running.done.finish_reason == FinishReason.LENGTH and running.done.drafter_died
        assert running.text == running.done.text == plain  # greedy: the same text as without drafting
        assert metric(st.metrics_addr, "tandem_requests_finished_without_drafter_total") == 1
        list(queued)  # served meanwhile (plainly, or by then with the new drafter)
        assert queued.done.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert queued.done.usage.completion_tokens > 0
        new = wait_for(
            lambda: (pid := a.status().worker_pids.get("drafter")) not in (None, old) and pid, what="a new drafter"
        )
        wait_for(lambda: "(restarting)" not in a.status().drafter, what="the drafter back")
        again = a.complete(prompt="Count: 1 2 3 4 5 6 7 8", max_tokens=16, temperature=0.0, draft="on")
        assert again.draft is not None and again.draft.rounds > 0 and again.draft.drafted > 0
        st = a.status()
        assert st.worker_pids["drafter"] == new and st.worker_restarts == 1
        assert metric(st.metrics_addr, 'tandem_worker_restarts_total{role="drafter"}') == 1
    assert "restarting it in 1 s" in d.log()


def test_a_drafter_that_keeps_dying_is_switched_off_and_plain_decoding_goes_on(start_daemon, pair):
    target, drafter = pair
    d = start_daemon("--drafter", str(drafter), "--ctx-size", "512", "--governor", "off", model=target)
    with d.client() as c:
        for _ in range(3):
            pid = wait_for(lambda: c.status().worker_pids.get("drafter"), what="a drafter")
            wait_for(lambda: "(restarting)" not in c.status().drafter, what="the drafter ready")
            os.kill(pid, signal.SIGKILL)
            wait_for(
                lambda pid=pid: c.status().worker_pids.get("drafter") != pid or "(off" in c.status().drafter,
                what="death seen",
            )
        st = wait_for(lambda: (s := c.status()) and "(off" in s.drafter and s, what="drafting off")
        assert "died 3 times within 10 minutes" in st.drafter and "drafter" not in st.worker_pids
        done = c.complete(prompt="Still answering:", max_tokens=8, ignore_eos=True, draft="on")
        assert done.usage.completion_tokens == 8 and (done.draft is None or done.draft.drafted == 0)
        assert c.status().state == "ready"
    assert "drafting is switched off and plain decoding goes on" in d.log()


def test_a_hung_target_is_killed_after_worker_timeout_and_restarted(start_daemon):
    d = start_daemon("--ctx-size", "512", "--worker-timeout", "3")
    with d.client() as c:
        running = c.generate(prompt="Long:", max_tokens=2000, ignore_eos=True)
        it = iter(running)
        next(it)
        pid = c.status().worker_pids["target"]
        os.kill(pid, signal.SIGSTOP)  # alive, silent
        started = time.monotonic()
        with pytest.raises(RequestFailed) as info:
            list(it)
        assert info.value.code == ErrorCode.WORKER_DIED
        assert "did not answer within 3 s (worker_timeout) and was killed" in info.value.message
        assert time.monotonic() - started < 30
        wait_for(lambda: c.status().state == "ready", what="ready again")
        assert c.complete(prompt="Again:", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3
        assert c.status().worker_restarts == 1


def test_a_long_prefill_is_not_mistaken_for_a_hang(start_daemon):
    # 900 prompt tokens at a 64-token batch: many llama_decode calls, a progress beat between them
    d = start_daemon("--ctx-size", "1024", "--batch-size", "64", "--worker-timeout", "1", "--cache-bytes", "0")
    with d.client() as c:
        done = c.complete(prompt="word " * 900, max_tokens=4, ignore_eos=True)
        assert done.usage.completion_tokens == 4 and c.status().worker_restarts == 0


def test_a_hung_drafter_is_killed_and_restarted(start_daemon, pair):
    target, drafter = pair
    d = start_daemon(
        "--drafter", str(drafter), "--ctx-size", "512", "--governor", "off", "--worker-timeout", "3", model=target
    )
    with d.client() as c:
        running = c.generate(prompt="Count slowly: one, two,", max_tokens=300, ignore_eos=True, draft="on")
        it = iter(running)
        next(it)
        pid = c.status().worker_pids["drafter"]
        os.kill(pid, signal.SIGSTOP)
        list(it)  # finished plainly
        assert running.done.usage.completion_tokens == 300 and running.done.finish_reason == FinishReason.LENGTH
        assert "did not answer within 3 s and was killed" in d.log()
        wait_for(lambda: c.status().worker_pids.get("drafter") not in (None, pid), what="a new drafter")
        assert c.status().worker_pids["target"]  # the target lived through it
        done = c.complete(prompt="After:", max_tokens=4, ignore_eos=True)
        assert done.usage.completion_tokens == 4


def test_a_target_that_cannot_come_back_fails_the_daemon_clearly(short_tmpdir, start_daemon, smollm2_path):
    work = short_tmpdir()
    model = work / "model.gguf"
    shutil.copy(smollm2_path, model)
    d = start_daemon("--ctx-size", "256", model=model)
    with d.client() as c:
        pid = c.status().worker_pids["target"]
        model.unlink()  # the restart cannot load it
        os.kill(pid, signal.SIGKILL)
        st = wait_for(lambda: (s := c.status()).state == "failed" and s, what="failed state")
        assert "could not load the model" in st.failure and str(model) in st.failure
        with pytest.raises(RequestFailed) as info:
            c.complete(prompt="Hello", max_tokens=2)
        assert info.value.code == ErrorCode.NOT_READY and "failed" in info.value.message
        assert metric(st.metrics_addr, "tandem_ready") == 0
    shutil.rmtree(work, ignore_errors=True)


def test_a_target_killed_while_loading_is_loaded_again_and_the_daemon_serves(start_daemon):
    """The OOM killer (or a user) ends the worker before it said ready: the
    restart policy loads it again; the daemon does not end."""
    import psutil

    d = start_daemon("--ctx-size", "512", wait=False)
    daemon = psutil.Process(d.proc.pid)

    def loading_worker():
        return next((p for p in daemon.children() if "worker_main" in " ".join(p.cmdline())), None)

    worker = wait_for(loading_worker, what="the worker's start")
    worker.kill()
    d.wait_ready(120)
    with d.client() as c:
        st = c.status()
        assert st.worker_restarts == 1 and st.worker_pids["target"] != worker.pid and st.state == "ready"
        assert c.complete(prompt="Hello", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3
    assert "while loading" in d.log()


def test_ten_target_deaths_in_a_row_each_survived(start_daemon):
    d = start_daemon("--ctx-size", "512", "--cache-bytes", "16M")
    prompt = PREAMBLE + "Again?"
    with d.client() as c:
        first = c.complete(prompt=prompt, max_tokens=4, temperature=0.0)
        for n in range(1, 11):
            os.kill(c.status().worker_pids["target"], signal.SIGKILL)
            wait_for(lambda n=n: (s := c.status()).worker_restarts == n and s.state == "ready", what=f"restart {n}")
            done = c.complete(prompt=prompt, max_tokens=4, temperature=0.0)
            assert done.text == first.text and done.usage.cached_tokens > 0  # the same answer, from kept pages
        st = c.status()
        assert st.worker_restarts == 10 and st.requests.get("error", 0) == 0


def test_a_restarted_drafter_that_cannot_load_switches_drafting_off_not_the_daemon(short_tmpdir, start_daemon, pair):
    target, drafter = pair
    work = short_tmpdir()
    copy = work / "drafter.gguf"
    shutil.copy(drafter, copy)
    d = start_daemon("--drafter", str(copy), "--ctx-size", "512", "--governor", "off", model=target)
    with d.client() as c:
        pid = c.status().worker_pids["drafter"]
        copy.unlink()
        os.kill(pid, signal.SIGKILL)
        st = wait_for(lambda: (s := c.status()) and "(off" in s.drafter and s, what="drafting off")
        assert "could not load the drafter" in st.drafter and st.state == "ready"
        done = c.complete(prompt="Plainly:", max_tokens=5, ignore_eos=True, draft="on")
        assert done.usage.completion_tokens == 5
    shutil.rmtree(work, ignore_errors=True)


def test_a_request_whose_id_is_drafter_is_just_a_request(start_daemon, pair):
    target, drafter = pair
    d = start_daemon("--drafter", str(drafter), "--ctx-size", "256", "--governor", "off", model=target)
    with d.client() as c:
        before = c.status().worker_pids
        with pytest.raises(RequestFailed) as info:
            c.complete(prompt="word " * 400, max_tokens=2, request_id="drafter")
        assert info.value.code == ErrorCode.PROMPT_TOO_LONG and info.value.request_id == "drafter"
        done = c.complete(prompt="Fine:", max_tokens=3, ignore_eos=True, request_id="drafter")
        assert done.usage.completion_tokens == 3
        assert c.status().worker_pids == before and c.status().worker_restarts == 0
