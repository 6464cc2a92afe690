"""Prompt-lookup drafting: no model, just the context.

Agent loops and code edits copy long runs from their prompt. To draft k
tokens, find the longest n-gram (n from ``max_ngram`` down to ``min_ngram``)
that ends the context and also occurs earlier in it, take its most recent
earlier occurrence, and propose the tokens that followed it. The proposals are
deterministic, so their q is one-hot.

The index maps each n-gram to the positions where it ends and is extended
incrementally as tokens are appended, so drafting costs O(max_ngram) lookups
per round regardless of context length.
"""

from __future__ import annotations

from typing import Sequence

from .interfaces import Drafter
from .speculative import SparseDist


class NgramDrafter(Drafter):
    free_proposals = True

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.tokens: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}  # n-gram -> end index (exclusive) of its latest occurrence

    def reset(self, tokens: Sequence[int]) -> None:
        self.tokens = []
        self._last_end = {}
        self.extend(tokens)

    def truncate(self, n_keep: int) -> None:
        if n_keep < len(self.tokens):
            self.reset(self.tokens[:n_keep])

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            # index the n-grams ending just before t (not those ending at the very end,
            # so a suffix never matches itself)
            end = len(self.tokens)
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end >= n:
                    self._last_end[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(t)

    def draft(self, k: int) -> list[int]:
        self.evidence = 0
        if k <= 0:
            return []
        end = len(self.tokens)
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            key = tuple(self.tokens[end - n :])
            at = self._last_end.get(key)
            if at is not None and at < end:
                self.evidence = n
                return self.tokens[at : at + k]
        return []

    # ---- the engine's Drafter interface

    def begin(self, request_id: str, prompt: Sequence[int], sampler, prefill: bool = True) -> None:
        self.reset(prompt)

    def sync(self, context: Sequence[int]) -> None:
        self._catch_up(context)

    def ready(self) -> bool:
        return True

    def propose(self, context: Sequence[int], k: int, p_min: float):
        """Within a request the context only grows, so catching up is an append."""
        self._catch_up(context)
        drafts = self.draft(k)
        return drafts, [SparseDist.one_hot(d) for d in drafts]

    def _catch_up(self, context: Sequence[int]) -> None:
        n = len(self.tokens)
        if len(context) < n or (n and context[n - 1] != self.tokens[-1]):
            self.reset(context)
        else:
            self.extend(context[n:])
