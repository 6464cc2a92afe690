"""Anthropic's Messages API on the bridge, driven by the official ``anthropic``
Python package against the real daemon on Qwen2.5-Coder-0.5B: messages (system,
blocks, stop sequences), the streamed event sequence, tool_use and tool_result
blocks, count_tokens, and errors in Anthropic's shape."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import anthropic
import pytest

GREEDY = {"temperature": 0}  # (this SDK takes sampling settings as extra fields)
ONE_CALL = {"type": "any", "disable_parallel_tool_use": True}  # (in parallel this small model calls on and on)


@pytest.fixture(scope="module")
def bridge(coder_daemon, bridge_process):
    b = bridge_process(coder_daemon)
    yield b
    assert b.stop() == 0, "".join(b.lines)


@pytest.fixture(scope="module")
def client(bridge) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=bridge.url.removesuffix("/v1"), api_key="unused", max_retries=0)


def test_a_message_with_system_and_blocks(client, coder_daemon):
    m = client.messages.create(
        model="tandem",
        max_tokens=24,
        system=[{"type": "text", "text": "Answer in one short sentence."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is 2 + 2?"}]}],
        extra_body=GREEDY,
    )
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    (block,) = m.content
    assert block.type == "text" and "4" in block.text
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert m.usage.output_tokens > 0 and m.usage.input_tokens + m.usage.cache_read_input_tokens > 10


def test_streamed_events_assemble_to_the_same_message(client):
    kw = dict(model="tandem", max_tokens=24, messages=[{"role": "user", "content": "Name three colors."}])
    whole = client.messages.create(**kw, extra_body=GREEDY)
    with client.messages.stream(**kw, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    with client.messages.stream(**kw, extra_body=GREEDY) as stream:
        received = list(stream)
    events = [e.type for e in received]
    assert events[0] == "message_start" and events[-1] == "message_stop"
    # the prompt's size comes first, as Anthropic's does (an agent shows its context from it)
    prompt = whole.usage.input_tokens + whole.usage.cache_read_input_tokens
    assert received[0].message.usage.input_tokens == prompt
    assert events[1] == "content_block_start" and "content_block_stop" in events and "message_delta" in events


def test_stop_sequences_end_the_message_and_are_named(client):
    m = client.messages.create(
        model="tandem",
        max_tokens=40,
        messages=[{"role": "user", "content": "Count from 1 to 10, separated by commas."}],
        stop_sequences=[","],
        extra_body=GREEDY,
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == ","
    assert "," not in m.content[0].text


def test_tool_use_then_tool_result(client, weather_tool_anthropic):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model="tandem", max_tokens=80, tools=[weather_tool_anthropic], tool_choice=ONE_CALL, messages=ask)
    m = client.messages.create(**kw, extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input["city"].lower().startswith("paris") and use.id
    with client.messages.stream(**kw, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    (streamed_use,) = [b for b in streamed.content if b.type == "tool_use"]
    assert streamed_use.name == use.name and streamed_use.input == use.input  # input_json_delta pieces assembled
    history = ask + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C and sunny"}]},
    ]
    after = client.messages.create(
        model="tandem", max_tokens=40, tools=[weather_tool_anthropic], messages=history, extra_body=GREEDY
    )
    assert after.stop_reason in ("end_turn", "tool_use", "max_tokens") and after.content
    assert after.usage.input_tokens + after.usage.cache_read_input_tokens > (
        m.usage.input_tokens + m.usage.cache_read_input_tokens
    )


def test_count_tokens_is_what_the_message_reads(client, weather_tool_anthropic):
    kw = dict(
        model="tandem",
        system="Be brief.",
        messages=[{"role": "user", "content": "Say hello to the team."}],
        tools=[weather_tool_anthropic],
    )
    counted = client.messages.count_tokens(**kw).input_tokens
    m = client.messages.create(max_tokens=1, **kw, extra_body=GREEDY)
    assert counted == m.usage.input_tokens + m.usage.cache_read_input_tokens
    no_tools = client.messages.count_tokens(model="tandem", system="Be brief.", messages=kw["messages"]).input_tokens
    assert no_tools < counted  # the tools are rendered into the prompt too
    # ... except under tool_choice none, as the message renders it
    assert client.messages.count_tokens(**kw, tool_choice={"type": "none"}).input_tokens == no_tools


def raw(url: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json", "anthropic-version": "2023-06-01"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_errors_in_anthropics_shape(client, bridge):
    # max_tokens beyond the context is a cap, as in the API (agents send 32k+): the context ends the reply
    with client.messages.stream(
        model="tandem", max_tokens=50_000, messages=[{"role": "user", "content": "Hi"}], extra_body=GREEDY
    ) as stream:
        big = stream.get_final_message()
    assert big.stop_reason in ("end_turn", "max_tokens") and big.content[0].text
    url = bridge.url + "/messages"
    status, body = raw(url, {"model": "tandem", "messages": [{"role": "user", "content": "x"}]})
    assert status == 400 and body["type"] == "error" and "max_tokens" in body["error"]["message"]
    status, body = raw(url, b'{"model": ')
    assert status == 400 and body["type"] == "error" and "JSON" in body["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGk="}}
    status, body = raw(url, {"model": "t", "max_tokens": 5, "messages": [{"role": "user", "content": [image]}]})
    assert status == 400 and "text only" in body["error"]["message"]


def test_llama_server_tokenize_and_detokenize(bridge, coder_daemon):
    base = bridge.url.removesuffix("/v1")
    status, body = raw(base + "/tokenize", {"content": "def hello():", "with_pieces": True})
    assert status == 200 and "".join(t["piece"] for t in body["tokens"]) == "def hello():"
    ids = [t["id"] for t in body["tokens"]]
    status, back = raw(base + "/detokenize", {"tokens": ids})
    assert status == 200 and back["content"] == "def hello():"
    with coder_daemon.client() as c:
        assert c.tokenize("def hello():", add_special=False).tokens == ids
    status, counted = raw(bridge.url + "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200 and counted["count"] == len(counted["tokens"]) > 3
    status, body = raw(base + "/detokenize", {"tokens": [10**9]})
    assert status == 400 and "not in the vocabulary" in body["error"]["message"]
