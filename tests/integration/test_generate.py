"""Generation through the real daemon's socket with the real SmolLM2-135M model."""

from __future__ import annotations

import codecs
import threading
import time

import pytest

from tandem.client import Client, QueueFull, RequestFailed
from tandem.client.core import generate_request
from tandem.daemon.worker.llama_decode import PREFILL_GROUP
from tandem.daemon.worker.llama_load import reference_llama
from tandem.protocol import PROGRESS_SECONDS, ErrorCode, FinishReason

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    '{"name": "Ada", "languages": [',
    "Once upon a time, in a small village by the sea,",
]


@pytest.fixture(scope="module")
def reference(smollm2_path):
    """llama-cpp-python's own high-level API, in this process, same settings as the daemon."""
    llm = reference_llama(smollm2_path, n_ctx=1024, n_batch=512)
    yield llm
    llm.close()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_through_the_socket_equals_llama_cpp_in_process(client, reference, prompt):
    done = client.complete(prompt=prompt, max_tokens=48, temperature=0.0)
    ref = reference.create_completion(prompt, max_tokens=48, temperature=0.0)
    assert done.text == ref["choices"][0]["text"]
    assert done.usage.completion_tokens == ref["usage"]["completion_tokens"]
    assert done.usage.prompt_tokens == ref["usage"]["prompt_tokens"]


def test_chat_uses_the_gguf_template_like_llama_cpp(client, reference):
    messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Name a colour."}]
    done = client.complete(messages=messages, max_tokens=32, temperature=0.0)
    ref = reference.create_chat_completion(messages=messages, max_tokens=32, temperature=0.0)
    assert done.text == ref["choices"][0]["message"]["content"]
    assert done.finish_reason.value == ref["choices"][0]["finish_reason"]


def test_stream_chunks_concatenate_to_the_final_text(client):
    stream = client.generate(prompt="Write a haiku about the sea.\n", max_tokens=40, temperature=0.7, seed=3)
    chunks = list(stream)
    assert "".join(c.text for c in chunks) == stream.done.text == stream.text
    assert sum(len(c.token_ids) for c in chunks) == stream.done.usage.completion_tokens
    assert len(chunks) >= stream.done.usage.completion_tokens  # streamed token by token


def test_seeded_sampling_reproduces(client):
    a = client.complete(prompt="A list of fruits:", max_tokens=24, temperature=1.0, seed=1234)
    b = client.complete(prompt="A list of fruits:", max_tokens=24, temperature=1.0, seed=1234)
    assert a.text == b.text


def test_stop_strings_cut_the_text_where_the_unstopped_text_has_them(client):
    prompt = "Count: 1, 2, 3,"
    full = client.complete(prompt=prompt, max_tokens=40, temperature=0.0, ignore_eos=True).text
    assert " 6" in full, full  # the test needs the stop string in the unstopped output
    stopped = client.complete(prompt=prompt, max_tokens=40, temperature=0.0, stop=[" 6"])
    assert stopped.finish_reason == FinishReason.STOP
    assert stopped.text == full[: full.index(" 6")]
    streamed = client.generate(prompt=prompt, max_tokens=40, temperature=0.0, stop=[" 6"])
    assert "".join(c.text for c in streamed) == stopped.text  # no chunk ever showed the stop string


def test_max_tokens_is_honoured(client):
    done = client.complete(prompt="Tell me a long story.", max_tokens=17, temperature=0.0, ignore_eos=True)
    assert done.usage.completion_tokens == 17
    assert done.finish_reason == FinishReason.LENGTH


def test_multibyte_utf8_is_never_split(client, reference):
    prompt = "日本の首都は東京です。日本の有名な食べ物は"
    stream = client.generate(prompt=prompt, max_tokens=40, temperature=0.0)
    chunks = list(stream)
    pieces = [reference.detokenize([t]) for c in chunks for t in c.token_ids]
    incomplete = []
    for p in pieces:
        try:
            p.decode("utf-8")
        except UnicodeDecodeError:
            incomplete.append(p)
    assert incomplete, "the test needs tokens that are partial UTF-8 characters"
    assert "\ufffd" not in stream.done.text
    assert all("\ufffd" not in c.text for c in chunks)
    # everything but a character that max_tokens may have cut in half at the end
    assert stream.done.text == codecs.getincrementaldecoder("utf-8")().decode(b"".join(pieces))


def test_prompt_over_the_context_gets_the_documented_error(client):
    with pytest.raises(RequestFailed) as info:
        client.complete(prompt="word " * 1500, max_tokens=4)
    assert info.value.code == ErrorCode.PROMPT_TOO_LONG
    assert "1,024" in info.value.message and "--ctx-size" in info.value.message
    assert client.complete(prompt="Still alive?", max_tokens=3, ignore_eos=True).usage.completion_tokens == 3


def test_duplicate_request_id_is_refused(client, daemon):
    stream = client.generate(prompt="Go on and on:", max_tokens=400, ignore_eos=True, request_id="same-id")
    next(iter(stream))
    with daemon.client() as other, pytest.raises(RequestFailed) as info:
        other.complete(prompt="x", max_tokens=2, request_id="same-id")
    assert info.value.code == ErrorCode.DUPLICATE_REQUEST_ID
    assert stream.cancel().finish_reason == FinishReason.CANCELLED


def test_cancel_ends_the_request_promptly(client, daemon):
    stream = client.generate(prompt="Keep talking:", max_tokens=5000, ignore_eos=True)
    it = iter(stream)
    for _ in range(3):
        next(it)
    with daemon.client() as other:
        assert other.cancel(stream.request_id) is True
        assert other.cancel("no-such-request") is False
    rest = list(it)
    assert stream.done.finish_reason == FinishReason.CANCELLED
    assert len(rest) <= 3  # chunks already in flight when the cancel landed
    assert stream.done.usage.completion_tokens < 10


def test_status_answers_while_a_generation_runs(client, daemon):
    stream = client.generate(prompt="Write a very long essay:", max_tokens=2000, ignore_eos=True)
    it = iter(stream)
    next(it)
    seen = []
    with daemon.client() as other:
        for _ in range(5):
            t0 = time.perf_counter()
            st = other.status()
            seen.append((time.perf_counter() - t0, st.active.completion_tokens if st.active else None))
            time.sleep(0.05)
    assert all(tokens is not None for _, tokens in seen), seen  # the generation was running all along
    assert seen[-1][1] > seen[0][1]  # and progressing
    assert max(latency for latency, _ in seen) < 1.0  # answered without waiting for the ~25 s generation
    stream.cancel()


def test_client_going_away_cancels_its_request(daemon):
    before = Client(daemon.socket).status().requests.get("done_cancelled", 0)
    c = Client(daemon.socket)
    stream = c.generate(prompt="Ramble forever:", max_tokens=5000, ignore_eos=True)
    it = iter(stream)
    next(it)
    next(it)
    c.close()  # no cancel sent: the socket just goes away
    with daemon.client() as watcher:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            st = watcher.status()
            if st.active is None:
                break
            time.sleep(0.02)
        assert st.active is None
        assert st.requests.get("done_cancelled", 0) == before + 1


def test_async_client_streams_and_queries_status_concurrently(daemon):
    import asyncio

    from tandem.client import AsyncClient

    async def main():
        async with AsyncClient(daemon.socket) as ac:
            stream = await ac.generate(prompt="def add(a, b):", max_tokens=30, temperature=0.0)
            texts = []
            statuses = []
            async for chunk in stream:
                texts.append(chunk.text)
                if len(texts) == 5:
                    statuses.append(await ac.status())
            return "".join(texts), stream.done, statuses

    text, done, statuses = asyncio.run(main())
    assert text == done.text and done.usage.completion_tokens > 5
    assert statuses[0].active is not None


def test_full_queue_answers_busy(start_daemon):
    d = start_daemon("--max-queue", "1", "--ctx-size", "512", "--preempt-tokens", "0")  # (the queue alone)
    with d.client() as a, d.client() as b, d.client() as c:
        running = a.generate(prompt="Go:", max_tokens=3000, ignore_eos=True)
        next(iter(running))
        queued = b.generate(prompt="Wait:", max_tokens=5)
        deadline = time.monotonic() + 5
        while c.status().queue_length < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(QueueFull) as info:
            c.complete(prompt="One too many", max_tokens=5)
        assert info.value.max_queue == 1 and info.value.queue_length == 1
        assert c.status().requests["busy"] == 1
        running.cancel()
        list(queued)
        assert queued.done.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)


def test_requests_are_served_in_arrival_order(start_daemon):
    d = start_daemon("--ctx-size", "512")
    finished: list[int] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        with d.client() as c:
            c.complete(prompt=f"Number {i}:", max_tokens=8, ignore_eos=True, temperature=0.0)
            with lock:
                finished.append(i)

    with d.client() as blocker:
        running = blocker.generate(prompt="Hold:", max_tokens=3000, ignore_eos=True)
        next(iter(running))
        threads = []
        for i in range(5):
            t = threading.Thread(target=one, args=(i,))
            t.start()
            threads.append(t)
            deadline = time.monotonic() + 5
            while blocker.status().queue_length < i + 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        running.cancel()
        for t in threads:
            t.join(60)
    assert finished == [0, 1, 2, 3, 4]


def test_cancel_lands_during_a_long_prefill(client, daemon):
    stream = client.generate(prompt="word " * 800, max_tokens=50)  # ~800 tokens: two prefill batches
    with daemon.client() as other:
        assert other.cancel(stream.request_id)
    assert list(stream) == []
    assert stream.done.finish_reason == FinishReason.CANCELLED
    assert stream.done.usage.completion_tokens == 0 and stream.done.usage.prompt_tokens > 512


def test_a_vanished_client_s_queued_and_unstreamed_requests_are_cancelled(daemon):
    before = Client(daemon.socket).status().requests.get("done_cancelled", 0)
    c = Client(daemon.socket)
    c.connect()
    c._send(generate_request(prompt="Forever:", max_tokens=3000, ignore_eos=True, stream=False))
    c._send(generate_request(prompt="Queued:", max_tokens=3000))
    with daemon.client() as watcher:
        while watcher.status().active is None:
            time.sleep(0.01)
        c.close()  # no chunk will ever fail to send: only the disconnect tells the daemon
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            st = watcher.status()
            if st.active is None and st.queue_length == 0:
                break
            time.sleep(0.02)
        assert st.active is None and st.queue_length == 0
        assert st.requests.get("done_cancelled", 0) == before + 2


def test_leaving_a_stream_early_cancels_it(client):
    with client.generate(prompt="On and on:", max_tokens=3000, ignore_eos=True) as stream:
        for i, _ in enumerate(stream):
            if i == 2:
                break
    t0 = time.perf_counter()
    done = client.complete(prompt="Next:", max_tokens=3, ignore_eos=True)  # not stuck behind 3000 tokens
    assert done.usage.completion_tokens == 3
    assert time.perf_counter() - t0 < 20
    assert stream.request_id not in client._router.buffers


def test_progress_requests_see_the_prompt_read_and_the_same_text(client):
    # a streamed request with progress: chunks with no text say how far its prompt's reading has come (the first
    # when it begins: what the cache held; the last when it ends), all before the first token; the text is the
    # text without them
    prompt = "A short story about a lighthouse keeper and the sea. " * 40  # ~500 tokens, some from the cache
    plain = client.complete(prompt=prompt, max_tokens=16, temperature=0.0)
    client.cache_clear()
    stream = client.generate(prompt=prompt, max_tokens=16, temperature=0.0, progress=True)
    chunks = list(stream)
    reports = [c.progress for c in chunks if c.progress is not None]
    assert len(reports) >= 2, chunks
    first_text = next(i for i, c in enumerate(chunks) if c.token_ids)
    assert all(c.progress is not None for c in chunks[:first_text])
    assert all(c.progress is None for c in chunks[first_text:])
    assert all(c.text == "" and c.token_ids == [] and c.tool_calls == [] for c in chunks if c.progress is not None)
    total = stream.done.usage.prompt_tokens
    assert {p.total for p in reports} == {total}
    assert reports[0].processed == reports[0].cached == stream.done.usage.cached_tokens
    assert reports[-1].processed == total
    assert [p.processed for p in reports] == sorted(p.processed for p in reports)
    assert stream.done.text == plain.text and stream.text == plain.text
    # not streamed, or not asked: no progress chunks
    quiet = client.generate(prompt=prompt + " More.", max_tokens=4, temperature=0.0)
    assert all(c.progress is None for c in quiet)


def test_a_prompt_read_for_longer_than_the_clients_timeout_is_not_a_timeout(start_daemon):
    """The Python client's timeout is for each reply; it asks for the prompt's progress, so a prompt
    that takes longer than that to read (32k tokens on a laptop: minutes) is answered, streamed or not,
    and its caller sees no progress chunk it did not ask for."""
    d = start_daemon("--ctx-size", "8192", "--cache-bytes", "0")
    unit = "The lighthouse keeper wrote in his log about the sea and the ships. "  # ~15 tokens
    with d.client(timeout=None) as c:
        for n in (60, 120, 240, 480):  # as long as it takes this CPU more than two timeouts to read
            prompt = unit * n
            alone = c.complete(prompt=prompt, max_tokens=4, temperature=0.0, cache=False)
            # progress comes between two passes of the reading (PREFILL_GROUP tokens each), at most once
            # every PROGRESS_SECONDS: the timeout is more than that and three passes of this CPU
            passes = -(-alone.usage.prompt_tokens // PREFILL_GROUP)
            timeout = PROGRESS_SECONDS + 3 * alone.timings.prompt_seconds / passes
            if alone.timings.prompt_seconds > 2 * timeout:
                break
    assert alone.timings.prompt_seconds > 2 * timeout, "7,000 tokens read in under two timeouts: a longer prompt"
    with d.client(timeout=timeout) as c:
        done = c.complete(prompt=prompt, max_tokens=4, temperature=0.0, cache=False)
        stream = c.generate(prompt=prompt, max_tokens=4, temperature=0.0, cache=False)
        chunks = list(stream)
    assert done.text == alone.text == stream.done.text
    assert done.timings.prompt_seconds > timeout and all(ch.progress is None for ch in chunks)
