"""Tool calls through the real daemon: Qwen2.5-Coder-0.5B (its template's <tool_call>
syntax) and SmolLM2 (a template without tools: tandem's generic prompt). Every call
validates against its tool's schema (jsonschema), streamed pieces add up to the
calls in ``done``, a history that sends the calls back hits the prefix cache, and
bad tools are typed errors before any decoding."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tandem.client import InvalidRequest, RequestFailed, assistant_message
from tandem.protocol import ErrorCode, FinishReason

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER_SCHEMA},
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the project",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "maxLength": 80}},
                "required": ["path"],
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


def check_calls(done, names=None):
    assert done.finish_reason == FinishReason.TOOL_CALLS, (done.text, done.finish_reason)
    assert done.tool_calls
    for call in done.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_auto_the_model_calls_a_tool_and_the_call_is_constrained(coder_daemon):
    with coder_daemon.client() as c:
        done = c.complete(messages=ASK, tools=TOOLS, temperature=0.0, max_tokens=120)
        check_calls(done, {"get_weather"})
        assert "paris" in json.loads(done.tool_calls[0].function.arguments)["city"].lower()
        assert done.text == ""  # the call is not text
        assert done.draft is not None and done.draft.forced > 0  # '\n{"name": "' and the like were jumped over


def test_auto_a_question_that_needs_no_tool_is_answered_in_text(coder_daemon):
    with coder_daemon.client() as c:
        done = c.complete(
            messages=[{"role": "user", "content": "Write a haiku about rain."}],
            tools=TOOLS,
            temperature=0.0,
            max_tokens=60,
        )
        assert done.finish_reason == FinishReason.STOP and done.tool_calls == [] and done.text.strip()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "read_file"}}])
def test_required_and_named_calls_are_constrained_from_the_first_token(coder_daemon, choice):
    named = isinstance(choice, dict)
    messages = [{"role": "user", "content": "Hi there!"}]  # nothing asks for a tool: the grammar does
    with coder_daemon.client() as c:
        for seed in (1, 2, 3):
            done = c.complete(
                messages=messages,
                tools=TOOLS,
                tool_choice=choice,
                parallel_tool_calls=False,  # sampled freely, a small model may call and call again
                temperature=1.0,
                seed=seed,
            )
            check_calls(done, {"read_file"} if named else None)
            assert len(done.tool_calls) == 1


def test_parallel_tool_calls_off_allows_one_call(coder_daemon):
    messages = [{"role": "user", "content": "Weather in Paris, in Oslo and in Rome?"}]
    with coder_daemon.client() as c:
        for parallel in (True, False):
            done = c.complete(
                messages=messages,
                tools=TOOLS,
                tool_choice="required",
                parallel_tool_calls=parallel,
                temperature=0.0,
                max_tokens=160,
            )
            if parallel:  # a small model may go on calling until max_tokens: every call made is still valid
                assert done.finish_reason in (FinishReason.TOOL_CALLS, FinishReason.LENGTH)
                assert len(done.tool_calls) >= 2
                done.finish_reason = FinishReason.TOOL_CALLS
            check_calls(done, None if parallel else {"get_weather"})
            if not parallel:
                assert len(done.tool_calls) == 1


def test_streamed_pieces_add_up_to_the_calls_in_done(coder_daemon):
    with coder_daemon.client() as c:
        stream = c.generate(messages=ASK, tools=TOOLS, temperature=0.0, max_tokens=120)
        pieces: dict[int, list] = {}
        text = ""
        for chunk in stream:
            text += chunk.text
            for d in chunk.tool_calls:
                if d.id is not None:
                    assert d.index not in pieces and d.name
                    pieces[d.index] = [d.id, d.name, ""]
                pieces[d.index][2] += d.arguments
        done = stream.done
    check_calls(done)
    assert text == done.text
    assert [tuple(pieces[i]) for i in sorted(pieces)] == [
        (t.id, t.function.name, t.function.arguments) for t in done.tool_calls
    ]
    assert len([p for p in pieces.values() if p[2]]) == len(done.tool_calls)


def tool_loop(client, turns: int):
    """An agent's loop: ask, run each call (a made-up result), send the history back."""
    messages = [{"role": "system", "content": "You are a coding agent. Use the tools."}] + [
        {"role": "user", "content": "Read src/app.py, then README.md, then tell me the weather in Paris."}
    ]
    dones = []
    for turn in range(turns):
        done = client.complete(
            messages=messages,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0.0,
            max_tokens=80,
        )
        dones.append(done)
        check_calls(done)
        messages.append(assistant_message(done))
        for t in done.tool_calls:
            messages.append({"role": "tool", "tool_call_id": t.id, "content": f"result {turn}: ok, 12 lines"})
    return dones


def test_a_tool_loop_re_renders_the_calls_so_the_prefix_cache_hits(coder_daemon):
    with coder_daemon.client() as c:
        chunk = c.status().model.prefill_chunk
        dones = tool_loop(c, 4)
    for before, after in zip(dones, dones[1:]):
        # every whole prefill chunk of the previous turn's prompt is kept (mixed kernels:
        # what follows, its reply included, is read as an uncached request reads it);
        # that prompt held the turn before's calls as re-rendered, so they matched
        assert after.usage.cached_tokens >= before.usage.prompt_tokens // chunk * chunk > 0, (before.usage, after.usage)


def test_smollm2_without_a_tool_template_gets_the_generic_prompt(daemon):
    with daemon.client() as c:
        done = c.complete(
            messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=120
        )
        check_calls(done)
        auto = c.complete(messages=ASK, tools=TOOLS, temperature=0.0, max_tokens=120)
        # calls, or a plain answer: how long the answer runs is the CPU's (on an AVX2-only EPYC it ran past 120)
        assert auto.finish_reason in (FinishReason.TOOL_CALLS, FinishReason.STOP, FinishReason.LENGTH)
        assert (auto.finish_reason == FinishReason.TOOL_CALLS) == bool(auto.tool_calls)
        if auto.tool_calls:
            check_calls(auto)
        else:
            assert auto.text.strip() and not auto.text.startswith("<")


def test_bad_tools_are_typed_errors_before_decoding_and_the_daemon_keeps_serving(coder_daemon):
    with coder_daemon.client() as c:
        bad_schema = [
            {
                "type": "function",
                "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "bogus"}}}},
            }
        ]
        with pytest.raises(RequestFailed) as err:
            c.complete(messages=ASK, tools=bad_schema, tool_choice="required", max_tokens=20)
        assert err.value.code == ErrorCode.BAD_CONSTRAINT and "tools[].function.parameters" in err.value.message
        with pytest.raises(RequestFailed) as err:  # the call's fixed start does not fit in max_tokens
            c.complete(messages=ASK, tools=TOOLS[:1], tool_choice="required", max_tokens=3)
        assert err.value.code == ErrorCode.BAD_CONSTRAINT and "raise max_tokens" in err.value.message
        with pytest.raises(InvalidRequest, match="not in 'tools'"):
            c.complete(messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "rm"}})
        with pytest.raises(RequestFailed) as err:
            c.complete(
                messages=ASK, tools=TOOLS, response_format={"type": "json_object"}, tool_choice="auto", max_tokens=5
            )
        assert err.value.code == ErrorCode.INVALID_REQUEST
        bad_history = ASK + [
            {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{x"}}]}
        ]
        with pytest.raises(RequestFailed) as err:
            c.complete(messages=bad_history, tools=TOOLS, max_tokens=5)
        assert "arguments is not JSON" in err.value.message
        assert c.complete(messages=ASK, tools=TOOLS, temperature=0.0, max_tokens=60).tool_calls


def test_a_call_cut_off_by_max_tokens_says_length_and_claims_no_call(coder_daemon):
    with coder_daemon.client() as c:
        done = c.complete(messages=ASK, tools=TOOLS, tool_choice="required", temperature=0.0, max_tokens=18)
    assert done.finish_reason == FinishReason.LENGTH and done.tool_calls == []


def one_call(client, max_tokens: int, **kw):
    """tool_choice required, one call: the grammar ends with the call's closing tag (one token in Qwen's
    vocabulary). Streamed; (the call pieces streamed, done)."""
    stream = client.generate(
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0.0,
        max_tokens=max_tokens,
        **kw,
    )
    deltas = [d for chunk in stream for d in chunk.tool_calls]
    return deltas, stream.done


def test_a_call_cut_off_before_it_closes_is_neither_streamed_nor_reported(coder_daemon):
    """max_tokens before the closing tag (the arguments are whole and parse) or inside the arguments: the
    call did not finish, so it is not a call, and no piece of it was streamed for a client to add up."""
    with coder_daemon.client() as c:
        deltas, whole = one_call(c, 120)
        check_calls(whole)
        n = whole.usage.completion_tokens
        assert [(d.name, d.arguments) for d in deltas] == [
            (t.function.name, t.function.arguments) for t in whole.tool_calls
        ]  # a call is streamed whole, once it closed
        assert not whole.incomplete
        for cut in (n - 1, n - 4):
            deltas, done = one_call(c, cut)
            assert done.finish_reason == FinishReason.LENGTH and done.incomplete, (cut, done)
            assert done.tool_calls == [] and deltas == [], cut


def test_a_stop_string_inside_a_call_ends_it_and_it_is_not_a_call(coder_daemon):
    with coder_daemon.client() as c:
        deltas, done = one_call(c, 120, stop=['"city"'])
    assert done.finish_reason == FinishReason.STOP and done.stop_sequence == '"city"'
    assert done.incomplete and done.tool_calls == [] and deltas == []


def test_a_repeated_call_ends_the_turn_instead_of_burning_max_tokens(coder_daemon):
    """Qwen2.5-Coder-0.5B, calls required and parallel ones allowed, writes the same read_file call again
    after its first calls (it did so until max_tokens before this rule): the turn ends at the repeat, with
    the calls made before it, each once."""
    messages = [
        {"role": "system", "content": "You are a coding agent. Use the tools."},
        {"role": "user", "content": "Read src/app.py and fix the bug in it."},
    ]
    with coder_daemon.client() as c:
        done = c.complete(messages=messages, tools=TOOLS, tool_choice="required", temperature=0.0, max_tokens=200)
    check_calls(done)
    calls = [(t.function.name, t.function.arguments) for t in done.tool_calls]
    assert len(set(calls)) == len(calls) and ("read_file", '{"path": "src/app.py"}') in calls
    assert done.usage.completion_tokens < 200 and not done.incomplete
