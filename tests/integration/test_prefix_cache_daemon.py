"""The prefix cache through the daemon's socket with SmolLM2 (target pages only,
opt-in with --cache-bytes while the issue is in progress)."""

from __future__ import annotations

import subprocess
import sys

import pytest

SYSTEM = (
    "You are a terse assistant for a small software team. Answer in one or two sentences. "
    "Never invent facts; say when you do not know. Prefer plain words. "
) * 3


@pytest.fixture
def cached_daemon(start_daemon):
    return start_daemon("--ctx-size", "1024", "--cache-bytes", "64M", "--page-tokens", "16")


def test_multi_turn_chat_with_the_cache_equals_without(cached_daemon):
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a unit test?"}]
    with cached_daemon.client() as client:
        first = client.complete(messages=history, max_tokens=24, temperature=0.0)
        assert first.usage.cached_tokens == 0
        for question in ["And an integration test?", "Which should I write first?"]:
            history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": question}]
            cached = client.complete(messages=history, max_tokens=24, temperature=0.0)
            fresh = client.complete(messages=history, max_tokens=24, temperature=0.0, cache=False)
            assert fresh.usage.cached_tokens == 0
            # the system prompt and the earlier turns came from the cache, in whole pages
            assert cached.usage.cached_tokens >= 16 * (len(SYSTEM) // 80)
            assert cached.usage.cached_tokens % 16 == 0 and cached.usage.cached_tokens < cached.usage.prompt_tokens
            assert cached.text == fresh.text
            first = cached
        st = client.status()
    c = st.cache
    assert c is not None and c == cached.cache and c.page_tokens == 16
    assert c.hits == 2 and c.misses == 1  # the first turn missed; the cache: false requests did not look
    assert c.tokens_from_cache > 0 and c.tokens_prefilled > 0 and 0 < c.bytes_used <= c.bytes_budget == 64 * 2**20
    assert c.pages > 0 and c.evictions == 0
    out = subprocess.run(
        [sys.executable, "-m", "tandem.client.cli", "--socket", str(cached_daemon.socket), "status"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0 and "prompt tokens from cache" in out.stdout, out.stderr


def test_same_later_tokens_after_another_start_are_no_hit(cached_daemon):
    tail = " The build log follows. step one compiled, step two linked, step three tested. " * 4
    with cached_daemon.client() as client:
        a = client.complete(prompt="Report A." + tail, max_tokens=4, temperature=0.0)
        b = client.complete(prompt="Another start entirely, different words." + tail, max_tokens=4, temperature=0.0)
        again = client.complete(prompt="Report A." + tail + " Summary:", max_tokens=4, temperature=0.0)
    assert a.usage.cached_tokens == 0
    assert b.usage.cached_tokens == 0  # its pages after the first hold a's tokens, but follow another prefix
    assert again.usage.cached_tokens > 0
