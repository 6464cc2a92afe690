"""The daemon's decisions about requests, without sockets.

``Scheduler`` holds admission, the queue, the one running request, cache clears
waiting for the target, cancels, and every request's single terminal message.
The shell (server.py, with supervisor.py for the workers) owns the sockets; it hands the scheduler
what clients ask and what the target worker says, and the scheduler answers
through two callables: ``reply(identity, message)`` to a client, ``to_target(message)``
to the target worker (both return False when the peer cannot take it). A test
drives it with a fake target and a list of replies (tests/daemon/test_scheduler.py).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from tandem.protocol import (
    ActiveRequest,
    Busy,
    CacheClear,
    CacheCleared,
    CacheInfo,
    Cancel,
    Chunk,
    Complete,
    Decoding,
    Detokenized,
    Done,
    DraftStats,
    Error,
    ErrorCode,
    GovernorInfo,
    Message,
    Tokenized,
)

from .metrics import Metrics


@dataclass
class Job:
    """A generate or complete request, queued or running."""

    identity: bytes
    request: Decoding
    enqueued_at: float
    started_at: Optional[float] = None
    completion_tokens: int = 0
    last_tokens_at: Optional[float] = None  # when the latest chunk with tokens was relayed
    serial: int = 0  # arrival order among queued requests
    client_gone: bool = False


@dataclass
class Counters:
    requests: collections.Counter = field(default_factory=collections.Counter)
    tokens: collections.Counter = field(default_factory=collections.Counter)
    draft: DraftStats = field(default_factory=DraftStats)


MAX_TOKENIZING = 64  # tokenize/detokenize requests in flight at once (each is answered between two steps)
SHORT_PROMPT_CHARS = 16_000  # the short-request lane: a prompt of at most this many characters (about 4k tokens)


def prompt_chars(req: Decoding) -> int:
    """The size of a request's prompt, in characters of its text (before the template)."""
    if isinstance(req, Complete):
        return len(req.prefix) + len(req.suffix)
    messages = req.messages
    if messages is None:
        return len(req.prompt or "")
    tools = getattr(req, "tools", None)
    return sum(len(m.content) + len(m.reasoning or "") for m in messages) + len(str(tools) if tools else "")


@dataclass
class Lane:
    """The short-request lane: while a long request runs, one short request at a
    time is sent to the target, which serves it between two of the long one's
    rounds (target_worker's ``_lend``) and then resumes the long one, with the
    output it would have had. A request is short when it asks for at most
    ``max_tokens`` tokens with a prompt of at most SHORT_PROMPT_CHARS characters;
    a seeded sampling request on a daemon with a drafter never is (it would decode
    without the drafter, so its tokens would differ from its run alone). The long
    request always progresses: after a short one took d seconds, the next may
    start d seconds later at the earliest (the long one keeps at least half)."""

    max_tokens: int = 512  # 0: no lane
    drafter: bool = False
    open_at: float = 0.0  # the next short request may start from then
    preemptions: int = 0
    seconds: float = 0.0  # spent on short requests while long ones waited

    def is_short(self, req: Decoding) -> bool:
        if not 0 < req.max_tokens <= self.max_tokens or prompt_chars(req) > SHORT_PROMPT_CHARS:
            return False
        return not (self.drafter and req.seed is not None and req.temperature > 0)


class Scheduler:
    def __init__(
        self,
        reply: Callable[[bytes, Message], bool],
        relay: Callable[[bytes, list[bytes]], bool],
        to_target: Callable[[Message], bool],
        metrics: Metrics,
        max_queue: int,
        clock: Callable[[], float] = time.monotonic,
        lane: Optional[Lane] = None,
    ):
        """``relay(identity, frames)`` sends a chunk as the worker encoded it."""
        self.reply, self.relay, self.to_target = reply, relay, to_target
        self.metrics = metrics
        self.max_queue = max_queue
        self.clock = clock
        self.lane = lane if lane is not None else Lane(max_tokens=0)
        self.queue: collections.deque[Job] = collections.deque()
        self.active: Optional[Job] = None
        self.nested: Optional[Job] = None  # a short request the target serves within the active one (``Lane``)
        self.jobs: dict[str, Job] = {}  # by request id, queued or running
        self.serial = 0
        # cache clears waiting for the target: all of them are done by the next one it runs (coalesced)
        self.clears: list[tuple[bytes, CacheClear]] = []
        self.clearing: Optional[list[tuple[bytes, CacheClear]]] = None  # those the clear sent to the target answers
        self.closing = False  # shutting down: nothing new is taken
        self.tokenizing: dict[str, bytes] = {}  # tokenize/detokenize sent to the target: who asked
        self.counters = Counters()
        self.failure = ""  # why the daemon failed ("" while it has not): requests are refused
        self.governor: Optional[GovernorInfo] = None  # the target's latest report
        self.cache: Optional[CacheInfo] = None  # likewise
        self.on_request_done: Callable[[], None] = lambda: None  # the target finished a request

    # ------------------------------------------------------------------ from clients

    def admit(self, identity: bytes, msg: Decoding) -> None:
        """Queue a request, or answer why not."""
        if self._refused(identity, msg):
            return
        if len(self.queue) >= self.max_queue:
            self.counters.requests["busy"] += 1
            self.metrics.request_ended("busy")
            self.reply(
                identity,
                Busy(
                    id=msg.id,
                    queue_length=len(self.queue),
                    max_queue=self.max_queue,
                    message=f"the queue is full ({len(self.queue)} waiting); retry later or raise --max-queue",
                ),
            )
            return
        self.serial += 1
        job = Job(identity=identity, request=msg, enqueued_at=self.clock(), serial=self.serial)
        self.jobs[msg.id] = job
        self.queue.append(job)

    def cancel(self, request_id: str) -> bool:
        """Cancel a queued or running request; False when there is none by that id."""
        job = self.jobs.get(request_id)
        if job is not None:
            self._cancel(job)
        return job is not None

    def cancel_active(self) -> None:
        """Have the target stop the running request, and a short one sent within it (the daemon is shutting down)."""
        for job in (self.nested, self.active):
            if job is not None:
                self._cancel(job)

    def client_gone(self, identity: bytes) -> None:
        """The peer disconnected: cancel what it asked for; nobody is left to answer."""
        for job in list(self.jobs.values()):
            if job.identity == identity:
                job.client_gone = True
                self._cancel(job)

    def clear_cache(self, identity: bytes, msg: CacheClear) -> None:
        """Clear the prefix cache after the running request, before the next one."""
        if self.closing:
            self.reply(identity, Error.of(msg.id, ErrorCode.SHUTTING_DOWN, "the daemon is shutting down"))
            return
        if self.failure:
            self.reply(identity, self._failed(msg.id))
            return
        if len(self.clears) >= self.max_queue:  # (they are coalesced: the bound is only on waiters)
            why = f"{len(self.clears)} cache clears are waiting already; retry later"
            self.reply(identity, Busy(id=msg.id, queue_length=len(self.clears), max_queue=self.max_queue, message=why))
            return
        self.clears.append((identity, msg))

    def _refused(self, identity: bytes, msg: Message) -> bool:
        """Answer a request (generate, complete, tokenize) that cannot be taken: the daemon is
        shutting down or has failed, or its id is in use. True when it was answered."""
        if self.closing:
            self.reply(identity, Error.of(msg.id, ErrorCode.SHUTTING_DOWN, "the daemon is shutting down"))
            return True
        if self.failure:
            self.reply(identity, self._failed(msg.id))
            return True
        owner = self.jobs[msg.id].identity if msg.id in self.jobs else self.tokenizing.get(msg.id)
        if owner is None:
            return False
        why = f"a request with id {msg.id!r} is already queued or running; give each request a new id"
        # the same connection: an error with that id would land on its own live request's stream
        self.reply(identity, Error.of(None if owner == identity else msg.id, ErrorCode.DUPLICATE_REQUEST_ID, why))
        return True

    def tokenize(self, identity: bytes, msg: Message) -> None:
        """A tokenize or detokenize: not queued, the target answers it between steps."""
        if self._refused(identity, msg):
            return
        if len(self.tokenizing) >= MAX_TOKENIZING:
            why = f"{len(self.tokenizing)} tokenize requests are being answered already; retry"
            self.reply(
                identity, Busy(id=msg.id, queue_length=len(self.tokenizing), max_queue=MAX_TOKENIZING, message=why)
            )
            return
        self.tokenizing[msg.id] = identity
        if not self.to_target(msg):
            self._answer_tokenizing(ErrorCode.WORKER_DIED, "the model worker could not take the request; retry")

    def _answer_tokenizing(self, code: ErrorCode, message: str) -> None:
        for request_id, identity in list(self.tokenizing.items()):
            self.reply(identity, Error.of(request_id, code, message))
        self.tokenizing.clear()

    # ------------------------------------------------------------------ the target

    @property
    def busy(self) -> bool:
        """The target is working for us (a request or a clear): it must show signs of life."""
        return self.active is not None or self.clearing is not None

    def start_next(self) -> bool:
        """Give the target its next piece of work, if it is idle: a waiting cache
        clear first, else the oldest request; while it runs a long request, the
        oldest short one, through the lane. True when something was sent.
        The caller calls this only while the target can take work."""
        if self.busy:
            return self._start_short()
        if self.clears:
            self.clearing, self.clears = self.clears, []  # one clear answers every clear waiting
            first = self.clearing[0][1]  # (the disk too, if any of them asks for it)
            memory_only = all(m.memory_only for _, m in self.clearing)
            if not self.to_target(dataclasses.replace(first, memory_only=memory_only)):
                self.clear_failed("the model worker could not take the request")
            return True
        if not self.queue:
            return False
        job = self.queue.popleft()
        job.started_at = self.clock()
        self.active = job
        self.to_target(job.request)
        return True

    def _start_short(self) -> bool:
        """The lane: the oldest short request, sent while a long one runs (``Lane``)."""
        lane, active = self.lane, self.active
        if not lane.max_tokens or active is None or self.nested is not None or self.clearing or self.clears:
            return False  # (a cache clear asked for first goes first)
        if self.closing or self.clock() < lane.open_at or lane.is_short(active.request):
            return False
        job = next((j for j in self.queue if lane.is_short(j.request)), None)
        if job is None:
            return False
        self.queue.remove(job)
        job.started_at = self.clock()
        self.nested = job
        self.to_target(job.request)
        return True

    def on_target_message(self, msg: Message, frames: list[bytes]) -> bool:
        """A chunk, done, error or cache_cleared from the target; chunks are relayed
        as the worker encoded them. False: the message is about no request of ours."""
        if isinstance(msg, (Tokenized, Detokenized)) or (
            isinstance(msg, Error)
            and msg.id in self.tokenizing
            and (self.active is None or self.active.request.id != msg.id)
        ):
            identity = self.tokenizing.pop(msg.id, None)
            if identity is not None:
                self.reply(identity, msg)
            return True
        if isinstance(msg, CacheCleared):
            if self.clearing is not None and msg.id == self.clearing[0][1].id:
                self.cache = msg.cache
                if msg.cache is not None:
                    self.metrics.cache_seen(msg.cache)
                for i, (identity, waiting) in enumerate(self.clearing):
                    self.reply(identity, msg if i == 0 else dataclasses.replace(msg, id=waiting.id))
                self.clearing = None
            return True
        job = next((j for j in (self.active, self.nested) if j is not None and msg.id == j.request.id), None)
        if job is None:
            return False
        if isinstance(msg, Chunk):
            self._relay_chunk(job, msg, frames)
            return True
        if isinstance(msg, Done):
            self.on_request_done()
            msg.serial = job.serial
            # its wait here, and in the worker for a round of the running request to end (the lane)
            msg.timings.queued_seconds += (job.started_at or job.enqueued_at) - job.enqueued_at
            if msg.governor is not None:
                self.governor = msg.governor
            if msg.cache is not None:
                self.cache = msg.cache
        self._finish(job, msg)
        return True

    def _relay_chunk(self, job: Job, msg: Chunk, frames: list[bytes]) -> None:
        job.completion_tokens += len(msg.token_ids)
        if msg.token_ids:
            now = self.clock()
            if job.last_tokens_at is not None:  # the first chunk's wait is the time to first token
                self.metrics.tokens_relayed(len(msg.token_ids), now - job.last_tokens_at)
            job.last_tokens_at = now
        if not job.client_gone and not self.relay(job.identity, frames):
            job.client_gone = True
            self._cancel(job)

    def abort(self, code: ErrorCode, message: str, why: str) -> None:
        """The target is gone (``why``): answer what it was doing, the request
        with ``code`` and ``message``, a cache clear with why it was not done."""
        self.clear_failed(why)
        self._answer_tokenizing(ErrorCode.WORKER_DIED, f"{why}; retry")
        for job in (self.nested, self.active):
            if job is not None:
                self._finish(job, Error.of(job.request.id, code, message))
        self.active = self.nested = None

    def clear_failed(self, why: str) -> None:
        if self.clearing is not None:
            waiting, self.clearing = self.clearing, None
            for identity, msg in waiting:
                self.reply(
                    identity, Error.of(msg.id, ErrorCode.WORKER_DIED, f"the cache was not cleared: {why}; retry")
                )

    # ------------------------------------------------------------------ the daemon's state

    def fail(self, message: str) -> None:
        """The daemon cannot serve: refuse what waits and what comes."""
        self.failure = message
        for job in list(self.queue):
            self.queue.remove(job)
            self._finish(job, Error.of(job.request.id, ErrorCode.NOT_READY, message))
        for identity, msg in self.clears:
            self.reply(identity, self._failed(msg.id))
        self.clears = []

    def shutting_down(self) -> None:
        """Answer everything that waits; the running request is the caller's to cancel."""
        self.closing = True
        self._answer_tokenizing(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down")
        for identity, msg in [*self.clears, *(self.clearing or [])]:
            self.reply(identity, Error.of(msg.id, ErrorCode.SHUTTING_DOWN, "the daemon is shutting down"))
        self.clears.clear()
        self.clearing = None
        for job in list(self.queue):
            self.queue.remove(job)
            self._finish(job, Error.of(job.request.id, ErrorCode.SHUTTING_DOWN, "the daemon is shutting down"))

    def active_request(self, nested: bool = False) -> Optional[ActiveRequest]:
        """The running request (``nested``: the short one served within it, if any)."""
        job = self.nested if nested else self.active
        if job is None:
            return None
        now = self.clock()
        return ActiveRequest(
            id=job.request.id, elapsed_seconds=now - (job.started_at or now), completion_tokens=job.completion_tokens
        )

    # ------------------------------------------------------------------ ending requests

    def _failed(self, request_id: str) -> Error:
        return Error.of(request_id, ErrorCode.NOT_READY, f"the daemon has failed: {self.failure}")

    def _cancel(self, job: Job) -> None:
        if job is self.active or job is self.nested:
            self.to_target(Cancel(id=job.request.id, request_id=job.request.id))
        else:
            self.queue.remove(job)
            self._finish(job, self._cancelled_done(job))

    def _cancelled_done(self, job: Job) -> Done:
        done = Done.cancelled(job.request.id, queued_seconds=self.clock() - job.enqueued_at)
        done.serial = job.serial
        return done

    def _finish(self, job: Job, terminal: Message) -> None:
        """Deliver a request's one terminal message and forget the request."""
        self.jobs.pop(job.request.id, None)
        if job is self.nested:  # served within the running request (or answered before it started)
            self.nested = None
            now = self.clock()
            spent = now - (job.started_at or now)
            if isinstance(terminal, Done):  # the worker's own time for it (not its wait for a round's end)
                spent = min(spent, terminal.timings.prompt_seconds + terminal.timings.generation_seconds)
            self.lane.open_at = now + spent  # the long request's turn: at least as long
            self.lane.preemptions += 1
            self.lane.seconds += spent
            self.metrics.preempted(spent)
        elif job is self.active:
            # a short request sent within it and not served yet: the target serves it next
            self.active, self.nested = self.nested, None
        if isinstance(terminal, Done):
            if terminal.draft is not None:
                self.counters.draft.merge(terminal.draft)
            self.counters.requests[f"done_{terminal.finish_reason.value}"] += 1
            self.counters.tokens["prompt"] += terminal.usage.prompt_tokens
            self.counters.tokens["completion"] += terminal.usage.completion_tokens
            self.metrics.request_ended(terminal.finish_reason.value, terminal, streamed=job.request.stream)
        else:
            self.counters.requests["error"] += 1
            self.metrics.request_ended("error")
        if not job.client_gone:
            self.reply(job.identity, terminal)
