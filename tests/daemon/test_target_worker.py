"""The target worker's loop over a real PAIR socket, around an engine on a scripted
model (the socket shell without llama.cpp; the real worker runs in every
integration test)."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
import zmq

from tandem.daemon.config import SettingsValues
from tandem.daemon.worker import target_worker
from tandem.daemon.worker.engine import Engine
from tandem.daemon.worker.target_worker import TargetLoop
from tandem.daemon.worker.worker_config import WorkerConfig
from tandem.protocol import (
    CacheClear,
    CacheCleared,
    Cancel,
    Chunk,
    Done,
    Error,
    ErrorCode,
    FinishReason,
    Generate,
    ModelInfo,
    Shutdown,
    Status,
    decode,
    encode,
)
from tandem.protocol.internal import WORKER_REPLIES, DrafterState, Progress, Ready

INFO = ModelInfo("scripted", "/scripted.gguf", 64, 64, 256, 1, False)


class Worker:
    """A TargetLoop in a thread, and the daemon's end of its socket."""

    def __init__(self, load, drafter: str = "none"):
        self.dir = Path(tempfile.mkdtemp(prefix="tdm-tw-", dir="/tmp"))
        self.ctx = zmq.Context()
        self.daemon = self.ctx.socket(zmq.PAIR)
        self.daemon.bind(f"ipc://{self.dir / 'w.ipc'}")
        sock = self.ctx.socket(zmq.PAIR)
        sock.connect(f"ipc://{self.dir / 'w.ipc'}")
        config = WorkerConfig(
            role="target",
            model_name="scripted",
            model_path="/scripted.gguf",
            settings=SettingsValues(),
            drafter=drafter,
        )
        self.loop = TargetLoop(config, sock)
        self.load = load
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(target_worker, "load_engine", self.load)
            try:
                self.loop.run()
            finally:
                self.loop.sock.close(linger=2000)  # as the real worker: what it sent last is delivered

    def send(self, msg) -> None:
        self.daemon.send_multipart(encode(msg))

    def recv(self, timeout_ms: int = 5000):
        assert self.daemon.poll(timeout_ms), "the worker said nothing"
        return decode(self.daemon.recv_multipart(), table=WORKER_REPLIES)

    def until_terminal(self) -> list:
        got = []
        while not got or not isinstance(got[-1], (Done, Error)):
            got.append(self.recv())
        return got

    def close(self) -> None:
        if self.thread.is_alive():
            self.send(Shutdown(id="daemon"))
            self.thread.join(5)
        self.daemon.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def worker_on(scripted_model):
    started = []

    def start(model=None, load=None, drafter="none"):
        model = model if model is not None else scripted_model(b"hello world")
        w = Worker(load or (lambda config, d: (Engine(model, None, d, draft_tokens=4), INFO)), drafter)
        started.append(w)
        return w

    yield start
    for w in started:
        w.close()


def test_it_says_ready_then_streams_a_request_after_a_first_heartbeat(worker_on):
    w = worker_on()
    ready = w.recv()
    assert isinstance(ready, Ready) and ready.model == INFO and ready.governor is None and ready.cache is None
    w.send(Generate(id="g1", prompt="hi", temperature=0.0, max_tokens=5))
    got = w.until_terminal()
    assert isinstance(got[0], Progress) and got[0].id == "g1"  # at once: a prefill may take a while
    chunks = [m for m in got if isinstance(m, Chunk)]
    assert "".join(c.text for c in chunks) == "hello" and got[-1].text == "hello"
    assert got[-1].finish_reason == FinishReason.LENGTH


def test_a_request_the_engine_refuses_is_an_error_and_the_loop_serves_on(worker_on, scripted_model):
    w = worker_on(scripted_model(b"x", n_ctx=8))
    w.recv()
    w.send(Generate(id="long", prompt="123456789", temperature=0.0))
    assert w.until_terminal()[-1].code == ErrorCode.PROMPT_TOO_LONG
    w.send(Generate(id="ok", prompt="1", temperature=0.0, max_tokens=1))
    assert isinstance(w.until_terminal()[-1], Done)


def test_a_cancel_lands_between_steps(worker_on, scripted_model):
    class SlowModel(scripted_model):
        def decode(self, tokens, logits_for=(-1,), abort=None):
            time.sleep(0.02)
            return super().decode(tokens, logits_for, abort)

    w = worker_on(SlowModel(b"x" * 60))
    w.recv()
    w.send(Generate(id="g", prompt="hi", temperature=0.0, max_tokens=50))
    while not isinstance(w.recv(), Chunk):
        pass
    w.send(Cancel(id="g", request_id="g"))
    done = w.until_terminal()[-1]
    assert done.finish_reason == FinishReason.CANCELLED and done.usage.completion_tokens < 50


def test_control_messages_without_a_cache_or_drafter_are_answered_or_ignored(worker_on):
    w = worker_on()
    w.recv()
    w.send(Cancel(id="c", request_id="nothing-running"))  # finished before it came: ignored
    w.send(DrafterState(id="daemon", available=False))  # no drafter: nothing to switch
    w.send(Status(id="s"))  # decodable, but not the worker's to answer: logged, not fatal
    w.daemon.send_multipart([b"generate", b"\xc1"])  # undecodable: logged, not fatal
    w.send(CacheClear(id="k"))
    cleared = w.recv()
    assert isinstance(cleared, CacheCleared) and cleared.pages == 0 and cleared.cache is None
    w.send(Shutdown(id="daemon"))
    w.thread.join(5)
    assert not w.thread.is_alive()


def test_a_model_that_does_not_load_is_one_error_and_the_loop_ends(worker_on):
    def fail(config, drafter):
        raise FileNotFoundError("no such file: /scripted.gguf")

    w = worker_on(load=fail)
    err = w.recv()
    assert isinstance(err, Error) and err.code == ErrorCode.NOT_READY and "could not load the model" in err.message
    w.thread.join(5)
    assert not w.thread.is_alive()


def test_drafter_state_messages_reach_any_drafter_and_the_ngram_drafter_serves_on(worker_on, scripted_model):
    """The daemon's drafter_state goes to whatever drafter the engine has; the
    n-gram drafter has no process to lose, so it ignores it (it once crashed here)."""
    w = worker_on(scripted_model(b"abc abc abc abc"), drafter="ngram")
    w.recv()
    w.send(DrafterState(id="daemon", available=False))
    w.send(DrafterState(id="daemon", available=True))
    w.send(Generate(id="g", prompt="abc ", temperature=0.0, max_tokens=15))
    done = w.until_terminal()[-1]
    assert isinstance(done, Done) and done.text == "abc abc abc abc" and done.draft is not None


def test_each_placement_of_the_layers_keeps_its_own_governor_state(tmp_path):
    from tandem.daemon.drafting.governor import state_file

    base = state_file(tmp_path, "target=t.gguf drafter=d.gguf k=4")
    config = WorkerConfig(
        role="target",
        model_name="t",
        model_path="/t.gguf",
        settings=SettingsValues(),
        governor_state=str(base),
        governor_identity="target=t.gguf drafter=d.gguf k=4",
    )
    # every layer on the CPU: the daemon's identity and file, as before placement was known
    assert target_worker.governor_keys(config, "") == (config.governor_identity, base)
    gpu = target_worker.governor_keys(config, "layers=CUDA0:31")
    rpc = target_worker.governor_keys(config, "layers=RPC0:16,RPC1:15")
    assert gpu[0] == "target=t.gguf drafter=d.gguf k=4 layers=CUDA0:31"
    assert len({base, gpu[1], rpc[1]}) == 3 and gpu[1].parent == rpc[1].parent == tmp_path
    # steps over repacked weights in 3-row passes: verify costs another price than before repacking
    repacked = target_worker.governor_keys(config, "", 3)
    both = target_worker.governor_keys(config, "layers=CUDA0:31", 3)
    assert repacked[0] == "target=t.gguf drafter=d.gguf k=4 step_rows=3"
    assert both[0] == "target=t.gguf drafter=d.gguf k=4 layers=CUDA0:31 step_rows=3"
    assert len({base, gpu[1], repacked[1], both[1]}) == 4
    config.governor_state = ""  # no state directory: nothing kept anywhere
    assert target_worker.governor_keys(config, "layers=CUDA0:31")[1] is None


def test_a_prompt_read_that_cannot_be_measured_leaves_the_pass_costs_standing(scripted_model, monkeypatch, caplog):
    from tandem.daemon.drafting import governor

    config = WorkerConfig(
        role="target", model_name="t", model_path="/t.gguf", settings=SettingsValues(), drafter="model", drafter_bytes=1
    )
    model = scripted_model(b"the quick brown fox jumps over the lazy dog. " * 4, n_ctx=512)
    model.tokenize = lambda text, add_special=True, parse_special=True: list(range(1, 200))
    model.size_bytes = 1
    costs = target_worker.pass_costs(model, config, 1)
    assert costs is not None and costs.read is not None and costs.read > 0  # measured: a 64-token prompt

    def broken(model, n=64):
        raise RuntimeError("no room")

    monkeypatch.setattr(governor, "measure_read_cost", broken)
    costs = target_worker.pass_costs(model, config, 1)
    assert costs is not None and costs.read is None and set(costs.load) == set(range(1, config.draft_tokens + 2))
    assert "could not measure a prompt read (RuntimeError: no room)" in caplog.text


# ---------------------------------------------------------------- the short-request lane


def slow(scripted_model, copies: bool):
    """A scripted model whose steps take 20 ms; ``copies``: it can copy its KV state (suspend/resume)."""

    class Slow(scripted_model):
        def decode(self, tokens, logits_for=(-1,), abort=None):
            time.sleep(0.02)
            return super().decode(tokens, logits_for, abort)

    class Copying(Slow):
        def suspend(self, max_bytes):
            return (self.n_past, self.prompt_len)

        def resume(self, saved):
            self.n_past, self.prompt_len = saved

        def forget_history(self):
            pass

    return Copying if copies else Slow


def terminals(w, n: int) -> list:
    """The next ``n`` terminal messages, in the order they came."""
    got = []
    while len(got) < n:
        msg = w.recv()
        if isinstance(msg, (Done, Error)):
            got.append(msg)
    return got


def start_long_then_short(w, short_id: str = "short") -> None:
    w.recv()  # ready
    w.send(Generate(id="long", prompt="hi", temperature=0.0, max_tokens=40))
    while not isinstance(w.recv(), Chunk):
        pass
    w.send(Generate(id=short_id, prompt="yo", temperature=0.0, max_tokens=3))


def test_a_short_request_is_served_within_the_running_one_and_both_write_what_they_write_alone(
    worker_on, scripted_model
):
    w = worker_on(slow(scripted_model, copies=True)(b"x" * 60))
    start_long_then_short(w)
    short, long = terminals(w, 2)
    assert (short.id, short.text) == ("short", "xxx")
    assert (long.id, long.text) == ("long", "x" * 40) and long.timings.paused_seconds > 0


def test_where_the_model_cannot_copy_its_kv_the_short_request_waits_for_the_running_one(worker_on, scripted_model):
    w = worker_on(slow(scripted_model, copies=False)(b"x" * 60))
    start_long_then_short(w)
    long, short = terminals(w, 2)
    assert (long.id, long.text, long.timings.paused_seconds) == ("long", "x" * 40, 0.0)
    assert (short.id, short.text) == ("short", "xxx")
    # it waited here for at least the long one's last 35 steps of 20 ms (the daemon adds its own queue's wait)
    assert short.timings.queued_seconds >= 35 * 0.02


def test_a_waiting_short_request_that_is_cancelled_is_answered_at_once(worker_on, scripted_model):
    w = worker_on(slow(scripted_model, copies=False)(b"x" * 60))
    start_long_then_short(w)
    w.send(Cancel(id="c", request_id="short"))
    short, long = terminals(w, 2)
    assert (short.id, short.finish_reason) == ("short", FinishReason.CANCELLED)
    assert (long.id, long.text) == ("long", "x" * 40)
    w.send(Generate(id="next", prompt="hi", temperature=0.0, max_tokens=2))
    assert terminals(w, 1)[0].text == "xx"  # nothing of the cancelled one is served later
