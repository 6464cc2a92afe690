"""The OpenAI dialect of the HTTP bridge (server.py): ``/v1/models``,
``/v1/completions`` (with ``suffix`` for fill in the middle),
``/v1/chat/completions`` (tools, ``response_format``), ``stream: true`` as
server-sent events, and llama-server's ``/tokenize``/``/detokenize``, each
translated to one daemon request. ``ApiError`` is every dialect's error.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional

from tandem.client.core import assistant_message
from tandem.daemon.version import __version__
from tandem.protocol import MAX_TOKENS_LIMIT, FinishReason

from .answers import ApiError, sse

if TYPE_CHECKING:
    from tandem.client.aio import AsyncClient, AsyncStream

    from .exchange import Exchange

OPENAI_COMPLETIONS_MAX_TOKENS = 16  # the API's default for /v1/completions
FINGERPRINT = f"tandem-{__version__}"  # OpenAI's system_fingerprint: which backend answered

# --------------------------------------------------------------------------- request translation


def _get(body: dict, key: str, kinds: tuple, default: Any = None) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = "/".join(
            {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}[k]
            for k in kinds
        )
        raise ApiError(HTTPStatus.BAD_REQUEST, f"'{key}' must be {names}, got {json.dumps(value)[:80]}", param=key)
    return value


def _refuse(
    body: dict, key: str, why: str, allowed: Callable[[Any], bool] = lambda v: v in (None, False, 0, [], {})
) -> None:
    if key in body and not allowed(body[key]):
        raise ApiError(HTTPStatus.BAD_REQUEST, f"'{key}' is not supported by tandem: {why}", param=key)


def _sampling(body: dict, default_max_tokens: int) -> dict:
    """The parameters /v1/completions and /v1/chat/completions share, as daemon request fields."""
    if _get(body, "n", (int,), 1) != 1:
        raise ApiError(HTTPStatus.BAD_REQUEST, "'n' must be 1: tandem generates one choice per request", param="n")
    _refuse(body, "logprobs", "no log-probabilities are returned")
    _refuse(body, "top_logprobs", "no log-probabilities are returned")
    _refuse(body, "logit_bias", "sampling cannot be biased per token")
    _refuse(body, "presence_penalty", "sampling has no penalties")
    _refuse(body, "frequency_penalty", "sampling has no penalties")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    elif stop is None:
        stop = []
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ApiError(HTTPStatus.BAD_REQUEST, "'stop' must be a string or an array of strings", param="stop")
    max_tokens = _get(body, "max_completion_tokens", (int,)) or _get(body, "max_tokens", (int,), default_max_tokens)
    params = dict(
        max_tokens=max_tokens,
        temperature=float(_get(body, "temperature", (int, float), 1.0)),
        top_p=float(_get(body, "top_p", (int, float), 1.0)),
        seed=_get(body, "seed", (int,)),
        stop=stop,
    )
    # tandem's own knobs, for clients that can add fields (openai: extra_body=...)
    for key, kinds in (
        ("top_k", (int,)),
        ("draft", (str,)),
        ("draft_tokens", (int,)),
        ("cache", (bool,)),
        ("ignore_eos", (bool,)),
    ):
        if body.get(key) is not None:
            params[key] = _get(body, key, kinds)
    if params["top_p"] == 0.0:  # the API allows 0; the daemon's nucleus must hold a token
        params["top_p"] = 1.0
        params["temperature"] = 0.0
    return params


def _chat_messages(body: dict) -> list[dict]:
    messages = _get(body, "messages", (list,))
    if not messages:
        raise ApiError(HTTPStatus.BAD_REQUEST, "'messages' is required: an array of {role, content}", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(
                HTTPStatus.BAD_REQUEST, f"messages[{i}] must be an object with a 'role'", param=f"messages[{i}]"
            )
        role = "system" if m["role"] == "developer" else m["role"]
        if role not in ("system", "user", "assistant", "tool"):
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                f"messages[{i}] has role {m['role']!r}; tandem takes system, developer, user, assistant and tool "
                "(the legacy 'function' role: send tool calls and tool results instead)",
                param=f"messages[{i}].role",
            )
        content = m.get("content")
        if content is None:
            content = ""
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ApiError(
                        HTTPStatus.BAD_REQUEST,
                        f"messages[{i}].content has a part that is not text; tandem's models read text only",
                        param=f"messages[{i}].content",
                    )
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                f"messages[{i}].content must be a string or an array of text parts",
                param=f"messages[{i}].content",
            )
        message: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = _tool_calls(m["tool_calls"], i)
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise ApiError(
                    HTTPStatus.BAD_REQUEST,
                    f"messages[{i}] is a tool result without a 'tool_call_id' (the id of the call it answers)",
                    param=f"messages[{i}].tool_call_id",
                )
            message["tool_call_id"] = m["tool_call_id"]
            if isinstance(m.get("name"), str):
                message["name"] = m["name"]
        out.append(message)
    return out


def _tool_calls(calls: Any, i: int) -> list[dict]:
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{where} must be an array of tool calls", param=where)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(call.get("id"), str)):
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                f'{where}[{j}] must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}',
                param=f"{where}[{j}]",
            )
        arguments = fn.get("arguments", "{}")
        if not isinstance(arguments, str):  # some clients send the object itself
            arguments = json.dumps(arguments, ensure_ascii=False)
        out.append({"id": call["id"], "function": {"name": fn["name"], "arguments": arguments}})
    return out


def _tools(body: dict) -> dict:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` as the daemon takes them."""
    tools = _get(body, "tools", (list,))
    if not tools:
        choice = body.get("tool_choice")
        if choice not in (None, "none", "auto"):
            raise ApiError(HTTPStatus.BAD_REQUEST, "'tool_choice' is given but 'tools' is not", param="tool_choice")
        return {}
    out = []
    for i, tool in enumerate(tools):
        if not (isinstance(tool, dict) and tool.get("type", "function") == "function"):
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                f'tools[{i}] must be {{"type": "function", "function": {{"name", "description", "parameters"}}}}',
                param=f"tools[{i}]",
            )
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ApiError(HTTPStatus.BAD_REQUEST, f"tools[{i}].function must be an object", param=f"tools[{i}]")
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})  # null: absent
    params: dict[str, Any] = {"tools": out}
    if body.get("tool_choice") is not None:
        params["tool_choice"] = body["tool_choice"]
    if body.get("parallel_tool_calls") is not None:
        params["parallel_tool_calls"] = _get(body, "parallel_tool_calls", (bool,))
    return params


@dataclass
class Call:
    """One translated request: what to start on the daemon and how to shape the answer."""

    kind: str  # "text_completion" or "chat.completion"
    start: Callable[["AsyncClient"], Awaitable["AsyncStream"]]
    stream: bool
    include_usage: bool


def completions_call(body: dict) -> Call:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError(
            HTTPStatus.BAD_REQUEST,
            "'prompt' must be a string (one prompt; token arrays are not supported)",
            param="prompt",
        )
    _refuse(body, "echo", "the prompt is not echoed back")
    _refuse(body, "best_of", "one choice is generated", allowed=lambda v: v in (None, 1))
    params = _sampling(body, OPENAI_COMPLETIONS_MAX_TOKENS)
    suffix = _get(body, "suffix", (str,))
    if suffix is not None:  # fill in the middle: the daemon's ``complete`` op
        for key, kinds in (("max_lines", (int,)), ("stop_at_blank_line", (bool,))):
            if body.get(key) is not None:
                params[key] = _get(body, key, kinds)
        start = lambda c: c.infill(prompt, suffix, **params)  # noqa: E731
    else:
        start = lambda c: c.generate(prompt=prompt, **params)  # noqa: E731
    return Call("text_completion", start, bool(_get(body, "stream", (bool,), False)), _include_usage(body))


def chat_call(body: dict) -> Call:
    messages = _chat_messages(body)
    _refuse(body, "functions", "the legacy 'functions' are not taken: send them as 'tools'")
    _refuse(body, "function_call", "the legacy 'function_call' is not taken: send 'tool_choice'")
    params = _sampling(body, MAX_TOKENS_LIMIT)  # the API's default: until the model stops or the context is full
    params.update(_tools(body))
    response_format = _response_format(body)
    if response_format is not None:
        params["response_format"] = response_format
    start = lambda c: c.generate(messages=messages, **params)  # noqa: E731
    return Call("chat.completion", start, bool(_get(body, "stream", (bool,), False)), _include_usage(body))


def _response_format(body: dict) -> Optional[dict]:
    """OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``), and
    tandem's own ``regex`` and ``grammar``, as the daemon takes it."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise ApiError(
            HTTPStatus.BAD_REQUEST,
            "'response_format' must be an object with a 'type': text, json_object, json_schema, regex or grammar",
            param="response_format",
        )
    keys = {"type", "json_schema", "pattern", "lark"}
    return {k: v for k, v in rf.items() if k in keys}


def _include_usage(body: dict) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and options.get("include_usage") is True


def _finish(reason: FinishReason) -> str:
    return {FinishReason.LENGTH: "length", FinishReason.TOOL_CALLS: "tool_calls"}.get(reason, "stop")


def _call_deltas(deltas) -> list[dict]:
    """One entry per call in a chunk, as OpenAI sends them (pieces of the same call merged)."""
    out: list[dict] = []
    for d in deltas:
        if out and out[-1]["index"] == d.index:
            out[-1]["function"]["arguments"] += d.arguments
        else:
            out.append(_call_delta(d))
    return out


def _call_delta(d) -> dict:
    """A streamed tool-call piece, as OpenAI streams it: the first has id, type and name."""
    if d.id is not None:
        return {
            "index": d.index,
            "id": d.id,
            "type": "function",
            "function": {"name": d.name, "arguments": d.arguments},
        }
    return {"index": d.index, "function": {"arguments": d.arguments}}


def _usage(done) -> dict:
    u = done.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


# ------------------------------------------------------------------- answers (the HTTP side: server.py, exchange.py)


async def model_entry(ex: "Exchange") -> dict:
    """/v1/models' entry for the daemon's model, as it is now."""
    hello = await ex.hello()
    return {"id": hello.model, "object": "model", "created": 0, "owned_by": "tandem", "context_length": hello.n_ctx}


async def models(ex: "Exchange") -> None:
    ex.send_json(HTTPStatus.OK, {"object": "list", "data": [await model_entry(ex)]})


async def model(ex: "Exchange", name: str) -> None:
    entry = await model_entry(ex)
    if name not in (entry["id"], "tandem"):  # (chat takes model "tandem" too)
        raise ApiError(HTTPStatus.NOT_FOUND, f"no model {name!r}; this daemon serves {entry['id']!r}", param="model")
    ex.send_json(HTTPStatus.OK, entry)


async def generate(ex: "Exchange", call: Call) -> None:
    """/v1/completions and /v1/chat/completions: one daemon request, answered whole or as server-sent events."""
    if not call.stream:
        done = await ex.run_to_done(call.start)
        ex.send_json(HTTPStatus.OK, _answer(call, ex, done))
        return
    chat = call.kind == "chat.completion"

    def event(delta: Optional[str], finish: Optional[str] = None, role: bool = False) -> bytes:
        e = _envelope(call, ex, chunk=True)
        if chat:
            d: dict = (
                {"role": "assistant", "content": ""} if role else ({"content": delta} if delta is not None else {})
            )
            e["choices"] = [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]
        else:
            e["choices"] = [{"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}]
        return sse(e)

    def each(chunk) -> list[bytes]:
        out = [event(chunk.text)] if chunk.text else []
        if chat and chunk.tool_calls:
            e = _envelope(call, ex, chunk=True)
            delta = {"tool_calls": _call_deltas(chunk.tool_calls)}
            e["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]
            out.append(sse(e))
        return out

    def closing(done) -> list[bytes]:
        out = [event(None, finish=_finish(done.finish_reason))]
        if call.include_usage:
            e = _envelope(call, ex, chunk=True)
            e["choices"] = []
            e["usage"] = _usage(done)
            out.append(sse(e))
        return out + [sse("[DONE]")]

    await ex.relay(
        call.start,
        "text/event-stream",
        opening=lambda: [event(None, role=True)] if chat else [],
        each=each,
        closing=closing,
        failing=lambda exc: [sse(exc.body()), sse("[DONE]")],
    )


def _answer(call: Call, ex: "Exchange", done) -> dict:
    reply = _envelope(call, ex)
    if call.kind == "chat.completion":
        message = assistant_message(done)
        if done.tool_calls:
            message["content"] = done.text or None
        choice = {"index": 0, "message": message, "logprobs": None}
    else:
        choice = {"index": 0, "text": done.text, "logprobs": None}
    choice["finish_reason"] = _finish(done.finish_reason)
    reply["choices"] = [choice]
    reply["usage"] = _usage(done)
    return reply


def _envelope(call: Call, ex: "Exchange", chunk: bool = False) -> dict:
    prefix = "chatcmpl-" if call.kind == "chat.completion" else "cmpl-"
    obj = call.kind + (".chunk" if chunk and call.kind == "chat.completion" else "")
    return {
        "id": prefix + ex.request_id,
        "object": obj,
        "created": int(time.time()),
        "model": ex.server.model,
        "system_fingerprint": FINGERPRINT,
    }


async def tokens(ex: "Exchange", path: str, body: dict) -> None:
    """llama-server's /tokenize and /detokenize; /v1/tokenize: an OpenAI-style
    request's prompt or messages (and tools) counted as generate would read them."""
    async with ex.daemon() as client:
        if path == "/detokenize":
            ids = _get(body, "tokens", (list,), [])
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ApiError(HTTPStatus.BAD_REQUEST, "'tokens' must be an array of integers", param="tokens")
            return ex.send_json(HTTPStatus.OK, {"content": await client.detokenize(ids)})
        if path == "/tokenize":
            content = _get(body, "content", (str,))
            if content is None:
                raise ApiError(HTTPStatus.BAD_REQUEST, "'content' (the text) is required", param="content")
            pieces = bool(_get(body, "with_pieces", (bool,), False))
            reply = await client.tokenize(
                content,
                add_special=bool(_get(body, "add_special", (bool,), False)),
                parse_special=bool(_get(body, "parse_special", (bool,), True)),
                with_pieces=pieces,
            )
            if pieces:
                out = [{"id": t, "piece": p} for t, p in zip(reply.tokens, reply.pieces)]
                return ex.send_json(HTTPStatus.OK, {"tokens": out})
            return ex.send_json(HTTPStatus.OK, {"tokens": reply.tokens})
        if body.get("messages") is not None:
            reply = await client.tokenize(messages=_chat_messages(body), tools=_tools(body).get("tools"))
        else:
            prompt = _get(body, "prompt", (str,))
            if prompt is None:
                raise ApiError(HTTPStatus.BAD_REQUEST, "give 'prompt' or 'messages'", param="prompt")
            reply = await client.tokenize(prompt, parse_special=True)
        ex.send_json(HTTPStatus.OK, {"tokens": reply.tokens, "count": len(reply.tokens), "model": ex.server.model})
