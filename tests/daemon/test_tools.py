"""Tool calls without a model: the template's syntax, the history the template sees,
the request checks, and the streaming parser (fed every possible split)."""

from __future__ import annotations

import json

import pytest

from tandem.daemon.constraints.tools import (
    GENERIC,
    HERMES,
    LLAMA3,
    CallOpener,
    HermesParser,
    Llama3Parser,
    ToolPlan,
    closed,
    detect_format,
    message_dicts,
    with_generic_prompt,
)
from tandem.daemon.drafting.interfaces import RequestError
from tandem.protocol import ChatMessage, FunctionCall, FunctionSpec, Generate, Tool, ToolCall

WEATHER = Tool(
    FunctionSpec(
        "get_weather",
        "The weather in a city",
        {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    )
)
TIME = Tool(FunctionSpec("get_time"))


def test_the_templates_syntax_is_detected():
    qwen = "{%- if tools %}{{ tool | tojson }} <tool_call>\\n{...}</tool_call>{%- endif %}"
    llama = '{%- if tools %}{{- \'{"name": function name, "parameters": dictionary}\' }}<|python_tag|>{% endif %}'
    assert detect_format(qwen) == HERMES
    assert detect_format(llama) == LLAMA3
    assert detect_format("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}") == GENERIC
    assert detect_format(None) == GENERIC


def feed_all(parser, text: str, cuts: list[int], cut_off: bool = False):
    content, deltas, last = "", [], 0
    for cut in [*cuts, len(text)]:
        c, d = parser.feed(text[last:cut])
        content, deltas, last = content + c, deltas + d, cut
    c, d = parser.finish(cut_off)
    return content + c, deltas + d


CALLS = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\\"is {x}"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n'
)


@pytest.mark.parametrize("cut", range(len(CALLS) + 1))
def test_hermes_calls_parse_the_same_however_the_text_is_split(cut):
    content, deltas = feed_all(HermesParser(), CALLS, [cut])
    assert content == "Let me look.\n"
    parser_calls = _calls(deltas)
    assert parser_calls == [("get_weather", '{"city": "Par\\"is {x}"}'), ("get_time", "{}")]
    assert [json.loads(a) for _, a in parser_calls] == [{"city": 'Par"is {x}'}, {}]


def test_hermes_parser_streams_a_call_whole_once_it_closes():
    """Nothing of a call is streamed before it closes: a client that adds up streamed
    pieces (the OpenAI and Anthropic SDKs do) never holds a call that was then cut off."""
    parser = HermesParser()
    assert parser.feed("<tool_call>\n") == ("", [])
    assert parser.feed('{"name": "get_weather", "arguments": {"ci') == ("", [])
    assert parser.feed('ty": "Oslo"}}\n') == ("", [])
    _, deltas = parser.feed("</tool_call>")
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(0, "get_weather", '{"city": "Oslo"}')]
    assert deltas[0].id.startswith("call_")
    assert parser.calls[0].function == FunctionCall("get_weather", '{"city": "Oslo"}')
    assert parser.calls[0].id == _first_id(parser) == deltas[0].id


def _first_id(parser):
    return parser.calls[0].id


def _calls(deltas):
    calls: dict[int, list] = {}
    for d in deltas:
        if d.id is not None:
            calls[d.index] = [d.name, ""]
        calls[d.index][1] += d.arguments
    return [tuple(calls[i]) for i in sorted(calls)]


def test_a_call_cut_off_by_max_tokens_is_not_a_call():
    parser = HermesParser()
    content, deltas = feed_all(parser, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os', [], True)
    assert content == "" and parser.calls == [] and deltas == []  # nothing of it streamed either


@pytest.mark.parametrize("cut", ['{"city": "Oslo"}', '{"city": "Oslo"}}', '{"city": "Oslo"}}\n</tool_'])
def test_a_call_cut_off_before_its_closing_tag_is_not_a_call(cut):
    """Arguments that parse are not enough: the call ended (max_tokens, a stop string)
    before the model closed it, so it is not reported, after a complete one that is."""
    parser = HermesParser({"get_weather"})
    whole = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
    content, deltas = feed_all(
        parser, whole + '<tool_call>\n{"name": "get_weather", "arguments": ' + cut, [7, 30], True
    )
    assert content == ""
    assert [c.function.arguments for c in parser.calls] == ['{"city": "Rome"}']
    assert _calls(deltas) == [("get_weather", '{"city": "Rome"}')]


def test_a_call_whose_output_ended_by_itself_before_the_closing_tag_is_a_call():
    """The model ended its answer (end of generation, not max_tokens or a stop string) after
    whole arguments, without writing the closing tag: that call is complete and reported."""
    parser = HermesParser({"get_weather"})
    content, deltas = feed_all(parser, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}', [9])
    assert content == "" and _calls(deltas) == [("get_weather", '{"city": "Oslo"}')]
    parser = HermesParser()  # another key order: parsed whole at the end
    content, deltas = feed_all(parser, '<tool_call>\n{"arguments": {"city": "Oslo"}, "name": "get_weather"}', [])
    assert content == "" and _calls(deltas) == [("get_weather", '{"city": "Oslo"}')]


def test_a_repeated_call_is_not_reported_again_and_says_so():
    """The engine ends the turn when ``repeated`` is set (a small model can write the same
    call until max_tokens); the repeat itself is neither reported nor streamed."""
    parser = HermesParser({"read_file"})
    call = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n'
    other = '<tool_call>\n{"name": "read_file", "arguments": {"path": "b.py"}}\n</tool_call>\n'
    _, deltas = feed_all(parser, call + other, [5])
    assert not parser.repeated and len(parser.calls) == 2
    _, more = feed_all(
        parser, call + '<tool_call>\n{"name": "read_file", "arguments": {"path": "c.py"}}\n</tool_call>', [3]
    )
    assert parser.repeated and len(parser.calls) == 2 and more == []  # nor a new call after the repeat


# Qwen2.5-Coder-0.5B under Claude Code's prompt (2026-12-07): a bare object, not compact JSON (so not constrained),
# whose arguments are a string. It is no call; it was dropped, the answer came back empty, and Claude Code re-asked
BARE_STRING_ARGS = '{\n    "name": "Bash",\n    "arguments": "cd /tmp/repo && git status"\n}'
NOT_CALLS = [
    BARE_STRING_ARGS,
    "```json\n" + BARE_STRING_ARGS + "\n```",
    '<tool_call>\n{"name": "Bash", "arguments": "ls"}\n</tool_call>',
    '<tool_call>\n{"name": "no_such_tool", "arguments": {"a": 1}}\n</tool_call>',
    '<tool_call>\n{"arguments": {"a": 1}, "name": "no_such_tool"}\n</tool_call>',
    '<tool_call>\n{"name": "Bash", "arguments": "ls"}',  # ended by itself, without the closing tag
    "<tool_call>\nls -la",
    BARE_STRING_ARGS + "\n\nThat runs git status.",
    'Sure.\n```json\n<tool_call>\n{"name": "Bash", "arguments": "ls"}\n</tool_call>\n```',
]


@pytest.mark.parametrize("text", NOT_CALLS)
@pytest.mark.parametrize("cut", [0, 1, 7, 15, 30, 45])
def test_what_is_not_a_call_is_the_answers_text_as_written(text, cut):
    """A call the model closed (or ended its answer in) that names no tool or whose arguments
    are not an object is given back as text, as llama-server does, never dropped: an empty
    answer makes an agent re-ask (Claude Code: 'Your previous response had no visible output')."""
    parser = HermesParser({"Bash"})
    content, deltas = feed_all(parser, text, [min(cut, len(text))])
    assert content == text and deltas == [] and parser.calls == []


def test_a_bare_object_that_is_not_a_call_is_streamed_as_text_once_it_closes_and_kept_if_then_cut_off():
    parser = HermesParser({"Bash"})
    assert parser.feed(BARE_STRING_ARGS[:20]) == ("", [])
    assert parser.feed(BARE_STRING_ARGS[20:] + "\n") == (BARE_STRING_ARGS, [])  # at its close, not the answer's end
    content, deltas = feed_all(parser, "\nand more", [], cut_off=True)  # (max_tokens after it)
    assert content == "\n\nand more" and deltas == [] and parser.calls == []  # (the newline held till then)


def test_a_call_that_is_not_one_between_two_calls_is_text_and_both_calls_are_reported():
    call = '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call>\n'
    bad = '<tool_call>\n{"name": "Bash", "arguments": "pwd"}\n</tool_call>\n'
    other = call.replace("ls", "pwd")
    for cut in range(0, len(call + bad + other), 9):
        parser = HermesParser({"Bash"})
        content, deltas = feed_all(parser, call + bad + other, [cut])
        assert content == bad.rstrip("\n"), (cut, content)  # (whitespace between calls is not text)
        assert _calls(deltas) == [("Bash", '{"command": "ls"}'), ("Bash", '{"command": "pwd"}')]


def test_text_without_calls_passes_through_even_if_it_looks_like_a_tag():
    content, deltas = feed_all(HermesParser(), "a <tool no> b <tool_c", [3, 9])
    assert content == "a <tool no> b <tool_c" and deltas == []


def test_an_unconstrained_call_in_another_key_order_is_still_parsed():
    parser = HermesParser()
    content, _ = feed_all(
        parser, '<tool_call>\n{"arguments": {"city": "Rome"}, "name": "get_weather"}\n</tool_call>', []
    )
    assert content == ""
    assert parser.calls[0].function == FunctionCall("get_weather", '{"city": "Rome"}')


def test_llama3_answers_are_text_or_one_call():
    parser = Llama3Parser({"get_weather"})
    content, deltas = feed_all(parser, ' {"name": "get_weather", "parameters": {"city": "Oslo"}}', [5])
    assert content == "" and parser.calls[0].function == FunctionCall("get_weather", '{"city": "Oslo"}')
    parser = Llama3Parser({"get_weather"})
    content, _ = feed_all(parser, "It is sunny.", [2])
    assert content == "It is sunny." and parser.calls == []
    parser = Llama3Parser({"get_weather"})
    content, _ = feed_all(parser, '{"not": "a call"}', [])
    assert content == '{"not": "a call"}' and parser.calls == []


HISTORY = [
    ChatMessage("user", "Weather in Oslo?"),
    ChatMessage("assistant", "", tool_calls=[ToolCall("call_1", FunctionCall("get_weather", '{"city": "Oslo"}'))]),
    ChatMessage("tool", "sunny", tool_call_id="call_1", name="get_weather"),
]


def test_the_history_is_shown_to_a_tool_template_with_argument_objects():
    out = message_dicts(HISTORY, HERMES)
    assert out[1]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    ]
    assert out[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "name": "get_weather"}


def test_a_template_without_tools_sees_calls_and_results_as_text():
    out = with_generic_prompt(message_dicts(HISTORY, GENERIC), [WEATHER])
    assert out[0]["role"] == "system" and '"get_weather"' in out[0]["content"] and "<tool_call>" in out[0]["content"]
    assert out[2] == {
        "role": "assistant",
        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    }
    assert out[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}


def test_arguments_that_are_not_json_are_a_typed_error_naming_the_field():
    bad = [ChatMessage("assistant", "", tool_calls=[ToolCall("c", FunctionCall("get_weather", "{city: Oslo"))])]
    with pytest.raises(RequestError, match=r"messages\[0\]\.tool_calls\[0\]\.function\.arguments is not JSON"):
        message_dicts(bad, HERMES)


def _generate(**kw):
    return Generate(id="r", messages=[ChatMessage("user", "hi")], **kw)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "not in 'tools'"),
        (dict(tools=[WEATHER], tool_choice="always"), "must be one of none, auto, required"),
        (dict(tool_choice="required"), "'tools' is missing"),
        (dict(tools=[], tool_choice="required"), "'tools' is missing"),
        (dict(tools=[Tool(FunctionSpec("bad name"))]), "letters, digits"),
        (dict(tools=[WEATHER, WEATHER]), "given twice"),
        (dict(tools=[Tool(FunctionSpec("f", parameters={"type": "array"}))]), "Schema of an object"),
        (dict(tools=[Tool(FunctionSpec("f"), type="retrieval")]), "must be 'function'"),
    ],
)
def test_bad_tools_are_refused_naming_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        _generate(**kw).check()


def test_tools_need_messages():
    with pytest.raises(ValueError, match="needs 'messages'"):
        Generate(id="r", prompt="hi", tools=[WEATHER]).check()


def test_the_grammar_constrains_names_and_arguments_per_tool():
    plan = ToolPlan(HERMES, [WEATHER, TIME], "required", parallel=False, open_token=7, close_token=8)
    grammar = plan.grammars()["start"]
    assert grammar.startswith("start: call\n") and "<[7]>" in grammar and "<[8]>" in grammar
    schema = json.loads(grammar.split("%json ", 1)[1])
    names = [o["properties"]["name"]["const"] for o in schema["anyOf"]]
    assert names == ["get_weather", "get_time"]
    no_arguments = {"type": "object", "properties": {}, "additionalProperties": False}
    assert schema["anyOf"][1]["properties"]["arguments"] == no_arguments
    named = ToolPlan(HERMES, [WEATHER, TIME], "get_time", parallel=True).grammars()["start"]
    assert '"get_weather"' not in named and '("\\n" call)*' in named and '"<tool_call>"' in named
    auto = ToolPlan(HERMES, [WEATHER], "auto", parallel=True, open_token=7, close_token=8).grammars()
    assert set(auto) == {"tagged", "bare"} and auto["bare"].startswith("start: body\n")
    assert "TEXT" in ToolPlan(GENERIC, [WEATHER], "auto", parallel=True).grammars()["start"]
    assert ToolPlan(LLAMA3, [WEATHER], "required", parallel=True).grammars()["start"].startswith("start: body\n")


def test_an_untagged_call_at_the_start_is_a_call():
    parser = HermesParser()
    content, deltas = feed_all(parser, ' {"name": "get_weather", "arguments": {"city": "Oslo"}}', [3, 20])
    assert content == "" and parser.calls[0].function == FunctionCall("get_weather", '{"city": "Oslo"}')
    parser = HermesParser()
    content, _ = feed_all(parser, '{"answer": 42}', [4])
    assert content == '{"answer": 42}' and parser.calls == []


FENCED = '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'


@pytest.mark.parametrize("cut", range(len(FENCED) + 1))
def test_a_call_in_a_code_fence_at_the_start_is_a_call_and_the_fence_is_not_text(cut):
    """What Qwen2.5-Coder writes under Claude Code's 12k-token system prompt (the grammar
    takes over after the fence, so the model never gets to close it)."""
    for parser in (HermesParser({"get_weather"}), Llama3Parser({"get_weather"})):
        content, deltas = feed_all(parser, FENCED, [cut])
        assert content == "" and _calls(deltas) == [("get_weather", '{"city": "Oslo"}')], type(parser)


@pytest.mark.parametrize(
    "text",
    [
        "```python\nprint(1)\n```",
        "```json\n[1, 2]\n```",
        "``",
        "```json",
        "Use ```json\n{}```",
        '```json\n{"a": 1}\n```',  # JSON, not a call (where the output was not constrained): given back whole
    ],
)
def test_a_code_fence_that_holds_no_call_is_text(text):
    for parser in (HermesParser({"get_weather"}), Llama3Parser({"get_weather"})):
        for cut in range(len(text) + 1):
            content, deltas = feed_all(parser.__class__({"get_weather"}), text, [cut])
            assert content == text and deltas == [], (type(parser), cut)


AFTER_TEXT = (
    'Here\'s the JSON output:\n\n```json\n{\n  "name": "get_weather",\n  "arguments": {"city": "Oslo"}\n}\n```\nDone.'
)


@pytest.mark.parametrize("cut", range(len(AFTER_TEXT) + 1))
def test_a_call_in_a_code_fence_after_text_is_a_call_as_llama_server_reads_it(cut):
    """What Qwen2.5-Coder-0.5B writes under Qwen Code's 17k-token prompt: not constrained
    (it opened no call where one can be), parsed whole once the fence closes."""
    content, deltas = feed_all(HermesParser({"get_weather"}), AFTER_TEXT, [cut])
    assert content == "Here's the JSON output:\n\n\nDone."
    assert _calls(deltas) == [("get_weather", '{"city": "Oslo"}')]
    text = AFTER_TEXT.replace("get_weather", "get_time")  # no such tool: the block is text
    assert feed_all(HermesParser({"get_weather"}), text, [cut]) == (text, [])
    unclosed = AFTER_TEXT[: AFTER_TEXT.index("```\nDone")]  # the output ended inside the fence
    assert _calls(feed_all(HermesParser({"get_weather"}), unclosed, [min(cut, len(unclosed))])[1])
    content, deltas = feed_all(HermesParser({"get_weather"}), unclosed, [min(cut, len(unclosed))], cut_off=True)
    assert deltas == [] and content == unclosed  # cut off by max_tokens: text, not a call


@pytest.mark.parametrize("cut", range(60))
def test_a_tagged_call_in_a_fence_after_text_is_a_call(cut):
    text = 'Sure.\n```json\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, deltas = feed_all(HermesParser({"get_weather"}), text, [cut])
    assert content == "Sure.\n" and _calls(deltas) == [("get_weather", '{"city": "Oslo"}')]


def test_a_closed_fence_after_a_call_at_the_start_is_not_text():
    text = '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```'
    for parser in (HermesParser({"get_weather"}), Llama3Parser({"get_weather"})):
        for cut in range(len(text) + 1):
            content, deltas = feed_all(parser.__class__({"get_weather"}), text, [cut])
            assert content == "" and len(deltas) == 1, (type(parser), cut, content)


class Grammar:
    """What CallOpener uses of a compiled constraint."""

    def __init__(self, first: bytes):
        self.first = first  # what the grammar's first token must start with
        self.consumed: list[int] = []

    def valid_prefix(self, tokens) -> bool:
        return PIECES[tokens[0]].startswith(self.first)

    def consume(self, token) -> bool:
        self.consumed.append(token)
        return True


PIECES = {1: b"```", 2: b"json", 3: b"\n", 4: b'{"', 5: b"{\n", 6: b"Hello", 7: b"<tool_call>", 8: b"python", 9: b" "}


@pytest.mark.parametrize(
    "tokens, opens_at, consumed",
    [
        ([4], 0, [4]),  # a compact object first: the bare call, from its first token
        ([1, 2, 3], 2, []),  # ```json and a newline: the call starts at the next token
        ([9, 1, 2, 3], 3, []),  # ```json and a newline after a space
        ([1, 3, 4], None, None),  # a fence that does not say json: text (a code block)
        ([5], None, None),  # '{\n' first: not the compact start of a call, nor a fence
        ([1, 8, 3], None, None),  # ```python: text
        ([6, 1, 2, 3], None, None),  # a fence after text: text
        ([6, 7], 1, [7]),  # the tag opens a call anywhere
    ],
)
def test_the_opener_starts_the_call_at_its_token_or_after_a_fence(tokens, opens_at, consumed):
    bare, tagged = Grammar(b'{"'), Grammar(b"<tool_call>")
    plan = ToolPlan(HERMES, [WEATHER], "auto", parallel=False, open_token=7, close_token=8)
    opener = CallOpener(plan, {"bare": bare, "tagged": tagged}, PIECES.__getitem__)
    opened = [opener.opens(t, first=i == 0) for i, t in enumerate(tokens)]
    at = next((i for i, c in enumerate(opened) if c is not None), None)
    assert at == opens_at
    if at is not None:
        assert opened[at].consumed == consumed


def test_tool_arguments_are_closed_to_keys_the_schema_does_not_declare():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}}, "c": {"type": "string"}},
        "$defs": {"d": {"type": "object", "properties": {}}},
        "items": {"properties": {"e": {}}},
    }
    out = closed(schema)
    assert out["additionalProperties"] is False and out["properties"]["a"]["additionalProperties"] is False
    assert out["$defs"]["d"]["additionalProperties"] is False and out["items"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["c"]
    opened = {"type": "object", "properties": {}, "additionalProperties": {"type": "integer"}}
    assert closed(opened) == opened  # what the schema says stays
    assert "additionalProperties" not in schema  # the request's own schema is not changed


def test_odd_unconstrained_output_never_raises_and_is_not_claimed_as_a_call():
    cases = [
        '<tool_call>\n{"name": "get\\_weather", "arguments": {"city": "x"}}\n</tool_call>',  # not a JSON string
        '<tool_call>\n{"name": "nope", "arguments": {"city": "x"}}\n</tool_call>',  # no such tool
        '<tool_call>\n{"name": "get_weather", "arguments": 5}\n</tool_call>',  # not an object
        "<tool_call>\n" + "[" * 3000 + "\n</tool_call>",  # deeper than json can read
        '<tool_call>\n{"arguments": {"a": "\\ud800"}, "name": "get_weather"}\n</tool_call>',  # a lone surrogate
    ]
    for text in cases:
        parser = HermesParser({"get_weather"})
        feed_all(parser, text, [len(text) // 2])
        for call in parser.calls:
            call.function.arguments.encode("utf-8")  # msgpack can send it
    assert HermesParser({"get_weather"}).calls == []
    parser = Llama3Parser({"get_weather"})
    feed_all(parser, "{" * 3000, [])
    assert parser.calls == []


def test_leading_whitespace_is_split_the_same_way_however_it_arrives():
    text = '  \n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    for cut in range(len(text) + 1):
        content, _ = feed_all(HermesParser({"get_weather"}), text, [cut])
        assert content == "", cut
    assert feed_all(HermesParser(), "  \nHello", [2])[0] == "  \nHello"
    assert feed_all(HermesParser(), "  ", [1])[0] == "  "


def test_combinators_are_not_closed():
    schema = {"type": "object", "allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert closed(schema) == schema


def _deep(n: int):
    value: object = 0
    for _ in range(n):
        value = [value]
    return value


@pytest.mark.parametrize(
    "body",
    [
        {"id": "r", "messages": [{"role": "user", "content": "x"}], "tool_choice": [[[]]], "tools": []},
        {"id": "r", "messages": [{"role": "user", "content": "x"}], "tool_choice": 7},
        {
            "id": "r",
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"function": {"name": "f", "parameters": {"type": ["object"]}}}],
        },
        {
            "id": "r",
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"function": {"name": "f", "parameters": {"type": "object", "x": _deep(200)}}}],
        },
        {"id": "r", "messages": [{"role": "user", "content": "x"}], "tool_choice": {"function": _deep(900)}},
    ],
)
def test_malformed_tool_fields_are_invalid_request_never_a_crash(body):
    from tandem.protocol import ErrorCode, ProtocolError, decode, packb

    with pytest.raises(ProtocolError) as err:
        decode([b"generate", packb(body)])
    assert err.value.code == ErrorCode.INVALID_REQUEST
