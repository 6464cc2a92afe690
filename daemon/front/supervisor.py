"""The daemon's two workers: started, watched, restarted, or given up on.

``Supervisor`` owns the target and drafter ``WorkerHandle``s and the daemon's
state (loading, ready, failed). It reads what the workers send: ``ready``,
the target's messages for the scheduler, a drafter found hung. It notices a
death (or a target that went silent during a request: hung), answers what the
dead worker was doing through the scheduler, and restarts it after its
``RestartPolicy``'s backoff, or gives up: the target's give-up fails the
daemon, the drafter's switches drafting off while plain decoding goes on.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Callable, Optional

import psutil
import zmq

from tandem.protocol import Error, ErrorCode, Message, ProtocolError, Shutdown, decode, endpoint
from tandem.protocol.internal import WORKER_REPLIES, CacheState, DrafterHung, DrafterState, Progress, Ready

from ..drafting.governor import state_file
from ..models import narrow_drafter
from ..models.vocab import vocab_mismatch
from ..worker.worker_config import WorkerConfig, spin_count_for
from .embedder import Embedder
from .metrics import Metrics
from .restart_policy import RestartPolicy
from .scheduler import Scheduler
from .sdnotify import Notifier
from .worker_handle import WorkerHandle

log = logging.getLogger("tandem.daemon")

TARGET_MAX_DEATHS = 5  # the target died this often within the window, no request finished: the daemon fails
DRAFTER_MAX_DEATHS = 3  # the drafter died this often within the window: drafting is switched off
DEATH_WINDOW_SECONDS = 600.0


def governor_identity(c) -> str:
    """What the governor's learned state is valid for: the target and drafter
    files (name and size), the draft length and the kernels (which change the
    speed of both kinds of round)."""

    def describe(path: Optional[Path]) -> str:
        if path is None:
            return "-"
        try:
            return f"{path.name}:{path.stat().st_size}"
        except OSError:
            return path.name

    s = c.settings.values
    drafter = describe(c.drafter_path) if c.drafter_path is not None else c.drafter_name
    kernels = f" kernels={s.kernels} flash={'on' if s.flash_attn else 'off'}"
    placed = (s.gpu_layers, s.device, s.drafter_gpu_layers, s.drafter_device, s.rpc)
    if placed != (None, "auto", None, "auto", ""):  # layers placed by hand: other pass costs
        kernels += " placed=" + "/".join(str(v) for v in placed)
    return f"target={describe(c.model_path)} drafter={drafter} k={s.draft_tokens}{kernels}"


class Supervisor:
    def __init__(
        self,
        zctx: zmq.Context,
        config,
        scheduler: Scheduler,
        metrics: Metrics,
        notifier: Notifier,
        is_stopping: Callable[[], bool],
        stop: Callable[[], None],
    ):
        """``config`` is the daemon's ServeConfig; ``stop()`` ends the daemon
        (its models never loaded: nothing to serve)."""
        self.zctx = zctx
        self.config = config
        self.settings = config.settings
        self.scheduler = scheduler
        self.metrics = metrics
        self.notifier = notifier
        self.is_stopping = is_stopping
        self.stop = stop
        self.state = "loading"
        self.ever_ready = False
        self.drafter_off = ""  # why drafting was switched off for good ("" while it is not)
        self.target: Optional[WorkerHandle] = None
        self.drafter: Optional[WorkerHandle] = None
        self.embedding: Optional[Embedder] = None  # with --embedding-model (embedder.py), set before start
        self._process = psutil.Process()  # the daemon's own

    def start(self, socket_dir: Path, cache_shm: str, cache_bytes: int) -> None:
        """Start the workers: ipc sockets in ``socket_dir``, the prefix cache's
        arena at ``cache_shm`` ("": none) of ``cache_bytes``."""
        c = self.config
        kind = c.drafter_kind
        identity = governor_identity(c)
        timeout = self.settings.values.worker_timeout
        common = dict(
            settings=self.settings.values,
            draft_endpoint=endpoint(socket_dir / f".draft-{os.getpid()}.ipc") if kind == "model" else "",
            cache_shm=cache_shm,
            cache_bytes=cache_bytes,
            n_ctx=c.n_ctx,
        )
        target = WorkerConfig(
            role="target",
            model_name=c.model_name,
            model_path=str(c.model_path),
            drafter=kind,
            governor_state=str(state_file(c.state_dir, identity)) if c.state_dir is not None and kind != "none" else "",
            governor_identity=identity,
            probe_cache=str(c.state_dir / "batch-invariance.json") if c.state_dir is not None else "",
            drafter_bytes=_size(c.drafter_path),
            drafter_quantization=narrow_drafter(c.drafter_path),
            kv_room=c.kv_room,
            spin_count=spin_count_for(kind, "target"),
            **common,
        )
        policy = RestartPolicy(TARGET_MAX_DEATHS, DEATH_WINDOW_SECONDS, timeout, give_up=self._target_gave_up)
        self.target = WorkerHandle(self.zctx, target, socket_dir, policy)
        self.scheduler.on_request_done = policy.forgive  # deaths count only while no request finishes
        if kind == "model":
            drafter = WorkerConfig(
                role="drafter",
                model_name=c.drafter_name,
                model_path=str(c.drafter_path),
                spin_count=spin_count_for(kind, "drafter"),
                **common,
            )
            policy = RestartPolicy(DRAFTER_MAX_DEATHS, DEATH_WINDOW_SECONDS, timeout, give_up=self._drafter_gave_up)
            self.drafter = WorkerHandle(self.zctx, drafter, socket_dir, policy)
            self.drafter.start()  # first: it binds the endpoint the target connects to
        self.target.start()
        if self.embedding is not None:
            self.embedding.start(self.zctx, socket_dir, DEATH_WINDOW_SECONDS)

    @property
    def failure(self) -> str:
        return self.scheduler.failure

    @property
    def models_ready(self) -> bool:
        if not self.target.ready:
            return False
        # after the first start a drafter that is down (restarting, switched off) blocks nothing
        return self.drafter is None or bool(self.drafter_off) or self.ever_ready or self.drafter.ready

    @property
    def can_take_work(self) -> bool:
        return self.state == "ready" and self.models_ready and not self.is_stopping()

    def sockets(self) -> list:
        """What the poll loop waits on: each live worker's channel and death sentinel."""
        out = []
        for w in self.workers:
            if w.sock is not None:
                out.append(w.sock)
                if w.sentinel is not None:
                    out.append(w.sentinel)
        return out

    def drain(self, events: dict) -> None:
        for w in self.workers:
            if w.sock is not None and w.sock in events:
                self._drain_worker(w)

    def check(self, now: float) -> None:
        """Deaths, due restarts and a hung target."""
        for w in self.workers:
            if w.sock is not None and not w.alive:
                self._on_death(w)
        for w in self.workers:
            if w.policy.due(now) and not self._restart(w):
                w.policy.start_failed(now)
        self._check_hung(now)
        if self.embedding is not None:
            self.embedding.check_hung(now, generating=self.scheduler.busy)

    def stop_workers(self) -> None:
        for w in self.workers:
            if w.alive:
                w.send(Shutdown(id="daemon"))
        for w in self.workers:
            w.stop()

    @property
    def workers(self) -> list[WorkerHandle]:
        return [w for w in (self.target, self.drafter, self.embedder) if w is not None]

    @property
    def embedder(self) -> Optional[WorkerHandle]:
        return self.embedding.handle if self.embedding is not None else None

    def _drain_worker(self, worker: WorkerHandle, limit: int = 1024) -> None:
        for _ in range(limit):
            if worker.sock is None:
                return
            try:
                frames = worker.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(frames, table=WORKER_REPLIES)
            except ProtocolError as exc:
                log.error("undecodable message from the %s worker: %s", worker.role, exc.message)
                continue
            if isinstance(msg, Ready):
                self._on_ready(worker, msg)
            elif worker is self.embedder:
                self.embedding.on_message(msg)
            elif worker is self.target:
                self._on_target_message(msg, frames)
            elif isinstance(msg, Error):  # the drafter says only ready or why it could not load
                if self.ever_ready:  # a restarted drafter that cannot load: draft no more, serve on
                    self._drafter_switched_off(msg.message)
                else:
                    self.fail(msg.message)

    def _on_target_message(self, msg: Message, frames: list[bytes]) -> None:
        self.target.policy.heard(time.monotonic())
        if isinstance(msg, Progress):
            return  # a heartbeat
        if isinstance(msg, CacheState):  # pages written to disk between requests
            self.scheduler.cache = msg.cache
            self.metrics.cache_seen(msg.cache)
            return
        if isinstance(msg, DrafterHung):  # the target found the drafter hung, or failing
            if self.drafter is not None and self.drafter.alive:
                log.error("the drafter worker (pid %s): %s; killing it", self.drafter.pid, msg.message)
                self.drafter.policy.killed_as_hung(msg.message.removeprefix("the drafter ") + " and was killed")
                self._kill(self.drafter)
            return
        if not self.scheduler.on_target_message(msg, frames):
            if isinstance(msg, Error) and msg.code == ErrorCode.NOT_READY:
                self.fail(msg.message)  # it could not load its model

    def _tell_target(self, msg: Message) -> None:
        if self.target.alive and self.target.sock is not None:
            self.target.send(msg)

    def _on_ready(self, worker: WorkerHandle, msg: Ready) -> None:
        worker.info = msg.model
        if worker is self.embedder:
            self.embedding.on_ready()
        if worker is self.target and self.drafter is not None:
            # a new target while the drafter is down: switched off, or restarting after the first start (at the
            # first start the daemon serves nothing until both are loaded: a drafter still loading is not down,
            # and telling the target so would leave it off for good)
            if self.drafter_off or (self.ever_ready and not self.drafter.ready):
                self.target.send(DrafterState(id="daemon", available=False))
        if worker is self.drafter and (self.ever_ready or worker.policy.restarts) and self.target.alive:
            self.target.send(DrafterState(id="daemon", available=True))  # a restarted drafter: draft again
        if worker is self.target:
            self.scheduler.governor = msg.governor
            self.scheduler.cache = msg.cache
            if msg.governor is not None:
                self.metrics.governor_seen(msg.governor)
            if msg.cache is not None:
                self.metrics.cache_seen(msg.cache)
        elapsed = time.monotonic() - worker.started_at
        log.info(
            "%s model %s loaded in %.1f s (context %d tokens, worker pid %d)",
            worker.role,
            msg.model.name,
            elapsed,
            msg.model.n_ctx,
            msg.pid,
        )
        self._become_ready()

    def _become_ready(self) -> None:
        """Ready once every model needed is loaded (after the first start, the target alone)."""
        if self.state != "loading" or not self.models_ready:
            return
        if self.drafter is not None and self.drafter.info is not None and self.target.info is not None:
            mismatch = vocab_mismatch(self.target.info, self.drafter.info)
            if mismatch:
                self.fail(mismatch + "; choose a drafter from the target's model family, or --drafter ngram|suffix")
                return
        self.state = "ready"
        self.ever_ready = True
        log.info("ready")
        self.notifier.ready(self.ready_status())  # models loaded, socket bound: systemd may call us started

    def _check_hung(self, now: float) -> None:
        """A target that sends nothing during a request for worker_timeout (it sends
        progress every second while it works) is hung: kill it; its death is handled
        like any other."""
        target = self.target
        if not self.scheduler.busy or not target.alive or target.sock is None:
            return
        if target.policy.silent_too_long(now):
            why = f"did not answer within {self.settings.values.worker_timeout:g} s (worker_timeout) and was killed"
            log.error("the model worker (pid %s) %s", target.pid, why)
            target.policy.killed_as_hung(why)
            self._kill(target)

    def _on_death(self, worker: WorkerHandle) -> None:
        """A worker died: answer what it was doing, then restart it after its
        policy's backoff, or give up (the policy's action)."""
        if worker is self.embedder:
            self._drain_worker(worker)  # what it said before it went (why it could not load) first
            self.embedding.on_death(worker.reap())
            return
        code = worker.reap()
        is_target = worker is self.target
        if self.is_stopping() or (not is_target and (self.state == "failed" or self.drafter_off)):
            return  # (a drafter switched off was told to exit)
        how = worker.policy.cause(code)
        name = "model worker" if is_target else "drafter worker"
        if not self.ever_ready:
            path = self.config.model_path if is_target else self.config.drafter_path
            how = f"{how} while loading {path}"
            if code != -signal.SIGKILL:  # a crash at load (a bad file): it would crash again
                self.fail(f"the {name} {how}")
                return
            # killed (the OOM killer, a user): loaded again under the policy
        if is_target:
            log.error("the model worker %s", how)
            if self.state == "failed":  # no restart; still, what it was doing gets its answer
                self.scheduler.abort(ErrorCode.NOT_READY, f"the daemon has failed: {self.failure}", f"the {name} {how}")
                return
        delay = worker.policy.died(time.monotonic())
        if is_target:
            self.scheduler.abort(  # (nothing runs before the first ready)
                ErrorCode.WORKER_DIED,
                f"the model worker {how} while serving this request; it is being restarted and the request "
                "may be retried",
                f"the model worker {how}",
            )
        else:
            # decode plainly until it is back; a running request goes on that way (done.drafter_died)
            self._tell_target(DrafterState(id="daemon", available=False))
        if delay is None:
            worker.policy.give_up(worker.policy.reason(), how)
            return
        self.metrics.worker_restarted(worker.role)
        if is_target:
            self.state = "loading"
            self.notifier.status(f"restarting the model worker (it {how})")
        else:
            log.warning("the drafter worker %s; restarting it in %d s (plain decoding meanwhile)", how, delay)

    def _target_gave_up(self, reason: str, how: str) -> None:
        between = "without finishing a request in between" if self.ever_ready else "before it was ever ready"
        self.fail(
            f"the model worker {reason} {between} (last: it {how}); the daemon gave up restarting it. See the log "
            "above, fix the cause (killed while loading: is there memory enough for the model?), and restart the "
            "daemon"
        )

    def _drafter_gave_up(self, reason: str, how: str) -> None:
        self._drafter_switched_off(f"it {reason}", how)

    def _drafter_switched_off(self, why: str, how: str = "cannot be used") -> None:
        self.drafter_off = why or "it cannot be used"
        self.drafter.policy.cancel()
        if self.drafter.alive:
            self.drafter.send(Shutdown(id="daemon"))
        self._tell_target(DrafterState(id="daemon", available=False))
        log.warning(
            "the drafter worker %s; %s, so drafting is switched off and plain decoding goes on "
            "(restart the daemon to draft again)",
            how,
            why,
        )
        self._become_ready()  # a target that loaded while the drafter could not: serve without it

    @staticmethod
    def _restart(worker: WorkerHandle) -> bool:
        """Start a worker again; False (logged) when no process can be started now (out of memory, pids)."""
        try:
            worker.start()
            return True
        except OSError as exc:
            worker.close_channel()
            wait = worker.policy.backoff_seconds[-1]
            log.error("could not start the %s worker (%s); trying again in %d s", worker.role, exc, wait)
            return False

    @staticmethod
    def _kill(worker: WorkerHandle) -> None:
        if worker.process is not None:
            worker.process.kill()

    def fail(self, message: str) -> None:
        log.error("%s", message)
        self.notifier.status(f"failed: {message}"[:400])
        self.state = "failed"
        self.scheduler.fail(message)
        if not self.ever_ready:
            self.stop()  # the models never loaded: nothing to serve

    def ready_status(self) -> str:
        drafter = f" + drafter {self.config.drafter_name}" if self.config.drafter_name != "none" else ""
        return f"serving {self.config.model_name}{drafter} on {self.config.socket_path}"

    def drafter_note(self) -> str:
        if self.drafter is None:
            return ""
        if self.drafter_off:
            return f" (off: {self.drafter_off})"
        if self.drafter.policy.restart_due is not None or (self.ever_ready and not self.drafter.alive):
            return " (restarting)"
        return ""

    def memory(self, reap: bool = True) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        """Resident memory by process ("daemon", "target", "drafter"): RSS and PSS, and
        the workers' pids. PSS (proportional set size) counts a page shared by n
        mappings as 1/n in each: a target with a prompt reader maps its model file
        twice, which RSS counts twice, and the prefix cache's arena is mapped by the
        daemon and both workers. PSS is {} where the system cannot say (no
        /proc/PID/smaps). ``reap=False`` (off the main thread) leaves worker liveness
        to psutil: a dead worker's pid has no memory to read."""
        rss, pss = {}, {}
        procs = {"daemon": self._process}
        pids = {}
        for w in self.workers:
            pid = w.pid
            # off the main thread: a reaped worker has no channel, and its pid may be reused
            if pid and (w.alive if reap else w.sock is not None):
                pids[w.role] = pid
                try:
                    procs[w.role] = psutil.Process(pid)
                except psutil.Error:
                    pass
        for role, proc in procs.items():
            try:
                info = proc.memory_full_info()
            except psutil.AccessDenied:  # smaps unreadable: RSS alone
                try:
                    rss[role] = proc.memory_info().rss
                except psutil.Error:
                    pass
                continue
            except (psutil.Error, OSError):
                continue
            rss[role] = info.rss
            if getattr(info, "pss", None) is not None:
                pss[role] = info.pss
        return rss, pss, pids


def _size(path: Optional[Path]) -> int:
    try:
        return path.stat().st_size if path is not None else 0
    except OSError:
        return 0
