"""The daemon's embed requests without sockets or models: the queue (EmbedQueue), the
supervisor's handling of the embedding worker (its death at any moment, loading
included, never the daemon's), and what the worker computes (vectors.py and
embed_worker.Embedding with a fake model)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from tandem.daemon import config as settings
from tandem.daemon.embedding.embed_worker import BUSY_SLICE_TOKENS, Cancelled, Embedding
from tandem.daemon.embedding.vectors import TooLong, finish, fit, max_inputs, next_batch
from tandem.daemon.front.embed_queue import EmbedQueue
from tandem.daemon.front.embedder import EMBEDDER_MAX_DEATHS, Embedder
from tandem.daemon.front.metrics import Metrics
from tandem.daemon.front.restart_policy import RestartPolicy
from tandem.daemon.front.scheduler import Scheduler
from tandem.daemon.front.sdnotify import Notifier
from tandem.daemon.front.server import ServeConfig
from tandem.daemon.front.supervisor import TARGET_MAX_DEATHS, Supervisor
from tandem.protocol import (
    MAX_EMBED_INPUTS,
    Busy,
    Cancel,
    Embed,
    Embedded,
    Error,
    ErrorCode,
    Generate,
    ModelInfo,
    Shutdown,
)
from tandem.protocol.internal import Pace, Progress, Ready

INFO = ModelInfo("m", "/m.gguf", 64, 64, 256, 1, False)


def embedded(rid: str, n: int = 1, tokens: int = 3) -> Embedded:
    return Embedded(id=rid, model="e", embeddings=[[1.0, 0.0]] * n, prompt_tokens=tokens)


class Queue:
    def __init__(self, model: str = "e", max_queue: int = 4):
        self.replies: list = []
        self.sent: list = []
        self.worker_up = True
        self.metrics = Metrics(lambda: {})
        self.q = EmbedQueue(
            lambda i, m: self.replies.append((i, m)) or True,
            lambda m: self.worker_up and (self.sent.append(m) or True),
            self.metrics,
            max_queue,
            model=model,
        )

    def admit(self, rid: str, who: bytes = b"A", **kw) -> None:
        self.q.admit(who, Embed(id=rid, input=["x"], **kw))


def test_no_embedding_model_is_a_typed_error_naming_the_fix():
    t = Queue(model="")
    t.admit("a")
    ((who, err),) = t.replies
    assert who == b"A" and err.code == ErrorCode.NO_EMBEDDING_MODEL and err.id == "a"
    assert "tandem serve --embedding-model" in err.message
    assert not t.q.queue and not t.q.jobs


def test_one_request_at_a_time_in_order_each_answered_once_with_its_queue_time():
    t = Queue()
    for rid in "abc":
        t.admit(rid)
    assert t.q.start_next() and not t.q.start_next()  # one in flight
    assert [m.id for m in t.sent] == ["a"]
    assert t.q.on_worker_message(embedded("a", tokens=5))
    assert not t.q.on_worker_message(embedded("zzz"))  # about no request of ours
    assert t.q.start_next() and [m.id for m in t.sent] == ["a", "b"]
    assert t.q.on_worker_message(Error.of("b", ErrorCode.PROMPT_TOO_LONG, "too long"))
    (_, first), (_, second) = t.replies
    assert isinstance(first, Embedded) and first.queued_seconds >= 0.0
    assert second.code == ErrorCode.PROMPT_TOO_LONG
    assert t.metrics.embed_tokens._value.get() == 5 and t.metrics.embed_inputs._value.get() == 1


def test_a_full_queue_answers_busy_and_a_duplicate_id_is_refused():
    t = Queue(max_queue=2)
    t.admit("a")
    t.admit("b")
    t.admit("c")
    assert isinstance(t.replies[-1][1], Busy) and t.replies[-1][1].id == "c"
    assert t.metrics.embed_requests.labels("busy")._value.get() == 1
    t.admit("a", who=b"B")  # another connection: the error carries its id
    assert t.replies[-1][1].code == ErrorCode.DUPLICATE_REQUEST_ID and t.replies[-1][1].id == "a"
    t.q.admit(b"B", Embed(id="g", input=["x"]), id_owner=b"B")  # a generate of its own with this id: no id
    assert t.replies[-1][1].code == ErrorCode.DUPLICATE_REQUEST_ID and t.replies[-1][1].id is None


def test_a_worker_death_answers_the_running_request_and_the_queue_waits_for_the_restart():
    t = Queue()
    t.admit("a")
    t.admit("b")
    t.q.start_next()
    t.q.abort(ErrorCode.WORKER_DIED, "the embedding worker died")
    ((_, err),) = t.replies
    assert err.id == "a" and err.code == ErrorCode.WORKER_DIED
    assert [j.request.id for j in t.q.queue] == ["b"] and t.q.active is None


def test_switched_off_answers_what_waits_and_what_comes():
    t = Queue()
    for rid in "ab":
        t.admit(rid)
    t.q.start_next()
    t.q.switch_off("died 3 times within 10 minutes")
    t.admit("c")
    assert [m.id for _, m in t.replies] == ["a", "b", "c"]
    assert all(m.code == ErrorCode.NOT_READY and "restart the daemon" in m.message for _, m in t.replies)
    assert "died 3 times" in t.replies[-1][1].message


def test_a_client_that_leaves_loses_its_queue_and_its_running_request_is_cancelled():
    t = Queue()
    t.admit("a", who=b"L")
    t.admit("b", who=b"L")
    t.admit("c", who=b"S")
    t.q.start_next()
    t.q.client_gone(b"L")
    assert isinstance(t.sent[-1], Cancel) and t.sent[-1].request_id == "a"
    assert [j.request.id for j in t.q.queue] == ["c"]
    t.q.on_worker_message(Error.of("a", ErrorCode.INTERNAL, "cancelled"))  # the worker's answer: to nobody
    assert not t.replies and t.q.active is None and t.q.start_next()


def test_shutting_down_answers_everything_and_refuses_the_rest():
    t = Queue()
    t.admit("a")
    t.admit("b")
    t.q.start_next()
    t.q.shutting_down()
    t.admit("c")
    assert sorted(m.id for _, m in t.replies) == ["a", "b", "c"]
    assert all(m.code == ErrorCode.SHUTTING_DOWN for _, m in t.replies) and not t.q.jobs


# --------------------------------------------------------------------------- the supervisor


class FakeSock:
    """A channel with nothing waiting on it."""

    def recv_multipart(self, flags: int = 0):
        raise zmq.Again()


class FakeHandle:
    def __init__(self, role: str, policy: RestartPolicy):
        self.role, self.policy = role, policy
        self.sent: list = []
        self.alive, self.sock, self.sentinel, self.info = True, FakeSock(), None, None
        self.pid, self.process, self.started_at, self.starts, self.exit_code = 4242, None, 0.0, 0, -9

    @property
    def ready(self) -> bool:
        return self.info is not None and self.alive

    def send(self, msg) -> bool:
        self.sent.append(msg)
        return self.alive

    def reap(self):
        self.sock, self.info = None, None
        return self.exit_code

    def start(self) -> None:
        self.starts += 1
        self.alive, self.sock, self.info = True, FakeSock(), None

    def die(self, code: int = -9) -> None:
        self.alive, self.exit_code = False, code


class Daemon:
    """A supervisor with a fake target and a fake embedding worker, the scheduler and the embed queue."""

    def __init__(self, loaded: bool = True):
        sources = {o.key: "default" for o in settings.OPTIONS}
        s = settings.Settings(settings.SettingsValues(), sources, Path("/nonexistent.toml"), False)
        config = ServeConfig(
            settings=s,
            model_name="m",
            model_path=Path("/m.gguf"),
            socket_path=Path("/tmp/unused.sock"),
            embedding_name="e",
            embedding_path=Path("/e.gguf"),
        )
        self.replies: list = []
        self.scheduler = Scheduler(
            lambda i, m: self.replies.append(m) or True,
            lambda i, f: True,
            lambda m: self.sup.target.send(m),
            Metrics(lambda: {}),
            max_queue=8,
        )
        self.sup = Supervisor(None, config, self.scheduler, self.scheduler.metrics, Notifier(None), lambda: False, None)
        self.embeds = EmbedQueue(
            lambda i, m: self.replies.append(m) or True,
            lambda m: self.sup.embedder.send(m),
            self.scheduler.metrics,
            8,
            model="e",
            counters=self.scheduler.counters,
        )
        self.sup.embedding = Embedder(config, self.scheduler.metrics, self.embeds, lambda: False)
        timeout = s.values.worker_timeout
        self.sup.target = FakeHandle(
            "target", RestartPolicy(TARGET_MAX_DEATHS, 600.0, timeout, self.sup._target_gave_up)
        )
        policy = RestartPolicy(EMBEDDER_MAX_DEATHS, 600.0, timeout, self.sup.embedding._gave_up)
        self.sup.embedding.handle = FakeHandle("embedding", policy)
        self.sup._on_ready(self.sup.target, Ready(id="target", model=INFO, pid=1))
        if loaded:
            self.sup._on_ready(self.sup.embedder, Ready(id="embedding", model=INFO, pid=2))
        assert self.sup.state == "ready"

    def embed(self, rid: str) -> None:
        self.embeds.admit(b"C", Embed(id=rid, input=["x"]))
        self.sup.embedding.pace(self.scheduler.busy)
        self.sup.embedding.start_next()


def test_the_embedding_worker_killed_mid_request_gives_worker_died_and_is_restarted_daemon_ready():
    d = Daemon()
    d.embed("a")
    d.embed("b")
    d.sup.embedder.die()
    d.sup.check(time.monotonic())
    (err,) = d.replies
    assert err.id == "a" and err.code == ErrorCode.WORKER_DIED and "embedding worker" in err.message
    assert "retried" in err.message and d.sup.state == "ready"  # generation goes on
    assert d.sup.embedding.note() == " (restarting)"
    d.sup.check(d.sup.embedder.policy.restart_due)
    assert d.sup.embedder.starts == 1
    d.sup._on_ready(d.sup.embedder, Ready(id="embedding", model=INFO, pid=3))
    d.sup.embedding.start_next()
    assert d.sup.embedder.sent[-1].id == "b" and d.sup.embedding.note() == ""


def test_a_crash_while_it_first_loads_switches_embeddings_off_and_the_daemon_serves_on():
    d = Daemon(loaded=False)
    d.embed("a")  # waits for the model
    assert not d.replies and d.sup.embedding.note() == " (loading)"
    d.sup.embedder.die(code=-11)
    d.sup.check(time.monotonic())
    (err,) = d.replies
    assert err.code == ErrorCode.NOT_READY and "while loading /e.gguf" in err.message
    assert d.sup.state == "ready" and d.sup.embedding.note().startswith(" (off: ")
    assert d.sup.embedder.policy.restart_due is None


def test_killed_while_loading_it_is_loaded_again():
    d = Daemon(loaded=False)
    d.sup.embedder.die(code=-9)  # the OOM killer, a user
    d.sup.check(time.monotonic())
    assert d.sup.embedder.policy.restart_due is not None and not d.embeds.off


def test_a_model_that_cannot_load_switches_embeddings_off():
    d = Daemon(loaded=False)
    d.sup.embedding.on_message(Error.of("embedding", ErrorCode.NOT_READY, "could not load the embedding model x"))
    d.embed("a")
    (err,) = d.replies
    assert err.code == ErrorCode.NOT_READY and "embeddings are off" in err.message and d.sup.state == "ready"
    assert isinstance(d.sup.embedder.sent[-1], Shutdown)


def test_it_is_given_up_after_dying_too_often_generation_unaffected():
    d = Daemon()
    for i in range(EMBEDDER_MAX_DEATHS):
        d.sup.embedder.die()
        d.sup.check(time.monotonic())
        if d.sup.embedder.policy.restart_due is not None:
            d.sup.check(d.sup.embedder.policy.restart_due)
            d.sup._on_ready(d.sup.embedder, Ready(id="embedding", model=INFO, pid=10 + i))
    assert "died 3 times" in d.embeds.off and d.sup.state == "ready"
    d.embed("late")
    assert d.replies[-1].code == ErrorCode.NOT_READY


def test_pace_follows_the_target_and_its_silence_is_excused_while_a_generation_runs():
    d = Daemon()
    d.embed("a")
    assert [m.generating for m in d.sup.embedder.sent if isinstance(m, Pace)] == [False]
    d.scheduler.admit(b"G", Generate(id="g", prompt="hi"))
    d.scheduler.start_next()
    d.sup.embedding.pace(d.scheduler.busy)
    d.sup.embedding.pace(d.scheduler.busy)  # said once
    assert [m.generating for m in d.sup.embedder.sent if isinstance(m, Pace)] == [False, True]
    late = time.monotonic() + d.sup.settings.values.worker_timeout * 2
    d.sup.check(late)  # a generation runs: the embedding worker yields the cores to it
    assert d.sup.embedder.alive
    d.sup.embedding.on_message(Progress(id="a"))
    d.scheduler.abort(ErrorCode.WORKER_DIED, "x", "x")  # no generation any more
    d.sup.check(late + d.sup.settings.values.worker_timeout * 2)
    assert d.sup.embedder.policy.hung  # silent while it could work: killed as hung


# --------------------------------------------------------------------------- what the worker computes


def test_fit_keeps_the_tokens_around_the_text_or_refuses():
    tokens = [101, *range(1, 20), 102]  # [CLS] text [SEP]
    cut, was = fit(tokens, 8, head=1, tail=1, truncate=True, where="input 0")
    assert was and cut == [101, 1, 2, 3, 4, 5, 6, 102]
    assert fit(tokens, 64, 1, 1, True, "input 0") == (tokens, False)
    with pytest.raises(TooLong, match="input 3 has 21 tokens; the embedding context holds 8"):
        fit(tokens, 8, 1, 1, truncate=False, where="input 3")
    assert fit(list(range(10)), 4, 0, 0, True, "x")[0] == [0, 1, 2, 3]


def test_batches_fit_the_budget_and_a_long_input_goes_alone():
    lengths = [10, 10, 50, 200, 5, 5]
    ends, start = [], 0
    while start < len(lengths):
        start = next_batch(lengths, start, 64, 3)
        ends.append(start)
    assert ends == [2, 3, 4, 6]
    assert next_batch([1] * 10, 0, 100, 4) == 4  # at most max_seqs inputs


def test_finish_cuts_and_normalizes():
    v = np.array([[3.0, 4.0, 12.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    out = finish(v, None, True)
    assert np.allclose(out[0], [3 / 13, 4 / 13, 12 / 13]) and out[1] == [0.0, 0.0, 0.0]
    assert np.allclose(finish(v, 2, True)[0], [0.6, 0.8]) and finish(v, 2, False)[0] == [3.0, 4.0]
    assert max_inputs(896) == MAX_EMBED_INPUTS and max_inputs(8192) < MAX_EMBED_INPUTS


class FakeModel:
    """What Embedding uses of llama_embed.EmbeddingModel; ``embed`` records its passes."""

    n_embd, n_vocab, n_ctx, head, tail, max_threads = 4, 100, 32, 1, 1, 2

    def __init__(self):
        self.passes: list[tuple[int, int]] = []  # (inputs, threads)
        self.n_threads = 2

    def tokenize(self, text: str) -> list[int]:
        return [1] + [2 + (ord(c) % 90) for c in text] + [99]

    def set_threads(self, n: int) -> None:
        self.n_threads = n

    def embed(self, seqs):
        self.passes.append((len(seqs), self.n_threads))
        return np.array([[len(s), 1.0, 0.0, 0.0] for s in seqs], dtype=np.float32)


def test_embedding_reads_whole_batches_idle_and_small_slices_on_one_thread_while_a_generation_runs():
    e = Embedding(FakeModel(), "e")
    texts = ["a" * 10] * 6
    reply = e.run(Embed(id="r", input=texts, normalize=False), lambda: None)
    assert e.model.passes == [(2, 2), (2, 2), (2, 2)]  # 12 tokens each, 32 a pass
    assert reply.prompt_tokens == 72 and reply.input_tokens == [12] * 6 and reply.embeddings[0][0] == 12.0
    e.model.passes.clear()
    e.generating = True
    e.run(Embed(id="r", input=texts), lambda: None)
    per_slice = BUSY_SLICE_TOKENS // 12
    assert all(threads == 1 and n <= max(per_slice, 1) for n, threads in e.model.passes)


def test_embedding_checks_what_it_cannot_do_and_stops_when_cancelled():
    e = Embedding(FakeModel(), "e")
    with pytest.raises(ValueError, match="'dimensions' is 5; e's vectors have 4"):
        e.run(Embed(id="r", input=["a"], dimensions=5), lambda: None)
    with pytest.raises(ValueError, match="token id 100"):
        e.run(Embed(id="r", tokens=[[1, 100]]), lambda: None)
    with pytest.raises(TooLong):
        e.run(Embed(id="r", input=["a" * 40], truncate=False), lambda: None)
    cut = e.run(Embed(id="r", input=["a" * 40, "b"]), lambda: None)
    assert cut.truncated == 1 and cut.input_tokens == [32, 3]

    def cancel():
        raise Cancelled()

    with pytest.raises(Cancelled):
        e.run(Embed(id="r", input=["a"]), cancel)
