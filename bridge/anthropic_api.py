"""Anthropic's Messages API on the bridge (``POST /v1/messages``), translated to daemon requests.

Agents built on Anthropic's SDKs reach tandem by changing the base URL. What is
served, as docs.anthropic.com's Messages reference defines it: ``system``
(a string or text blocks), ``messages`` with string or block content (``text``,
``tool_use``, ``tool_result``), ``max_tokens`` (required), ``stop_sequences``,
``temperature``, ``top_p``, ``top_k``, ``tools`` (``input_schema``) and
``tool_choice`` (``auto``, ``any``, ``tool``, ``none``), and ``stream`` as
Anthropic's event sequence (``message_start``, ``content_block_start`` /
``_delta`` / ``_stop``, ``message_delta``, ``message_stop``). Image and
document blocks are refused (the models read text); ``metadata`` is accepted.
Errors are Anthropic's ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from tandem.protocol import FinishReason

from .answers import ApiError, sse

if TYPE_CHECKING:
    from .exchange import Exchange


def _text_of(content: Any, where: str) -> str:
    """A string, or text blocks joined (tool results carry either)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, block in enumerate(content):
            if not (isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)):
                raise ApiError(HTTPStatus.BAD_REQUEST, f"{where}[{j}] must be a text block here")
            parts.append(block["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise ApiError(HTTPStatus.BAD_REQUEST, f"{where} must be a string or an array of text blocks")


def _messages(body: dict) -> list[dict]:
    """Anthropic's system + messages as the daemon's chat messages (tool_use and
    tool_result blocks become assistant tool calls and tool messages)."""
    out: list[dict] = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": _text_of(system, "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(HTTPStatus.BAD_REQUEST, "messages: an array of {role, content} is required")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ApiError(HTTPStatus.BAD_REQUEST, f"messages.{i}.role must be 'user' or 'assistant'")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise ApiError(HTTPStatus.BAD_REQUEST, f"messages.{i}.content must be a string or an array of blocks")
        text, calls = [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            where = f"messages.{i}.content.{j}"
            if kind == "text":
                text.append(_text_of([block], where))
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise ApiError(HTTPStatus.BAD_REQUEST, f"{where}: a tool_use block needs 'id' and 'name'")
                args = json.dumps(block.get("input") or {}, ensure_ascii=False)
                calls.append({"id": block["id"], "function": {"name": block["name"], "arguments": args}})
            elif kind == "tool_result" and m["role"] == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise ApiError(HTTPStatus.BAD_REQUEST, f"{where}: a tool_result block needs 'tool_use_id'")
                result = _text_of(block.get("content"), f"{where}.content")
                if block.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
            elif kind in ("image", "document"):
                raise ApiError(HTTPStatus.BAD_REQUEST, f"{where}: tandem's models read text only ({kind} blocks)")
            elif kind in ("thinking", "redacted_thinking"):
                continue  # a previous turn's reasoning: not shown to the model again
            else:
                raise ApiError(HTTPStatus.BAD_REQUEST, f"{where}: block type {kind!r} is not supported here")
        if text or calls:
            msg: dict[str, Any] = {"role": m["role"], "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def _tools(body: dict) -> dict:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools:
        if isinstance(choice, dict) and choice.get("type") in ("any", "tool"):
            raise ApiError(HTTPStatus.BAD_REQUEST, "tool_choice asks for a tool, but no tools are given")
        return {}
    if not isinstance(tools, list):
        raise ApiError(HTTPStatus.BAD_REQUEST, "tools must be an array")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise ApiError(HTTPStatus.BAD_REQUEST, f"tools.{i}: a tool needs 'name' and 'input_schema'")
        if tool.get("type") not in (None, "custom"):
            raise ApiError(HTTPStatus.BAD_REQUEST, f"tools.{i}: server tools ({tool['type']}) are not available here")
        fn = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
        if tool.get("description"):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    params: dict[str, Any] = {"tools": out}
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "tool":
            params["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in ("auto", "any", "none"):
            params["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
        else:
            raise ApiError(HTTPStatus.BAD_REQUEST, "tool_choice.type must be auto, any, tool or none")
        if choice.get("disable_parallel_tool_use"):
            params["parallel_tool_calls"] = False
    return params


def _number(body: dict, key: str, kinds=(int, float)) -> Any:
    value = body.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, kinds)):
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{key}: a number is required")
    return value


def _params(body: dict, n_ctx: int) -> dict:
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ApiError(HTTPStatus.BAD_REQUEST, "max_tokens: a positive integer is required")
    max_tokens = min(max_tokens, n_ctx)  # a cap, as in the API (agents send 32k+): the context ends a reply first
    stop = body.get("stop_sequences") or []
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ApiError(HTTPStatus.BAD_REQUEST, "stop_sequences must be an array of strings")
    params: dict[str, Any] = {"max_tokens": max_tokens, "stop": stop, "temperature": 1.0}  # Anthropic's default
    for key in ("temperature", "top_p"):
        if _number(body, key) is not None:
            params[key] = float(body[key])
    if _number(body, "top_k", (int,)) is not None:
        params["top_k"] = body["top_k"]
    if params.get("top_p") == 0.0:
        params["top_p"], params["temperature"] = 1.0, 0.0
    return params


def _blocks(done) -> list[dict]:
    blocks: list[dict] = []
    if done.text or not done.tool_calls:
        blocks.append({"type": "text", "text": done.text})
    for call in done.tool_calls:
        try:
            args = json.loads(call.function.arguments or "{}")
        except ValueError:
            args = {}
        blocks.append({"type": "tool_use", "id": call.id, "name": call.function.name, "input": args})
    return blocks


def _stop_reason(done) -> tuple[str, Any]:
    if done.finish_reason == FinishReason.TOOL_CALLS:
        return "tool_use", None
    if done.finish_reason == FinishReason.LENGTH:
        return "max_tokens", None
    if done.stop_sequence is not None:
        return "stop_sequence", done.stop_sequence
    return "end_turn", None


def _usage(done) -> dict:
    u = done.usage
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


async def messages(ex: "Exchange", body: dict) -> None:
    hello = await ex.hello()
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(HTTPStatus.BAD_REQUEST, "model: the name of the model is required (any name: one is served)")
    chat = _messages(body)
    params = _params(body, hello.n_ctx)
    tools = _tools(body)
    params.update(tools)
    stream = body.get("stream", False)
    msg_id = "msg_" + __import__("secrets").token_hex(12)
    start = lambda c: c.generate(messages=chat, **params)  # noqa: E731
    if not stream:
        done = await ex.run_to_done(start)
        reason, seq = _stop_reason(done)
        ex.send_json(
            HTTPStatus.OK,
            {
                "id": msg_id,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": _blocks(done),
                "stop_reason": reason,
                "stop_sequence": seq,
                "usage": _usage(done),
            },
        )
        return
    events = _Events(msg_id, model, params["stop"])
    prompt_tokens = await _prompt_tokens(ex, chat, tools)  # message_start carries them, as Anthropic's does

    def out(pairs) -> list[bytes]:
        return [sse(data, event=name) for name, data in pairs]

    await ex.relay(
        start,
        "text/event-stream",
        opening=lambda: out(events.start(prompt_tokens)),
        each=lambda chunk: out(events.chunk(chunk)),
        closing=lambda done: out(events.finish(done)),
        failing=lambda exc: out([("error", exc.body("anthropic"))]),
    )


class _Events:
    """Anthropic's streamed event sequence for one message."""

    def __init__(self, msg_id: str, model: str, stop: list[str]):
        self.msg_id, self.model, self.stop = msg_id, model, stop
        self.index = -1  # the open content block
        self.kind = ""  # its type: "text" or "tool_use"

    def start(self, prompt_tokens: int = 0) -> list[tuple[str, dict]]:
        message = {
            "id": self.msg_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
        }
        return [("message_start", {"type": "message_start", "message": message})]

    def _close(self) -> list[tuple[str, dict]]:
        if self.index < 0 or not self.kind:
            return []
        self.kind = ""
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _open(self, block: dict) -> list[tuple[str, dict]]:
        out = self._close()
        self.index += 1
        self.kind = block["type"]
        out.append(
            ("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})
        )
        return out

    def chunk(self, chunk) -> list[tuple[str, dict]]:
        out: list[tuple[str, dict]] = []
        if chunk.text:
            if self.kind != "text":
                out += self._open({"type": "text", "text": ""})
            delta = {"type": "text_delta", "text": chunk.text}
            out.append(("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}))
        for d in chunk.tool_calls or []:
            if d.id is not None:  # a new call
                out += self._open({"type": "tool_use", "id": d.id, "name": d.name, "input": {}})
            if d.arguments:
                delta = {"type": "input_json_delta", "partial_json": d.arguments}
                out.append(
                    ("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})
                )
        return out

    def finish(self, done) -> list[tuple[str, dict]]:
        out = []
        if self.index < 0:  # nothing was produced: still one (empty) text block
            out += self._open({"type": "text", "text": ""})
        out += self._close()
        reason, seq = _stop_reason(done)
        out.append(
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": seq},
                    "usage": _usage(done),  # (input_tokens too: they are known only now)
                },
            )
        )
        out.append(("message_stop", {"type": "message_stop"}))
        return out


async def count_tokens(ex: "Exchange", body: dict) -> None:
    """``/v1/messages/count_tokens``: the prompt's tokens, as the daemon renders and reads it."""
    ex.send_json(HTTPStatus.OK, {"input_tokens": await _prompt_tokens(ex, _messages(body), _tools(body))})


async def _prompt_tokens(ex: "Exchange", chat: list[dict], tools: dict) -> int:
    """The prompt's tokens as generate renders it (with no tools under tool_choice none: they cost nothing then)."""
    offered = None if tools.get("tool_choice") == "none" else tools.get("tools")
    async with ex.daemon() as client:
        return await client.count_tokens(messages=chat, tools=offered)
