"""Decoding passes over a llama.cpp context, and the KV state they leave.

``LlamaDecoder`` is the part of ``LlamaModel`` (llama_model.py) that runs once
the model is loaded: ``decode`` (a batch of tokens, logits only for the
positions asked for), ``prefill`` (a prompt, in whole chunks with the fast
kernels where fast prefill is on), and what sequence 0 of the context holds:
``n_past`` tokens (``history``), of which ``fixed_upto`` were read in whole
chunks; ``truncate``, ``clear``, ``seq_state``/``set_seq_state`` (the prefix
cache's pages) and ``settle`` (idle time: a turn's tail read again in whole
chunks).

``LlamaModel`` sets what a pass needs before it runs one: ``ctx``, ``memory``,
``_batch``, ``_cpu_backends``, ``n_ctx``, ``n_batch``, ``n_vocab``,
``step_rows``, ``prefill_chunk``, ``can_settle`` and ``prompt_reader``.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Callable, Optional, Sequence

import llama_cpp as llama
import numpy as np

from ..drafting.interfaces import DecodeAborted
from .llama_load import DecodeError, set_reference

log = logging.getLogger(__name__)

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

SETTLE_MAX_STATE = 256 * 2**20  # bytes: a KV state larger than this is not copied to settle it


class LlamaDecoder:
    """The passes over one llama.cpp context and what its sequence 0 holds; the
    base of ``LlamaModel``, which loads the model and creates the context."""

    def _empty_sequence(self) -> None:
        """Nothing in the KV cache yet (set at load, before the context is created)."""
        self._fast = False  # a prefill's fast kernels are on (``use_reference``)
        self.fixed_upto = 0  # KV positions [0, fixed_upto) were read in whole chunks by ``prefill``
        # the state before ``settle`` (blob, n_past, history, fixed_upto, prefilled), until the next request
        self._before_settle: Optional[tuple] = None
        self._prefilled: Optional[tuple[int, np.ndarray]] = None  # (prompt length, logits after it) of the last one
        self.n_past = 0  # tokens in the KV cache of sequence 0
        # the tokens at those positions (-1: unknown), so a next request can keep the prefix it shares
        self.history: list[int] = []
        self._reading: Optional["LlamaDecoder"] = None  # the prompt reader, while it reads this context's prompt

    def reading_at(self) -> int:
        """The tokens in the KV cache of the context that reads a prompt now
        (the prompt reader's while it reads one for this context; else ``n_past``)."""
        reading = self._reading
        return reading.n_past if reading is not None else self.n_past

    def set_prefill_group(self, tokens: int) -> None:
        """Read up to ``tokens`` of whole prefill chunks per llama_decode (rounded
        down to whole chunks, at most ``n_batch``; at least one chunk)."""
        chunk = self.prefill_chunk
        if chunk:
            self.prefill_group = max(min(int(tokens), self.n_batch) // chunk, 1) * chunk

    def clear(self) -> None:
        self._before_settle = None
        llama.llama_memory_clear(self.memory, True)
        self._reader_keeps(0)
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
        if self.prompt_reader is not None:
            return self._prefill_by_reader(tokens, abort)
        start_at = self.n_past
        if start_at % chunk:
            raise DecodeError(f"a fast prefill starts at a multiple of {chunk} tokens, not at {start_at}")
        whole = self.fixed_upto >= start_at  # what is kept was read in whole chunks too
        self._prefilled = None
        self.use_reference(False)
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
            self.use_reference(True)
        self._prefilled = (self.n_past, logits.copy())
        return logits

    def _prefill_by_reader(self, tokens: Sequence[int], abort: Optional[Callable[[], bool]]) -> np.ndarray:
        """``prefill`` in the prompt reader (``LlamaModel.add_prompt_reader``): it
        first holds what this context holds (kept from its last prompt, or copied),
        reads ``tokens`` and the result is copied back, also where it stopped early."""
        reader = self.prompt_reader.holding(self)
        self._prefilled = None
        self._reading = reader
        try:
            logits = reader.prefill(tokens, abort)
        finally:
            self._reading = None
            self.prompt_reader.give_back(self)
        self._prefilled = (self.n_past, logits.copy())
        return logits

    def use_reference(self, on: bool) -> None:
        """The reference kernels on for this context's passes (off: ggml's fast ones, as ``prefill`` reads)."""
        self._fast = not on
        set_reference(self._cpu_backends, on)

    def _reader_keeps(self, n: int) -> None:
        """The prompt reader holds at most the first ``n`` KV positions as this context does."""
        if self.prompt_reader is not None:
            self.prompt_reader.same = min(self.prompt_reader.same, n)

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
            self._reader_keeps(n_keep)
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
        done, stopped = self._read_again(tokens, start, end, interrupted)
        if self.prompt_reader is not None:
            try:
                self.prompt_reader.give_back(self)
            except DecodeError as exc:  # this context is empty: nothing of the turn is kept
                log.warning("settling stopped: %s", exc)
                self.forget_history()
                self._before_settle = None
                return 0
        llama.llama_memory_seq_rm(self.memory, 0, done, -1)  # (an aborted chunk's cells, if it left any)
        self.n_past, self.history, self.fixed_upto, self._prefilled = done, tokens[:done], done, None
        self._reader_keeps(done)
        self._before_settle = before
        if stopped:  # the waiting message first; what was read stays live (pages at the end, if it goes on)
            return start - done - 1
        if done > start:
            keep(tokens[:done])
        return done - start

    def _read_again(self, tokens: list[int], start: int, end: int, interrupted: Callable[[], bool]) -> tuple[int, bool]:
        """``settle``'s reading: ``tokens[start:end]`` chunk by chunk, with llama.cpp's
        abort callback asking ``interrupted()`` between a pass's graph nodes; (where
        what was read ends, whether it was interrupted). With a prompt reader, the
        chunks are read there (``settle`` copies its KV back)."""
        chunk = self.prefill_chunk
        callback = llama.ggml_abort_callback(lambda _: bool(interrupted()))
        contexts = [self.ctx] + ([self.prompt_reader.context.ctx] if self.prompt_reader is not None else [])
        for ctx in contexts:
            llama.llama_set_abort_callback(ctx, callback, None)
        done, stopped = start, False
        # with a reader, the chunks are read there and its KV copied back once (a copy is of the whole state)
        reads = self.prompt_reader.holding(self) if self.prompt_reader is not None else self
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
        return done, stopped

    def _put_back(self, before: tuple) -> None:
        """The KV cache as ``settle`` found it (``_before_settle``'s tuple)."""
        blob, n_past, history, fixed_upto, prefilled = before
        self.set_seq_state(blob, n_past, history)
        self.fixed_upto, self._prefilled = fixed_upto, prefilled

    def pausable(self) -> bool:
        """Whether ``suspend`` may be called now: between two steps, or between two
        passes of a prompt this context reads itself (not the prompt reader)."""
        return self._reading is None

    def suspend(self, max_bytes: int) -> Optional[tuple]:
        """A copy of what sequence 0 holds (its KV state, to the last bit, and what
        this object knows of it, with the kernels its passes use), for ``resume``
        after another request has used the context: the short-request lane. None
        when the copy would take more than ``max_bytes``. The kernels are the
        reference ones until then (the other request's steps use them)."""
        if llama.llama_state_seq_get_size(self.ctx, 0) > max_bytes:
            return None
        saved = (self._seq_state_buffer(), self.n_past, list(self.history), self.fixed_upto, self._prefilled)
        fast = self._fast
        self.use_reference(True)
        return saved, fast

    def resume(self, saved: tuple) -> None:
        """Sequence 0 as ``suspend`` found it: the same cells, in the same places, and
        the same kernels, so the next pass computes what it would have computed
        without the pause (the next step, or the prompt's next pass)."""
        state, fast = saved
        self._before_settle = None
        self._put_back(state)
        self.use_reference(not fast)

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
        return bytes(self._seq_state_buffer())

    def _seq_state_buffer(self) -> ctypes.Array:
        """``seq_state`` in the buffer llama.cpp wrote it to (no copy into bytes)."""
        size = llama.llama_state_seq_get_size(self.ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        written = llama.llama_state_seq_get_data(self.ctx, buf, size, 0)
        if written != size:
            raise DecodeError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
        return buf

    def set_seq_state(
        self, blob: bytes | bytearray | memoryview | ctypes.Array, n_tokens: int, tokens: Optional[Sequence[int]] = None
    ) -> None:
        """Replace sequence 0 with a state from ``seq_state`` (or assembled from
        pages) that holds ``n_tokens`` tokens (``tokens``, where the caller knows them)."""
        self.clear()
        data = blob if isinstance(blob, ctypes.Array) else (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
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
