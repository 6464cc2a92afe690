"""ModelDrafterClient without a model: the target worker's handle on the drafter
worker, talking over a real PAIR socket to a fake drafter on a thread.

The fake reads only a draft request's ``id``, ``keep``, ``append``, ``k``,
``new_request``, ``store`` and ``restore`` (and, in one test, ``sampling``), and
keeps the tokens it "holds" the way the real drafter's KV cache does: roll back
to ``keep``, read ``append``, draft ``k`` tokens and hold all but the last. So
``fake.cache == client.mirror`` after every completed round.
"""

from __future__ import annotations

import os
import queue
import shutil
import tempfile
import threading
import time
from typing import Callable, Optional

import numpy as np
import pytest
import zmq

from tandem.daemon.cache.page_store import PageStore
from tandem.daemon.cache.prefix_cache import ExtentAllocator, PageTree
from tandem.daemon.drafting import drafter_client
from tandem.daemon.drafting.drafter_client import ModelDrafterClient
from tandem.daemon.drafting.sampler import Sampler
from tandem.daemon.drafting.speculative import SparseDist
from tandem.protocol import Error, ErrorCode, encode, unpackb
from tandem.protocol.internal import Drafted

GREEDY = Sampler(0.0, 0, 1.0, 0)
STALE_NONCE = "stale000"  # never a token_hex(4): stands for an earlier target worker's requests


def q_for(token: int, i: int) -> tuple[np.ndarray, np.ndarray]:
    """The fake's distribution q for its i-th draft: 1 to 3 entries, the drafted token first."""
    n = i % 3 + 1
    ids = np.array([token + 1000 * j for j in range(n)], dtype=np.int32)
    probs = np.arange(n, 0, -1, dtype=np.float32)
    return ids, probs / probs.sum()


class FakeDrafter:
    """A drafter worker without a model, serving one bound PAIR socket on its own thread."""

    def __init__(self, zctx: zmq.Context, endpoint: str, page_tokens: int = 4, page_bytes: int = 0, n_ctx: int = 2**20):
        self.zctx, self.endpoint = zctx, endpoint
        self.page_tokens, self.page_bytes, self.n_ctx = page_tokens, page_bytes, n_ctx
        self.requests: queue.Queue[dict] = queue.Queue()  # every request received, as its msgpack map
        self.cache: list[int] = []  # the tokens in its "KV cache"
        self.stored: dict[int, list[int]] = {}  # prefix-cache pages written: offset -> tokens
        self.respond: Callable[[dict], list] = lambda req: [self.draft(req)]  # [] never answers
        self.gate = threading.Event()  # cleared: hold every reply until it is set
        self.gate.set()
        self.delay = 0.0  # seconds to wait before each reply
        self._stop = threading.Event()
        self._bound = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-drafter", daemon=True)

    def start(self) -> "FakeDrafter":
        self._thread.start()
        assert self._bound.wait(2), "the fake drafter did not bind"
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        assert not self._thread.is_alive()

    def _run(self) -> None:
        sock = self.zctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self.endpoint)
            self._bound.set()
            while not self._stop.is_set():
                if not sock.poll(5, zmq.POLLIN):
                    continue
                op, body = sock.recv_multipart()
                assert op == b"draft"
                req = unpackb(body)
                self.requests.put(req)
                replies = self.respond(req)
                while not self.gate.wait(0.005):
                    if self._stop.is_set():
                        return
                if self.delay:
                    time.sleep(self.delay)
                for reply in replies:
                    try:
                        sock.send_multipart(encode(reply), flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break  # the client has gone (a PAIR with no peer would block)
        finally:
            sock.close(linger=0)

    def draft(self, req: dict) -> Drafted | Error:
        """What the real drafter does with a request, on token lists."""
        pt = self.page_tokens
        for start, offset in req.get("store") or []:
            if start < 0 or start + pt > len(self.cache):
                return Error.of(req["id"], ErrorCode.INTERNAL, f"cannot store the page at token {start}")
            self.stored[offset] = self.cache[start : start + pt]
        if req.get("restore"):
            self.cache = [t for offset in req["restore"] for t in self.stored[offset]]
        keep, append, k = req["keep"], req["append"], req["k"]
        if keep > len(self.cache):
            return Error.of(req["id"], ErrorCode.INTERNAL, f"asked to keep {keep} tokens, {len(self.cache)} cached")
        del self.cache[keep:]
        if not append or len(self.cache) + len(append) >= self.n_ctx:
            return self.drafted(req, [])
        self.cache += append
        tokens = [self.cache[-1] + 1 + i for i in range(k)]
        self.cache += tokens[:-1]  # it decodes all drafts but the last
        return self.drafted(req, tokens)

    def drafted(self, req: dict, tokens: list[int], id: Optional[str] = None) -> Drafted:
        qs = [q_for(t, i) for i, t in enumerate(tokens)]
        return Drafted(
            id=req["id"] if id is None else id,
            tokens=tokens,
            n_cached=len(self.cache),
            q_ids=np.concatenate([ids for ids, _ in qs]) if qs else np.zeros(0, np.int32),
            q_probs=np.concatenate([probs for _, probs in qs]) if qs else np.zeros(0, np.float32),
            q_lens=[len(ids) for ids, _ in qs],
            page_bytes=self.page_bytes,
        )

    def next(self, timeout: float = 1.0) -> dict:
        return self.requests.get(timeout=timeout)

    def assert_quiet(self, wait: float = 0.05) -> None:
        """No request arrives (within ``wait``: a sent one would arrive in well under that)."""
        with pytest.raises(queue.Empty):
            self.requests.get(timeout=wait)


def wait_until(cond: Callable[[], bool], timeout: float = 1.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


@pytest.fixture
def endpoint():
    d = tempfile.mkdtemp(prefix="tdm-dc-", dir="/tmp")  # Unix socket paths: 107 bytes at most
    yield f"ipc://{d}/draft.sock"
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.term()  # every socket is closed by now (the fixtures below end first)


@pytest.fixture
def drafter(zctx, endpoint):
    """Factory: drafter(**kw) -> a started FakeDrafter bound to the endpoint, stopped at teardown."""
    started: list[FakeDrafter] = []

    def start(**kw) -> FakeDrafter:
        if started:
            # some libzmq versions remove a closed socket's ipc file, from their I/O thread:
            # let that happen before the next drafter binds the path (at most briefly: 4.3.5 keeps it)
            path = endpoint.removeprefix("ipc://")
            deadline = time.monotonic() + 0.05
            while os.path.exists(path) and time.monotonic() < deadline:
                time.sleep(0.002)
        fake = FakeDrafter(zctx, endpoint, **kw)
        started.append(fake)
        return fake.start()

    yield start
    for fake in started:
        if fake._thread.is_alive():
            fake.stop()


@pytest.fixture
def client(zctx, endpoint):
    """Factory: client(timeout=...) -> a ModelDrafterClient on the endpoint, its socket closed at teardown."""
    made: list[ModelDrafterClient] = []

    def make(timeout: float = 2.0) -> ModelDrafterClient:
        c = ModelDrafterClient(zctx, endpoint, timeout=timeout)
        made.append(c)
        return c

    yield make
    for c in made:
        c.go_down()


# ---------------------------------------------------------------- the mirror


def test_timeouts_come_from_the_constructor(client):
    c = client(timeout=120.0)
    assert (c.prefill_timeout_ms, c.draft_timeout_ms) == (120_000, drafter_client.DRAFT_TIMEOUT_MS)
    c = client(timeout=0.5)
    assert (c.prefill_timeout_ms, c.draft_timeout_ms) == (500, 500)


def test_begin_prefills_and_ready_waits_for_its_reply(drafter, client):
    fake, c = drafter(), client()
    prompt = tokens(1, 10)
    fake.gate.clear()
    c.begin("r1", prompt, GREEDY)
    req = fake.next()
    assert req["id"] == f"{c.nonce}:r1"
    assert (req["keep"], req["append"], req["k"], req["new_request"]) == (0, prompt, 0, True)
    assert not c.ready()  # its reply is held back
    assert not c.ready()
    fake.gate.set()
    wait_until(c.ready)
    assert c.awaiting == 0
    assert c.mirror == fake.cache == prompt


def test_begin_without_prefill_sends_nothing_and_the_first_round_is_the_new_request(drafter, client):
    fake, c = drafter(), client()
    c.begin("r1", tokens(1, 10), GREEDY, prefill=False)
    assert c.ready()
    fake.assert_quiet()
    c.propose(tokens(1, 10), 3, 0.0)
    req = fake.next()
    assert (req["keep"], req["append"], req["k"], req["new_request"]) == (0, tokens(1, 10), 3, True)


def test_propose_keeps_the_common_prefix_and_appends_only_new_tokens(drafter, client):
    fake, c = drafter(), client()
    c.begin("r1", [], GREEDY, prefill=False)
    ctx1 = tokens(1, 10)
    assert c.propose(ctx1, 3, 0.0) == ([11, 12, 13], None)  # greedy: no distributions
    req = fake.next()
    assert (req["keep"], req["append"], req["k"], req["new_request"]) == (0, ctx1, 3, True)
    assert c.mirror == fake.cache == ctx1 + [11, 12]  # the context and all drafts but the last

    # two drafts accepted, then the target's own token: only that one is new
    ctx2 = ctx1 + [11, 12, 99]
    assert c.propose(ctx2, 3, 0.0) == ([100, 101, 102], None)
    req = fake.next()
    assert (req["keep"], req["append"], req["new_request"]) == (12, [99], False)
    assert c.mirror == fake.cache == ctx2 + [100, 101]

    # the second draft rejected: the drafter rolls back past it
    ctx3 = ctx2 + [100, 7]
    c.propose(ctx3, 2, 0.0)
    req = fake.next()
    assert (req["keep"], req["append"], req["k"]) == (len(ctx2) + 1, [7], 2)
    assert c.mirror == fake.cache == ctx3 + [8]

    # a context that diverges early keeps only the common prefix
    ctx4 = ctx1[:5] + [500, 501]
    assert c.propose(ctx4, 1, 0.0) == ([502], None)
    req = fake.next()
    assert (req["keep"], req["append"]) == (5, [500, 501])
    assert c.mirror == fake.cache == ctx4  # one draft: nothing of it is decoded


def test_a_context_the_drafter_holds_whole_is_read_again_from_its_last_token(drafter, client):
    fake, c = drafter(), client()
    prompt = tokens(1, 10)
    c.begin("r1", prompt, GREEDY)
    wait_until(c.ready)
    fake.next()
    assert c.mirror == prompt
    assert c.propose(prompt, 2, 0.0) == ([11, 12], None)
    req = fake.next()
    assert (req["keep"], req["append"]) == (9, [10])  # it needs the logits after the last token
    assert c.mirror == fake.cache == prompt + [11]


def test_propose_right_after_begin_collects_both_replies(drafter, client):
    fake, c = drafter(), client()
    prompt = tokens(1, 10)
    c.begin("r1", prompt, GREEDY)
    assert c.propose(prompt, 3, 0.0) == ([11, 12, 13], None)
    first, second = fake.next(), fake.next()
    assert (first["keep"], first["append"], first["k"], first["new_request"]) == (0, prompt, 0, True)
    assert (second["keep"], second["append"], second["k"], second["new_request"]) == (9, [10], 3, False)
    assert c.awaiting == 0
    assert c.mirror == fake.cache == prompt + [11, 12]


def test_sync_reads_only_what_the_drafter_lacks_and_waits_for_it(drafter, client):
    fake, c = drafter(), client()
    prompt = tokens(1, 10)
    c.begin("r1", prompt, GREEDY, prefill=False)
    assert c.behind(prompt) == 10  # what the governor predicts a catch-up from
    assert c.sync(prompt) is True
    req = fake.next()
    assert (req["keep"], req["append"], req["k"], req["new_request"]) == (0, prompt, 0, True)
    assert c.awaiting == 0
    assert c.mirror == fake.cache == prompt

    c.sync(prompt)  # it holds all of it already
    fake.assert_quiet()
    c.sync(prompt[:4])  # ... or a prefix
    fake.assert_quiet()

    assert c.behind(prompt) == c.behind(prompt[:4]) == 0 and c.behind(prompt + [7, 8]) == 2
    assert c.behind(prompt[:5] + [99]) == 1  # a context that left its own after 5 tokens
    c.sync(prompt + [7, 8])
    req = fake.next()
    assert (req["keep"], req["append"], req["k"]) == (10, [7, 8], 0)
    assert c.mirror == fake.cache == prompt + [7, 8]

    # a prefill on its way: sync sends nothing more, only waits for it
    prompt2 = tokens(50, 6)
    c.begin("r2", prompt2, GREEDY)
    c.sync(prompt2)
    req = fake.next()
    assert (req["id"], req["keep"], req["append"]) == (f"{c.nonce}:r2", 0, prompt2)
    fake.assert_quiet()
    assert c.awaiting == 0 and c.ready()
    assert c.mirror == fake.cache == prompt2


def test_a_drafter_without_room_holds_a_prefix_and_the_next_round_reads_the_rest(drafter, client):
    fake, c = drafter(n_ctx=12), client()
    c.begin("r1", [], GREEDY, prefill=False)
    ctx = tokens(1, 12)
    assert c.propose(ctx, 3, 0.0) == ([], None)  # no room: no drafts, and it read nothing
    fake.next()
    assert c.mirror == fake.cache == []
    assert c.propose(ctx[:8], 3, 0.0) == ([9, 10, 11], None)
    req = fake.next()
    assert (req["keep"], req["append"]) == (0, ctx[:8])
    assert c.mirror == fake.cache == ctx[:8] + [9, 10]
    assert c.sync(ctx) is False  # no room for all of it: not caught up (the governor learns no read cost from it)
    fake.next()
    assert c.sync(ctx[:10]) is True


# ---------------------------------------------------------------- other workers' replies, errors


def test_replies_for_an_earlier_worker_are_skipped(drafter, client):
    fake, c = drafter(), client()

    def stale_first(req: dict) -> list:
        stale = f"{STALE_NONCE}:{req['id'].split(':', 1)[1]}"
        return [
            fake.drafted(req, [666], id=stale),
            Error.of(stale, ErrorCode.INTERNAL, "an earlier worker's failure"),
            fake.draft(req),
        ]

    fake.respond = stale_first
    prompt = tokens(1, 10)
    c.begin("r1", prompt, GREEDY)
    wait_until(c.ready)  # ready() skips them too
    assert not c.broken and c.awaiting == 0
    assert c.mirror == fake.cache == prompt
    assert c.propose(prompt + [20], 3, 0.0) == ([21, 22, 23], None)
    assert not c.broken and c.awaiting == 0
    assert c.mirror == fake.cache == prompt + [20, 21, 22]


@pytest.mark.parametrize("with_id", [True, False], ids=["our-id", "no-id"])
def test_an_error_reply_switches_drafting_off(drafter, client, with_id):
    fake, c = drafter(), client()
    told: list[str] = []
    c.on_broken = told.append  # the daemon restarts it, as a hung one
    fake.respond = lambda req: [Error.of(req["id"] if with_id else None, ErrorCode.INTERNAL, "out of memory")]
    c.begin("r1", [], GREEDY, prefill=False)
    assert c.propose(tokens(1, 10), 3, 0.0) == ([], None)
    fake.next()
    assert c.broken and c.awaiting == 0
    assert told == ["the drafter failed (out of memory)"]
    assert c.propose(tokens(1, 12), 3, 0.0) == ([], None)
    c.sync(tokens(1, 14))
    c.begin("r2", tokens(1, 5), GREEDY)  # also the next request: until the daemon revives it
    assert c.ready()
    fake.assert_quiet()


# ---------------------------------------------------------------- waiting: timeouts, heartbeats, cancel


def test_a_drafter_that_never_answers_times_out_and_the_daemon_is_told(drafter, client):
    fake, c = drafter(), client(timeout=0.3)
    assert c.draft_timeout_ms == 300
    fake.respond = lambda req: []
    told: list[str] = []
    c.on_broken = told.append
    c.begin("r1", [], GREEDY, prefill=False)
    t0 = time.monotonic()
    assert c.propose(tokens(1, 10), 3, 0.0) == ([], None)
    elapsed = time.monotonic() - t0
    assert 0.28 <= elapsed < 0.8
    fake.next(0)
    assert len(told) == 1 and "did not answer" in told[0]
    assert c.broken
    t0 = time.monotonic()
    assert c.propose(tokens(1, 11), 3, 0.0) == ([], None)  # off now: no wait, no request
    assert time.monotonic() - t0 < 0.05
    assert len(told) == 1
    assert c.sync(tokens(1, 12)) is False and c.behind(tokens(1, 12)) == 0  # broken: no catch-up to make or price
    fake.assert_quiet()


def test_a_sync_that_times_out_says_so(drafter, client):
    fake, c = drafter(), client(timeout=0.3)
    fake.respond = lambda req: []
    c.begin("r1", [], GREEDY, prefill=False)
    assert c.sync(tokens(1, 10)) is False  # the governor then learns no read cost from its time
    fake.next(0)


def test_a_long_read_gets_the_prefill_timeout_a_short_one_the_draft_timeout(drafter, client, monkeypatch):
    monkeypatch.setattr(drafter_client, "DRAFT_TIMEOUT_MS", 100)
    fake, c = drafter(), client(timeout=3.0)
    assert (c.prefill_timeout_ms, c.draft_timeout_ms) == (3000, 100)
    told: list[str] = []
    c.on_broken = told.append
    fake.delay = 0.2
    c.begin("r1", [], GREEDY, prefill=False)
    ctx = tokens(1, 40)  # 40 tokens to read > 4 k + 16: it reads much more than it drafts
    assert c.propose(ctx, 3, 0.0) == ([41, 42, 43], None)
    assert told == []
    assert c.propose(ctx + [41, 42, 43], 3, 0.0) == ([], None)  # reads one: 100 ms are not enough
    assert len(told) == 1 and c.broken


def test_on_wait_is_called_while_waiting(drafter, client, monkeypatch):
    monkeypatch.setattr(drafter_client, "WAIT_SLICE_MS", 10)
    fake, c = drafter(), client()
    calls = []
    c.on_wait = lambda: calls.append(1) and False
    fake.delay = 0.1
    c.begin("r1", [], GREEDY, prefill=False)
    assert c.propose(tokens(1, 10), 3, 0.0) == ([11, 12, 13], None)
    assert len(calls) >= 2  # about every slice
    assert not c.broken


def test_on_wait_returning_true_ends_the_wait_and_the_late_reply_is_still_collected(drafter, client, monkeypatch):
    monkeypatch.setattr(drafter_client, "WAIT_SLICE_MS", 10)
    fake, c = drafter(), client()
    told: list[str] = []
    c.on_broken = told.append
    calls = []
    c.on_wait = lambda: (calls.append(1), len(calls) >= 3)[1]  # cancelled at the third heartbeat
    fake.gate.clear()
    c.begin("r1", [], GREEDY, prefill=False)
    ctx = tokens(1, 10)
    t0 = time.monotonic()
    assert c.propose(ctx, 3, 0.0) == ([], None)
    assert time.monotonic() - t0 < 0.5
    assert len(calls) == 3
    assert not c.broken and c.awaiting == 1 and told == []  # not a failure: the reply is still due

    c.on_wait = None
    fake.gate.set()
    ctx2 = ctx + [11, 5]
    assert c.propose(ctx2, 2, 0.0) == ([6, 7], None)  # the late reply, then this one
    fake.next(), fake.next()
    assert c.awaiting == 0
    assert c.mirror == fake.cache == ctx2 + [6]


# ---------------------------------------------------------------- the drafter dies, a new one comes up


def test_go_down_then_revive_starts_afresh_at_the_next_request(drafter, client):
    fake, c = drafter(), client()
    prompt = tokens(1, 10)
    c.begin("r1", prompt, GREEDY)
    assert c.propose(prompt, 3, 0.0) == ([11, 12, 13], None)
    old_nonce = c.nonce

    fake.stop()  # it died; the daemon says so
    c.go_down()
    assert c.sock is None and c.broken
    assert c.propose(prompt + [11], 3, 0.0) == ([], None)
    c.begin("r2", prompt, GREEDY)
    assert c.ready()
    c.sync(prompt)

    fresh = drafter()  # a new drafter on the same endpoint
    c.revive()
    assert c.propose(prompt + [11], 3, 0.0) == ([], None)  # never under a request already running
    fresh.assert_quiet()

    c.begin("r3", prompt + [11], GREEDY)
    assert c.nonce != old_nonce and not c.broken
    req = fresh.next()
    assert req["id"] == f"{c.nonce}:r3"
    assert (req["keep"], req["append"], req["k"], req["new_request"]) == (0, prompt + [11], 0, True)  # empty mirror
    assert c.propose(prompt + [11], 2, 0.0) == ([12, 13], None)
    assert c.mirror == fresh.cache == prompt + [11, 12]


def test_revive_without_go_down_also_resets_at_the_next_begin(drafter, client):
    fake, c = drafter(), client()
    c.begin("r1", [], GREEDY, prefill=False)
    c.propose(tokens(1, 10), 3, 0.0)
    fake.next()
    old_nonce = c.nonce
    c.revive()
    assert c.propose(tokens(1, 12), 3, 0.0) == ([13, 14, 15], None)  # this request goes on as it was
    req = fake.next()
    assert req["id"].startswith(old_nonce + ":") and (req["keep"], req["append"]) == (11, [12])
    fake.stop()
    fresh = drafter()
    c.begin("r2", tokens(1, 12), GREEDY)
    req = fresh.next()
    assert req["id"] == f"{c.nonce}:r2" and c.nonce != old_nonce
    assert (req["keep"], req["append"], req["new_request"]) == (0, tokens(1, 12), True)
    wait_until(c.ready)
    assert c.mirror == fresh.cache == tokens(1, 12)


# ---------------------------------------------------------------- sampling


def test_at_temperature_above_zero_q_comes_back_per_drafted_token(drafter, client):
    fake = drafter()
    c = client()
    c.begin("r1", [], Sampler(0.8, 40, 0.95, 1234), prefill=False)
    drafts, dists = c.propose(tokens(1, 10), 4, 0.0)
    assert drafts == [11, 12, 13, 14]
    sampling = fake.next()["sampling"]  # the request's sampling settings, with the drafter's own seed
    assert sampling == {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": c.seed}
    assert len(dists) == 4
    for i, (token, dist) in enumerate(zip(drafts, dists, strict=True)):
        ids, probs = q_for(token, i)
        assert isinstance(dist, SparseDist)
        assert dist.ids.dtype == np.int64 and dist.probs.dtype == np.float64
        assert dist.ids.tolist() == ids.tolist()
        assert np.allclose(dist.probs, probs)
        assert dist.prob(token) == pytest.approx(float(probs[0]))
    c.propose(tokens(1, 10) + [11], 1, 0.0)
    assert [len(d.ids) for d in c.propose(tokens(1, 12), 3, 0.0)[1]] == [1, 2, 3]


def test_the_drafter_gets_its_own_seed_stream(client):
    c = client()
    s = Sampler(0.8, 40, 0.95, 1234)
    c.begin("r1", [], s, prefill=False)
    assert c.seed == (1234 + 0x9E3779B97F4A7C15) % 2**64
    assert c.seed != s.seed


# ---------------------------------------------------------------- the prefix cache: store and restore


def test_store_writes_the_drafters_new_full_pages_and_a_later_request_restores_them(drafter, client):
    fake, c = drafter(page_tokens=4, page_bytes=64), client()
    c.begin("a", tokens(1, 10), GREEDY)
    wait_until(c.ready)
    fake.next()
    c.store(tokens(1, 10))  # no prefix cache: nothing to do
    fake.assert_quiet()

    arena = memoryview(bytearray(4096))
    pages = PageStore(PageTree(4, ExtentAllocator(len(arena), align=1)), arena, model=None)
    c.use_pages(pages)
    assert c.page_bytes == 64  # learnt from its replies
    p = tokens(1, 10)
    c.store(p)
    req = fake.next()
    assert (req["keep"], req["append"], req["k"]) == (10, [], 0)
    assert [start for start, _ in req["store"]] == [0, 4]  # full pages only
    offsets = [offset for _, offset in req["store"]]
    assert {o: fake.stored[o] for o in offsets} == {offsets[0]: p[0:4], offsets[1]: p[4:8]}
    assert c.mirror == fake.cache == p
    c.store(p)  # cached already
    fake.assert_quiet()

    q = tokens(100, 10)
    c.begin("b", q, GREEDY)  # nothing of it cached: read as usual
    req = fake.next()
    assert (req["keep"], req["append"], req.get("restore") or []) == (0, q, [])
    wait_until(c.ready)

    # catching up on p would restore its 8 cached tokens and read 2; asking locks, touches and counts nothing
    nodes = pages.tree.peek(p, "drafter")
    before = [(n.locks, n.last_used) for n in nodes]
    assert c.behind(p) == 2 and pages.drafter_tokens_from_cache == 0
    assert [(n.locks, n.last_used) for n in nodes] == before and not pages.locked
    c.begin("c", p, GREEDY)  # the drafter holds q, but p's pages are cached
    c.store(p)  # a reply still due: store waits for nothing, sends nothing
    req = fake.next()
    assert req["restore"] == offsets
    assert (req["keep"], req["append"]) == (8, p[8:])
    assert pages.drafter_tokens_from_cache == 8
    fake.assert_quiet()
    wait_until(c.ready)
    assert c.mirror == fake.cache == p
    pages.release()


def test_pages_a_cancelled_store_was_writing_are_never_reused_until_the_drafter_answers(drafter, client, monkeypatch):
    """Issue 19, item 10: the wait for a store's reply ends early on a cancel,
    while the drafter still writes. Its extents must stay allocated (the next
    request's pages going there would be overwritten after their checksums were
    taken) and unmatched until the reply seals them."""
    monkeypatch.setattr(drafter_client, "WAIT_SLICE_MS", 10)
    fake, c = drafter(page_tokens=4, page_bytes=64), client()
    arena = memoryview(bytearray(64 * 4))  # room for four pages: the store's two, then two more
    pages = PageStore(PageTree(4, ExtentAllocator(len(arena), align=1)), arena, model=None)
    c.use_pages(pages)
    p = tokens(1, 8)
    c.begin("a", p, GREEDY)
    wait_until(c.ready)
    fake.next()
    fake.gate.clear()  # the drafter is busy writing
    c.on_wait = lambda: True  # and the request is cancelled meanwhile
    c.store(p)
    writing = {offset for _, offset in fake.next()["store"]}
    assert len(writing) == 2 and c.awaiting == 1
    assert pages.match_role(p, "drafter") == []  # unsealed: never restored
    pages.release()

    # the next request stores its own pages: never into the extents being written, even under pressure
    other = pages.plan(tokens(50, 16), "target", 64)
    assert len(other) == 2  # only two free extents left (nothing evictable: the drafter's are locked)
    assert {node.pages["target"].offset for _, node in other}.isdisjoint(writing)
    pages.tree.clear()  # a cache clear meanwhile: the pages being written survive it
    assert {n.pages["drafter"].offset for n in pages.tree.nodes() if "drafter" in n.pages} == writing

    fake.gate.set()  # the drafter finishes: its late reply seals the pages
    c.on_wait = None
    wait_until(c.ready)
    assert c.awaiting == 0
    assert len(pages.match_role(p, "drafter")) == 2
    pages.release()


def test_pages_of_a_store_the_drafter_died_during_are_freed(drafter, client, monkeypatch):
    monkeypatch.setattr(drafter_client, "WAIT_SLICE_MS", 10)
    fake, c = drafter(page_tokens=4, page_bytes=64), client()
    arena = memoryview(bytearray(64 * 4))
    pages = PageStore(PageTree(4, ExtentAllocator(len(arena), align=1)), arena, model=None)
    c.use_pages(pages)
    c.begin("a", tokens(1, 8), GREEDY)
    wait_until(c.ready)
    fake.next()
    fake.gate.clear()
    c.on_wait = lambda: True
    c.store(tokens(1, 8))
    fake.next()
    assert pages.tree.allocator.used == 128
    c.go_down()  # the daemon says it died: it writes nothing more
    assert pages.tree.allocator.used == 0 and c.unacknowledged == {}
    fake.stop()
