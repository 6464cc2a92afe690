"""The scheduler without sockets: admission, order, cancels, deaths and shutdown,
driven by a fake target that records what it was sent, and the short-request lane (pure logic; the real
daemon is exercised with a real model in tests/integration and tests/reliability)."""

from __future__ import annotations

import pytest

from tandem.daemon.front.metrics import Metrics
from tandem.daemon.front.scheduler import SHORT_PROMPT_CHARS, Lane, Scheduler
from tandem.protocol import (
    Busy,
    CacheClear,
    CacheCleared,
    Cancel,
    ChatMessage,
    Chunk,
    Complete,
    Done,
    DraftStats,
    Error,
    ErrorCode,
    FinishReason,
    Generate,
    Timings,
    Usage,
    encode,
)


class Harness:
    """A scheduler, what it said to each client, and what it sent the target."""

    def __init__(self, clock, max_queue: int = 4, target_up: bool = True):
        self.clock = clock
        self.replies: list[tuple[bytes, object]] = []
        self.relayed: list[tuple[bytes, list[bytes]]] = []
        self.to_target: list[object] = []
        self.target_up = target_up
        self.gone: set[bytes] = set()  # clients whose sends fail
        self.metrics = Metrics(lambda: {})
        self.done_count = 0
        self.s = Scheduler(self._reply, self._relay, self._send_target, self.metrics, max_queue, clock=self.clock)
        self.s.on_request_done = self._done

    def _reply(self, identity, msg) -> bool:
        self.replies.append((identity, msg))
        return identity not in self.gone

    def _relay(self, identity, frames) -> bool:
        self.relayed.append((identity, frames))
        return identity not in self.gone

    def _send_target(self, msg) -> bool:
        self.to_target.append(msg)
        return self.target_up

    def _done(self):
        self.done_count += 1

    def submit(self, client: bytes, rid: str, **kw) -> Generate:
        msg = Generate(id=rid, prompt="hi", **kw)
        self.s.admit(client, msg)
        return msg

    def worker_says(self, msg) -> bool:
        return self.s.on_target_message(msg, encode(msg))

    def replies_to(self, client: bytes) -> list:
        return [m for c, m in self.replies if c == client]

    def started(self) -> list[str]:
        return [m.id for m in self.to_target if isinstance(m, Generate)]


def done(rid: str, tokens: int = 3, reason: FinishReason = FinishReason.STOP, **kw) -> Done:
    return Done(
        id=rid,
        text="x" * tokens,
        finish_reason=reason,
        usage=Usage(prompt_tokens=2, completion_tokens=tokens),
        timings=Timings(0.1, 0.05, 0.2, 10.0, 0.0),
        **kw,
    )


@pytest.fixture
def h(clock) -> Harness:
    return Harness(clock)


def test_requests_run_one_at_a_time_in_arrival_order(h):
    for rid in ("a", "b", "c"):
        h.submit(b"C1", rid)
    assert h.s.start_next() and h.started() == ["a"]
    assert not h.s.start_next()  # the target is busy
    h.clock.advance(2.0)
    assert h.worker_says(done("a"))
    h.s.start_next()
    h.worker_says(done("b"))
    h.s.start_next()
    h.worker_says(done("c"))
    assert h.started() == ["a", "b", "c"]
    answers = h.replies_to(b"C1")
    assert [m.id for m in answers] == ["a", "b", "c"] and [m.serial for m in answers] == [1, 2, 3]
    assert answers[1].timings.queued_seconds == pytest.approx(2.0)  # b waited while a ran
    assert h.s.counters.requests["done_stop"] == 3 and h.s.counters.tokens["completion"] == 9
    assert h.done_count == 3 and not h.s.jobs and not h.s.busy


def test_a_full_queue_answers_busy_and_keeps_who_is_in_it(clock):
    h = Harness(clock, max_queue=2)
    for rid in ("a", "b", "c"):
        h.submit(b"C1", rid)
    (busy,) = h.replies_to(b"C1")
    assert isinstance(busy, Busy) and busy.id == "c" and busy.queue_length == 2 and busy.max_queue == 2
    assert "--max-queue" in busy.message and [j.request.id for j in h.s.queue] == ["a", "b"]
    assert h.s.counters.requests["busy"] == 1


def test_a_duplicate_id_is_refused_while_the_first_is_queued_or_running_and_free_after(h):
    h.submit(b"C1", "a")
    h.submit(b"C2", "a")
    (err,) = h.replies_to(b"C2")
    assert err.code == ErrorCode.DUPLICATE_REQUEST_ID
    h.s.start_next()
    h.submit(b"C2", "a")
    assert h.replies_to(b"C2")[-1].code == ErrorCode.DUPLICATE_REQUEST_ID
    h.worker_says(done("a"))
    h.submit(b"C2", "a")  # finished: the id may be reused
    assert len(h.replies_to(b"C2")) == 2 and [j.request.id for j in h.s.queue] == ["a"]


def test_chunks_are_relayed_as_the_worker_encoded_them_and_counted(h):
    h.submit(b"C1", "a")
    h.s.start_next()
    chunk = Chunk(id="a", text="he", token_ids=[1, 2])
    h.worker_says(chunk)
    h.clock.advance(0.5)
    h.worker_says(Chunk(id="a", text="y", token_ids=[3]))
    assert h.relayed[0] == (b"C1", encode(chunk))
    assert h.s.active_request().completion_tokens == 3
    h.worker_says(done("a"))
    assert isinstance(h.replies_to(b"C1")[-1], Done)


def test_messages_about_no_request_of_ours_are_not_taken(h):
    assert not h.worker_says(Error.of("target", ErrorCode.NOT_READY, "could not load the model"))
    h.submit(b"C1", "a")
    h.s.start_next()
    assert not h.worker_says(done("zzz"))  # an earlier request's late reply
    assert h.s.active is not None and not h.replies


def test_cancel_of_a_queued_request_answers_cancelled_at_once_and_it_never_starts(h):
    h.submit(b"C1", "a")
    h.submit(b"C1", "b")
    h.clock.advance(1.5)
    assert h.s.cancel("b")
    (d,) = h.replies_to(b"C1")
    assert d.finish_reason == FinishReason.CANCELLED and d.id == "b" and d.timings.queued_seconds == 1.5
    h.s.start_next()
    h.worker_says(done("a"))
    assert not h.s.start_next() and h.started() == ["a"]
    assert not h.s.cancel("nope")


def test_cancel_of_the_running_request_asks_the_target_and_the_worker_answers(h):
    h.submit(b"C1", "a")
    h.s.start_next()
    assert h.s.cancel("a")
    assert isinstance(h.to_target[-1], Cancel) and h.to_target[-1].request_id == "a"
    assert not h.replies  # the worker's own terminal message is the answer
    h.worker_says(done("a", reason=FinishReason.CANCELLED))
    assert h.replies_to(b"C1")[-1].finish_reason == FinishReason.CANCELLED


def test_a_client_that_goes_away_has_its_requests_cancelled_and_nothing_sent_to_it(h):
    h.submit(b"C1", "a")
    h.submit(b"C1", "b")
    h.submit(b"C2", "c")
    h.s.start_next()
    h.s.client_gone(b"C1")
    assert isinstance(h.to_target[-1], Cancel) and h.to_target[-1].request_id == "a"
    assert [j.request.id for j in h.s.queue] == ["c"]
    h.worker_says(Chunk(id="a", text="late", token_ids=[1]))
    h.worker_says(done("a", reason=FinishReason.CANCELLED))
    assert not h.replies_to(b"C1") and not h.relayed
    assert h.s.counters.requests["done_cancelled"] == 2  # counted, though nobody was told
    h.s.start_next()
    assert h.started() == ["a", "c"]


def test_a_client_that_stops_reading_is_dropped_and_its_request_cancelled(h):
    h.submit(b"C1", "a")
    h.s.start_next()
    h.gone.add(b"C1")
    h.worker_says(Chunk(id="a", text="x", token_ids=[1]))
    assert isinstance(h.to_target[-1], Cancel)
    h.worker_says(Chunk(id="a", text="y", token_ids=[2]))
    assert len(h.relayed) == 1  # no more relaying to it


def test_a_cache_clear_runs_after_the_running_request_and_before_the_next(h):
    h.submit(b"C1", "a")
    h.s.start_next()
    h.submit(b"C1", "b")
    h.s.clear_cache(b"C2", CacheClear(id="k"))
    h.worker_says(done("a"))
    h.s.start_next()
    assert isinstance(h.to_target[-1], CacheClear) and h.s.busy
    assert not h.s.start_next()  # b waits for the clear
    h.worker_says(CacheCleared(id="other", pages=0, bytes=0))  # not this clear's
    assert h.s.clearing is not None
    h.worker_says(CacheCleared(id="k", pages=3, bytes=300))
    assert h.replies_to(b"C2")[-1].pages == 3 and not h.s.busy
    h.s.start_next()
    assert h.started() == ["a", "b"]


def test_waiting_clears_are_done_by_one_and_bounded(h):
    """Issue 19, item 14: clears are coalesced (one target clear answers all that
    wait) and at most max_queue wait, so they cannot pile up in front of requests."""
    h.submit(b"C1", "a")
    h.s.start_next()
    for i in range(6):  # max_queue 4
        h.s.clear_cache(b"C%d" % i, CacheClear(id=f"k{i}"))
    assert [type(h.replies_to(b"C%d" % i)[-1]).__name__ for i in (4, 5)] == ["Busy", "Busy"]
    h.submit(b"C1", "b")
    h.worker_says(done("a"))
    h.s.start_next()
    assert [m.id for m in h.to_target if isinstance(m, CacheClear)] == ["k0"]  # one clear for four
    h.worker_says(CacheCleared(id="k0", pages=3, bytes=300))
    assert [(h.replies_to(b"C%d" % i)[-1].id, h.replies_to(b"C%d" % i)[-1].pages) for i in range(4)] == [
        ("k0", 3),
        ("k1", 3),
        ("k2", 3),
        ("k3", 3),
    ]
    h.s.start_next()
    assert h.started() == ["a", "b"]


@pytest.mark.parametrize("kinds, memory_only", [((True, True), True), ((True, False), False), ((False, True), False)])
def test_coalesced_clears_keep_the_disk_only_if_every_one_asks(h, kinds, memory_only):
    h.submit(b"C1", "a")
    h.s.start_next()
    for i, kind in enumerate(kinds):
        h.s.clear_cache(b"C%d" % i, CacheClear(id=f"k{i}", memory_only=kind))
    h.worker_says(done("a"))
    h.s.start_next()
    (sent,) = [m for m in h.to_target if isinstance(m, CacheClear)]
    assert sent.id == "k0" and sent.memory_only is memory_only


def test_a_duplicate_id_from_the_connection_that_owns_it_is_answered_without_the_id(h):
    h.submit(b"C1", "a")
    h.s.start_next()
    h.submit(b"C1", "a")  # same connection: an error with id "a" would end a's stream
    h.submit(b"C2", "a")  # another connection: its own error, with the id it sent
    (same,), (other,) = h.replies_to(b"C1"), h.replies_to(b"C2")
    assert same.code == other.code == ErrorCode.DUPLICATE_REQUEST_ID
    assert same.id is None and other.id == "a" and "'a' is already queued or running" in same.message
    assert h.s.jobs["a"].identity == b"C1" and h.s.active is not None


def test_after_shutdown_starts_new_requests_and_clears_are_answered_shutting_down(h):
    h.s.shutting_down()
    h.submit(b"C1", "late")
    h.s.clear_cache(b"C2", CacheClear(id="k"))
    assert h.replies_to(b"C1")[-1].code == h.replies_to(b"C2")[-1].code == ErrorCode.SHUTTING_DOWN
    assert not h.s.queue and not h.s.clears


def test_a_failed_daemon_answers_waiting_clears(h):
    h.submit(b"C1", "a")
    h.s.start_next()
    h.s.clear_cache(b"C2", CacheClear(id="k"))
    h.s.fail("the model cannot load")
    assert h.replies_to(b"C2")[-1].code == ErrorCode.NOT_READY and not h.s.clears


def test_tokenize_ids_never_collide_with_requests(h):
    from tandem.protocol import Tokenize, Tokenized

    h.s.tokenize(b"C1", Tokenize(id="t", text="hi"))
    h.submit(b"C2", "t")  # a generate reusing the id of a tokenize in flight: refused, the tokenize keeps its id
    assert h.replies_to(b"C2")[-1].code == ErrorCode.DUPLICATE_REQUEST_ID and "t" not in h.s.jobs
    h.submit(b"C1", "a")
    h.s.start_next()
    h.s.tokenize(b"C1", Tokenize(id="a", text="hi"))  # its own running request's id: an error without the id
    assert h.replies_to(b"C1")[-1].id is None and h.replies_to(b"C1")[-1].code == ErrorCode.DUPLICATE_REQUEST_ID
    assert h.worker_says(Tokenized(id="t", tokens=[1, 2]))
    assert h.replies_to(b"C1")[-1] == Tokenized(id="t", tokens=[1, 2]) and not h.s.tokenizing


def test_tokenize_is_bounded_and_answered_when_the_target_dies(h):
    from tandem.daemon.front.scheduler import MAX_TOKENIZING
    from tandem.protocol import Tokenize

    for i in range(MAX_TOKENIZING + 1):
        h.s.tokenize(b"C1", Tokenize(id=f"t{i}", text="hi"))
    assert type(h.replies_to(b"C1")[-1]).__name__ == "Busy"
    h.s.abort(ErrorCode.WORKER_DIED, "died", "the model worker died")
    codes = [m.code for m in h.replies_to(b"C1")[1:]]
    assert len(codes) == MAX_TOKENIZING and set(codes) == {ErrorCode.WORKER_DIED} and not h.s.tokenizing


def test_a_clear_the_target_cannot_take_is_answered_with_an_error(clock):
    h = Harness(clock, target_up=False)
    h.s.clear_cache(b"C2", CacheClear(id="k"))
    h.s.start_next()
    (err,) = h.replies_to(b"C2")
    assert err.code == ErrorCode.WORKER_DIED and "not cleared" in err.message and not h.s.busy


def test_a_target_death_answers_the_running_request_and_the_clear_and_the_queue_waits(h):
    h.submit(b"C1", "a")
    h.s.start_next()
    h.s.clear_cache(b"C2", CacheClear(id="k"))
    h.submit(b"C1", "b")
    h.s.abort(ErrorCode.WORKER_DIED, "the model worker died while serving this request", "the model worker died")
    (err,) = h.replies_to(b"C1")
    assert err.id == "a" and err.code == ErrorCode.WORKER_DIED
    assert h.s.active is None and "a" not in h.s.jobs and [j.request.id for j in h.s.queue] == ["b"]
    h.s.start_next()  # the restarted target: the clear first
    h.s.abort(ErrorCode.WORKER_DIED, "died again", "the model worker died again")
    clear_err = h.replies_to(b"C2")[-1]
    assert clear_err.code == ErrorCode.WORKER_DIED and "died again" in clear_err.message
    assert h.done_count == 0  # no request finished: the deaths keep counting


def test_a_failed_daemon_answers_the_queue_and_refuses_new_work(h):
    h.submit(b"C1", "a")
    h.submit(b"C1", "b")
    h.s.start_next()
    h.s.fail("the model worker died 5 times")
    (err,) = h.replies_to(b"C1")
    assert err.id == "b" and err.code == ErrorCode.NOT_READY and "5 times" in err.message
    h.submit(b"C2", "c")
    h.s.clear_cache(b"C2", CacheClear(id="k"))
    assert [m.code for m in h.replies_to(b"C2")] == [ErrorCode.NOT_READY] * 2
    assert "the daemon has failed" in h.replies_to(b"C2")[0].message


def test_shutdown_with_a_full_queue_answers_everyone_once(clock):
    h = Harness(clock, max_queue=8)
    for rid in "abcde":
        h.submit(b"C1", rid)
    h.s.clear_cache(b"C2", CacheClear(id="k"))
    h.s.start_next()  # the clear
    h.worker_says(CacheCleared(id="k", pages=0, bytes=0))
    h.s.clear_cache(b"C2", CacheClear(id="k2"))
    h.s.start_next()  # the clear k2 runs
    h.s.shutting_down()
    assert [m.code for m in h.replies_to(b"C1")] == [ErrorCode.SHUTTING_DOWN] * 5
    assert isinstance(h.replies_to(b"C2")[0], CacheCleared) and h.replies_to(b"C2")[1].code == ErrorCode.SHUTTING_DOWN
    assert not h.s.queue and not h.s.jobs and not h.s.busy


def test_shutdown_cancels_the_running_request_and_answers_it_if_the_worker_does_not(h):
    h.submit(b"C1", "a")
    h.s.start_next()
    h.s.shutting_down()
    h.s.cancel_active()
    assert isinstance(h.to_target[-1], Cancel)
    h.s.abort(ErrorCode.SHUTTING_DOWN, "the daemon is shutting down", "the daemon is shutting down")
    (err,) = h.replies_to(b"C1")
    assert err.code == ErrorCode.SHUTTING_DOWN and h.s.active is None


def test_done_reports_update_the_governor_cache_and_draft_totals(h):
    from tandem.protocol import CacheInfo, GovernorInfo

    h.submit(b"C1", "a")
    h.s.start_next()
    governor = GovernorInfo("t", 1, "drafting", True, 5.0, 6.0, 64, 0, 0.0, 2, 3, 0, 0)
    cache = CacheInfo(16, 1, 2, 1 << 20, 3, 4, 5, 6, 7)
    stats = DraftStats()
    stats.add_round(4, 3)
    h.worker_says(done("a", governor=governor, cache=cache, draft=stats))
    assert h.s.governor == governor and h.s.cache == cache
    assert h.s.counters.draft.rounds == 1 and h.s.counters.draft.accepted == 3


def test_a_cancel_that_crosses_the_workers_done_finds_nothing_and_nothing_is_sent_twice(h):
    h.submit(b"C1", "a")
    h.s.start_next()
    h.worker_says(done("a"))  # finished just before the cancel came
    assert not h.s.cancel("a")
    assert len(h.replies_to(b"C1")) == 1 and not any(isinstance(m, Cancel) for m in h.to_target)


def test_a_cancel_racing_a_worker_death_gets_one_answer(h):
    h.submit(b"C1", "a")
    h.s.start_next()
    assert h.s.cancel("a")  # sent to a target that is dying
    h.s.abort(ErrorCode.WORKER_DIED, "the model worker died while serving this request", "the model worker died")
    h.worker_says(done("a", reason=FinishReason.CANCELLED))  # a reply from the dead worker, drained late
    (answer,) = h.replies_to(b"C1")
    assert answer.code == ErrorCode.WORKER_DIED


# ---------------------------------------------------------------- the short-request lane


class LaneHarness(Harness):
    def __init__(self, clock, lane: Lane):
        super().__init__(clock)
        self.s = Scheduler(self._reply, self._relay, self._send_target, self.metrics, 8, clock=clock, lane=lane)
        self.s.on_request_done = self._done


@pytest.fixture
def lane(clock) -> LaneHarness:
    return LaneHarness(clock, Lane(max_tokens=64))


def preempted(h: LaneHarness) -> float:
    return h.metrics.preemptions._value.get()


def served(rid: str, seconds: float) -> Done:
    """The worker's done for a short request it took ``seconds`` over (prompt and generation)."""
    msg = done(rid)
    msg.timings = Timings(0.1, 0.0, seconds, 10.0, 0.0)
    return msg


def test_short_means_few_tokens_and_a_short_prompt():
    lane = Lane(max_tokens=64)
    assert lane.is_short(Generate(id="a", prompt="hi", max_tokens=64))
    assert not lane.is_short(Generate(id="a", prompt="hi", max_tokens=65))
    assert not lane.is_short(Generate(id="a", prompt="x" * (SHORT_PROMPT_CHARS + 1), max_tokens=8))
    big_chat = [ChatMessage(role="user", content="x" * (SHORT_PROMPT_CHARS // 2 + 1))] * 2
    assert not lane.is_short(Generate(id="a", messages=big_chat, max_tokens=8))
    assert lane.is_short(Complete(id="f", prefix="def f(", suffix="\n", max_tokens=32))  # an editor's FIM
    seeded = Generate(id="s", prompt="hi", max_tokens=8, seed=1, temperature=0.7)
    assert lane.is_short(seeded)
    # with a drafter it would decode without one: its seeded tokens would differ from its run alone
    assert not Lane(max_tokens=64, drafter=True).is_short(seeded)
    assert Lane(max_tokens=64, drafter=True).is_short(Generate(id="g", prompt="hi", max_tokens=8, temperature=0))
    assert not Lane(max_tokens=0).is_short(Generate(id="a", prompt="hi", max_tokens=1))


def test_a_short_request_is_sent_while_a_long_one_runs_and_answered_first(lane):
    h = lane
    h.submit(b"L", "long", max_tokens=1000)
    h.submit(b"Q", "queued-long", max_tokens=1000)
    h.submit(b"S", "short", max_tokens=16)
    assert h.s.start_next() and h.started() == ["long"]
    assert h.s.start_next() and h.started() == ["long", "short"]  # past the long one queued before it
    assert h.s.busy and h.s.nested.request.id == "short"
    assert h.s.active_request().id == "long" and h.s.active_request(nested=True).id == "short"
    assert not h.s.start_next()  # one at a time
    h.clock.advance(3.0)  # of which the worker spent 2 s on it (it waited for a round's end)
    assert h.worker_says(served("short", 2.0))
    assert [m.id for m in h.replies_to(b"S")] == ["short"] and h.s.active_request(nested=True) is None
    assert h.s.active.request.id == "long" and preempted(h) == 1
    assert h.metrics.preempted_seconds._value.get() == pytest.approx(2.0)
    h.worker_says(done("long"))
    assert h.s.start_next() and h.started()[-1] == "queued-long"


def test_a_short_requests_queued_seconds_add_its_wait_in_the_worker_for_a_rounds_end(lane):
    h = lane
    h.submit(b"L", "long", max_tokens=1000)
    h.s.start_next()
    h.clock.advance(0.5)
    h.submit(b"S", "short", max_tokens=16)
    h.clock.advance(1.0)  # in the daemon's queue ...
    h.s.start_next()
    h.clock.advance(0.4)
    answer = served("short", 0.1)
    answer.timings.queued_seconds = 0.3  # ... and the worker's: it held the request until a round ended
    h.worker_says(answer)
    assert h.replies_to(b"S")[0].timings.queued_seconds == pytest.approx(1.3)


def test_the_long_request_keeps_at_least_half_the_time(lane):
    h = lane
    h.submit(b"L", "long", max_tokens=1000)
    h.s.start_next()
    h.submit(b"S", "s1", max_tokens=16)
    h.s.start_next()
    h.clock.advance(2.5)
    h.worker_says(served("s1", 2.0))
    h.submit(b"S", "s2", max_tokens=16)
    assert not h.s.start_next()  # the long one's turn: as long as s1 took
    h.clock.advance(1.9)
    assert not h.s.start_next()
    h.clock.advance(0.2)
    assert h.s.start_next() and h.started() == ["long", "s1", "s2"]


def test_no_lane_within_a_short_request_or_when_off(clock):
    h = LaneHarness(clock, Lane(max_tokens=64))
    h.submit(b"A", "a", max_tokens=8)
    h.submit(b"B", "b", max_tokens=8)
    h.s.start_next()
    assert not h.s.start_next() and h.started() == ["a"]  # a short one is not pre-empted
    off = LaneHarness(clock, Lane(max_tokens=0))
    off.submit(b"A", "long", max_tokens=1000)
    off.submit(b"B", "short", max_tokens=8)
    off.s.start_next()
    assert not off.s.start_next() and off.started() == ["long"]


def test_a_long_request_that_ends_first_hands_over_to_the_short_one(lane):
    h = lane
    """The target took the short request after the long one's last round: it serves it next."""
    h.submit(b"L", "long", max_tokens=1000)
    h.s.start_next()
    h.submit(b"S", "short", max_tokens=16)
    h.s.start_next()
    h.worker_says(done("long"))
    assert h.s.active.request.id == "short" and h.s.nested is None and h.s.busy
    assert preempted(h) == 0  # it was not served within the long one
    h.submit(b"X", "next", max_tokens=1000)
    assert not h.s.start_next()  # the short one is the target's until its answer
    h.worker_says(done("short"))
    assert [m.id for m in h.replies_to(b"S")] == ["short"]
    assert h.s.start_next() and h.started()[-1] == "next"


def test_cancels_reach_the_target_for_either_and_a_death_answers_both(lane):
    h = lane
    h.submit(b"L", "long", max_tokens=1000)
    h.s.start_next()
    h.submit(b"S", "short", max_tokens=16)
    h.s.start_next()
    assert h.s.cancel("short")
    assert isinstance(h.to_target[-1], Cancel) and h.to_target[-1].request_id == "short"
    h.worker_says(done("short", reason=FinishReason.CANCELLED))
    h.submit(b"S", "short2", max_tokens=16)
    h.clock.advance(10)
    h.s.start_next()
    h.s.abort(ErrorCode.WORKER_DIED, "the model worker died while serving this request", "the model worker died")
    for client, rid in ((b"L", "long"), (b"S", "short2")):
        err = h.replies_to(client)[-1]
        assert err.id == rid and err.code == ErrorCode.WORKER_DIED
    assert h.s.active is None and h.s.nested is None and not h.s.jobs and not h.s.busy


def test_shutdown_cancels_a_short_request_within_the_long_one_too(lane):
    h = lane
    h.submit(b"L", "long", max_tokens=1000)
    h.s.start_next()
    h.submit(b"S", "short", max_tokens=16)
    h.s.start_next()
    h.s.cancel_active()
    cancels = [m.request_id for m in h.to_target if isinstance(m, Cancel)]
    assert sorted(cancels) == ["long", "short"]


def test_a_cache_clear_asked_for_first_goes_before_the_lane(lane):
    h = lane
    h.submit(b"L", "long", max_tokens=1000)
    h.s.start_next()
    h.s.clear_cache(b"K", CacheClear(id="k"))
    h.submit(b"S", "short", max_tokens=16)
    assert not h.s.start_next() and h.started() == ["long"]
    h.worker_says(done("long"))
    assert h.s.start_next() and isinstance(h.to_target[-1], CacheClear)


def test_a_long_request_cancelled_while_a_short_one_runs_within_it(lane):
    h = lane
    h.submit(b"L", "long", max_tokens=1000)
    h.s.start_next()
    h.submit(b"S", "short", max_tokens=16)
    h.s.start_next()
    assert h.s.cancel("long") and h.to_target[-1].request_id == "long"
    h.worker_says(served("short", 1.0))  # the worker ends the short one first, then the long one
    h.worker_says(done("long", reason=FinishReason.CANCELLED))
    assert [m.id for m in h.replies_to(b"S")] == ["short"]
    assert h.replies_to(b"L")[-1].finish_reason == FinishReason.CANCELLED
    assert not h.s.busy and not h.s.jobs
