"""Embeddings on the bridge: OpenAI's ``POST /v1/embeddings`` and Ollama's
``POST /api/embed`` (and its older ``POST /api/embeddings``), each parsed into one
``EmbedRequest`` and sent to the daemon's ``embed`` op (``AsyncClient.embed``) in
pieces of ``DAEMON_BATCH`` inputs; the vectors are rendered back in the dialect's
shape.

- OpenAI: ``input`` a string, an array of strings, an array of token ids or an
  array of such arrays (ids of the embedding model's vocabulary, as llama-server
  takes them), at most 2,048 inputs; ``encoding_format`` ``float`` or ``base64``
  (little-endian float32, which the ``openai`` package asks for by default);
  ``dimensions``; ``user`` accepted. An input longer than the embedding context is
  cut to fit, as Ollama's OpenAI endpoint does (``truncate: false``, tandem's, makes
  it a 400). Any ``model`` name is accepted; the answer names the embedding model.
- Ollama: ``/api/embed`` with ``input`` (a string or an array of them),
  ``truncate`` (default true), ``dimensions``, ``options`` and ``keep_alive``
  (accepted), answered with ``embeddings`` (unit length), ``prompt_eval_count`` and
  durations in ns; an empty ``input`` is answered with no vectors (Ollama's way
  to load a model). ``/api/embeddings`` with ``prompt`` answers ``embedding``, not
  normalized (as Ollama's). ``model`` must name the embedding model (or ``tandem``).

A daemon without an embedding model answers 400 naming ``--embedding-model``
(a 400, not a 5xx: clients retry those, and this needs the daemon restarted).
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Optional

import numpy as np

from tandem.protocol import EMBED_FIX, MAX_EMBED_INPUTS

from .answers import ApiError
from .translate import bad_request, is_a, read

if TYPE_CHECKING:
    from .exchange import Exchange

MAX_INPUTS = 2048  # OpenAI's limit on inputs in one request
DAEMON_BATCH = 64  # inputs in one daemon request (a longer list is sent in several, one after the other)
ENCODINGS = ("float", "base64")


@dataclass
class EmbedRequest:
    """What to embed and how, as the daemon's embed op takes it."""

    texts: list[str] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    truncate: bool = True
    dimensions: Optional[int] = None
    normalize: bool = True
    encoding: str = "float"  # OpenAI's encoding_format

    @property
    def count(self) -> int:
        return len(self.texts) or len(self.tokens)

    def pieces(self, size: int = DAEMON_BATCH) -> list[dict]:
        """The daemon requests' arguments (``AsyncClient.embed``), ``size`` inputs each."""
        options = dict(truncate=self.truncate, dimensions=self.dimensions, normalize=self.normalize)
        if self.texts:
            return [dict(input=self.texts[i : i + size], **options) for i in range(0, len(self.texts), size)]
        return [dict(tokens=self.tokens[i : i + size], **options) for i in range(0, len(self.tokens), size)]


def no_embedding_model() -> ApiError:
    return ApiError(
        HTTPStatus.BAD_REQUEST, f"this daemon serves no embedding model. {EMBED_FIX}", code="no_embedding_model"
    )


def _dimensions(body: dict) -> Optional[int]:
    dims = read(body, "dimensions", (int,))
    if dims is not None and dims < 1:
        raise bad_request(f"'dimensions' must be 1 or more, got {dims}", param="dimensions")
    return dims


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(is_a(t, (int,)) and t >= 0 for t in value)


def parse_openai(body: dict) -> EmbedRequest:
    """OpenAI's embeddings request (``input``, ``encoding_format``, ``dimensions``, ``user``)."""
    value = body.get("input")
    req = EmbedRequest(
        truncate=bool(read(body, "truncate", (bool,), True)),
        dimensions=_dimensions(body),
        encoding=read(body, "encoding_format", (str,), "float"),
    )
    if req.encoding not in ENCODINGS:
        raise bad_request(f"'encoding_format' must be float or base64, got {req.encoding!r}", param="encoding_format")
    shape = "'input' must be a string, an array of strings, an array of token ids or an array of such arrays"
    if isinstance(value, str):
        req.texts = [value]
    elif _is_token_list(value):
        req.tokens = [value]
    elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        req.texts = value
    elif isinstance(value, list) and value and all(_is_token_list(v) for v in value):
        req.tokens = value
    elif value is None:
        raise bad_request("'input' is required: the text (or texts) to embed", param="input")
    elif value == []:
        raise bad_request("'input' is empty: give at least one text", param="input")
    else:
        raise bad_request(shape, param="input")
    if req.count > MAX_INPUTS:
        raise bad_request(f"'input' has {req.count} entries; the limit is {MAX_INPUTS}", param="input")
    empty = next((i for i, t in enumerate(req.texts) if not t), None)
    if empty is not None:
        raise bad_request(f"'input[{empty}]' is empty: there is nothing to embed", param="input")
    return req


def parse_ollama(body: dict) -> EmbedRequest:
    """Ollama's /api/embed (``input``, ``truncate``, ``dimensions``; ``options``, ``keep_alive`` accepted)."""
    value = body.get("input")
    req = EmbedRequest(truncate=bool(read(body, "truncate", (bool,), True)), dimensions=_dimensions(body))
    if isinstance(value, str):
        req.texts = [value] if value else []
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        req.texts = list(value)
    elif value is not None:
        raise ApiError(HTTPStatus.BAD_REQUEST, "invalid input type: 'input' must be a string or an array of strings")
    if req.count > MAX_INPUTS:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"'input' has {req.count} entries; the limit is {MAX_INPUTS}")
    empty = next((i for i, t in enumerate(req.texts) if not t), None)
    if empty is not None:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"'input[{empty}]' is empty: there is nothing to embed")
    return req


def parse_legacy(body: dict) -> EmbedRequest:
    """Ollama's older /api/embeddings (``prompt``): one vector, not normalized."""
    prompt = body.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise ApiError(HTTPStatus.BAD_REQUEST, "'prompt' must be a string")
    return EmbedRequest(texts=[prompt] if prompt else [], normalize=False)


def openai_answer(req: EmbedRequest, vectors: list[list[float]], model: str, prompt_tokens: int) -> dict:
    def encoded(v: list[float]) -> Any:
        if req.encoding == "base64":
            return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")
        return v

    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def check_model(name: Any, embedding_model: str) -> None:
    """Ollama's ``model`` must name the embedding model (with or without ``:latest``), or ``tandem``."""
    if not isinstance(name, str) or not name:
        raise ApiError(HTTPStatus.BAD_REQUEST, "'model' is required (the embedding model's name)")
    base = name.removesuffix(":latest")
    if base not in (embedding_model, embedding_model.removesuffix(":latest"), "tandem"):
        raise ApiError(
            HTTPStatus.NOT_FOUND,
            f"model '{name}' not found; this daemon embeds with '{embedding_model}' (its --embedding-model): "
            "ask for that name",
        )


async def _embed(ex: "Exchange", req: EmbedRequest) -> tuple[list[list[float]], int, str]:
    """(the vectors, the tokens read, the embedding model's name): the daemon's embed op,
    ``DAEMON_BATCH`` inputs at a time."""
    vectors: list[list[float]] = []
    tokens = 0
    async with ex.daemon() as client:
        model = client.server.embedding_model
        if not model:
            raise no_embedding_model()
        for piece in req.pieces(min(DAEMON_BATCH, MAX_EMBED_INPUTS)):
            reply = await client.embed(**piece, timeout=None)  # (the HTTP client's own timeout decides)
            vectors += reply.embeddings
            tokens += reply.prompt_tokens
    return vectors, tokens, model


async def openai_embeddings(ex: "Exchange", body: dict) -> None:
    req = parse_openai(body)
    vectors, tokens, model = await _embed(ex, req)
    ex.send_json(HTTPStatus.OK, openai_answer(req, vectors, model, tokens))


async def _embedding_model(ex: "Exchange", body: dict) -> str:
    async with ex.daemon() as client:
        model = client.server.embedding_model
    if not model:
        raise no_embedding_model()
    check_model(body.get("model"), model)
    return model


async def ollama_embed(ex: "Exchange", body: dict) -> None:
    started = time.monotonic()
    await _embedding_model(ex, body)
    req = parse_ollama(body)
    vectors, tokens = ([], 0) if not req.count else (await _embed(ex, req))[:2]
    ns = int((time.monotonic() - started) * 1e9)
    ex.send_json(
        HTTPStatus.OK,
        {
            "model": body["model"],
            "embeddings": vectors,
            "total_duration": ns,
            "load_duration": 0,
            "prompt_eval_count": tokens,
        },
    )


async def ollama_embeddings(ex: "Exchange", body: dict) -> None:
    await _embedding_model(ex, body)
    req = parse_legacy(body)
    vectors = (await _embed(ex, req))[0] if req.count else [[]]
    ex.send_json(HTTPStatus.OK, {"embedding": vectors[0]})
