"""The embedding worker process: the daemon's ``embed`` requests, one at a time.

It runs at the lowest CPU priority there is (``lowest_priority``: Linux's
SCHED_IDLE), so the cores are the target's whenever it wants them: a generation
that starts while a batch of inputs is being read preempts it at once, and
embedding goes on in what the target leaves idle. The daemon also tells it when
a generation runs (``pace``): then it reads in slices of ``BUSY_SLICE_TOKENS``
on ``BUSY_THREADS`` thread (a thread of ggml's that gets a core while its sibling
waits for one would spin the core away at each barrier), and between slices it
reads the daemon's messages. Idle, it uses every thread and whole batches.

``Embedding`` is the logic without sockets (tokenize, fit, batch, pool, finish);
``EmbedLoop`` the process's socket to the daemon.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable, Optional

import numpy as np
import zmq

from tandem.protocol import (
    Cancel,
    Embed,
    Embedded,
    Error,
    ErrorCode,
    ProtocolError,
    Shutdown,
    decode,
    encode,
)
from tandem.protocol.internal import EMBEDDER_REQUESTS, Pace, Progress, Ready

from ..worker.worker_config import WorkerConfig, describe_model
from .vectors import MAX_SEQS, TooLong, finish, fit, max_inputs, next_batch

log = logging.getLogger("tandem.embedding")

BUSY_SLICE_TOKENS = 64  # while a generation runs: tokens read in one llama_decode (a longer input alone)
BUSY_THREADS = 1
HEARTBEAT_SECONDS = 1.0


class Cancelled(Exception):
    """The daemon cancelled the request being computed (its client went away)."""


class Stop(Exception):
    """The daemon asked the worker to exit."""


def lowest_priority() -> str:
    """Put the calling thread, and the threads it starts from now on (llama.cpp's), at the
    lowest CPU priority: SCHED_IDLE, which runs only where nothing else wants the core; nice 19
    where that cannot be had. Returns what it got."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return "SCHED_IDLE"
    except (AttributeError, OSError):
        pass
    try:
        os.nice(19 - os.nice(0))
        return "nice 19"
    except OSError as exc:
        return f"normal priority (neither SCHED_IDLE nor nice 19: {exc})"


class Embedding:
    """An embed request computed on ``model`` (llama_embed.EmbeddingModel, or a fake with its
    attributes): ``generating`` says whether the target is decoding (read in small slices, one thread)."""

    def __init__(self, model, name: str):
        self.model = model
        self.name = name
        self.generating = False

    def prepare(self, req: Embed) -> tuple[list[list[int]], int]:
        """Each input's tokens within the context, and how many were cut. ValueError
        (TooLong) for what cannot be embedded as asked."""
        m = self.model
        n = len(req.input) or len(req.tokens)
        dims = m.n_embd if req.dimensions is None else req.dimensions
        if dims > m.n_embd:
            raise ValueError(f"'dimensions' is {req.dimensions}; {self.name}'s vectors have {m.n_embd}")
        limit = max_inputs(dims)
        if n > limit:
            raise ValueError(
                f"{n} vectors of {dims} dimensions do not fit one reply (4 MiB): send at most {limit} inputs a request"
            )
        seqs, cut = [], 0
        if req.input:
            for i, text in enumerate(req.input):
                tokens, was_cut = fit(m.tokenize(text), m.n_ctx, m.head, m.tail, req.truncate, f"input {i}")
                seqs.append(tokens)
                cut += was_cut
        else:
            for i, ids in enumerate(req.tokens):
                bad = next((t for t in ids if t >= m.n_vocab), None)
                if bad is not None:
                    raise ValueError(f"'tokens[{i}]' has token id {bad}; {self.name}'s vocabulary has {m.n_vocab}")
                tokens, was_cut = fit(list(ids), m.n_ctx, 0, 0, req.truncate, f"tokens[{i}]")
                seqs.append(tokens)
                cut += was_cut
        if any(not s for s in seqs):  # (a text of no tokens: only where the model adds none around it)
            i = next(i for i, s in enumerate(seqs) if not s)
            raise ValueError(f"input {i} has no tokens for {self.name}")
        return seqs, cut

    def run(self, req: Embed, between: Callable[[], None]) -> Embedded:
        """The request's vectors; ``between()`` runs before each pass (it may change
        ``generating``, or raise Cancelled or Stop)."""
        started = time.perf_counter()
        seqs, cut = self.prepare(req)
        m = self.model
        lengths = [len(s) for s in seqs]
        vectors = np.empty((len(seqs), m.n_embd), dtype=np.float32)
        i = 0
        while i < len(seqs):
            between()
            m.set_threads(BUSY_THREADS if self.generating else m.max_threads)
            j = next_batch(lengths, i, BUSY_SLICE_TOKENS if self.generating else m.n_ctx, MAX_SEQS)
            vectors[i:j] = m.embed(seqs[i:j])
            i = j
        return Embedded(
            id=req.id,
            model=self.name,
            embeddings=finish(vectors, req.dimensions, req.normalize),
            prompt_tokens=sum(lengths),
            input_tokens=lengths,
            truncated=cut,
            seconds=time.perf_counter() - started,
        )


class EmbedLoop:
    """The embedding worker's socket to the daemon: ready (or why not), then embed requests."""

    def __init__(self, config: WorkerConfig, sock: zmq.Socket):
        self.config = config
        self.sock = sock
        self.embedding: Optional[Embedding] = None
        self.waiting: list[Embed] = []  # embeds that came while one was computed (the daemon sends one at a time)
        self._heartbeat = 0.0

    def run(self) -> None:
        c = self.config
        priority = lowest_priority()
        try:
            from .llama_embed import EmbeddingModel

            model = EmbeddingModel(c.model_path, n_threads=c.settings.threads, flash_attn=c.settings.flash_attn)
            info = describe_model(model, c, has_chat_template=False)
        except Exception as exc:  # a file llama.cpp cannot load, a reranker: the daemon serves on without embeddings
            why = f"could not load the embedding model {c.model_path}: {exc}"
            self.sock.send_multipart(encode(Error.of(c.role, ErrorCode.NOT_READY, why)))
            return
        log.info(
            "embedding model %s: %d dimensions, %s pooling, inputs up to %d tokens, %s",
            model.path.name,
            model.n_embd,
            model.pooling,
            model.n_ctx,
            priority,
        )
        self.embedding = Embedding(model, c.model_name)
        self.sock.send_multipart(encode(Ready(id=c.role, model=info, pid=os.getpid())))
        try:
            while True:
                req = self.waiting.pop(0) if self.waiting else self._receive(block=True)
                if isinstance(req, Embed):
                    self._serve(req)
        except Stop:
            return

    def _receive(self, block: bool):
        """The next message the loop acts on (an Embed or a Cancel); pace is applied
        here; Stop on shutdown. None when ``block`` is False and nothing waits."""
        while block or self.sock.poll(0):
            frames = self.sock.recv_multipart()
            try:
                msg = decode(frames, table=EMBEDDER_REQUESTS)
            except ProtocolError as exc:
                log.error("undecodable message from the daemon: %s", exc.message)
                continue
            if isinstance(msg, Shutdown):
                raise Stop()
            if isinstance(msg, Pace):
                self.embedding.generating = msg.generating
                continue
            return msg
        return None

    def _between(self, request_id: str) -> None:
        now = time.monotonic()
        if now - self._heartbeat >= HEARTBEAT_SECONDS:
            self.sock.send_multipart(encode(Progress(id=request_id)))
            self._heartbeat = now
        while (msg := self._receive(block=False)) is not None:
            if isinstance(msg, Cancel) and msg.request_id == request_id:
                raise Cancelled()
            if isinstance(msg, Embed):
                self.waiting.append(msg)

    def _serve(self, req: Embed) -> None:
        self._heartbeat = 0.0
        try:
            reply = self.embedding.run(req, lambda: self._between(req.id))
        except Cancelled:
            reply = Error.of(req.id, ErrorCode.INTERNAL, "cancelled: its client went away")
        except TooLong as exc:
            reply = Error.of(req.id, ErrorCode.PROMPT_TOO_LONG, str(exc))
        except ValueError as exc:
            reply = Error.of(req.id, ErrorCode.INVALID_REQUEST, f"embed: {exc}")
        except Stop:
            raise
        except Exception as exc:  # a llama.cpp failure: answer it, keep serving
            log.exception("embedding failed")
            reply = Error.of(req.id, ErrorCode.INTERNAL, f"the embedding model failed: {type(exc).__name__}: {exc}")
        self.sock.send_multipart(encode(reply))
