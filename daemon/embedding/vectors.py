"""What an embed request's inputs and vectors go through, without llama.cpp.

``fit`` cuts one input's tokens to the embedding context (keeping the special
tokens the tokenizer puts around a text, so a model that pools its last token, or
its first, still finds it there), ``next_batch`` groups inputs into the batches of one
``llama_decode`` each, and ``finish`` turns pooled vectors into what is sent:
the first ``dimensions`` of them, at unit length.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from tandem.protocol import MAX_EMBED_INPUTS, MAX_MESSAGE_BYTES

BYTES_PER_FLOAT = 9  # a msgpack float 64: the reply's vectors are lists of floats
REPLY_SLACK = 64 * 1024  # the reply's other fields
MAX_SEQS = 64  # inputs in one llama_decode


class TooLong(ValueError):
    """An input longer than the embedding context, with truncate off."""


def fit(tokens: list[int], limit: int, head: int, tail: int, truncate: bool, where: str) -> tuple[list[int], bool]:
    """(``tokens`` within ``limit``, whether they were cut). ``head`` and ``tail``:
    the special tokens the tokenizer put before and after the text (kept when cut)."""
    if len(tokens) <= limit:
        return tokens, False
    if not truncate:
        raise TooLong(
            f"{where} has {len(tokens):,} tokens; the embedding context holds {limit:,} (send truncate: true to "
            "cut it to fit, or split the text)"
        )
    keep = max(limit - head - tail, 1)
    end = tokens[len(tokens) - tail :] if tail else []
    return (tokens[: head + keep] + end)[:limit], True


def next_batch(lengths: Sequence[int], start: int, budget: int, max_seqs: int) -> int:
    """The end of the batch that starts at input ``start``: the inputs after it while they
    fit ``budget`` tokens and ``max_seqs`` inputs (one input longer than the budget goes alone)."""
    end, used = start, 0
    while end < len(lengths) and end - start < max_seqs and (end == start or used + lengths[end] <= budget):
        used += lengths[end]
        end += 1
    return end


def finish(vectors: np.ndarray, dimensions: Optional[int], normalize: bool) -> list[list[float]]:
    """Pooled vectors (one per row) as sent: the first ``dimensions`` (all if None or
    more than there are), at unit length with ``normalize`` (a zero vector stays zero)."""
    out = np.asarray(vectors, dtype=np.float64)
    if dimensions is not None:
        out = out[:, :dimensions]
    if normalize:
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        out = out / np.where(norms > 0, norms, 1.0)
    return out.tolist()


def max_inputs(n_embd: int) -> int:
    """How many vectors of ``n_embd`` dimensions one reply holds within the message limit."""
    fits = (MAX_MESSAGE_BYTES - REPLY_SLACK) // (n_embd * BYTES_PER_FLOAT + 16)
    return max(1, min(MAX_EMBED_INPUTS, fits))
