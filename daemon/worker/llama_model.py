"""A thin driver for one llama.cpp model through llama-cpp-python's low-level API.

Only the calls tandem needs: load, tokenize, token pieces, and ``decode`` that
runs a batch of tokens and returns logits *only* for the positions asked for
(``Llama.eval``/``logits_all`` computes them for every position, which makes
long prefills minutes instead of seconds on a CPU).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import llama_cpp as llama
import numpy as np
from llama_cpp import _logger as llama_logger

from ..drafting.interfaces import DecodeAborted

log = logging.getLogger(__name__)


class ModelLoadError(Exception):
    pass


class DecodeError(Exception):
    pass


def default_threads() -> int:
    return max(1, os.cpu_count() or 1)


def cpu_has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " amx_int8" in f.read()
    except OSError:
        return False


def default_extra_buffers(reference_kernels: bool = True, fast_prefill: bool = False) -> bool:
    """llama.cpp's extra weight buffers (repacking, and AMX on Intel CPUs that
    have it): on where steps stay exact with them, off where AMX is present
    (the AMX matmul kernel segfaults on the first decode on an AMX-capable Xeon
    VM, llama-cpp-python 0.3.36, Q4_1).

    Repacked Q4_0/Q4_K/Q8_0 weights multiply 4 rows at a time (gemm) and a
    leftover row alone (gemv), which round differently; a pass of at most 3
    rows is all gemv, each row as a one-token step computes it. So: on with
    fast kernels (nothing is exact there anyway); on with ``--kernels mixed``
    (``fast_prefill``), whose steps run in passes of at most ``REPACK_STEP_ROWS``
    rows (``decode``); off with the reference kernels everywhere (a drafter's,
    and ``--kernels reference``, whose prompts are read by steps). Repacking decodes Q4_K a third faster on
    this machine's AVX-512 EPYC (Qwen2.5-Coder-1.5B: 26.8 against 36.7 ms a step)
    and reads prompts slower (148 against 246 tok/s), as llama-server does; the
    prompt reader (``add_prompt_reader``) gives the faster prompts back."""
    return (not reference_kernels or fast_prefill) and not cpu_has_amx()


# With extra buffers, steps (the reference kernels) run in passes of at most this many
# rows: repack.cpp's gemv, one row at a time, the kernel of a one-token step (from 4
# rows it multiplies 4 at a time, which rounds differently).
REPACK_STEP_ROWS = 3


# Fast prefill reads prompts in chunks of this many tokens: from 64 query rows
# ggml's flash attention tiles (its fastest path), and a longer chunk only adds
# to what a request whose prompt extends a cached one reads again.
PREFILL_CHUNK = 64
# ... and reads up to this many tokens of whole chunks in one llama_decode: where
# ggml's kernels compute rows apart, a position's KV is the same whether its chunk
# was read alone or with the chunks after it (``prefill_grouping_is_exact`` checks
# that at load), and one pass over 256 tokens reads a prompt faster than four of
# 64 (measured on the 2-core EPYC: Qwen2.5-Coder-1.5B 1.27x, SmolLM2 1.06-1.11x).
# A cancel waits for the pass it arrives in.
PREFILL_GROUP = 256

_REFERENCE_KERNELS = {"on": False, "hook": None, "set": None, "created": None}


def use_reference_kernels(on: bool) -> None:
    """Make llama.cpp CPU contexts created from now on use ggml's row-by-row
    kernels (``ggml_backend_cpu_set_use_ref``), so that a position's logits do
    not depend on how many tokens were decoded with it.

    ggml's CPU backend picks kernels by batch shape: flash attention is tiled for
    64 or more query rows and split across threads for one row over 512 or more
    KV cells; K-quant matmuls are tiled from 8 rows; ops are fused. Each rounds
    differently, so a prefix-cache restore, a verify pass or a one-token step can
    give other logits than one long prefill. ``use_ref`` turns those variants off
    (it is what llama.cpp's test-backend-ops compares against). llama.cpp has no
    API to set it on a context's backend, so this wraps the CPU device's
    ``init_backend`` (``struct ggml_backend_device_i``, 6th slot, pinned to the
    llama.cpp vendored in llama-cpp-python 0.3.36) to set it on every CPU
    backend the device creates. Whether it took effect is not assumed: the load
    probe (``LlamaModel.batch_invariance``) measures it."""
    _REFERENCE_KERNELS["on"] = bool(on)
    if _REFERENCE_KERNELS["hook"] is not None or not on:
        return
    _install_kernel_hook()


def _install_kernel_hook() -> None:
    """Wrap the CPU device's ``init_backend`` (see ``use_reference_kernels``): every
    CPU backend it creates gets the reference kernels while they are on, and is
    listed in ``_REFERENCE_KERNELS["created"]`` while a context is being created,
    so that its model can switch them per pass (``LlamaModel.prefill``)."""
    from ..models.devices import DeviceError, libs

    try:
        ggml = base = libs().ggml
    except DeviceError as exc:
        raise ModelLoadError(str(exc)) from None
    dev = ggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    if not dev or base.ggml_backend_dev_name(dev) != b"CPU":
        raise ModelLoadError("llama.cpp has no CPU device to set reference kernels on")
    set_ref_addr = base.ggml_backend_reg_get_proc_address(
        base.ggml_backend_dev_backend_reg(dev), b"ggml_backend_cpu_set_use_ref"
    )
    if not set_ref_addr:
        raise ModelLoadError("this llama.cpp has no ggml_backend_cpu_set_use_ref")
    set_ref = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_bool)(set_ref_addr)
    init_type = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)
    slot = ctypes.c_void_p.from_address(dev + 5 * ctypes.sizeof(ctypes.c_void_p))  # iface.init_backend
    original = init_type(slot.value)

    @init_type
    def init_backend(device, params):
        backend = original(device, params)
        if backend and _REFERENCE_KERNELS["on"]:
            set_ref(backend, True)
        if backend and _REFERENCE_KERNELS["created"] is not None:
            _REFERENCE_KERNELS["created"].append(backend)
        return backend

    _REFERENCE_KERNELS["hook"] = (init_backend, original)  # kept alive: llama.cpp holds the pointer
    _REFERENCE_KERNELS["set"] = set_ref
    slot.value = ctypes.cast(init_backend, ctypes.c_void_p).value


SETTLE_MAX_STATE = 256 * 2**20  # bytes: a KV state larger than this is not copied to settle it


class LlamaModel:
    def __init__(
        self,
        path: Path | str,
        n_ctx: Optional[int] = None,
        n_threads: Optional[int] = None,
        n_batch: int = 512,
        flash_attn: bool = True,
        max_ctx: int = 8192,
        extra_buffers: Optional[bool] = None,
        reference_kernels: bool = True,
        fast_prefill: bool = False,
        prefill_chunk: int = PREFILL_CHUNK,
        settle: bool = False,
        gpu_layers: int = 0,
        devices: Optional[Sequence[str]] = None,
        prompt_reader: bool = False,
    ):
        self.path = Path(path)
        self.gpu_layers = int(gpu_layers)  # llama.cpp's n_gpu_layers: -1 all, N, 0 none
        self.device_names = list(devices or [])  # [] = llama.cpp's choice (every GPU and RPC device)
        self.can_settle = settle and fast_prefill  # see ``settle``
        llama_logger.set_verbose(False)
        llama.llama_backend_init()
        if extra_buffers is None:
            extra_buffers = default_extra_buffers(reference_kernels, fast_prefill)
        self.extra_buffers = extra_buffers
        self._load_model()
        self.n_ctx_train = int(llama.llama_model_n_ctx_train(self.model))
        self.n_ctx = int(n_ctx) if n_ctx else min(self.n_ctx_train, max_ctx)
        self.n_batch = min(n_batch, self.n_ctx)
        self.n_threads = n_threads or default_threads()
        self.flash_attn = flash_attn
        self.reference_kernels = reference_kernels or fast_prefill
        # rows per llama_decode of a step, with fast prefill (the target with --kernels mixed, whose
        # steps must agree): repacked weights (llama.cpp's CPU_REPACK buffer, which it fills only for
        # the types it repacks: Q4_0, Q4_K, Q8_0, ...) compute at most REPACK_STEP_ROWS rows as a
        # one-row step does (0: no limit but n_batch; a drafter's steps need not agree)
        repacked = any("REPACK" in name for name in self.placement.weights)
        self.step_rows = REPACK_STEP_ROWS if repacked and fast_prefill else 0
        self._fast = False  # a prefill's fast kernels are on (``_use_reference``)
        use_reference_kernels(self.reference_kernels)
        # fast prefill: prompts read with fast kernels, in chunks of this many tokens from position 0 (0: off)
        self.prefill_chunk = max(int(prefill_chunk), 1) if fast_prefill else 0
        self.prefill_group = self.prefill_chunk  # tokens of whole chunks one pass reads (set_prefill_group)
        self.fixed_upto = 0  # KV positions [0, fixed_upto) were read in whole chunks by ``prefill``
        # the state before ``settle`` (blob, n_past, history, fixed_upto, prefilled), until the next request
        self._before_settle: Optional[tuple] = None
        self._prefilled: Optional[tuple[int, np.ndarray]] = None  # (prompt length, logits after it) of the last one
        self._cpu_backends: list[int] = []
        self._create_context(flash_attn)
        self._batch = llama.llama_batch_init(self.n_batch, 0, 1)
        self._pieces: dict[int, bytes] = {}
        self.n_past = 0  # tokens in the KV cache of sequence 0
        # the tokens at those positions (-1: unknown), so a next request can keep the prefix it shares
        self.history: list[int] = []
        # prompts read by a second context over the weights as the file has them (see ``add_prompt_reader``)
        self.reader: Optional["LlamaModel"] = None
        self._reader_same = 0  # KV positions from 0 the reader holds as this context does
        self._state_buf: Optional[np.ndarray] = None  # reused to copy KV state between the two contexts
        self.set_prefill_group(PREFILL_GROUP)
        if prompt_reader:
            self.add_prompt_reader()

    # ------------------------------------------------------------------ setup

    def _load_model(self) -> None:
        if not self.path.is_file():
            raise ModelLoadError(f"model file not found: {self.path}")
        from ..models.devices import DeviceError, LoadLog, select_devices

        params = llama.llama_model_default_params()
        params.use_extra_bufts = self.extra_buffers
        params.n_gpu_layers = self.gpu_layers
        if self.device_names:
            try:
                chosen = select_devices(self.device_names)
            except DeviceError as exc:
                raise ModelLoadError(str(exc)) from None
            params.devices = ctypes.addressof(chosen)  # kept alive by `chosen` until the load returns
        with LoadLog() as load_log:
            self.model = llama.llama_model_load_from_file(os.fsencode(self.path), params)
        self.placement = load_log.placement()
        if not self.model:
            why = "; ".join(self.placement.errors[-3:]) or "is it a GGUF model file?"
            raise ModelLoadError(f"llama.cpp could not load {self.path}: {why}")
        self.vocab = llama.llama_model_get_vocab(self.model)
        self.n_vocab = int(llama.llama_vocab_n_tokens(self.vocab))
        self.size_bytes = self.path.stat().st_size
        # a recurrent (or hybrid) model's cache asked to drop its last position alone erases the whole
        # sequence and reports success: nothing may add one position only to drop it again
        self.drops_one_position = not (
            llama.llama_model_is_recurrent(self.model) or llama.llama_model_is_hybrid(self.model)
        )

    def _create_context(self, flash_attn: bool) -> None:
        params = llama.llama_context_default_params()
        params.n_ctx = self.n_ctx
        params.n_batch = self.n_batch
        params.n_ubatch = self.n_batch
        params.n_seq_max = 1
        params.n_threads = self.n_threads
        params.n_threads_batch = self.n_threads
        params.no_perf = True
        params.flash_attn_type = (
            llama.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else llama.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        _REFERENCE_KERNELS["created"] = []
        try:
            self.ctx = llama.llama_init_from_model(self.model, params)
        finally:
            self._cpu_backends, _REFERENCE_KERNELS["created"] = _REFERENCE_KERNELS["created"] or [], None
        if self.prefill_chunk and not (self._cpu_backends and _REFERENCE_KERNELS["set"]):
            log.warning("fast prefill is off: llama.cpp created no CPU backend whose kernels can be switched")
            self.prefill_chunk = 0
        if not self.ctx:
            raise ModelLoadError(
                f"llama.cpp could not create a context of {self.n_ctx} tokens for {self.path.name}; "
                "try a smaller --ctx-size"
            )
        self.memory = llama.llama_get_memory(self.ctx)

    def add_prompt_reader(self) -> bool:
        """Read prompts (``prefill``) with a second context over this file's weights
        as they are, not repacked, and copy its KV state into this one; steps stay
        here, on the repacked weights. Only with fast prefill over repacked weights
        (``step_rows``): llama.cpp's repacked Q4_K multiplies many rows slower than
        its plain kernels on some CPUs (the 2-core EPYC: Qwen2.5-Coder-1.5B reads a
        prompt in 0.63-0.82x the time), and one row faster. Both contexts map the
        same file, so the second costs its KV cache and compute buffers, not the
        weights again. Every prompt position's KV is then the reader's, in the same
        chunks, wherever it was read: what exact output rests on holds (the load
        checks measure it through ``prefill``). Returns whether there is one."""
        if self.reader is not None:
            return True
        if not (self.step_rows and self.prefill_chunk) or self.placement.key():  # (not with layers offloaded)
            return False
        try:
            self.reader = LlamaModel(
                self.path,
                n_ctx=self.n_ctx,
                n_threads=self.n_threads,
                n_batch=self.n_batch,
                flash_attn=self.flash_attn,
                extra_buffers=False,
                fast_prefill=True,
                prefill_chunk=self.prefill_chunk,
            )
        except ModelLoadError as exc:  # (a second KV cache that does not fit): prompts read here, as before
            log.warning("no prompt reader: %s", exc)
            return False
        if not self.reader.prefill_chunk:  # (its context had no CPU backend whose kernels can be switched)
            self.drop_prompt_reader()
            return False
        self._reader_same = 0
        return True

    def prompt_reader_pays(self, margin: float = 1.1) -> Optional[bool]:
        """Does the reader read a prompt at least ``margin`` times faster than this
        context? A pass of up to 128 tokens each way, twice, alternating (the
        faster of each). None without a reader or room to measure. Leaves the
        caches empty."""
        reader = self.reader
        n = min(self.prefill_group, 128) // self.prefill_chunk * self.prefill_chunk if reader is not None else 0
        if not n or self.n_ctx <= n:
            return None
        tokens = self.tokenize("The lighthouse keeper climbed the stairs every evening. " * 40, add_special=True)[:n]
        times: dict[bool, list[float]] = {False: [], True: []}
        try:
            for _ in range(2):
                for use in (False, True):
                    self.reader = reader if use else None
                    self.clear()
                    started = time.perf_counter()
                    self.prefill(tokens)
                    times[use].append(time.perf_counter() - started)
        finally:
            self.reader = reader
            self.clear()
            reader.clear()
        log.info(
            "a %d-token prompt pass: %.0f ms over the repacked weights, %.0f ms by the reader",
            n,
            min(times[False]) * 1000,
            min(times[True]) * 1000,
        )
        return min(times[False]) > margin * min(times[True])

    def drop_prompt_reader(self) -> None:
        """Back to reading prompts in this context."""
        reader, self.reader, self._reader_same, self._state_buf = self.reader, None, 0, None
        if reader is not None:
            reader.close()

    def _copy_state(self, source: "LlamaModel", target: "LlamaModel") -> None:
        """``target``'s sequence 0 replaced by ``source``'s KV (its positions,
        history and what of it was read in whole chunks), through a reused buffer."""
        size = llama.llama_state_seq_get_size(source.ctx, 0)
        if self._state_buf is None or len(self._state_buf) < size:  # (grown by half again: a chat grows)
            self._state_buf = np.empty(max(size + size // 2, 1 << 20), dtype=np.uint8)
        ptr = self._state_buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        written = llama.llama_state_seq_get_data(source.ctx, ptr, size, 0)
        if written != size:
            raise DecodeError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
        llama.llama_memory_clear(target.memory, True)  # (not ``clear``: a settled state's copy stays)
        read = llama.llama_state_seq_set_data(target.ctx, ptr, size, 0)
        if read != size:
            target.clear()
            raise DecodeError(f"llama_state_seq_set_data read {read} of {size} bytes")
        target.n_past, target.history, target.fixed_upto = source.n_past, list(source.history), source.fixed_upto

    def _prefill_by_reader(self, tokens: Sequence[int], abort: Optional[Callable[[], bool]]) -> np.ndarray:
        """``prefill`` in the reader (``add_prompt_reader``): it first holds what
        this context holds (kept from its last prompt, or copied), reads
        ``tokens`` and the result is copied back, also where it stopped early."""
        reader = self._reader_holds_this()
        self._prefilled = None
        try:
            logits = reader.prefill(tokens, abort)
        finally:
            self._take_the_readers()
        self._prefilled = (self.n_past, logits.copy())
        return logits

    def _reader_holds_this(self) -> "LlamaModel":
        """The reader, holding this context's KV (kept from its last prompt where
        it still holds the same, else copied), ready to read at ``n_past``."""
        reader, start_at = self.reader, self.n_past
        if self._reader_same >= start_at and reader.n_past >= start_at:
            reader.truncate(start_at)
            llama.llama_memory_seq_rm(reader.memory, 0, start_at, -1)  # (cells an aborted pass may have left)
            reader.history, reader.fixed_upto = list(self.history), self.fixed_upto
        else:
            self._copy_state(self, reader)
        reader._prefilled = None
        reader.prefill_group = self.prefill_group
        return reader

    def _take_the_readers(self) -> None:
        """This context's KV replaced by what the reader holds (also after a pass
        stopped early); on a failed copy this context is empty."""
        self._reader_same = 0
        self._copy_state(self.reader, self)
        self._reader_same = self.n_past

    def close(self) -> None:
        self.drop_prompt_reader()
        if getattr(self, "_batch", None) is not None:
            llama.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "ctx", None):
            llama.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            llama.llama_model_free(self.model)
            self.model = None

    # ------------------------------------------------------------------ vocabulary

    def tokenize(self, text: str, add_special: bool, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (llama.llama_token * capacity)()
        n = llama.llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special, parse_special)
        if n < 0:
            capacity = -n
            buf = (llama.llama_token * capacity)()
            n = llama.llama_tokenize(self.vocab, data, len(data), buf, capacity, add_special, parse_special)
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """The bytes a token stands for (control tokens render as nothing)."""
        cached = self._pieces.get(token)
        if cached is None:
            cached = self.token_text(token, special=False)
            self._pieces[token] = cached
        return cached

    def token_text(self, token: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = llama.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def vocab_digests(self, block: int = 4096) -> list[str]:
        """sha256 (first 16 hex digits) of the token texts of each block of ids:
        two models with equal digests have the same vocabulary, and the first
        unequal block says where they differ."""
        import hashlib

        digests = []
        for start in range(0, self.n_vocab, block):
            h = hashlib.sha256()
            for token in range(start, min(start + block, self.n_vocab)):
                h.update(self.token_text(token, special=True))
                h.update(b"\0")
            digests.append(h.hexdigest()[:16])
        return digests

    def batch_invariance(self) -> dict[str, bool]:
        """Does a position's logits depend on how the tokens were batched? Decodes
        a ~70-token text (past the 64 query rows where ggml's flash attention
        tiles, and the 8 where its K-quant matmul does) the ways tandem does and
        compares the logits bit for bit with one prefill of the whole text:

        - ``restore``: a page of 16 tokens first, then the rest (a prefix-cache hit)
        - ``verify``: all but 5 tokens, then 5 in one pass (a verify pass, k = 4)
        - ``one_token``: the same 5 one at a time (plain decoding), against the verify rows;
          and one-token steps against verify passes of widths 2, 3, 4, 5, 8, 9 and 17 (``step_passes``)
        - ``small_batches``: 7 tokens per call (a prompt longer than --batch-size)
        - ``exact_steps``: what exact mode runs: two-position steps against verify passes
          of widths 2, 3, 4, 5, 8, 9 and 17, each cut back to what its round accepts (``step_passes``)

        Returns each path's verdict; all True means batch-invariant here. Leaves the cache empty."""
        text = (
            "The lighthouse keeper climbed the stairs every evening to light the lamp. "
            'def parse(line):\n    """Split a CSV line."""\n    fields = []\n    for part in line.split(","):\n'
            "        fields.append(part.strip())\n    return fields  # one per column\n"
        )
        tokens = self.tokenize(text, add_special=True)
        while len(tokens) < 70:
            tokens = tokens + tokens[1:]
        tokens = tokens[: min(72, self.n_ctx - 1)]  # decode() splits by n_batch itself
        n = len(tokens)
        if n < 24:
            return {}  # a context too small to probe in: unknown
        try:
            self.clear()
            whole = self.decode(tokens)[0]
            self.clear()
            self.decode(tokens[:16])
            restore = self.decode(tokens[16:])[0]
            self.clear()
            self.decode(tokens[: n - 5])
            rows = self.decode(tokens[n - 5 :], logits_for=range(5))
            self.truncate(n - 5)
            singles = [self.decode([t])[0] for t in tokens[n - 5 :]]
            self.clear()
            for start in range(0, n, 7):
                small = self.decode(tokens[start : start + 7])[0]
            one_token = all(np.array_equal(a, b) for a, b in zip(rows, singles))
            one_token = one_token and self.step_passes(tokens, step=1)
            exact_steps = self.step_passes(tokens, step=2)
            return {
                "restore": bool(np.array_equal(restore, whole)),
                "verify": bool(np.array_equal(rows[-1], whole)),
                "one_token": one_token,
                "small_batches": bool(np.array_equal(small, whole)),
                "exact_steps": exact_steps,
            }
        finally:
            self.clear()

    # (width, accepted) of the verify passes ``step_passes`` runs: widths 2 to k + 1 = 17
    # (--draft-tokens up to 16; 8 is where ggml's tiled K-quant matmul starts), each
    # round accepting some of its drafts
    PROBE_ROUNDS = ((5, 1), (2, 0), (17, 3), (3, 2), (9, 8), (8, 0), (4, 3))

    def step_passes(self, tokens: Sequence[int], step: int = 2) -> bool:
        """What drafting rests on, measured: does a verify pass of w positions give, row
        for row, the logits a plain step gives at each of those positions, for widths
        2, 3, 4, 5, 8, 9 and 17, with the passes cut back after each round as the engine cuts them
        (rejected drafts dropped, the next pass written into the cells they held)?
        ``step`` is the plain step's width: 1, or 2 in exact mode (the token and a
        guess, the guess then dropped). tinyBLAS and ggml's tiled K-quant matmul start
        at 2 and 8 rows and round each row alike whatever the width; this checks it,
        and whatever else could differ, on the CPU the daemon runs on. Leaves the
        cache empty."""
        starts = [sum(a + 1 for _, a in self.PROBE_ROUNDS[:i]) for i in range(len(self.PROBE_ROUNDS))]
        need = max(at + width for at, (width, _) in zip(starts, self.PROBE_ROUNDS))  # positions read: 27
        text = list(tokens)
        while len(text) < 24 + need:
            text = text + list(tokens[1:])
        if len(text) > self.n_ctx - 2:
            return True  # (a context too small to probe in: the other paths' verdicts stand)
        base, rest = text[:24], text[24:]
        try:
            self.clear()
            self.decode(base)
            steps = []
            for i in range(need):
                if step == 1:
                    steps.append(self.decode([rest[i]])[0])
                else:  # an exact step: [token, guess], logits for both, the guess (the token again) dropped
                    steps.append(self.decode([rest[i], rest[i]], logits_for=(0, 1))[0])
                    self.truncate(self.n_past - 1)
            self.clear()
            self.decode(base)
            for at, (width, _) in zip(starts, self.PROBE_ROUNDS):
                self.truncate(len(base) + at)  # the round before kept its accepted drafts and its own token
                rows = self.decode(rest[at : at + width], logits_for=range(width))
                if not all(np.array_equal(rows[j], steps[at + j]) for j in range(width)):
                    return False
            return True
        finally:
            self.clear()

    def fast_prefill_is_exact(self) -> Optional[bool]:
        """Does fast prefill hold here what exact output rests on? Two checks:

        - a prompt whose first chunk was kept from a request that went on
          differently gives the logits of the same prompt read whole;
        - a position's logits in a whole chunk do not depend on the chunk's later
          rows (prefix-cache pages of one chunk may come from two requests that
          share the tokens up to a page boundary inside it).

        Both hold by construction (the same chunks in the same shapes; kernels
        that compute rows apart); this checks the construction on this machine
        before the daemon relies on it. None when the context is too small to
        check in. Leaves the cache empty."""
        chunk = self.prefill_chunk
        if not chunk or self.n_ctx < 2 * chunk + 8:
            return None
        text = "The lighthouse keeper climbed the stairs every evening to light the lamp. "
        tokens = self.tokenize(text, add_special=True)
        while len(tokens) < 2 * chunk + 8:
            tokens = tokens + tokens[1:]
        other = self.tokenize(" A different ending, read with it before, about the harbour at night.", False)
        other = (other * (chunk // max(len(other), 1) + 1))[:chunk]
        half = chunk // 2
        group, self.prefill_group = self.prefill_group, chunk  # chunk by chunk: grouping is checked apart
        try:
            self.clear()
            whole = self.prefill(tokens[: chunk + 8]).copy()
            self.clear()
            self.prefill(tokens[:chunk] + other)
            self.truncate(chunk)
            kept = self.prefill(tokens[chunk : chunk + 8])
            rows = []
            reads = self.reader or self  # (the context whose fast kernels read prompts)
            for later in (tokens[chunk + half : 2 * chunk], other[: chunk - half]):
                reads.clear()
                reads.prefill(tokens[:chunk])
                reads._use_reference(False)
                try:
                    rows.append(reads.decode(tokens[chunk : chunk + half] + later, logits_for=[half - 1])[0].copy())
                finally:
                    reads._use_reference(True)
            return bool(np.array_equal(kept, whole) and np.array_equal(rows[0], rows[1]))
        finally:
            self.prefill_group = group
            self.clear()
            if self.reader is not None:
                self.reader.clear()

    def set_prefill_group(self, tokens: int) -> None:
        """Read up to ``tokens`` of whole prefill chunks per llama_decode (rounded
        down to whole chunks, at most ``n_batch``; at least one chunk)."""
        chunk = self.prefill_chunk
        if chunk:
            self.prefill_group = max(min(int(tokens), self.n_batch) // chunk, 1) * chunk

    def checkable_group(self) -> int:
        """The largest group up to ``prefill_group`` that ``prefill_grouping_is_exact``
        can check in this context (0: not even two chunks, or grouping is off)."""
        chunk = self.prefill_chunk
        if not chunk:
            return 0
        group = min(self.prefill_group, (self.n_ctx - chunk - 8) // chunk * chunk)
        return group if group >= 2 * chunk else 0

    def prefill_grouping_is_exact(self) -> Optional[bool]:
        """Does a whole chunk's KV stay the same when one llama_decode reads it with
        the chunks around it (``prefill_group``)? A cached request groups a prompt's
        chunks from another start than an uncached one. Compares the logits after
        a group, one chunk and 8 tokens read chunk by chunk with those read in
        groups from position 0, from the second chunk and from the third (what
        is before kept, as a cached request does: a full group, then one a chunk
        shorter); the 8 in a pass of their own every time. Where the
        context cannot hold that, the group shrinks to what it can check. None
        when not even two chunks can be checked, or grouping is off. Leaves the
        cache empty; ``prefill_group`` the size checked."""
        chunk, group = self.prefill_chunk, self.checkable_group()
        if not group:
            return None
        text = 'def parse(line):\n    """Split a CSV line."""\n    return [part.strip() for part in line.split(",")]\n'
        tokens = self.tokenize(text, add_special=True)
        while len(tokens) < group + chunk + 8:
            tokens = tokens + tokens[1:]
        tokens = tokens[: group + chunk + 8]
        try:
            self.prefill_group = chunk
            self.clear()
            alone = self.prefill(tokens).copy()
            self.prefill_group = group
            self.clear()
            from_zero = self.prefill(tokens).copy()
            shifted = []
            for kept in (chunk, 2 * chunk):  # a full group from the second chunk; a shorter one from the third
                self.clear()
                self.prefill_group = chunk
                self.prefill(tokens[:kept])
                self.prefill_group = group
                shifted.append(self.prefill(tokens[kept:]).copy())
            return bool(np.array_equal(alone, from_zero) and all(np.array_equal(alone, s) for s in shifted))
        finally:
            self.prefill_group = group
            self.clear()

    def fim_tokens(self) -> Optional[tuple[int, int, int]]:
        """The (prefix, suffix, middle) fill-in-the-middle tokens, or None when the
        vocabulary lacks one. llama.cpp finds them at load, from the GGUF's
        metadata or by their spellings in the vocabulary (<|fim_prefix|>,
        <fim_prefix>, <PRE>, ...)."""
        ids = (
            int(llama.llama_vocab_fim_pre(self.vocab)),
            int(llama.llama_vocab_fim_suf(self.vocab)),
            int(llama.llama_vocab_fim_mid(self.vocab)),
        )
        return ids if all(i >= 0 for i in ids) else None

    def is_eog(self, token: int) -> bool:
        return bool(llama.llama_vocab_is_eog(self.vocab, token))

    @staticmethod
    def runtime() -> tuple[str, str]:
        """llama.cpp as loaded: its binding's version and the CPU features it uses."""
        return llama.__version__, llama.llama_print_system_info().decode()

    @property
    def bos_token(self) -> int:
        return int(llama.llama_vocab_bos(self.vocab))

    @property
    def eos_token(self) -> int:
        return int(llama.llama_vocab_eos(self.vocab))

    def chat_template(self) -> Optional[str]:
        raw = llama.llama_model_chat_template(self.model, None)
        return raw.decode("utf-8") if raw else None

    # ------------------------------------------------------------------ decoding

    def clear(self) -> None:
        self._before_settle = None
        llama.llama_memory_clear(self.memory, True)
        self._reader_same = 0
        self.n_past = 0
        self.history = []
        self.fixed_upto = 0
        self._prefilled = None

    @property
    def kv_reusable(self) -> int:
        """How many KV positions from 0 a later request may reuse (keep, or store
        as prefix-cache pages) and get the logits it would get without them: all
        with reference kernels everywhere; with fast prefill, those read in
        whole chunks (a prompt's last, partial chunk and decoded tokens are read
        again, in the shape an uncached request reads them)."""
        return self.fixed_upto if self.prefill_chunk else self.n_past

    def prefilled_logits(self, tokens: Sequence[int]) -> Optional[np.ndarray]:
        """The logits after ``tokens`` when they are exactly the prompt the last
        ``prefill`` read and the KV cache still holds it (a re-sent prompt)."""
        before, self._before_settle = self._before_settle, None
        if before is not None:  # the cache was settled since: the prompt as it was, if this re-sends it
            _, _, history, _, prefilled = before
            if prefilled is None or prefilled[0] != len(tokens) or history[: len(tokens)] != list(tokens):
                return None
            self._put_back(before)
        if self._prefilled is None:
            return None
        n, logits = self._prefilled
        if n != len(tokens) or n > self.n_past or self.history[:n] != list(tokens):
            return None
        return logits

    def prefill(self, tokens: Sequence[int], abort: Optional[Callable[[], bool]] = None) -> np.ndarray:
        """Read a prompt's ``tokens`` at ``n_past``; the logits after the last.

        With fast prefill, with ggml's fast (shape-specialised) kernels, in chunks
        of ``prefill_chunk`` tokens at positions aligned to 0: whole chunks up to
        ``prefill_group`` tokens per llama_decode, the last, partial chunk in a
        llama_decode of its own. A position's KV and logits then depend on the
        tokens up to its chunk's end, never on what was cached: an uncached
        request reads the same chunks, the partial one in the same shape. ``n_past`` must be a multiple of the
        chunk (the caller keeps or restores only whole chunks: ``kv_reusable``).
        Decoding steps (``decode``) keep the reference kernels."""
        chunk = self.prefill_chunk
        if not chunk:
            return self.decode(tokens, abort=abort)[0]
        if not tokens:
            raise DecodeError("nothing to decode")
        if self.reader is not None:
            return self._prefill_by_reader(tokens, abort)
        start_at = self.n_past
        if start_at % chunk:
            raise DecodeError(f"a fast prefill starts at a multiple of {chunk} tokens, not at {start_at}")
        whole = self.fixed_upto >= start_at  # what is kept was read in whole chunks too
        self._prefilled = None
        self._use_reference(False)
        try:
            start = 0
            while start < len(tokens):
                if start and abort is not None and abort():
                    raise DecodeAborted()
                whole_chunks = (len(tokens) - start) // chunk * chunk
                part = tokens[start : start + (min(self.prefill_group, whole_chunks) or chunk)]
                logits = self.decode(part)[0]
                if whole and len(part) % chunk == 0:
                    self.fixed_upto = self.n_past
                start += len(part)
        finally:
            self._use_reference(True)
        self._prefilled = (self.n_past, logits.copy())
        return logits

    def _use_reference(self, on: bool) -> None:
        self._fast = not on
        set_ref = _REFERENCE_KERNELS["set"]
        for backend in self._cpu_backends:
            set_ref(backend, on)

    def truncate(self, n_keep: int) -> None:
        """Drop KV cache positions >= n_keep."""
        if n_keep < self.n_past:
            if not llama.llama_memory_seq_rm(self.memory, 0, n_keep, -1):
                self.clear()  # a cache that cannot drop a tail (a recurrent model): nothing of it is trusted
                raise DecodeError(
                    f"llama.cpp could not drop KV positions {n_keep} and on (a recurrent or hybrid model?); "
                    "its cache was cleared"
                )
            self.n_past = n_keep
            self._reader_same = min(self._reader_same, n_keep)
            del self.history[n_keep:]
            self.fixed_upto = min(self.fixed_upto, n_keep)
            if self._prefilled is not None and self._prefilled[0] > n_keep:
                self._prefilled = None

    def settle(self, keep: Callable[[list[int]], object], interrupted: Callable[[], bool]) -> int:
        """Idle time, with fast prefill: read again, in whole prefill chunks, what
        the KV cache holds past the last whole chunk a prefill read (a prompt's
        last, partial chunk and the reply decoded after it), as an uncached
        request whose prompt starts with those tokens reads them (a chat's or an
        agent's next turn re-sends them), and hand those tokens to ``keep``
        (which stores their pages in the prefix cache). The cache then holds them
        so; the state before is kept as a copy until the next request: one that
        re-sends the last prompt gets it back (``prefilled_logits``: that prompt's
        last chunk as an uncached request reads it), any other drops it.

        ``interrupted()`` is polled between chunks and, through llama.cpp's abort
        callback, between a pass's graph nodes: a message that arrives stops it
        within milliseconds, keeping the chunks already read. Returns the tokens
        read again (0: nothing to settle, or its state is over
        ``SETTLE_MAX_STATE``); when interrupted, -1 - those read (a next call
        goes on from there, and stores the pages when it completes: the message
        waiting is not kept waiting for that).

        Why a copy and not a second sequence sharing the cells: with the old
        cells still occupied, the chunks read again land after them, and llama.cpp
        then computes them differently (measured: logits 0.4 apart) from an
        uncached request, whose cells are contiguous."""
        chunk = self.prefill_chunk
        if not (chunk and self.can_settle):
            return 0
        before = self._before_settle  # (an interrupted settle goes on from where it stopped)
        source, n_source = (self.history, self.n_past) if before is None else (before[2], before[1])
        start, end = self.fixed_upto, n_source // chunk * chunk
        if end <= start or -1 in source[start:end] or self.history != source[: self.n_past]:
            return 0
        if before is None:
            size = llama.llama_state_seq_get_size(self.ctx, 0)
            if size > SETTLE_MAX_STATE:
                log.info("not settling: the KV state (%d MiB) is over %d MiB", size >> 20, SETTLE_MAX_STATE >> 20)
                return 0
            before = (self.seq_state(), self.n_past, list(self.history), self.fixed_upto, self._prefilled)
        tokens = list(source[:end])
        try:
            self.truncate(start)
        except DecodeError:  # a cache that cannot drop a tail (it was cleared): as it was, unsettled
            self._put_back(before)
            self.can_settle = False
            return 0
        callback = llama.ggml_abort_callback(lambda _: bool(interrupted()))
        contexts = [self.ctx] + ([self.reader.ctx] if self.reader is not None else [])
        for ctx in contexts:
            llama.llama_set_abort_callback(ctx, callback, None)
        done, stopped = start, False
        # with a reader, the chunks are read there and its KV copied back once (a copy is of the whole state)
        reads = self._reader_holds_this() if self.reader is not None else self
        try:
            for at in range(start, end, chunk):
                if interrupted():
                    stopped = True
                    break
                reads.prefill(tokens[at : at + chunk])
                done = at + chunk
        except DecodeError as exc:  # aborted for a message (llama_decode 2): the chunks before it stand
            stopped = getattr(exc, "rc", None) == 2 or interrupted()
            if not stopped:
                log.warning("settling stopped: %s", exc)
        finally:
            for ctx in contexts:
                llama.llama_set_abort_callback(ctx, llama.ggml_abort_callback(), None)
        if reads is not self:
            try:
                self._take_the_readers()
            except DecodeError as exc:  # this context is empty: nothing of the turn is kept
                log.warning("settling stopped: %s", exc)
                self.forget_history()
                self._before_settle = None
                return 0
        llama.llama_memory_seq_rm(self.memory, 0, done, -1)  # (an aborted chunk's cells, if it left any)
        self.n_past, self.history, self.fixed_upto, self._prefilled = done, tokens[:done], done, None
        self._reader_same = min(self._reader_same, done)
        self._before_settle = before
        if stopped:  # the waiting message first; what was read stays live (pages at the end, if it goes on)
            return start - done - 1
        if done > start:
            keep(tokens[:done])
        return done - start

    def _put_back(self, before: tuple) -> None:
        """The KV cache as ``settle`` found it (``_before_settle``'s tuple)."""
        blob, n_past, history, fixed_upto, prefilled = before
        self.set_seq_state(blob, n_past, history)
        self.fixed_upto, self._prefilled = fixed_upto, prefilled

    def forget_history(self) -> None:
        """The KV cache's contents are no longer to be reused (``live_prefix`` 0)."""
        self._before_settle = None
        self.history = [-1] * self.n_past
        self.fixed_upto = 0
        self._prefilled = None

    def live_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the KV cache already holds, from the start."""
        n = 0
        for have, want in zip(self.history, tokens):
            if have != want:
                break
            n += 1
        return n

    def seq_state(self) -> bytes:
        """llama.cpp's serialized KV state of sequence 0 (all ``n_past`` tokens)."""
        size = llama.llama_state_seq_get_size(self.ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        written = llama.llama_state_seq_get_data(self.ctx, buf, size, 0)
        if written != size:
            raise DecodeError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
        return bytes(buf)

    def set_seq_state(
        self, blob: bytes | bytearray | memoryview, n_tokens: int, tokens: Optional[Sequence[int]] = None
    ) -> None:
        """Replace sequence 0 with a state from ``seq_state`` (or assembled from
        pages) that holds ``n_tokens`` tokens (``tokens``, where the caller knows them)."""
        self.clear()
        data = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        read = llama.llama_state_seq_set_data(self.ctx, data, len(blob), 0)
        if read != len(blob):
            self.clear()
            raise DecodeError(f"llama_state_seq_set_data read {read} of {len(blob)} bytes")
        self.n_past = n_tokens
        self.history = list(tokens[:n_tokens]) if tokens is not None else [-1] * n_tokens
        self.fixed_upto = n_tokens  # pages hold only what was reusable (``kv_reusable``) when they were stored

    def decode(
        self,
        tokens: Sequence[int],
        logits_for: Sequence[int] = (-1,),
        abort: Optional[Callable[[], bool]] = None,
    ) -> np.ndarray:
        """Append ``tokens`` at position ``n_past``; return a (len(logits_for), n_vocab)
        float32 copy of the logits at those indices into ``tokens`` (negative
        indices count from the end). Processes ``n_batch`` tokens per llama_decode
        (a step with repacked weights: ``step_rows``); between batches, ``abort()``
        returning True raises DecodeAborted (the tokens decoded so far stay in the
        cache)."""
        n = len(tokens)
        if n == 0:
            raise DecodeError("nothing to decode")
        if self.n_past + n > self.n_ctx:
            raise DecodeError(f"{self.n_past + n} tokens do not fit the context of {self.n_ctx}")
        wanted = {i % n for i in logits_for}
        out = np.empty((len(logits_for), self.n_vocab), dtype=np.float32)
        batch = self._batch
        per_pass = min(self.step_rows, self.n_batch) if self.step_rows and not self._fast else self.n_batch
        for start in range(0, n, per_pass):
            if start and abort is not None and abort():
                raise DecodeAborted()
            chunk = tokens[start : start + per_pass]
            batch.n_tokens = len(chunk)
            for j, tok in enumerate(chunk):
                batch.token[j] = tok
                batch.pos[j] = self.n_past + j
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = 0
                batch.logits[j] = (start + j) in wanted
            rc = llama.llama_decode(self.ctx, batch)
            if rc != 0:
                self.history = [-1] * self.n_past  # what it left in the cache is not known: never reused
                self.fixed_upto = 0
                self._prefilled = None
                error = DecodeError(f"llama_decode returned {rc}")
                error.rc = rc  # (2: the abort callback stopped it)
                raise error
            self.n_past += len(chunk)
            self.history.extend(chunk)
            for idx in wanted:
                if start <= idx < start + len(chunk):
                    ptr = llama.llama_get_logits_ith(self.ctx, idx - start)
                    row = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
                    for r, i in enumerate(logits_for):
                        if i % n == idx:
                            out[r] = row
        return out


def reference_llama(path: Path | str, n_ctx: int, n_threads: Optional[int] = None, **kwargs) -> "llama.Llama":
    """llama-cpp-python's own high-level ``Llama`` with the worker's default
    settings (threads, reference kernels, flash attention, extra buffers), for
    comparing the daemon against it in-process. ``Llama`` does not expose
    ``use_extra_bufts``, so its default params are patched while it loads."""
    original = llama.llama_cpp.llama_model_default_params

    def params():
        p = original()
        p.use_extra_bufts = default_extra_buffers()
        return p

    threads = n_threads or default_threads()
    kwargs.setdefault("flash_attn", True)
    use_reference_kernels(True)
    llama.llama_cpp.llama_model_default_params = params
    try:
        return llama.Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False, **kwargs)
    finally:
        llama.llama_cpp.llama_model_default_params = original
