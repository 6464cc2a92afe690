"""The bridge's routes: which dialect answers which method and path (server.py serves them)."""

from __future__ import annotations

from http import HTTPStatus
from typing import TYPE_CHECKING

from . import anthropic_api, embeddings, ollama_api, openai_bridge, responses_api
from .answers import ApiError

if TYPE_CHECKING:
    from .exchange import Exchange

_MANAGE = {"/api/pull": "tandem pull NAME", "/api/delete": "tandem rm NAME"}


# llama-server serves these OpenAI routes without /v1 too (not /completions: there it is its own native API)
_UNVERSIONED = ("/chat/completions", "/models", "/responses")


_GET = {"", "/health", "/api/version", "/api/tags", "/api/ps", "/v1/models"}
_POST = {
    *("/api/generate", "/api/chat", "/api/show", "/api/embed", "/api/embeddings"),
    *("/api/pull", "/api/push", "/api/create", "/api/copy"),
    *("/v1/messages", "/v1/messages/count_tokens", "/v1/completions", "/v1/chat/completions", "/v1/responses"),
    "/v1/embeddings",
    *("/tokenize", "/detokenize", "/v1/tokenize"),
}


def allowed(path: str) -> tuple[str, ...]:
    """The methods ``path`` is served with (none: no such route)."""
    if path in _GET or path.startswith("/v1/models/"):
        return ("GET", "HEAD")
    if path == "/api/delete":  # Ollama's is DELETE
        return ("DELETE", "POST")
    if path in _POST or path.startswith("/api/blobs"):
        return ("POST",)
    return ()


async def route(ex: "Exchange") -> None:
    method, path = ex.method, ex.path
    if path in _UNVERSIONED or path.startswith("/models/"):
        path = "/v1" + path
    methods = allowed(path)
    if not methods:
        hint = (
            "try GET /v1/models"
            if method in ("GET", "HEAD")
            else "tandem serves /v1/completions, /v1/chat/completions, /v1/responses and /v1/messages"
        )
        raise ApiError(HTTPStatus.NOT_FOUND, f"no route {method} {path}; {hint}")
    if method not in methods:
        allow = ", ".join(methods)
        raise ApiError(
            HTTPStatus.METHOD_NOT_ALLOWED, f"no route {method} {path} (it takes {allow})", headers={"Allow": allow}
        )
    if method in ("GET", "HEAD"):
        return await _get(ex, path)
    if path.startswith("/api/"):
        ollama = {"/api/generate": ollama_api.generate, "/api/chat": ollama_api.chat, "/api/show": ollama_api.show}
        if path in ollama:
            body = await ex.body()
            return await ollama[path](ex, with_sampling(ex, body) if path != "/api/show" else body)
        if path == "/api/embed":
            return await embeddings.ollama_embed(ex, await ex.body())
        if path == "/api/embeddings":
            return await embeddings.ollama_embeddings(ex, await ex.body())
        if path in _MANAGE or path in ("/api/push", "/api/create", "/api/copy") or path.startswith("/api/blobs"):
            raise ApiError(
                HTTPStatus.NOT_IMPLEMENTED,
                f"{path} is not served over HTTP: models are managed with the tandem command "
                f"({_MANAGE.get(path, 'tandem models --help')})",
            )
    if path == "/v1/messages":
        return await anthropic_api.messages(ex, with_sampling(ex, await ex.body()))
    if path == "/v1/responses":
        return await responses_api.responses(ex, with_sampling(ex, await ex.body()))
    if path == "/v1/embeddings":
        return await embeddings.openai_embeddings(ex, await ex.body())
    if path == "/v1/messages/count_tokens":
        return await anthropic_api.count_tokens(ex, await ex.body())
    if path in ("/tokenize", "/detokenize", "/v1/tokenize"):
        return await openai_bridge.tokens(ex, path, await ex.body())
    parse = {"/v1/completions": openai_bridge.parse_completions, "/v1/chat/completions": openai_bridge.parse_chat}
    await openai_bridge.generate(ex, parse[path](with_sampling(ex, await ex.body())))


def with_sampling(ex: "Exchange", body: dict) -> dict:
    """``body`` with the bridge's sampling (``tandem http --temperature`` ...) where it sets none (or null):
    at its top, or in Ollama's ``options``. What it sets itself holds, as with llama-server's --temp."""
    if not ex.server.sampling:
        return body
    where = body
    if ex.dialect == "ollama":
        if body.get("options") is None:
            body["options"] = {}
        where = body["options"]
        if not isinstance(where, dict):
            return body  # (the dialect refuses it: ollama_api._options)
    for key, value in ex.server.sampling.items():
        if where.get(key) is None:
            where[key] = value
    return body


async def _get(ex: "Exchange", path: str) -> None:
    if path == "/api/version":
        ex.send_json(HTTPStatus.OK, {"version": ollama_api.API_VERSION})
    elif path == "/api/tags":
        ex.send_json(HTTPStatus.OK, await ollama_api.tags(ex))
    elif path == "/api/ps":
        ex.send_json(HTTPStatus.OK, await ollama_api.ps(ex))
    elif path == "/v1/models":
        await openai_bridge.models(ex)
    elif path.startswith("/v1/models/"):
        await openai_bridge.model(ex, path[len("/v1/models/") :])
    elif path in ("", "/health"):  # (HEAD / is what some Ollama clients probe before they start)
        # open without the API key, as llama-server's: then it says no more than that the bridge is up
        keyed = ex.server.api_key is not None
        ex.send_json(HTTPStatus.OK, {"status": "ok"} if keyed else {"status": "ok", "model": ex.server.model})
    else:
        raise ApiError(HTTPStatus.NOT_FOUND, f"no route {ex.method} {path}; try GET /v1/models")
