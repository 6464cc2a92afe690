"""The target worker process: a thin shell of sockets around ``Engine``.

``worker_main`` runs ``TargetLoop`` in the target's process. It talks to the
daemon over a ZeroMQ PAIR socket on a private ipc path, using the same codec as
clients: it loads the model (``load_engine``, which has no socket), says
``ready``, then serves one ``generate`` at a time, streaming ``chunk`` messages
and ending each with exactly one ``done`` or ``error``. Between decode steps it
drains its socket for ``cancel``/``shutdown``, so a cancel lands within one step.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable, Optional

import psutil
import zmq

from tandem.protocol import (
    CacheClear,
    CacheCleared,
    Cancel,
    Complete,
    Decoding,
    Detokenize,
    Detokenized,
    Done,
    Error,
    ErrorCode,
    Generate,
    ModelInfo,
    ProtocolError,
    Shutdown,
    Tokenize,
    Tokenized,
    decode,
    encode,
)
from tandem.protocol.internal import WORKER_REQUESTS, CacheState, DrafterHung, DrafterState, Progress, Ready

from ..constraints.constraint import Grammars
from ..drafting.interfaces import Drafter, RequestError
from ..kernels import in_use
from ..models.context_size import ContextError, kv_bytes_per_token, mib
from ..models.gguf_meta import GGUFError, read_metadata
from .engine import Engine
from .invariance import invariance_fix, kept_check, machine_kept_check, probe_batch_invariance
from .lane import ResumeFailed
from .worker_config import WorkerConfig, describe_model, load_model

log = logging.getLogger("tandem.worker")

HEARTBEAT_SECONDS = 1.0  # Progress at most this often while serving a request
SHUTDOWN_SPILL_SECONDS = 3.0  # of the 5 the daemon gives a stopping worker: pages still to write to disk
NARROW_REPORT_DRAFTS = 64  # a 4-bit drafter's acceptance is logged once it has drafted this many


def load_engine(config: WorkerConfig, drafter: Optional[Drafter]) -> tuple[Engine, ModelInfo]:
    """Load the target model, probe it, and build its engine (with its governors
    and prefix-cache pages, where the daemon has them)."""
    from ..cache.page_store import model_identity
    from ..models.chat import ChatTemplate, ChatTemplateError

    c = config
    identity = model_identity(c.model_path) if c.cache_shm else ""  # of the file as it is loaded
    disk_identity = model_identity(c.model_path, location=False) if c.cache_shm else ""  # (the disk tier's)
    model = load_model(c)
    template = None
    source = model.chat_template()
    if c.settings.chat_template_file is not None:
        try:
            source = Path(c.settings.chat_template_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:  # (checked at start: it went away since)
            log.warning("--chat-template-file: cannot read it now (%s); the GGUF file's template is used", exc)
    if source:
        try:
            template = ChatTemplate(
                source,
                bos_token=model.token_text(model.bos_token, special=True).decode("utf-8", "replace"),
                eos_token=model.token_text(model.eos_token, special=True).decode("utf-8", "replace"),
            )
        except ChatTemplateError as exc:
            log.warning("%s; chat requests will be refused", exc)
    info = describe_model(
        model,
        c,
        has_chat_template=template is not None,
        vocab_digests=model.vocab_digests() if c.drafter == "model" else [],
        fim=model.fim_tokens() is not None,
        kernels=c.settings.kernels,
        cpu_kernels=in_use(),
        flash_attn=c.settings.flash_attn,
        extra_buffers=model.extra_buffers,
    )
    choose_prompt_reader(model, c)
    check_fast_prefill(model, info, c)
    probe(model, c, info)
    min_batch = 2 if wants_exact_steps(c, info) else 1
    info.exact_steps = min_batch > 1
    info.draft_off = draft_off_reason(c, info, min_batch)
    governors, costs = None, None
    if c.governed:
        from ..drafting.governor import GovernorBank

        identity, path = governor_keys(c, model.placement.key(), model.step_rows)
        costs = pass_costs(model, c, min_batch)
        governors = GovernorBank(
            identity,
            path,
            per_task=c.settings.governor_per_task,
            costs=costs,
            k_max=c.draft_tokens,
        )
    if min_batch > 1:
        say_exact_steps(c, costs.load if costs is not None else {})
    if info.draft_off:
        log.warning("drafting and jump-forward are off for every request: %s", info.draft_off)
    engine = Engine(
        model,
        template,
        drafter,
        c.draft_tokens,
        c.settings.draft_p_min,
        min_batch,
        governors=governors,
        cache=page_store(model, c, identity, disk_identity),
        grammars=Grammars(model),
        jump_forward=c.settings.jump_forward,
    )
    engine.batch_invariant = info.batch_invariant
    engine.draft_off = info.draft_off
    info.reasoning = engine.prompts.reasoning_kind
    budget = c.settings.thinking_budget
    engine.prompts.default_budget = budget if budget >= 0 else None
    return engine, info


def wants_exact_steps(config: WorkerConfig, info: ModelInfo) -> bool:
    """Exact steps (every step reads two positions): ``--exact on``; with ``auto``,
    where the probe found one-token steps rounding differently from wider passes
    (and, with a drafter, where it found no verdict). Not only with a drafter: a
    daemon without one, or a constrained request's jump-forward pass, would
    otherwise write other text than the same model with a drafter."""
    if config.settings.exact == "on":
        return True
    if config.settings.exact != "auto":
        return False
    return info.batch_invariant is False or (config.drafter != "none" and info.batch_invariant is None)


def draft_off_reason(config: WorkerConfig, info: ModelInfo, min_batch: int) -> str:
    """Why drafting (and jump-forward) must stay off for every request: a verify pass
    gives other logits than the steps the engine takes between them (exact steps with
    ``min_batch`` 2, one-token steps otherwise), so drafting would change greedy
    output. "" where it does not, where nothing was measured, or with ``--exact off``
    (which drafts whatever the probe says)."""
    if config.settings.exact == "off":
        return ""
    path = "exact_steps" if min_batch > 1 else "one_token"
    if path not in info.batch_variant_paths:
        return ""
    steps = "two-position (exact) steps" if min_batch > 1 else "one-token steps"
    return (
        f"on this CPU, with these settings, a verify pass rounds differently from {steps} (load probe: "
        f"{path}), so drafting would change greedy output; --exact off drafts anyway, and output may then change "
        "at near-ties"
    )


def say_exact_steps(config: WorkerConfig, load: dict[int, float]) -> None:
    """Exact steps' price, said at start: every step without drafts reads two positions."""
    price = ""
    if 1 in load and 2 in load:
        price = (
            f" (here {load[2] * 1000:.1f} ms a step against {load[1] * 1000:.1f} ms for one token: decoding runs at "
            f"about {load[1] / load[2]:.2f}x a daemon without a drafter, drafting or not)"
        )
    log.warning(
        "exact steps on: %s is not batch-invariant here, so every step reads two positions, with a drafter "
        "or without one (a daemon with a drafter and one without then write the same text)%s. "
        "A K-quant or Q4_1 target is usually batch-invariant and decodes one token a step; "
        "--exact off gives one-token steps back, and with them greedy output that can change with drafting, "
        "jump-forward and the daemon's drafter at near-ties",
        config.model_name,
        price,
    )


LOOKUP_STEP_SECONDS = 2e-5  # a prompt-lookup or suffix draft: a few dict lookups in Python


def pass_costs(model, config: WorkerConfig, min_batch: int):
    """What this machine's target passes over 1 ... k+1 tokens cost, measured now
    (a second or two), with a prior for the drafter's step: the n-gram drafter's
    is Python lookups; a model drafter's, the target's one-token pass scaled by
    the two files' sizes (a decode step reads every weight once). None when the
    context is too small to measure in (the governors then measure only)."""
    from ..drafting.governor import PassCosts, measure_pass_costs, measure_read_cost

    started = time.perf_counter()
    widths = range(1, max(config.draft_tokens, 1) + 2)
    read = None
    try:
        load = measure_pass_costs(model, widths)
    except Exception as exc:  # never a reason not to serve: the governors measure instead
        log.warning(
            "could not measure the target's pass costs (%s: %s); the governor only measures", type(exc).__name__, exc
        )
        return None
    if not load:
        return None
    if config.drafter == "model":  # what a prompt token costs to read: a model drafter's catch-up is priced from it
        try:
            read = measure_read_cost(model)
        except Exception as exc:  # the pass costs stand: catch-ups are priced from the widest pass instead
            log.warning("could not measure a prompt read (%s: %s)", type(exc).__name__, exc)
    if config.drafter == "model" and config.drafter_bytes > 0:
        drafter = load[1] * config.drafter_bytes / max(model.size_bytes, 1)
    else:
        drafter = LOOKUP_STEP_SECONDS
    costs = PassCosts(load, drafter, plain_width=min_batch, read=read)
    log.info(
        "target pass costs (%.1f s to measure): %s; drafter step prior %.1f ms%s",
        time.perf_counter() - started,
        ", ".join(f"{w} tok {v * 1000:.1f} ms" for w, v in load.items()),
        drafter * 1000,
        f"; a prompt read at {read * 1000:.1f} ms a token, so a drafter catching up at "
        f"{costs.read_prior() * 1000:.1f} ms a token"
        if read is not None
        else "",
    )
    return costs


BUSY_SHARE = 0.25  # of every core's time: other processes using more keep the machine busy (machine_busy)
BUSY_SAMPLE_SECONDS = 0.05


def machine_busy() -> bool:
    """Whether other processes are using more than BUSY_SHARE of the time of the
    cores this worker may run on (sampled over BUSY_SAMPLE_SECONDS, while it
    idles): another tandem daemon decoding, a build. Idle-time work that would
    compete with them, and measure passes slowed by them, waits. (In a container
    the kernel reports the host's cores: other tenants count too.)"""
    per_core = psutil.cpu_percent(interval=BUSY_SAMPLE_SECONDS, percpu=True)
    mine = [per_core[c] for c in os.sched_getaffinity(0) if c < len(per_core)] or per_core
    return sum(mine) / max(len(mine), 1) > BUSY_SHARE * 100


STEP_PATHS = ("verify", "one_token")  # the probe's paths that decoding steps take (the rest: reading prompts)


def probe(model, config: WorkerConfig, info: ModelInfo) -> None:
    """The batch-invariance probe's verdict into ``info``, logged with its fix.

    With fast prefill (mixed kernels, after ``check_fast_prefill``) prompts are
    exact by their chunks, whatever the probe says of reading them another way:
    only the steps' paths are judged."""
    started = time.perf_counter()
    try:
        paths = probe_batch_invariance(model, config)
    except Exception as exc:  # a failed probe must not stop the daemon: the verdict is unknown
        log.warning("the batch-invariance probe failed (%s: %s); exactness unknown", type(exc).__name__, exc)
        paths = {}
    # (jump-forward for constrained output runs several tokens in a pass too, drafter or not)
    judged = {k: v for k, v in paths.items() if k in STEP_PATHS} if model.prefill_chunk else dict(paths)
    judged.pop("exact_steps", None)  # (what exact mode's steps rest on: judged apart, draft_off_reason)
    info.batch_invariant = all(judged.values()) if paths else None
    info.batch_variant_paths = [name for name, same in judged.items() if not same]
    if paths.get("exact_steps") is False:
        info.batch_variant_paths.append("exact_steps")
    if info.batch_invariant:
        verdict = "every path that applies gives identical logits"
    elif info.batch_invariant is None:
        verdict = "no verdict (the context is too small to probe in, or the probe failed)"
    else:
        verdict = "logits differ on " + ", ".join(info.batch_variant_paths)
    log.info("batch-invariance probe (%.2f s): %s", time.perf_counter() - started, verdict)
    if info.batch_invariant is False:
        log.warning(
            "%s is not batch-invariant on this CPU with these settings (kernels=%s, flash_attn=%s, "
            "extra_buffers=%s): at near-ties greedy output can depend on the prefix cache and on drafting. %s",
            config.model_name,
            config.settings.kernels,
            "on" if config.settings.flash_attn else "off",
            "on" if model.extra_buffers else "off",
            invariance_fix(config, model),
        )


def check_fast_prefill(model, info: ModelInfo, config: Optional[WorkerConfig] = None) -> None:
    """Fast prefill (--kernels mixed) only where it measures exact here; else the
    reference kernels read prompts too, with a warning. The verdicts are kept
    beside the batch-invariance probe's (``config.probe_cache``)."""
    if not model.prefill_chunk:
        if info.kernels == "mixed":  # (the context had no CPU backend whose kernels can be switched)
            info.kernels = "reference"
        slow_prompts(model)
        return
    try:
        name = f"fast_prefill chunk={model.prefill_chunk}{' reader' if model.reader is not None else ''}"
        exact = kept_check(model, config, name, model.fast_prefill_is_exact)
    except Exception as exc:  # never a reason not to serve: read prompts the slow, exact way
        log.warning("the fast-prefill check failed (%s: %s)", type(exc).__name__, exc)
        exact = False
    if exact is False and model.reader is not None:  # (not the reader's fault alone, maybe: checked without it)
        log.warning("the fast-prefill check failed with the prompt reader; prompts are read without it")
        model.drop_prompt_reader()
        return check_fast_prefill(model, info, config)
    if exact is None:
        log.warning(
            "fast prefill is off: the context (%d tokens) is too small to check it in; prompts are read with "
            "the reference kernels (as --kernels reference)",
            model.n_ctx,
        )
    elif exact is False:
        log.warning(
            "fast prefill is off: a prompt read in %d-token chunks gave other logits when part of it was "
            "kept from another request; prompts are read with the reference kernels (as --kernels reference)",
            model.prefill_chunk,
        )
    if not exact:
        model.prefill_chunk = 0
        info.kernels = "reference"
    else:
        check_prefill_grouping(model, config)
        log.info(
            "fast prefill: prompts read in %d-token chunks with fast kernels, up to %d tokens per pass",
            model.prefill_chunk,
            model.prefill_group,
        )
    if not model.prefill_chunk:
        model.drop_prompt_reader()  # (prompts are read by steps, here)
    info.prefill_chunk = model.prefill_chunk
    info.prompt_reader = model.reader is not None
    slow_prompts(model)


def choose_prompt_reader(model, config: WorkerConfig) -> None:
    """--prompt-reader auto: keep the second context that reads prompts over the
    weights not repacked (``LlamaModel.add_prompt_reader``) only where a prompt
    pass measures at least 10% faster with it and its KV cache fits in what
    --kv-budget leaves beside the caches the context was sized for. The reader
    computes a prompt's KV in other bits than the repacked weights do, so the
    speed verdict is kept for the machine (``machine_kept_check``): the first
    one stands for every daemon of this user, whatever its state directory."""
    if model.reader is None:
        if config.settings.prompt_reader == "on" and model.repacked:
            log.warning("--prompt-reader on: no reader (fast prefill is off, or llama.cpp could not create one)")
        return
    kv = reader_kv_bytes(model)
    if config.settings.prompt_reader == "auto":
        if 0 <= config.kv_room < kv:  # (before measuring its speed: seconds of prompt passes)
            log.info(
                "prompts are read over the repacked weights: a prompt reader's KV cache (%s at %d tokens) does not "
                "fit in what --kv-budget leaves (%s): raise --kv-budget, or --prompt-reader on",
                mib(kv),
                model.n_ctx,
                mib(config.kv_room),
            )
            model.drop_prompt_reader()
            return
        try:
            name = f"prompt_reader faster chunk={model.prefill_chunk} group={model.prefill_group}"
            faster = machine_kept_check(model, config, name, model.prompt_reader_pays)
        except Exception as exc:  # never a reason not to serve: read prompts here
            log.warning("measuring the prompt reader failed (%s: %s)", type(exc).__name__, exc)
            faster = False
        if not faster:
            log.info("prompts are read over the repacked weights: reading them over the file's was not faster here")
            model.drop_prompt_reader()
            return
    log.info(
        "prompts are read by a second context over the weights not repacked (--prompt-reader %s; its KV cache: "
        "%s more); steps over the repacked ones",
        config.settings.prompt_reader,
        mib(kv) if kv else "unknown",
    )


def reader_kv_bytes(model) -> int:
    """The prompt reader's KV cache at the model's context: one more of the model's own (0: not known)."""
    try:
        return model.n_ctx * kv_bytes_per_token(read_metadata(model.path), model.kv_type)
    except (ContextError, GGUFError, OSError, KeyError):
        return 0


def slow_prompts(model) -> None:
    """Without fast prefill, prompts are read by steps: over repacked weights, 3 rows a pass."""
    if not model.prefill_chunk and model.step_rows:
        log.warning(
            "prompts are read %d tokens per pass (steps over repacked weights, without fast prefill): "
            "--extra-buffers off reads them many times faster here",
            model.step_rows,
        )


def check_prefill_grouping(model, config: Optional[WorkerConfig] = None) -> None:
    """Several whole chunks per pass only where a chunk's KV measures the same
    read alone or with the chunks around it (at the largest group the context
    can check); else one chunk per pass, with a note."""
    group = model.checkable_group()
    try:
        if group:
            model.prefill_group = group
        name = f"grouping chunk={model.prefill_chunk} group={group}{' reader' if model.reader is not None else ''}"
        grouped = kept_check(model, config, name, model.prefill_grouping_is_exact) if group else None
    except Exception as exc:  # one chunk per pass is always exact
        log.warning("the prefill-grouping check failed (%s: %s)", type(exc).__name__, exc)
        grouped = False
    if grouped is False:
        log.info(
            "prompts are read one %d-token chunk per pass: here a chunk read with the next one gave other "
            "logits than read alone (prefill is slower, output is as exact)",
            model.prefill_chunk,
        )
    if not grouped:  # (None: the context is too small to check a group in)
        model.set_prefill_group(model.prefill_chunk)


def governor_keys(config: WorkerConfig, placed: str, step_rows: int = 0) -> tuple[str, Optional[Path]]:
    """The governor state's identity and file: the daemon's (models, draft length,
    kernels), where the target's layers are when not all on the CPU (``placed``,
    devices.Placement.key: speeds measured on a GPU are not the CPU's), and the
    rows per pass of a step over repacked weights (``step_rows``: a verify pass
    then costs about a step per row). Each of those keeps its own file."""
    from ..drafting.governor import state_file

    path = Path(config.governor_state) if config.governor_state else None
    extra = " ".join(part for part in (placed, f"step_rows={step_rows}" if step_rows else "") if part)
    if not extra:
        return config.governor_identity, path
    identity = f"{config.governor_identity} {extra}"
    return identity, state_file(path.parent, identity) if path is not None else None


def page_store(model, config: WorkerConfig, identity: str, disk_identity: str = ""):
    """The target's view of the daemon's prefix-cache arena (None: no prefix cache)."""
    if not config.cache_shm:
        return None
    from ..cache.arena import index_path
    from ..cache.page_store import PageStore, map_arena
    from ..cache.prefix_cache import ExtentAllocator, PageTree

    try:
        arena = map_arena(config.cache_shm, config.cache_bytes)  # a memoryview of it keeps it mapped
    except OSError as exc:
        log.warning("no prefix cache in this worker: cannot use the arena %s (%s)", config.cache_shm, exc)
        return None
    tree = PageTree(config.settings.page_tokens, ExtentAllocator(config.cache_bytes))
    store = PageStore(tree, memoryview(arena), model)
    store.probe_layout()
    # pages hold KV as these kernels computed it: valid for the same model file and kernels only
    computed = (
        f"kernels={config.settings.kernels} cpu_kernels={in_use()} prefill_chunk={model.prefill_chunk} "
        f"step_rows={model.step_rows} "
        f"extra_buffers={'on' if model.extra_buffers else 'off'}"
        + (" prompt_reader=on" if model.reader is not None else "")  # (prompt KV from the weights not repacked)
    )
    store.model_identity = f"{identity} {computed}"
    kept, dropped = store.load_index(index_path(config.cache_shm))
    if kept or dropped:
        log.info(
            "prefix cache: %d pages kept from the previous worker (%d dropped: evicted or overwritten since)",
            kept,
            dropped,
        )
    if disk_identity:
        # files outlive this daemon: also the llama.cpp build, its CPU features and the weights' layout, which
        # a later start (an upgrade, another setting, a home directory shared with another machine) may change
        version, features = model.runtime()
        runtime = f"llama.cpp={version} extra_buffers={model.extra_buffers} cpu={features.strip()}"
        store.disk = disk_tier(store, config, f"{disk_identity} {computed} {runtime}")
    return store


def disk_dir(config: WorkerConfig) -> Path:
    from ..cache.disk_cache import default_dir

    return config.settings.disk_cache_dir or default_dir()


def disk_tier(store, config: WorkerConfig, identity: str):
    """The prefix cache's disk tier for this model (None: off, or unusable, with a warning)."""
    from ..cache.disk_cache import DiskTier, disk_budget

    root = disk_dir(config)
    budget = disk_budget(config.settings.disk_cache_bytes, root)
    if budget <= 0:
        return None
    page_bytes = store.layout.page_bytes(store.page_tokens)
    disk = DiskTier.open(root, identity, repr(store.layout), store.page_tokens, page_bytes, budget)
    if disk is not None:
        log.info(
            "prefix cache disk tier: %s, %d pages (%d MiB of %d MiB)",
            disk.path,
            len(disk.entries),
            disk.bytes_used >> 20,
            budget >> 20,
        )
    return disk


class TargetLoop:
    def __init__(self, config: WorkerConfig, sock: zmq.Socket):
        self.config = config
        self.sock = sock
        self.stopping = False
        self.settle_due = False  # the last request left KV to settle in idle time (see _settle)
        self.refresh_due = False  # a request ran: the target's passes may be re-measured in idle time
        self.cancelled: set[str] = set()
        self.engine: Optional[Engine] = None
        self.last_beat = 0.0
        self.current = ""  # the request being served
        self.serving: Optional[Decoding] = None  # ... and the one _serve took (a short one's host, for the lane)
        self.waiting: Optional[Decoding] = None  # a short request the daemon sent while another runs (the lane)
        self.waiting_held = False  # ... that waits for the running one to end (its KV was too large to copy)
        self.waiting_since = 0.0  # ... since then (its wait here is part of its queued_seconds)
        self.drafter_died = False  # the drafter died while the current request was served
        self.narrow_drafted = self.narrow_accepted = 0  # a 4-bit drafter's first drafts (reported once)
        self.narrow_reported = False
        self.handlers: dict[type, Callable] = {
            Shutdown: self._shutdown,
            Cancel: lambda msg: None,  # nothing running: it finished before the cancel arrived
            DrafterState: self._drafter_state,
            CacheClear: self._clear_cache,
            Tokenize: self._tokenize,
            Detokenize: self._detokenize,
            Generate: self._serve,
            Complete: self._serve,
        }

    def send(self, msg) -> None:
        self.sock.send_multipart(encode(msg))

    def run(self) -> None:
        try:
            self.engine, info = load_engine(self.config, self._drafter())
        except Exception as exc:
            self.send(Error.of(self.config.role, ErrorCode.NOT_READY, f"could not load the model: {exc}"))
            return
        engine = self.engine
        self.send(
            Ready(
                id=self.config.role,
                model=info,
                pid=os.getpid(),
                governor=engine.governors.info() if engine.governors is not None else None,
                cache=engine.cache.info() if engine.cache is not None else None,
            )
        )
        while not self.stopping:
            cache = engine.cache
            if self.waiting is not None:  # sent within a request that ended before it could be served: next
                msg, self.waiting, self.waiting_held = self.waiting, None, False
                self._serve(msg, sent_within=True, held=self._held())
                continue
            if self.settle_due and not self.sock.poll(0, zmq.POLLIN):
                self.settle_due = False  # once per request: what it left is settled, or a request came
                self._settle()
                continue
            if self.refresh_due and not self.sock.poll(0, zmq.POLLIN):
                self.refresh_due = False  # (after settling: a next turn's pages first)
                self._refresh_pass_costs()
                continue
            if cache is not None and cache.disk_pending and not self.sock.poll(0, zmq.POLLIN):
                self._spill(cache)  # between requests, a page at a time: nothing waits for it
                continue
            try:
                msg = decode(self.sock.recv_multipart(), table=WORKER_REQUESTS)
            except ProtocolError as exc:  # the daemon validated it; this is a bug
                log.error("undecodable message from the daemon: %s", exc.message)
                continue
            handler = self.handlers.get(type(msg))
            if handler is None:
                log.error("unexpected %s message from the daemon", msg.op.value)
                continue
            handler(msg)
        cache = engine.cache
        if cache is not None and cache.disk_pending:  # stopping: the pages not on disk yet, for a while
            deadline = time.monotonic() + SHUTDOWN_SPILL_SECONDS
            while cache.to_disk and time.monotonic() < deadline:
                self._spill(cache, report=False)
            if cache.to_disk:
                log.info("prefix cache disk tier: %d pages left unwritten at shutdown", len(cache.to_disk))
                cache.to_disk.clear()
            self._spill(cache, report=False)  # (the index of what was written)

    def _drafter(self) -> Optional[Drafter]:
        kind = self.config.drafter
        if kind == "ngram":
            from ..drafting.ngram import NgramDrafter

            return NgramDrafter()
        if kind == "suffix":
            from ..drafting.suffix import SuffixDrafter

            return SuffixDrafter()
        if kind == "model":
            from ..drafting.drafter_client import ModelDrafterClient

            timeout = self.config.settings.worker_timeout
            client = ModelDrafterClient(self.sock.context, self.config.draft_endpoint, timeout=timeout)
            client.on_wait = lambda: self._poll_cancel(self.current)  # heartbeats, and cancels, while it waits
            # a drafter that does not answer: the daemon kills and restarts it
            client.on_broken = lambda why: self.send(DrafterHung(id=self.current, message=why))
            return client
        return None

    def _shutdown(self, msg: Shutdown) -> None:
        self.stopping = True

    def _serve(self, msg, sent_within: bool = False, held: float = 0.0) -> None:
        """``held``: the seconds a request sent within the one before waited here (in its queued_seconds)."""
        engine = self.engine
        assert engine is not None
        # a cancel of a request sent within the one before (the lane) is due to it
        self.cancelled &= {msg.id} if sent_within else set()
        self.serving = msg
        self.current = msg.id
        self.drafter_died = False
        self.last_beat = time.monotonic()
        self.send(Progress(id=msg.id))  # at once: the first prefill batch may take a while
        try:
            done = engine.run(msg, self.send, lambda: self._poll_cancel(msg.id), self._lend)
            done.drafter_died = self.drafter_died  # it finished plainly: say so
            done.timings.queued_seconds = held  # (the daemon adds its own queue's)
            if engine.cache is not None:
                # before the reply (a few ms in tmpfs): once a request is answered,
                # its pages survive this worker being killed
                self._save_cache_index()
            self.send(done)
            # (not after fill in the middle: an editor's next request changes the text at the cursor, not
            # after the reply, so the reply read again would never be reused)
            self.settle_due = engine.cache is not None and not getattr(msg, "suffix", "")
            self.refresh_due = engine.governors is not None and engine.governors.costs is not None
            self._report_narrow_drafter(done)
            if done.governor is not None and engine.governors is not None:
                engine.governors.save()  # after the reply: a few ms of disk never delay it
        except RequestError as exc:
            self.send(Error.of(msg.id, exc.code, exc.message))
        except Exception as exc:  # a bug or a llama.cpp failure: report it, keep serving
            log.exception("request %s failed", msg.id)
            self.send(Error.of(msg.id, ErrorCode.INTERNAL, f"the worker failed: {type(exc).__name__}: {exc}"))
        finally:
            self.current = ""  # between requests: a drafter's death concerns none

    def _held(self) -> float:
        """The seconds the short request waiting here has waited (part of its queued_seconds)."""
        return time.monotonic() - self.waiting_since

    def _lend(self) -> bool:
        """Between two rounds of the running request: serve the short request the
        daemon sent meanwhile, if any (``Engine.run_within``); True when one was served.
        If the running request's KV cannot be put back, the short one is answered
        with an error and the running one ends with one (ResumeFailed goes up)."""
        short = self.waiting
        if short is None or self.waiting_held:
            return False
        self.waiting = None
        held = self._held()
        outer, died = self.current, self.drafter_died
        self.current = short.id
        self.send(Progress(id=short.id))
        engine = self.engine
        try:
            private = not self.serving.cache  # the running request's KV is not for the short one's prompt
            done = engine.run_within(short, self.send, lambda: self._poll_cancel(short.id), private)
            if done is None:  # the running request's KV is too large to copy now: served after it
                log.info("request %s waits for %s to end: its KV state is too large to copy", short.id, outer)
                self.waiting, self.waiting_held = short, True
                return False
            done.timings.queued_seconds = held  # its wait for this round's end (the daemon adds its queue's)
            if engine.cache is not None:
                self._save_cache_index()  # (as _serve: once answered, its pages survive this worker)
            self.send(done)
        except ResumeFailed as exc:
            self.send(Error.of(short.id, ErrorCode.INTERNAL, f"the worker failed: {exc}"))
            raise
        except RequestError as exc:
            self.send(Error.of(short.id, exc.code, exc.message))
        except Exception as exc:  # a bug or a llama.cpp failure: report it; the running request goes on
            log.exception("request %s failed", short.id)
            self.send(Error.of(short.id, ErrorCode.INTERNAL, f"the worker failed: {type(exc).__name__}: {exc}"))
        finally:
            self.current, self.drafter_died = outer, died or self.drafter_died
            self.cancelled.discard(short.id)
        return True

    def _cancel_waiting(self) -> None:
        """The short request the worker holds (not started) was cancelled: answered now."""
        short, self.waiting, self.waiting_held = self.waiting, None, False
        self.cancelled.discard(short.id)
        self.send(Done.cancelled(short.id, queued_seconds=self._held()))

    def _report_narrow_drafter(self, done) -> None:
        """A drafter of 4 bits or fewer: once it has drafted enough to say, log the
        acceptance it gets here (the warning at start could only cite others')."""
        from ..models import NARROW_PREFIXES

        q = self.config.drafter_quantization
        if self.narrow_reported or not q.startswith(NARROW_PREFIXES) or done.draft is None:
            return
        self.narrow_drafted += done.draft.drafted
        self.narrow_accepted += done.draft.accepted
        if self.narrow_drafted >= NARROW_REPORT_DRAFTS:
            self.narrow_reported = True
            log.warning(
                "the %s drafter's acceptance here: %.2f over its first %d drafts; an 8-bit file of the same "
                "model usually keeps more",
                q,
                self.narrow_accepted / self.narrow_drafted,
                self.narrow_drafted,
            )

    def _tokenize(self, msg: Tokenize) -> None:
        engine = self.engine
        try:
            if msg.messages is not None:  # rendered exactly as generate renders them (tools included)
                req = Generate(
                    id=msg.id,
                    messages=msg.messages,
                    tools=msg.tools,
                    tool_choice=msg.tool_choice,
                    max_tokens=1,
                    think=msg.think,
                    reasoning_effort=msg.reasoning_effort,
                    max_thinking_tokens=msg.max_thinking_tokens,
                )
                req.check()
                tokens = engine.prompt_tokens(req, engine.tool_plan(req), check_fits=False)  # a count
            else:
                tokens = engine.model.tokenize(msg.text, add_special=msg.add_special, parse_special=msg.parse_special)
            pieces = [engine.model.piece(t).decode("utf-8", "replace") for t in tokens] if msg.with_pieces else []
            self.send(Tokenized(id=msg.id, tokens=list(tokens), pieces=pieces))
        except RequestError as exc:
            self.send(Error.of(msg.id, exc.code, exc.message))
        except ValueError as exc:
            self.send(Error.of(msg.id, ErrorCode.INVALID_REQUEST, f"tokenize: {exc}"))
        except Exception as exc:  # a bug: report it, keep serving
            log.exception("tokenize %s failed", msg.id)
            self.send(Error.of(msg.id, ErrorCode.INTERNAL, f"the worker failed: {type(exc).__name__}: {exc}"))

    def _detokenize(self, msg: Detokenize) -> None:
        model = self.engine.model
        bad = next((t for t in msg.tokens if not 0 <= t < model.n_vocab), None)
        if bad is not None:
            why = f"detokenize: token {bad} is not in the vocabulary (0 to {model.n_vocab - 1})"
            self.send(Error.of(msg.id, ErrorCode.INVALID_REQUEST, why))
            return
        text = b"".join(model.piece(t) for t in msg.tokens).decode("utf-8", "replace")
        self.send(Detokenized(id=msg.id, text=text))

    def _settle(self) -> None:
        """Between requests: the last request's partial chunk and reply, read again
        in whole chunks into prefix-cache pages, for a next turn that re-sends them
        (see LlamaModel.settle); a request that arrives meanwhile stops it."""
        engine = self.engine
        try:
            settled = engine.settle(lambda: bool(self.sock.poll(0, zmq.POLLIN)))
        except Exception:  # a bug: the next turn reads those chunks itself, as it did before
            log.exception("settling the last request's KV failed")
            return
        if settled < 0:
            self.settle_due = True  # a message came first: again once it is answered (a request resets it)
        elif settled and engine.cache is not None:
            self._save_cache_index()  # (the pages it stored outlive this worker, as a request's do)
            if not engine.cache.disk_pending:
                self.send(CacheState(id=self.config.role, cache=engine.cache.info()))

    def _refresh_pass_costs(self) -> None:
        """Between requests: the governors' pass costs re-measured (Engine.refresh_pass_costs);
        a request that arrives meanwhile stops it."""
        try:
            self.engine.refresh_pass_costs(lambda: bool(self.sock.poll(0, zmq.POLLIN)), machine_busy)
        except Exception:  # a bug: the pass costs stay as rounds keep them
            log.exception("re-measuring the target's passes failed")

    def _spill(self, cache, report: bool = True) -> None:
        try:
            if not cache.spill() and report:  # done: the daemon's status shows it from now on
                self.send(CacheState(id=self.config.role, cache=cache.info()))
        except Exception as exc:  # a bug: the disk tier stops, requests go on (and never spins on it)
            log.exception("prefix cache disk tier: writing a page failed")
            cache.to_disk.clear()
            if cache.disk is not None:
                cache.disk.turn_off(f"{type(exc).__name__}: {exc}")

    def _clear_cache(self, msg: CacheClear) -> None:
        self.engine.forget_live()  # nothing the requests before left is reused after a clear
        cache = self.engine.cache
        if cache is None or cache.disk is None:  # no disk tier in this daemon: page files of earlier ones go too
            disk_pages, disk_bytes = self._clear_disk_dir() if not msg.memory_only else (0, 0)
        if cache is None:
            self.send(CacheCleared(id=msg.id, pages=0, bytes=0, disk_pages=disk_pages, disk_bytes=disk_bytes))
            return
        if cache.disk is None:
            pages, used, _, _ = cache.clear(memory_only=True)
        else:
            pages, used, disk_pages, disk_bytes = cache.clear(memory_only=msg.memory_only)
        self._save_cache_index()
        log.info(
            "prefix cache cleared: %d pages, %d bytes%s",
            pages,
            used,
            "" if msg.memory_only else f"; on disk {disk_pages} pages, {disk_bytes} bytes",
        )
        self.send(
            CacheCleared(
                id=msg.id, pages=pages, bytes=used, disk_pages=disk_pages, disk_bytes=disk_bytes, cache=cache.info()
            )
        )

    def _clear_disk_dir(self) -> tuple[int, int]:
        from ..cache.disk_cache import clear_dir

        try:
            pages, nbytes, _ = clear_dir(disk_dir(self.config))
        except OSError as exc:
            log.warning("prefix cache: could not remove the disk tier's page files: %s", exc)
            return 0, 0
        return pages, nbytes

    def _save_cache_index(self) -> None:
        from ..cache.arena import index_path

        try:
            self.engine.cache.save_index(index_path(self.config.cache_shm))
        except OSError as exc:
            log.warning("could not save the prefix-cache index (a restarted worker would start empty): %s", exc)

    def _poll_cancel(self, request_id: str) -> bool:
        """Between steps of a request: read what the daemon sent, and say we are alive."""
        now = time.monotonic()
        if now - self.last_beat >= min(HEARTBEAT_SECONDS, self.config.settings.worker_timeout / 4):
            self.last_beat = now
            self.send(Progress(id=request_id))
        while self.sock.poll(0, zmq.POLLIN):
            try:
                msg = decode(self.sock.recv_multipart(), table=WORKER_REQUESTS)
            except ProtocolError:
                continue
            if isinstance(msg, Cancel):
                self.cancelled.add(msg.request_id)
                if self.waiting is not None and msg.request_id == self.waiting.id:
                    self._cancel_waiting()
            elif isinstance(msg, Shutdown):
                self.stopping = True
            elif isinstance(msg, DrafterState):
                self._drafter_state(msg)
            elif isinstance(msg, (Generate, Complete)):  # a short request, for the lane (``_lend``)
                if self.waiting is None:
                    self.waiting, self.waiting_since = msg, time.monotonic()
                else:  # the daemon sends one at a time: a bug
                    why = "the worker holds a short request already"
                    self.send(Error.of(msg.id, ErrorCode.INTERNAL, why))
            elif isinstance(msg, (Tokenize, Detokenize)):
                # between two steps: a few ms at most, never queued behind the request (and alive meanwhile)
                self._tokenize(msg) if isinstance(msg, Tokenize) else self._detokenize(msg)
                self.send(Progress(id=request_id))
                self.last_beat = time.monotonic()
        return self.stopping or request_id in self.cancelled

    def _drafter_state(self, msg: DrafterState) -> None:
        drafter = self.engine.drafter if self.engine is not None else None
        if drafter is None:
            return
        if msg.available:
            log.info("the drafter worker is back; drafting again from the next request")
            drafter.revive()  # at the next request's start: never under a request that is waiting on it
        else:
            self.drafter_died = self.drafter_died or bool(self.current)
            drafter.go_down()  # until it is back: plain decoding (the running request goes on)
