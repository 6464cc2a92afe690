"""Anthropic's dialect (bridge/anthropic_api.py) without a model or a daemon:
/v1/messages bodies (system, blocks, tool_use and tool_result, tools and
tool_choice) parsed into the typed request and refused with Anthropic's 400s,
and the daemon's results rendered as a message and as its event sequence."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tandem.bridge.answers import ApiError
from tandem.bridge.anthropic_api import (
    BILLING_HEADER,
    MessageEvents,
    _prompt_tokens,
    chat_messages,
    content_blocks,
    parse_messages,
    stop_reason,
    usage,
    whole_message,
)
from tandem.bridge.translate import ToolUse
from tandem.protocol import FinishReason

N_CTX = 4096
BASE = {"model": "claude-sonnet", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]}
WEATHER = {"name": "get_weather", "description": "Weather now", "input_schema": {"type": "object"}}
WEATHER_SPEC = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}, "description": "Weather now"},
}


def refused(body: dict) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_messages(body, N_CTX)
    assert info.value.status == 400
    return info.value


# --------------------------------------------------------------------------- parsing


def test_a_plain_message_with_anthropics_defaults():
    req = parse_messages(BASE, N_CTX)
    assert req.messages == [{"role": "user", "content": "Hi"}] and req.model == "claude-sonnet"
    assert req.daemon_params() == {"max_tokens": 64, "temperature": 1.0, "stop": []}
    assert req.stream is False and req.tools is None


def test_sampling_caps_max_tokens_at_the_context_and_takes_top_p_zero_as_greedy():
    body = {**BASE, "max_tokens": 32000, "stop_sequences": ["\n\n"], "temperature": 0.5, "top_p": 0, "top_k": 5}
    assert parse_messages(body, N_CTX).daemon_params() == {
        "max_tokens": N_CTX,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 5,
        "stop": ["\n\n"],
    }
    assert parse_messages({**BASE, "stream": True}, N_CTX).stream is True


def test_system_blocks_tool_use_and_tool_results_become_the_daemons_messages():
    body = {
        **BASE,
        "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "The user wants...", "signature": "x"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Zürich"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "get_time"},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [{"type": "text", "text": "no clock"}],
                        "is_error": True,
                    },
                    {"type": "text", "text": "Thanks"},
                ],
            },
            {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},  # nothing left: no message
        ],
    }
    assert parse_messages(body, N_CTX).messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"id": "toolu_1", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
                {"id": "toolu_2", "function": {"name": "get_time", "arguments": "{}"}},
            ],
            "reasoning": "The user wants...",  # (sent back: a template that shows it gets it)
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no clock"},
        {"role": "user", "content": "Thanks"},
    ]


def test_a_tool_search_result_names_the_tools_it_found():
    """Claude Code's ToolSearch tool answers with tool_reference blocks (seen from 2.1.328)."""
    body = {
        **BASE,
        "messages": [
            {"role": "user", "content": "Find the edit tool"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {}}]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "tool_reference", "tool_name": "Edit"}, {"type": "text", "text": "ok"}],
                    }
                ],
            },
        ],
    }
    assert parse_messages(body, N_CTX).messages[-1] == {
        "role": "tool",
        "tool_call_id": "t1",
        "content": "Tool available: Edit\nok",
    }
    body["messages"][0] = {"role": "user", "content": [{"type": "tool_reference", "tool_name": "Edit"}]}
    with pytest.raises(ApiError, match="not supported"):  # only inside a tool result
        parse_messages(body, N_CTX)


@pytest.mark.parametrize(
    "choice, expected, parallel",
    [
        ({"type": "auto"}, "auto", None),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "none"}, "none", None),
        ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}, None),
        (None, None, None),
    ],
)
def test_tools_and_tool_choice(choice, expected, parallel):
    req = parse_messages({**BASE, "tools": [WEATHER, {"name": "ping", "type": "custom"}], "tool_choice": choice}, N_CTX)
    ping = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}}
    assert req.tools == ToolUse([WEATHER_SPEC, ping], choice=expected, parallel=parallel)


def test_count_tokens_reads_the_system_prompt_as_a_message():
    assert chat_messages({"system": "S", "messages": [{"role": "user", "content": "x"}]}) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "x"},
    ]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model": ""}, "model: the name of the model is required (any name: one is served)"),
        ({"messages": []}, "messages: an array of {role, content} is required"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role must be 'user', 'assistant' or 'system'"),
        ({"thinking": {"type": "sometimes"}}, "thinking.type must be enabled, adaptive or disabled"),
        (
            {"thinking": {"type": "enabled", "budget_tokens": -1}},
            "thinking.budget_tokens must be a non-negative integer",
        ),
        ({"output_config": "high"}, "output_config must be an object"),
        ({"output_config": {"effort": 3}}, "output_config.effort must be a string"),
        ({"context_management": []}, "context_management must be an object"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content must be a string or an array of blocks"),
        ({"system": 5}, "system must be a string or an array of text blocks"),
        ({"system": [{"type": "image"}]}, "system[0] must be a text block here"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages.0.content.0: tandem's models read text only (image blocks)",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}]},
            "messages.0.content.0: block type 'tool_use' is not supported here",
        ),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]}]},
            "messages.0.content.0: a tool_use block needs 'id' and 'name'",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
            "messages.0.content.0: a tool_result block needs 'tool_use_id'",
        ),
        ({"max_tokens": None}, "max_tokens: a positive integer is required"),
        ({"max_tokens": True}, "max_tokens: a positive integer is required"),
        ({"stop_sequences": "\n"}, "stop_sequences must be an array of strings"),
        ({"temperature": "hot"}, "temperature: a number is required"),
        ({"top_k": 1.5}, "top_k: a number is required"),
        ({"tool_choice": {"type": "any"}}, "tool_choice asks for a tool, but no tools are given"),
        ({"tools": {"name": "f"}}, "tools must be an array"),
        ({"tools": [{"input_schema": {}}]}, "tools.0: a tool needs 'name' and 'input_schema'"),
        (
            {"tools": [{"name": "web", "type": "web_search_20250305"}]},
            "tools.0: server tools (web_search_20250305) are not available here",
        ),
        ({"tools": [WEATHER], "tool_choice": {"type": "some"}}, "tool_choice.type must be auto, any, tool or none"),
    ],
)
def test_a_bad_message_is_a_400_in_anthropics_shape(change, message):
    err = refused({**BASE, **change})
    assert err.message == message and err.param is None
    assert err.body("anthropic") == {"type": "error", "error": {"type": "invalid_request_error", "message": message}}


# --------------------------------------------------------------------------- rendering


@pytest.mark.parametrize(
    "finish, sequence, expected",
    [
        (FinishReason.STOP, None, ("end_turn", None)),
        (FinishReason.STOP, "\n\n", ("stop_sequence", "\n\n")),
        (FinishReason.LENGTH, None, ("max_tokens", None)),
        (FinishReason.TOOL_CALLS, None, ("tool_use", None)),
        (FinishReason.CANCELLED, None, ("end_turn", None)),
    ],
)
def test_stop_reasons(done, finish, sequence, expected):
    assert stop_reason(done("x", finish, stop_sequence=sequence)) == expected


def test_a_whole_message(done):
    result = done("Hello", FinishReason.STOP, stop_sequence="\n\n")
    assert whole_message(result, "msg_1", "claude-sonnet") == {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet",
        "content": [{"type": "text", "text": "Hello"}],
        "stop_reason": "stop_sequence",
        "stop_sequence": "\n\n",
        "usage": {
            "input_tokens": 8,
            "output_tokens": 5,
            "cache_read_input_tokens": 4,
            "cache_creation_input_tokens": 0,
        },
    }


def test_content_blocks_text_then_calls_with_their_input_as_objects(done):
    calls = [("call_1", "get_weather", '{"city": "Paris"}'), ("call_2", "f", "oops")]
    assert content_blocks(done("", FinishReason.TOOL_CALLS, calls=calls)) == [
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "call_2", "name": "f", "input": {}},
    ]
    assert content_blocks(done("Sure.", FinishReason.TOOL_CALLS, calls=calls[:1]))[0] == {
        "type": "text",
        "text": "Sure.",
    }
    assert content_blocks(done("")) == [{"type": "text", "text": ""}]
    assert usage(done("x", cached_tokens=0))["input_tokens"] == 12


def test_the_event_sequence_of_a_text_then_a_tool_call(done, chunk):
    events = MessageEvents("msg_1", "claude-sonnet")
    (start,) = events.start(prompt_tokens=12)
    assert start == (
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "model": "claude-sonnet",
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": 12, "output_tokens": 0},
            },
        },
    )
    sent = events.chunk(chunk("Let me check."))
    sent += events.chunk(chunk("", deltas=[(0, '{"city"', "call_1", "get_weather"), (0, ': "Paris"}', None, None)]))
    sent += events.finish(done("Let me check.", FinishReason.TOOL_CALLS, calls=[("call_1", "get_weather", "{}")]))
    assert sent == [
        (
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        ),
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Let me check."}},
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            "content_block_start",
            {
                "type": "content_block_start",
                "index": 1,
                "content_block": {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 1,
                "delta": {"type": "input_json_delta", "partial_json": '{"city"'},
            },
        ),
        (
            "content_block_delta",
            {
                "type": "content_block_delta",
                "index": 1,
                "delta": {"type": "input_json_delta", "partial_json": ': "Paris"}'},
            },
        ),
        ("content_block_stop", {"type": "content_block_stop", "index": 1}),
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                "usage": {
                    "input_tokens": 8,
                    "output_tokens": 5,
                    "cache_read_input_tokens": 4,
                    "cache_creation_input_tokens": 0,
                },
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]


def test_an_empty_reply_still_has_one_empty_text_block(done):
    events = MessageEvents("msg_1", "m")
    names = [name for name, _ in events.finish(done("", FinishReason.LENGTH))]
    assert names == ["content_block_start", "content_block_stop", "message_delta", "message_stop"]


# --------------------------------------------------------------------------- as Claude Code sends it

RECORDED = Path(__file__).parent / "recorded"


def recorded(name: str) -> dict:
    """A request Claude Code 2.1.328 sent (claude -p, headless; paths and ids scrubbed)."""
    return json.loads((RECORDED / name).read_text())


def test_claude_codes_first_request_parses_with_its_system_message_in_place_and_no_billing_header():
    rec = recorded("claude-code-2.1.328-first.json")
    assert rec["query"] == "beta=true" and rec["body"]["system"][0]["text"].startswith(BILLING_HEADER)
    req = parse_messages(rec["body"], 32768)
    roles = [m["role"] for m in req.messages]
    assert roles == ["system", "user", "system"]  # the environment stays after the user's turn, where it was sent
    assert BILLING_HEADER not in json.dumps(req.messages)  # (its value changes between sessions)
    assert req.messages[0]["content"].startswith("You are a Claude agent")
    assert req.messages[1]["content"].endswith("say hi")
    assert req.messages[2]["content"].startswith("# Environment")
    assert req.sampling.max_tokens == 32000 and req.stream is True and req.model == "some-name"
    assert [t["function"]["name"] for t in req.tools.tools][:3] == ["Agent", "Bash", "Edit"]
    assert len(req.tools.tools) == 12


def test_the_second_request_renders_the_first_as_its_prefix():
    """Claude Code re-sends the system message as a plain string once cache_control moved off it, and the
    billing header differs between sessions: neither may change the messages the first request rendered."""
    first = parse_messages(recorded("claude-code-2.1.328-first.json")["body"], 32768).messages
    body = recorded("claude-code-2.1.328-tool-result.json")["body"]
    assert isinstance(body["messages"][1]["content"], str)  # (a one-block list in the first request)
    second = parse_messages(body, 32768).messages
    assert second[: len(first)] == first
    assert [m["role"] for m in second[len(first) :]] == ["assistant", "tool"]
    assert second[-2]["tool_calls"][0]["function"]["name"] == "Bash"
    other_session = json.loads(json.dumps(body).replace("cc_version=2.1.328.593", "cc_version=2.1.328.b7f"))
    assert parse_messages(other_session, 32768).messages == second


def test_an_empty_system_message_with_its_own_keys_renders_nothing():
    """Claude Code with its default model: ``{"role": "system", "content": [], "output_config": {...}}``."""
    body = recorded("claude-code-2.1.328-bare-default-model.json")["body"]
    assert body["messages"][1] == {"role": "system", "content": [], "output_config": {"effort": "medium"}}
    assert [m["role"] for m in parse_messages(body, 32768).messages] == ["system", "user"]


@pytest.mark.parametrize(
    "thinking, controls",
    [
        ({"type": "adaptive", "display": "omitted"}, {}),  # (the model's default)
        ({"type": "enabled", "budget_tokens": 1024}, {"think": True, "max_thinking_tokens": 1024}),
        ({"type": "disabled"}, {"think": False}),
    ],
)
def test_thinking_and_effort_become_the_daemons_reasoning_controls(thinking, controls):
    """Claude Code's thinking and effort reach the daemon (a model that does not think ignores them);
    context_management is the client's business and changes nothing."""
    body = {
        **BASE,
        "thinking": thinking,
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": "x"},
    }
    plain = parse_messages(BASE, N_CTX)
    req = parse_messages(body, N_CTX)
    assert req.messages == plain.messages
    assert req.daemon_params() == {**plain.daemon_params(), "reasoning_effort": "high", **controls}
    max_effort = parse_messages({**BASE, "output_config": {"effort": "max"}}, N_CTX)
    assert max_effort.reasoning_effort == "high" and max_effort.think is None
    later = parse_messages({**BASE, "output_config": {"effort": "extreme"}}, N_CTX)  # (a word the API adds later)
    assert later.reasoning_effort is None and later.think is None


def test_a_system_message_between_turns_stays_between_them():
    body = {
        **BASE,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "system", "content": [{"type": "text", "text": "It is Sunday."}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "Hello"},
                ],
            },
            {"role": "user", "content": "Day?"},
        ],
    }
    assert [(m["role"], m["content"]) for m in parse_messages(body, N_CTX).messages] == [
        ("system", "Be brief."),
        ("user", "Hi"),
        ("system", "It is Sunday."),
        ("assistant", "Hello"),
        ("user", "Day?"),
    ]


class _Counting:
    """What ``_prompt_tokens`` uses of the bridge's exchange and daemon client (a daemon of ``version``)."""

    def __init__(self, version: list[int]):
        self.version, self.params = version, None

    def daemon(self):
        outer = self

        class Opened:
            async def __aenter__(self):
                return outer

            async def __aexit__(self, *exc):
                return False

        return Opened()

    async def connect(self):
        return SimpleNamespace(protocol_version=self.version)

    async def count_tokens(self, messages, **params):
        self.params = params
        return 7


@pytest.mark.parametrize("version", [[1, 11], [1, 12]])
def test_a_streamed_messages_prompt_count_on_an_older_daemon_leaves_out_what_it_cannot_count(version, caplog):
    """message_start's count: a 1.11 daemon (a bridge of a newer tandem in front of a daemon still running)
    counts without tool_choice and the reasoning controls, and the log says so; the request is not failed."""
    body = {
        "model": "m",
        "max_tokens": 10,
        "messages": [{"role": "user", "content": "hi"}],
        "thinking": {"type": "enabled", "budget_tokens": 64},
        "tools": [{"name": "get_time", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any"},
    }
    fake = _Counting(version)
    assert asyncio.run(_prompt_tokens(fake, parse_messages(body, 4096))) == 7
    assert fake.params["tools"]
    old = version < [1, 12]
    assert ("think" in fake.params, "tool_choice" in fake.params) == (not old, not old)
    assert ("counted without tool_choice" in caplog.text) == old
