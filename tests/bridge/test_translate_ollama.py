"""Ollama's dialect (bridge/ollama_api.py) without a model or a daemon:
/api/generate and /api/chat bodies parsed into the typed request (Ollama's
defaults, options, format, tool calls without ids) and refused with Ollama's
400s, and the daemon's results rendered as Ollama's answers and NDJSON lines."""

from __future__ import annotations

import pytest

from tandem.bridge.answers import ApiError
from tandem.bridge.ollama_api import OllamaAnswer, check_model, done_fields, loaded, parse_chat, parse_generate
from tandem.protocol import MAX_TOKENS_LIMIT, FinishReason

N_CTX = 4096
USER = [{"role": "user", "content": "Hi"}]
OLLAMA_DEFAULTS = {"max_tokens": MAX_TOKENS_LIMIT, "temperature": 0.8, "top_p": 0.9, "top_k": 40, "stop": []}


def refused(parse, body: dict) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body, N_CTX)
    assert info.value.status == 400
    return info.value


# --------------------------------------------------------------------------- /api/generate


def test_a_prompt_goes_through_the_chat_template_with_ollamas_defaults_and_streams():
    req = parse_generate({"model": "qwen", "prompt": "Why?", "system": "Be brief."}, N_CTX)
    assert req.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]
    assert req.prompt is None and req.model == "qwen" and req.stream is True
    assert req.daemon_params() == OLLAMA_DEFAULTS


def test_raw_is_a_plain_prompt_and_a_suffix_a_fill_in_the_middle():
    req = parse_generate({"model": "m", "prompt": "def f", "raw": True, "system": "ignored", "stream": False}, N_CTX)
    assert (req.prompt, req.messages, req.suffix, req.stream) == ("def f", None, None, False)
    req = parse_generate({"model": "m", "prompt": "a = ", "suffix": "\nprint(a)"}, N_CTX)
    assert (req.prompt, req.suffix, req.messages) == ("a = ", "\nprint(a)", None)


def test_an_empty_prompt_only_loads_the_model():
    assert parse_generate({"model": "m", "prompt": ""}, N_CTX) is None
    assert parse_generate({"model": "m"}, N_CTX) is None
    assert loaded("m", now=lambda: "2025-01-01T00:00:00Z") == {
        "model": "m",
        "created_at": "2025-01-01T00:00:00Z",
        "response": "",
        "done": True,
        "done_reason": "load",
    }


def test_options_become_the_daemons_sampling():
    options = {"num_predict": 5, "temperature": 0, "top_k": -1, "seed": 3, "stop": "\n", "repeat_penalty": 1.1}
    req = parse_generate({"model": "m", "prompt": "x", "options": options}, N_CTX)
    assert req.daemon_params() == {
        "max_tokens": 5,
        "temperature": 0.0,
        "top_p": 0.9,
        "top_k": 0,
        "seed": 3,
        "stop": ["\n"],
    }
    req = parse_generate({"model": "m", "prompt": "x", "options": {"num_predict": 0, "top_p": 0}}, N_CTX)
    assert (req.sampling.max_tokens, req.sampling.top_p, req.sampling.temperature) == (1, 1.0, 0.0)
    # an explicit null is no value: the daemon's default, not Ollama's
    req = parse_generate({"model": "m", "prompt": "x", "options": {"temperature": None, "num_ctx": N_CTX}}, N_CTX)
    assert req.sampling.temperature is None and "temperature" not in req.daemon_params()


def test_format_constrains_the_output():
    req = parse_generate({"model": "m", "prompt": "x", "format": "json"}, N_CTX)
    assert req.response_format == {"type": "json_object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    req = parse_chat({"model": "m", "messages": USER, "format": schema}, N_CTX)
    assert req.response_format == {"type": "json_schema", "json_schema": {"name": "format", "schema": schema}}
    assert parse_chat({"model": "m", "messages": USER, "format": ""}, N_CTX).response_format is None


@pytest.mark.parametrize(
    "body, message",
    [
        ({"prompt": "x", "images": ["aGk="]}, "'images': tandem's models read text only; images are not supported"),
        (
            {"prompt": "x", "template": "{{ .Prompt }}"},
            "'template' is not supported: the model's own chat template is used",
        ),
        ({"prompt": "x", "context": [1, 2]}, "'context' (deprecated) is not supported: send the whole history"),
        ({"prompt": 5}, "'prompt' must be a string"),
        ({"prompt": "x", "options": 5}, "'options' must be an object"),
        ({"prompt": "x", "options": []}, "'options' must be an object"),  # (not "no options": as Ollama's)
        ({"prompt": "x", "options": {"num_ctx": 0}}, "options.num_ctx must be a positive integer, got 0"),
        (
            {"prompt": "x", "options": {"num_ctx": 100000}},
            "options.num_ctx 100000 is more than the daemon's context of 4096 tokens; tandem never cuts a prompt "
            "silently: restart the daemon with --ctx-size 100000 (or send num_ctx <= 4096)",
        ),
        ({"prompt": "x", "options": {"temperature": "hot"}}, 'options.temperature must be a number, got "hot"'),
        ({"prompt": "x", "options": {"top_k": 1.5}}, "options.top_k must be a number, got 1.5"),
        ({"prompt": "x", "options": {"num_predict": "5"}}, "options.num_predict must be an integer, got '5'"),
        ({"prompt": "x", "options": {"stop": [1]}}, "options.stop must be an array of strings"),
        ({"prompt": "x", "format": "xml"}, "'format' must be \"json\" or a JSON schema object"),
        ({"prompt": "x", "suffix": 5}, "'suffix' must be a string"),
        ({"prompt": "x", "suffix": "y", "format": "json"}, "'format' cannot constrain a fill in the middle ('suffix')"),
        ({"prompt": "x", "stream": "yes"}, "'stream' must be a boolean"),
    ],
)
def test_a_bad_generate_is_a_400_saying_why(body, message):
    err = refused(parse_generate, {"model": "m", **body})
    assert err.message == message and err.body("ollama") == {"error": message}


def test_only_the_served_model_is_served():
    check_model("qwen", "qwen")
    check_model("qwen:latest", "qwen")
    check_model("tandem", "qwen")
    with pytest.raises(ApiError) as info:
        check_model("nosuch-model", "qwen")
    assert (info.value.status, info.value.message) == (404, "model 'nosuch-model' not found; this daemon serves 'qwen'")
    with pytest.raises(ApiError) as info:
        check_model(None, "qwen")
    assert (info.value.status, info.value.message) == (400, "'model' is required (the name /api/tags lists)")


# --------------------------------------------------------------------------- /api/chat


def test_tool_calls_get_ids_and_tool_results_answer_the_call_of_their_tool():
    messages = [
        {"role": "user", "content": "Weather in Paris and time in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"function": {"name": "get_time", "arguments": '{"city": "Oslo"}'}},
            ],
        },
        {"role": "tool", "tool_name": "get_time", "content": "12:00"},
        {"role": "tool", "content": "18 C"},  # no name: the first call still unanswered
        {"role": "user", "content": None},
    ]
    assert parse_chat({"model": "m", "messages": messages}, N_CTX).messages == [
        {"role": "user", "content": "Weather in Paris and time in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "call_2", "function": {"name": "get_time", "arguments": '{"city": "Oslo"}'}},
            ],
        },
        {"role": "tool", "content": "12:00", "tool_call_id": "call_2", "name": "get_time"},
        {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
        {"role": "user", "content": ""},
    ]


def test_a_chat_with_tools_and_options():
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "description": None, "parameters": {"type": "object"}},
    }
    req = parse_chat(
        {"model": "m", "messages": USER, "tools": [tool], "options": {"num_predict": -2}, "stream": False}, N_CTX
    )
    assert req.daemon_params() == {
        **OLLAMA_DEFAULTS,
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    }
    assert req.stream is False and req.tools.choice is None and req.tools.parallel is None


@pytest.mark.parametrize(
    "body, message",
    [
        ({}, "'messages' is required: an array of {role, content}"),
        (
            {"messages": [{"role": "robot", "content": "x"}]},
            "messages[0] must have a role: system, user, assistant or tool",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
            "messages[0].images: tandem's models read text only; images are not supported",
        ),
        ({"messages": [{"role": "user", "content": ["x"]}]}, "messages[0].content must be a string"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}]},
            "messages[0].tool_calls[0] needs function.name",
        ),
        ({"messages": USER, "tools": {"a": 1}}, "'tools' must be an array"),
        (
            {"messages": USER, "tools": [{"type": "function"}]},
            'tools[0] must be {"type": "function", "function": {"name"...}}',
        ),
        ({"messages": USER, "stream": 1}, "'stream' must be a boolean"),
    ],
)
def test_a_bad_chat_is_a_400_saying_why(body, message):
    assert refused(parse_chat, {"model": "m", **body}).message == message


# --------------------------------------------------------------------------- rendering

NOW = "2025-01-01T00:00:00Z"
DONE_FIELDS = {
    "done": True,
    "done_reason": "stop",
    "total_duration": 1_500_000_000,
    "load_duration": 0,
    "prompt_eval_count": 12,
    "prompt_eval_duration": 125_000_000,
    "eval_count": 5,
    "eval_duration": 500_000_000,
}


def test_done_fields_in_nanoseconds_and_ollamas_done_reasons(done):
    assert done_fields(done("x"), 1.5) == DONE_FIELDS
    assert done_fields(done("x", FinishReason.LENGTH), 1.5)["done_reason"] == "length"
    assert done_fields(done("", FinishReason.TOOL_CALLS), 1.5)["done_reason"] == "stop"  # as Ollama says it


def test_a_whole_generate_answer(done):
    req = parse_generate({"model": "qwen", "prompt": "x", "stream": False}, N_CTX)
    reply = OllamaAnswer(req, chat=False, now=lambda: NOW).whole(done("Because."), 1.5)
    assert reply == {"model": "qwen", "created_at": NOW, "response": "Because.", **DONE_FIELDS}
    assert list(reply)[:4] == ["model", "created_at", "response", "done"]


def test_a_whole_chat_answer_with_tool_calls_as_objects(done):
    req = parse_chat({"model": "qwen", "messages": USER, "stream": False}, N_CTX)
    calls = [("call_1", "get_weather", '{"city": "Paris"}'), ("call_2", "get_time", "not json")]
    reply = OllamaAnswer(req, chat=True, now=lambda: NOW).whole(done("", FinishReason.TOOL_CALLS, calls=calls), 1.5)
    assert reply["message"] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"function": {"name": "get_time", "arguments": {}}},
        ],
    }
    assert reply["done"] is True and reply["done_reason"] == "stop"


def test_streamed_lines(done, chunk):
    req = parse_chat({"model": "qwen", "messages": USER}, N_CTX)
    a = OllamaAnswer(req, chat=True, now=lambda: NOW)
    assert a.chunk(chunk("")) == []
    assert a.chunk(chunk("Hel")) == [
        {"model": "qwen", "created_at": NOW, "message": {"role": "assistant", "content": "Hel"}, "done": False}
    ]
    assert a.closing(done("Hello"), 1.5) == [
        {"model": "qwen", "created_at": NOW, "message": {"role": "assistant", "content": ""}, **DONE_FIELDS}
    ]
    # streamed, the calls come in a line of their own before the done line
    lines = a.closing(done("", FinishReason.TOOL_CALLS, calls=[("call_1", "f", "{}")]), 1.5)
    assert lines[0] == {
        "model": "qwen",
        "created_at": NOW,
        "message": {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
        "done": False,
    }
    assert lines[1]["done"] is True and "tool_calls" not in lines[1]["message"] and len(lines) == 2
    g = OllamaAnswer(parse_generate({"model": "qwen", "prompt": "x"}, N_CTX), chat=False, now=lambda: NOW)
    assert g.chunk(chunk("ab")) == [{"model": "qwen", "created_at": NOW, "response": "ab", "done": False}]
