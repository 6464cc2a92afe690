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

``parse_messages`` makes the GenRequest (translate.py), ``whole_message`` and
``MessageEvents`` render the daemon's result back, and the async handlers around
them do the I/O.
"""

from __future__ import annotations

import logging
import secrets
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Optional

from tandem.client.core import uncounted
from tandem.protocol import Chunk, Done, FinishReason

from .answers import sse
from .translate import (
    GenRequest,
    Sampling,
    ToolUse,
    arguments_object,
    bad_request,
    function_tool,
    history_call,
    json_text,
    read,
)
from .translate import effort as effort_of

if TYPE_CHECKING:
    from .exchange import Exchange

NUMBER = "{key}: a number is required"

log = logging.getLogger("tandem.bridge")


# --------------------------------------------------------------------------- request translation


def _text_of(content: Any, where: str, references: bool = False) -> str:
    """A string, or text blocks joined (tool results carry either). A ``tool_reference`` block
    (Claude Code's tool search answers with them: the tool it names may now be called) is a line
    naming the tool: every tool a request declares is shown to the model whole anyway."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if references and kind == "tool_reference" and isinstance(block.get("tool_name"), str):
                parts.append(f"Tool available: {block['tool_name']}\n")
                continue
            if not (kind == "text" and isinstance(block.get("text"), str)):
                raise bad_request(f"{where}[{j}] must be a text block here")
            parts.append(block["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise bad_request(f"{where} must be a string or an array of text blocks")


BILLING_HEADER = "x-anthropic-billing-header:"  # Claude Code's first system block: billing metadata, not instructions


def _system_text(system: Any, where: str) -> str:
    """The top-level ``system`` (a string or text blocks) without Claude Code's billing header block
    (``x-anthropic-billing-header: cc_version=…; cc_entrypoint=…;``): it is addressed to Anthropic's
    billing, says nothing to the model, and its value changes between sessions, so rendered first it
    would change every prompt from its first token and no cached prefix would ever match."""
    if isinstance(system, list):
        kept = [b for b in system if not (isinstance(b, dict) and str(b.get("text", "")).startswith(BILLING_HEADER))]
        if len(kept) < len(system):
            log.debug("the billing header block of system is left out of the prompt")
        system = kept
    return _text_of(system, where)


def chat_messages(body: dict) -> list[dict]:
    """Anthropic's system + messages as the daemon's chat messages (tool_use and
    tool_result blocks become assistant tool calls and tool messages). A ``system``
    message inside ``messages`` (Claude Code sends its environment so) stays where it
    is: moved to the front it would change the prompt's prefix."""
    out: list[dict] = []
    system = body.get("system")
    if system:
        text = _system_text(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages: an array of {role, content} is required")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise bad_request(f"messages.{i}.role must be 'user', 'assistant' or 'system'")
        content = m.get("content")
        if m["role"] == "system":  # (a string or text blocks; none: nothing to render)
            text = _text_of(content, f"messages.{i}.content")
            if text:
                out.append({"role": "system", "content": text})
            continue
        if isinstance(content, str):
            out.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(f"messages.{i}.content must be a string or an array of blocks")
        text, calls, thought = [], [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            where = f"messages.{i}.content.{j}"
            if kind == "text":
                text.append(_text_of([block], where))
            elif kind == "tool_use" and m["role"] == "assistant":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise bad_request(f"{where}: a tool_use block needs 'id' and 'name'")
                calls.append(history_call(block["id"], block["name"], json_text(block.get("input") or {})))
            elif kind == "tool_result" and m["role"] == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise bad_request(f"{where}: a tool_result block needs 'tool_use_id'")
                result = _text_of(block.get("content"), f"{where}.content", references=True)
                if block.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
            elif kind in ("image", "document"):
                raise bad_request(f"{where}: tandem's models read text only ({kind} blocks)")
            elif kind == "thinking" and m["role"] == "assistant":
                if isinstance(block.get("thinking"), str):
                    thought.append(block["thinking"])  # (sent back: the templates that show it get it)
            elif kind in ("thinking", "redacted_thinking"):
                continue  # (redacted: Anthropic's encrypted reasoning, which no local model wrote)
            else:
                raise bad_request(f"{where}: block type {kind!r} is not supported here")
        if text or calls:
            msg: dict[str, Any] = {"role": m["role"], "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            if thought:
                msg["reasoning"] = "".join(thought)
            out.append(msg)
    return out


THINKING = ("enabled", "adaptive", "disabled")


def reasoning_controls(body: dict, req: Optional[GenRequest] = None) -> None:
    """``thinking`` (enabled with ``budget_tokens``: thinking on with that budget; disabled: off; adaptive: the
    model's default), ``output_config.effort`` (low, medium, high, max) and ``context_management``, as Claude
    Code sends them: checked for shape, and set on ``req`` for a reasoning model (a model that does not think
    ignores them; context_management is the client's)."""
    thinking = body.get("thinking")
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in THINKING:
            raise bad_request("thinking.type must be enabled, adaptive or disabled")
        budget = thinking.get("budget_tokens")
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
            raise bad_request("thinking.budget_tokens must be a non-negative integer")
    for key in ("output_config", "context_management"):
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise bad_request(f"{key} must be an object")
    effort = (body.get("output_config") or {}).get("effort")
    if effort is not None and not isinstance(effort, str):
        raise bad_request("output_config.effort must be a string")
    if req is None:
        return
    if thinking is not None and thinking["type"] != "adaptive":
        req.think = thinking["type"] == "enabled"
        if req.think and thinking.get("budget_tokens") is not None:
            req.max_thinking_tokens = thinking["budget_tokens"]
    if effort is not None:
        think, req.reasoning_effort = effort_of(effort)
        if think is not None:
            req.think = think


def tool_use(body: dict) -> Optional[ToolUse]:
    """``tools`` (``input_schema``) and ``tool_choice`` as the daemon takes them."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if not tools:
        if isinstance(choice, dict) and choice.get("type") in ("any", "tool"):
            raise bad_request("tool_choice asks for a tool, but no tools are given")
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be an array")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise bad_request(f"tools.{i}: a tool needs 'name' and 'input_schema'")
        if tool.get("type") not in (None, "custom"):
            raise bad_request(f"tools.{i}: server tools ({tool['type']}) are not available here")
        fn = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
        if tool.get("description"):
            fn["description"] = tool["description"]
        out.append(function_tool(fn))
    use = ToolUse(out)
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "tool":
            use.choice = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in ("auto", "any", "none"):
            use.choice = {"auto": "auto", "any": "required", "none": "none"}[kind]
        else:
            raise bad_request("tool_choice.type must be auto, any, tool or none")
        if choice.get("disable_parallel_tool_use"):
            use.parallel = False
    return use


def _sampling(body: dict, n_ctx: int) -> Sampling:
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise bad_request("max_tokens: a positive integer is required")
    stop = body.get("stop_sequences") or []
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad_request("stop_sequences must be an array of strings")
    temperature = read(body, "temperature", (int, float), 1.0, message=NUMBER, param=False)  # 1: Anthropic's default
    top_p = read(body, "top_p", (int, float), message=NUMBER, param=False)
    return Sampling(
        max_tokens=min(max_tokens, n_ctx),  # a cap, as in the API (agents send 32k+): the context ends a reply first
        temperature=float(temperature),
        top_p=None if top_p is None else float(top_p),
        top_k=read(body, "top_k", (int,), message=NUMBER, param=False),
        stop=stop,
    ).normalised()


def parse_messages(body: dict, n_ctx: int) -> GenRequest:
    """``/v1/messages`` for a daemon of ``n_ctx`` tokens."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model: the name of the model is required (any name: one is served)")
    messages = chat_messages(body)
    sampling = _sampling(body, n_ctx)
    tools = tool_use(body)
    stream = bool(body.get("stream", False))
    req = GenRequest(messages=messages, sampling=sampling, tools=tools, model=model, stream=stream)
    reasoning_controls(body, req)
    return req


# --------------------------------------------------------------------------- rendering the result


def content_blocks(done: Done) -> list[dict]:
    """The reply's content: its thinking, its text (an empty one when there is nothing else), then its calls."""
    blocks: list[dict] = []
    if done.reasoning:  # (no signature: nothing of Anthropic's to verify; sent back, it is shown to the model again)
        blocks.append({"type": "thinking", "thinking": done.reasoning, "signature": ""})
    if done.text or not done.tool_calls:
        blocks.append({"type": "text", "text": done.text})
    for call in done.tool_calls:
        input_ = arguments_object(call.function.arguments)
        blocks.append({"type": "tool_use", "id": call.id, "name": call.function.name, "input": input_})
    return blocks


def stop_reason(done: Done) -> tuple[str, Optional[str]]:
    """``stop_reason`` and ``stop_sequence``."""
    if done.finish_reason == FinishReason.TOOL_CALLS:
        return "tool_use", None
    if done.finish_reason == FinishReason.LENGTH:
        return "max_tokens", None
    if done.stop_sequence is not None:
        return "stop_sequence", done.stop_sequence
    return "end_turn", None


def usage(done: Done) -> dict:
    u = done.usage
    return {
        "input_tokens": u.prompt_tokens - u.cached_tokens,
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def whole_message(done: Done, msg_id: str, model: str) -> dict:
    reason, seq = stop_reason(done)
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(done),
        "stop_reason": reason,
        "stop_sequence": seq,
        "usage": usage(done),
    }


class MessageEvents:
    """Anthropic's streamed event sequence for one message: (event name, data) pairs."""

    def __init__(self, msg_id: str, model: str):
        self.msg_id, self.model = msg_id, model
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
        out = []
        if self.kind == "thinking":  # (a thinking block ends with its signature, as Anthropic's: none here)
            out.append(self._delta({"type": "signature_delta", "signature": ""}))
        self.kind = ""
        return out + [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _open(self, block: dict) -> list[tuple[str, dict]]:
        out = self._close()
        self.index += 1
        self.kind = block["type"]
        out.append(
            ("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})
        )
        return out

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return ("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def chunk(self, chunk: Chunk) -> list[tuple[str, dict]]:
        out: list[tuple[str, dict]] = []
        if chunk.reasoning:
            if self.kind != "thinking":
                out += self._open({"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": chunk.reasoning}))
        if chunk.text:
            if self.kind != "text":
                out += self._open({"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": chunk.text}))
        for d in chunk.tool_calls or []:
            if d.id is not None:  # a new call
                out += self._open({"type": "tool_use", "id": d.id, "name": d.name, "input": {}})
            if d.arguments:
                out.append(self._delta({"type": "input_json_delta", "partial_json": d.arguments}))
        return out

    def finish(self, done: Done) -> list[tuple[str, dict]]:
        out = []
        if self.index < 0:  # nothing was produced: still one (empty) text block
            out += self._open({"type": "text", "text": ""})
        out += self._close()
        reason, seq = stop_reason(done)
        delta = {"stop_reason": reason, "stop_sequence": seq}
        # (input_tokens too: they are known only now)
        out.append(("message_delta", {"type": "message_delta", "delta": delta, "usage": usage(done)}))
        out.append(("message_stop", {"type": "message_stop"}))
        return out


# --------------------------------------------------------------------------- the handlers


async def messages(ex: "Exchange", body: dict) -> None:
    hello = await ex.hello()
    req = parse_messages(body, hello.n_ctx)
    msg_id = "msg_" + secrets.token_hex(12)
    if not req.stream:
        ex.send_json(HTTPStatus.OK, whole_message(await ex.run_to_done(req.start), msg_id, req.model))
        return
    events = MessageEvents(msg_id, req.model)
    prompt_tokens = await _prompt_tokens(ex, req)  # message_start carries them, as Anthropic's

    def out(pairs) -> list[bytes]:
        return [sse(data, event=name) for name, data in pairs]

    await ex.relay(
        req.start,
        "text/event-stream",
        opening=lambda: out(events.start(prompt_tokens)),
        each=lambda chunk: out(events.chunk(chunk)),
        closing=lambda done: out(events.finish(done)),
        failing=lambda exc: out([("error", exc.body("anthropic"))]),
        keepalive=lambda: out([("ping", {"type": "ping"})]),  # (Anthropic's own keep-alive event)
    )


async def count_tokens(ex: "Exchange", body: dict) -> None:
    """``/v1/messages/count_tokens``: the prompt's tokens, as the daemon renders and reads it."""
    await ex.hello()  # (a model that is loading: waited for)
    req = GenRequest(messages=chat_messages(body), tools=tool_use(body))
    reasoning_controls(body, req)  # (a reasoning model's template renders thinking on and off apart)
    ex.send_json(HTTPStatus.OK, {"input_tokens": await _prompt_tokens(ex, req)})


async def _prompt_tokens(ex: "Exchange", req: GenRequest) -> int:
    """The prompt's tokens as generate renders it (tools and tool_choice, and the reasoning controls).
    A daemon older than 1.12 counts without tool_choice and the reasoning controls (the client refuses
    to ask it with them): a count a few tokens off, said in the log, rather than a failed request."""
    async with ex.daemon() as client:
        params = req.daemon_params()
        hello = await client.connect()
        left_out = uncounted(hello, params)
        if left_out:
            log.warning(
                "the daemon speaks protocol %d.%d: prompt tokens counted without %s; restart it from this tandem "
                "for exact counts",
                *hello.protocol_version[:2],
                ", ".join(left_out),
            )
            params = {k: v for k, v in params.items() if k not in left_out}
        return await client.count_tokens(messages=req.messages or [], **params)
