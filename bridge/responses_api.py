"""OpenAI's Responses API on the bridge (``POST /v1/responses``), translated to daemon requests.

What Codex CLI speaks (its chat wire is gone), as platform.openai.com's Responses
reference defines it: ``instructions``; ``input`` as a string or items
(``message`` with ``input_text``/``output_text`` parts, roles user, assistant,
system and developer, rendered where they stand; ``function_call`` and
``function_call_output``; ``reasoning`` items, which are not shown to the model
again); ``function`` tools (other tool types, such as Codex's ``web_search`` and
``namespace`` entries, are left out with a warning in the bridge's log: the model
is offered only what it can call); ``tool_choice``, ``parallel_tool_calls``,
``max_output_tokens``, ``temperature``, ``top_p`` (and tandem's ``top_k``, as in chat), ``text.format`` (structured
output through the daemon's constraints); ``reasoning``, ``include``, ``store``,
``prompt_cache_key``, ``metadata`` and ``client_metadata`` accepted (the served
models have no reasoning controls, and the prefix cache needs no key). No response
is kept: ``previous_response_id`` is a 400 that says to send the whole input, which
is what Codex does. ``stream`` gives the documented event sequence, each event's
``type`` in its data, from ``response.created`` to ``response.completed`` (with
``usage`` and its cached tokens), and ``response.in_progress`` as the keep-alive
while a long prompt is read (Codex needs a data event, not a comment).

``parse_responses`` makes the GenRequest (translate.py), ``ResponsesAnswer``
renders the daemon's result back, and the async handler does the I/O.
"""

from __future__ import annotations

import logging
import secrets
import time
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Optional

from tandem.protocol import MAX_TOKENS_LIMIT, Chunk, Done, FinishReason, ToolCallDelta

from .answers import sse
from .translate import (
    GenRequest,
    Sampling,
    ToolUse,
    bad_request,
    checked,
    effort,
    function_tool,
    history_call,
    prompt_progress,
    read,
)

if TYPE_CHECKING:
    from .exchange import Exchange

log = logging.getLogger("tandem.bridge")

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")


# --------------------------------------------------------------------------- request translation


_WARNED: set[str] = set()  # the kinds of tools left out that were logged (an agent sends them every turn)


def _left_out_once(kinds: str) -> None:
    level = logging.DEBUG if kinds in _WARNED else logging.WARNING
    _WARNED.add(kinds)
    log.log(level, "tools left out (the model can call only function tools here): %s", kinds)


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or an array of content parts", param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind in ("input_image", "input_file", "input_audio"):
            raise bad_request(f"{where}[{j}]: tandem's models read text only ({kind})", param=where)
        else:
            raise bad_request(f"{where}[{j}]: a content part of type {kind!r} is not supported here", param=where)
    return "".join(parts)


def _call(out: list[dict], item: dict, where: str) -> None:
    """A ``function_call`` item of an earlier turn: a call of the assistant message it follows."""
    if not isinstance(item.get("call_id"), str) or not isinstance(item.get("name"), str):
        raise bad_request(f"{where}: a function_call needs 'call_id' and 'name'", param=where)
    arguments = item.get("arguments") or "{}"
    if not isinstance(arguments, str):
        raise bad_request(f"{where}.arguments must be a string of JSON", param=where)
    call = history_call(item["call_id"], item["name"], arguments)
    if out and out[-1]["role"] == "assistant":  # (the same turn: its text, then its calls)
        out[-1].setdefault("tool_calls", []).append(call)
    else:
        out.append({"role": "assistant", "content": "", "tool_calls": [call]})


def input_messages(body: dict) -> list[dict]:
    """``instructions`` and ``input`` as the daemon's chat messages, in their order."""
    out: list[dict] = []
    instructions = read(body, "instructions", (str,))
    if instructions:
        out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("'input' is required: a string, or an array of input items", param="input")
    thought = ""  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "reasoning":
            thought += _reasoning_text(item)
            continue
        before = len(out), len(out[-1].get("tool_calls") or ()) if out else 0
        if kind == "message":
            role = ROLES.get(item.get("role"))
            if role is None:
                raise bad_request(f"{where}.role must be user, assistant, system or developer", param=where)
            text = _text(item.get("content"), f"{where}.content")
            if text or role != "system":
                out.append({"role": role, "content": text})
        elif kind == "function_call":
            _call(out, item, where)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}: a function_call_output needs 'call_id'", param=where)
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported here", param=where)
        after = len(out), len(out[-1].get("tool_calls") or ()) if out else 0
        if thought and out and out[-1]["role"] == "assistant" and after != before:
            out[-1]["reasoning"] = thought  # (sent back: the templates that show it get it)
            thought = ""
    return out


def _reasoning_text(item: dict) -> str:
    """A ``reasoning`` item's text: its ``reasoning_text`` content (what this server sends), else its summary."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list):
            text = "".join(p["text"] for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
            if text:
                return text
    return ""


def tool_use(body: dict) -> Optional[ToolUse]:
    """``function`` tools, ``tool_choice`` and ``parallel_tool_calls`` as the daemon takes them."""
    tools = read(body, "tools", (list,)) or []
    out, left_out = [], []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise bad_request(f"tools[{i}] must be an object", param="tools")
        if tool.get("type") != "function":
            left_out.append(str(tool.get("type")))
            continue
        if not isinstance(tool.get("name"), str):
            raise bad_request(f"tools[{i}]: a function tool needs 'name'", param="tools")
        fn = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object", "properties": {}}}
        if tool.get("description"):
            fn["description"] = tool["description"]
        out.append(function_tool(fn))
    if left_out:
        _left_out_once(", ".join(left_out))
    choice = body.get("tool_choice")
    if not out:
        if choice == "required" or isinstance(choice, dict):
            raise bad_request("tool_choice asks for a tool, but no function tools are given", param="tool_choice")
        return None
    use = ToolUse(out, parallel=read(body, "parallel_tool_calls", (bool,)))
    if choice in (None, "auto", "none", "required"):
        use.choice = choice
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        use.choice = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise bad_request("tool_choice must be auto, none, required or {type: function, name}", param="tool_choice")
    return use


def response_format(body: dict) -> Optional[dict]:
    """``text.format`` (``text``, ``json_object``, ``json_schema`` with its ``schema``) as the daemon takes it."""
    text = read(body, "text", (dict,)) or {}
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "output", "schema": fmt["schema"]}}
    raise bad_request("text.format must be {type: text}, {type: json_object} or {type: json_schema, schema}", "text")


def parse_responses(body: dict) -> GenRequest:
    """``/v1/responses``."""
    if body.get("previous_response_id") is not None:
        raise bad_request(
            "previous_response_id: this server keeps no responses (store is not kept); send the whole "
            "conversation in 'input'",
            param="previous_response_id",
        )
    reasoning = read(body, "reasoning", (dict,)) or {}
    model = read(body, "model", (str,), "")
    sampling = Sampling(
        # (none given, as Codex sends it: until the model stops or the context is full, as the API does)
        max_tokens=read(body, "max_output_tokens", (int,), MAX_TOKENS_LIMIT),
        temperature=read(body, "temperature", (int, float)),
        top_p=read(body, "top_p", (int, float)),
        top_k=read(body, "top_k", (int,)),  # (tandem's, as in chat completions)
    ).normalised()
    req = GenRequest(
        messages=input_messages(body),
        sampling=sampling,
        tools=tool_use(body),
        response_format=response_format(body),
        model=model,
        stream=bool(read(body, "stream", (bool,), False)),
        progress=bool(read(body, "return_progress", (bool,), False)),  # (llama-server's)
    )
    if reasoning.get("effort") is not None:  # (a reasoning model's; one that does not think ignores it)
        req.think, req.reasoning_effort = effort(checked(reasoning["effort"], (str,), key="reasoning.effort"))
    req.max_thinking_tokens = read(body, "max_thinking_tokens", (int,))  # (tandem's)
    return req


# --------------------------------------------------------------------------- rendering the result


def usage(done: Done) -> dict:
    u = done.usage
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    content = [{"type": "output_text", "text": text, "annotations": []}] if status != "in_progress" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    """The model's thinking, as OpenAI's open-weight models' reasoning items carry it (raw text, no summary)."""
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [], "content": content}


def call_item(call_id: str, name: str, arguments: str) -> dict:
    return {
        "type": "function_call",
        "id": "fc_" + call_id.removeprefix("call_"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


class ResponsesAnswer:
    """One request's answer: the response object (``response``), whole or as
    the stream's events (``opening``, ``chunk``, ``waiting``, ``closing``: dicts
    whose ``type`` names the event)."""

    def __init__(self, req: GenRequest, response_id: str, created_at: int):
        self.req, self.id, self.created_at = req, response_id, created_at
        self.sequence = 0
        self.output: list[dict] = []  # the items streamed so far, completed
        self.text_item: Optional[dict] = None  # the message item being streamed
        self.text = ""
        self.thought_item: Optional[dict] = None  # the reasoning item being streamed
        self.thought = ""

    def response(self, status: str, done: Optional[Done] = None, output: Optional[list] = None) -> dict:
        tools = self.req.tools
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.req.model,
            "output": output if output is not None else [],
            "parallel_tool_calls": bool(tools is None or tools.parallel is not False),
            "tool_choice": (tools.choice if tools is not None and tools.choice is not None else "auto"),
            "tools": [],
            "error": None,
            "incomplete_details": None,
            "usage": usage(done) if done is not None else None,
        }
        if done is not None and done.finish_reason == FinishReason.LENGTH:
            out["status"] = "incomplete"
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out

    def whole(self, done: Done) -> dict:
        cut = done.finish_reason == FinishReason.LENGTH and not done.tool_calls
        output = [message_item("msg_" + self.id.removeprefix("resp_"), done.text)] if done.text else []
        if output and cut:
            output[0]["status"] = "incomplete"
        if done.reasoning:
            output.insert(0, reasoning_item("rs_" + self.id.removeprefix("resp_"), done.reasoning))
        output += [call_item(c.id, c.function.name, c.function.arguments) for c in done.tool_calls]
        return self.response("completed", done, output)

    def _event(self, kind: str, **fields: Any) -> dict:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def opening(self) -> list[dict]:
        return [
            self._event("response.created", response=self.response("in_progress")),
            self._event("response.in_progress", response=self.response("in_progress")),
        ]

    def waiting(self) -> list[dict]:
        return [self._event("response.in_progress", response=self.response("in_progress"))]

    def _open_text(self) -> list[dict]:
        at = len(self.output)  # (a message after a call is another item, with an id of its own)
        item_id = "msg_" + self.id.removeprefix("resp_") + (f"_{at}" if at else "")
        self.text_item = message_item(item_id, "", "in_progress")
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self._event("response.output_item.added", output_index=at, item=self.text_item),
            self._event(
                "response.content_part.added", item_id=self.text_item["id"], output_index=at, content_index=0, part=part
            ),
        ]

    def _open_thought(self) -> list[dict]:
        at = len(self.output)
        item_id = "rs_" + self.id.removeprefix("resp_") + (f"_{at}" if at else "")
        self.thought_item = reasoning_item(item_id, "", "in_progress")
        return [self._event("response.output_item.added", output_index=at, item=self.thought_item)]

    def _close_thought(self) -> list[dict]:
        if self.thought_item is None:
            return []
        item, at = reasoning_item(self.thought_item["id"], self.thought), len(self.output)
        self.thought_item, self.thought = None, ""
        self.output.append(item)
        ids = {"item_id": item["id"], "output_index": at, "content_index": 0}
        return [
            self._event("response.reasoning_text.done", **ids, text=item["content"][0]["text"]),
            self._event("response.output_item.done", output_index=at, item=item),
        ]

    def _close_text(self, cut: bool = False) -> list[dict]:
        if self.text_item is None:
            return []
        item, at = message_item(self.text_item["id"], self.text, "incomplete" if cut else "completed"), len(self.output)
        self.text_item = None
        self.output.append(item)
        ids = {"item_id": item["id"], "output_index": at, "content_index": 0}
        return [
            self._event("response.output_text.done", **ids, text=self.text),
            self._event("response.content_part.done", **ids, part=item["content"][0]),
            self._event("response.output_item.done", output_index=at, item=item),
        ]

    def _call(self, d: ToolCallDelta) -> list[dict]:
        item, at = call_item(d.id or "", d.name or "", d.arguments), len(self.output)
        self.output.append(item)
        return [
            self._event(
                "response.output_item.added", output_index=at, item={**item, "arguments": "", "status": "in_progress"}
            ),
            self._event(
                "response.function_call_arguments.delta", item_id=item["id"], output_index=at, delta=d.arguments
            ),
            self._event(
                "response.function_call_arguments.done", item_id=item["id"], output_index=at, arguments=d.arguments
            ),
            self._event("response.output_item.done", output_index=at, item=item),
        ]

    def chunk(self, chunk: Chunk) -> list[dict]:
        if chunk.progress is not None:  # (return_progress) on the keep-alive event, as llama-server puts it
            return [{**self.waiting()[0], "prompt_progress": prompt_progress(chunk.progress)}]
        out: list[dict] = []
        if chunk.reasoning:
            if self.thought_item is None:
                out += self._close_text() + self._open_thought()
            self.thought += chunk.reasoning
            ids = {"item_id": self.thought_item["id"], "output_index": len(self.output), "content_index": 0}
            out.append(self._event("response.reasoning_text.delta", **ids, delta=chunk.reasoning))
        if chunk.text:
            out += self._close_thought()
            if self.text_item is None:
                out += self._open_text()
            self.text += chunk.text
            at = len(self.output)
            out.append(
                self._event(
                    "response.output_text.delta",
                    item_id=self.text_item["id"],
                    output_index=at,
                    content_index=0,
                    delta=chunk.text,
                )
            )
        for d in chunk.tool_calls:  # (since protocol 1.5 each call comes whole, once the model closed it)
            out += self._close_thought() + self._close_text() + self._call(d)
        return out

    def closing(self, done: Done) -> list[dict]:
        out = self._close_thought() + self._close_text(cut=done.finish_reason == FinishReason.LENGTH)  # (cut: length)
        response = self.response("completed", done, self.output)
        return out + [
            self._event(
                "response.completed" if response["status"] == "completed" else "response.incomplete", response=response
            )
        ]

    def failing(self, error: dict) -> list[dict]:
        response = {**self.response("failed", None, self.output), "error": error}
        return [self._event("response.failed", response=response)]


# --------------------------------------------------------------------------- the handler


async def responses(ex: "Exchange", body: dict) -> None:
    req = parse_responses(body)
    hello = await ex.hello()
    req.model = req.model or hello.model
    answer = ResponsesAnswer(req, "resp_" + secrets.token_hex(12), int(time.time()))
    if not req.stream:
        ex.send_json(HTTPStatus.OK, answer.whole(await ex.run_to_done(req.start)))
        return

    def events(items: list[dict]) -> list[bytes]:
        return [sse(e, event=e["type"]) for e in items]

    await ex.relay(
        req.start,
        "text/event-stream",
        opening=lambda: events(answer.opening()),
        each=lambda chunk: events(answer.chunk(chunk)),
        closing=lambda done: events(answer.closing(done)),
        failing=lambda exc: events(answer.failing(exc.body()["error"])),
        keepalive=lambda: events(answer.waiting()),
    )
