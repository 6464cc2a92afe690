"""The daemon's embed requests, without sockets: admission, their own queue, the one
the embedding worker computes, and each one's single answer.

Embed requests never wait behind a generation: the embedding model has its own
worker (supervisor.py starts and restarts it), so ``EmbedQueue`` hands it the
oldest request whenever it is idle and ready. Like the Scheduler it answers
through callables: ``reply(identity, message)`` to a client, ``to_worker(message)``
to the embedding worker (False when it cannot take it). A test drives it with
fakes (tests/daemon/test_embed_queue.py).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Callable, Optional

from tandem.protocol import EMBED_FIX, Busy, Cancel, Embed, Embedded, Error, ErrorCode, Message

from .metrics import Metrics


@dataclass
class EmbedJob:
    identity: bytes
    request: Embed
    enqueued_at: float
    started_at: Optional[float] = None
    client_gone: bool = False


class EmbedQueue:
    def __init__(
        self,
        reply: Callable[[bytes, Message], bool],
        to_worker: Callable[[Message], bool],
        metrics: Metrics,
        max_queue: int,
        model: str = "",
        counters=None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``model``: the embedding model's name ("" when the daemon has none). ``counters``:
        the Scheduler's (``requests``, ``tokens``), which status shows; embeds count as
        ``embed`` and ``embed_error``, their tokens as ``embedding``."""
        self.reply, self.to_worker = reply, to_worker
        self.metrics = metrics
        self.max_queue = max_queue
        self.model = model
        self.counters = counters
        self.clock = clock
        self.queue: collections.deque[EmbedJob] = collections.deque()
        self.active: Optional[EmbedJob] = None
        self.jobs: dict[str, EmbedJob] = {}
        self.off = ""  # why embeddings are off until the daemon restarts ("" while they are not)
        self.closing = False

    # ------------------------------------------------------------------ from clients

    def admit(self, identity: bytes, msg: Embed, failure: str = "", id_owner: Optional[bytes] = None) -> None:
        """Queue an embed, or answer why not. ``failure``: why the daemon has failed ("" if it has not);
        ``id_owner``: the connection of another request with this id (a generate, a tokenize), if any."""
        refusal = self._refusal(msg, failure)
        if refusal is not None:
            self._refuse(identity, refusal)
            return
        owner = self.jobs[msg.id].identity if msg.id in self.jobs else id_owner
        if owner is not None:
            why = f"a request with id {msg.id!r} is already queued or running; give each request a new id"
            # the same connection: an error with that id would land on its own live request's stream
            self._refuse(identity, Error.of(None if owner == identity else msg.id, ErrorCode.DUPLICATE_REQUEST_ID, why))
            return
        if len(self.queue) >= self.max_queue:
            why = f"{len(self.queue)} embed requests wait already; retry later or raise --max-queue"
            self._count("busy")
            self.metrics.embed_ended("busy")
            self.reply(identity, Busy(id=msg.id, queue_length=len(self.queue), max_queue=self.max_queue, message=why))
            return
        job = EmbedJob(identity=identity, request=msg, enqueued_at=self.clock())
        self.jobs[msg.id] = job
        self.queue.append(job)

    def _refusal(self, msg: Embed, failure: str) -> Optional[Error]:
        if not self.model:
            why = f"this daemon serves no embedding model. {EMBED_FIX}"
            return Error.of(msg.id, ErrorCode.NO_EMBEDDING_MODEL, why)
        if self.closing:
            return Error.of(msg.id, ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        if failure:
            return Error.of(msg.id, ErrorCode.NOT_READY, f"the daemon has failed: {failure}")
        if self.off:
            return Error.of(msg.id, ErrorCode.NOT_READY, self._off_message())
        return None

    def _off_message(self) -> str:
        return f"embeddings are off: the embedding model {self.model} {self.off}; restart the daemon to embed again"

    def _refuse(self, identity: bytes, error: Error) -> None:
        self._count("embed_error")
        self.metrics.embed_ended("error")
        self.reply(identity, error)

    def client_gone(self, identity: bytes) -> None:
        """The peer disconnected: drop what it queued, cancel what the worker computes for it."""
        for job in list(self.jobs.values()):
            if job.identity != identity:
                continue
            job.client_gone = True
            if job is self.active:
                self.to_worker(Cancel(id=job.request.id, request_id=job.request.id))
            else:
                self.queue.remove(job)
                self.jobs.pop(job.request.id, None)

    # ------------------------------------------------------------------ the worker

    def start_next(self) -> bool:
        """Hand the worker the oldest request, if it is idle (the caller calls this only
        while the worker is ready). True when one was sent."""
        if self.active is not None or not self.queue:
            return False
        job = self.queue.popleft()
        job.started_at = self.clock()
        self.active = job
        if not self.to_worker(job.request):  # (its death is noticed and answered by the supervisor)
            self.abort(ErrorCode.WORKER_DIED, "the embedding worker could not take the request; retry")
        return True

    def on_worker_message(self, msg: Message) -> bool:
        """An ``embed`` reply or an error from the worker; False: about no request of ours."""
        job = self.active
        if job is None or not isinstance(msg, (Embedded, Error)) or msg.id != job.request.id:
            return False
        if isinstance(msg, Embedded):
            msg.queued_seconds = (job.started_at or job.enqueued_at) - job.enqueued_at
        self._finish(job, msg)
        return True

    def abort(self, code: ErrorCode, message: str) -> None:
        """The worker is gone: answer what it computed."""
        if self.active is not None:
            self._finish(self.active, Error.of(self.active.request.id, code, message))

    def switch_off(self, why: str) -> None:
        """No embeddings until the daemon restarts (the model did not load, or its worker
        died too often): answer what waits, and from now on what comes."""
        self.off = why
        self.abort(ErrorCode.NOT_READY, self._off_message())
        for job in list(self.queue):
            self.queue.remove(job)
            self._finish(job, Error.of(job.request.id, ErrorCode.NOT_READY, self._off_message()))

    def shutting_down(self) -> None:
        self.closing = True
        for job in [*self.queue, *([self.active] if self.active else [])]:
            self._finish(job, Error.of(job.request.id, ErrorCode.SHUTTING_DOWN, "the daemon is shutting down"))
        self.queue.clear()

    # ------------------------------------------------------------------ answers

    def _count(self, key: str, tokens: int = 0) -> None:
        if self.counters is not None:
            self.counters.requests[key] += 1
            if tokens:
                self.counters.tokens["embedding"] += tokens

    def _finish(self, job: EmbedJob, terminal: Message) -> None:
        self.jobs.pop(job.request.id, None)
        if job is self.active:
            self.active = None
        if isinstance(terminal, Embedded):
            self._count("embed", terminal.prompt_tokens)
            self.metrics.embed_ended("done", len(terminal.embeddings), terminal.prompt_tokens)
        else:
            self._count("embed_error")
            self.metrics.embed_ended("error")
        if not job.client_gone:
            self.reply(job.identity, terminal)
