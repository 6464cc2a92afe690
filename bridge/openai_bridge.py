"""The OpenAI dialect of the HTTP bridge (server.py): ``/v1/models``,
``/v1/completions`` (with ``suffix`` for fill in the middle),
``/v1/chat/completions`` (tools, ``response_format``), ``stream: true`` as
server-sent events, and llama-server's ``/tokenize``/``/detokenize``, each
translated to one daemon request: ``parse_completions`` and ``parse_chat``
make the GenRequest (translate.py), ``OpenAIAnswer`` renders the daemon's
result back, and the async handlers around them do the I/O.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from tandem.client.core import assistant_message, counted
from tandem.daemon.version import __version__
from tandem.protocol import MAX_TOKENS_LIMIT, Chunk, Done, FinishReason, ToolCallDelta

from .answers import ApiError, sse
from .translate import (
    GenRequest,
    Sampling,
    ToolUse,
    arguments_text,
    bad_request,
    checked,
    effort,
    function_tool,
    history_call,
    prompt_progress,
    read,
    stop_list,
)

if TYPE_CHECKING:
    from .exchange import Exchange

OPENAI_COMPLETIONS_MAX_TOKENS = 16  # the API's default for /v1/completions
FINGERPRINT = f"tandem-{__version__}"  # OpenAI's system_fingerprint: which backend answered
KNOB_KINDS = (("draft", (str,)), ("draft_tokens", (int,)), ("cache", (bool,)), ("ignore_eos", (bool,)))

# --------------------------------------------------------------------------- request translation


def _refuse(
    body: dict, key: str, why: str, allowed: Callable[[Any], bool] = lambda v: v in (None, False, 0, [], {})
) -> None:
    if key in body and not allowed(body[key]):
        raise bad_request(f"'{key}' is not supported by tandem: {why}", param=key)


def _sampling(body: dict, default_max_tokens: int) -> dict:
    """The fields /v1/completions and /v1/chat/completions share, as GenRequest's
    keyword arguments (``sampling`` and tandem's own knobs)."""
    if read(body, "n", (int,), 1) != 1:
        raise bad_request("'n' must be 1: tandem generates one choice per request", param="n")
    _refuse(body, "logprobs", "no log-probabilities are returned")
    _refuse(body, "top_logprobs", "no log-probabilities are returned")
    _refuse(body, "logit_bias", "sampling cannot be biased per token")
    _refuse(body, "presence_penalty", "sampling has no penalties")
    _refuse(body, "frequency_penalty", "sampling has no penalties")
    stop = stop_list(body.get("stop"), "'stop' must be a string or an array of strings", param="stop")
    sampling = Sampling(
        max_tokens=read(body, "max_completion_tokens", (int,)) or read(body, "max_tokens", (int,), default_max_tokens),
        temperature=float(read(body, "temperature", (int, float), 1.0)),
        top_p=float(read(body, "top_p", (int, float), 1.0)),
        seed=read(body, "seed", (int,)),
        stop=stop,
    )
    # tandem's own knobs, for clients that can add fields (openai: extra_body=...)
    sampling.top_k = read(body, "top_k", (int,))
    knobs = {key: read(body, key, kinds) for key, kinds in KNOB_KINDS}
    return {"sampling": sampling.normalised(), **knobs}


def chat_messages(body: dict) -> list[dict]:
    """``messages`` as the daemon's chat messages (``developer`` is ``system``)."""
    messages = read(body, "messages", (list,))
    if not messages:
        raise bad_request("'messages' is required: an array of {role, content}", param="messages")
    return [_chat_message(m, i) for i, m in enumerate(messages)]


def _chat_message(m: Any, i: int) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise bad_request(f"messages[{i}] must be an object with a 'role'", param=f"messages[{i}]")
    role = "system" if m["role"] == "developer" else m["role"]
    if role not in ("system", "user", "assistant", "tool"):
        raise bad_request(
            f"messages[{i}] has role {m['role']!r}; tandem takes system, developer, user, assistant and tool "
            "(the legacy 'function' role: send tool calls and tool results instead)",
            param=f"messages[{i}].role",
        )
    message: dict[str, Any] = {"role": role, "content": _content(m.get("content"), i)}
    if role == "assistant" and m.get("tool_calls"):
        message["tool_calls"] = _tool_calls(m["tool_calls"], i)
    if role == "assistant":  # the thinking before it, as llama-server (reasoning_content) or vLLM (reasoning) send it
        thought = m.get("reasoning_content") or m.get("reasoning")
        if isinstance(thought, str) and thought:
            message["reasoning"] = thought
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise bad_request(
                f"messages[{i}] is a tool result without a 'tool_call_id' (the id of the call it answers)",
                param=f"messages[{i}].tool_call_id",
            )
        message["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            message["name"] = m["name"]
    return message


def _content(content: Any, i: int) -> str:
    """A message's content: a string, or text parts joined (null: empty)."""
    where = f"messages[{i}].content"
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad_request(f"{where} has a part that is not text; tandem's models read text only", param=where)
            parts.append(part["text"])
        return "".join(parts)
    if not isinstance(content, str):
        raise bad_request(f"{where} must be a string or an array of text parts", param=where)
    return content


def _tool_calls(calls: Any, i: int) -> list[dict]:
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be an array of tool calls", param=where)
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(call.get("id"), str)):
            raise bad_request(
                f'{where}[{j}] must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}',
                param=f"{where}[{j}]",
            )
        out.append(history_call(call["id"], fn["name"], arguments_text(fn.get("arguments", "{}"))))
    return out


def _tools(body: dict) -> Optional[ToolUse]:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` as the daemon takes them."""
    tools = read(body, "tools", (list,))
    if not tools:
        choice = body.get("tool_choice")
        if choice not in (None, "none", "auto"):
            raise bad_request("'tool_choice' is given but 'tools' is not", param="tool_choice")
        return None
    out = []
    for i, tool in enumerate(tools):
        if not (isinstance(tool, dict) and tool.get("type", "function") == "function"):
            raise bad_request(
                f'tools[{i}] must be {{"type": "function", "function": {{"name", "description", "parameters"}}}}',
                param=f"tools[{i}]",
            )
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"tools[{i}].function must be an object", param=f"tools[{i}]")
        out.append(function_tool(fn))
    return ToolUse(out, choice=body.get("tool_choice"), parallel=read(body, "parallel_tool_calls", (bool,)))


def _response_format(body: dict) -> Optional[dict]:
    """OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``), and
    tandem's own ``regex`` and ``grammar``, as the daemon takes it."""
    rf = body.get("response_format")
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise bad_request(
            "'response_format' must be an object with a 'type': text, json_object, json_schema, regex or grammar",
            param="response_format",
        )
    keys = {"type", "json_schema", "pattern", "lark"}
    return {k: v for k, v in rf.items() if k in keys}


def _answer_shape(body: dict) -> dict:
    """``stream``, ``stream_options.include_usage`` and llama-server's ``return_progress``."""
    options = body.get("stream_options")
    return {
        "stream": bool(read(body, "stream", (bool,), False)),
        "include_usage": isinstance(options, dict) and options.get("include_usage") is True,
        "progress": bool(read(body, "return_progress", (bool,), False)),
    }


def parse_completions(body: dict) -> GenRequest:
    """``/v1/completions``: a prompt; with ``suffix``, fill in the middle."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad_request("'prompt' must be a string (one prompt; token arrays are not supported)", param="prompt")
    _refuse(body, "echo", "the prompt is not echoed back")
    _refuse(body, "best_of", "one choice is generated", allowed=lambda v: v in (None, 1))
    req = GenRequest(prompt=prompt, **_sampling(body, OPENAI_COMPLETIONS_MAX_TOKENS))
    req.suffix = read(body, "suffix", (str,))
    if req.suffix is not None:  # fill in the middle: the daemon's ``complete`` op
        req.max_lines = read(body, "max_lines", (int,))
        req.stop_at_blank_line = read(body, "stop_at_blank_line", (bool,))
    for key, value in _answer_shape(body).items():
        setattr(req, key, value)
    return req


def parse_chat(body: dict) -> GenRequest:
    """``/v1/chat/completions``: messages, tools, ``response_format``."""
    messages = chat_messages(body)
    _refuse(body, "functions", "the legacy 'functions' are not taken: send them as 'tools'")
    _refuse(body, "function_call", "the legacy 'function_call' is not taken: send 'tool_choice'")
    params = _sampling(body, MAX_TOKENS_LIMIT)  # the API's default: until the model stops or the context is full
    tools = _tools(body)
    response_format = _response_format(body)
    req = GenRequest(messages=messages, tools=tools, response_format=response_format, **params, **_answer_shape(body))
    _reasoning(body, req)
    return req


def _reasoning(body: dict, req: GenRequest) -> None:
    """A reasoning model's controls: OpenAI's ``reasoning_effort`` ("none" turns thinking off),
    ``chat_template_kwargs.enable_thinking`` (llama-server's and vLLM's), and tandem's ``think`` and
    ``max_thinking_tokens``."""
    value = read(body, "reasoning_effort", (str,))
    if value is not None:
        req.think, req.reasoning_effort = effort(value)
    kwargs = read(body, "chat_template_kwargs", (dict,))
    if kwargs and kwargs.get("enable_thinking") is not None:
        req.think = checked(kwargs["enable_thinking"], (bool,), key="chat_template_kwargs.enable_thinking")
    think = read(body, "think", (bool,))
    if think is not None:
        req.think = think
    req.max_thinking_tokens = read(body, "max_thinking_tokens", (int,))


# --------------------------------------------------------------------------- rendering the result


@dataclass
class Head:
    """What an OpenAI answer names besides the result: the daemon request's id,
    the model that answered, and when (Unix seconds)."""

    request_id: str
    model: str
    created: int


def finish_reason(reason: FinishReason) -> str:
    return {FinishReason.LENGTH: "length", FinishReason.TOOL_CALLS: "tool_calls"}.get(reason, "stop")


def usage(done: Done) -> dict:
    u = done.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
    }


def call_deltas(deltas: list[ToolCallDelta]) -> list[dict]:
    """One entry per call in a chunk, as OpenAI sends them (pieces of the same call merged);
    the first piece of a call has its id, type and name."""
    out: list[dict] = []
    for d in deltas:
        if out and out[-1]["index"] == d.index:
            out[-1]["function"]["arguments"] += d.arguments
        elif d.id is not None:
            out.append(
                {
                    "index": d.index,
                    "id": d.id,
                    "type": "function",
                    "function": {"name": d.name, "arguments": d.arguments},
                }
            )
        else:
            out.append({"index": d.index, "function": {"arguments": d.arguments}})
    return out


class OpenAIAnswer:
    """One request's answer, whole (``whole``) or as server-sent events' data
    (``opening``, ``chunk``, ``closing``: dicts, and the final "[DONE]").
    ``head()`` is asked for each answer or event, as it is sent."""

    def __init__(self, req: GenRequest, head: Callable[[], Head]):
        self.chat = req.is_chat
        self.include_usage = req.include_usage
        self.head = head
        self.kind = "chat.completion" if self.chat else "text_completion"

    def envelope(self, chunk: bool = False) -> dict:
        head = self.head()
        return {
            "id": ("chatcmpl-" if self.chat else "cmpl-") + head.request_id,
            "object": self.kind + (".chunk" if chunk and self.chat else ""),
            "created": head.created,
            "model": head.model,
            "system_fingerprint": FINGERPRINT,
        }

    def whole(self, done: Done) -> dict:
        reply = self.envelope()
        if self.chat:
            message = assistant_message(done)
            thought = message.pop("reasoning", "")
            if thought:
                message["reasoning_content"] = thought  # (llama-server's and DeepSeek's field)
            if done.tool_calls:
                message["content"] = done.text or None
            choice = {"index": 0, "message": message, "logprobs": None}
        else:
            choice = {"index": 0, "text": done.text, "logprobs": None}
        choice["finish_reason"] = finish_reason(done.finish_reason)
        reply["choices"] = [choice]
        reply["usage"] = usage(done)
        return reply

    def _event(self, delta: Optional[str], finish: Optional[str] = None, role: bool = False) -> dict:
        e = self.envelope(chunk=True)
        if self.chat:
            d: dict = (
                {"role": "assistant", "content": ""} if role else ({"content": delta} if delta is not None else {})
            )
            e["choices"] = [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]
        else:
            e["choices"] = [{"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}]
        return e

    def opening(self) -> list[dict]:
        return [self._event(None, role=True)] if self.chat else []

    def chunk(self, chunk: Chunk) -> list[dict]:
        if chunk.progress is not None:  # (return_progress) as llama-server sends it: a delta with no content
            e = self._event(None, role=True)
            if self.chat:
                e["choices"][0]["delta"]["content"] = None
            e["prompt_progress"] = prompt_progress(chunk.progress)
            return [e]
        out = []
        if self.chat and chunk.reasoning:
            e = self._event(None)
            e["choices"][0]["delta"] = {"reasoning_content": chunk.reasoning}
            out.append(e)
        if chunk.text:
            out.append(self._event(chunk.text))
        if self.chat and chunk.tool_calls:
            e = self.envelope(chunk=True)
            delta = {"tool_calls": call_deltas(chunk.tool_calls)}
            e["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]
            out.append(e)
        return out

    def closing(self, done: Done) -> list[Union[dict, str]]:
        out: list[Union[dict, str]] = [self._event(None, finish=finish_reason(done.finish_reason))]
        if self.include_usage:
            e = self.envelope(chunk=True)
            e["choices"] = []
            e["usage"] = usage(done)
            out.append(e)
        return out + ["[DONE]"]


# ------------------------------------------------------------------- answers (the HTTP side: server.py, exchange.py)


async def model_entry(ex: "Exchange") -> dict:
    """/v1/models' entry for the daemon's model, as it is now (while it loads: a context length of 0)."""
    hello = await ex.hello(wait=False)
    return {"id": hello.model, "object": "model", "created": 0, "owned_by": "tandem", "context_length": hello.n_ctx}


async def models(ex: "Exchange") -> None:
    ex.send_json(HTTPStatus.OK, {"object": "list", "data": [await model_entry(ex)]})


async def model(ex: "Exchange", name: str) -> None:
    entry = await model_entry(ex)
    if name not in (entry["id"], "tandem"):  # (chat takes model "tandem" too)
        raise ApiError(HTTPStatus.NOT_FOUND, f"no model {name!r}; this daemon serves {entry['id']!r}", param="model")
    ex.send_json(HTTPStatus.OK, entry)


def _events(data: list) -> list[bytes]:
    return [sse(d) for d in data]


async def generate(ex: "Exchange", req: GenRequest) -> None:
    """/v1/completions and /v1/chat/completions: one daemon request, answered whole or as server-sent events."""
    await ex.hello()  # (a model that is loading: waited for)
    answer = OpenAIAnswer(req, lambda: Head(ex.request_id, ex.server.model, int(time.time())))
    if not req.stream:
        ex.send_json(HTTPStatus.OK, answer.whole(await ex.run_to_done(req.start)))
        return
    await ex.relay(
        req.start,
        "text/event-stream",
        opening=lambda: _events(answer.opening()),
        each=lambda chunk: _events(answer.chunk(chunk)),
        closing=lambda done: _events(answer.closing(done)),
        failing=lambda exc: [sse(exc.body()), sse("[DONE]")],
    )


async def tokens(ex: "Exchange", path: str, body: dict) -> None:
    """llama-server's /tokenize and /detokenize; /v1/tokenize: an OpenAI-style
    request's prompt or messages (and tools) counted as generate would read them."""
    async with ex.daemon() as client:
        if path == "/detokenize":
            ids = read(body, "tokens", (list,), [])
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise bad_request("'tokens' must be an array of integers", param="tokens")
            return ex.send_json(HTTPStatus.OK, {"content": await client.detokenize(ids)})
        if path == "/tokenize":
            content = read(body, "content", (str,))
            if content is None:
                raise bad_request("'content' (the text) is required", param="content")
            pieces = bool(read(body, "with_pieces", (bool,), False))
            reply = await client.tokenize(
                content,
                add_special=bool(read(body, "add_special", (bool,), False)),
                parse_special=bool(read(body, "parse_special", (bool,), True)),
                with_pieces=pieces,
            )
            if pieces:
                out = [{"id": t, "piece": p} for t, p in zip(reply.tokens, reply.pieces)]
                return ex.send_json(HTTPStatus.OK, {"tokens": out})
            return ex.send_json(HTTPStatus.OK, {"tokens": reply.tokens})
        if body.get("messages") is not None:
            req = GenRequest(messages=chat_messages(body), tools=_tools(body))
            _reasoning(body, req)  # (a reasoning model's template renders thinking on and off apart)
            reply = await client.tokenize(messages=req.messages, **counted(req.daemon_params()))
        else:
            prompt = read(body, "prompt", (str,))
            if prompt is None:
                raise bad_request("give 'prompt' or 'messages'", param="prompt")
            reply = await client.tokenize(prompt, parse_special=True)
        ex.send_json(HTTPStatus.OK, {"tokens": reply.tokens, "count": len(reply.tokens), "model": ex.server.model})
