"""An agent's tool loop through the bridge, driven by clients nobody on this project
wrote: the official ``openai`` package (streamed calls, results fed back) and the
``llm`` CLI's tool support (it runs the tool itself and sends the result back)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest


@pytest.fixture(scope="module")
def bridge(coder_daemon, bridge_process):
    b = bridge_process(coder_daemon)
    yield b
    assert b.stop() == 0, "".join(b.lines)


def streamed_call(client, messages, **kw):
    """One streamed turn, accumulated as an agent does: (text, tool calls, finish_reason)."""
    text, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model="tandem", messages=messages, stream=True, **kw):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        text += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.id:
                calls[d.index] = {
                    "id": d.id,
                    "type": "function",
                    "function": {"name": d.function.name, "arguments": ""},
                }
            calls[d.index]["function"]["arguments"] += d.function.arguments or ""
    return text, [calls[i] for i in sorted(calls)], finish


def test_openai_client_tool_loop_streamed_with_results_fed_back(bridge, weather_tool):
    client = bridge.openai()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    # required: whether this small model calls on its own is its choice (other tests
    # cover auto); this test is about the client's streamed calls and the loop
    text, calls, finish = streamed_call(
        client,
        messages,
        tools=[weather_tool],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=100,
    )
    assert finish == "tool_calls" and len(calls) == 1, (text, calls)
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    args = json.loads(calls[0]["function"]["arguments"])
    jsonschema.validate(args, weather_tool["function"]["parameters"])
    messages += [
        {"role": "assistant", "content": text or None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "18 degrees celsius and sunny"},
    ]
    first_prompt = client.chat.completions.create(
        model="tandem", messages=messages[:1], tools=[weather_tool], temperature=0, max_tokens=1
    ).usage.prompt_tokens
    answer = client.chat.completions.create(
        model="tandem", messages=messages, tools=[weather_tool], temperature=0, max_tokens=60
    )
    choice = answer.choices[0]
    # Qwen2.5-Coder-0.5B calls eagerly: after the result it may answer or call again; either is well-formed
    if choice.finish_reason == "tool_calls":
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), weather_tool["function"]["parameters"])
    else:
        assert choice.finish_reason == "stop" and choice.message.content
    assert answer.usage.prompt_tokens > first_prompt + 10  # the call and its result were rendered into the prompt
    # and the first turn hit the cache (its whole 64-token prefill chunks, with the default mixed kernels)
    assert answer.usage.prompt_tokens_details.cached_tokens >= (first_prompt - 1) // 64 * 64 > 0


def test_openai_client_non_streamed_calls_parse(bridge, weather_tool):
    client = bridge.openai()
    reply = client.chat.completions.create(
        model="tandem",
        messages=[{"role": "user", "content": "Weather in Oslo and in Rome?"}],
        tools=[weather_tool],
        tool_choice="required",
        parallel_tool_calls=False,  # on, this small model goes on calling until max_tokens
        temperature=0,
        max_tokens=120,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), weather_tool["function"]["parameters"])


def test_bad_tools_are_400s_naming_the_field(bridge, weather_tool):
    import openai

    client = bridge.openai()
    with pytest.raises(openai.BadRequestError, match="not in 'tools'"):
        client.chat.completions.create(
            model="tandem",
            messages=[{"role": "user", "content": "hi"}],
            tools=[weather_tool],
            tool_choice={"type": "function", "function": {"name": "rm_rf"}},
        )
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        client.chat.completions.create(
            model="tandem", messages=[{"role": "tool", "content": "x"}], tools=[weather_tool]
        )


def llm_cli() -> str:
    exe = shutil.which("llm") or str(Path(sys.executable).with_name("llm"))
    if not Path(exe).exists():
        pytest.fail("the llm CLI is not installed: pip install -e '.[test]' installs it")
    return exe


def test_llm_cli_runs_a_tool_through_the_bridge(bridge, tmp_path):
    home = tmp_path
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: tandem\n  model_name: tandem\n  api_base: {bridge.url}\n  supports_tools: true\n"
    )
    env = {**os.environ, "LLM_USER_PATH": str(home), "OPENAI_API_KEY": "unused"}
    functions = "def city_temperature(city: str) -> str:\n    return f'It is 21 degrees in {city}.'\n"
    out = subprocess.run(
        [
            llm_cli(),
            "-m",
            "tandem",
            "--functions",
            functions,
            "--td",  # tools debug: show each call and its result
            "--cl",  # chain limit: this small model may call again after the result
            "2",
            "-o",
            "temperature",
            "0",
            "What is the temperature in Lisbon? Use the tool.",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    shown = out.stdout + out.stderr
    # the small model may call again after the result: llm then stops at its chain limit, having sent it back
    assert out.returncode == 0 or "Chain limit of 2 exceeded" in out.stderr, shown
    assert "Tool call: city_temperature(" in shown and "Lisbo" in shown, shown
    assert "21 degrees" in shown, shown  # the tool ran, and its result went back to the model


# --------------------------------------------------------------------------- the Responses API (what Codex speaks)


def responses_tool(weather_tool) -> dict:
    """The same tool in the Responses API's flat shape."""
    return {"type": "function", **weather_tool["function"]}


def test_openai_client_responses_whole_and_streamed_agree(bridge):
    client = bridge.openai()
    asked = dict(model="tandem", input="Count from 1 to 50, separated by commas.", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**asked)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output_text and whole.usage.output_tokens == 12
    kinds, text, final = [], "", None
    for event in client.responses.create(stream=True, **asked):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        final = event
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert text == whole.output_text == final.response.output_text  # greedy: the same text either way


def test_openai_client_responses_tool_round_like_codex(bridge, weather_tool):
    """Codex's loop: a streamed turn that calls a tool, the call echoed back with its output, the next turn
    reading the first one's prompt from the prefix cache."""
    client = bridge.openai()
    tools = [responses_tool(weather_tool), {"type": "web_search"}]  # (not a function tool: left out)
    items: list = [
        {"type": "message", "role": "developer", "content": "You answer questions about the weather."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
    ]
    done = None
    for event in client.responses.create(
        model="local-model",
        input=items,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=100,
        stream=True,
        store=False,
    ):
        if event.type == "response.output_item.done" and event.item.type == "function_call":
            items.append(event.item.model_dump(exclude_none=True))
        done = event
    assert done.type == "response.completed", done
    call = items[-1]
    assert call["type"] == "function_call" and call["name"] == "get_weather" and call["call_id"].startswith("call_")
    jsonschema.validate(json.loads(call["arguments"]), weather_tool["function"]["parameters"])
    first_prompt = done.response.usage.input_tokens
    items.append({"type": "function_call_output", "call_id": call["call_id"], "output": "18 degrees and sunny"})
    answer = client.responses.create(model="local-model", input=items, tools=tools, temperature=0, max_output_tokens=40)
    assert answer.status in ("completed", "incomplete") and answer.output  # (text, or another call: the model's choice)
    # the first turn from the cache (its whole 64-token prefill chunks, with the default mixed kernels)
    assert answer.usage.input_tokens > first_prompt + 10
    assert answer.usage.input_tokens_details.cached_tokens >= (first_prompt - 1) // 64 * 64 > 0
