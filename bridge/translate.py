"""The bridge's one translation layer: the typed request every dialect parses
its JSON into (``GenRequest``: what to start on the daemon and how to answer),
and what the dialects share to get there and back: typed field readers that
answer a 400 naming the field, top_p 0 as greedy, stop lists, tool specs,
tool-call arguments as JSON text or objects.

A dialect module (openai_bridge.py, ollama_api.py, anthropic_api.py) is a pure
``parse_*(body) -> GenRequest``, pure renderers from the daemon's ``Done`` and
``Chunk`` (tandem.protocol: its one typed result, with ``ToolCall`` and
``ToolCallDelta``) to its own JSON, and thin async handlers around them that do
the I/O (exchange.py). Nothing here reads a socket, a clock or a file.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Awaitable, Optional

from .answers import ApiError

if TYPE_CHECKING:
    from tandem.client.aio import AsyncClient, AsyncStream
    from tandem.protocol import PromptProgress

# --------------------------------------------------------------------------- the typed request

TANDEM_KNOBS = ("draft", "draft_tokens", "cache", "ignore_eos", "max_lines", "stop_at_blank_line")
REASONING_KNOBS = ("think", "reasoning_effort", "max_thinking_tokens")  # a reasoning model's controls


@dataclass
class Sampling:
    """How tokens are chosen and when generation ends. None: the daemon's default
    (``Generate``'s, or ``Complete``'s for fill in the middle)."""

    max_tokens: Optional[int] = None
    temperature: Optional[float] = None  # 0: greedy
    top_p: Optional[float] = None
    top_k: Optional[int] = None  # 0: off
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)

    def normalised(self, negative_top_k_is_off: bool = False) -> "Sampling":
        """top_p 0, which every dialect's API allows, as greedy (the daemon's nucleus
        must hold a token); with ``negative_top_k_is_off`` (Ollama's "0 or less =
        off") a negative top_k as 0, which the daemon would refuse."""
        if self.top_p == 0.0:
            self.top_p, self.temperature = 1.0, 0.0
        if negative_top_k_is_off and self.top_k is not None and self.top_k <= 0:
            self.top_k = 0
        return self


@dataclass
class ToolUse:
    """The tools offered to the model, as the daemon takes them."""

    tools: list[dict]  # {"type": "function", "function": {"name", "description", "parameters"}} (protocol's Tool)
    choice: Any = None  # "auto", "none", "required" or {"type": "function", "function": {"name"}}; None: auto
    parallel: Optional[bool] = None  # False: at most one call per turn; None: the daemon's default (several)


@dataclass
class GenRequest:
    """One generation request as every dialect parses it: what the daemon reads
    (exactly one of ``prompt`` and ``messages``; ``prompt`` with ``suffix`` is
    fill in the middle, the daemon's ``complete`` op), how it samples, its tools
    and constraint, tandem's own knobs, and how the HTTP answer is shaped. A
    new dialect maps its JSON onto these fields and renders ``Done`` back."""

    prompt: Optional[str] = None  # plain text (no chat template); with suffix: the text before the cursor
    messages: Optional[list[dict]] = None  # chat, as the protocol's ChatMessage maps (role, content, tool_calls...)
    suffix: Optional[str] = None  # not None: fill in the middle, the text after the cursor
    sampling: Sampling = field(default_factory=Sampling)
    tools: Optional[ToolUse] = None
    response_format: Optional[dict] = None  # the protocol's ResponseFormat as a map (type, json_schema, pattern, lark)
    # tandem's own knobs (TANDEM_KNOBS; None: the daemon's default); max_lines and stop_at_blank_line: a suffix's
    draft: Optional[str] = None
    draft_tokens: Optional[int] = None
    cache: Optional[bool] = None
    ignore_eos: Optional[bool] = None
    max_lines: Optional[int] = None
    stop_at_blank_line: Optional[bool] = None
    # a reasoning model's controls (REASONING_KNOBS; None: the model's default): thinking on or off, its
    # effort (low, medium, high), its budget in tokens
    think: Optional[bool] = None
    reasoning_effort: Optional[str] = None
    max_thinking_tokens: Optional[int] = None
    # the HTTP answer (none of these reaches the daemon)
    model: str = ""  # the model the request named, where the answer echoes it (Ollama, Anthropic)
    stream: bool = False  # answer as the dialect's stream (the daemon streams chunks either way)
    include_usage: bool = False  # OpenAI's stream_options.include_usage
    progress: bool = False  # a streamed answer shows the prompt's reading (llama-server's return_progress)

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    @property
    def is_fill(self) -> bool:
        return self.suffix is not None

    def daemon_params(self) -> dict[str, Any]:
        """The daemon request's fields besides what it reads (AsyncClient.generate's
        and .infill's keyword arguments); one left out takes the daemon's default."""
        params = asdict(self.sampling)  # (its fields are the daemon's)
        if self.tools is not None:
            params.update(
                tools=self.tools.tools, tool_choice=self.tools.choice, parallel_tool_calls=self.tools.parallel
            )
        params["response_format"] = self.response_format
        params.update((knob, getattr(self, knob)) for knob in TANDEM_KNOBS)
        if self.messages is not None:
            params.update((knob, getattr(self, knob)) for knob in REASONING_KNOBS)
        if self.progress and self.stream:
            params["progress"] = True
        return {k: v for k, v in params.items() if v is not None}

    def start(self, client: "AsyncClient") -> Awaitable["AsyncStream"]:
        """Starts it on the daemon (Exchange.run_to_done and Exchange.relay take this)."""
        params = self.daemon_params()
        if self.suffix is not None:
            return client.infill(self.prompt or "", self.suffix, **params)
        if self.messages is not None:
            return client.generate(messages=self.messages, **params)
        return client.generate(prompt=self.prompt, **params)


def prompt_progress(progress: PromptProgress) -> dict:
    """llama-server's ``prompt_progress``: the prompt's tokens, those from the cache, those in the
    KV cache now, and the milliseconds since the reading began."""
    return {
        "total": progress.total,
        "cache": progress.cached,
        "processed": progress.processed,
        "time_ms": round(progress.seconds * 1000),
    }


EFFORTS = {"minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


def effort(value: str) -> tuple[Optional[bool], Optional[str]]:
    """A dialect's reasoning effort as (think, reasoning_effort): "none" turns thinking
    off; "minimal" is low and "xhigh" and "max" are high (the daemon knows low, medium
    and high, which is what gpt-oss's template takes). A word the APIs may add later
    is the model's default (as before this server knew efforts: an agent must not fail on it)."""
    if value == "none":
        return False, None
    return None, EFFORTS.get(value)


# --------------------------------------------------------------------------- reading fields

TYPE_NAMES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}
TYPE_MESSAGE = "'{key}' must be {names}, got {json:.80}"  # OpenAI's; a dialect passes its own


def bad_request(message: str, param: Optional[str] = None) -> ApiError:
    return ApiError(HTTPStatus.BAD_REQUEST, message, param=param)


def is_a(value: Any, kinds: tuple) -> bool:
    """``isinstance``, except that JSON's true and false are not numbers."""
    return isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)


def checked(value: Any, kinds: tuple, message: str = TYPE_MESSAGE, key: str = "", param: bool = True) -> Any:
    """``value`` if it is None or of ``kinds``; else a 400. ``message`` is formatted
    with ``key``, ``names`` (the kinds, "integer/number"), ``json`` (the value as
    JSON) and ``value``; with ``param`` the error names ``key`` as its param
    (OpenAI's error shape shows it)."""
    if value is None or is_a(value, kinds):
        return value
    names = "/".join(TYPE_NAMES[k] for k in kinds)
    text = message.format(key=key, names=names, json=json.dumps(value), value=value)
    raise bad_request(text, param=key if param and key else None)


def read(
    body: dict, key: str, kinds: tuple, default: Any = None, message: str = TYPE_MESSAGE, param: bool = True
) -> Any:
    """``body[key]`` if it is of ``kinds``; ``default`` if it is absent or null; else a 400."""
    value = body.get(key, default)
    if value is None:
        return default
    return checked(value, kinds, message, key, param)


def stop_list(value: Any, message: str, param: Optional[str] = None, one_string: bool = True) -> list[str]:
    """Stop strings as the daemon takes them: null is none, one string is a list
    of one (unless ``one_string`` is False), else an array of strings or a 400."""
    if value is None:
        return []
    if isinstance(value, str) and one_string:
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise bad_request(message, param)


# --------------------------------------------------------------------------- tools


def function_tool(function: dict) -> dict:
    """A function tool as the daemon takes it (a null field is an absent one)."""
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def json_text(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


def arguments_text(arguments: Any) -> str:
    """A call's arguments as JSON text, as the daemon takes them: OpenAI's shape
    sends the text, Ollama's (and some OpenAI clients) the object itself."""
    return arguments if isinstance(arguments, str) else json_text(arguments)


def arguments_object(text: str) -> Any:
    """A call's arguments, which the model wrote as JSON text, as the object the
    dialects that send objects (Ollama, Anthropic) answer with; {} if not JSON."""
    try:
        return json.loads(text or "{}")
    except ValueError:
        return {}


def history_call(call_id: str, name: str, arguments: str) -> dict:
    """A tool call of an earlier assistant turn, as the daemon's ChatMessage takes it."""
    return {"id": call_id, "function": {"name": name, "arguments": arguments}}
