"""A reasoning model end to end: the daemon on a GGUF whose weights are
Qwen2.5-Coder-0.5B's and whose chat template and thinking tokens are
DeepSeek-R1-Distill-Qwen's (tests/reasoning_gguf.py: no small reasoning model can
be had here). Its generation prompt opens the thinking, so what the model writes
is thinking until it closes the tag, or the budget closes it. Through the
daemon's socket, then through the bridge with the real openai, ollama and
anthropic clients and the Responses API, each reading thinking the way its
dialect carries it."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent))
from reasoning_gguf import GPT_OSS, reasoning_gguf  # noqa: E402

ASK = [{"role": "user", "content": "Write a Python function that reverses a string, and explain it."}]
GREEDY = {"temperature": 0.0}
RULES = " ".join(f"Rule {i}: keep the code short, typed and tested, and say why in one line." for i in range(1, 13))
LONG_ASK = [{"role": "system", "content": "You are a careful Python tutor. " + RULES}, *ASK]  # (> 2 cache chunks)


@pytest.fixture(scope="module")
def r1_path(coder_path) -> Path:
    from tandem.daemon.models import models_dir

    return reasoning_gguf(coder_path, models_dir().parent / "test-models")


@pytest.fixture(scope="module")
def r1_daemon(r1_path, daemon_process):
    # (a budget for the requests that set none: Ollama's clients cannot, and this model, which never learnt
    # the tag, would think to the end)
    d = daemon_process(r1_path, "--ctx-size", "2048", "--drafter", "ngram", "--thinking-budget", "12")
    d.wait_ready(600)  # (a file of its own: the load probe runs for it once a session)
    yield d
    assert d.stop() == 0, d.log()
    d.cleanup()


@pytest.fixture(scope="module")
def client(r1_daemon):
    with r1_daemon.client() as c:
        yield c


def test_the_daemon_knows_the_model_thinks(client):
    assert client.status().model.reasoning == "think"


def test_the_daemons_budget_holds_where_a_request_sets_none(client):
    done = client.complete(messages=ASK, max_tokens=40, **GREEDY)
    assert done.reasoning and done.text and 12 <= done.usage.reasoning_tokens <= 15
    longer = client.complete(messages=ASK, max_tokens=40, max_thinking_tokens=20, **GREEDY)
    assert 20 <= longer.usage.reasoning_tokens <= 23 and longer.reasoning.startswith(done.reasoning)


def test_a_budget_ends_the_thinking_and_the_model_answers_after_it(client):
    stream = client.generate(messages=ASK, max_tokens=48, max_thinking_tokens=12, **GREEDY)
    chunks = list(stream)
    done = stream.done
    assert done.reasoning and done.text, done
    assert "".join(c.reasoning for c in chunks) == done.reasoning and "".join(c.text for c in chunks) == done.text
    assert "</think>" not in done.text and "</think>" not in done.reasoning
    assert 12 <= done.usage.reasoning_tokens <= 12 + 3  # the budget, and the closing's tokens up to its tag
    assert done.usage.completion_tokens > done.usage.reasoning_tokens


def test_thinking_off_answers_at_once(client):
    done = client.complete(messages=ASK, max_tokens=24, think=False, **GREEDY)
    assert done.reasoning == "" and done.usage.reasoning_tokens == 0 and done.text


def test_a_count_renders_the_prompt_as_the_request_with_its_reasoning_controls(client):
    """This template closes the thinking in the prompt when it is off: more tokens, counted so."""
    default, off = client.count_tokens(messages=ASK), client.count_tokens(messages=ASK, think=False)
    assert off > default
    assert off == client.complete(messages=ASK, max_tokens=1, think=False, **GREEDY).usage.prompt_tokens
    assert client.count_tokens(messages=ASK, max_thinking_tokens=0) == off  # (a budget of 0: thinking off)
    assert client.count_tokens(messages=ASK, think=True) == default


def test_the_split_output_is_the_same_with_cache_and_drafting_on_or_off(client):
    kw = dict(messages=LONG_ASK, max_tokens=40, max_thinking_tokens=10, **GREEDY)
    runs = [
        client.complete(cache=False, draft="off", **kw),
        client.complete(draft="on", **kw),  # (drafting every round)
        client.complete(draft="off", **kw),  # (the pages the one before left)
    ]
    assert len({(d.reasoning, d.text) for d in runs}) == 1, [(d.reasoning, d.text) for d in runs]
    assert runs[2].usage.cached_tokens > 0


def test_the_next_turn_reuses_the_cached_prompt(client):
    """DeepSeek-R1's template drops an earlier turn's thinking: the next turn's prompt still starts with
    the first turn's, which the cache serves (to its last whole 64-token chunk)."""
    first = client.complete(messages=LONG_ASK, max_tokens=24, max_thinking_tokens=8, **GREEDY)
    turn = {"role": "assistant", "content": first.text, "reasoning": first.reasoning}
    later = [*LONG_ASK, turn, {"role": "user", "content": "Shorter."}]
    second = client.complete(messages=later, max_tokens=8, **GREEDY)
    assert second.usage.cached_tokens >= first.usage.prompt_tokens // 64 * 64 > 0


# --------------------------------------------------------------------------- the bridge's dialects


@pytest.fixture(scope="module")
def bridge(r1_daemon, bridge_process):
    b = bridge_process(r1_daemon)
    yield b
    assert b.stop() == 0, "".join(b.lines)


def test_openai_chat_has_reasoning_content_whole_and_streamed(bridge):
    oa = bridge.openai()
    kw = dict(model="tandem", messages=ASK, max_tokens=40, temperature=0, extra_body={"max_thinking_tokens": 10})
    whole = oa.chat.completions.create(**kw)
    message = whole.choices[0].message
    thought = message.model_extra["reasoning_content"]
    assert thought and message.content
    assert whole.usage.completion_tokens_details.reasoning_tokens >= 10
    streamed_thought = streamed_text = ""
    for event in oa.chat.completions.create(**kw, stream=True):
        if event.choices:
            delta = event.choices[0].delta
            streamed_thought += (delta.model_extra or {}).get("reasoning_content") or ""
            streamed_text += delta.content or ""
    assert (streamed_thought, streamed_text) == (thought, message.content)
    off = oa.chat.completions.create(
        model="tandem", messages=ASK, max_tokens=16, temperature=0, reasoning_effort="none"
    )
    assert not (off.choices[0].message.model_extra or {}).get("reasoning_content")


def test_ollama_think_and_thinking(bridge):
    import ollama

    host = bridge.url.removesuffix("/v1")
    client = ollama.Client(host=host)
    options = {"temperature": 0, "num_predict": 40}
    body = dict(model="tandem", messages=ASK, options=options)
    answer = client.chat(**body, think=True)
    assert answer.message.thinking and answer.message.content
    parts = list(client.chat(**body, think=True, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == answer.message.thinking
    assert "".join(p.message.content or "" for p in parts) == answer.message.content
    off = client.chat(model="tandem", messages=ASK, options={"temperature": 0, "num_predict": 16}, think=False)
    assert not off.message.thinking and off.message.content
    shown = client.show("tandem")
    assert "thinking" in (shown.capabilities or [])


def test_anthropic_thinking_blocks_whole_streamed_and_sent_back(bridge):
    import anthropic

    client = anthropic.Anthropic(base_url=bridge.url.removesuffix("/v1"), api_key="unused", max_retries=0)
    kw = dict(
        model="tandem",
        max_tokens=40,
        messages=LONG_ASK[1:],
        system=LONG_ASK[0]["content"],
        thinking={"type": "enabled", "budget_tokens": 10},
        extra_body=GREEDY,  # (this SDK takes sampling settings as extra fields)
    )
    m = client.messages.create(**kw)
    assert [b.type for b in m.content][:2] == ["thinking", "text"]
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in m.content]
    # the history with the thinking block sent back, as Claude Code sends it
    history = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in m.content]}]
    again = client.messages.create(**{**kw, "messages": [*history, {"role": "user", "content": "Shorter."}]})
    assert again.content and again.usage.cache_read_input_tokens > 0
    off = client.messages.create(**{**kw, "thinking": {"type": "disabled"}, "max_tokens": 16})
    assert [b.type for b in off.content] == ["text"]
    # count_tokens renders the prompt with the request's thinking too (disabled: the thinking closed in it)
    count = {k: v for k, v in kw.items() if k in ("model", "messages", "system")}
    counted_off = client.messages.count_tokens(**count, thinking={"type": "disabled"}).input_tokens
    assert counted_off == off.usage.input_tokens + off.usage.cache_read_input_tokens
    assert client.messages.count_tokens(**count, thinking=kw["thinking"]).input_tokens < counted_off


def test_v1_tokenize_counts_with_the_reasoning_controls(bridge):
    """The bridge's /v1/tokenize renders messages as the chat request with the same fields would."""

    def count(**extra) -> int:
        body = json.dumps({"model": "tandem", "messages": ASK, **extra}).encode()
        req = urllib.request.Request(bridge.url + "/tokenize", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())["count"]

    default = count()
    assert count(reasoning_effort="none") == count(chat_template_kwargs={"enable_thinking": False}) > default
    assert count(think=True) == default


def test_responses_reasoning_items(bridge):
    body = {"model": "tandem", "input": ASK[0]["content"], "max_output_tokens": 40, "temperature": 0}
    oa = bridge.openai()
    whole = oa.responses.create(**body, extra_body={"max_thinking_tokens": 10})
    kinds = [item.type for item in whole.output]
    assert kinds == ["reasoning", "message"], kinds
    assert whole.output[0].content[0].text and whole.output_text
    assert whole.usage.output_tokens_details.reasoning_tokens >= 10
    events = list(oa.responses.create(**body, stream=True, extra_body={"max_thinking_tokens": 10}))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == whole.output[0].content[0].text
    done = [e for e in events if e.type == "response.completed"][0].response
    assert [item.type for item in done.output] == kinds
    # the reasoning item sent back with the next input is taken (and shown where the template wants it)
    request = urllib.request.Request(
        bridge.url + "/responses",
        data=json.dumps(
            {
                **body,
                "max_output_tokens": 8,
                "input": [
                    {"type": "message", "role": "user", "content": ASK[0]["content"]},
                    whole.output[0].model_dump(exclude_none=True),
                    whole.output[1].model_dump(exclude_none=True),
                    {"type": "message", "role": "user", "content": "Shorter."},
                ],
            }
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        assert json.load(r)["status"] in ("completed", "incomplete")


# --------------------------------------------------------------------------- gpt-oss's harmony format

WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def oss(r1_path, daemon_process):
    """The same file with gpt-oss's template (--chat-template-file): its control tokens are the file's."""
    d = daemon_process(r1_path, "--ctx-size", "4096", "--chat-template-file", str(GPT_OSS), "--thinking-budget", "8")
    d.wait_ready(600)
    with d.client() as c:
        yield c
    assert d.stop() == 0, d.log()
    d.cleanup()


def test_a_template_file_replaces_the_gguf_files(oss):
    assert oss.status().model.reasoning == "harmony"


def test_a_required_call_is_written_in_harmony_and_parsed(oss, weather_tool):
    done = oss.complete(messages=WEATHER, tools=[weather_tool], tool_choice="required", max_tokens=80, **GREEDY)
    assert done.finish_reason.value == "tool_calls", done
    (call,) = done.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    assert done.text == ""  # (the call's message is not answer text)
    # the call sent back with its thinking: gpt-oss's template shows the analysis on a tool-call turn
    turn = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": call.id, "function": {"name": call.function.name, "arguments": call.function.arguments}}],
        "reasoning": "The user wants the weather.",
    }
    history = [*WEATHER, turn, {"role": "tool", "tool_call_id": call.id, "name": "get_weather", "content": "18 C"}]
    pieces = oss.tokenize(messages=history, tools=[weather_tool], with_pieces=True).pieces
    assert "The user wants the weather." in "".join(pieces)
    after = oss.complete(messages=history, tools=[weather_tool], max_tokens=40, **GREEDY)
    assert after.finish_reason.value in ("stop", "length", "tool_calls")


def test_with_tools_on_auto_the_reply_keeps_harmonys_shape(oss, weather_tool):
    """Every reply with tools is one the grammar allows: analysis, then a final answer or one call."""
    done = oss.complete(messages=WEATHER, tools=[weather_tool], max_tokens=60, **GREEDY)
    assert done.usage.reasoning_tokens <= 8 + 8  # (the daemon's budget, and the closing it writes)
    if done.tool_calls:
        assert done.tool_calls[0].function.name == "get_weather" and done.text == ""
    assert "<|" not in done.text and "<|" not in done.reasoning
