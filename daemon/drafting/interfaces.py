"""What the engine needs of a model and of a drafter, and nothing that loads one.

``Model`` is the part of ``LlamaModel`` the engine calls; ``Drafter`` is what
proposes tokens for the target to verify (``NgramDrafter`` in ngram.py, the
model drafter's client in drafter_client.py). Both live here, apart from
llama.cpp, so the engine, the governor and their tests import no model runtime.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Callable, Optional, Protocol, Sequence

import numpy as np

if TYPE_CHECKING:
    from tandem.protocol import ErrorCode

    from ..cache.page_store import PageStore
    from .sampler import Sampler
    from .speculative import SparseDist


class DecodeAborted(Exception):
    """``abort()`` returned True between two batches of a long decode."""


class RequestError(Exception):
    """The request cannot be served as given; ends it with an ``error`` reply."""

    def __init__(self, code: "ErrorCode", message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class Model(Protocol):
    n_ctx: int
    n_ctx_train: int
    n_past: int
    eos_token: int

    def tokenize(self, text: str, add_special: bool, parse_special: bool = True) -> list[int]: ...
    def piece(self, token: int) -> bytes: ...
    def is_eog(self, token: int) -> bool: ...
    def fim_tokens(self) -> Optional[tuple[int, int, int]]: ...
    def clear(self) -> None: ...
    def truncate(self, n_keep: int) -> None: ...
    def decode(
        self, tokens: Sequence[int], logits_for: Sequence[int] = (-1,), abort: Optional[Callable[[], bool]] = None
    ) -> np.ndarray: ...


class Drafter(abc.ABC):
    """Proposes tokens for the target to verify.

    A subclass implements ``propose``; the rest has defaults that suit a drafter
    without state of its own (no KV cache, no process): nothing to start, always
    ready, no prefix-cache pages, never down."""

    # True: proposing costs next to nothing (prompt lookup: no model runs), so a
    # governed request asks for a proposal every round and the governor weighs its
    # ``evidence`` (see governor.py); False: proposing costs a drafter's steps.
    free_proposals = False
    evidence = 0  # of the last proposal: how many tokens the match it copies after is long

    def begin(self, request_id: str, prompt: list[int], sampler: "Sampler", prefill: bool = True) -> None:
        """A new request; ``prefill``: start reading the prompt now (in parallel with the target)."""

    @abc.abstractmethod
    def propose(self, context: list[int], k: int, p_min: float) -> tuple[list[int], Optional[list["SparseDist"]]]:
        """Up to ``k`` tokens to follow ``context``, and their distributions q
        (None at temperature 0)."""

    def sync(self, context: list[int]) -> Optional[bool]:
        """Catch up on ``context`` without drafting (before the first drafting
        round after plain ones, so the governor times drafting, not catching up).
        False: it did not get there (broke down, timed out, cancelled); None or
        True: it did."""

    def behind(self, context: list[int]) -> int:
        """How many tokens of ``context`` ``sync`` would have to read (what the
        governor predicts catching up costs from): 0 for a drafter without a KV cache."""
        return 0

    def ready(self) -> bool:
        """False while it is still working on something sent earlier (reading the prompt)."""
        return True

    def use_pages(self, pages: Optional["PageStore"]) -> None:
        """The prefix cache of this request (None: none, or not used): a drafter
        with a KV cache of its own restores its pages of the prompt from it."""

    def store(self, tokens: Sequence[int]) -> None:
        """The request is over: keep this drafter's pages of ``tokens`` in the prefix cache."""

    def finished(self, context: list[int], prompt_tokens: int) -> None:
        """The request is over: ``context`` is its prompt (the first ``prompt_tokens``)
        and its reply. Called for every request of a daemon with this drafter,
        drafting or not, except those sent with ``cache: false``."""

    def forget(self) -> None:
        """Keep nothing of earlier requests (a ``cache: false`` request, a cache clear)."""

    def go_down(self) -> None:
        """Its process died: propose nothing until ``revive``."""

    def revive(self) -> None:
        """Its process is back: use it again from the next request on."""
