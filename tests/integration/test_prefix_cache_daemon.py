"""The prefix cache through the daemon's socket with SmolLM2: equal output with
and without it, no false hits, pages that outlive a killed worker, clearing,
and the drafter's own pages."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace

import pytest

SYSTEM = (
    "You are a terse assistant for a small software team. Answer in one or two sentences. "
    "Never invent facts; say when you do not know. Prefer plain words. "
) * 3


@pytest.fixture
def cached_daemon(start_daemon):
    # settling off: these tests count what each turn takes from the cache, which pages stored
    # between requests would change depending on when the next request arrives (test_settle.py)
    return start_daemon("--ctx-size", "1024", "--cache-bytes", "64M", "--page-tokens", "16", "--settle", "off")


def test_multi_turn_chat_with_the_cache_equals_without(cached_daemon):
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a unit test?"}]
    with cached_daemon.client() as client:
        chunk = client.status().model.prefill_chunk  # (--kernels mixed: what is kept ends at a whole chunk)
        assert chunk == 64
        first = client.complete(messages=history, max_tokens=24, temperature=0.0)
        assert first.usage.cached_tokens == 0
        for question in ["And an integration test?", "Which should I write first?"]:
            history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": question}]
            cached = client.complete(messages=history, max_tokens=24, temperature=0.0)
            fresh = client.complete(messages=history, max_tokens=24, temperature=0.0, cache=False)
            assert fresh.usage.cached_tokens == 0
            # the system prompt and the earlier turns came from the cache: the turn before
            # left them in the model's KV (to the last whole chunk its prompt was read in);
            # the cache: false request between turns cleared it, so the next turn
            # restored them from pages
            assert cached.usage.cached_tokens == first.usage.prompt_tokens // chunk * chunk > 0
            assert cached.text == fresh.text
            first = cached
        st = client.status()
    c = st.cache
    # (the disk tier's counts in status may have moved on since: pages written between requests)
    assert c is not None and replace(c, disk=None) == replace(cached.cache, disk=None) and c.page_tokens == 16
    assert c.hits == 2 and c.misses == 1  # the first turn missed; the cache: false requests did not look
    assert c.tokens_from_cache > 0 and c.tokens_prefilled > 0 and 0 < c.bytes_used <= c.bytes_budget == 64 * 2**20
    assert 0 < c.tokens_from_live < c.tokens_from_cache  # turn 2 from the live KV, turn 3 from pages
    assert c.pages > 0 and c.evictions == 0
    out = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "--socket", str(cached_daemon.socket), "status"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "prompt tokens from cache" in out.stdout, out.stderr


def resent_extended_and_from_pages(client):
    """A prompt, the same again, extended by its reply and a question (cached, then
    cache: false), then the first prompt again, which the cache: false request left
    to the pages only; and the status's tokens_from_live after them."""
    prompt = SYSTEM + "Question: what is a flaky test?"
    first = client.complete(prompt=prompt, max_tokens=12, temperature=0.0)
    again = client.complete(prompt=prompt, max_tokens=12, temperature=0.0)
    extended = prompt + first.text + " And a slow one?"
    longer = client.complete(prompt=extended, max_tokens=12, temperature=0.0)
    fresh_longer = client.complete(prompt=extended, max_tokens=12, temperature=0.0, cache=False)
    from_pages = client.complete(prompt=prompt, max_tokens=12, temperature=0.0)
    return first, again, longer, fresh_longer, from_pages, client.status().cache.tokens_from_live


def test_a_repeated_prompt_reads_nothing_and_an_extended_one_from_its_last_whole_chunk(cached_daemon):
    """--kernels mixed (the default): a re-sent prompt is not read at all (the model
    still holds its KV and the logits after it, from the request before); a prompt
    that extends it keeps every whole chunk the request before read in its prefill
    and reads the rest as an uncached request reads it."""
    with cached_daemon.client() as client:
        chunk = client.status().model.prefill_chunk
        first, again, longer, fresh_longer, from_pages, live = resent_extended_and_from_pages(client)
    n = first.usage.prompt_tokens
    assert n > chunk
    assert first.usage.cached_tokens == 0
    assert again.usage.cached_tokens == n and again.text == first.text
    assert again.timings.prompt_seconds < first.timings.prompt_seconds
    assert longer.usage.cached_tokens == n // chunk * chunk and longer.text == fresh_longer.text
    assert from_pages.usage.cached_tokens == (n - 1) // chunk * chunk and from_pages.text == first.text
    assert live == again.usage.cached_tokens + longer.usage.cached_tokens


def test_with_reference_kernels_a_repeated_prompt_rereads_one_token(start_daemon):
    """--kernels reference: what the model holds from the request before is kept to
    the token: a re-sent prompt prefills its last token only, an extended one its new tokens."""
    d = start_daemon("--ctx-size", "1024", "--cache-bytes", "64M", "--page-tokens", "16", "--kernels", "reference")
    with d.client() as client:
        assert client.status().model.prefill_chunk == 0
        first, again, longer, fresh_longer, from_pages, live = resent_extended_and_from_pages(client)
    n = first.usage.prompt_tokens
    assert first.usage.cached_tokens == 0
    assert again.usage.cached_tokens == n - 1 and again.text == first.text
    # the prompt and what the first request wrote were still in the KV: only the new words are read
    assert n - 1 <= longer.usage.cached_tokens < longer.usage.prompt_tokens and longer.text == fresh_longer.text
    assert from_pages.usage.cached_tokens == (n - 1) // 16 * 16 and from_pages.text == first.text
    assert live == again.usage.cached_tokens + longer.usage.cached_tokens


def test_without_an_arena_the_live_kv_is_still_reused(start_daemon):
    d = start_daemon("--ctx-size", "512", "--cache-bytes", "0")
    prompt = SYSTEM + "Question: what is a mock?"
    with d.client() as client:
        first = client.complete(prompt=prompt, max_tokens=12, temperature=0.0)
        again = client.complete(prompt=prompt, max_tokens=12, temperature=0.0)
        uncached = client.complete(prompt=prompt, max_tokens=12, temperature=0.0, cache=False)
        after_uncached = client.complete(prompt=prompt, max_tokens=12, temperature=0.0)  # nothing left to reuse
        kept = client.complete(prompt=prompt, max_tokens=12, temperature=0.0)
        cleared = client.cache_clear()
        after_clear = client.complete(prompt=prompt, max_tokens=12, temperature=0.0)
        assert client.status().cache is None
    n = first.usage.prompt_tokens  # a re-sent prompt is not read again
    assert again.usage.cached_tokens == n and uncached.usage.cached_tokens == 0
    assert after_uncached.usage.cached_tokens == 0 and kept.usage.cached_tokens == n
    assert cleared.pages == 0 and cleared.cache is None and after_clear.usage.cached_tokens == 0
    assert first.text == again.text == uncached.text == after_clear.text


def test_same_later_tokens_after_another_start_are_no_hit(cached_daemon):
    tail = " The build log follows. step one compiled, step two linked, step three tested. " * 4
    with cached_daemon.client() as client:
        a = client.complete(prompt="Report A." + tail, max_tokens=4, temperature=0.0)
        b = client.complete(prompt="Another start entirely, different words." + tail, max_tokens=4, temperature=0.0)
        again = client.complete(prompt="Report A." + tail + " Summary:", max_tokens=4, temperature=0.0)
    assert a.usage.cached_tokens == 0
    assert b.usage.cached_tokens == 0  # its pages after the first hold a's tokens, but follow another prefix
    assert again.usage.cached_tokens > 0


def wait_ready_again(d, old_pid: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with d.client() as c:
            st = c.status()
        if st.state == "ready" and st.worker_pids.get("target") not in (None, old_pid):
            return
        time.sleep(0.1)
    raise TimeoutError(d.log())


def test_a_worker_killed_with_sigkill_restarts_and_still_hits_the_cache(cached_daemon):
    prompt = "Report A." + " The build log follows. step one compiled, step two linked, step three tested." * 6
    with cached_daemon.client() as client:
        first = client.complete(prompt=prompt, max_tokens=8, temperature=0.0)
        before = client.status()
        pid = before.worker_pids["target"]
        os.kill(pid, signal.SIGKILL)
    wait_ready_again(cached_daemon, pid)
    with cached_daemon.client() as client:
        after = client.status()
        assert after.worker_restarts == 1
        assert after.cache is not None and after.cache.pages == before.cache.pages > 0  # taken back from the arena
        again = client.complete(prompt=prompt, max_tokens=8, temperature=0.0)
    chunk = after.model.prefill_chunk
    assert again.usage.cached_tokens == (first.usage.prompt_tokens - 1) // chunk * chunk > 0
    assert again.text == first.text
    assert "pages kept from the previous worker" in cached_daemon.log()


def test_cache_clear_empties_it_after_which_requests_miss(cached_daemon):
    prompt = SYSTEM + "Question: what is a flaky test?"
    with cached_daemon.client() as client:
        client.complete(prompt=prompt, max_tokens=4, temperature=0.0)
        assert client.complete(prompt=prompt, max_tokens=4, temperature=0.0).usage.cached_tokens > 0
        held = client.status().cache
        out = subprocess.run(
            [sys.executable, "-m", "tandem.cli", "--socket", str(cached_daemon.socket), "cache", "clear"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert f"cleared {held.pages:,} pages" in out.stdout
        st = client.status().cache
        assert st.pages == 0 and st.bytes_used == 0 and st.evictions == 0
        assert client.complete(prompt=prompt, max_tokens=4, temperature=0.0).usage.cached_tokens == 0
        # a clear sent while a request runs waits for it, and that request completes normally
        stream = client.generate(prompt=prompt, max_tokens=64, temperature=0.0, ignore_eos=True)
        next(iter(stream))  # it runs
        cleared = client.cache_clear()
        for _ in stream:
            pass
        assert stream.done.finish_reason.value == "length"
        # the clear came after the request stored its pages: it dropped them
        assert cleared.pages > 0 and cleared.cache is not None and cleared.cache.pages == 0


def test_a_daemon_started_with_cache_bytes_0_has_no_cache(start_daemon):
    d = start_daemon("--ctx-size", "512", "--cache-bytes", "0")
    with d.client() as client:
        done = client.complete(prompt="Hello", max_tokens=2, temperature=0.0)
        assert done.cache is None and client.status().cache is None
        assert client.cache_clear().cache is None


def test_cache_bytes_larger_than_shared_memory_is_refused_with_the_fix(smollm2_path, tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.cli",
            "--socket",
            str(tmp_path / "s"),
            "serve",
            "--model",
            str(smollm2_path),
            "--cache-bytes",
            "100000G",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert "more than /dev/shm has free" in out.stderr and "--cache-bytes 0" in out.stderr


@pytest.fixture
def pair(smollm2_path):
    from tandem.daemon import models

    return models.derive_f16(smollm2_path), smollm2_path


def test_the_drafter_keeps_its_own_pages_and_output_is_unchanged(start_daemon, pair):
    target, drafter = pair
    d = start_daemon(
        "--drafter",
        str(drafter),
        "--ctx-size",
        "1024",
        "--draft-tokens",
        "4",
        "--governor",
        "off",
        "--cache-bytes",
        "64M",
        "--page-tokens",
        "16",
        model=target,
    )
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name one kind of test."}]
    with d.client() as client:
        assert not client.status().model.draft_off  # (the probe found drafting exact here: else it says why)
        first = client.complete(messages=history, max_tokens=16, temperature=0.0)
        assert first.draft is not None and first.draft.rounds > 0, (first, client.status())
        c = first.cache
        assert set(c.page_bytes) == {"target", "drafter"} and c.drafter_tokens_from_cache == 0
        # every cached stretch of tokens has a page of each model
        assert c.pages % 2 == 0 and c.pages > 0
        assert c.bytes_used >= c.pages // 2 * (c.page_bytes["target"] + c.page_bytes["drafter"])
        # another session in between: the drafter's KV then holds that one
        client.complete(prompt="A different session about databases. " * 8, max_tokens=8, temperature=0.0)
        history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And another?"}]
        cached = client.complete(messages=history, max_tokens=16, temperature=0.0)
        fresh = client.complete(messages=history, max_tokens=16, temperature=0.0, cache=False)
    assert cached.usage.cached_tokens > 0 and cached.text == fresh.text
    assert cached.draft is not None and cached.draft.rounds > 0
    # so it restored its pages of this session's start rather than reading them again
    assert cached.cache.drafter_tokens_from_cache >= cached.usage.cached_tokens - 16 > 0


@pytest.mark.parametrize("kernels", ["reference", "mixed"])
def test_with_exact_steps_a_re_sent_prompt_still_gives_the_uncached_answer(start_daemon, pair, kernels):
    """A target that is not batch-invariant (the F16 one) with a drafter runs exact
    steps: never a one-token pass, so with reference kernels the KV kept from the
    request before leaves two tokens of the prompt to read; with mixed ones a
    re-sent prompt reads nothing (its logits are the prefill's); the answer is the
    uncached one."""
    target, drafter = pair
    d = start_daemon(
        "--drafter", str(drafter), "--ctx-size", "1024", "--cache-bytes", "0", "--kernels", kernels, model=target
    )
    prompt = SYSTEM + "Question: what is a fixture?"
    with d.client() as client:
        exact = client.status().model.exact_steps
        first = client.complete(prompt=prompt, max_tokens=12, temperature=0.0, draft="off")
        again = client.complete(prompt=prompt, max_tokens=12, temperature=0.0, draft="off")
        fresh = client.complete(prompt=prompt, max_tokens=12, temperature=0.0, draft="off", cache=False)
    keep = (2 if exact else 1) if kernels == "reference" else 0  # (exact steps follow the load probe here)
    assert again.usage.cached_tokens == first.usage.prompt_tokens - keep
    assert first.text == again.text == fresh.text
