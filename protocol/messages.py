"""Every message that crosses a process boundary in tandem, and nothing else.

Keep this file focused on message definitions: the op enum (its values are the
first frame's bytes), the finish-reason enum, the numbered error codes, and one
typed dataclass per message. ``codec.py`` turns them into frames and back.
PROTOCOL.md documents the same shapes for client authors in other languages.

Direction matters: a client sends requests (hello, generate, complete, cancel,
status, shutdown, cache_clear); the daemon answers with replies. A reply to hello/status/cancel/
shutdown carries the same op name as the request. The messages between the
daemon's own processes (front, target worker, drafter worker) are defined in
``internal.py``; their ops share the ``Op`` enum, so no frame is ambiguous.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

PROTOCOL_VERSION: tuple[int, int] = (1, 12)
"""(major, minor). A client whose major differs is refused; minors are compatible:
receivers ignore fields they do not know and fill missing optional fields with
their defaults. 1.12 added ``tool_choice`` and the reasoning controls on ``tokenize``
(an older daemon would count without them: the client refuses to send them to one). 1.11 added
``status.within``. 1.10 added ``ModelInfo.cpu_kernels``. 1.9 added
``timings.paused_seconds`` (the short-request lane). 1.8 added the embed op
and reasoning (thinking) fields. 1.1 added tools and
tool calls: a client refuses to send tools to a 1.0 daemon, which would ignore them. 1.2 added
``done.drafter_died`` (a drafter's death no longer fails the request: DRAFTER_DIED is not
sent) and ``done.stop_sequence``."""

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
"""Largest message body the daemon accepts (bytes of msgpack)."""

MAX_ID_CHARS = 128
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_MESSAGES = 4096
MAX_TOKENS_LIMIT = 1 << 20
MAX_DRAFT_TOKENS = 16
MAX_LINES = 10_000
PROGRESS_SECONDS = 1.0  # a progress request's prompt progress, at most this often while its prompt is read
MAX_TOOLS = 128
MAX_NESTING = 64  # maps and lists inside a schema, a tool's parameters or tool_choice
MAX_TOOL_NAME_CHARS = 64
REASONING_EFFORTS = ("low", "medium", "high")
TOOL_CHOICES = ("none", "auto", "required")
DRAFT_MODES = ("auto", "on", "off")
MAX_EMBED_INPUTS = 256  # texts (or token lists) in one embed request
EMBED_FIX = (
    "Start the daemon with one: tandem serve --embedding-model MODEL (a preset such as qwen2.5-coder-0.5b, "
    "hf.co/ORG/REPO[:QUANT] or the path of a .gguf file)"
)
FIM_FIX = (
    "Serve a code model that has them (tandem serve --model qwen2.5-coder-1.5b), "
    "or send 'generate' with the text before the cursor as 'prompt'."
)


class Op(str, enum.Enum):
    """The first frame of every message is ``Op.value`` encoded as ASCII."""

    HELLO = "hello"
    GENERATE = "generate"
    COMPLETE = "complete"  # fill in the middle: code between a prefix and a suffix
    CANCEL = "cancel"
    STATUS = "status"
    SHUTDOWN = "shutdown"
    CACHE_CLEAR = "cache_clear"
    CHUNK = "chunk"
    DONE = "done"
    ERROR = "error"
    BUSY = "busy"
    READY = "ready"  # internal: worker -> daemon
    PROGRESS = "progress"  # internal: target worker -> daemon, at least every second of a request's work
    DRAFTER_STATE = "drafter_state"  # internal: daemon -> target worker, the drafter went away or came back
    DRAFTER_HUNG = "drafter_hung"  # internal: target worker -> daemon, the drafter stopped answering
    CACHE_STATE = "cache_state"  # internal: target worker -> daemon, the prefix cache after work between requests
    TOKENIZE = "tokenize"  # text, or messages as the chat template renders them -> token ids
    DETOKENIZE = "detokenize"  # token ids -> text
    DRAFT = "draft"  # internal: target worker -> drafter worker
    DRAFTED = "drafted"  # internal: drafter worker -> target worker
    EMBED = "embed"  # texts (or token ids) -> embedding vectors, from the embedding model (1.8)
    PACE = "pace"  # internal: daemon -> embedding worker, a generation started or ended


class FinishReason(str, enum.Enum):
    STOP = "stop"  # the model ended its turn (end-of-generation token) or a stop string matched
    LENGTH = "length"  # max_tokens reached, or the context is full
    CANCELLED = "cancelled"  # a cancel request, the client going away, or daemon shutdown
    TOOL_CALLS = "tool_calls"  # the model called tools (done.tool_calls) and ended its turn


class ErrorCode(enum.IntEnum):
    """Numbered error codes. 1xx: the request is at fault (do not retry it as is).
    2xx: the daemon could not serve it (retrying later may work)."""

    MALFORMED_MESSAGE = 100  # wrong frame count, not msgpack, body not a map
    UNKNOWN_OP = 101  # first frame is not a known request op
    INVALID_REQUEST = 102  # a field is missing, has the wrong type or is out of range
    UNSUPPORTED_VERSION = 103  # hello with a protocol major version the daemon does not speak
    DUPLICATE_REQUEST_ID = 104  # a request with this id is already queued or running
    PROMPT_TOO_LONG = 105  # prompt tokens do not fit the context (--ctx-size)
    MESSAGE_TOO_LARGE = 106  # body over MAX_MESSAGE_BYTES
    CHAT_TEMPLATE = 107  # messages given but the model has no usable chat template
    FIM_UNSUPPORTED = 108  # complete sent but the model has no fill-in-the-middle tokens
    BAD_CONSTRAINT = 109  # response_format does not compile (bad schema, regex or grammar)
    NO_EMBEDDING_MODEL = 110  # embed sent but the daemon serves no embedding model (--embedding-model)
    INTERNAL = 200  # a bug: the message says what failed
    WORKER_DIED = 201  # the model worker process died during the request; it is restarted
    SHUTTING_DOWN = 202  # the daemon is stopping
    CLIENT_TOO_SLOW = 203  # the client stopped reading and its send queue overflowed
    NOT_READY = 204  # the model is not loaded (yet, or it failed to load)
    # the drafter worker died or hung during the request; it is restarted (or drafting is switched off)
    DRAFTER_DIED = 205


class Message:
    """Base class: every message has an op and a request ``id``."""

    op: ClassVar[Op]
    id: str


@dataclass
class FunctionCall:
    name: str
    arguments: str  # the arguments object as JSON text, exactly as the model wrote it


@dataclass
class ToolCall:
    """A call the model made (OpenAI's shape): in ``done.tool_calls``, and in an
    assistant message of the history when it is sent back."""

    id: str  # "call_..." (made by the daemon); a tool message answers it by tool_call_id
    function: FunctionCall
    type: str = "function"


@dataclass
class ChatMessage:
    role: str  # "system", "user", "assistant", "tool" (whatever the model's template knows)
    content: str = ""
    tool_calls: Optional[list[ToolCall]] = None  # assistant: the calls it made
    tool_call_id: Optional[str] = None  # tool: which call this is the result of
    name: Optional[str] = None  # tool: the function's name (some templates show it)
    # assistant: the thinking that came before this reply (done.reasoning), sent back for templates
    # that show it (gpt-oss on tool-call turns, Qwen3 within a tool loop); others drop it: 1.8
    reasoning: Optional[str] = None


@dataclass
class FunctionSpec:
    name: str  # letters, digits, '_' and '-', at most 64 characters
    description: str = ""
    parameters: Optional[dict[str, Any]] = None  # a JSON Schema of the arguments object; None = no arguments
    strict: Optional[bool] = None  # accepted for OpenAI's shape; calls are always constrained to the schema


@dataclass
class Tool:
    """A tool the model may call (OpenAI's function-tool shape)."""

    function: FunctionSpec
    type: str = "function"


@dataclass
class ToolCallDelta:
    """A tool call as streamed (in ``chunk.tool_calls``): since protocol 1.5 one delta per
    call, with its ``id``, ``name`` and whole ``arguments``, once the model closed it."""

    index: int  # the call's place in done.tool_calls (0, 1, ...)
    arguments: str = ""
    id: Optional[str] = None
    name: Optional[str] = None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = (
        0  # prompt tokens not prefilled: restored from pages, or kept in the KV from the request before
    )
    reasoning_tokens: int = 0  # of completion_tokens, those the model thought in (1.8)


@dataclass
class Timings:
    time_to_first_token_seconds: float  # request start (dequeued) to first generated token
    prompt_seconds: float  # tokenizing and prefilling the prompt
    generation_seconds: float  # first generated token to the last
    tokens_per_second: float  # completion tokens after the first / generation_seconds
    queued_seconds: float  # waiting in the queue before the worker served it (the lane: and in the worker)
    # seconds it waited while short requests were served (the lane): in its prompt's reading (of
    # prompt_seconds) and between its steps (of generation_seconds; tokens_per_second leaves those out): 1.9
    paused_seconds: float = 0.0


# --------------------------------------------------------------------------- requests


@dataclass
class Hello(Message):
    op: ClassVar[Op] = Op.HELLO
    id: str
    protocol_version: list[int]
    client_name: str = ""

    def check(self) -> None:
        if len(self.protocol_version) != 2:
            raise ValueError("'protocol_version' must be [major, minor]")


RESPONSE_FORMATS = ("text", "json_object", "json_schema", "regex", "grammar")
MAX_CONSTRAINT_CHARS = 256 * 1024


def check_nesting(value: Any, where: str, limit: int = MAX_NESTING) -> None:
    """ValueError if maps and lists in ``value`` nest deeper than ``limit`` (no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > limit:
                raise ValueError(f"'{where}' nests maps and lists deeper than {limit} levels")
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)


@dataclass
class ResponseFormat:
    """What the output must be: ``text`` (anything), ``json_object`` (any JSON
    object), ``json_schema`` (OpenAI's shape: ``json_schema`` = {name, schema,
    strict}), ``regex`` (``pattern``) or ``grammar`` (a Lark grammar in ``lark``)."""

    type: str
    json_schema: Optional[dict[str, Any]] = None
    pattern: Optional[str] = None
    lark: Optional[str] = None

    def check(self) -> None:
        if self.type not in RESPONSE_FORMATS:
            raise ValueError(f"'response_format.type' must be one of {', '.join(RESPONSE_FORMATS)}, got {self.type!r}")
        needs = {"json_schema": "json_schema", "regex": "pattern", "grammar": "lark"}.get(self.type)
        if needs is not None and getattr(self, needs) is None:
            raise ValueError(f"'response_format' of type {self.type!r} needs '{needs}'")
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise ValueError("'response_format.json_schema' must be a map: {name, schema, strict}")
        if self.type == "json_schema" and not isinstance(self.json_schema.get("schema"), dict):
            raise ValueError("'response_format.json_schema.schema' must be a JSON Schema object")
        if self.json_schema is not None:
            check_nesting(self.json_schema, "response_format.json_schema")
        for name in ("pattern", "lark"):
            text = getattr(self, name)
            if text is not None and not isinstance(text, str):
                raise ValueError(f"'response_format.{name}' must be a string")
            if text is not None and len(text) > MAX_CONSTRAINT_CHARS:
                raise ValueError(f"'response_format.{name}' is over {MAX_CONSTRAINT_CHARS} characters")


@dataclass
class Decoding(Message):
    """What ``generate`` and ``complete`` share: how to sample, when to stop, drafting and caching."""

    id: str
    max_tokens: int = 256
    temperature: float = 0.8  # 0 = greedy
    top_k: int = 40  # 0 = off
    top_p: float = 0.95  # 1 = off
    seed: Optional[int] = None  # None = a fresh random seed
    stop: list[str] = field(default_factory=list)
    stream: bool = True  # False: no chunk messages, only the terminal one
    ignore_eos: bool = False  # keep generating past end-of-generation tokens
    draft_tokens: Optional[int] = None  # speculative draft length k; None = the daemon's; 0 = no drafting
    draft_p_min: Optional[float] = None  # stop a draft when the drafter's probability falls below; None = daemon's
    draft: str = "auto"  # "auto": the governor decides each round; "on": draft every round; "off": never
    cache: bool = True  # use the prefix cache (if the daemon has one) for this request
    response_format: Optional[ResponseFormat] = None  # constrain the output; None = any text
    # stream: True: chunks with no text and ``progress`` set while the prompt is read (at its start, about
    # every PROGRESS_SECONDS, and at its end); from 1.7, ignored by earlier daemons
    progress: bool = False

    def check(self) -> None:
        if not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise ValueError(f"'max_tokens' must be between 1 and {MAX_TOKENS_LIMIT}, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0):
            raise ValueError(f"'temperature' must be between 0 and 100, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"'top_k' must be >= 0 (0 turns it off), got {self.top_k}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"'top_p' must be in (0, 1] (1 turns it off), got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"'seed' must be between 0 and 2**64-1, got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"'stop' has {len(self.stop)} strings; the limit is {MAX_STOP_STRINGS}")
        for s in self.stop:
            if not 1 <= len(s) <= MAX_STOP_CHARS:
                raise ValueError(f"each 'stop' string must have 1 to {MAX_STOP_CHARS} characters")
        if self.draft_tokens is not None and not 0 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"'draft_tokens' must be between 0 and {MAX_DRAFT_TOKENS}, got {self.draft_tokens}")
        if self.draft_p_min is not None and not (math.isfinite(self.draft_p_min) and 0.0 <= self.draft_p_min <= 1.0):
            raise ValueError(f"'draft_p_min' must be between 0 and 1, got {self.draft_p_min}")
        if self.draft not in DRAFT_MODES:
            raise ValueError(f"'draft' must be one of {', '.join(DRAFT_MODES)}, got {self.draft!r}")
        if self.response_format is not None:
            self.response_format.check()


@dataclass
class Generate(Decoding):
    op: ClassVar[Op] = Op.GENERATE
    prompt: Optional[str] = None  # plain completion prompt (no chat template)
    messages: Optional[list[ChatMessage]] = None  # chat, rendered with the GGUF's template
    tools: Optional[list[Tool]] = None  # tools the model may call (needs messages)
    # "auto" (the default with tools): the model answers or calls; "none": it answers in text;
    # "required": it calls at least one tool; {"type": "function", "function": {"name": N}}: it calls N
    tool_choice: Any = None
    parallel_tool_calls: bool = True  # False: at most one call per turn
    # reasoning models (1.8): think False: answer without thinking (a template's enable_thinking off, or a
    # thinking budget of 0); None: the model's default. reasoning_effort: low, medium or high (gpt-oss's
    # system prompt). max_thinking_tokens: the thinking is ended (its closing tag written for the model)
    # after this many tokens; None: the daemon's --thinking-budget (by default none)
    think: Optional[bool] = None
    reasoning_effort: Optional[str] = None
    max_thinking_tokens: Optional[int] = None

    def check(self) -> None:
        if self.reasoning_effort is not None and self.reasoning_effort not in REASONING_EFFORTS:
            raise ValueError(
                f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got {self.reasoning_effort!r}"
            )
        if self.max_thinking_tokens is not None and not 0 <= self.max_thinking_tokens <= MAX_TOKENS_LIMIT:
            raise ValueError(
                f"'max_thinking_tokens' must be between 0 and {MAX_TOKENS_LIMIT}, got {self.max_thinking_tokens}"
            )
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' (plain text) or 'messages' (chat)")
        if self.messages is not None and not self.messages:
            raise ValueError("'messages' is empty: give at least one {role, content}")
        if self.messages is not None and len(self.messages) > MAX_MESSAGES:
            raise ValueError(f"'messages' has {len(self.messages)} entries; the limit is {MAX_MESSAGES}")
        self._check_tools()
        super().check()

    def tool_choice_name(self) -> Optional[str]:
        """'none', 'auto', 'required', or the one function's name; None without tools (or ``tools`` [])."""
        if not self.tools:
            return None
        choice = self.tool_choice
        if choice is None:
            return "auto"
        if isinstance(choice, str):
            return choice
        return choice["function"]["name"]

    def _check_tools(self) -> None:
        choice = self.tool_choice
        if not (choice is None or isinstance(choice, (str, dict))):
            raise ValueError(
                '\'tool_choice\' must be "none", "auto", "required" or {"type": "function", "function": {"name": '
                f"...}}}}, got {type(choice).__name__}"
            )
        check_nesting(choice, "tool_choice")
        if not self.tools:  # None or []
            if not (choice is None or choice in ("none", "auto")):
                raise ValueError("'tool_choice' names a tool choice but 'tools' is missing: give the tools too")
            return
        if self.messages is None:
            raise ValueError("'tools' needs 'messages' (chat): a plain 'prompt' has no template to show them")
        if len(self.tools) > MAX_TOOLS:
            raise ValueError(f"'tools' has {len(self.tools)} entries; the limit is {MAX_TOOLS}")
        names = set()
        for i, tool in enumerate(self.tools):
            if tool.type != "function":
                raise ValueError(f"'tools[{i}].type' must be 'function', got {tool.type!r}")
            name = tool.function.name
            if not (
                1 <= len(name) <= MAX_TOOL_NAME_CHARS and all(c.isascii() and (c.isalnum() or c in "_-") for c in name)
            ):
                raise ValueError(
                    f"'tools[{i}].function.name' must be 1 to {MAX_TOOL_NAME_CHARS} letters, digits, '_' or '-', "
                    f"got {name!r}"
                )
            if name in names:
                raise ValueError(f"'tools[{i}].function.name' {name!r} is given twice: tool names must be unique")
            names.add(name)
            params = tool.function.parameters
            if params is not None:
                check_nesting(params, f"tools[{i}].function.parameters")
                kind = params.get("type", "object")
                if not (isinstance(kind, str) and kind == "object"):
                    raise ValueError(
                        f"'tools[{i}].function.parameters' must be a JSON Schema of an object "
                        f"(type 'object'), got type {kind if isinstance(kind, str) else type(kind).__name__!r}"
                    )
        if isinstance(choice, str):
            if choice not in TOOL_CHOICES:
                raise ValueError(
                    f"'tool_choice' must be one of {', '.join(TOOL_CHOICES)} or "
                    f'{{"type": "function", "function": {{"name": ...}}}}, got {choice!r}'
                )
        elif choice is not None:
            fn = choice.get("function")
            if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
                raise ValueError(
                    '\'tool_choice\' must be "none", "auto", "required" or {"type": "function", "function": {"name": '
                    "...}}, got a map without function.name"
                )
            if fn["name"] not in names:
                raise ValueError(
                    f"'tool_choice' names the function {fn['name']!r}, which is not in 'tools' "
                    f"(they are: {', '.join(sorted(names))})"
                )


@dataclass
class Complete(Decoding):
    """Fill in the middle: the code that belongs between ``prefix`` (the text
    before the cursor) and ``suffix`` (the text after it), prompted with the
    model's own FIM tokens. Defaults suit inline completion: greedy, short,
    ending at the first blank line."""

    op: ClassVar[Op] = Op.COMPLETE
    max_tokens: int = 128
    temperature: float = 0.0
    prefix: str = field(kw_only=True)  # required; "" at the start of a file
    suffix: str = ""
    max_lines: int = 0  # stop before the (max_lines+1)-th line of the completion; 0 = no limit
    stop_at_blank_line: bool = True  # stop before a line that is empty or only spaces and tabs

    def check(self) -> None:
        if not 0 <= self.max_lines <= MAX_LINES:
            raise ValueError(f"'max_lines' must be between 0 (no limit) and {MAX_LINES}, got {self.max_lines}")
        super().check()


@dataclass
class Cancel(Message):
    op: ClassVar[Op] = Op.CANCEL
    id: str
    request_id: str  # the id of the generate request to cancel


@dataclass
class Status(Message):
    op: ClassVar[Op] = Op.STATUS
    id: str


@dataclass
class Shutdown(Message):
    op: ClassVar[Op] = Op.SHUTDOWN
    id: str


@dataclass
class CacheClear(Message):
    """Empty the prefix cache (after the running request, before the next): both
    tiers, or with ``memory_only`` the shared memory alone (the disk keeps its pages)."""

    op: ClassVar[Op] = Op.CACHE_CLEAR
    id: str
    memory_only: bool = False


@dataclass
class Tokenize(Message):
    """The token ids of ``text``, or of ``messages`` (and ``tools``) rendered by the
    model's chat template exactly as ``generate`` renders them: what a request
    would cost before it is sent. Answered between decoding steps: never queued."""

    op: ClassVar[Op] = Op.TOKENIZE
    id: str
    text: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    tools: Optional[list[Tool]] = None
    add_special: bool = True  # text only: BOS etc. as the model adds them to a prompt
    parse_special: bool = False  # text only: "<|im_start|>" written in the text is that special token
    with_pieces: bool = False  # also each token's text
    # messages only (1.12): the prompt as a generate with these renders it (Generate's fields): tool_choice
    # none renders no tools, and a required call or thinking off closes a reasoning model's thinking
    tool_choice: Any = None
    think: Optional[bool] = None
    reasoning_effort: Optional[str] = None
    max_thinking_tokens: Optional[int] = None

    def check(self) -> None:
        if (self.text is None) == (self.messages is None):
            raise ValueError("give exactly one of 'text' and 'messages'")
        rendering = (self.tool_choice, self.think, self.reasoning_effort, self.max_thinking_tokens)
        if self.messages is None and any(v is not None for v in rendering):
            raise ValueError("'tool_choice', 'think', 'reasoning_effort' and 'max_thinking_tokens' go with 'messages'")
        if self.text is not None and len(self.text) > MAX_MESSAGE_BYTES:
            raise ValueError("'text' is too long")
        if self.tools and self.messages is None:
            raise ValueError("'tools' go with 'messages'")


@dataclass
class Detokenize(Message):
    """The text of token ids (what ``generate`` would stream for them)."""

    op: ClassVar[Op] = Op.DETOKENIZE
    id: str
    tokens: list[int] = field(default_factory=list)

    def check(self) -> None:
        if len(self.tokens) > MAX_TOKENS_LIMIT * 4:
            raise ValueError("too many tokens")


@dataclass
class Embed(Message):
    """Embedding vectors of ``input`` (texts) or ``tokens`` (token ids of the embedding
    model's vocabulary), one per entry, in order, from the daemon's embedding model
    (``--embedding-model``, its own worker). Not queued behind generation: embed
    requests have their own queue, and a running generation has priority over them (1.8)."""

    op: ClassVar[Op] = Op.EMBED
    id: str
    input: list[str] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    # an entry longer than the embedding context: True cuts it to fit (as Ollama does by default);
    # False answers PROMPT_TOO_LONG, naming the entry
    truncate: bool = True
    dimensions: Optional[int] = None  # keep the first N dimensions (then normalized); None: all of them
    normalize: bool = True  # unit length (L2), as OpenAI's and Ollama's /api/embed are; False: as pooled

    def check(self) -> None:
        if bool(self.input) == bool(self.tokens):
            raise ValueError(
                "give 'input' (a list of texts) or 'tokens' (a list of token id lists), one of them and not empty"
            )
        n = len(self.input) or len(self.tokens)
        if n > MAX_EMBED_INPUTS:
            raise ValueError(f"{n} inputs in one request; the limit is {MAX_EMBED_INPUTS}: send them in several")
        for i, text in enumerate(self.input):
            if not text:
                raise ValueError(f"'input[{i}]' is empty: there is nothing to embed")
        for i, ids in enumerate(self.tokens):
            if not ids:
                raise ValueError(f"'tokens[{i}]' is empty: there is nothing to embed")
            if min(ids) < 0:
                raise ValueError(f"'tokens[{i}]' has a negative token id")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"'dimensions' must be 1 or more, got {self.dimensions}")


# --------------------------------------------------------------------------- replies


@dataclass
class HelloReply(Message):
    op: ClassVar[Op] = Op.HELLO
    id: str
    protocol_version: list[int]
    daemon_version: str
    model: str
    n_ctx: int
    embedding_model: str = ""  # the embedding model's name; "" when the daemon has none (1.8)


@dataclass
class Tokenized(Message):
    op: ClassVar[Op] = Op.TOKENIZE
    id: str
    tokens: list[int]
    pieces: list[str] = field(default_factory=list)  # with_pieces: each token's text (bytes as UTF-8, replaced)


@dataclass
class Detokenized(Message):
    op: ClassVar[Op] = Op.DETOKENIZE
    id: str
    text: str


@dataclass
class Embedded(Message):
    """The reply to ``embed``: one vector per input, in order (1.8)."""

    op: ClassVar[Op] = Op.EMBED
    id: str
    model: str  # the embedding model's name
    embeddings: list[list[float]]
    prompt_tokens: int  # tokens read, every input together (after truncation)
    input_tokens: list[int] = field(default_factory=list)  # tokens read of each input
    truncated: int = 0  # inputs cut to fit the embedding context (truncate)
    seconds: float = 0.0  # the embedding worker's time on the request
    queued_seconds: float = 0.0  # waiting for the embedding worker


@dataclass
class PromptProgress:
    """How far the reading of a request's prompt has come (``progress`` requests).
    ``processed / total`` is the share done; ``(processed - cached) / (total - cached)``
    the share of the reading itself (llama-server's ``prompt_progress``, in tokens and seconds)."""

    total: int  # the prompt's tokens
    cached: int  # of them restored from the prefix cache or kept from the request before
    processed: int  # of them in the model's KV cache now (cached included)
    seconds: float  # since the reading began


@dataclass
class Chunk(Message):
    op: ClassVar[Op] = Op.CHUNK
    id: str
    text: str  # new text since the previous chunk (may be empty while text is held back)
    token_ids: list[int]  # tokens generated since the previous chunk
    tool_calls: list[ToolCallDelta] = field(default_factory=list)  # new pieces of tool calls (with tools)
    progress: Optional[PromptProgress] = None  # set (no text, no tokens) while the prompt is read: 1.7
    reasoning: str = ""  # new thinking text (a reasoning model's; not in ``text``): 1.8


@dataclass
class DraftStats:
    """Speculative decoding counters (per request in ``done``, cumulative in ``status``)."""

    rounds: int = 0  # verification passes of the target
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens the target kept
    acceptance_rate: Optional[float] = None  # accepted / drafted; None before the first draft
    accepted_per_position: list[int] = field(
        default_factory=list
    )  # [i]: rounds whose draft i was accepted (0 to longest draft)
    tokens_per_round: Optional[float] = None  # mean tokens a round produced (accepted + the target's own)
    forced: int = 0  # tokens the grammar forced (response_format), verified as drafts and kept; not in rounds

    def add_round(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position.extend([0] * (drafted - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1
        self._refresh()

    def merge(self, other: "DraftStats") -> None:
        self.rounds += other.rounds
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.forced += other.forced
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        self.accepted_per_position = [
            (self.accepted_per_position[i] if i < len(self.accepted_per_position) else 0)
            + (other.accepted_per_position[i] if i < len(other.accepted_per_position) else 0)
            for i in range(n)
        ]
        self._refresh()

    def _refresh(self) -> None:
        self.acceptance_rate = self.accepted / self.drafted if self.drafted else None
        self.tokens_per_round = (self.accepted + self.rounds) / self.rounds if self.rounds else None


@dataclass
class GovernorInfo:
    """The governor's state for one task (see daemon/drafting/governor.py)."""

    task: str  # which task: a hash of the prompt's first 16 tokens
    tasks: int  # tasks the governor remembers
    phase: str  # "measuring", "drafting", "refreshing", "plain" or "probing"
    drafting: bool  # whether the next round drafts
    plain_tokens_per_second: Optional[float]  # moving average of plain rounds
    draft_tokens_per_second: Optional[float]  # moving average of drafting rounds
    probe_interval: int  # plain rounds between probes
    rounds_until_probe: int  # in "plain": rounds left before the next probe
    probe_debt_seconds: float  # plain time still to run before the next probe: catching the drafter up (PROTOCOL.md)
    plain_rounds: int
    draft_rounds: int
    probes: int
    failed_probes: int
    # with the pass costs measured at load (None without): this task's acceptance rate
    # (smoothed toward every task's), the draft length of its next drafting round, and
    # the predicted tokens/s of such rounds over plain ones
    alpha: Optional[float] = None
    draft_length: Optional[int] = None
    predicted_speedup: Optional[float] = None
    # a drafter whose proposals are free (prompt lookup): each round verifies the predicted best number
    # of its drafts (never probes); the acceptance measured per match length ("1", "2-3" ... "64+")
    gate: dict[str, float] = field(default_factory=dict)


@dataclass
class DiskCacheInfo:
    """The prefix cache's disk tier (see daemon/cache/disk_cache.py): the target's pages in files."""

    path: str  # the directory of this model's pages
    state: str  # "on", or "off: <why>" (a full or read-only disk, say)
    pages: int
    bytes_used: int
    bytes_budget: int  # --disk-cache-bytes (every model's pages in the directory together)
    hits: int  # requests that read at least one page from disk
    tokens_from_disk: int  # of tokens_from_cache: read from disk (then kept in shared memory)
    pages_read: int
    read_seconds: float
    pages_written: int  # between requests, never while one waits
    bytes_written: int
    write_seconds: float
    evictions: int
    dropped: int  # page files ignored: damaged, truncated, not this user's, of another format


@dataclass
class CacheInfo:
    """The prefix cache (see daemon/cache/prefix_cache.py): the shared-memory tier, and the disk tier in ``disk``."""

    page_tokens: int
    pages: int  # pages held (of every model)
    bytes_used: int
    bytes_budget: int
    hits: int  # requests that restored at least one page
    misses: int
    tokens_from_cache: int  # prompt tokens restored instead of prefilled
    tokens_prefilled: int  # prompt tokens prefilled by requests that used the cache
    evictions: int
    pages_total: int = 0  # pages the budget holds (each cached page of tokens has one page per model)
    page_bytes: dict[str, int] = field(default_factory=dict)  # bytes of one page, by model: "target", "drafter"
    drafter_tokens_from_cache: int = 0  # tokens the drafter restored instead of reading
    tokens_from_live: int = 0  # of tokens_from_cache: kept in the target's KV from the request before (no pages read)
    disk: Optional[DiskCacheInfo] = None  # the disk tier; None when it is off (--disk-cache-bytes 0) or unusable


@dataclass
class Done(Message):
    op: ClassVar[Op] = Op.DONE
    id: str
    text: str  # the whole completion (the chunks' texts concatenated): with tools, the text outside the calls
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    draft: Optional[DraftStats] = None  # None when the request was decoded without drafting
    governor: Optional[GovernorInfo] = None  # its task's governor after this request; None if not governed
    cache: Optional[CacheInfo] = None  # the prefix cache after this request; None without one
    serial: int = 0  # the request's place in the daemon's arrival order (1, 2, ...): it serves them in this order
    # the target's load probe: greedy output is independent of cache and drafting
    batch_invariant: Optional[bool] = None
    tool_calls: list[ToolCall] = field(default_factory=list)  # the calls the model made (finish_reason tool_calls)
    drafter_died: bool = False  # the drafter worker died during the request: the rest was decoded plainly
    stop_sequence: Optional[str] = None  # the stop string that ended it (finish_reason stop); None otherwise
    # drafting (and jump-forward) was off for this request because it would change greedy output on this
    # CPU (the load probe's exact_steps or one_token path differs); None: it was not turned off for that
    draft_off: Optional[str] = None
    # a constrained output (response_format or a tool call) ended before its grammar was complete
    # (max_tokens, a stop string): finish_reason says which; the cut-off call is not in tool_calls
    incomplete: bool = False
    reasoning: str = ""  # a reasoning model's thinking (the chunks' reasoning concatenated; not in text): 1.8

    @classmethod
    def cancelled(
        cls, request_id: str, prompt_tokens: int = 0, prompt_seconds: float = 0.0, queued_seconds: float = 0.0
    ) -> "Done":
        """A request cancelled before it produced a token (while queued, or in its prefill)."""
        return cls(
            id=request_id,
            text="",
            finish_reason=FinishReason.CANCELLED,
            usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=0),
            timings=Timings(0.0, prompt_seconds, 0.0, 0.0, queued_seconds),
        )


@dataclass
class Error(Message):
    op: ClassVar[Op] = Op.ERROR
    id: Optional[str]  # None when the offending message had no readable id
    code: int  # an ErrorCode value
    name: str  # the ErrorCode name, for humans and logs
    message: str

    @classmethod
    def of(cls, request_id: Optional[str], code: ErrorCode, message: str) -> "Error":
        return cls(id=request_id, code=int(code), name=code.name, message=message)


@dataclass
class Busy(Message):
    op: ClassVar[Op] = Op.BUSY
    id: str
    queue_length: int
    max_queue: int
    message: str


@dataclass
class CancelReply(Message):
    op: ClassVar[Op] = Op.CANCEL
    id: str
    request_id: str
    found: bool  # False: no such request queued or running (already finished, or never seen)


@dataclass
class DeviceInfo:
    """a llama.cpp compute device in a worker's process."""

    name: str  # llama.cpp's name: "CPU", "CUDA0", "MTL0", "RPC0"...
    description: str  # the CPU's or GPU's model; an RPC device's HOST:PORT
    kind: str  # "cpu", "gpu", "igpu", "accel", "rpc"
    memory_free: int = 0  # bytes (0: not reported)
    memory_total: int = 0


@dataclass
class ModelInfo:
    name: str
    path: str
    n_ctx: int
    n_ctx_train: int
    n_vocab: int
    size_bytes: int
    has_chat_template: bool
    vocab_digests: list[str] = field(default_factory=list)  # sha256 (16 hex) of each 4,096-id block of token texts
    batch_invariant: Optional[bool] = None  # the load probe: every decoding path gives bit-identical logits here
    exact_steps: bool = False  # every step reads >= 2 positions so drafting never changes greedy output
    # why drafting and jump-forward are off for every request (verify passes round differently from plain
    # steps on this CPU, with these settings); "" when they draft as configured
    draft_off: str = ""
    fim: bool = False  # the vocabulary has fill-in-the-middle tokens: ``complete`` works
    batch_variant_paths: list[str] = field(default_factory=list)  # the probe's paths whose logits differ
    kernels: str = ""  # "mixed" (fast prefill, reference steps), "reference" (ggml's batch-invariant kernels) or "fast"
    cpu_kernels: str = ""  # whose CPU backend the worker loaded: "tandem-KEY" (daemon/kernels) or "llama.cpp": 1.10
    flash_attn: Optional[bool] = None
    prefill_chunk: int = 0  # "mixed": prompts are read with fast kernels in chunks of this many tokens from 0
    extra_buffers: Optional[bool] = None  # llama.cpp's repacked weights are in use
    prompt_reader: bool = False  # prompts are read by a second context over the weights not repacked
    devices: list[DeviceInfo] = field(default_factory=list)  # the devices llama.cpp has in this model's worker
    gpu_backend: bool = False  # llama.cpp can offload layers (a GPU backend or RPC is compiled in)
    gpu_note: str = ""  # without one: how to install a llama.cpp with a GPU backend
    gpu_layers_asked: int = 0  # the setting as llama.cpp's n_gpu_layers: -1 all (and auto), N layers
    n_layers: int = 0  # layers llama.cpp places: the repeating ones and the output layer
    layers: dict[str, int] = field(default_factory=dict)  # device name -> layers placed there
    weights: dict[str, int] = field(default_factory=dict)  # llama.cpp weight buffer ("CPU_Mapped", "CUDA0") -> bytes
    kv_type: str = "f16"  # the KV cache's element type (--kv-type)
    # the thinking the chat template renders and the daemon parses: "think" (<think>...</think>: Qwen3,
    # DeepSeek-R1), "harmony" (gpt-oss's analysis channel), "" (none): 1.8
    reasoning: str = ""


@dataclass
class ActiveRequest:
    id: str
    elapsed_seconds: float
    completion_tokens: int


@dataclass
class StatusReply(Message):
    op: ClassVar[Op] = Op.STATUS
    id: str
    state: str  # "loading", "ready", "failed", "stopping"
    daemon_version: str
    pid: int
    uptime_seconds: float
    socket_path: str
    model: Optional[ModelInfo]
    active: Optional[ActiveRequest]
    queue_length: int
    max_queue: int
    requests: dict[str, int]  # counts: "done_stop", "done_length", "done_cancelled", "error", "busy"
    tokens: dict[str, int]  # counts: "prompt", "completion"
    memory_rss_bytes: dict[str, int]  # resident memory by process: "daemon", "target"
    worker_pids: dict[str, int]
    worker_restarts: int
    failure: str = ""  # why state is "failed"
    drafter: str = "none"  # "none", "ngram", or the drafter model's name
    drafter_model: Optional[ModelInfo] = None
    draft_tokens: int = 0  # the daemon's default k
    draft: Optional[DraftStats] = None  # cumulative over all requests that drafted
    governor: Optional[GovernorInfo] = None  # the most recently used task's governor; None without one
    cache: Optional[CacheInfo] = None  # the prefix cache as of the last request; None without one
    metrics_addr: str = ""  # HOST:PORT of the Prometheus endpoint; "" when off
    # proportional set size by process: a page mapped n times counts 1/n in each mapping
    # (the model file a prompt reader maps a second time, the prefix cache's arena); {}
    # where the system cannot say
    memory_pss_bytes: dict[str, int] = field(default_factory=dict)
    context: str = ""  # how the context length was chosen (--ctx-size, or the trained one within --kv-budget)
    # the embedding model's name and state ("none" without one; "(loading)", "(restarting)", "(off: why)"): 1.8
    embedding: str = "none"
    embedding_model: Optional[ModelInfo] = None
    # the short request the target serves within the active one meanwhile (the lane), or None: 1.11
    within: Optional[ActiveRequest] = None


@dataclass
class CacheCleared(Message):
    op: ClassVar[Op] = Op.CACHE_CLEAR
    id: str
    pages: int  # pages dropped
    bytes: int  # bytes freed
    disk_pages: int = 0  # page files removed from the disk tier
    disk_bytes: int = 0
    cache: Optional[CacheInfo] = None  # the cache now (None: the daemon has none)


@dataclass
class ShutdownReply(Message):
    op: ClassVar[Op] = Op.SHUTDOWN
    id: str


REQUESTS: dict[Op, type] = {
    m.op: m for m in (Hello, Generate, Complete, Cancel, Status, Shutdown, CacheClear, Tokenize, Detokenize, Embed)
}
REPLIES: dict[Op, type] = {
    m.op: m
    for m in (
        HelloReply,
        Chunk,
        Done,
        Error,
        Busy,
        CancelReply,
        StatusReply,
        ShutdownReply,
        CacheCleared,
        Tokenized,
        Detokenized,
        Embedded,
    )
}
"""What a client decodes: the daemon's replies. The daemon's own processes speak
more among themselves; those messages and their tables are in ``internal.py``."""
TERMINAL_OPS = frozenset({Op.DONE, Op.ERROR, Op.BUSY})
