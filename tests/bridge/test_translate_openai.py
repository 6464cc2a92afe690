"""OpenAI's dialect (bridge/openai_bridge.py) without a model or a daemon:
/v1/completions and /v1/chat/completions bodies parsed into the typed request
(and refused with OpenAI's 400s), and the daemon's results rendered as OpenAI's
answers and server-sent events."""

from __future__ import annotations

import pytest

from tandem.bridge.answers import ApiError
from tandem.bridge.openai_bridge import FINGERPRINT, Head, OpenAIAnswer, call_deltas, parse_chat, parse_completions
from tandem.bridge.translate import GenRequest
from tandem.protocol import MAX_TOKENS_LIMIT, FinishReason, ToolCallDelta

USER = [{"role": "user", "content": "Hi"}]
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object"}, "description": None, "strict": None},
}


def refused(parse, body: dict) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body)
    assert info.value.status == 400
    return info.value


# --------------------------------------------------------------------------- /v1/completions


def test_a_completion_takes_openais_defaults():
    req = parse_completions({"model": "x", "prompt": "def add(a, b):"})
    assert req.prompt == "def add(a, b):" and req.messages is None and req.suffix is None
    assert req.daemon_params() == {"max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "stop": []}
    assert (req.stream, req.include_usage) == (False, False)


def test_a_completion_with_a_suffix_is_a_fill_in_the_middle_with_tandems_knobs():
    body = {"prompt": ["a = "], "suffix": "\nprint(a)", "max_tokens": 32, "temperature": 0, "max_lines": 1}
    body.update(stop_at_blank_line=False, draft="off", draft_tokens=4, cache=False, ignore_eos=True, top_k=1, seed=7)
    req = parse_completions(body)
    assert (req.prompt, req.suffix) == ("a = ", "\nprint(a)")  # a list of one prompt is that prompt
    assert req.daemon_params() == {
        "max_tokens": 32,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 1,
        "seed": 7,
        "stop": [],
        "draft": "off",
        "draft_tokens": 4,
        "cache": False,
        "ignore_eos": True,
        "max_lines": 1,
        "stop_at_blank_line": False,
    }
    # without a suffix the fill-in-the-middle knobs are not read
    assert parse_completions({"prompt": "x", "max_lines": "bad"}).max_lines is None


def test_a_completion_streams_with_usage_when_asked():
    req = parse_completions({"prompt": "x", "stream": True, "stream_options": {"include_usage": True}})
    assert (req.stream, req.include_usage) == (True, True)
    req = parse_completions({"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}})
    assert (req.stream, req.include_usage) == (True, False)


@pytest.mark.parametrize(
    "body, message, param",
    [
        ({"prompt": [1, 2]}, "'prompt' must be a string (one prompt; token arrays are not supported)", "prompt"),
        ({"prompt": ["a", "b"]}, "'prompt' must be a string (one prompt; token arrays are not supported)", "prompt"),
        ({"prompt": "x", "echo": True}, "'echo' is not supported by tandem: the prompt is not echoed back", "echo"),
        ({"prompt": "x", "best_of": 2}, "'best_of' is not supported by tandem: one choice is generated", "best_of"),
        ({"prompt": "x", "n": 2}, "'n' must be 1: tandem generates one choice per request", "n"),
        (
            {"prompt": "x", "logprobs": 3},
            "'logprobs' is not supported by tandem: no log-probabilities are returned",
            "logprobs",
        ),
        (
            {"prompt": "x", "presence_penalty": 0.5},
            "'presence_penalty' is not supported by tandem: sampling has no penalties",
            "presence_penalty",
        ),
        ({"prompt": "x", "stop": ["a", 1]}, "'stop' must be a string or an array of strings", "stop"),
        ({"prompt": "x", "max_tokens": "8"}, "'max_tokens' must be integer, got \"8\"", "max_tokens"),
        ({"prompt": "x", "temperature": "hot"}, "'temperature' must be integer/number, got \"hot\"", "temperature"),
        ({"prompt": "x", "suffix": 5}, "'suffix' must be string, got 5", "suffix"),
        ({"prompt": "x", "stream": "yes"}, "'stream' must be boolean, got \"yes\"", "stream"),
        ({"prompt": "x", "cache": "no"}, "'cache' must be boolean, got \"no\"", "cache"),
    ],
)
def test_a_bad_completion_is_a_400_naming_the_field(body, message, param):
    err = refused(parse_completions, body)
    assert (err.message, err.param) == (message, param)


def test_what_costs_nothing_to_accept_is_accepted():
    req = parse_completions({"prompt": "x", "best_of": 1, "logprobs": None, "echo": False, "n": 1, "stop": "\n"})
    assert req.sampling.stop == ["\n"]


# --------------------------------------------------------------------------- /v1/chat/completions


def test_a_chat_reads_to_the_end_and_takes_top_p_zero_as_greedy():
    req = parse_chat({"messages": USER, "top_p": 0, "temperature": 0.9})
    assert req.messages == USER and req.prompt is None
    assert req.daemon_params() == {"max_tokens": MAX_TOKENS_LIMIT, "temperature": 0.0, "top_p": 1.0, "stop": []}
    assert parse_chat({"messages": USER, "max_completion_tokens": 9, "max_tokens": 99}).sampling.max_tokens == 9


def test_chat_messages_become_the_daemons():
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "18 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "12 C"},
    ]
    assert parse_chat({"messages": messages}).messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "c2", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
            ],
        },
        {"role": "tool", "content": "18 C", "tool_call_id": "c1", "name": "get_weather"},
        {"role": "tool", "content": "12 C", "tool_call_id": "c2"},
    ]


def test_tools_tool_choice_and_parallel_calls():
    req = parse_chat({"messages": USER, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False})
    spec = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    params = req.daemon_params()
    assert (params["tools"], params["tool_choice"], params["parallel_tool_calls"]) == ([spec], "required", False)
    assert "tools" not in parse_chat({"messages": USER, "tools": [], "tool_choice": "auto"}).daemon_params()


def test_response_format_keeps_the_fields_the_daemon_reads():
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}, "strict": True}
    assert parse_chat({"messages": USER, "response_format": rf}).response_format == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {}},
    }
    assert parse_chat({"messages": USER}).response_format is None


@pytest.mark.parametrize(
    "body, message, param",
    [
        ({}, "'messages' is required: an array of {role, content}", "messages"),
        ({"messages": "hi"}, "'messages' must be array, got \"hi\"", "messages"),
        ({"messages": ["hi"]}, "messages[0] must be an object with a 'role'", "messages[0]"),
        (
            {"messages": [{"role": "function", "content": "x"}]},
            "messages[0] has role 'function'; tandem takes system, developer, user, assistant and tool "
            "(the legacy 'function' role: send tool calls and tool results instead)",
            "messages[0].role",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content has a part that is not text; tandem's models read text only",
            "messages[0].content",
        ),
        (
            {"messages": [{"role": "user", "content": 5}]},
            "messages[0].content must be a string or an array of text parts",
            "messages[0].content",
        ),
        (
            {"messages": [{"role": "tool", "content": "18 C"}]},
            "messages[0] is a tool result without a 'tool_call_id' (the id of the call it answers)",
            "messages[0].tool_call_id",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
            'messages[0].tool_calls[0] must be {"id", "type": "function", "function": {"name", "arguments"}}',
            "messages[0].tool_calls[0]",
        ),
        (
            {"messages": USER, "functions": [{"name": "f"}]},
            "'functions' is not supported by tandem: the legacy 'functions' are not taken: send them as 'tools'",
            "functions",
        ),
        ({"messages": USER, "tool_choice": "required"}, "'tool_choice' is given but 'tools' is not", "tool_choice"),
        (
            {"messages": USER, "tools": [{"type": "code_interpreter"}]},
            'tools[0] must be {"type": "function", "function": {"name", "description", "parameters"}}',
            "tools[0]",
        ),
        ({"messages": USER, "tools": [{"type": "function"}]}, "tools[0].function must be an object", "tools[0]"),
        (
            {"messages": USER, "tools": [WEATHER], "parallel_tool_calls": "no"},
            "'parallel_tool_calls' must be boolean, got \"no\"",
            "parallel_tool_calls",
        ),
        (
            {"messages": USER, "response_format": "json"},
            "'response_format' must be an object with a 'type': text, json_object, json_schema, regex or grammar",
            "response_format",
        ),
    ],
)
def test_a_bad_chat_is_a_400_naming_the_field(body, message, param):
    err = refused(parse_chat, body)
    assert (err.message, err.param) == (message, param)


# --------------------------------------------------------------------------- rendering


def answer(req: GenRequest) -> OpenAIAnswer:
    return OpenAIAnswer(req, lambda: Head("req1", "qwen", 1700000000))


ENVELOPE = {"created": 1700000000, "model": "qwen", "system_fingerprint": FINGERPRINT}
COMPLETION = {"id": "cmpl-req1", "object": "text_completion", **ENVELOPE}
CHAT = {"id": "chatcmpl-req1", "object": "chat.completion", **ENVELOPE}
CHAT_CHUNK = {**CHAT, "object": "chat.completion.chunk"}


def test_a_whole_completion(done):
    reply = answer(parse_completions({"prompt": "x"})).whole(done("a + b", FinishReason.LENGTH))
    assert reply == {
        **COMPLETION,
        "choices": [{"index": 0, "text": "a + b", "logprobs": None, "finish_reason": "length"}],
        "usage": {
            "prompt_tokens": 12,
            "completion_tokens": 5,
            "total_tokens": 17,
            "prompt_tokens_details": {"cached_tokens": 4},
            "completion_tokens_details": {"reasoning_tokens": 0},
        },
    }
    assert list(reply) == ["id", "object", "created", "model", "system_fingerprint", "choices", "usage"]


@pytest.mark.parametrize(
    "finish, expected",
    [
        (FinishReason.STOP, "stop"),
        (FinishReason.LENGTH, "length"),
        (FinishReason.TOOL_CALLS, "tool_calls"),
        (FinishReason.CANCELLED, "stop"),
    ],
)
def test_finish_reasons(done, finish, expected):
    reply = answer(parse_chat({"messages": USER})).whole(done("x", finish))
    assert reply["choices"][0]["finish_reason"] == expected


def test_a_whole_chat_with_tool_calls_has_null_content_and_the_arguments_as_written(done):
    result = done("", FinishReason.TOOL_CALLS, calls=[("call_1", "get_weather", '{"city":"Paris"}')])
    reply = answer(parse_chat({"messages": USER})).whole(result)
    assert reply["choices"] == [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                    }
                ],
            },
            "logprobs": None,
            "finish_reason": "tool_calls",
        }
    ]
    assert {k: reply[k] for k in CHAT} == CHAT
    plain = answer(parse_chat({"messages": USER})).whole(done("Hello"))
    assert plain["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}


def test_streamed_chat_events(done, chunk):
    a = answer(parse_chat({"messages": USER, "stream": True, "stream_options": {"include_usage": True}}))
    assert a.opening() == [
        {
            **CHAT_CHUNK,
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            ],
        }
    ]
    assert a.chunk(chunk("")) == []  # text held back: nothing to send
    events = a.chunk(chunk("Let me", deltas=[(0, '{"ci', "call_1", "get_weather"), (0, 'ty": 1}', None, None)]))
    assert [e["choices"][0]["delta"] for e in events] == [
        {"content": "Let me"},
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": 1}'},
                }
            ]
        },
    ]
    closing = a.closing(done("Let me", FinishReason.TOOL_CALLS))
    assert closing[0]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}]
    assert closing[1] == {
        **CHAT_CHUNK,
        "choices": [],
        "usage": {
            "prompt_tokens": 12,
            "completion_tokens": 5,
            "total_tokens": 17,
            "prompt_tokens_details": {"cached_tokens": 4},
            "completion_tokens_details": {"reasoning_tokens": 0},
        },
    }
    assert closing[2] == "[DONE]" and len(closing) == 3


def test_streamed_completion_events(done, chunk):
    a = answer(parse_completions({"prompt": "x", "stream": True}))
    assert a.opening() == []
    assert a.chunk(chunk("ab")) == [
        {**COMPLETION, "choices": [{"index": 0, "text": "ab", "logprobs": None, "finish_reason": None}]}
    ]
    assert a.closing(done("ab")) == [
        {**COMPLETION, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}]},
        "[DONE]",
    ]


def test_call_deltas_merge_the_pieces_of_one_call_and_start_each_new_one_with_its_name():
    deltas = [
        ToolCallDelta(index=0, arguments="{", id="call_1", name="a"),
        ToolCallDelta(index=0, arguments="}"),
        ToolCallDelta(index=1, arguments="{}", id="call_2", name="b"),
        ToolCallDelta(index=2, arguments="x"),
    ]
    assert call_deltas(deltas) == [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "a", "arguments": "{}"}},
        {"index": 1, "id": "call_2", "type": "function", "function": {"name": "b", "arguments": "{}"}},
        {"index": 2, "function": {"arguments": "x"}},
    ]


def test_return_progress_streams_llama_servers_prompt_progress(chunk):
    from tandem.protocol import PromptProgress

    progress = PromptProgress(total=17545, cached=4096, processed=8192, seconds=12.3456)
    reading = chunk("")
    reading.progress = progress
    asked = parse_chat({"messages": USER, "stream": True, "return_progress": True})
    assert asked.daemon_params()["progress"] is True
    event = answer(asked).chunk(reading)
    assert event == [
        {
            **CHAT_CHUNK,
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": None}, "logprobs": None, "finish_reason": None}
            ],
            "prompt_progress": {"total": 17545, "cache": 4096, "processed": 8192, "time_ms": 12346},
        }
    ]
    completion = answer(parse_completions({"prompt": "x", "stream": True, "return_progress": True})).chunk(reading)
    assert completion[0]["choices"][0]["text"] == "" and completion[0]["prompt_progress"]["processed"] == 8192
    # not streamed, or not asked: the daemon is not asked for it
    assert "progress" not in parse_chat({"messages": USER, "return_progress": True}).daemon_params()
    assert "progress" not in parse_chat({"messages": USER, "stream": True}).daemon_params()
