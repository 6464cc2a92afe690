"""Tool calls: showing a request's ``tools`` to the model, constraining its calls, parsing them.

A model writes tool calls in the syntax its chat template taught it. The
template's source says which (``detect_format``):

- ``hermes``: the template takes ``tools`` and asks for
  ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`` (Qwen2.5, Hermes,
  and most open chat models since);
- ``llama3``: the template takes ``tools`` and the model answers with the bare
  object ``{"name": N, "parameters": {...}}`` (Llama 3.1 to 3.3);
- ``generic``: the template knows no tools (SmolLM2). tandem describes the tools
  in the system message and asks for the hermes markup, and converts tool calls
  and results in the history to text the template can show.

A ``ToolPlan`` is one request's tools. Its ``grammars`` are Lark grammars for
llguidance whose calls are the tools' JSON Schemas: with ``tool_choice``
``required`` or a named function the whole answer is constrained; with
``auto`` the model writes freely until it opens a call (the single token that
opens one, or a first token that opens a JSON object: ``CallOpener``), and
from there the call is constrained. Its ``parser`` turns the output into the
answer's text and tool calls, each streamed whole once it closes; a call that
names no tool or has no arguments object (possible only where the output was
not constrained) is text, as the model wrote it; one that was cut off
(``max_tokens``, a stop string) is not reported, and a call identical to one
already made ends the turn. The
arguments are compact JSON (``", "`` and ``": "``), exactly what the
templates' ``tojson`` writes back, so a history that re-sends the calls
renders the tokens the model generated and the prefix cache keeps hitting.
"""

from __future__ import annotations

import abc
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from tandem.protocol import ChatMessage, ErrorCode, FunctionCall, Generate, Tool, ToolCall, ToolCallDelta

from ..drafting.interfaces import RequestError
from ..worker.textstream import held_suffix
from .constraint import JSON_OPTIONS

HERMES, LLAMA3, GENERIC, HARMONY = "hermes", "llama3", "generic", "harmony"
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>")
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"

GENERIC_PROMPT = (
    "You can call these tools. Each is described by a JSON object:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a tool, answer with only this, one block per call:\n"
    '<tool_call>\n{{"name": <tool name>, "arguments": <the arguments as a JSON object>}}\n</tool_call>\n'
    "Each result comes back in <tool_response></tool_response>."
)


def detect_format(template: Optional[str]) -> str:
    """The tool-call syntax a chat template teaches its model."""
    if not template or "tools" not in template:
        return GENERIC
    if "<|channel|>" in template and "to=" in template:  # gpt-oss: a call is a commentary message to functions.NAME
        return HARMONY
    if OPEN in template:
        return HERMES
    if PYTHON_TAG in template or "ipython" in template or '"parameters"' in template:
        return LLAMA3
    return GENERIC


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def tool_dict(tool: Tool) -> dict:
    """The OpenAI shape a template's ``tools`` loop expects."""
    fn: dict[str, Any] = {"name": tool.function.name}
    if tool.function.description:
        fn["description"] = tool.function.description
    fn["parameters"] = tool.function.parameters if tool.function.parameters is not None else _NO_ARGUMENTS
    return {"type": "function", "function": fn}


def _dump(value: Any) -> str:
    """Compact JSON as the templates write it; escaped where the text would not be valid UTF-8 (a lone surrogate)."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(value)
    return text


_NO_ARGUMENTS = {"type": "object", "properties": {}}


def closed(schema: Any) -> Any:
    """``schema`` with every object that lists its properties closed to others (where it
    does not say): a call has the arguments the tool declares, as llama-server's
    grammars and OpenAI's strict mode make it, not keys a small model invents."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k in _SUBSCHEMAS else v for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    combined = any(k in out for k in _COMBINATORS)  # closing here or in a branch would change what they mean
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out and not combined:
        out["additionalProperties"] = False
    return out


_SUBSCHEMAS = ("items", "prefixItems")
_COMBINATORS = ("anyOf", "oneOf", "allOf", "not", "if", "then", "else")


def _arguments(call: ToolCall, where: str) -> Any:
    try:
        return json.loads(call.function.arguments)
    except ValueError:
        raise RequestError(
            ErrorCode.INVALID_REQUEST,
            f"{where}.function.arguments is not JSON ({call.function.arguments[:60]!r}); "
            "send back the arguments text the call came with",
        ) from None


def message_dicts(messages: Sequence[ChatMessage], fmt: str) -> list[dict]:
    """The history as the template's ``messages``. For the native formats the
    calls' arguments are objects again (the templates write them with tojson);
    for ``generic`` the calls and results become text the template can show."""
    out = []
    for i, m in enumerate(messages):
        calls = m.tool_calls or []
        if fmt == GENERIC:
            if m.role == "assistant" and calls:
                blocks = [
                    _hermes_block(c, _arguments(c, f"messages[{i}].tool_calls[{j}]")) for j, c in enumerate(calls)
                ]
                text = "\n".join(([m.content] if m.content else []) + blocks)
                out.append({"role": "assistant", "content": text})
            elif m.role == "tool":
                out.append({"role": "user", "content": f"<tool_response>\n{m.content}\n</tool_response>"})
            else:
                out.append({"role": m.role, "content": m.content})
            continue
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c, f"messages[{i}].tool_calls[{j}]")},
                }
                for j, c in enumerate(calls)
            ]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        if m.reasoning:  # Qwen3's templates read reasoning_content, gpt-oss's thinking; others neither
            d["reasoning_content"] = m.reasoning
            if not (calls and m.content):  # (gpt-oss's refuses a call turn with both: its text is the analysis then)
                d["thinking"] = m.reasoning
        out.append(d)
    return out


def _hermes_block(call: ToolCall, arguments: Any) -> str:
    return f"{OPEN}\n{_dump({'name': call.function.name, 'arguments': arguments})}\n{CLOSE}"


def with_generic_prompt(messages: list[dict], tools: Sequence[Tool]) -> list[dict]:
    """The tools described in the system message (a new one if there is none)."""
    described = "\n".join(_dump(tool_dict(t)) for t in tools)
    prompt = GENERIC_PROMPT.format(tools=described)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


@dataclass
class ToolPlan:
    """One request's tools: how the model is shown them, and what its calls may be."""

    format: str
    tools: list[Tool]
    choice: str  # "auto", "required" or a function's name ("none" never gets a plan)
    parallel: bool
    open_token: Optional[int] = None  # the single token that opens a call (hermes), when the vocabulary has one
    close_token: Optional[int] = None
    python_tag: Optional[int] = None  # llama3's <|python_tag|> token, when the vocabulary has one
    markers: dict = field(default_factory=dict)  # harmony: HARMONY_TOKENS -> their token ids

    @property
    def forced(self) -> bool:
        """The whole answer is calls (required, or a named function)."""
        return self.choice != "auto"

    @property
    def args_key(self) -> str:
        return "parameters" if self.format == LLAMA3 else "arguments"

    def call_schema(self) -> dict:
        """A call: {"name": <one of the tools>, "arguments": <that tool's parameters>}."""
        tools = [t for t in self.tools if self.choice in ("auto", "required") or t.function.name == self.choice]
        options = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    self.args_key: closed(_NO_ARGUMENTS if t.function.parameters is None else t.function.parameters),
                },
                "required": ["name", self.args_key],
                "additionalProperties": False,
            }
            for t in tools
        ]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return {**schema, "x-guidance": JSON_OPTIONS}

    def grammars(self) -> dict[str, str]:
        """Lark grammars (llguidance's dialect) of the answer, by when they start:
        ``start`` constrains it from the first token; with ``auto`` there is none, and
        ``tagged`` starts at the token that opens a call, ``bare`` at a first token
        that opens a JSON object (Qwen2.5-Coder often writes its call untagged).
        Each covers the call from its first token, the one that opened it."""
        if self.format == HARMONY:
            return {"start": self._harmony()}
        body = "body: %json " + json.dumps(self.call_schema())
        bare = f"start: body\n{body}\n"
        if self.format == LLAMA3:
            if self.forced:
                return {"start": bare}
            lazy = {"bare": bare}
            if self.python_tag is not None:
                lazy["tagged"] = f"start: <[{self.python_tag}]> body\n{body}\n"
            return lazy
        open_ = f"<[{self.open_token}]>" if self.open_token is not None else json.dumps(OPEN)
        close = f"<[{self.close_token}]>" if self.close_token is not None else json.dumps(CLOSE)
        more = ' ("\\n" call)*' if self.parallel else ""
        call = f'call: {open_} "\\n" body "\\n" {close}'
        calls = f"start: call{more}\n{call}\n{body}\n"
        if self.forced:
            return {"start": calls}
        if self.open_token is not None:
            return {"tagged": calls, "bare": bare}
        # no one token opens a call (a generic prompt to a small vocabulary): text that does not start one, or calls
        return {"start": f"start: TEXT | call{more}\nTEXT: /[^<][\\s\\S]*/\n{call}\n{body}\n"}

    def _harmony(self) -> str:
        """gpt-oss's whole reply, from its first token: its analysis messages (any text), then a final answer
        (any text; not with a forced call) or a call: ``<|channel|>commentary to=functions.NAME
        <|constrain|>json<|message|>`` and that tool's arguments (its ``<|call|>`` ends the reply)."""
        m = {text: f"<[{token}]>" for text, token in self.markers.items()}
        start, channel, message, end, constrain = (m[t] for t in HARMONY_TOKENS)
        tools = [t for t in self.tools if self.choice in ("auto", "required") or t.function.name == self.choice]
        calls, rules = [], []
        for i, t in enumerate(tools):
            schema = closed(_NO_ARGUMENTS if t.function.parameters is None else t.function.parameters)
            calls.append(f"call{i}")
            rules.append(
                f'call{i}: {json.dumps(t.function.name)} " " {constrain} "json" {message} args{i}\n'
                f"args{i}: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"
            )
        answer = "call" if self.forced else f'call | {channel} "final" {message} TEXT'
        return "\n".join(
            [
                f"start: thought* ({answer})",
                f'thought: {channel} "analysis" {message} TEXT {end} {start} "assistant"',
                f'call: {channel} "commentary to=functions." ({" | ".join(calls)})',
                "TEXT: /(?s:.*)/",
                *rules,
            ]
        )

    def parser(self) -> "ToolCallParser":
        names = {t.function.name for t in self.tools}
        if self.format == HARMONY:
            return HarmonyCallParser(names)
        return Llama3Parser(names) if self.format == LLAMA3 else HermesParser(names)


def make_plan(req: Generate, fmt: str, token_of) -> Optional[ToolPlan]:
    """The request's plan, or None when it has no tools or ``tool_choice`` is ``none``.
    ``token_of(text)`` is the single token ``text`` is in the vocabulary, or None."""
    choice = req.tool_choice_name()
    if choice is None or choice == "none":
        return None
    plan = ToolPlan(format=fmt, tools=list(req.tools or []), choice=choice, parallel=req.parallel_tool_calls)
    if fmt in (HERMES, GENERIC):
        plan.open_token, plan.close_token = token_of(OPEN), token_of(CLOSE)
        if plan.open_token is None or plan.close_token is None:
            plan.open_token = plan.close_token = None
    elif fmt == HARMONY:
        plan.markers = {text: token_of(text) for text in HARMONY_TOKENS}
        if None in plan.markers.values():  # (a template of gpt-oss's on another vocabulary: shown as text)
            plan.format = GENERIC
    else:
        plan.python_tag = token_of(PYTHON_TAG)
    return plan


FENCES = ("```json\n",)  # a code fence an answer may open its call with (small models, long prompts)
FENCE_IN_TEXT = "\n```json\n"  # one after text, on a line of its own


def fence_state(text: str) -> tuple[str, str]:
    """The start of an answer against a code fence that opens a call: ("open", what
    follows it), ("maybe", "") while the text may still become one, or ("no", "")."""
    s = text.lstrip()
    for fence in FENCES:
        if s.startswith(fence):
            return "open", s[len(fence) :]
    if any(fence.startswith(s) for fence in FENCES):
        return "maybe", ""
    return "no", ""


class CallOpener:
    """tool_choice auto: the constraint that takes over when the model opens a call,
    with the token that opened it already consumed (None: this token opens none).

    An answer that starts with a JSON code fence (```json and a newline) is a call
    too, as llama-server's parser reads one: Qwen2.5-Coder writes its calls that way
    under an agent's 10k-token system prompt. The call is constrained from the token
    after the fence, which is left out of the answer (so with tools and tool_choice
    auto, an answer cannot start with a ```json block that is not a call)."""

    def __init__(self, plan: ToolPlan, compiled: dict, piece):
        self.open_token = plan.open_token if plan.format != LLAMA3 else plan.python_tag
        self.tagged = compiled.get("tagged")
        self.bare = compiled.get("bare")
        self.piece = piece  # token -> bytes
        self.lead: Optional[str] = ""  # the answer so far while it may be opening a fence (None: it is not)

    def opens(self, token: int, first: bool):
        if token == self.open_token and self.tagged is not None:
            constraint = self.tagged
        elif first and self.bare is not None and self.piece(token).lstrip().startswith(b"{"):
            constraint = self.bare
        else:
            return self._fenced(token)
        if not constraint.valid_prefix([token]):  # e.g. '{\n': not the compact JSON of a call
            return self._fenced(token)
        constraint.consume(token)
        return constraint

    def _fenced(self, token: int):
        """The bare call's constraint, not yet consumed, once the answer has opened a code fence."""
        if self.lead is None or self.bare is None:
            return None
        self.lead += self.piece(token).decode("utf-8", errors="replace")
        state, rest = fence_state(self.lead)
        if state == "maybe":
            return None
        self.lead = None
        return self.bare if state == "open" and not rest.strip() else None


# --------------------------------------------------------------------------- parsing the output


class ToolCallParser(abc.ABC):
    """Splits the streamed output into the answer's text and tool calls; ``calls``
    holds the complete calls so far. A call is streamed whole when it closes (its
    name, id and arguments in one piece), never before: a client that adds up
    streamed pieces must not see a call that was then cut off (max_tokens, a stop
    string). ``repeated`` is set when the model closes a call identical to one it
    already made in this answer (the engine ends the turn there: a small model
    can otherwise repeat one call until max_tokens)."""

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.repeated = False

    def _add(self, call: ToolCall, deltas: list[ToolCallDelta]) -> None:
        """A complete call: reported and streamed, unless it repeats one already made (then it and
        whatever follows it are not: the turn ends at the repeat)."""
        if self.repeated:
            return
        if any(
            c.function.name == call.function.name and c.function.arguments == call.function.arguments
            for c in self.calls
        ):
            self.repeated = True
            return
        deltas.append(ToolCallDelta(len(self.calls), call.function.arguments, call.id, call.function.name))
        self.calls.append(call)

    @abc.abstractmethod
    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """More output -> (text for the answer, tool-call pieces)."""

    @abc.abstractmethod
    def finish(self, cut: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """The output ended: what was held back. ``cut``: it did not end by itself (max_tokens,
        a stop string, an error), so a call still open is not a call."""


_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class HermesParser(ToolCallParser):
    """``text <tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call> ...``: each call is
    read as it is written and streamed whole once it closes."""

    def __init__(self, names: Optional[set[str]] = None) -> None:
        super().__init__()
        self.names = names  # the tools' names (None: any); a call to another name is not a call
        self.buf = ""  # text not yet classified
        self.in_call = False
        self.bare = False  # the call is a JSON object without tags, at the start of the answer
        self.started = False  # something other than whitespace was seen
        self.held = ""  # whitespace after a call: text only if something else follows
        self.fence_open = False  # a ```json block after text is held until it closes
        self.fence = ""  # ... the fence of one that holds a tagged call (not part of the answer)
        self.dropped = ""  # the code fence left out before a call at the answer's start
        self.fence_close = False  # that call closed: its fence's closing line is not text either
        self._reset_call()

    def _reset_call(self, opened: str = "") -> None:
        self.raw = opened  # what the model wrote of this call so far: given back as text if it is not a call
        self.given = ""  # a closed call's text that was not a call, for the answer
        self.name: Optional[str] = None
        self.call_id = ""
        self.args = ""
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.args_done = False

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.buf += text
        content, deltas = "", []
        if not self.started:
            if not self.buf.strip():
                return "", []  # leading whitespace: what follows decides whether it is text
            state, rest = fence_state(self.buf)
            if state == "maybe" or (state == "open" and not rest.strip()):
                return "", []  # a code fence, perhaps: a call may follow it
            if state == "open" and rest.lstrip().startswith("{"):
                self.dropped = self.buf[: len(self.buf) - len(rest)]  # (given back if no call follows)
                self.buf = rest  # a call in a code fence: the fence is not part of the answer
            self.started = True
            if self.buf.lstrip().startswith("{"):
                self.in_call = self.bare = True
                self._reset_call(self.dropped)
        while True:
            if self.fence_close:
                s = self.buf.lstrip()
                if len(s) < 3 and "```".startswith(s):
                    return content, deltas  # (held: whitespace, or the closing fence's start)
                self.buf, self.fence_close = s.removeprefix("```"), False
            if not self.in_call:
                i = self.buf.find(OPEN)
                f = 0 if self.fence_open else self.buf.find(FENCE_IN_TEXT)
                if 0 <= f and (i < 0 or f < i or self.fence_open):  # a JSON code fence in the text: a call, or text
                    if not self.fence_open:
                        content += self._text(self.buf[: f + 1])  # (up to its line's end)
                        self.buf = self.buf[f + 1 :]
                        self.fence_open = True
                    inside = self.buf[len(FENCES[0]) :].lstrip()
                    if inside and OPEN.startswith(inside[: len(OPEN)]):  # a tagged call in the fence
                        if len(inside) < len(OPEN):
                            return content, deltas
                        self.fence = self.buf[: len(self.buf) - len(inside)]  # (given back if no call follows)
                        self.buf, self.fence_open = inside, False  # (the fence is not part of the answer)
                        continue
                    end = self.buf.find("\n```", len(FENCES[0]) - 1)
                    if end < 0:
                        return content, deltas
                    block, self.buf = self.buf[: end + 4], self.buf[end + 4 :]
                    self.fence_open = False
                    content += self._fenced_block(block, deltas)
                    continue
                if i < 0:
                    keep = held_suffix(self.buf, (OPEN, FENCE_IN_TEXT))
                    content += self._text(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep :]
                    return content, deltas
                content += self._text(self.buf[:i])
                self.held = ""
                self.buf = self.buf[i + len(OPEN) :]
                self.in_call = True
                self._reset_call(self.fence + OPEN)
                self.fence = ""
            closed = self._call_step(deltas)
            if self.given:
                content += self._text(self.given)
                self.given = ""
            if not closed:
                return content, deltas

    def _fenced_block(self, block: str, deltas: list[ToolCallDelta]) -> str:
        """A whole ```json block written after text: a call when it holds one to a tool
        (as llama-server's parser reads it; not constrained), else the text it is."""
        before = len(self.calls)
        self._whole(block[len(FENCES[0]) : -4], deltas)
        return "" if len(self.calls) > before or self.repeated else self._text(block)

    def _text(self, text: str) -> str:
        if not self.calls and not self.in_call:
            return text
        self.held += text  # after a call: only whitespace so far, or real text
        if self.held.strip():
            text, self.held = self.held, ""
            return text
        return ""

    def _call_step(self, deltas: list[ToolCallDelta]) -> bool:
        """Advance inside a call; True when the call closed (the loop goes on)."""
        if self.name is None:
            m = _HEAD.match(self.buf)
            if m is not None and m.end() == len(self.buf):
                m = None  # more space may follow the colon: wait for the value's first character
            if m is None:
                close = self.buf.find(CLOSE) if not self.bare else -1
                if close >= 0:  # a call in another shape (unconstrained): parse it whole
                    text = self.buf[: close + len(CLOSE)]
                    self.buf = self.buf[close + len(CLOSE) :]
                    self.in_call = False
                    if not self._whole(text[:close], deltas):
                        self.given = self.raw + text
                    return True
                return False
            try:
                self.name = json.loads(f'"{m.group(1)}"')
            except ValueError:
                self.name = m.group(1)  # not a valid JSON string; it will not match a tool's name
            self.call_id = new_call_id()
            self.raw += self.buf[: m.end()]
            self.buf = self.buf[m.end() :]
        if not self.args_done:
            n = self._scan(self.buf)
            piece, self.buf = self.buf[:n], self.buf[n:]
            self.args += piece
            self.raw += piece
            if not self.args_done:
                return False
        end, word = (self.buf.find("}"), "}") if self.bare else (self.buf.find(CLOSE), CLOSE)
        if end < 0:
            return False
        self.raw += self.buf[: end + len(word)]
        self.buf = self.buf[end + len(word) :]
        bare, self.in_call, self.bare = self.bare, False, False
        if self._close(deltas):
            self.fence_close = bare and bool(self.dropped)  # the fence it was written in may close next
        else:
            self.given = self.raw
        return True

    def _close(self, deltas: list[ToolCallDelta]) -> bool:
        """A closed call is reported if it calls a tool with an arguments object; unconstrained
        output may not (a string for arguments, a name that is no tool's), and it is then the
        answer's text, as the model wrote it (as llama-server gives back a call it cannot parse):
        False."""
        try:
            args = json.loads(self.args)
        except (ValueError, RecursionError):
            args = None
        if isinstance(args, dict) and (self.names is None or self.name in self.names):
            self._add(ToolCall(id=self.call_id, function=FunctionCall(self.name, self.args)), deltas)
            return True
        return False

    def _scan(self, text: str) -> int:
        """How much of ``text`` belongs to the arguments value (a JSON object)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:  # a string, not an object: it stands for itself (not a call)
                        self.args_done = True
                        return i + 1
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.args_done = True
                    return i + 1
            elif self.depth == 0 and not ch.isspace():
                self.args_done = True  # not an object: a scalar stands for itself, up to the comma or brace
                return i
        return len(text)

    def _whole(self, text: str, deltas: list[ToolCallDelta]) -> bool:
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):
            obj = None
        name = obj.get("name") if isinstance(obj, dict) else None
        if (
            isinstance(name, str)
            and (self.names is None or name in self.names)
            and isinstance(obj.get("arguments"), dict)
        ):
            self._add(ToolCall(new_call_id(), FunctionCall(name, _dump(obj["arguments"]))), deltas)
            return True
        return False

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = "", []
        if self.in_call:
            if cut:  # cut off (max_tokens, a stop string) before the model closed it: not a call, none of it
                if self.bare and self.name is None:  # streamed; held JSON at the start of the answer is text
                    content = self.dropped + self.buf
            else:  # the model ended without the closing tag: a call if what it wrote is one, else text
                if self.name is not None:
                    called = self.args_done and self._close(deltas)
                else:
                    called = self._whole(self.buf, deltas)
                if not called:
                    content = self._text(self.raw + self.buf)  # (an answer that is JSON, not a call)
        elif not self.started:
            content = self.buf  # only whitespace
        elif self.fence_open:  # a code fence the output never closed
            before = len(self.calls)
            if not cut:
                self._whole(self.buf[len(FENCES[0]) - 1 :], deltas)
            content = "" if len(self.calls) > before or self.repeated else self._text(self.buf)
        elif self.buf:
            content = self._text(self.buf)
        self.buf = ""
        return content, deltas


class Llama3Parser(ToolCallParser):
    """The answer is either text or one bare ``{"name": N, "parameters": {...}}``: an answer
    that starts with ``{`` is held until it ends, then parsed."""

    def __init__(self, names: set[str]):
        super().__init__()
        self.names = names
        self.buf = ""
        self.holding: Optional[bool] = None  # None: nothing but whitespace seen yet
        self.dropped = ""  # the code fence left out before a call (given back if it is not one)

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if self.holding is False:
            return text, []
        self.buf += text
        start = self.buf.lstrip()
        if not start:
            return "", []
        state, rest = fence_state(self.buf)
        if state == "maybe" or (state == "open" and not rest.strip()):
            return "", []  # a code fence, perhaps: a call may follow it
        if state == "open" and rest.lstrip().startswith("{"):
            self.dropped = self.buf[: len(self.buf) - len(rest.lstrip())]
            self.buf = start = rest.lstrip()  # a call in a code fence: the fence is not part of the answer
        self.holding = start.startswith("{")
        if self.holding:
            return "", []
        text, self.buf = self.buf, ""
        return text, []

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCallDelta]]:
        text, self.buf = self.buf, ""
        body = text.rstrip().removesuffix("```") if self.dropped else text  # (a closed fence)
        try:
            obj = json.loads(body) if self.holding and not cut else None
        except (ValueError, RecursionError):
            obj = None
        args = obj.get("parameters", obj.get("arguments")) if isinstance(obj, dict) else None
        if isinstance(obj, dict) and obj.get("name") in self.names and isinstance(args, dict):
            deltas: list[ToolCallDelta] = []
            self._add(ToolCall(new_call_id(), FunctionCall(obj["name"], _dump(args))), deltas)
            return "", deltas
        return self.dropped + text, []


class HarmonyCallParser(ToolCallParser):
    """gpt-oss's calls: the reasoning splitter (models/reasoning.HarmonySplitter) keeps a
    commentary message to ``functions.NAME`` out of the answer and hands over its name and
    arguments (``call``) once the reply ends there (its ``<|call|>`` ends generation)."""

    def __init__(self, names: set[str]) -> None:
        super().__init__()
        self.names = names
        self.pending: Optional[tuple[str, str]] = None  # (name, arguments) of the call the reply ended with

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        return text, []

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCallDelta]]:
        deltas: list[ToolCallDelta] = []
        if self.pending is not None and not cut and self.pending[0] in self.names:
            name, arguments = self.pending
            self._add(ToolCall(id=new_call_id(), function=FunctionCall(name, arguments)), deltas)
        return "", deltas
