"""A thin driver for one llama.cpp model through llama-cpp-python's low-level API.

Only the calls tandem needs: load, tokenize, token pieces, and ``decode`` that
runs a batch of tokens and returns logits *only* for the positions asked for
(``Llama.eval``/``logits_all`` computes them for every position, which makes
long prefills minutes instead of seconds on a CPU).

Around ``LlamaModel``: llama_load.py loads the file and sets the CPU kernels,
load_checks.py holds the checks it runs on itself at load, prompt_reader.py the
second context that reads its prompts.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Optional, Sequence

import llama_cpp as llama
from llama_cpp import _logger as llama_logger

from ..kernels import in_use, rows_as_steps
from . import load_checks
from .llama_decode import PREFILL_CHUNK, PREFILL_GROUP, LlamaDecoder
from .llama_load import (
    REPACK_STEP_ROWS,
    ModelLoadError,
    can_switch_kernels,
    create_context,
    default_extra_buffers,
    default_threads,
    load_weights,
    tokenize,
    use_reference_kernels,
)
from .prompt_reader import PromptReader

log = logging.getLogger(__name__)


class LlamaModel(LlamaDecoder):
    """A GGUF model file loaded into a llama.cpp context: its vocabulary, its
    checks at load, its prompt reader; the passes and the KV state are
    ``LlamaDecoder``'s (llama_decode.py)."""

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
        kv_type: str = "f16",
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
        self.kv_type = kv_type  # the KV cache's element type (models/context_size.py's KV_TYPES)
        self.reference_kernels = reference_kernels or fast_prefill
        # rows per llama_decode on the reference kernels (the target's steps, and a drafter's reads, whose
        # KV then does not depend on how its tokens were split, so a seeded request reproduces):
        # repacked weights (llama.cpp's CPU_REPACK buffer, which it fills only for the types it repacks:
        # Q4_0, Q4_K, Q8_0, ...) compute at most REPACK_STEP_ROWS rows as a one-row step does (0: no
        # limit but n_batch)
        self.repacked = any("REPACK" in name for name in self.placement.weights)
        # ... except with tandem's CPU kernels (daemon/kernels), whose reference mode computes every row of
        # a pass through the one-row kernel (the weights read once per pass): passes of any width are exact
        self.step_rows = REPACK_STEP_ROWS if self.repacked and self.reference_kernels and not rows_as_steps() else 0
        self._empty_sequence()
        use_reference_kernels(self.reference_kernels)
        # fast prefill: prompts read with fast kernels, in chunks of this many tokens from position 0 (0: off)
        self.prefill_chunk = max(int(prefill_chunk), 1) if fast_prefill else 0
        self.prefill_group = self.prefill_chunk  # tokens of whole chunks one pass reads (set_prefill_group)
        self._cpu_backends: list[int] = []
        self._create_context(flash_attn)
        self._batch = llama.llama_batch_init(self.n_batch, 0, 1)
        self._pieces: dict[int, bytes] = {}
        # prompts read by a second context over the weights as the file has them (see ``add_prompt_reader``)
        self.prompt_reader: Optional[PromptReader] = None
        self.set_prefill_group(PREFILL_GROUP)
        if prompt_reader:
            self.add_prompt_reader()

    # ------------------------------------------------------------------ setup (llama_load.py)

    def _load_model(self) -> None:
        self.model, self.placement = load_weights(self.path, self.extra_buffers, self.gpu_layers, self.device_names)
        self.vocab = llama.llama_model_get_vocab(self.model)
        self.n_vocab = int(llama.llama_vocab_n_tokens(self.vocab))
        self.size_bytes = self.path.stat().st_size
        # a recurrent (or hybrid) model's cache asked to drop its last position alone erases the whole
        # sequence and reports success: nothing may add one position only to drop it again
        self.drops_one_position = not (
            llama.llama_model_is_recurrent(self.model) or llama.llama_model_is_hybrid(self.model)
        )

    def _create_context(self, flash_attn: bool) -> None:
        self.ctx, self._cpu_backends = create_context(
            self.model, self.n_ctx, self.n_batch, self.n_threads, flash_attn, self.kv_type
        )
        if self.prefill_chunk and not can_switch_kernels(self._cpu_backends):
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
        here, on the repacked weights. Only with fast prefill over repacked weights:
        llama.cpp's repacked Q4_K multiplies many rows slower than its plain kernels
        on some CPUs (the 2-core EPYC: Qwen2.5-Coder-1.5B reads a prompt in
        0.63-0.82x the time), and one row faster. Both contexts map the
        same file, so the second costs its KV cache and compute buffers, not the
        weights again. Every prompt position's KV is then the reader's, in the same
        chunks, wherever it was read: what exact output rests on holds (the load
        checks measure it through ``prefill``). Returns whether there is one."""
        if self.prompt_reader is not None:
            return True
        if not (self.repacked and self.prefill_chunk) or self.placement.key():  # (not with layers offloaded)
            return False
        try:
            context = LlamaModel(
                self.path,
                n_ctx=self.n_ctx,
                n_threads=self.n_threads,
                n_batch=self.n_batch,
                flash_attn=self.flash_attn,
                extra_buffers=False,
                fast_prefill=True,
                prefill_chunk=self.prefill_chunk,
                kv_type=self.kv_type,  # (its KV state is copied into this context's: the same types)
            )
        except ModelLoadError as exc:  # (a second KV cache that does not fit): prompts read here, as before
            log.warning("no prompt reader: %s", exc)
            return False
        if not context.prefill_chunk:  # (its context had no CPU backend whose kernels can be switched)
            context.close()
            return False
        self.prompt_reader = PromptReader(context)
        return True

    @property
    def reader(self) -> Optional["LlamaModel"]:
        """The context that reads this one's prompts (``add_prompt_reader``), or None."""
        return self.prompt_reader.context if self.prompt_reader is not None else None

    def drop_prompt_reader(self) -> None:
        """Back to reading prompts in this context."""
        reader, self.prompt_reader = self.prompt_reader, None
        if reader is not None:
            reader.close()

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

    # ------------------------------------------------------------------ checks at load (load_checks.py)

    def batch_invariance(self) -> dict[str, bool]:
        """Does a position's logits depend on how the tokens were batched? (``load_checks.batch_invariance``)"""
        return load_checks.batch_invariance(self)

    def fast_prefill_is_exact(self) -> Optional[bool]:
        """Does fast prefill hold here what exact output rests on? (``load_checks.fast_prefill_is_exact``)"""
        return load_checks.fast_prefill_is_exact(self)

    def checkable_group(self) -> int:
        """The largest prefill group ``prefill_grouping_is_exact`` can check here (``load_checks``)."""
        return load_checks.checkable_group(self)

    def prefill_grouping_is_exact(self) -> Optional[bool]:
        """Does grouping prefill chunks keep their KV? (``load_checks.prefill_grouping_is_exact``)"""
        return load_checks.prefill_grouping_is_exact(self)

    def prompt_reader_pays(self, margin: float = 1.1) -> Optional[bool]:
        """Does the reader read a prompt ``margin`` times faster? (``load_checks.prompt_reader_pays``)"""
        return load_checks.prompt_reader_pays(self, margin)

    # ------------------------------------------------------------------ vocabulary

    def tokenize(self, text: str, add_special: bool, parse_special: bool = True) -> list[int]:
        return tokenize(self.vocab, text.encode("utf-8"), add_special, parse_special)

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
        """llama.cpp as loaded: its binding's version (and whose CPU kernels, where they are tandem's) and
        the CPU features it uses."""
        kernels = in_use()
        version = llama.__version__ + (f" kernels={kernels}" if kernels != "llama.cpp" else "")
        return version, llama.llama_print_system_info().decode()

    @property
    def bos_token(self) -> int:
        return int(llama.llama_vocab_bos(self.vocab))

    @property
    def eos_token(self) -> int:
        return int(llama.llama_vocab_eos(self.vocab))

    def chat_template(self) -> Optional[str]:
        raw = llama.llama_model_chat_template(self.model, None)
        return raw.decode("utf-8") if raw else None
