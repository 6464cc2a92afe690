"""An embedding model in llama.cpp: pooled vectors of several inputs in one pass.

The context is created with ``embeddings`` on and the model's own pooling (the
``<arch>.pooling_type`` of its GGUF file: CLS for most BERT-style embedding
models, LAST for Qwen3-Embedding, MEAN for nomic-embed), or MEAN for a file that
has none (a generative model, whose mean last hidden state is then the vector).
Each input of a batch is its own sequence (seq id 0, 1, ...), so one
``llama_decode`` reads them all and llama.cpp pools each; ``llama_get_embeddings_seq``
reads them back. llama.cpp pools a sequence within one micro-batch, so the
context, the batch and the micro-batch are one size: the longest input it takes.

With embeddings on llama.cpp still computes a generative model's output layer
for every token (its logits are not read): that costs a 0.5B Qwen about a third
more than its layers alone, and its output buffer grows with the vocabulary, so
the context is kept to what ``CONTEXT_BYTES`` of logits allow.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import llama_cpp as llama
import numpy as np
from llama_cpp import _logger as llama_logger

from ..models.devices import LoadLog
from ..worker.llama_load import DecodeError, ModelLoadError, default_threads, load_weights, tokenize
from .vectors import MAX_SEQS

log = logging.getLogger("tandem.embedding")

MAX_CONTEXT = 2048  # tokens of one input, at most (also the model's trained context)
CONTEXT_BYTES = 256 << 20  # the logits buffer's bytes the context may take (n_vocab x tokens x 4)
MIN_CONTEXT = 64
POOLINGS = {
    llama.LLAMA_POOLING_TYPE_MEAN: "mean",
    llama.LLAMA_POOLING_TYPE_CLS: "cls",
    llama.LLAMA_POOLING_TYPE_LAST: "last",
}


def context_tokens(n_vocab: int, n_ctx_train: int) -> int:
    """The embedding context: the trained one up to ``MAX_CONTEXT``, less where the
    logits buffer would pass ``CONTEXT_BYTES`` (in whole 64-token steps)."""
    by_memory = CONTEXT_BYTES // max(n_vocab * 4, 1) // 64 * 64
    return max(MIN_CONTEXT, min(MAX_CONTEXT, n_ctx_train or MAX_CONTEXT, by_memory))


class EmbeddingModel:
    """A GGUF file loaded for embeddings: tokenize, and ``embed`` batches of token lists."""

    def __init__(self, path: Path | str, n_threads: int | None = None, flash_attn: bool = True):
        self.path = Path(path)
        self.size_bytes = self.path.stat().st_size if self.path.is_file() else 0
        llama_logger.set_verbose(False)
        llama.llama_backend_init()
        self.gpu_layers = -1  # llama.cpp's choice: every layer on a GPU where there is one, else the CPU
        self.model, self.placement = load_weights(self.path, extra_buffers=False, gpu_layers=-1, device_names=[])
        self.vocab = llama.llama_model_get_vocab(self.model)
        self.n_vocab = int(llama.llama_vocab_n_tokens(self.vocab))
        self.n_embd = int(llama.llama_model_n_embd_out(self.model))
        self.n_ctx_train = int(llama.llama_model_n_ctx_train(self.model))
        self.kv_type = "f16"
        self.pooling_type = self._pooling()
        self.pooling = POOLINGS[self.pooling_type]
        self.n_ctx = context_tokens(self.n_vocab, self.n_ctx_train)
        self.max_threads = n_threads or default_threads()
        self.n_threads = self.max_threads
        self._create_context(flash_attn)
        self.head, self.tail = self._specials()

    def _meta(self, key: str) -> str:
        buf = ctypes.create_string_buffer(256)
        n = llama.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", errors="replace") if n >= 0 else ""

    def _pooling(self) -> int:
        arch = self._meta("general.architecture")
        own = self._meta(f"{arch}.pooling_type")
        if not own.strip().lstrip("-").isdigit() or int(own) in (-1, llama.LLAMA_POOLING_TYPE_NONE):
            return llama.LLAMA_POOLING_TYPE_MEAN  # a generative model: the mean of its last hidden states
        if int(own) not in POOLINGS:  # RANK: a reranker's head, which gives a score, not a vector
            raise ModelLoadError(f"{self.path.name} pools as type {own} (a reranker?), not into embedding vectors")
        return int(own)

    def _create_context(self, flash_attn: bool) -> None:
        params = llama.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = self.n_ctx
        params.n_seq_max = MAX_SEQS
        params.kv_unified = True  # the sequences of a batch share the context's cells
        params.n_threads = params.n_threads_batch = self.n_threads
        params.embeddings = True
        params.pooling_type = self.pooling_type
        params.no_perf = True
        params.flash_attn_type = (
            llama.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else llama.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        with LoadLog() as load_log:
            self.ctx = llama.llama_init_from_model(self.model, params)
        if not self.ctx:
            errors = "; ".join(load_log.placement().errors[-3:])
            raise ModelLoadError(
                f"llama.cpp could not create an embedding context of {self.n_ctx} tokens for {self.path.name}"
                + (f": {errors}" if errors else "")
            )
        self.memory = llama.llama_get_memory(self.ctx)  # NULL for an encoder (BERT): nothing to clear
        self._batch = llama.llama_batch_init(self.n_ctx, 0, 1)

    def _specials(self) -> tuple[int, int]:
        """(tokens the tokenizer puts before a text, after it): kept when an input is cut."""
        plain = self.tokenize("x", add_special=False)
        marked = self.tokenize("x", add_special=True)
        for start in range(len(marked) - len(plain) + 1):
            if marked[start : start + len(plain)] == plain:
                return start, len(marked) - start - len(plain)
        return 0, 0

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return tokenize(self.vocab, text.encode("utf-8", errors="replace"), add_special, False)

    def set_threads(self, n: int) -> None:
        n = max(1, min(n, self.max_threads))
        if n != self.n_threads:
            llama.llama_set_n_threads(self.ctx, n, n)
            self.n_threads = n

    def embed(self, seqs: list[list[int]]) -> np.ndarray:
        """The pooled vectors of ``seqs`` (one row each, float32), read in one ``llama_decode``:
        at most ``MAX_SEQS`` of them, ``n_ctx`` tokens together."""
        total = sum(len(s) for s in seqs)
        if not seqs or len(seqs) > MAX_SEQS or total > self.n_ctx or min(len(s) for s in seqs) == 0:
            raise DecodeError(f"cannot embed {len(seqs)} inputs of {total} tokens in one pass of {self.n_ctx}")
        b = self._batch
        n = 0
        for seq, tokens in enumerate(seqs):
            for pos, token in enumerate(tokens):
                b.token[n] = token
                b.pos[n] = pos
                b.n_seq_id[n] = 1
                b.seq_id[n][0] = seq
                b.logits[n] = True  # (every token is an output of a pooled embedding)
                n += 1
        b.n_tokens = n
        if self.memory:
            llama.llama_memory_clear(self.memory, True)
        rc = llama.llama_decode(self.ctx, b)
        if rc != 0:
            raise DecodeError(f"llama_decode failed ({rc}) on {len(seqs)} inputs of {total} tokens")
        out = np.empty((len(seqs), self.n_embd), dtype=np.float32)
        for seq in range(len(seqs)):
            ptr = llama.llama_get_embeddings_seq(self.ctx, seq)
            if not ptr:
                raise DecodeError(f"llama.cpp pooled no vector for input {seq}")
            out[seq] = np.ctypeslib.as_array(ptr, shape=(self.n_embd,))
        if self.memory:
            llama.llama_memory_clear(self.memory, True)
        return out

    def close(self) -> None:
        if getattr(self, "_batch", None) is not None:
            llama.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "ctx", None):
            llama.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            llama.llama_model_free(self.model)
            self.model = None
