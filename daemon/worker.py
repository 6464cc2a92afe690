"""The model worker process: a thin shell of sockets around ``Engine``.

The daemon starts ``python -m tandem.daemon.worker`` (configuration as JSON on
stdin; see worker_handle.py) and talks to it over a ZeroMQ PAIR socket on a private ipc path, using the
same codec as clients. The worker loads the model, says ``ready``, then serves
one ``generate`` at a time, streaming ``chunk`` messages and ending each with
exactly one ``done`` or ``error``. Between decode steps it drains its socket for
``cancel``/``shutdown``, so a cancel lands within one step.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import zmq

from tandem.protocol import (
    CacheCleared,
    CacheClear,
    Cancel,
    Complete,
    DrafterHung,
    DrafterState,
    Error,
    ErrorCode,
    Generate,
    ModelInfo,
    Progress,
    ProtocolError,
    Ready,
    Shutdown,
    WORKER_REQUESTS,
    decode,
    encode,
)

# Nothing here imports llama_cpp at module level: the worker sets GOMP_SPINCOUNT
# before llama.cpp (and its OpenMP runtime) is loaded.

log = logging.getLogger("tandem.worker")

HEARTBEAT_SECONDS = 1.0  # Progress at most this often while serving a request


@dataclass
class WorkerConfig:
    role: str  # "target"
    model_name: str
    model_path: str
    n_ctx: Optional[int]
    n_threads: Optional[int]
    n_batch: int
    extra_buffers: Optional[bool]
    endpoint: str
    flash_attn: bool = True
    kernels: str = "reference"  # "reference": ggml's batch-invariant CPU kernels; "fast": its shape-specialised ones
    spin_count: Optional[int] = 10000  # GOMP_SPINCOUNT; see FACTS.md on two llama.cpp processes
    drafter: str = "none"  # target only: "none", "ngram" or "model"
    draft_endpoint: str = ""  # the drafter worker binds it, the target worker connects to it
    draft_tokens: int = 0
    draft_p_min: float = 0.0
    exact: str = "auto"  # batch every step: "on", "off", "auto" = when not batch-invariant and not governed
    governor: bool = False  # with a drafter: draft only while it pays (see governor.py)
    governor_state: str = ""  # file the governor's state is kept in ("": not kept)
    governor_identity: str = ""  # target, drafter and k: the state is valid only for these
    governor_per_task: bool = True  # one governor per task (the prompt's start), or one for all
    probe_cache: str = ""  # file keeping the batch-invariance probe's verdicts across restarts ("": not kept)
    cache_shm: str = ""  # the daemon's prefix-cache arena (a /dev/shm name); "": no prefix cache
    cache_bytes: int = 0
    page_tokens: int = 16
    worker_timeout: float = 120.0  # the daemon's deadline; the target waits for the drafter no longer than this


def load_model(config: WorkerConfig):
    """Load the worker's model with the daemon's llama.cpp settings (call only
    after the process environment is set: this imports llama.cpp)."""
    from .llama_model import LlamaModel

    return LlamaModel(
        config.model_path,
        n_ctx=config.n_ctx,
        n_threads=config.n_threads,
        n_batch=config.n_batch,
        extra_buffers=config.extra_buffers,
        flash_attn=config.flash_attn,
        reference_kernels=config.kernels == "reference",
    )


PROBE_PATHS = {"restore", "verify", "one_token", "small_batches"}  # LlamaModel.batch_invariance's keys


def probe_key(model, config: WorkerConfig) -> str:
    """What the probe's verdict depends on: the model file, the kernels and
    their settings, the CPU's features as llama.cpp sees them, and its version."""
    import hashlib

    import llama_cpp

    st = model.path.stat()
    parts = (
        str(model.path.resolve()), st.st_size, st.st_mtime_ns, config.kernels, model.flash_attn, model.extra_buffers,
        model.n_batch, model.n_threads, llama_cpp.__version__, llama_cpp.llama_print_system_info().decode(),
    )  # fmt: skip
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def probe_batch_invariance(model, config: WorkerConfig) -> dict[str, bool]:
    """``model.batch_invariance()``, kept in ``config.probe_cache`` (a few seconds
    for a 1.5B model on 2 cores, so not at every start). A missing, corrupt or
    foreign file only means probing again."""
    import json

    path = Path(config.probe_cache) if config.probe_cache else None
    key = probe_key(model, config)
    known: dict = {}
    if path is not None:
        try:
            if path.is_file() and path.stat().st_size < 1 << 20:  # never a FIFO or a huge file
                known = json.loads(path.read_text())
            known = known if isinstance(known, dict) else {}
        except Exception:  # unreadable, not JSON, nested too deep: probe again
            known = {}
        cached = known.get(key)
        if isinstance(cached, dict) and set(cached) == PROBE_PATHS and all(isinstance(v, bool) for v in cached.values()):
            return cached
    paths = model.batch_invariance()
    if path is not None and paths:
        known = {k: v for k, v in known.items() if isinstance(v, dict)}
        known[key] = paths
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(dict(list(known.items())[-32:])))
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            log.warning("could not keep the batch-invariance probe's verdict in %s: %s", path, exc)
    return paths


def invariance_fix(config: WorkerConfig, model) -> str:
    """What to change so that the probe passes, as far as it is known."""
    if config.kernels != "reference":
        return "Use --kernels reference (the default)."
    if not config.flash_attn:
        return "Use --flash-attn on (the default)."
    if model.extra_buffers:
        return "Try --extra-buffers off (weight repacking uses other kernels for one row than for several)."
    return ("No setting is known to fix it for this model file (F16 weights use llamafile's tinyBLAS, whose "
            "rows differ from its one-row kernel); Q4_K and Q4_1 models were measured batch-invariant.")


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m tandem.daemon.worker --sentinel-fd N`` with a WorkerConfig as JSON on stdin."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="tandem.daemon.worker", description="a tandem model worker (started by the daemon)")
    ap.add_argument("--sentinel-fd", type=int, required=True, help="a pipe's write end, held open while we live")
    ap.add_argument("--parent-pid", type=int, required=True, help="the daemon: we exit if it is gone")
    args = ap.parse_args(argv)
    os.set_inheritable(args.sentinel_fd, False)  # held by this process only, never by anything it starts
    _die_with_parent()
    if os.getppid() != args.parent_pid:  # it died before PR_SET_PDEATHSIG was in place
        sys.exit(1)
    config = WorkerConfig(**json.loads(sys.stdin.read()))
    run_worker_process(config)


def run_worker_process(config: WorkerConfig) -> None:
    """Entry point of the worker process."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when we stop
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a terminal hangup or a reload is the daemon's business
    if config.spin_count is not None:
        os.environ.setdefault("GOMP_SPINCOUNT", str(config.spin_count))
    logging.basicConfig(level=logging.INFO, format=f"tandem[{config.role}] %(levelname)s %(message)s")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(config.endpoint)
    try:
        if config.role == "drafter":
            from .drafter_worker import DrafterLoop

            DrafterLoop(config, sock).run()
        else:
            WorkerLoop(config, sock).run()
    finally:
        sock.close()
        ctx.term()
    sys.exit(0)


class WorkerLoop:
    def __init__(self, config: WorkerConfig, sock):
        self.config = config
        self.sock = sock
        self.stopping = False
        self.cancelled: set[str] = set()
        self.governors = None
        self.engine = None
        self.last_beat = 0.0
        self.current = ""  # the request being served

    def send(self, msg) -> None:
        self.sock.send_multipart(encode(msg))

    def run(self) -> None:
        try:
            engine, info = self._load()
            self.engine = engine
        except Exception as exc:
            self.send(Error.of(self.config.role, ErrorCode.NOT_READY, f"could not load the model: {exc}"))
            return
        self.send(
            Ready(
                id=self.config.role,
                model=info,
                pid=os.getpid(),
                governor=self.governors.info() if self.governors is not None else None,
                cache=engine.cache.info() if engine.cache is not None else None,
            )
        )
        while not self.stopping:
            self._serve_one(engine, self.sock.recv_multipart())

    def _load(self):
        from .chat import ChatTemplate, ChatTemplateError
        from .engine import Engine

        c = self.config
        model = load_model(c)
        template = None
        source = model.chat_template()
        if source:
            try:
                template = ChatTemplate(
                    source,
                    bos_token=model.token_text(model.bos_token, special=True).decode("utf-8", "replace"),
                    eos_token=model.token_text(model.eos_token, special=True).decode("utf-8", "replace"),
                )
            except ChatTemplateError as exc:
                log.warning("%s; chat requests will be refused", exc)
        info = ModelInfo(
            name=c.model_name,
            path=str(model.path),
            n_ctx=model.n_ctx,
            n_ctx_train=model.n_ctx_train,
            n_vocab=model.n_vocab,
            size_bytes=model.size_bytes,
            has_chat_template=template is not None,
            vocab_digests=model.vocab_digests() if c.drafter == "model" else [],
            fim=model.fim_tokens() is not None,
            kernels=c.kernels,
            flash_attn=c.flash_attn,
        )
        min_batch = 1
        started = time.perf_counter()
        try:
            paths = probe_batch_invariance(model, c)
        except Exception as exc:  # a failed probe must not stop the daemon: the verdict is unknown
            log.warning("the batch-invariance probe failed (%s: %s); exactness unknown", type(exc).__name__, exc)
            paths = {}
        info.batch_invariant = all(paths.values()) if paths else None
        info.batch_variant_paths = [name for name, same in paths.items() if not same]
        log.info(
            "batch-invariance probe (%.2f s): %s", time.perf_counter() - started,
            "every path gives identical logits" if info.batch_invariant
            else "no verdict (the context is too small to probe in, or the probe failed)" if info.batch_invariant is None
            else "logits differ on " + ", ".join(info.batch_variant_paths),
        )  # fmt: skip
        if info.batch_invariant is False:
            log.warning(
                "%s is not batch-invariant on this CPU with these settings (kernels=%s, flash_attn=%s, "
                "extra_buffers=%s): at near-ties greedy output can depend on the prefix cache and on drafting. "
                "%s", c.model_name, c.kernels, "on" if c.flash_attn else "off",
                "on" if model.extra_buffers else "off", invariance_fix(c, model),
            )  # fmt: skip
        if c.drafter != "none" and (c.exact == "on" or (c.exact == "auto" and info.batch_invariant is not True)):
            min_batch = 2
            info.exact_steps = True
        governors = None
        if c.governor and c.drafter != "none":
            from .governor import GovernorBank

            governors = GovernorBank(
                c.governor_identity,
                Path(c.governor_state) if c.governor_state else None,
                per_task=c.governor_per_task,
            )
        self.governors = governors
        engine = Engine(
            model,
            template,
            self._drafter(),
            c.draft_tokens,
            c.draft_p_min,
            min_batch,
            governors=governors,
            cache=self._page_store(model),
        )
        engine.batch_invariant = info.batch_invariant
        return engine, info

    def _page_store(self, model):
        c = self.config
        if not c.cache_shm:
            return None
        from .page_store import PageStore, index_path, map_arena
        from .prefix_cache import ExtentAllocator, PageTree

        self._arena = map_arena(c.cache_shm, c.cache_bytes)
        store = PageStore(PageTree(c.page_tokens, ExtentAllocator(c.cache_bytes)), memoryview(self._arena), model)
        store.probe_layout()
        kept, dropped = store.load_index(index_path(c.cache_shm))
        if kept or dropped:
            log.info(
                "prefix cache: %d pages kept from the previous worker (%d dropped: evicted or overwritten since)",
                kept, dropped,
            )  # fmt: skip
        return store

    def _drafter(self):
        kind = self.config.drafter
        if kind == "ngram":
            from .ngram import NgramDrafter

            return NgramDrafter()
        if kind == "model":
            from .drafter_client import ModelDrafterClient

            client = ModelDrafterClient(self.sock.context, self.config.draft_endpoint, timeout=self.config.worker_timeout)
            client.on_wait = lambda: self._poll_cancel(self.current)  # heartbeats, and cancels, while it waits
            # a drafter that does not answer: the daemon kills and restarts it
            client.on_timeout = lambda why: self.send(DrafterHung(id=self.current, message=why))
            return client
        return None

    def _serve_one(self, engine, frames) -> None:
        from .engine import RequestError

        try:
            msg = decode(frames, table=WORKER_REQUESTS)
        except ProtocolError as exc:  # the daemon validated it; this is a bug
            log.error("undecodable message from the daemon: %s", exc.message)
            return
        if isinstance(msg, Shutdown):
            self.stopping = True
            return
        if isinstance(msg, Cancel):
            return  # nothing running: it finished before the cancel arrived
        if isinstance(msg, DrafterState):
            self._drafter_state(msg)
            return
        if isinstance(msg, CacheClear):
            self._clear_cache(engine, msg)
            return
        if not isinstance(msg, (Generate, Complete)):
            log.error("unexpected %s message from the daemon", msg.op.value)
            return
        self.cancelled.clear()
        self.current = msg.id
        self.last_beat = time.monotonic()
        self.send(Progress(id=msg.id))  # at once: the first prefill batch may take a while
        try:
            done = engine.run(msg, self.send, lambda: self._poll_cancel(msg.id))
            if engine.cache is not None:
                # before the reply (a few ms in tmpfs): once a request is answered,
                # its pages survive this worker being killed
                self._save_cache_index(engine)
            self.send(done)
            if done.governor is not None and self.governors is not None:
                self.governors.save()  # after the reply: a few ms of disk never delay it
        except RequestError as exc:
            self.send(Error.of(msg.id, exc.code, exc.message))
        except Exception as exc:  # a bug or a llama.cpp failure: report it, keep serving
            log.exception("request %s failed", msg.id)
            self.send(Error.of(msg.id, ErrorCode.INTERNAL, f"the worker failed: {type(exc).__name__}: {exc}"))

    def _clear_cache(self, engine, msg: CacheClear) -> None:
        cache = engine.cache
        if cache is None:
            self.send(CacheCleared(id=msg.id, pages=0, bytes=0, cache=None))
            return
        pages, used = cache.tree.pages(), cache.tree.allocator.used
        cache.release()
        cache.tree.clear()
        self._save_cache_index(engine)
        pages, used = pages - cache.tree.pages(), used - cache.tree.allocator.used
        log.info("prefix cache cleared: %d pages, %d bytes", pages, used)
        self.send(CacheCleared(id=msg.id, pages=pages, bytes=used, cache=cache.info()))

    def _save_cache_index(self, engine) -> None:
        from .page_store import index_path

        try:
            engine.cache.save_index(index_path(self.config.cache_shm))
        except OSError as exc:
            log.warning("could not save the prefix-cache index (a restarted worker would start empty): %s", exc)

    def _poll_cancel(self, request_id: str) -> bool:
        """Between steps of a request: read what the daemon sent, and say we are alive."""
        now = time.monotonic()
        if now - self.last_beat >= min(HEARTBEAT_SECONDS, self.config.worker_timeout / 4):
            self.last_beat = now
            self.send(Progress(id=request_id))
        while self.sock.poll(0, zmq.POLLIN):
            try:
                msg = decode(self.sock.recv_multipart(), table=WORKER_REQUESTS)
            except ProtocolError:
                continue
            if isinstance(msg, Cancel):
                self.cancelled.add(msg.request_id)
            elif isinstance(msg, Shutdown):
                self.stopping = True
            elif isinstance(msg, DrafterState):
                self._drafter_state(msg)
        return self.stopping or request_id in self.cancelled

    def _drafter_state(self, msg: DrafterState) -> None:
        drafter = self.engine.drafter if self.engine is not None else None
        if drafter is None or not hasattr(drafter, "reset"):
            return
        if msg.available:
            log.info("the drafter worker is back; drafting again from the next request")
            drafter.revive()  # at the next request's start: never under a request that is waiting on it
        else:
            drafter.go_down()  # until it is back: plain decoding


if __name__ == "__main__":
    main()
