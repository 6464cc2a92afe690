"""OpenAI's Responses API (bridge/responses_api.py) without a model or a daemon:
Codex CLI's recorded requests and hand-made bodies parsed into the typed
request, refused with 400s that name the field, and the daemon's results
rendered as a response object and as the event sequence Codex reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.bridge.answers import ApiError
from tandem.bridge.responses_api import ResponsesAnswer, parse_responses
from tandem.protocol import MAX_TOKENS_LIMIT, FinishReason

RECORDED = Path(__file__).parent / "recorded"
BASE = {"model": "local-model", "input": "Hi"}


def recorded(name: str) -> dict:
    """A request Codex CLI 0.169.0 sent (codex exec; paths and ids scrubbed)."""
    return json.loads((RECORDED / name).read_text())["body"]


def refused(body: dict) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_responses(body)
    assert info.value.status == 400
    return info.value


def test_codexs_first_request_is_its_developer_and_user_messages_with_its_function_tools():
    req = parse_responses(recorded("codex-0.169.0-first.json"))
    assert [m["role"] for m in req.messages] == ["system", "system", "user", "user"]
    assert req.messages[-1]["content"] == "say hi"
    assert "<environment_context>" in req.messages[2]["content"]
    names = [t["function"]["name"] for t in req.tools.tools]
    assert names == ["exec_command", "write_stdin", "request_user_input", "view_image"] + [
        "get_goal",
        "create_goal",
        "update_goal",
    ]  # (its namespace and web_search entries are not function tools: left out)
    assert req.tools.choice == "auto" and req.tools.parallel is True
    assert req.stream is True and req.model == "local-model"
    # Codex sends no max_output_tokens: to the end (the daemon's own default, 256, cut its answers)
    assert req.daemon_params()["max_tokens"] == MAX_TOKENS_LIMIT


def test_codexs_tool_round_renders_the_first_request_as_its_prefix():
    first = parse_responses(recorded("codex-0.169.0-first.json")).messages
    second = parse_responses(recorded("codex-0.169.0-tool-result.json")).messages
    assert second[: len(first)] == first
    call, result = second[len(first) :]
    assert call["role"] == "assistant" and call["tool_calls"][0]["function"]["name"] == "exec_command"
    assert json.loads(call["tool_calls"][0]["function"]["arguments"]) == {"cmd": "ls"}
    assert result["role"] == "tool" and result["tool_call_id"] == call["tool_calls"][0]["id"]
    assert result["content"].endswith("README.md\ncalc.py\n")


def test_instructions_and_items_in_their_order():
    body = {
        "instructions": "Be brief.",
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List files."}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
            {"type": "function_call", "call_id": "call_1", "name": "ls", "arguments": "{}"},
            {"type": "function_call", "call_id": "call_2", "name": "pwd", "arguments": ""},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.py"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "/x"}]},
            {"role": "developer", "content": "Now summarise."},
        ],
    }
    msgs = parse_responses(body).messages
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "tool", "system"]
    assert msgs[2]["content"] == "Sure." and [c["id"] for c in msgs[2]["tool_calls"]] == ["call_1", "call_2"]
    assert msgs[2]["tool_calls"][1]["function"]["arguments"] == "{}"
    assert msgs[4]["content"] == "/x"


def test_sampling_tool_choice_and_text_format():
    req = parse_responses(
        {
            **BASE,
            "max_output_tokens": 50,
            "temperature": 0.2,
            "top_p": 0,
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "f"},
            "parallel_tool_calls": False,
            "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}},
            "reasoning": {"effort": "low"},
            "store": True,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "k",
        }
    )
    params = req.daemon_params()
    assert params["max_tokens"] == 50 and params["temperature"] == 0.0 and params["top_p"] == 1.0
    assert params["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert params["parallel_tool_calls"] is False
    assert params["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": {"type": "object"}},
    }
    assert parse_responses({**BASE, "text": {"format": {"type": "text"}}}).response_format is None


@pytest.mark.parametrize(
    "change, message",
    [
        ({"input": []}, "'input' is required: a string, or an array of input items"),
        ({"previous_response_id": "resp_1"}, "previous_response_id: this server keeps no responses"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role must be user, assistant, system or developer"),
        (
            {"input": [{"type": "local_shell_call"}]},
            "input[0]: input items of type 'local_shell_call' are not supported",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]: tandem's models read text only (input_image)",
        ),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0]: a function_call needs 'call_id' and 'name'"),
        ({"max_output_tokens": "5"}, "'max_output_tokens' must be integer"),
        ({"tool_choice": "required"}, "tool_choice asks for a tool, but no function tools are given"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format must be"),
    ],
)
def test_a_bad_body_is_a_400_naming_the_field(change, message):
    assert refused({**BASE, **change}).message.startswith(message)


def answer(**req) -> ResponsesAnswer:
    return ResponsesAnswer(parse_responses({**BASE, **req}), "resp_abc", 1700000000)


def test_a_whole_response_with_text_and_a_call(done):
    out = answer().whole(done("Listing.", FinishReason.TOOL_CALLS, calls=(("call_9", "ls", '{"d": "."}'),)))
    assert out["id"] == "resp_abc" and out["object"] == "response" and out["status"] == "completed"
    assert out["output"][0] == {
        "type": "message",
        "id": "msg_abc",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "Listing.", "annotations": []}],
    }
    assert out["output"][1] == {
        "type": "function_call",
        "id": "fc_9",
        "call_id": "call_9",
        "name": "ls",
        "arguments": '{"d": "."}',
        "status": "completed",
    }
    assert out["usage"] == {
        "input_tokens": 12,
        "input_tokens_details": {"cached_tokens": 4},
        "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 17,
    }


def test_a_response_cut_by_the_length_is_incomplete(done):
    out = answer().whole(done("abc", FinishReason.LENGTH))
    assert out["status"] == "incomplete" and out["incomplete_details"] == {"reason": "max_output_tokens"}


def test_the_streamed_events_are_codexs_sequence(done, chunk):
    a = answer(stream=True)
    events = a.opening() + a.waiting() + a.chunk(chunk("Hel")) + a.chunk(chunk("lo"))
    events += a.chunk(chunk("", deltas=((0, '{"cmd": "ls"}', "call_7", "exec_command"),)))
    events += a.closing(done("Hello", FinishReason.TOOL_CALLS, calls=(("call_7", "exec_command", '{"cmd": "ls"}'),)))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.in_progress",  # (the keep-alive while the prompt is read)
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done_items = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done_items[0]["content"][0]["text"] == "Hello"
    assert done_items[1]["call_id"] == "call_7" and done_items[1]["arguments"] == '{"cmd": "ls"}'
    final = events[-1]["response"]
    assert final["output"] == done_items and final["usage"]["input_tokens_details"]["cached_tokens"] == 4


def test_a_failure_after_the_start_is_a_failed_response():
    a = answer(stream=True)
    a.opening()
    (event,) = a.failing({"message": "the worker died", "type": "server_error"})
    assert event["type"] == "response.failed" and event["response"]["status"] == "failed"
    assert event["response"]["error"]["message"] == "the worker died"


def test_text_after_a_call_is_another_message_item_with_its_own_id(done, chunk):
    a = answer(stream=True)
    events = a.opening() + a.chunk(chunk("Let me look."))
    events += a.chunk(chunk("", deltas=((0, "{}", "call_1", "ls"),))) + a.chunk(chunk("\n"))
    events += a.closing(done("Let me look.\n", FinishReason.TOOL_CALLS, calls=(("call_1", "ls", "{}"),)))
    ids = [e["item"]["id"] for e in events if e["type"] == "response.output_item.done"]
    assert len(ids) == len(set(ids)) == 3
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["message", "function_call", "message"]


def test_text_the_length_cut_is_an_incomplete_item(done, chunk):
    a = answer(stream=True)
    events = a.opening() + a.chunk(chunk("1, 2, 3")) + a.closing(done("1, 2, 3", FinishReason.LENGTH))
    item = [e for e in events if e["type"] == "response.output_item.done"][0]["item"]
    assert item["status"] == "incomplete" and item["content"][0]["text"] == "1, 2, 3"
    assert events[-1]["type"] == "response.incomplete"
    assert answer().whole(done("1, 2, 3", FinishReason.LENGTH))["output"][0]["status"] == "incomplete"


def test_return_progress_rides_on_the_keep_alive_event(chunk):
    from tandem.protocol import PromptProgress

    a = answer(stream=True, return_progress=True)
    assert a.opening()[-1]["type"] == "response.in_progress"
    reading = chunk("")
    reading.progress = PromptProgress(total=6286, cached=5440, processed=5952, seconds=1.5)
    (event,) = a.chunk(reading)
    assert event["type"] == "response.in_progress" and event["sequence_number"] == 2
    assert event["prompt_progress"] == {"total": 6286, "cache": 5440, "processed": 5952, "time_ms": 1500}
    assert parse_responses({**BASE, "stream": True, "return_progress": True}).daemon_params()["progress"] is True
