"""The short-request lane through the real daemon (SmolLM2-135M): a short request
sent while a long generation runs is answered before the long one ends, and
both write exactly what they write alone: greedy and seeded sampling, with the
n-gram drafter and without, the short prompt sharing the long one's start."""

from __future__ import annotations

import threading
import time

import pytest

LONG = "Write a long story about a lighthouse keeper and the ships she watched over the years.\n"
SHORT = "Write a long story about a lighthouse keeper. Title:"  # shares the long prompt's first tokens
LONG_TOKENS = 240
LANE = ("--preempt-tokens", "100")  # short: at most 100 tokens (the long one asks for more)


def long_request(**kw) -> dict:
    return dict(prompt=LONG, max_tokens=LONG_TOKENS, ignore_eos=True, **kw)


def short_request(**kw) -> dict:
    return {"prompt": SHORT, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True, **kw}


def together(daemon, long_kw: dict, short_kw: dict):
    """The long request streamed on one connection; once it has written 30 tokens,
    the short one on another. (long done, short done, short's end - long's end)."""
    out: dict = {}
    started = threading.Event()

    def run_long():
        with daemon.client() as c:
            stream = c.generate(**long_kw)
            n = 0
            for chunk in stream:
                n += len(chunk.token_ids)
                if n >= 30:
                    started.set()
            out["long"], out["long_end"] = stream.done, time.monotonic()

    t = threading.Thread(target=run_long)
    t.start()
    assert started.wait(120), "the long request wrote nothing"
    with daemon.client() as c:
        out["short"] = c.complete(**short_kw)
        out["short_end"] = time.monotonic()
    t.join(300)
    return out["long"], out["short"], out["short_end"] - out["long_end"]


@pytest.mark.parametrize("drafter", ["none", "ngram"])
def test_a_short_request_runs_within_a_long_one_and_both_write_what_they_write_alone(start_daemon, drafter):
    d = start_daemon("--ctx-size", "2048", "--drafter", drafter, *LANE)
    # greedy; then seeded sampling, the short one too where no drafter makes it wait
    seeded_short = short_request(temperature=0.9, seed=3) if drafter == "none" else short_request()
    for long_kw, short_kw in (
        (long_request(temperature=0.0), short_request()),
        (long_request(temperature=0.9, seed=7), seeded_short),
    ):
        with d.client() as c:
            long_alone = c.complete(**long_kw)
            short_alone = c.complete(**short_kw)
        assert long_alone.timings.paused_seconds == 0.0
        long_done, short_done, short_first_by = together(d, long_kw, short_kw)
        assert short_first_by < 0, "the short request waited for the long one"
        assert short_done.text == short_alone.text
        assert long_done.text == long_alone.text, long_kw
        assert long_done.usage.completion_tokens == LONG_TOKENS
        assert long_done.timings.paused_seconds > 0
        # its rate leaves the pause out
        rate = (LONG_TOKENS - 1) / (long_done.timings.generation_seconds - long_done.timings.paused_seconds)
        assert long_done.timings.tokens_per_second == pytest.approx(rate, rel=1e-6)


def test_with_the_lane_off_the_short_request_waits(start_daemon):
    d = start_daemon("--ctx-size", "2048", "--preempt-tokens", "0")
    long_done, short_done, short_first_by = together(d, long_request(temperature=0.0), short_request())
    assert short_first_by > 0 and long_done.timings.paused_seconds == 0.0
    assert short_done.timings.queued_seconds > 0


def test_a_short_request_cancelled_within_a_long_one_leaves_it_intact(start_daemon):
    d = start_daemon("--ctx-size", "2048", *LANE)
    with d.client() as c:
        long_alone = c.complete(**long_request(temperature=0.0))
    out: dict = {}
    started = threading.Event()

    def run_long():
        with d.client() as c:
            stream = c.generate(**long_request(temperature=0.0))
            for chunk in stream:
                if chunk.token_ids:
                    started.set()
            out["long"] = stream.done

    t = threading.Thread(target=run_long)
    t.start()
    assert started.wait(120)
    with d.client() as c:
        stream = c.generate(**short_request(max_tokens=90))  # short enough for the lane
        while not stream.next_chunk(60).token_ids:
            pass
        with d.client() as other:  # status says which request runs within which
            st = other.status()
        assert st.within is not None and st.active is not None, st
        assert st.active.id != st.within.id and st.within.completion_tokens > 0 and st.active.completion_tokens > 0
        done = stream.cancel()
        assert done.finish_reason.value == "cancelled" and done.usage.completion_tokens < 90
    t.join(300)
    assert out["long"].text == long_alone.text
    assert out["long"].timings.paused_seconds > 0  # it was cancelled within the long one, not after it


def test_a_short_request_reuses_nothing_of_a_long_one_sent_with_cache_false(start_daemon):
    """Its prompt shares the long one's first 100-odd tokens, which the model holds: the first whole
    prefill chunk of them is kept for it when the long one lets the cache keep them, not when it was
    sent with ``cache: false``."""
    d = start_daemon("--ctx-size", "2048", "--cache-bytes", "0", *LANE)
    shared = "You are a careful assistant who writes plain English for a general reader. " * 8
    for cache in (True, False):
        long_kw = long_request(temperature=0.0, cache=cache) | {"prompt": shared + LONG}
        short_kw = short_request() | {"prompt": shared + "Title:"}
        long_done, short_done, short_first_by = together(d, long_kw, short_kw)
        assert short_first_by < 0 and long_done.timings.paused_seconds > 0
        assert (short_done.usage.cached_tokens > 0) == cache, short_done.usage


def test_a_short_request_runs_between_two_passes_of_a_long_prompt(start_daemon):
    """A short request that arrives while a long prompt is read is served between two of its passes
    (where the daemon reads prompts in its own context; with a prompt reader, after the prompt); the
    long one's output stays the same."""
    d = start_daemon("--ctx-size", "2048", "--cache-bytes", "0", *LANE)
    long_kw = long_request(temperature=0.0) | {"prompt": "A line of a long log file, number 17, said: ok. " * 120}
    with d.client() as c:
        alone = c.complete(**long_kw)
        short_alone = c.complete(**short_request())
        reader = c.status().model.prompt_reader
    assert alone.usage.prompt_tokens > 1200
    out: dict = {}
    reading = threading.Event()

    def run_long():
        with d.client() as c:
            stream = c.generate(**long_kw, progress=True)
            for chunk in stream:
                if chunk.progress is not None:
                    reading.set()
                elif chunk.token_ids and "first" not in out:
                    out["first"] = time.monotonic()
            out["long"] = stream.done

    t = threading.Thread(target=run_long)
    t.start()
    assert reading.wait(60)
    with d.client() as c:
        short = c.complete(**short_request())
        short_end = time.monotonic()
    t.join(300)
    assert out["long"].text == alone.text and short.text == short_alone.text
    if reader:  # the prompt reader reads in a context of its own: the short one waits for the prompt
        assert short_end > out["first"]
    else:
        assert short_end < out["first"] and out["long"].timings.paused_seconds > 0
