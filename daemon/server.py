"""The daemon's front process: the socket, dispatch, the queue, and status.

It never does model work. A single-threaded ZeroMQ poll loop reads client
requests from the ROUTER socket, hands one ``generate`` at a time to the
target worker process, and relays the worker's chunks back to the client
that asked. Every request message goes through ``dispatch``, which maps its
type to a ``handle_<op>`` method and turns any failure into an ``error``
reply, so the daemon never dies of a request.
"""

from __future__ import annotations

import collections
import errno
import fcntl
import logging
import os
import signal
import socket
import stat
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import psutil
import zmq
from zmq.utils.monitor import recv_monitor_message

from tandem.protocol import (
    CacheCleared,
    CacheClear,
    CacheInfo,
    GovernorInfo,
    PROTOCOL_VERSION,
    ActiveRequest,
    Busy,
    Cancel,
    CancelReply,
    Chunk,
    Done,
    DrafterHung,
    DrafterState,
    DraftStats,
    Error,
    ErrorCode,
    FinishReason,
    FIM_FIX,
    Complete,
    Decoding,
    Generate,
    Hello,
    HelloReply,
    Progress,
    ProtocolError,
    Ready,
    Shutdown,
    ShutdownReply,
    Status,
    StatusReply,
    Timings,
    Usage,
    decode,
    encode,
    endpoint,
)
from tandem.protocol.paths import MAX_SOCKET_PATH_BYTES

from .config import RELOADABLE, ConfigError, Settings
from .governor import state_file
from .metrics import Metrics
from .page_store import index_path
from .sdnotify import Notifier
from .version import __version__
from .vocab import vocab_mismatch
from .worker import WorkerConfig
from .worker_handle import WorkerHandle

log = logging.getLogger("tandem.daemon")

POLL_MS = 200
RESTART_BACKOFF_SECONDS = (1, 2, 4, 8, 16, 30)
TARGET_MAX_DEATHS = 5  # the target died this often within TARGET_DEATH_WINDOW, no request finished: the daemon fails
TARGET_DEATH_WINDOW = 600.0
DRAFTER_MAX_DEATHS = 3  # the drafter died this often within DRAFTER_DEATH_WINDOW: drafting is switched off
DRAFTER_DEATH_WINDOW = 600.0
HARD_MESSAGE_CAP_BYTES = 64 * 1024 * 1024


DEFAULT_CACHE_BYTES = 1 << 30
SHM_DIR = Path("/dev/shm")


def arena_name(pid: int) -> str:
    return f"tandem-kv-{os.getuid()}-{pid}"


def remove_stale_arenas(shm_dir: Path = SHM_DIR) -> list[str]:
    """Prefix cache arenas (and their indexes) of this user's daemons that are
    gone: killed, or stopped by the watchdog, without their shutdown."""
    removed = []
    prefix = arena_name(0)[:-1]
    for path in shm_dir.glob(prefix + "*"):
        pid_text = path.name[len(prefix):].removesuffix(".index")
        if not pid_text.isdigit() or psutil.pid_exists(int(pid_text)):
            continue
        try:
            path.unlink()
            removed.append(path.name)
        except OSError:
            pass
    if removed:
        log.info("removed the prefix cache of daemons that are gone: %s", ", ".join(sorted(removed)))
    return removed


class ServeError(Exception):
    """The daemon cannot start. The message says why and what to do."""


def cache_budget(requested: Optional[int], shm_dir: Path = SHM_DIR) -> int:
    """The prefix cache's byte budget: ``requested`` (None: the default, 1 GiB
    or half of what shared memory has free, if less). Shared memory is tmpfs,
    sparse until written: a budget larger than its free space would fault
    (SIGBUS) when the cache fills, so that is refused up front."""
    try:
        st = os.statvfs(shm_dir)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = 0
    if requested is None:
        budget = min(DEFAULT_CACHE_BYTES, free // 2)
        if budget < DEFAULT_CACHE_BYTES:
            log.warning(
                "%s has %d MiB free: the prefix cache gets %d MiB instead of %d (set --cache-bytes to choose)",
                shm_dir, free >> 20, budget >> 20, DEFAULT_CACHE_BYTES >> 20,
            )  # fmt: skip
        return budget
    if requested > free:
        raise ServeError(
            f"--cache-bytes {requested >> 20} MiB is more than {shm_dir} has free ({free >> 20} MiB); "
            "give a smaller --cache-bytes (or --cache-bytes 0 to run without a prefix cache), or enlarge /dev/shm"
        )
    return requested


@dataclass
class ServeConfig:
    model_name: str
    model_path: Path
    socket_path: Path
    ctx_size: Optional[int] = None
    threads: Optional[int] = None
    batch_size: int = 512
    max_queue: int = 16
    extra_buffers: Optional[bool] = None
    flash_attn: bool = True
    kernels: str = "reference"  # "reference" (batch-invariant) or "fast"
    drafter: str = "none"  # "none", "ngram", or a model's display name
    drafter_path: Optional[Path] = None  # set for a model drafter
    draft_tokens: int = 4
    draft_p_min: float = 0.0
    exact: str = "auto"  # "auto" (on when the target is not batch-invariant), "on", "off"
    governor: bool = True
    governor_per_task: bool = True
    cache_bytes: int = 0  # prefix cache arena (shared memory); 0 = no prefix cache (serve() defaults to 1 GiB)
    page_tokens: int = 16
    state_dir: Optional[Path] = None  # where the governor's state is kept; None: not kept
    metrics_addr: str = "off"  # HOST:PORT of the Prometheus endpoint (config.check keeps it loopback) or "off"
    metrics_addr_explicit: bool = True  # False: the default address, which falls back to a free port if taken
    worker_timeout: float = 120.0  # a worker silent this long during a request is treated as hung
    client_queue: int = 10_000  # replies queued for a client that does not read before it counts as gone
    log_level: str = "info"


@dataclass
class Job:
    """A generate or complete request, queued or running."""

    identity: bytes
    request: Decoding
    enqueued_at: float
    started_at: Optional[float] = None
    completion_tokens: int = 0
    last_tokens_at: Optional[float] = None  # when the latest chunk with tokens was relayed
    answered: bool = False  # its terminal message went out early (a worker died): the worker's own is dropped
    serial: int = 0  # arrival order among queued requests
    client_gone: bool = False


@dataclass
class Counters:
    requests: collections.Counter = field(default_factory=collections.Counter)
    tokens: collections.Counter = field(default_factory=collections.Counter)
    draft: DraftStats = field(default_factory=DraftStats)


# --------------------------------------------------------------------------- socket setup


def prepare_socket(path: Path) -> Path:
    """Create the socket's directory (0700) and check the path fits sun_path."""
    for candidate in (path, path.parent / ".target-4194304-999.ipc"):
        if len(os.fsencode(candidate)) > MAX_SOCKET_PATH_BYTES:
            raise ServeError(
                f"socket path {path} is too long for a Unix socket (limit {MAX_SOCKET_PATH_BYTES} bytes, "
                "with room for the worker sockets beside it); set TANDEM_SOCKET or --socket to a shorter path"
            )
    directory = path.parent
    if not directory.exists():
        old = os.umask(0o077)
        try:
            directory.mkdir(mode=0o700, parents=True)
        finally:
            os.umask(old)
    st = directory.stat()
    if st.st_uid != os.getuid():
        raise ServeError(f"socket directory {directory} belongs to another user (uid {st.st_uid}); pick another path")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise ServeError(
            f"socket directory {directory} is writable by other users (mode {mode:04o}): one of them could put "
            f"their own socket in its place. Run `chmod 700 {directory}`, or choose a socket in a directory of "
            "your own (--socket or TANDEM_SOCKET)"
        )
    if mode & 0o055:
        log.warning("socket directory %s is readable by others (mode %04o); 0700 is better", directory, mode)
    return directory


class InstanceLock:
    """One daemon per socket: an flock on ``<socket>.lock`` holding the pid."""

    def __init__(self, socket_path: Path):
        self.path = socket_path.with_name(socket_path.name + ".lock")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise ServeError(
                f"another tandem daemon (pid {holder}) is already serving {socket_path}. "
                f"Stop it with `tandem stop`, or start this one on another socket (--socket or TANDEM_SOCKET)."
            ) from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self.fd)


def governor_identity(c: ServeConfig) -> str:
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

    drafter = describe(c.drafter_path) if c.drafter_path is not None else c.drafter
    kernels = f" kernels={c.kernels} flash={'on' if c.flash_attn else 'off'}"
    return f"target={describe(c.model_path)} drafter={drafter} k={c.draft_tokens}{kernels}"


# --------------------------------------------------------------------------- the daemon


class Daemon:
    def __init__(
        self,
        config: ServeConfig,
        notifier: Optional[Notifier] = None,
        reload: Optional[Callable[[], Settings]] = None,
        settings: Optional[Settings] = None,
    ):
        self.config = config
        self.notifier = notifier or Notifier(None)
        self.reload_settings = reload
        self.started_with = dict(settings.values) if settings is not None else {}
        self.reload_requested = False
        self.started_at = time.monotonic()
        self.state = "loading"
        self.failure = ""
        self.stopping = False
        self.queue: collections.deque[Job] = collections.deque()
        self.active: Optional[Job] = None
        self.jobs: dict[str, Job] = {}
        self.serial = 0
        self.counters = Counters()
        self.governor: Optional[GovernorInfo] = None  # the target worker's latest report
        self.cache: Optional[CacheInfo] = None  # likewise
        self.restart_due: Optional[float] = None
        self.drafter_restart_due: Optional[float] = None
        self.drafter_deaths: list[float] = []  # when, within DRAFTER_DEATH_WINDOW
        self.drafter_off = ""  # why drafting was switched off for good ("" while it is not)
        self.target_deaths: list[float] = []  # when, since the last finished request, within TARGET_DEATH_WINDOW
        self.target_heard = time.monotonic()  # the target's last message (for the hung-worker deadline)
        self.hung: dict[str, str] = {}  # role -> why it was killed as hung
        self.clears: collections.deque[tuple[bytes, CacheClear]] = collections.deque()  # waiting for the worker
        self.clearing: Optional[tuple[bytes, CacheClear]] = None  # sent to the worker
        self.ever_ready = False
        self.on_ready: Optional[Callable[[], None]] = None
        self._process = psutil.Process()
        self.target: Optional[WorkerHandle] = None
        self.drafter: Optional[WorkerHandle] = None
        self._setup_socket()
        try:
            self._setup_metrics()  # after the instance lock: a second daemon is told about the first one
        except BaseException:
            self._release_socket()
            raise
        self._setup_worker()
        self._setup_dispatch()

    # ------------------------------------------------------------------ setup steps

    def _setup_metrics(self) -> None:
        self.metrics = Metrics(self.live_metrics)
        if self.config.metrics_addr == "off":
            return
        try:
            bound = self.metrics.serve(self.config.metrics_addr)
        except OSError as exc:
            if not self.config.metrics_addr_explicit and exc.errno == errno.EADDRINUSE:
                # the default port is taken (another daemon, on another socket): any free port
                # beats no metrics or no daemon; status and the log say where
                bound = self.metrics.serve(self.config.metrics_addr.rpartition(":")[0] + ":0")
                log.warning(
                    "the default metrics address %s is in use; serving metrics on %s instead (set metrics_addr "
                    "to choose)", self.config.metrics_addr, bound,
                )  # fmt: skip
                return
            raise ServeError(
                f"cannot serve metrics on {self.config.metrics_addr}: {exc.strerror or exc}. Another daemon may "
                "hold that port: give this one --metrics-addr 127.0.0.1:OTHER_PORT (0 picks a free port), or "
                "--metrics-addr off"
            ) from None
        log.info("metrics on http://%s/metrics", bound)

    def _setup_socket(self) -> None:
        path = self.config.socket_path
        self.socket_dir = prepare_socket(path)
        self.lock = InstanceLock(path)
        if path.exists() or path.is_symlink():
            path.unlink()  # stale: we hold the lock, so nobody serves it
        self.zctx = zmq.Context()
        self.front = self.zctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.front.setsockopt(zmq.SNDHWM, self.config.client_queue)
        # bodies over MAX_MESSAGE_BYTES get an error reply; ZeroMQ drops a peer that
        # sends a frame over this hard cap (no reply is possible: nothing was read)
        self.front.setsockopt(zmq.MAXMSGSIZE, HARD_MESSAGE_CAP_BYTES)
        self.front.setsockopt(zmq.LINGER, 1000)
        old = os.umask(0o177)
        try:
            self.front.bind(endpoint(path))
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        # Client disconnects: the monitor reports the connection's fd; each request
        # frame carries its source fd, which maps the fd to the client's identity.
        self.monitor = self.front.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.peer_fds: dict[int, bytes] = {}
        self.foreign_fds: set[int] = set()  # connections of another user, refused

    def _release_socket(self) -> None:
        """Undo _setup_socket (a later setup step failed)."""
        self.front.disable_monitor()
        self.monitor.close(linger=0)
        self.front.close(linger=0)
        self.config.socket_path.unlink(missing_ok=True)
        self.lock.release()
        self.zctx.term()

    def _setup_worker(self) -> None:
        c = self.config
        self.kv_arena = None
        remove_stale_arenas()
        if c.cache_bytes > 0:
            from multiprocessing import shared_memory

            # owned by the daemon, so cached pages outlive a worker that dies
            name = arena_name(os.getpid())
            for stale in (SHM_DIR / name, index_path(name)):  # a crashed daemon that had our pid
                stale.unlink(missing_ok=True)
            self.kv_arena = shared_memory.SharedMemory(create=True, size=c.cache_bytes, name=name)
        kind = "model" if c.drafter_path is not None else c.drafter
        draft_endpoint = endpoint(self.socket_dir / f".draft-{os.getpid()}.ipc") if kind == "model" else ""
        identity = governor_identity(c)
        common = dict(
            n_ctx=c.ctx_size, n_threads=c.threads, n_batch=c.batch_size, extra_buffers=c.extra_buffers,
            flash_attn=c.flash_attn, kernels=c.kernels, endpoint="", draft_endpoint=draft_endpoint,
        )  # fmt: skip
        self.target = WorkerHandle(
            self.zctx,
            WorkerConfig(
                role="target",
                model_name=c.model_name,
                model_path=str(c.model_path),
                drafter=kind,
                draft_tokens=c.draft_tokens if kind != "none" else 0,
                draft_p_min=c.draft_p_min,
                exact=c.exact,
                governor=c.governor and kind != "none",
                governor_state=str(state_file(c.state_dir, identity)) if c.state_dir is not None and kind != "none" else "",
                governor_identity=identity,
                governor_per_task=c.governor_per_task,
                probe_cache=str(c.state_dir / "batch-invariance.json") if c.state_dir is not None else "",
                worker_timeout=c.worker_timeout,
                cache_shm=self.kv_arena.name if self.kv_arena is not None else "",
                cache_bytes=c.cache_bytes,
                page_tokens=c.page_tokens,
                **common,
            ),
            self.socket_dir,
        )
        if kind == "model":
            self.drafter = WorkerHandle(
                self.zctx,
                WorkerConfig(
                role="drafter", model_name=c.drafter, model_path=str(c.drafter_path),
                cache_shm=self.kv_arena.name if self.kv_arena is not None else "", cache_bytes=c.cache_bytes,
                page_tokens=c.page_tokens, **common,
            ),  # fmt: skip
                self.socket_dir,
            )
            self.drafter.start()  # first: it binds the endpoint the target connects to
        self.target.start()
        self.drafter_dead = False

    @property
    def workers(self) -> list[WorkerHandle]:
        return [w for w in (self.target, self.drafter) if w is not None]

    @property
    def models_ready(self) -> bool:
        if not self.target.ready:
            return False
        # after the first start a drafter that is down (restarting, switched off) blocks nothing
        return self.drafter is None or self.drafter_dead or self.ever_ready or self.drafter.ready

    def _setup_dispatch(self) -> None:
        self.handlers: dict[type, Callable] = {
            Hello: self.handle_hello,
            Generate: self.handle_generate,
            Complete: self.handle_generate,
            Cancel: self.handle_cancel,
            Status: self.handle_status,
            Shutdown: self.handle_shutdown,
            CacheClear: self.handle_cache_clear,
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

    def reload(self) -> None:
        """SIGHUP: re-read the settings (flags given at start still win) and apply
        those that can change without dropping the models: max_queue and
        log_level. Others that changed are logged as needing a restart. A config
        that does not load changes nothing."""
        self.reload_requested = False
        if self.reload_settings is None or self.stopping:
            log.info("SIGHUP: nothing to reload")
            return
        # RELOADING=1 ... READY=1 only once started: before that, READY=1 would tell
        # systemd the daemon is up while its models are still loading
        started = self.ever_ready
        if started:
            self.notifier.reloading()
        try:
            new = self.reload_settings()
        except ConfigError as exc:
            log.error("SIGHUP: the settings did not load, nothing changed: %s", exc)
            if started:
                self.notifier.ready(self._ready_status() if self.state == "ready" else self.state)
            return
        applied = []
        if new.max_queue != self.config.max_queue:
            applied.append(f"max_queue {self.config.max_queue} -> {new.max_queue}")
            self.config.max_queue = new.max_queue  # a shorter queue keeps who is already in it
        if new.log_level != self.config.log_level:
            applied.append(f"log_level {self.config.log_level} -> {new.log_level}")
            self.config.log_level = new.log_level
            logging.getLogger().setLevel(new.log_level.upper())
        pending = [k for k, v in new.values.items() if k not in RELOADABLE and v != self.started_with.get(k, v)]
        log.info("SIGHUP: reloaded settings from %s: %s", new.path, "; ".join(applied) or "nothing to change")
        if pending:
            log.warning("SIGHUP: %s changed; restart the daemon to apply (tandem stop, or systemctl --user restart tandem)", ", ".join(pending))
        if started:
            self.notifier.ready(self._ready_status() if self.state == "ready" else self.state)

    def _poll_once(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        for w in self.workers:
            if w.sock is not None:
                poller.register(w.sock, zmq.POLLIN)
                if w.sentinel is not None:
                    poller.register(w.sentinel, zmq.POLLIN)
        events = dict(poller.poll(POLL_MS))
        self.notifier.watchdog()  # only from here: a loop that hangs stops the pings
        if self.reload_requested:
            self.reload()
        for w in self.workers:
            if w.sock is not None and w.sock in events:
                self._drain_worker(w)
        if self.monitor in events:
            self._drain_monitor()  # before new requests: an fd may be reused by a new client
        if self.front in events:
            self._drain_front()
        if self.target.sock is not None and not self.target.alive:
            self._on_worker_death()
        if self.drafter is not None and self.drafter.sock is not None and not self.drafter.alive:
            self._on_drafter_death()
        now = time.monotonic()
        if self.restart_due is not None and now >= self.restart_due:
            self.restart_due = None
            if not self._restart(self.target):
                self.restart_due = now + RESTART_BACKOFF_SECONDS[-1]
        if self.drafter_restart_due is not None and now >= self.drafter_restart_due and self.drafter is not None:
            self.drafter_restart_due = None
            if not self._restart(self.drafter):
                self.drafter_restart_due = now + RESTART_BACKOFF_SECONDS[-1]
        self._check_hung(now)
        self._start_next()

    def _check_hung(self, now: float) -> None:
        """A target that sends nothing during a request for worker_timeout (it sends
        progress every second while it works) is hung: kill it; its death is handled
        like any other."""
        busy = self.active is not None or self.clearing is not None
        if not busy or not self.target.alive or self.target.sock is None:
            return
        silent = now - self.target_heard
        if silent > self.config.worker_timeout:
            why = f"did not answer within {self.config.worker_timeout:g} s (worker_timeout) and was killed"
            log.error("the model worker (pid %s) %s", self.target.pid, why)
            self.hung["target"] = why
            self._kill(self.target)

    @staticmethod
    def _restart(worker: WorkerHandle) -> bool:
        """Start a worker again; False (logged) when no process can be started now (out of memory, pids)."""
        try:
            worker.start()
            return True
        except OSError as exc:
            worker.close_channel()
            log.error("could not start the %s worker (%s); trying again in %d s", worker.role, exc, RESTART_BACKOFF_SECONDS[-1])
            return False

    @staticmethod
    def _kill(worker: WorkerHandle) -> None:
        if worker.process is not None:
            worker.process.kill()

    def _drain_front(self, limit: int = 256) -> None:
        for _ in range(limit):
            try:
                frames = self.front.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = frames[0].bytes
            # ZeroMQ queues a connection's "accepted" event before it reads any of
            # its data, and an earlier connection's "disconnected" event on the same
            # fd before that: draining the monitor now retires any earlier owner of
            # this fd, so a late disconnect of a previous client can never cancel
            # this one's request (the fd is reused at once)
            self._drain_monitor()
            fd = frames[0].get(zmq.SRCFD)
            if fd in self.foreign_fds:
                continue  # another user's connection, being closed: no reply
            self.peer_fds[fd] = identity
            self.dispatch(identity, [f.bytes for f in frames[1:]])

    def _drain_monitor(self) -> None:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            fd = event["value"]
            if event["event"] == zmq.EVENT_ACCEPTED:
                self.foreign_fds.discard(fd)  # a new connection on this fd: judge it afresh
                self._check_peer(fd)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.foreign_fds.discard(fd)
                identity = self.peer_fds.pop(fd, None)
                if identity is not None:
                    self._on_client_gone(identity)

    def _check_peer(self, fd: int) -> None:
        """A new connection: refuse it unless it is this user's. ZeroMQ does not
        expose SO_PEERCRED, but its monitor gives the accepted socket's fd; a dup
        of it answers getsockopt, and shutting the dup down closes the connection."""
        try:
            with socket.fromfd(fd, socket.AF_UNIX, socket.SOCK_STREAM) as dup:
                if dup.getsockopt(socket.SOL_SOCKET, socket.SO_DOMAIN) != socket.AF_UNIX:
                    return  # the fd was closed and reused meanwhile (e.g. a metrics scrape): not ours to judge
                pid, uid, _gid = struct.unpack("3i", dup.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
                if uid == os.getuid():
                    return
                self.foreign_fds.add(fd)
                log.warning("refused a connection from uid %d (pid %d): this daemon serves uid %d only", uid, pid, os.getuid())
                dup.shutdown(socket.SHUT_RDWR)
        except OSError as exc:
            # Gone already (ZeroMQ closed the fd): its messages are served like any client's that
            # left. The socket file's 0600 mode is what keeps other users out; this check is the
            # second line, for a socket whose mode someone loosened.
            log.debug("could not check a new connection's user (it is gone): %s", exc)

    def _drain_worker(self, worker: WorkerHandle, limit: int = 1024) -> None:
        for _ in range(limit):
            if worker.sock is None:
                return
            try:
                frames = worker.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(frames, replies=True)
            except ProtocolError as exc:
                log.error("undecodable message from the %s worker: %s", worker.role, exc.message)
                continue
            if isinstance(msg, Ready):
                self._on_ready(msg)
            elif worker is self.target:
                self.on_target_message(msg, frames)
            elif isinstance(msg, Error):  # the drafter says only ready or why it could not load
                if self.ever_ready:  # a restarted drafter that cannot load: draft no more, serve on
                    self._drafter_switched_off(msg.message)
                else:
                    self._on_load_failure(msg.message)

    # ------------------------------------------------------------------ client side

    def send(self, identity: bytes, msg) -> bool:
        return self.send_frames(identity, encode(msg))

    def send_frames(self, identity: bytes, frames: list[bytes]) -> bool:
        """False when the client is gone or not reading (its queue is full)."""
        try:
            self.front.send_multipart([identity, *frames], flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            log.warning("client %s is not reading its replies; dropping it", identity.hex())
            return False
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return False
            raise

    def dispatch(self, identity: bytes, frames: list[bytes]) -> None:
        try:
            msg = decode(frames)
        except ProtocolError as exc:
            self.send(identity, Error.of(exc.request_id, exc.code, exc.message))
            return
        handler = self.handlers[type(msg)]
        try:
            handler(identity, msg)
        except Exception as exc:  # a bug: answer it, log it, keep serving
            log.exception("handling %s failed", msg.op.value)
            self.send(identity, Error.of(msg.id, ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))

    def handle_hello(self, identity: bytes, msg: Hello) -> None:
        major = msg.protocol_version[0] if msg.protocol_version else -1
        if major != PROTOCOL_VERSION[0]:
            self.send(
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
        info = self.target.info
        self.send(
            identity,
            HelloReply(
                id=msg.id,
                protocol_version=list(PROTOCOL_VERSION),
                daemon_version=__version__,
                model=self.config.model_name,
                n_ctx=info.n_ctx if info else 0,
            ),
        )

    def handle_generate(self, identity: bytes, msg: Decoding) -> None:
        if self.state == "failed":
            self.send(identity, Error.of(msg.id, ErrorCode.NOT_READY, f"the daemon has failed: {self.failure}"))
            return
        info = self.target.info
        if isinstance(msg, Complete) and info is not None and not info.fim:
            self.send(
                identity,
                Error.of(
                    msg.id,
                    ErrorCode.FIM_UNSUPPORTED,
                    f"{self.config.model_name} has no fill-in-the-middle tokens in its vocabulary, so 'complete' "
                    f"cannot prompt it. {FIM_FIX}",
                ),
            )
            return
        if msg.id in self.jobs:
            self.send(
                identity,
                Error.of(msg.id, ErrorCode.DUPLICATE_REQUEST_ID, f"a request with id {msg.id!r} is already queued or running"),
            )
            return
        if len(self.queue) >= self.config.max_queue:
            self.counters.requests["busy"] += 1
            self.metrics.request_ended("busy")
            self.send(
                identity,
                Busy(
                    id=msg.id,
                    queue_length=len(self.queue),
                    max_queue=self.config.max_queue,
                    message=f"the queue is full ({len(self.queue)} waiting); retry later or raise --max-queue",
                ),
            )
            return
        self.serial += 1
        job = Job(identity=identity, request=msg, enqueued_at=time.monotonic(), serial=self.serial)
        self.jobs[msg.id] = job
        self.queue.append(job)

    def handle_cancel(self, identity: bytes, msg: Cancel) -> None:
        job = self.jobs.get(msg.request_id)
        found = job is not None
        if job is not None:
            self._cancel(job)
        self.send(identity, CancelReply(id=msg.id, request_id=msg.request_id, found=found))

    def handle_status(self, identity: bytes, msg: Status) -> None:
        self.send(identity, self.status_reply(msg.id))

    def handle_shutdown(self, identity: bytes, msg: Shutdown) -> None:
        log.info("shutdown requested by a client")
        self.send(identity, ShutdownReply(id=msg.id))
        self.stopping = True

    def handle_cache_clear(self, identity: bytes, msg: CacheClear) -> None:
        if self.kv_arena is None:
            self.send(identity, CacheCleared(id=msg.id, pages=0, bytes=0, cache=None))
            return
        if self.state == "failed":
            self.send(identity, Error.of(msg.id, ErrorCode.NOT_READY, f"the daemon has failed: {self.failure}"))
            return
        self.clears.append((identity, msg))  # after the running request, before the next (see _start_next)

    def _on_client_gone(self, identity: bytes) -> None:
        """The peer disconnected: cancel what it asked for; nobody is left to answer."""
        for job in list(self.jobs.values()):
            if job.identity == identity:
                job.client_gone = True
                self._cancel(job)

    def _cancel(self, job: Job) -> None:
        if job is self.active:
            self.target.send(Cancel(id=job.request.id, request_id=job.request.id))
        else:
            self.queue.remove(job)
            self._finish(job, self._cancelled_done(job))

    def _cancelled_done(self, job: Job) -> Done:
        waited = time.monotonic() - job.enqueued_at
        return Done(
            id=job.request.id,
            text="",
            finish_reason=FinishReason.CANCELLED,
            usage=Usage(prompt_tokens=0, completion_tokens=0),
            timings=Timings(0.0, 0.0, 0.0, 0.0, waited),
            serial=job.serial,
        )

    def _finish(self, job: Job, terminal) -> None:
        """Deliver a request's one terminal message and forget the request."""
        if job.answered:  # its terminal message went out already (_answer_early)
            if job is self.active:
                self.active = None
            return
        self.jobs.pop(job.request.id, None)
        if job is self.active:
            self.active = None
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
            self.send(job.identity, terminal)

    # ------------------------------------------------------------------ worker side

    def _start_next(self) -> None:
        if self.active is not None or self.clearing is not None or self.state != "ready" or not self.models_ready:
            return
        if self.stopping:
            return
        if self.clears:
            self.clearing = self.clears.popleft()
            self.target_heard = time.monotonic()
            if not self.target.send(self.clearing[1]):
                self._clear_failed("the model worker could not take the request")
            return
        if not self.queue:
            return
        job = self.queue.popleft()
        job.started_at = time.monotonic()
        self.active = job
        self.target_heard = job.started_at  # the hung-worker deadline counts from here
        self.target.send(job.request)

    def on_target_message(self, msg, frames: list[bytes]) -> None:
        """A chunk, done or error from the target worker; chunks are relayed as
        the worker encoded them."""
        self.target_heard = time.monotonic()
        if isinstance(msg, Progress):
            return  # a heartbeat
        if isinstance(msg, DrafterHung):  # the target found the drafter hung
            if self.drafter is not None and self.drafter.alive:
                log.error("the drafter worker (pid %s): %s; killing it", self.drafter.pid, msg.message)
                self.hung["drafter"] = msg.message.removeprefix("the drafter ") + " and was killed"
                self._kill(self.drafter)
            return
        if isinstance(msg, CacheCleared):
            if self.clearing is not None and msg.id == self.clearing[1].id:
                self.cache = msg.cache
                if msg.cache is not None:
                    self.metrics.cache_seen(msg.cache)
                self.send(self.clearing[0], msg)
                self.clearing = None
            return
        job = self.active
        if job is None or msg.id != job.request.id:
            if isinstance(msg, Error) and msg.code == ErrorCode.NOT_READY:
                self._on_load_failure(msg.message)
            return
        if job.answered:  # already answered (a worker died): this is the worker finishing up
            if not isinstance(msg, Chunk):
                self._finish(job, msg)
            return
        if isinstance(msg, Chunk):
            job.completion_tokens += len(msg.token_ids)
            if msg.token_ids:
                now = time.monotonic()
                if job.last_tokens_at is not None:  # the first chunk's wait is the time to first token
                    self.metrics.tokens_relayed(len(msg.token_ids), now - job.last_tokens_at)
                job.last_tokens_at = now
            if not job.client_gone and not self.send_frames(job.identity, frames):
                job.client_gone = True
                self._cancel(job)
            return
        if isinstance(msg, Done):
            self.target_deaths.clear()
            msg.serial = job.serial
            msg.timings.queued_seconds = (job.started_at or job.enqueued_at) - job.enqueued_at
            if msg.governor is not None:
                self.governor = msg.governor
            if msg.cache is not None:
                self.cache = msg.cache
        self._finish(job, msg)

    def _clear_failed(self, why: str) -> None:
        if self.clearing is not None:
            identity, msg = self.clearing
            self.clearing = None
            self.send(identity, Error.of(msg.id, ErrorCode.WORKER_DIED, f"the cache was not cleared: {why}; retry"))

    def _on_ready(self, msg: Ready) -> None:
        worker = self.drafter if msg.id == "drafter" else self.target
        assert worker is not None
        worker.info = msg.model
        if worker is self.target and self.drafter is not None and (self.drafter_dead or not self.drafter.ready):
            self.target.send(DrafterState(id="daemon", available=False))  # a new target: the drafter is down
        if worker is self.drafter and self.ever_ready and self.target.alive:
            self.target.send(DrafterState(id="daemon", available=True))  # a restarted drafter: draft again
        if worker is self.target:
            self.governor = msg.governor
            self.cache = msg.cache
            if msg.governor is not None:
                self.metrics.governor_seen(msg.governor)
            if msg.cache is not None:
                self.metrics.cache_seen(msg.cache)
        elapsed = time.monotonic() - worker.started_at
        log.info(
            "%s model %s loaded in %.1f s (context %d tokens, worker pid %d)",
            worker.role, msg.model.name, elapsed, msg.model.n_ctx, msg.pid,
        )  # fmt: skip
        if not self.models_ready:
            return
        if self.drafter is not None and self.drafter.info is not None and self.target.info is not None:
            mismatch = vocab_mismatch(self.target.info, self.drafter.info)
            if mismatch:
                self._on_load_failure(mismatch + "; choose a drafter from the target's model family, or --drafter ngram")
                return
        self.state = "ready"
        self.ever_ready = True
        log.info("ready")
        self.notifier.ready(self._ready_status())  # models loaded, socket bound: systemd may call us started
        if self.on_ready is not None:
            self.on_ready()

    def _answer_early(self, job: Job, error: Error) -> None:
        """End the running request now with ``error`` and have the target stop it;
        it stays active (nothing else starts) until the target's own terminal
        message, which is then dropped."""
        self._finish(job, error)  # counts it, sends it, forgets the id (a retry may reuse it)
        job.answered = True
        self.active = job
        self.target.send(Cancel(id=job.request.id, request_id=job.request.id))

    def _on_drafter_death(self) -> None:
        assert self.drafter is not None
        code = self.drafter.reap()
        if self.stopping or self.state == "failed" or self.drafter_off:
            return  # (switched off: it was told to exit)
        how = self.hung.pop("drafter", None) or f"died (exit code {code})"
        if not self.ever_ready:
            self._on_load_failure(f"the drafter worker {how} while loading {self.config.drafter_path}")
            return
        now = time.monotonic()
        self.drafter_deaths = [t for t in self.drafter_deaths if now - t < DRAFTER_DEATH_WINDOW] + [now]
        give_up = len(self.drafter_deaths) >= DRAFTER_MAX_DEATHS
        if self.target.alive and self.target.sock is not None:
            self.target.send(DrafterState(id="daemon", available=False))  # decode plainly until it is back
        job = self.active
        if job is not None and not job.answered and job.request.draft != "off" and job.request.draft_tokens != 0:
            then = "drafting is now off" if give_up else "it is being restarted"
            self._answer_early(
                job,
                Error.of(
                    job.request.id,
                    ErrorCode.DRAFTER_DIED,
                    f"the drafter worker {how} while this request was decoded; {then}, and the request may be retried",
                ),
            )
        if give_up:
            self._drafter_switched_off(
                f"it died {len(self.drafter_deaths)} times within {DRAFTER_DEATH_WINDOW / 60:.0f} minutes", how
            )
            return
        delay = RESTART_BACKOFF_SECONDS[min(len(self.drafter_deaths) - 1, len(RESTART_BACKOFF_SECONDS) - 1)]
        log.warning("the drafter worker %s; restarting it in %d s (plain decoding meanwhile)", how, delay)
        self.drafter.restarts += 1
        self.metrics.worker_restarted("drafter")
        self.drafter_restart_due = now + delay

    def _drafter_switched_off(self, why: str, how: str = "cannot be used") -> None:
        self.drafter_dead = True
        self.drafter_off = why
        self.drafter_restart_due = None
        if self.drafter is not None and self.drafter.alive:
            self.drafter.send(Shutdown(id="daemon"))
        if self.target.alive and self.target.sock is not None:
            self.target.send(DrafterState(id="daemon", available=False))
        log.warning(
            "the drafter worker %s; %s, so drafting is switched off and plain decoding goes on "
            "(restart the daemon to draft again)", how, why,
        )  # fmt: skip

    def _ready_status(self) -> str:
        drafter = f" + drafter {self.config.drafter}" if self.config.drafter != "none" else ""
        return f"serving {self.config.model_name}{drafter} on {self.config.socket_path}"

    def _on_load_failure(self, message: str) -> None:
        log.error("%s", message)
        self.notifier.status(f"failed: {message}"[:400])
        self.state = "failed"
        self.failure = message
        for job in list(self.queue):
            self.queue.remove(job)
            self._finish(job, Error.of(job.request.id, ErrorCode.NOT_READY, message))
        if not self.ever_ready:
            self.stopping = True  # the models never loaded: nothing to serve

    def _on_worker_death(self) -> None:
        code = self.target.reap()
        if self.stopping:
            return
        how = self.hung.pop("target", None) or f"died (exit code {code})"
        log.error("the model worker %s", how)
        if self.state == "failed":  # no restart; still, what it was doing gets its answer
            self._clear_failed(f"the model worker {how}")
            if self.active is not None:
                self._finish(self.active, Error.of(self.active.request.id, ErrorCode.NOT_READY, f"the daemon has failed: {self.failure}"))
                self.active = None
            return
        if not self.ever_ready:
            self._on_load_failure(f"the model worker {how} while loading {self.config.model_path}")
            return
        self._clear_failed(f"the model worker {how}")
        if self.active is not None:
            job = self.active
            self._finish(
                job,
                Error.of(
                    job.request.id,
                    ErrorCode.WORKER_DIED,
                    f"the model worker {how} while serving this request; it is being restarted and the request "
                    "may be retried",
                ),
            )
            self.active = None
        now = time.monotonic()
        self.target_deaths = [t for t in self.target_deaths if now - t < TARGET_DEATH_WINDOW] + [now]
        if len(self.target_deaths) >= TARGET_MAX_DEATHS:
            self._on_load_failure(
                f"the model worker died {len(self.target_deaths)} times within {TARGET_DEATH_WINDOW / 60:.0f} "
                f"minutes without finishing a request in between (last: it {how}); the daemon gave up restarting "
                "it. See the log above, fix the cause, and restart the daemon"
            )
            return
        self.state = "loading"
        self.notifier.status(f"restarting the model worker (it {how})")
        delay = RESTART_BACKOFF_SECONDS[min(len(self.target_deaths) - 1, len(RESTART_BACKOFF_SECONDS) - 1)]
        self.target.restarts += 1
        self.metrics.worker_restarted("target")
        self.restart_due = time.monotonic() + delay

    # ------------------------------------------------------------------ status

    def _drafter_note(self) -> str:
        if self.drafter is None:
            return ""
        if self.drafter_off:
            return f" (off: {self.drafter_off})"
        if self.drafter_restart_due is not None or (self.ever_ready and not self.drafter.alive):
            return " (restarting)"
        return ""

    def memory(self, reap: bool = True) -> tuple[dict[str, int], dict[str, int]]:
        """Resident memory by process ("daemon", "target", "drafter") and the workers'
        pids. ``reap=False`` (off the main thread) leaves worker liveness to psutil:
        a dead worker's pid has no memory to read."""
        memory = {"daemon": self._process.memory_info().rss}
        pids = {}
        for w in self.workers:
            pid = w.pid
            # off the main thread: a reaped worker has no channel, and its pid may be reused
            if pid and (w.alive if reap else w.sock is not None):
                pids[w.role] = pid
                try:
                    memory[w.role] = psutil.Process(pid).memory_info().rss
                except psutil.Error:
                    pass
        return memory, pids

    def live_metrics(self) -> dict:
        """The present, for a metrics scrape (called on the metrics thread: reads only)."""
        return dict(
            queue_depth=len(self.queue),
            active=1 if self.active is not None else 0,
            ready=1 if self.state == "ready" and not self.stopping else 0,
            memory=self.memory(reap=False)[0],
            uptime=time.monotonic() - self.started_at,
        )

    def status_reply(self, request_id: str) -> StatusReply:
        now = time.monotonic()
        memory, pids = self.memory()
        active = None
        if self.active is not None:
            job = self.active
            active = ActiveRequest(
                id=job.request.id,
                elapsed_seconds=now - (job.started_at or now),
                completion_tokens=job.completion_tokens,
            )
        return StatusReply(
            id=request_id,
            state="stopping" if self.stopping else self.state,
            daemon_version=__version__,
            pid=os.getpid(),
            uptime_seconds=now - self.started_at,
            socket_path=str(self.config.socket_path),
            model=self.target.info,
            active=active,
            queue_length=len(self.queue),
            max_queue=self.config.max_queue,
            requests=dict(self.counters.requests),
            tokens=dict(self.counters.tokens),
            memory_rss_bytes=memory,
            worker_pids=pids,
            worker_restarts=sum(w.restarts for w in self.workers),
            failure=self.failure,
            drafter=self.config.drafter + self._drafter_note(),
            drafter_model=self.drafter.info if self.drafter is not None else None,
            draft_tokens=self.config.draft_tokens if self.config.drafter != "none" else 0,
            draft=self.counters.draft if self.counters.draft.rounds else None,
            governor=self.governor,
            cache=self.cache,
            metrics_addr=self.metrics.address,
        )

    # ------------------------------------------------------------------ shutdown

    def _shutdown(self) -> None:
        self.notifier.stopping("stopping: answering queued requests and stopping the workers")
        for identity, msg in [*self.clears, *([self.clearing] if self.clearing else [])]:
            self.send(identity, Error.of(msg.id, ErrorCode.SHUTTING_DOWN, "the daemon is shutting down"))
        self.clears.clear()
        self.clearing = None
        for job in list(self.queue):
            self.queue.remove(job)
            self._finish(job, Error.of(job.request.id, ErrorCode.SHUTTING_DOWN, "the daemon is shutting down"))
        if self.active is not None and self.target.alive and self.target.sock is not None:
            self._cancel(self.active)
            deadline = time.monotonic() + 5
            while self.active is not None and time.monotonic() < deadline and self.target.alive:
                if self.target.sock.poll(100, zmq.POLLIN):
                    self._drain_worker(self.target)
        if self.active is not None:
            self._finish(self.active, Error.of(self.active.request.id, ErrorCode.SHUTTING_DOWN, "the daemon is shutting down"))
        for w in self.workers:
            if w.alive:
                w.send(Shutdown(id="daemon"))
        for w in self.workers:
            w.stop()
        self.front.disable_monitor()
        self.monitor.close(linger=0)
        self.front.close(linger=1000)
        try:
            self.config.socket_path.unlink()
        except FileNotFoundError:
            pass
        if self.kv_arena is not None:
            self.kv_arena.close()
            self.kv_arena.unlink()
            index_path(self.kv_arena.name).unlink(missing_ok=True)
        self.lock.release()
        self.zctx.term()
        self.metrics.close()
        self.notifier.close()
        log.info("stopped")
