"""The embedding worker, watched: started, paced, restarted, or switched off.

``Embedder`` is the supervisor's part for ``--embedding-model`` (supervisor.py
hands it the worker's messages and its death). The daemon never fails because of
it, at any moment: a model that cannot be loaded (or a worker that crashes while
it first loads, which would crash again) switches embeddings off with the reason,
and embed requests are answered with it; a death afterwards fails only the embed
it computed (WORKER_DIED), and the worker is restarted after its policy's backoff,
until it dies too often (then embeddings are off too). It tells the worker when a
generation runs (``pace``); its silence is not held against it then, since it
yields the cores to the target by design.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path
from typing import Optional

import zmq

from tandem.protocol import Error, ErrorCode, Message, Shutdown
from tandem.protocol.internal import Pace, Progress

from ..worker.worker_config import TWO_PROCESS_SPIN, WorkerConfig
from .embed_queue import EmbedQueue
from .metrics import Metrics
from .restart_policy import RestartPolicy
from .worker_handle import WorkerHandle

log = logging.getLogger("tandem.daemon")

EMBEDDER_MAX_DEATHS = 3  # the embedding worker died this often within the window: embeddings are switched off


class Embedder:
    def __init__(self, config, metrics: Metrics, embeds: EmbedQueue, is_stopping):
        """``config``: the daemon's ServeConfig (``embedding_name``, ``embedding_path``, ``settings``)."""
        self.config = config
        self.metrics = metrics
        self.embeds = embeds
        self.is_stopping = is_stopping
        self.handle: Optional[WorkerHandle] = None
        self.loaded = False  # the model loaded once: a later crash is restarted, not final
        self._paced: Optional[bool] = None  # what the worker was last told

    def start(self, zctx: zmq.Context, socket_dir: Path, window_seconds: float) -> None:
        settings = self.config.settings.values
        worker = WorkerConfig(
            role="embedding",
            model_name=self.config.embedding_name,
            model_path=str(self.config.embedding_path),
            settings=settings,
            spin_count=TWO_PROCESS_SPIN,  # its idle threads spin briefly, as a drafter's (worker_config)
        )
        policy = RestartPolicy(EMBEDDER_MAX_DEATHS, window_seconds, settings.worker_timeout, give_up=self._gave_up)
        self.handle = WorkerHandle(zctx, worker, socket_dir, policy)
        self.handle.start()

    @property
    def ready(self) -> bool:
        return self.handle is not None and self.handle.ready

    def on_ready(self) -> None:
        self.loaded = True
        self._paced = None  # a new worker: tell it whether a generation runs

    def on_message(self, msg: Message) -> None:
        self.handle.policy.heard(time.monotonic())
        if isinstance(msg, Progress):
            return  # a heartbeat
        if self.embeds.on_worker_message(msg):
            return
        if isinstance(msg, Error) and msg.code == ErrorCode.NOT_READY:  # it could not load its model
            self._switch_off(msg.message.removeprefix("could not load the embedding model "))

    def on_death(self, code: Optional[int]) -> None:
        """The worker died (reaped): answer what it computed, restart it after the backoff, or switch off."""
        if self.is_stopping() or self.embeds.off:
            return
        policy = self.handle.policy
        how = policy.cause(code)
        if not self.loaded and code != -signal.SIGKILL:  # a crash at its first load: it would crash again
            self._switch_off(f"{how} while loading {self.config.embedding_path}")
            return
        delay = policy.died(time.monotonic())  # (killed while loading, by the OOM killer or a user: again)
        self.embeds.abort(
            ErrorCode.WORKER_DIED,
            f"the embedding worker {how} while computing this request's embeddings; it is being restarted and "
            "the request may be retried",
        )
        if delay is None:
            policy.give_up(policy.reason(), how)
            return
        self.metrics.worker_restarted("embedding")
        log.warning("the embedding worker %s; restarting it in %d s (embed requests wait meanwhile)", how, delay)

    def _gave_up(self, reason: str, how: str) -> None:
        self._switch_off(f"{reason} (last: it {how})")

    def _switch_off(self, why: str) -> None:
        self.handle.policy.cancel()
        if self.handle.alive:
            self.handle.send(Shutdown(id="daemon"))
        self.embeds.switch_off(why)
        log.error("the embedding model %s: embeddings are off until the daemon restarts", why)

    def check_hung(self, now: float, generating: bool) -> None:
        """Silent for worker_timeout while it computes a request and no generation runs: hung, killed
        (its death is handled as any other). While a generation runs its silence is by design."""
        w = self.handle
        if w is None or self.embeds.active is None or not w.alive or w.sock is None:
            return
        if generating:
            w.policy.heard(now)
        elif w.policy.silent_too_long(now):
            why = f"did not answer within {w.policy.hung_after_seconds:g} s (worker_timeout) and was killed"
            log.error("the embedding worker (pid %s) %s", w.pid, why)
            w.policy.killed_as_hung(why)
            if w.process is not None:
                w.process.kill()

    def pace(self, generating: bool) -> None:
        """Tell the worker whether a generation runs (when that changes, and each new worker)."""
        if self.ready and generating != self._paced and self.handle.send(Pace(id="daemon", generating=generating)):
            self._paced = generating

    def start_next(self) -> None:
        """Hand the ready worker the oldest embed request, if it is idle (the hung deadline counts from here)."""
        if self.ready and self.embeds.start_next():
            self.handle.policy.heard(time.monotonic())

    def note(self) -> str:
        """Its state for status: "" when it serves."""
        if self.embeds.off:
            return f" (off: {self.embeds.off})"
        if not self.loaded:
            return " (loading)"
        if not self.ready:
            return " (restarting)"
        return ""
