"""``tandem http --temperature/--top-k/--top-p``: sampling for the requests that set none (Claude Code sends
no temperature, so Anthropic's default of 1 samples its every turn), as llama-server's --temp. Driven by the
official anthropic, openai and ollama packages against the real daemon on Qwen2.5-Coder-0.5B: a request with
no temperature on a bridge started with --temperature 0 gets the greedy answer, in every dialect; one that sets
its own keeps it; a bridge's --top-k 1 makes any temperature greedy."""

from __future__ import annotations

import anthropic
import ollama
import pytest

ASK = "Write a four-line poem about the sea."
TOKENS = 40


@pytest.fixture(scope="module")
def plain(coder_daemon, bridge_process):
    b = bridge_process(coder_daemon)
    yield b
    assert b.stop() == 0, "".join(b.lines)


@pytest.fixture(scope="module")
def greedy(coder_daemon, bridge_process):
    b = bridge_process(coder_daemon, "--temperature", "0")
    yield b
    assert b.stop() == 0, "".join(b.lines)


@pytest.fixture(scope="module")
def top_1(coder_daemon, bridge_process):
    b = bridge_process(coder_daemon, "--top-k", "1", "--top-p", "0.5")
    yield b
    assert b.stop() == 0, "".join(b.lines)


def messages(bridge, **extra) -> str:
    api = anthropic.Anthropic(base_url=bridge.url.removesuffix("/v1"), api_key="unused", max_retries=0)
    m = api.messages.create(
        model="tandem", max_tokens=TOKENS, messages=[{"role": "user", "content": ASK}], extra_body=extra or None
    )
    return m.content[0].text


def chat(bridge, **extra) -> str:
    r = bridge.openai().chat.completions.create(
        model="tandem", max_tokens=TOKENS, messages=[{"role": "user", "content": ASK}], **extra
    )
    return r.choices[0].message.content


def responses(bridge, **extra) -> str:
    return bridge.openai().responses.create(model="tandem", max_output_tokens=TOKENS, input=ASK, **extra).output_text


def ollama_chat(bridge, **extra) -> str:
    api = ollama.Client(host=bridge.url.removesuffix("/v1"))
    options = {"num_predict": TOKENS, **extra}
    return api.chat(model="tandem", messages=[{"role": "user", "content": ASK}], options=options).message.content


DIALECTS = {"anthropic": messages, "chat": chat, "responses": responses, "ollama": ollama_chat}


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_a_request_with_no_temperature_samples_at_the_bridges(plain, greedy, dialect):
    ask = DIALECTS[dialect]
    expected = ask(plain, temperature=0)
    # the dialect's own default (1; Ollama's and the daemon's 0.8) samples: three answers of 40 tokens, each greedy,
    # would be a chance this model does not give a poem
    assert [ask(greedy) for _ in range(3)] == [expected] * 3
    assert ask(greedy, temperature=0) == expected


@pytest.mark.parametrize("dialect", ["chat", "ollama"])
def test_a_request_that_sets_its_own_sampling_keeps_it(plain, greedy, dialect):
    ask = DIALECTS[dialect]
    seeded = {"temperature": 1.0, "seed": 7}  # (a seed makes sampling repeatable, on either bridge)
    answer = ask(greedy, **seeded)
    assert answer == ask(plain, **seeded)
    assert answer != ask(plain, temperature=0)  # (this seed's answer is not the greedy one)


@pytest.mark.parametrize("dialect", ["anthropic", "ollama"])
def test_the_bridges_top_k_holds_where_a_request_sets_none(plain, top_1, dialect):
    # top-k 1 keeps only the likeliest token: greedy at any temperature (Ollama's own default top_k of 40 gives way)
    ask = DIALECTS[dialect]
    assert ask(top_1, temperature=1.0) == ask(plain, temperature=0)
