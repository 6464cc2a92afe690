"""The bridge's shared translation layer (bridge/translate.py), without a model
or a daemon: the typed request and what it starts, the typed field readers and
their 400s, top_p 0 as greedy, stop lists, tool specs and call arguments; and
that the bridge's modules import one another without a cycle."""

from __future__ import annotations

import ast
import asyncio

import pytest

from bench.code_shape import imports_of, modules
from tandem.bridge.answers import ApiError
from tandem.bridge.translate import (
    GenRequest,
    Sampling,
    ToolUse,
    arguments_object,
    arguments_text,
    checked,
    function_tool,
    history_call,
    is_a,
    read,
    stop_list,
)


def raises_400(fn, *args, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args, **kwargs)
    assert info.value.status == 400
    return info.value


# --------------------------------------------------------------------------- reading fields


@pytest.mark.parametrize(
    "value, kinds, ok",
    [
        (1, (int,), True),
        (True, (int,), False),  # JSON's true is not a number
        (True, (bool,), True),
        (1.5, (int,), False),
        (1.5, (int, float), True),
        ("1", (int, float), False),
        ([], (list,), True),
    ],
)
def test_is_a_keeps_booleans_apart_from_numbers(value, kinds, ok):
    assert is_a(value, kinds) is ok


def test_read_gives_the_default_for_absent_and_null_and_names_the_field_otherwise():
    assert read({}, "max_tokens", (int,), 16) == 16
    assert read({"max_tokens": None}, "max_tokens", (int,), 16) == 16
    assert read({"max_tokens": 7}, "max_tokens", (int,), 16) == 7
    err = raises_400(read, {"max_tokens": "7"}, "max_tokens", (int,))
    assert err.message == "'max_tokens' must be integer, got \"7\"" and err.param == "max_tokens"
    err = raises_400(read, {"temperature": True}, "temperature", (int, float))
    assert err.message == "'temperature' must be integer/number, got true"
    err = raises_400(read, {"stream": "x" * 200}, "stream", (bool,))
    assert err.message == "'stream' must be boolean, got " + ('"' + "x" * 79)  # the value cut at 80 characters


def test_checked_takes_a_dialects_own_message_and_may_leave_the_param_out():
    assert checked(None, (int,), "{key}: no") is None
    err = raises_400(
        checked, "hot", (int, float), "options.{key} must be a number, got {json:.60}", "temperature", False
    )
    assert err.message == 'options.temperature must be a number, got "hot"' and err.param is None
    err = raises_400(checked, 1.5, (int,), "{key} must be an integer, got {value!r}", "num_predict")
    assert err.message == "num_predict must be an integer, got 1.5" and err.param == "num_predict"


def test_stop_list_takes_null_one_string_or_strings():
    assert stop_list(None, "bad") == []
    assert stop_list("\n\n", "bad") == ["\n\n"]
    assert stop_list(["a", "b"], "bad") == ["a", "b"]
    err = raises_400(stop_list, ["a", 1], "'stop' must be a string or an array of strings", param="stop")
    assert err.message == "'stop' must be a string or an array of strings" and err.param == "stop"
    assert raises_400(stop_list, "a", "stop_sequences: strings", one_string=False).message == "stop_sequences: strings"
    assert raises_400(stop_list, 5, "bad").message == "bad"


# --------------------------------------------------------------------------- sampling


def test_top_p_zero_is_greedy_and_other_values_are_kept():
    s = Sampling(temperature=0.7, top_p=0.0).normalised()
    assert (s.temperature, s.top_p) == (0.0, 1.0)
    s = Sampling(temperature=0.7, top_p=0.5).normalised()
    assert (s.temperature, s.top_p) == (0.7, 0.5)
    s = Sampling(temperature=0.7).normalised()  # top_p not given: the daemon's
    assert (s.temperature, s.top_p) == (0.7, None)


def test_a_negative_top_k_is_off_only_where_the_dialect_says_so():
    assert Sampling(top_k=-1).normalised().top_k == -1  # (the daemon refuses it, naming the field)
    assert Sampling(top_k=-1).normalised(negative_top_k_is_off=True).top_k == 0
    assert Sampling(top_k=0).normalised(negative_top_k_is_off=True).top_k == 0
    assert Sampling(top_k=5).normalised(negative_top_k_is_off=True).top_k == 5


# --------------------------------------------------------------------------- the typed request


def test_daemon_params_leave_out_what_takes_the_daemons_default():
    req = GenRequest(prompt="x", sampling=Sampling(max_tokens=8, temperature=0.0, stop=["\n"]))
    assert req.daemon_params() == {"max_tokens": 8, "temperature": 0.0, "stop": ["\n"]}
    tool = function_tool({"name": "get"})
    req = GenRequest(
        messages=[{"role": "user", "content": "hi"}],
        sampling=Sampling(max_tokens=4, top_k=0, seed=3),
        tools=ToolUse([tool], choice="required", parallel=False),
        response_format={"type": "json_object"},
        draft="off",
        cache=False,
        stream=True,  # (the HTTP answer's: never the daemon's)
        model="x",
    )
    assert req.daemon_params() == {
        "max_tokens": 4,
        "top_k": 0,
        "seed": 3,
        "stop": [],
        "tools": [tool],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "response_format": {"type": "json_object"},
        "draft": "off",
        "cache": False,
    }
    assert GenRequest(messages=[], tools=ToolUse([tool])).daemon_params() == {"stop": [], "tools": [tool]}


def test_start_sends_a_prompt_messages_or_a_fill_in_the_middle(recording_client):
    c = recording_client
    sampling = Sampling(max_tokens=3)
    asyncio.run(GenRequest(prompt="def f", sampling=sampling).start(c))
    asyncio.run(GenRequest(messages=[{"role": "user", "content": "hi"}], sampling=sampling).start(c))
    asyncio.run(GenRequest(prompt="a = ", suffix="\nprint(a)", sampling=sampling, max_lines=1).start(c))
    assert c.calls == [
        ("generate", ("def f", None), {"max_tokens": 3, "stop": []}),
        ("generate", (None, [{"role": "user", "content": "hi"}]), {"max_tokens": 3, "stop": []}),
        ("infill", ("a = ", "\nprint(a)"), {"max_tokens": 3, "stop": [], "max_lines": 1}),
    ]
    assert GenRequest(prompt="a", suffix="b").is_fill and not GenRequest(prompt="a").is_fill
    assert GenRequest(messages=[]).is_chat and not GenRequest(prompt="a").is_chat


# --------------------------------------------------------------------------- tools and their arguments


def test_a_function_tool_drops_null_fields():
    fn = {"name": "get", "description": None, "parameters": {"type": "object"}, "strict": None}
    assert function_tool(fn) == {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}


def test_call_arguments_as_text_and_back():
    assert arguments_text('{"city": "Paris"}') == '{"city": "Paris"}'  # OpenAI's: the text as it is
    assert arguments_text({"city": "Zürich"}) == '{"city": "Zürich"}'  # Ollama's: the object, not ASCII-escaped
    assert arguments_text(None) == "null"
    assert arguments_object('{"a": [1, 2]}') == {"a": [1, 2]}
    assert arguments_object("") == {}
    assert arguments_object('{"a": ') == {}  # the model's text is not JSON: an empty object
    assert history_call("call_1", "get", "{}") == {"id": "call_1", "function": {"name": "get", "arguments": "{}"}}


# --------------------------------------------------------------------------- errors and the package's shape


def test_one_error_in_each_dialects_shape():
    err = ApiError(400, "'n' must be 1", param="n")
    assert err.body() == {
        "error": {"message": "'n' must be 1", "type": "invalid_request_error", "param": "n", "code": None}
    }
    assert err.body("ollama") == {"error": "'n' must be 1"}
    assert err.body("anthropic") == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "'n' must be 1"},
    }


def test_the_bridge_has_no_import_cycle_and_translation_needs_no_http_side():
    mods = {name: path for name, path in modules() if name.startswith("tandem.bridge")}
    graph = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        graph[name] = {m for m in imports_of(name, tree, path.name == "__init__.py") if m in mods and m != name}
    assert graph["tandem.bridge.translate"] == {"tandem.bridge.answers"}
    for dialect in ("openai_bridge", "ollama_api", "anthropic_api"):
        assert "tandem.bridge.server" not in graph[f"tandem.bridge.{dialect}"]
        assert "tandem.bridge.routes" not in graph[f"tandem.bridge.{dialect}"]

    def reaches(start: str, target: str, seen: set) -> bool:
        for m in graph[start]:
            if m == target or (m not in seen and (seen.add(m) or reaches(m, target, seen))):
                return True
        return False

    assert [m for m in graph if reaches(m, m, set())] == []


# --------------------------------------------------------------------------- the bridge's own sampling


def _exchange(dialect: str, sampling: dict):
    from types import SimpleNamespace

    return SimpleNamespace(dialect=dialect, server=SimpleNamespace(sampling=sampling))


def test_the_bridges_sampling_fills_what_a_request_leaves_out_and_null():
    from tandem.bridge.routes import with_sampling

    ex = _exchange("openai", {"temperature": 0.0, "top_k": 20})
    body = with_sampling(ex, {"messages": [], "temperature": None, "top_k": 5})
    assert body == {"messages": [], "temperature": 0.0, "top_k": 5}  # its own top_k holds
    assert with_sampling(_exchange("openai", {}), {"x": 1}) == {"x": 1}  # none set: the dialect's defaults
    # Ollama's sit in options, made if there are none; options of another type are the dialect's to refuse
    assert with_sampling(_exchange("ollama", {"top_p": 0.5}), {"model": "m"})["options"] == {"top_p": 0.5}
    assert with_sampling(_exchange("ollama", {"top_p": 0.5}), {"options": {"top_p": 0.9}})["options"] == {"top_p": 0.9}
    assert with_sampling(_exchange("ollama", {"top_p": 0.5}), {"options": [1]})["options"] == [1]
