"""Prompts read by a second context over the model file's weights as they are,
not repacked (``LlamaModel.add_prompt_reader`` says when, and why).

The model's own context decodes steps over the repacked weights; its prompt
reader reads prompts, and its KV state is then copied into the model's
context, whole. ``PromptReader.holding`` makes the reader hold what the model's
context holds (kept from its last prompt where it still holds the same, else
copied); ``PromptReader.give_back`` copies what it read back.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import llama_cpp as llama
import numpy as np

from .llama_load import DecodeError

KEEP_BUFFER_BYTES = 64 * 2**20  # a larger copy buffer is not kept: it would hold a long prompt's KV a third time


class PromptReader:
    """``context``: the second ``LlamaModel``, with fast prefill, over the weights not repacked."""

    def __init__(self, context):
        self.context = context
        self.same = 0  # KV positions from 0 the reader holds as the model's context does
        self._state_buf: Optional[np.ndarray] = None  # reused to copy KV states up to KEEP_BUFFER_BYTES

    def holding(self, model):
        """The reader, holding ``model``'s KV (kept from its last prompt where
        it still holds the same, else copied), ready to read at ``n_past``."""
        reader, start_at = self.context, model.n_past
        if self.same >= start_at and reader.n_past >= start_at:
            reader.truncate(start_at)
            llama.llama_memory_seq_rm(reader.memory, 0, start_at, -1)  # (cells an aborted pass may have left)
            reader.history, reader.fixed_upto = list(model.history), model.fixed_upto
        else:
            self.copy_state(model, reader)
        reader._prefilled = None  # (what the reader read last is not what it reads next)
        reader.prefill_group = model.prefill_group
        return reader

    def give_back(self, model) -> None:
        """``model``'s KV replaced by what the reader holds (also after a pass
        stopped early); on a failed copy ``model``'s context is empty."""
        self.same = 0
        self.copy_state(self.context, model)
        self.same = model.n_past

    def copy_state(self, source, target) -> None:
        """``target``'s sequence 0 replaced by ``source``'s KV (its positions,
        history and what of it was read in whole chunks), through a buffer: reused
        up to KEEP_BUFFER_BYTES, a larger one (a long prompt's KV) let go at once."""
        size = llama.llama_state_seq_get_size(source.ctx, 0)
        buf = self._state_buf
        if buf is None or len(buf) < size:  # (grown by half again: a chat grows)
            grown = min(max(size + size // 2, 1 << 20), KEEP_BUFFER_BYTES)
            buf = np.empty(grown if size <= KEEP_BUFFER_BYTES else size, dtype=np.uint8)
        self._state_buf = buf if len(buf) <= KEEP_BUFFER_BYTES else None
        ptr = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        written = llama.llama_state_seq_get_data(source.ctx, ptr, size, 0)
        if written != size:
            raise DecodeError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
        llama.llama_memory_clear(target.memory, True)  # (not ``clear``: a settled state's copy stays)
        read = llama.llama_state_seq_set_data(target.ctx, ptr, size, 0)
        if read != size:
            target.clear()
            raise DecodeError(f"llama_state_seq_set_data read {read} of {size} bytes")
        target.n_past, target.history, target.fixed_upto = source.n_past, list(source.history), source.fixed_upto

    def close(self) -> None:
        self.context.close()
