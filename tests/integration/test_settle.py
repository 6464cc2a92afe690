"""Settling between requests, through the daemon with SmolLM2 (mixed kernels):
the last turn's partial prompt chunk and its reply are read again in whole
chunks in idle time, so a next turn re-sending them reads only what is new, with
output identical to an uncached request; a re-sent prompt still finds its own KV."""

from __future__ import annotations

import time

import pytest

SYSTEM = (
    "You are a terse assistant for a small software team. Answer in one or two sentences. "
    "Never invent facts; say when you do not know. Prefer plain words. "
) * 3
pytestmark = pytest.mark.model


def wait_for_pages(client, more_than: int, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        pages = client.status().cache.pages
        if pages > more_than:
            return pages
        assert time.monotonic() < deadline, f"no pages stored after the request ({pages})"
        time.sleep(0.05)


def test_the_next_turn_reads_only_what_is_new_and_the_output_is_unchanged(start_daemon):
    d = start_daemon("--ctx-size", "1024", "--cache-bytes", "64M")
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Explain what a unit test is."}]
    with d.client() as client:
        chunk = client.status().model.prefill_chunk
        assert chunk == 64
        first = client.complete(messages=history, max_tokens=96, temperature=0.0)
        prompt, reply = first.usage.prompt_tokens, first.usage.completion_tokens
        # what the KV holds: the prompt and the reply, but for its last token after a length stop (never read)
        settled = (prompt + reply - (first.finish_reason.value == "length")) // chunk * chunk
        assert settled > prompt // chunk * chunk, (prompt, reply)  # a reply that crosses a chunk boundary
        wait_for_pages(client, first.cache.pages)  # the settled chunks' pages, stored between requests

        history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And a mock?"}]
        turn = client.complete(messages=history, max_tokens=32, temperature=0.0)
        fresh = client.complete(messages=history, max_tokens=32, temperature=0.0, cache=False)
        assert turn.text == fresh.text and fresh.usage.cached_tokens == 0
        # without settling it kept prompt // chunk * chunk: the old prompt's last chunk and
        # the reply were read again with the new turn
        assert turn.usage.cached_tokens == settled, (turn.usage, prompt, reply)

        # a prompt re-sent after its turn was settled: its own KV and logits, every token
        again = client.complete(messages=history, max_tokens=32, temperature=0.0)
        time.sleep(0.5)  # (it settles meanwhile)
        resent = client.complete(messages=history, max_tokens=32, temperature=0.0)
        assert resent.usage.cached_tokens == resent.usage.prompt_tokens and resent.text == again.text == fresh.text
    assert "Traceback" not in d.log()


def test_settle_off_keeps_what_the_prompt_read(start_daemon):
    d = start_daemon("--ctx-size", "1024", "--cache-bytes", "64M", "--settle", "off")
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Explain what a unit test is."}]
    with d.client() as client:
        first = client.complete(messages=history, max_tokens=96, temperature=0.0)
        time.sleep(1.0)
        assert client.status().cache.pages == first.cache.pages  # nothing stored between requests
        history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And a mock?"}]
        turn = client.complete(messages=history, max_tokens=32, temperature=0.0)
        assert turn.usage.cached_tokens == first.usage.prompt_tokens // 64 * 64
