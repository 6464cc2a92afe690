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
- ``POST /api/embed``/``/api/embeddings``: 501 (tandem has no embedding path);
  pulling, pushing, creating, copying and deleting models: 501 naming the
  ``tandem`` command that does it.

Ollama's defaults are kept where tandem has no reason to differ: ``stream``
true, temperature 0.8, top_k 40, top_p 0.9, no token limit (``num_predict``
-1). ``num_ctx`` above the daemon's context is refused naming ``--ctx-size``:
never a silent truncation. Options tandem's sampler does not have
(``repeat_penalty``, ``mirostat``, ...) are accepted and not applied, as
Ollama accepts options a runner ignores. Errors are Ollama's ``{"error": "..."}``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from datetime import datetime, timezone
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from tandem.protocol import MAX_TOKENS_LIMIT, FinishReason

from .answers import ApiError, ndjson

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
    from tandem.daemon.models import PRESETS, is_pulled

    if not isinstance(name, str) or not name:
        raise ApiError(HTTPStatus.BAD_REQUEST, "'model' is required (the name /api/tags lists)")
    base = _base(name)
    if base in (served, "tandem"):
        return
    if base in PRESETS and is_pulled(base):
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


# --------------------------------------------------------------------------- generation


def _options(body: dict, n_ctx: int) -> dict:
    """Ollama's options (and top-level sampling fields) as daemon request fields."""
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise ApiError(HTTPStatus.BAD_REQUEST, "'options' must be an object")
    num_ctx = options.get("num_ctx")
    if num_ctx is not None:
        if not isinstance(num_ctx, int) or isinstance(num_ctx, bool) or num_ctx <= 0:
            raise ApiError(HTTPStatus.BAD_REQUEST, f"options.num_ctx must be a positive integer, got {num_ctx!r}")
        if num_ctx > n_ctx:
            raise ApiError(
                HTTPStatus.BAD_REQUEST,
                f"options.num_ctx {num_ctx} is more than the daemon's context of {n_ctx} tokens; tandem never cuts "
                f"a prompt silently: restart the daemon with --ctx-size {num_ctx} (or send num_ctx <= {n_ctx})",
            )
    params: dict[str, Any] = {}
    for key, kinds in (("temperature", (int, float)), ("top_p", (int, float)), ("top_k", (int,)), ("seed", (int,))):
        value = options.get(key, DEFAULTS.get(key))
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise ApiError(HTTPStatus.BAD_REQUEST, f"options.{key} must be a number, got {json.dumps(value)[:60]}")
        params[key] = float(value) if float in kinds else value
    if params.get("top_p") == 0.0:
        params["top_p"], params["temperature"] = 1.0, 0.0
    if params.get("top_k") is not None and params["top_k"] <= 0:
        params["top_k"] = 0  # Ollama: 0 or less = off
    num_predict = options.get("num_predict", -1)
    if not isinstance(num_predict, int) or isinstance(num_predict, bool):
        raise ApiError(HTTPStatus.BAD_REQUEST, f"options.num_predict must be an integer, got {num_predict!r}")
    params["max_tokens"] = MAX_TOKENS_LIMIT if num_predict < 0 else max(num_predict, 1)  # -1, -2: to the end
    stop = options.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise ApiError(HTTPStatus.BAD_REQUEST, "options.stop must be an array of strings")
    params["stop"] = stop
    return params


def _format(body: dict) -> Optional[dict]:
    fmt = body.get("format")
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise ApiError(HTTPStatus.BAD_REQUEST, "'format' must be \"json\" or a JSON schema object")


def _refuse_images(where: str, value: Any) -> None:
    if value:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"{where}: tandem's models read text only; images are not supported")


async def generate(ex: "Exchange", body: dict) -> None:
    hello = await ex.hello()
    check_model(body.get("model"), hello.model)
    _refuse_images("'images'", body.get("images"))
    if body.get("template"):
        raise ApiError(HTTPStatus.BAD_REQUEST, "'template' is not supported: the model's own chat template is used")
    if body.get("context"):
        raise ApiError(HTTPStatus.BAD_REQUEST, "'context' (deprecated) is not supported: send the whole history")
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise ApiError(HTTPStatus.BAD_REQUEST, "'prompt' must be a string")
    params = _options(body, hello.n_ctx)
    rf = _format(body)
    if rf is not None:
        params["response_format"] = rf
    suffix = body.get("suffix")
    system = body.get("system")
    if prompt == "" and not suffix:
        # Ollama: an empty prompt loads the model and answers done at once
        loaded = {"model": body["model"], "created_at": _now(), "response": "", "done": True, "done_reason": "load"}
        return await _reply(ex, loaded, stream=bool(body.get("stream", True)))
    if suffix:
        if not isinstance(suffix, str):
            raise ApiError(HTTPStatus.BAD_REQUEST, "'suffix' must be a string")
        if rf is not None:
            raise ApiError(HTTPStatus.BAD_REQUEST, "'format' cannot constrain a fill in the middle ('suffix')")
        start = lambda c: c.infill(prompt, suffix, **params)  # noqa: E731
    elif body.get("raw"):
        start = lambda c: c.generate(prompt=prompt, **params)  # noqa: E731
    else:
        messages = ([{"role": "system", "content": system}] if isinstance(system, str) and system else []) + [
            {"role": "user", "content": prompt}
        ]
        start = lambda c: c.generate(messages=messages, **params)  # noqa: E731
    await _run(ex, body, start, chat=False)


def _chat_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(HTTPStatus.BAD_REQUEST, "'messages' is required: an array of {role, content}")
    out: list[dict] = []
    pending: list[tuple[str, str]] = []  # (call id, tool name) of the last assistant turn's calls
    serial = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ApiError(HTTPStatus.BAD_REQUEST, f"messages[{i}] must have a role: system, user, assistant or tool")
        _refuse_images(f"messages[{i}].images", m.get("images"))
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise ApiError(HTTPStatus.BAD_REQUEST, f"messages[{i}].content must be a string")
        msg: dict[str, Any] = {"role": m["role"], "content": content}
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls, pending = [], []
            for j, call in enumerate(m["tool_calls"]):
                fn = call.get("function") if isinstance(call, dict) else None
                if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
                    raise ApiError(HTTPStatus.BAD_REQUEST, f"messages[{i}].tool_calls[{j}] needs function.name")
                args = fn.get("arguments", {})
                serial += 1
                call_id = f"call_{serial}"
                calls.append({"id": call_id, "function": {"name": fn["name"], "arguments": _json_text(args)}})
                pending.append((call_id, fn["name"]))
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


def _json_text(args: Any) -> str:
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _tools(body: dict) -> dict:
    tools = body.get("tools")
    if not tools:
        return {}
    if not isinstance(tools, list):
        raise ApiError(HTTPStatus.BAD_REQUEST, "'tools' must be an array")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(
                HTTPStatus.BAD_REQUEST, f'tools[{i}] must be {{"type": "function", "function": {{"name"...}}}}'
            )
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return {"tools": out}


async def chat(ex: "Exchange", body: dict) -> None:
    hello = await ex.hello()
    check_model(body.get("model"), hello.model)
    messages = _chat_messages(body)
    params = _options(body, hello.n_ctx)
    params.update(_tools(body))
    rf = _format(body)
    if rf is not None:
        params["response_format"] = rf
    await _run(ex, body, lambda c: c.generate(messages=messages, **params), chat=True)


# --------------------------------------------------------------------------- replies


def _done_fields(done, started: float) -> dict:
    t = done.timings
    ns = 1_000_000_000
    reason = {FinishReason.LENGTH: "length"}.get(done.finish_reason, "stop")
    return {
        "done": True,
        "done_reason": reason,
        "total_duration": int((time.monotonic() - started) * ns),
        "load_duration": 0,
        "prompt_eval_count": done.usage.prompt_tokens,
        "prompt_eval_duration": int(t.prompt_seconds * ns),
        "eval_count": done.usage.completion_tokens,
        "eval_duration": int(t.generation_seconds * ns),
    }


def _ollama_calls(done) -> list[dict]:
    out = []
    for call in done.tool_calls:
        try:
            args = json.loads(call.function.arguments or "{}")
        except ValueError:
            args = {}
        out.append({"function": {"name": call.function.name, "arguments": args}})
    return out


async def _run(ex: "Exchange", body: dict, start, chat: bool) -> None:
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise ApiError(HTTPStatus.BAD_REQUEST, "'stream' must be a boolean")
    model = body["model"]
    started = time.monotonic()

    def piece(text: str) -> dict:
        base = {"model": model, "created_at": _now()}
        if chat:
            base["message"] = {"role": "assistant", "content": text}
        else:
            base["response"] = text
        base["done"] = False
        return base

    def final(done):
        out = piece("" if stream else done.text)
        out.update(_done_fields(done, started))
        if not (chat and done.tool_calls):
            return out
        if not stream:
            out["message"]["tool_calls"] = _ollama_calls(done)
            return out
        calls = piece("")  # streamed, Ollama sends the calls in a message of their own, before the done line
        calls["message"]["tool_calls"] = _ollama_calls(done)
        return [calls, out]

    if not stream:
        ex.send_json(HTTPStatus.OK, final(await ex.run_to_done(start)))
        return

    def closing(done) -> list[bytes]:
        last = final(done)
        return [ndjson(line) for line in (last if isinstance(last, list) else [last])]

    await ex.relay(
        start,
        "application/x-ndjson",
        opening=lambda: [],
        each=lambda chunk: [ndjson(piece(chunk.text))] if chunk.text else [],
        closing=closing,
        failing=lambda exc: [ndjson(exc.body("ollama"))],
    )


async def _reply(ex: "Exchange", obj: dict, stream: bool) -> None:
    if stream:
        await ex.start_stream("application/x-ndjson", [ndjson(obj)])
        await ex.end_stream()
    else:
        ex.send_json(HTTPStatus.OK, obj)
