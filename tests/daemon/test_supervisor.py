"""Worker deaths through the supervisor with fake worker handles: one code path and
one restart policy for both roles, what the running request is told, and each
role's give-up (pure logic; real workers are killed in tests/reliability). And
what memory() reads of each process, with a real child process as a worker."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tandem.daemon import config as settings
from tandem.daemon.front.metrics import Metrics
from tandem.daemon.front.restart_policy import RestartPolicy
from tandem.daemon.front.scheduler import Scheduler
from tandem.daemon.front.sdnotify import Notifier
from tandem.daemon.front.server import ServeConfig
from tandem.daemon.front.supervisor import DRAFTER_MAX_DEATHS, TARGET_MAX_DEATHS, Supervisor
from tandem.protocol import Done, ErrorCode, FinishReason, Generate, ModelInfo, Timings, Usage, encode
from tandem.protocol.internal import DrafterState, Ready

INFO = ModelInfo("m", "/m.gguf", 64, 64, 256, 1, False)


class FakeHandle:
    """What the supervisor uses of a WorkerHandle: a process that can die."""

    def __init__(self, role: str, policy: RestartPolicy):
        self.role, self.policy = role, policy
        self.sent: list = []
        self.alive = True
        self.sock = object()  # a channel: its death is noticed while it has one
        self.sentinel = None
        self.info = None  # until its ready
        self.pid = 4242
        self.process = None
        self.started_at = 0.0
        self.starts = 0
        self.exit_code = -9

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
        self.alive, self.sock, self.info = True, object(), None

    def die(self, code: int = -9) -> None:
        self.alive, self.exit_code = False, code


def serve_config(drafter_name: str, drafter_path, socket_path: Path = Path("/tmp/unused.sock")) -> ServeConfig:
    """A daemon's configuration with every setting at its default."""
    sources = {o.key: "default" for o in settings.OPTIONS}
    s = settings.Settings(settings.SettingsValues(), sources, Path("/nonexistent.toml"), False)
    return ServeConfig(
        settings=s,
        model_name="m",
        model_path=Path("/m.gguf"),
        socket_path=socket_path,
        drafter_name=drafter_name,
        drafter_path=drafter_path,
    )


class Harness:
    def __init__(self, drafter: bool = False):
        config = serve_config("d" if drafter else "none", Path("/d.gguf") if drafter else None)
        s = config.settings
        self.replies: list = []
        self.stopped = False
        self.scheduler = Scheduler(
            lambda i, m: self.replies.append(m) or True,
            lambda i, f: True,
            lambda m: self.sup.target.send(m),
            Metrics(lambda: {}),
            max_queue=8,
        )
        self.sup = Supervisor(
            None, config, self.scheduler, self.scheduler.metrics, Notifier(None), lambda: self.stopped, self._stop
        )
        timeout = s.values.worker_timeout
        self.sup.target = FakeHandle(
            "target", RestartPolicy(TARGET_MAX_DEATHS, 600.0, timeout, self.sup._target_gave_up)
        )
        self.scheduler.on_request_done = self.sup.target.policy.forgive
        if drafter:
            policy = RestartPolicy(DRAFTER_MAX_DEATHS, 600.0, timeout, self.sup._drafter_gave_up)
            self.sup.drafter = FakeHandle("drafter", policy)
        for w in reversed(self.sup.workers):  # the drafter starts (and loads) first
            self.sup._on_ready(w, Ready(id=w.role, model=INFO, pid=1))
        assert self.sup.state == "ready"

    def _stop(self):
        self.stopped = True

    def run_request(self, rid: str, **kw) -> None:
        self.scheduler.admit(b"C", Generate(id=rid, prompt="hi", **kw))
        assert self.sup.can_take_work and self.scheduler.start_next()
        # the shell does this when work starts. Every `now` here is time.monotonic(): the supervisor stamps a
        # death with it, so a fixed clock (1000.0 once) fails on a machine booted less than that long ago
        self.sup.target.policy.heard(time.monotonic())

    def restart_due(self, worker) -> None:
        """Let the backoff pass and the restart happen; the restarted worker says ready."""
        self.sup.check(worker.policy.restart_due)
        self.sup._on_ready(worker, Ready(id=worker.role, model=INFO, pid=2))

    def kill(self, worker, times: int = 1) -> None:
        """Kill ``worker`` ``times`` times, each death noticed and its restart done."""
        for _ in range(times):
            worker.die()
            self.sup.check(time.monotonic())
            self.restart_due(worker)


def finished(rid: str) -> Done:
    return Done(rid, "x", FinishReason.STOP, Usage(1, 1), Timings(0.0, 0.0, 0.0, 0.0, 0.0))


def test_a_target_death_answers_the_request_and_restarts_it_after_the_backoff():
    h = Harness()
    h.run_request("a")
    h.sup.target.die()
    h.sup.check(time.monotonic())
    (err,) = h.replies
    assert err.code == ErrorCode.WORKER_DIED and "died (exit code -9)" in err.message and "retried" in err.message
    assert h.sup.state == "loading" and h.sup.target.policy.restarts == 1 and h.sup.target.starts == 0
    h.restart_due(h.sup.target)
    assert h.sup.target.starts == 1 and h.sup.state == "ready"


def test_a_target_that_keeps_dying_without_finishing_a_request_fails_the_daemon():
    h = Harness()
    h.kill(h.sup.target, TARGET_MAX_DEATHS - 1)
    h.sup.target.die()
    h.sup.check(time.monotonic())
    assert h.sup.state == "failed" and "died 5 times within 10 minutes" in h.sup.failure
    assert "gave up restarting it" in h.scheduler.failure and not h.stopped  # it served before: it stays to say why


def test_a_finished_request_forgives_earlier_target_deaths():
    h = Harness()
    h.kill(h.sup.target, TARGET_MAX_DEATHS - 1)
    h.run_request("a")
    h.scheduler.on_target_message(finished("a"), encode(finished("a")))
    h.sup.target.die()
    h.sup.check(time.monotonic())
    assert h.sup.state == "loading"  # the count started again


def test_a_drafter_death_lets_a_drafting_request_go_on_and_the_target_decodes_plainly():
    h = Harness(drafter=True)
    h.run_request("a", draft_tokens=4)
    h.sup.drafter.die()
    h.sup.check(time.monotonic())
    assert h.replies == [] and h.scheduler.active is not None  # the request is not failed: it goes on plainly
    states = [m for m in h.sup.target.sent if isinstance(m, DrafterState)]
    assert [s.available for s in states] == [False] and h.sup.state == "ready"
    assert h.sup.drafter_note() == " (restarting)"
    h.restart_due(h.sup.drafter)
    assert [m.available for m in h.sup.target.sent if isinstance(m, DrafterState)] == [False, True]


def test_a_drafter_that_keeps_dying_is_switched_off_and_serving_goes_on():
    h = Harness(drafter=True)
    h.kill(h.sup.drafter, DRAFTER_MAX_DEATHS - 1)
    h.run_request("a", draft="off")  # not drafting: not answered for the drafter
    h.sup.drafter.die()
    h.sup.check(time.monotonic())
    assert h.sup.drafter_off == "it died 3 times within 10 minutes" and h.sup.drafter.policy.restart_due is None
    assert h.sup.state == "ready" and h.sup.can_take_work and h.scheduler.active is not None  # a goes on
    assert not h.replies and h.sup.drafter_note() == " (off: it died 3 times within 10 minutes)"


@pytest.mark.parametrize("role", ["target", "drafter"])
def test_a_worker_killed_as_hung_says_so(role, caplog):
    h = Harness(drafter=True)
    h.run_request("a", draft_tokens=4)
    worker = getattr(h.sup, role)
    worker.policy.killed_as_hung("did not answer within 120 s (worker_timeout) and was killed")
    with caplog.at_level("WARNING", "tandem.daemon"):
        worker.die()
        h.sup.check(time.monotonic())
    if role == "target":
        assert "did not answer within 120 s" in h.replies[0].message
    else:  # the request goes on plainly: the log says why
        assert h.replies == [] and "drafter worker did not answer within 120 s" in caplog.text


def loading_harness(drafter: bool = False) -> Harness:
    """A harness whose workers are still loading (none has said ready)."""
    h = Harness(drafter=drafter)
    h.sup.ever_ready, h.sup.state = False, "loading"
    for w in h.sup.workers:
        w.info = None
        w.sent.clear()
    return h


def test_a_target_killed_while_loading_is_loaded_again_and_the_daemon_serves():
    h = loading_harness()
    h.sup.target.die(code=-9)  # the OOM killer, or a user
    h.sup.check(time.monotonic())
    assert h.sup.state == "loading" and not h.stopped and h.sup.target.policy.restart_due is not None
    h.restart_due(h.sup.target)
    assert h.sup.target.starts == 1 and h.sup.state == "ready" and h.sup.ever_ready


def test_a_target_that_keeps_dying_while_loading_fails_the_daemon_and_stops_it():
    h = loading_harness()
    for _ in range(TARGET_MAX_DEATHS - 1):
        h.sup.target.die(code=-9)
        h.sup.check(time.monotonic())
        h.sup.check(h.sup.target.policy.restart_due)  # restarted; it is killed again before it is ready
    assert h.sup.state == "loading" and not h.stopped
    h.sup.target.die(code=-9)
    h.sup.check(time.monotonic())
    assert h.sup.state == "failed" and h.stopped
    assert "gave up" in h.sup.failure and "before it was ever ready" in h.sup.failure
    assert "while loading /m.gguf" in h.sup.failure


@pytest.mark.parametrize("code", [1, -11])
def test_a_worker_that_crashes_while_loading_fails_the_daemon_at_once(code):
    """A crash at load (a bad file, a llama.cpp abort) would only crash again: no retries."""
    h = loading_harness()
    h.sup.target.die(code=code)
    h.sup.check(time.monotonic())
    assert h.sup.state == "failed" and h.stopped and f"died (exit code {code}) while loading /m.gguf" in h.sup.failure


@pytest.mark.parametrize("target_first", [True, False])
def test_at_the_first_start_a_drafter_still_loading_is_not_down(target_first):
    """The daemon serves nothing until both are loaded: whichever is ready first (a small or
    seeded target can be), the target is never told the drafter is down, so it drafts from the
    first request (told so, it had stayed off for good: a 'down' is answered only by a restart)."""
    h = loading_harness(drafter=True)
    order = [h.sup.target, h.sup.drafter] if target_first else [h.sup.drafter, h.sup.target]
    for w in order:
        h.sup._on_ready(w, Ready(id=w.role, model=INFO, pid=1))
    assert h.sup.state == "ready"
    assert not [m for m in h.sup.target.sent if isinstance(m, DrafterState)]


def test_a_drafter_restarted_while_the_target_loads_is_up_for_the_target():
    """Told while it loaded that the drafter died (a queued message it reads after its ready), a target is
    told at its ready that the drafter is back."""
    h = loading_harness(drafter=True)
    h.sup.drafter.die()
    h.sup.check(time.monotonic())
    h.restart_due(h.sup.drafter)
    h.sup._on_ready(h.sup.target, Ready(id="target", model=INFO, pid=1))
    assert h.sup.state == "ready"
    assert [m.available for m in h.sup.target.sent if isinstance(m, DrafterState)][-1] is True


def test_a_drafter_killed_while_loading_is_loaded_again_and_then_drafts():
    h = loading_harness(drafter=True)
    h.sup.drafter.die()
    h.sup.check(time.monotonic())
    h.sup._on_ready(h.sup.target, Ready(id="target", model=INFO, pid=1))
    assert h.sup.state == "loading"  # the first start waits for both
    h.restart_due(h.sup.drafter)
    assert h.sup.state == "ready"
    assert [m.available for m in h.sup.target.sent if isinstance(m, DrafterState)][-1] is True


def test_a_drafter_that_keeps_dying_while_loading_is_switched_off_and_the_target_serves():
    h = loading_harness(drafter=True)
    h.sup._on_ready(h.sup.target, Ready(id="target", model=INFO, pid=1))
    for _ in range(DRAFTER_MAX_DEATHS):
        h.sup.drafter.die()
        h.sup.check(time.monotonic())
        if h.sup.drafter.policy.restart_due is not None:
            h.sup.check(h.sup.drafter.policy.restart_due)
    assert h.sup.drafter_off and h.sup.state == "ready" and not h.stopped


@pytest.mark.parametrize(
    "drafter_name, drafter_path, spins",
    [("none", None, [None]), ("ngram", None, [None]), ("d", Path("/d.gguf"), [10_000, 10_000])],
)
def test_the_openmp_spin_is_short_only_beside_a_model_drafter(monkeypatch, tmp_path, drafter_name, drafter_path, spins):
    """Alone (no drafter, or a lookup drafter in Python) the target gets libgomp's default spin;
    beside a model drafter both processes get the short one: each one's idle spinning would steal
    the other's cores."""
    from tandem.daemon.front import supervisor as sup_module

    started = []

    class Recorder:
        def __init__(self, zctx, config, socket_dir, policy):
            started.append(config)

        def start(self):
            pass

    monkeypatch.setattr(sup_module, "WorkerHandle", Recorder)
    config = serve_config(drafter_name, drafter_path, tmp_path / "t.sock")
    scheduler = Scheduler(lambda i, m: True, lambda i, f: True, lambda m: None, Metrics(lambda: {}), max_queue=8)
    sup = Supervisor(None, config, scheduler, scheduler.metrics, Notifier(None), lambda: False, lambda: None)
    sup.start(tmp_path, "", 0)
    assert [c.spin_count for c in started] == spins


# ---- memory(): what status and the metrics show of each process


@pytest.fixture
def child():
    """A real process standing in for a worker (memory is read from /proc)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_memory_gives_rss_and_pss_of_the_daemon_and_each_live_worker(child):
    h = Harness(drafter=True)
    h.sup.target.pid = child.pid
    h.sup.drafter.alive = False  # a dead worker has no memory to read, and no pid to show
    rss, pss, pids = h.sup.memory()
    assert pids == {"target": child.pid}
    assert set(rss) == {"daemon", "target"}
    assert set(pss) == {"daemon", "target"}  # (Linux: psutil reads PSS from /proc/PID/smaps)
    assert all(0 < pss[r] <= rss[r] for r in pss)


def test_memory_falls_back_to_rss_where_smaps_cannot_be_read(child, monkeypatch):
    import psutil

    def denied(self):
        raise psutil.AccessDenied(self.pid)

    monkeypatch.setattr(psutil.Process, "memory_full_info", denied)
    h = Harness()
    h.sup.target.pid = child.pid
    rss, pss, pids = h.sup.memory()
    assert set(rss) == {"daemon", "target"} and all(v > 0 for v in rss.values())
    assert pss == {}
    assert pids == {"target": child.pid}


def test_memory_of_a_worker_that_vanished_is_left_out_without_an_error(child):
    h = Harness()
    h.sup.target.pid = child.pid
    child.kill()
    child.wait()  # gone, though the supervisor has not noticed yet
    rss, pss, _ = h.sup.memory()
    assert "target" not in rss and "target" not in pss
    assert "daemon" in rss


def test_memory_off_the_main_thread_skips_a_worker_whose_channel_is_gone(child):
    h = Harness()
    h.sup.target.pid = child.pid
    h.sup.target.sock = None  # reaped: its pid may already be another process's
    rss, _, pids = h.sup.memory(reap=False)
    assert "target" not in rss and pids == {}
