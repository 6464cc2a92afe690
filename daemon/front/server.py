"""The daemon's front process: a thin shell of sockets around the Scheduler.

It never does model work. A single-threaded ZeroMQ poll loop reads client
requests from the client socket (client_socket.py), dispatches each by type to
a ``handle_<op>`` method that hands it to the ``Scheduler`` (scheduler.py: the
queue, the running request, cancels, answers), and relays the target worker's
messages the same way. It supervises both workers, each with its own
``RestartPolicy``. Every failure in dispatch becomes an ``error`` reply, so the
daemon never dies of a request.
"""

from __future__ import annotations

import errno
import logging
import os
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import zmq

from tandem.protocol import (
    FIM_FIX,
    PROTOCOL_VERSION,
    CacheClear,
    Cancel,
    CancelReply,
    Complete,
    Decoding,
    Detokenize,
    Embed,
    Error,
    ErrorCode,
    Generate,
    Hello,
    HelloReply,
    ProtocolError,
    Shutdown,
    ShutdownReply,
    Status,
    StatusReply,
    Tokenize,
    decode,
)

from ..cache.arena import create_arena, destroy_arena, remove_stale_arenas
from ..config import RELOADABLE, ConfigError, ServeError, Settings
from ..version import __version__
from .client_socket import ClientSocket, InstanceLock, prepare_socket
from .embed_queue import EmbedQueue
from .embedder import Embedder
from .metrics import Metrics
from .scheduler import Lane, Scheduler
from .sdnotify import Notifier
from .supervisor import Supervisor

log = logging.getLogger("tandem.daemon")

POLL_MS = 200


@dataclass
class ServeConfig:
    """What the daemon runs with: its settings (every option of config.OPTIONS,
    as loaded) and what ``serve`` resolved from them. The same settings go down
    to the workers, inside their WorkerConfig."""

    settings: Settings
    model_name: str
    model_path: Path
    socket_path: Path
    state_dir: Optional[Path] = None  # where what the daemon learns is kept; None: not kept
    cache_bytes: int = 0  # the prefix cache's arena in shared memory; 0 = no prefix cache
    drafter_name: str = "none"  # "none", "ngram", "suffix", or a model drafter's display name
    drafter_path: Optional[Path] = None  # set for a model drafter
    drafter_why: str = ""  # --drafter auto: what it chose and why ("auto: ..."), shown in status
    n_ctx: int = 0  # the context both models get (models/context_size.py); 0: the settings' or the model's
    context_note: str = ""  # how n_ctx was chosen, for `tandem status`
    kv_room: int = -1  # bytes --kv-budget leaves beside the KV caches n_ctx was chosen for (-1: not known)
    embedding_name: str = ""  # --embedding-model's display name ("": none)
    embedding_path: Optional[Path] = None  # its file: loaded in a worker of its own

    @property
    def drafter_kind(self) -> str:
        return "model" if self.drafter_path is not None else self.drafter_name


class Daemon:
    """The front process: the client socket, the poll loop, dispatch, status,
    reload and shutdown. Requests are the scheduler's; workers, the supervisor's."""

    def __init__(
        self,
        config: ServeConfig,
        notifier: Optional[Notifier] = None,
        reload: Optional[Callable[[], Settings]] = None,
    ):
        self.config = config
        self.settings = config.settings
        self.notifier = notifier or Notifier(None)
        self.reload_settings = reload
        self.started_with = config.settings.values  # (frozen: a reload replaces settings.values, never changes it)
        self.reload_requested = False
        self.started_at = time.monotonic()
        self.stopping = False
        self._setup_socket()
        try:
            self._setup_metrics()  # after the instance lock: a second daemon is told about the first one
        except BaseException:
            self.clients.close(linger=0)
            self.lock.release()
            self.zctx.term()
            raise
        self._setup_scheduler()
        self._setup_workers()
        self._setup_dispatch()

    # ------------------------------------------------------------------ setup steps

    def _setup_socket(self) -> None:
        path = self.config.socket_path
        self.socket_dir = prepare_socket(path)
        self.lock = InstanceLock(path)
        self.zctx = zmq.Context()
        self.clients = ClientSocket(self.zctx, path, self.settings.values.client_queue, on_gone=self._on_client_gone)

    def _setup_metrics(self) -> None:
        self.metrics = Metrics(self.live_metrics)
        addr = self.settings.values.metrics_addr
        if addr == "off":
            return
        try:
            bound = self.metrics.serve(addr, other_users=self.settings.values.metrics_other_users)
        except OSError as exc:
            if self.settings.sources["metrics_addr"] == "default" and exc.errno == errno.EADDRINUSE:
                # the default port is taken (another daemon, on another socket): any free port
                # beats no metrics or no daemon; status and the log say where
                bound = self.metrics.serve(
                    addr.rpartition(":")[0] + ":0", other_users=self.settings.values.metrics_other_users
                )
                log.warning(
                    "the default metrics address %s is in use; serving metrics on %s instead (set metrics_addr "
                    "to choose)",
                    addr,
                    bound,
                )
                return
            raise ServeError(
                f"cannot serve metrics on {addr}: {exc.strerror or exc}. Another daemon may hold that port: give "
                "this one --metrics-addr 127.0.0.1:OTHER_PORT (0 picks a free port), or --metrics-addr off"
            ) from None
        log.info("metrics on http://%s/metrics", bound)

    def _setup_scheduler(self) -> None:
        self.scheduler = Scheduler(
            reply=self.clients.send,
            relay=self.clients.send_frames,
            to_target=lambda msg: self.supervisor.target.send(msg),
            metrics=self.metrics,
            max_queue=self.settings.values.max_queue,
            lane=Lane(max_tokens=self.settings.values.preempt_tokens, drafter=self.config.drafter_name != "none"),
        )
        self.embeds = EmbedQueue(
            reply=self.clients.send,
            to_worker=lambda msg: self.supervisor.embedder.send(msg),
            metrics=self.metrics,
            max_queue=self.settings.values.max_queue,
            model=self.config.embedding_name if self.config.embedding_path is not None else "",
            counters=self.scheduler.counters,
        )

    def _setup_workers(self) -> None:
        remove_stale_arenas()
        self.kv_arena = create_arena(self.config.cache_bytes) if self.config.cache_bytes > 0 else None
        self.supervisor = Supervisor(
            self.zctx, self.config, self.scheduler, self.metrics, self.notifier, lambda: self.stopping, self._stop
        )
        if self.config.embedding_path is not None:
            self.supervisor.embedding = Embedder(self.config, self.metrics, self.embeds, lambda: self.stopping)
        arena = self.kv_arena
        self.supervisor.start(self.socket_dir, str(arena.path) if arena else "", arena.size if arena else 0)

    def _stop(self) -> None:
        self.stopping = True

    @property
    def state(self) -> str:
        return self.supervisor.state

    @property
    def failure(self) -> str:
        return self.scheduler.failure

    def _setup_dispatch(self) -> None:
        self.handlers: dict[type, Callable] = {
            Hello: self.handle_hello,
            Generate: self.handle_generate,
            Complete: self.handle_generate,
            Cancel: self.handle_cancel,
            Status: self.handle_status,
            Shutdown: self.handle_shutdown,
            CacheClear: self.handle_cache_clear,
            Tokenize: self.handle_tokenize,
            Detokenize: self.handle_tokenize,
            Embed: self.handle_embed,
        }

    # ------------------------------------------------------------------ main loop

    def serve_forever(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGHUP, self._on_sighup)
        log.info("listening on %s (pid %d); loading %s", self.config.socket_path, os.getpid(), self.config.model_name)
        self.notifier.status(f"loading {self.config.model_name}")
        try:
            while not self.stopping:
                self._poll_once()
        finally:
            self._shutdown()

    def _on_signal(self, signum, frame) -> None:
        log.info("received %s; shutting down", signal.Signals(signum).name)
        self.stopping = True

    def _on_sighup(self, signum, frame) -> None:
        self.reload_requested = True  # handled by the main loop, between messages

    def _poll_once(self) -> None:
        poller = zmq.Poller()
        poller.register(self.clients.sock, zmq.POLLIN)
        poller.register(self.clients.monitor, zmq.POLLIN)
        for sock in self.supervisor.sockets():
            poller.register(sock, zmq.POLLIN)
        events = dict(poller.poll(POLL_MS))
        self.notifier.watchdog()  # only from here: a loop that hangs stops the pings
        if self.reload_requested:
            self.reload()
        self.supervisor.drain(events)
        if self.clients.monitor in events:
            self.clients.drain_monitor()  # before new requests: an fd may be reused by a new client
        if self.clients.sock in events:
            for identity, frames in self.clients.receive():
                self.dispatch(identity, frames)
        self.supervisor.check(time.monotonic())
        if self.supervisor.can_take_work and self.scheduler.start_next():
            self.supervisor.target.policy.heard(time.monotonic())  # the hung-worker deadline counts from here
        embedding = self.supervisor.embedding
        if embedding is not None and not self.stopping:
            embedding.pace(self.scheduler.busy)  # (before an embed starts: it starts in the right pace)
            embedding.start_next()

    def reload(self) -> None:
        """SIGHUP: re-read the settings (flags given at start still win) and apply
        those that can change without dropping the models: max_queue,
        preempt_tokens and log_level. Others that changed are logged as needing a restart. A config
        that does not load changes nothing."""
        self.reload_requested = False
        if self.reload_settings is None or self.stopping:
            log.info("SIGHUP: nothing to reload")
            return
        # RELOADING=1 ... READY=1 only once started: before that, READY=1 would tell
        # systemd the daemon is up while its models are still loading
        started = self.supervisor.ever_ready
        if started:
            self.notifier.reloading()
        try:
            new = self.reload_settings()
        except Exception as exc:  # ConfigError names the fix; anything else must not kill the daemon either
            why = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
            log.error("SIGHUP: the settings did not load, nothing changed: %s", why)
            if started:
                self.notifier.ready(self.supervisor.ready_status() if self.state == "ready" else self.state)
            return
        applied = []
        old, loaded = self.settings.values, new.values
        if loaded.max_queue != old.max_queue:
            applied.append(f"max_queue {old.max_queue} -> {loaded.max_queue}")
            self.scheduler.max_queue = loaded.max_queue  # a shorter queue keeps who is already in it
        if loaded.preempt_tokens != old.preempt_tokens:
            applied.append(f"preempt_tokens {old.preempt_tokens} -> {loaded.preempt_tokens}")
            self.scheduler.lane.max_tokens = loaded.preempt_tokens
        if loaded.log_level != old.log_level:
            applied.append(f"log_level {old.log_level} -> {loaded.log_level}")
            logging.getLogger().setLevel(loaded.log_level.upper())
        # the reloadable options (RELOADABLE) into the settings that every part of the daemon holds
        self.settings.values = replace(
            old, max_queue=loaded.max_queue, log_level=loaded.log_level, preempt_tokens=loaded.preempt_tokens
        )
        pending = [k for k in loaded.changed(self.started_with) if k not in RELOADABLE]
        log.info("SIGHUP: reloaded settings from %s: %s", new.path, "; ".join(applied) or "nothing to change")
        if pending:
            log.warning(
                "SIGHUP: %s changed; restart the daemon to apply (tandem stop, or systemctl --user restart tandem)",
                ", ".join(pending),
            )
        if started:
            self.notifier.ready(self.supervisor.ready_status() if self.state == "ready" else self.state)

    # ------------------------------------------------------------------ clients

    def dispatch(self, identity: bytes, frames: list[bytes]) -> None:
        try:
            msg = decode(frames)
        except ProtocolError as exc:
            self.clients.send(identity, Error.of(exc.request_id, exc.code, exc.message))
            return
        handler = self.handlers[type(msg)]
        try:
            handler(identity, msg)
        except Exception as exc:  # a bug: answer it, log it, keep serving
            log.exception("handling %s failed", msg.op.value)
            self.clients.send(identity, Error.of(msg.id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))

    def handle_hello(self, identity: bytes, msg: Hello) -> None:
        major = msg.protocol_version[0] if msg.protocol_version else -1
        if major != PROTOCOL_VERSION[0]:
            self.clients.send(
                identity,
                Error.of(
                    msg.id,
                    ErrorCode.UNSUPPORTED_VERSION,
                    f"client speaks protocol {'.'.join(map(str, msg.protocol_version))}; this daemon "
                    f"(tandem {__version__}) speaks {PROTOCOL_VERSION[0]}.x. Use a client for protocol "
                    f"{PROTOCOL_VERSION[0]}, or upgrade the daemon.",
                ),
            )
            return
        info = self.supervisor.target.info
        self.clients.send(
            identity,
            HelloReply(
                id=msg.id,
                protocol_version=list(PROTOCOL_VERSION),
                daemon_version=__version__,
                model=self.config.model_name,
                n_ctx=info.n_ctx if info else 0,
                embedding_model=self.embeds.model,
            ),
        )

    def handle_generate(self, identity: bytes, msg: Decoding) -> None:
        info = self.supervisor.target.info
        if not self.failure and isinstance(msg, Complete) and info is not None and not info.fim:
            why = (
                f"{self.config.model_name} has no fill-in-the-middle tokens in its vocabulary, so 'complete' "
                f"cannot prompt it. {FIM_FIX}"
            )
            self.clients.send(identity, Error.of(msg.id, ErrorCode.FIM_UNSUPPORTED, why))
            return
        self.scheduler.admit(identity, msg)

    def handle_cancel(self, identity: bytes, msg: Cancel) -> None:
        found = self.scheduler.cancel(msg.request_id)
        self.clients.send(identity, CancelReply(id=msg.id, request_id=msg.request_id, found=found))

    def handle_status(self, identity: bytes, msg: Status) -> None:
        self.clients.send(identity, self.status_reply(msg.id))

    def handle_shutdown(self, identity: bytes, msg: Shutdown) -> None:
        log.info("shutdown requested by a client")
        self.clients.send(identity, ShutdownReply(id=msg.id))
        self.stopping = True

    def handle_cache_clear(self, identity: bytes, msg: CacheClear) -> None:
        # after the running request, before the next; without an arena too: the
        # target drops what its KV holds from the request before
        self.scheduler.clear_cache(identity, msg)

    def handle_tokenize(self, identity: bytes, msg) -> None:
        if not self.supervisor.can_take_work and not self.scheduler.failure and not self.stopping:
            why = "the model is still loading (or restarting); retry in a moment"
            self.clients.send(identity, Error.of(msg.id, ErrorCode.NOT_READY, why))
            return
        self.scheduler.tokenize(identity, msg)  # straight to the target: answered between decoding steps

    def handle_embed(self, identity: bytes, msg: Embed) -> None:
        # its own queue and worker: never behind a generation (a running one has the cores first)
        owner = self.scheduler.jobs[msg.id].identity if msg.id in self.scheduler.jobs else None
        self.embeds.admit(identity, msg, self.failure, owner or self.scheduler.tokenizing.get(msg.id))

    def _on_client_gone(self, identity: bytes) -> None:
        self.scheduler.client_gone(identity)
        self.embeds.client_gone(identity)

    def live_metrics(self) -> dict:
        """The present, for a metrics scrape (called on the metrics thread: reads only)."""
        # a scrape may come before the scheduler and the supervisor are set up
        scheduler, supervisor = getattr(self, "scheduler", None), getattr(self, "supervisor", None)
        rss, pss, _ = supervisor.memory(reap=False) if supervisor is not None else ({}, {}, {})
        return dict(
            queue_depth=len(scheduler.queue) if scheduler is not None else 0,
            active=1 if scheduler is not None and scheduler.active is not None else 0,
            ready=1 if supervisor is not None and supervisor.state == "ready" and not self.stopping else 0,
            memory=rss,
            pss=pss,
            uptime=time.monotonic() - self.started_at,
        )

    def status_reply(self, request_id: str) -> StatusReply:
        memory, pss, pids = self.supervisor.memory()
        s, c, sup = self.scheduler, self.config, self.supervisor
        return StatusReply(
            id=request_id,
            state="stopping" if self.stopping else self.state,
            daemon_version=__version__,
            pid=os.getpid(),
            uptime_seconds=time.monotonic() - self.started_at,
            socket_path=str(c.socket_path),
            model=sup.target.info,
            active=s.active_request(),
            within=s.active_request(nested=True),
            queue_length=len(s.queue),
            max_queue=s.max_queue,
            requests=dict(s.counters.requests),
            tokens=dict(s.counters.tokens),
            memory_rss_bytes=memory,
            memory_pss_bytes=pss,
            worker_pids=pids,
            worker_restarts=sum(w.policy.restarts for w in sup.workers),
            failure=self.failure,
            drafter=c.drafter_name + (f" ({c.drafter_why})" if c.drafter_why else "") + sup.drafter_note(),
            drafter_model=sup.drafter.info if sup.drafter is not None else None,
            draft_tokens=self.settings.values.draft_tokens if c.drafter_name != "none" else 0,
            draft=s.counters.draft if s.counters.draft.rounds else None,
            governor=s.governor,
            cache=s.cache,
            metrics_addr=self.metrics.address,
            context=c.context_note,
            embedding=c.embedding_name + sup.embedding.note() if sup.embedding is not None else "none",
            embedding_model=sup.embedder.info if sup.embedder is not None else None,
        )

    # ------------------------------------------------------------------ shutdown

    def _shutdown_poller(self, target_sock) -> zmq.Poller:
        poller = zmq.Poller()
        poller.register(target_sock, zmq.POLLIN)
        poller.register(self.clients.sock, zmq.POLLIN)
        return poller

    def _answer_clients(self) -> None:
        """While shutting down: answer what clients sent (a request: SHUTTING_DOWN)."""
        deadline = time.monotonic() + 2  # a client that keeps sending cannot hold the shutdown up
        while time.monotonic() < deadline:
            batch = list(self.clients.receive())
            if not batch:
                return
            for identity, frames in batch:
                self.dispatch(identity, frames)

    def _shutdown(self) -> None:
        self.notifier.stopping("stopping: answering queued requests and stopping the workers")
        scheduler = self.scheduler
        scheduler.shutting_down()  # from here on every new request is answered SHUTTING_DOWN
        self.embeds.shutting_down()
        target = self.supervisor.target
        if scheduler.active is not None and target.alive and target.sock is not None:
            scheduler.cancel_active()
            deadline = time.monotonic() + 5
            while scheduler.active is not None and time.monotonic() < deadline and target.alive:
                events = dict(self._shutdown_poller(target.sock).poll(100))
                self.supervisor.drain(events)
                self._answer_clients()
        if scheduler.active is not None:
            why = "the daemon is shutting down"
            scheduler.abort(ErrorCode.SHUTTING_DOWN, why, why)
        self.supervisor.stop_workers()
        self.clients.path.unlink(missing_ok=True)  # no new connections; what the old ones sent is answered
        self._answer_clients()
        self.clients.close()
        if self.kv_arena is not None:
            destroy_arena(self.kv_arena)
        self.lock.release()
        self.zctx.term()
        self.metrics.close()
        self.notifier.close()
        log.info("stopped")
