"""Ollama's native API on the bridge (``/api/...``), translated to daemon requests.

Editor plugins and tools built for Ollama (Continue, Zed, Open WebUI, the
``ollama`` Python and JS packages) reach tandem by changing the URL only. What
is served, as github.com/ollama/ollama docs/api.md defines it:

- ``GET /api/version``, ``GET /api/tags`` (the served model and every pulled
  one), ``POST /api/show`` (details, ``model_info`` with the context length the
  daemon serves, template, capabilities), ``GET /api/ps`` (the resident model).
- ``POST /api/generate``: ``prompt`` (through the chat template unless
  ``raw``), ``system``, ``suffix`` (fill in the middle), ``format`` (``"json"``
  or a JSON schema: constrained), ``options``, ``stream`` (NDJSON, on by
  default), ``keep_alive`` (accepted; the model stays resident).
- ``POST /api/chat``: ``messages`` (with ``tool_calls`` and ``tool`` results),
  ``tools``, ``format``, ``options``, ``stream``.
- ``POST /api/embed``/``/api/embeddings``: embeddings.py, with ``--embedding-model``;
  pulling, pushing, creating, copying and deleting models: 501 naming the
  ``tandem`` command that does it.

Ollama's defaults are kept where tandem has no reason to differ: ``stream``
true, temperature 0.8, top_k 40, top_p 0.9, no token limit (``num_predict``
-1). ``num_ctx`` above the daemon's context is refused naming ``--ctx-size``:
never a silent truncation. Options tandem's sampler does not have
(``repeat_penalty``, ``mirostat``, ...) are accepted and not applied, as
Ollama accepts options a runner ignores. Errors are Ollama's ``{"error": "..."}``.

``parse_generate`` and ``parse_chat`` make the GenRequest (translate.py),
``OllamaAnswer`` renders the daemon's result back, and the async handlers
around them do the I/O.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from datetime import datetime, timezone
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from tandem.protocol import MAX_TOKENS_LIMIT, Chunk, Done, FinishReason

from .answers import ApiError, ndjson
from .translate import (
    GenRequest,
    Sampling,
    ToolUse,
    arguments_object,
    arguments_text,
    bad_request,
    checked,
    function_tool,
    history_call,
    is_a,
    stop_list,
)

if TYPE_CHECKING:
    from .exchange import Exchange

API_VERSION = "0.6.0"  # the Ollama API level served (clients gate features on it)
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
IGNORED_OPTIONS = {  # Ollama options tandem accepts without applying them (no such knob here)
    "num_keep",
    "tfs_z",
    "typical_p",
    "repeat_last_n",
    "repeat_penalty",
    "presence_penalty",
    "frequency_penalty",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "penalize_newline",
    "numa",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "low_vram",
    "vocab_only",
    "use_mmap",
    "use_mlock",
    "num_thread",
    "min_p",
}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


# --------------------------------------------------------------------------- models


def _mtime(path: Path) -> str:
    try:
        return datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).isoformat().replace("+00:00", "Z")
    except OSError:
        return _now()


_FACTS: dict[tuple[str, float], dict] = {}


def model_facts(path: Path) -> dict:
    """gguf_meta.facts, cached per file and mtime."""
    from tandem.daemon.models.gguf_meta import facts

    try:
        key = (str(path), path.stat().st_mtime)
    except OSError:
        return {}
    if key not in _FACTS:
        _FACTS[key] = facts(path)
    return _FACTS[key]


def _digest(name: str, path: Path) -> str:
    """A preset's pinned sha256 when the file is that preset's; else a hash of
    path, size and mtime (an identifier, not the file's sha256: that would mean
    reading it whole on every listing)."""
    from tandem.daemon.models import PRESETS

    preset = PRESETS.get(name)
    try:
        st = path.stat()
    except OSError:
        st = None
    if preset is not None and st is not None and path.name == preset.filename and st.st_size == preset.size_bytes:
        return preset.sha256
    ident = f"{path}:{st.st_size if st else 0}:{st.st_mtime_ns if st else 0}"
    return hashlib.sha256(ident.encode()).hexdigest()


def _details(facts: dict) -> dict:
    family = facts.get("family") or ""
    return {
        "parent_model": "",
        "format": "gguf",
        "family": family,
        "families": [family] if family else None,
        "parameter_size": facts.get("parameter_size") or "",
        "quantization_level": facts.get("quantization") or "",
    }


def _entry(name: str, path: Path) -> dict:
    facts = model_facts(path)
    try:
        size = path.stat().st_size
    except OSError:
        size = 0
    return {
        "name": f"{name}:latest",
        "model": f"{name}:latest",
        "modified_at": _mtime(path),
        "size": size,
        "digest": _digest(name, path),
        "details": _details(facts),
    }


async def _served(ex: "Exchange"):
    """The daemon's status (its model's ModelInfo is ``.model``; the bridge's
    idea of the served model's name is refreshed by it)."""
    try:
        return await ex.status()
    except ApiError as exc:
        raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, exc.message) from None


def _base(name: str) -> str:
    return name[: -len(":latest")] if name.endswith(":latest") else name


def check_model(name: Any, served: str) -> None:
    """A request names the served model (with or without ``:latest``, or
    ``tandem``), or gets an error: 404 for a model tandem does not have, 400 for
    a pulled one that is not the resident target (one target is the design)."""
    from tandem.daemon.models import is_pulled, preset_names

    if not isinstance(name, str) or not name:
        raise ApiError(HTTPStatus.BAD_REQUEST, "'model' is required (the name /api/tags lists)")
    base = _base(name)
    if base in (served, "tandem"):
        return
    if base in preset_names() and is_pulled(base):
        raise ApiError(
            HTTPStatus.BAD_REQUEST,
            f"model '{name}' is pulled but this daemon serves '{served}' (one resident target): restart it with "
            f"`tandem stop && tandem serve --model {base}`, or ask for '{served}'",
        )
    raise ApiError(HTTPStatus.NOT_FOUND, f"model '{name}' not found; this daemon serves '{served}'")


async def tags(ex: "Exchange") -> dict:
    from tandem.daemon.models import list_models

    status = await _served(ex)  # the served model now (the daemon may have been restarted on another)
    served = status.model

    def rows() -> list[dict]:  # (reads each model's GGUF header: off the event loop)
        out = [_entry(ex.server.model, Path(served.path))] if served is not None else []
        for name, path, _ in list_models():
            if path is not None and (served is None or Path(served.path) != path.resolve()):
                out.append(_entry(name, path))
        return out

    return {"models": await asyncio.to_thread(rows)}


async def ps(ex: "Exchange") -> dict:
    status = await _served(ex)
    info = status.model
    if info is None:
        return {"models": []}
    entry = await asyncio.to_thread(_entry, ex.server.model, Path(info.path))  # (reads the GGUF header)
    entry.update(expires_at="2999-01-01T00:00:00Z", size_vram=0, context_length=info.n_ctx)
    return {"models": [entry]}


async def show(ex: "Exchange", body: dict) -> None:
    name = body.get("model") or body.get("name")
    status = await _served(ex)
    info = status.model
    served = ex.server.model
    if info is None:
        raise ApiError(HTTPStatus.SERVICE_UNAVAILABLE, "the daemon has not loaded its model yet; retry")
    from tandem.daemon.models import PRESETS, is_pulled, preset_path

    if isinstance(name, str) and _base(name) in PRESETS and _base(name) != served and is_pulled(_base(name)):
        path, n_ctx, fim = preset_path(_base(name)), None, None  # a pulled model that is not resident
    else:
        check_model(name, served)
        path, n_ctx, fim = Path(info.path), info.n_ctx, info.fim
    facts = await asyncio.to_thread(model_facts, path)
    arch = facts.get("architecture") or "unknown"
    model_info = dict(facts.get("metadata") or {})
    model_info["general.architecture"] = arch
    if n_ctx is not None:
        model_info[f"{arch}.context_length"] = n_ctx  # what the daemon serves, which is what a client may send
    capabilities = ["completion", "tools"]  # tools: every model (a template without them gets a generic prompt)
    if fim is None:  # not the resident model: from its vocabulary
        fim = bool(facts.get("fim"))
    if fim:
        capabilities.append("insert")
    if getattr(info, "reasoning", "") and path == Path(info.path):
        capabilities.append("thinking")  # (the resident model: its chat template renders thinking)
    reply = {
        "license": str(model_info.get("general.license", "")),
        "modelfile": f"# served by tandem\nFROM {path}\n",
        "parameters": "",
        "template": facts.get("chat_template", ""),
        "details": _details(facts),
        "model_info": model_info,
        "capabilities": capabilities,
        "modified_at": _mtime(path),
        "tandem": {"path": str(path), "context_length": n_ctx, "trained_context_length": facts.get("context_length")},
    }
    ex.send_json(HTTPStatus.OK, reply)


# --------------------------------------------------------------------------- request translation


def _options(body: dict, n_ctx: int) -> Sampling:
    """Ollama's options as the daemon's sampling; its defaults where none is given."""
    options = body.get("options")
    if options is None:
        options = {}
    if not isinstance(options, dict):  # (as Ollama's: [] or false is not "no options")
        raise bad_request("'options' must be an object")
    num_ctx = options.get("num_ctx")
    if num_ctx is not None:
        if not is_a(num_ctx, (int,)) or num_ctx <= 0:
            raise bad_request(f"options.num_ctx must be a positive integer, got {num_ctx!r}")
        if num_ctx > n_ctx:
            raise bad_request(
                f"options.num_ctx {num_ctx} is more than the daemon's context of {n_ctx} tokens; tandem never cuts "
                f"a prompt silently: restart the daemon with --ctx-size {num_ctx} (or send num_ctx <= {n_ctx})",
            )
    values = {  # (an explicit null is absent: the daemon's default, not Ollama's)
        key: checked(
            options.get(key, DEFAULTS.get(key)), kinds, "options.{key} must be a number, got {json:.60}", key, False
        )
        for key, kinds in (("temperature", (int, float)), ("top_p", (int, float)), ("top_k", (int,)), ("seed", (int,)))
    }
    num_predict = options.get("num_predict", -1)
    if not is_a(num_predict, (int,)):
        raise bad_request(f"options.num_predict must be an integer, got {num_predict!r}")
    sampling = Sampling(
        max_tokens=MAX_TOKENS_LIMIT if num_predict < 0 else max(num_predict, 1),  # -1, -2: to the end
        temperature=None if values["temperature"] is None else float(values["temperature"]),
        top_p=None if values["top_p"] is None else float(values["top_p"]),
        top_k=values["top_k"],
        seed=values["seed"],
        stop=stop_list(options.get("stop") or [], "options.stop must be an array of strings"),
    )
    return sampling.normalised(negative_top_k_is_off=True)  # Ollama: top_k 0 or less = off


def _format(body: dict) -> Optional[dict]:
    fmt = body.get("format")
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise bad_request("'format' must be \"json\" or a JSON schema object")


def _refuse_images(where: str, value: Any) -> None:
    if value:
        raise bad_request(f"{where}: tandem's models read text only; images are not supported")


def _stream(body: dict) -> bool:
    stream = body.get("stream", True)  # Ollama streams unless told not to
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean")
    return stream


def parse_generate(body: dict, n_ctx: int) -> Optional[GenRequest]:
    """``/api/generate`` for a daemon of ``n_ctx`` tokens: a prompt through the chat
    template (with ``system``), or as it is (``raw``), or with ``suffix`` fill in
    the middle. None for an empty prompt: Ollama loads the model and answers
    done at once (``loaded``)."""
    _refuse_images("'images'", body.get("images"))
    if body.get("template"):
        raise bad_request("'template' is not supported: the model's own chat template is used")
    if body.get("context"):
        raise bad_request("'context' (deprecated) is not supported: send the whole history")
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise bad_request("'prompt' must be a string")
    req = GenRequest(sampling=_options(body, n_ctx), response_format=_format(body), model=body.get("model") or "")
    suffix = body.get("suffix")
    system = body.get("system")
    if prompt == "" and not suffix:
        return None
    if suffix:
        if not isinstance(suffix, str):
            raise bad_request("'suffix' must be a string")
        if req.response_format is not None:
            raise bad_request("'format' cannot constrain a fill in the middle ('suffix')")
        req.prompt, req.suffix = prompt, suffix
    elif body.get("raw"):
        req.prompt = prompt
    else:
        req.messages = ([{"role": "system", "content": system}] if isinstance(system, str) and system else []) + [
            {"role": "user", "content": prompt}
        ]
        _think(body, req)
    req.stream = _stream(body)
    return req


def _think(body: dict, req: GenRequest) -> None:
    """Ollama's ``think``: true or false, or gpt-oss's "low", "medium" or "high" (thinking on, that effort)."""
    think = body.get("think")
    if think is None:
        return
    if isinstance(think, bool):
        req.think = think
    elif think in ("low", "medium", "high"):
        req.think, req.reasoning_effort = True, think
    else:
        raise bad_request(f'\'think\' must be true, false, "low", "medium" or "high", got {think!r}')


def chat_messages(body: dict) -> list[dict]:
    """``messages`` as the daemon's chat messages. Ollama's tool calls have no id
    and its tool results name the tool, not the call: calls get ids (call_1,
    call_2, ...), and a result answers the last turn's call of its tool."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' is required: an array of {role, content}")
    out: list[dict] = []
    pending: list[tuple[str, str]] = []  # (call id, tool name) of the last assistant turn's calls
    serial = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise bad_request(f"messages[{i}] must have a role: system, user, assistant or tool")
        _refuse_images(f"messages[{i}].images", m.get("images"))
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string")
        msg: dict[str, Any] = {"role": m["role"], "content": content}
        if m["role"] == "assistant" and isinstance(m.get("thinking"), str) and m["thinking"]:
            msg["reasoning"] = m["thinking"]  # (sent back: the templates that show it get it)
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls, pending = [], []
            for j, call in enumerate(m["tool_calls"]):
                fn = call.get("function") if isinstance(call, dict) else None
                if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
                    raise bad_request(f"messages[{i}].tool_calls[{j}] needs function.name")
                serial += 1
                calls.append(history_call(f"call_{serial}", fn["name"], arguments_text(fn.get("arguments", {}))))
                pending.append((f"call_{serial}", fn["name"]))
            msg["tool_calls"] = calls
        if m["role"] == "tool":  # Ollama names the tool (tool_name), not the call: match it to the last calls
            name = m.get("tool_name") or m.get("name")
            match = next((p for p in pending if p[1] == name), pending[0] if pending else None)
            if match is not None:
                pending.remove(match)
            msg["tool_call_id"] = match[0] if match else f"call_{serial + 1}"
            if isinstance(name, str):
                msg["name"] = name
        out.append(msg)
    return out


def _tools(body: dict) -> Optional[ToolUse]:
    tools = body.get("tools")
    if not tools:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be an array")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f'tools[{i}] must be {{"type": "function", "function": {{"name"...}}}}')
        out.append(function_tool(fn))
    return ToolUse(out)


def parse_chat(body: dict, n_ctx: int) -> GenRequest:
    """``/api/chat`` for a daemon of ``n_ctx`` tokens: messages, tools, ``format``."""
    messages = chat_messages(body)
    sampling = _options(body, n_ctx)
    tools = _tools(body)
    rf = _format(body)
    model = body.get("model") or ""
    req = GenRequest(
        messages=messages, sampling=sampling, tools=tools, response_format=rf, model=model, stream=_stream(body)
    )
    _think(body, req)
    return req


# --------------------------------------------------------------------------- rendering the result


def done_fields(done: Done, total_seconds: float) -> dict:
    """The last line's fields: why it ended, Ollama's counts and durations (ns)."""
    t = done.timings
    ns = 1_000_000_000
    reason = {FinishReason.LENGTH: "length"}.get(done.finish_reason, "stop")
    return {
        "done": True,
        "done_reason": reason,
        "total_duration": int(total_seconds * ns),
        "load_duration": 0,
        "prompt_eval_count": done.usage.prompt_tokens,
        "prompt_eval_duration": int(t.prompt_seconds * ns),
        "eval_count": done.usage.completion_tokens,
        "eval_duration": int(t.generation_seconds * ns),
    }


def ollama_calls(done: Done) -> list[dict]:
    """The calls the model made, as Ollama's: arguments as an object, no id."""
    return [
        {"function": {"name": c.function.name, "arguments": arguments_object(c.function.arguments)}}
        for c in done.tool_calls
    ]


def loaded(model: str, now: Callable[[], str] = _now) -> dict:
    """The answer to an empty prompt: the model is loaded (it always is)."""
    return {"model": model, "created_at": now(), "response": "", "done": True, "done_reason": "load"}


class OllamaAnswer:
    """One request's answer, whole (``whole``) or as NDJSON lines (``chunk``,
    ``closing``) of ``/api/chat`` (``chat``: a message) or ``/api/generate`` (a
    response); ``now()`` gives each line's ``created_at``, ``total_seconds`` the
    time since the request came."""

    def __init__(self, req: GenRequest, chat: bool, now: Callable[[], str] = _now):
        self.model, self.chat, self.now = req.model, chat, now

    def piece(self, text: str, thinking: str = "") -> dict:
        base: dict[str, Any] = {"model": self.model, "created_at": self.now()}
        if self.chat:
            base["message"] = {"role": "assistant", "content": text}
            if thinking:
                base["message"]["thinking"] = thinking
        else:
            base["response"] = text
            if thinking:
                base["thinking"] = thinking
        base["done"] = False
        return base

    def chunk(self, chunk: Chunk) -> list[dict]:
        return [self.piece(chunk.text, chunk.reasoning)] if chunk.text or chunk.reasoning else []

    def whole(self, done: Done, total_seconds: float) -> dict:
        out = self.piece(done.text, done.reasoning)
        out.update(done_fields(done, total_seconds))
        if self.chat and done.tool_calls:
            out["message"]["tool_calls"] = ollama_calls(done)
        return out

    def closing(self, done: Done, total_seconds: float) -> list[dict]:
        out = self.piece("")
        out.update(done_fields(done, total_seconds))
        if not (self.chat and done.tool_calls):
            return [out]
        calls = self.piece("")  # streamed, Ollama sends the calls in a message of their own, before the done line
        calls["message"]["tool_calls"] = ollama_calls(done)
        return [calls, out]


# --------------------------------------------------------------------------- the handlers


async def generate(ex: "Exchange", body: dict) -> None:
    hello = await ex.hello()
    check_model(body.get("model"), hello.model)
    req = parse_generate(body, hello.n_ctx)
    if req is None:
        return await _reply(ex, loaded(body["model"]), stream=bool(body.get("stream", True)))
    await _run(ex, req, chat=False)


async def chat(ex: "Exchange", body: dict) -> None:
    hello = await ex.hello()
    check_model(body.get("model"), hello.model)
    await _run(ex, parse_chat(body, hello.n_ctx), chat=True)


async def _run(ex: "Exchange", req: GenRequest, chat: bool) -> None:
    started = time.monotonic()
    answer = OllamaAnswer(req, chat)
    if not req.stream:
        done = await ex.run_to_done(req.start)
        ex.send_json(HTTPStatus.OK, answer.whole(done, time.monotonic() - started))
        return
    await ex.relay(
        req.start,
        "application/x-ndjson",
        opening=lambda: [],
        each=lambda chunk: [ndjson(line) for line in answer.chunk(chunk)],
        closing=lambda done: [ndjson(line) for line in answer.closing(done, time.monotonic() - started)],
        failing=lambda exc: [ndjson(exc.body("ollama"))],
        keepalive=lambda: [ndjson(answer.piece(""))],  # (NDJSON has no comments: a line with no text)
    )


async def _reply(ex: "Exchange", obj: dict, stream: bool) -> None:
    if stream:
        await ex.start_stream("application/x-ndjson", [ndjson(obj)])
        await ex.end_stream()
    else:
        ex.send_json(HTTPStatus.OK, obj)
