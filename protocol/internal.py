"""The messages between tandem's own processes, which clients never see.

The daemon front, the target worker and the drafter worker speak these among
themselves over private PAIR sockets, with the same codec as clients. They may
change shape between versions (both ends always come from the same install);
``messages.py`` holds what clients speak. Each table is what one receiver
decodes with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Optional

import numpy as np

from .messages import (
    REQUESTS,
    CacheCleared,
    CacheInfo,
    Cancel,
    Chunk,
    Detokenized,
    Done,
    Embed,
    Embedded,
    Error,
    GovernorInfo,
    Message,
    ModelInfo,
    Op,
    Shutdown,
    Tokenized,
)


@dataclass
class Ready(Message):
    """a worker tells the daemon its model is loaded."""

    op: ClassVar[Op] = Op.READY
    id: str  # the worker's role, e.g. "target"
    model: ModelInfo
    pid: int
    governor: Optional[GovernorInfo] = None  # the target's governor as loaded from the state directory
    cache: Optional[CacheInfo] = None  # the prefix cache, if the daemon has one


@dataclass
class Progress(Message):
    """the target worker is working on request ``id`` (a heartbeat, sent at
    most once a second from its decoding loop; a worker that sends none within the
    daemon's worker_timeout is treated as hung)."""

    op: ClassVar[Op] = Op.PROGRESS
    id: str


@dataclass
class CacheState(Message):
    """the target worker's prefix cache after work between requests (pages
    written to the disk tier): what ``status`` shows until the next request."""

    op: ClassVar[Op] = Op.CACHE_STATE
    id: str  # "target"
    cache: CacheInfo


@dataclass
class DrafterState(Message):
    """the daemon tells the target worker its drafter worker died
    (``available`` false: decode plainly) or was restarted (true: start afresh with it)."""

    op: ClassVar[Op] = Op.DRAFTER_STATE
    id: str
    available: bool


@dataclass
class DrafterHung(Message):
    """the target worker's drafter did not answer in time (the daemon kills and restarts it)."""

    op: ClassVar[Op] = Op.DRAFTER_HUNG
    id: str  # the request being decoded
    message: str


@dataclass
class SamplingParams:
    """How a request samples: temperature (0 = greedy), top-k (0 = off), top-p
    (1 = off) and the seed of its random stream."""

    temperature: float
    top_k: int
    top_p: float
    seed: int


@dataclass
class DraftRequest(Message):
    """The target worker asks the drafter worker for k tokens.

    The drafter first makes its context ``its first `keep` tokens + append``
    (rolling its KV cache back past tokens the target rejected), then drafts."""

    op: ClassVar[Op] = Op.DRAFT
    id: str  # the generate request's id
    keep: int
    append: list[int]
    k: int
    sampling: SamplingParams  # the drafter seeds its own sampler from this when ``new_request``
    p_min: float = 0.0  # stop early when the drafter's probability for its next guess is below
    new_request: bool = False
    # prefix-cache pages in the daemon's arena (offsets), done before anything else:
    store: list[list[int]] = field(default_factory=list)  # [start token, offset]: write these pages of the KV state
    restore: list[int] = field(default_factory=list)  # replace the KV state by these pages (then keep <= their tokens)


@dataclass
class Drafted(Message):
    """the drafter's k tokens and its distributions q for them, as raw
    arrays: position i has ``q_lens[i]`` entries of ``q_ids``/``q_probs``."""

    op: ClassVar[Op] = Op.DRAFTED
    id: str
    tokens: list[int]
    n_cached: int  # tokens now in the drafter's KV cache (context + all but the last draft)
    q_ids: np.ndarray
    q_probs: np.ndarray
    q_lens: list[int]
    page_bytes: int = 0  # bytes of one prefix-cache page of the drafter's KV (0: no prefix cache)


@dataclass
class Pace(Message):
    """the daemon tells the embedding worker that a generation started (``generating``
    true: embed in small slices on one thread, so the target keeps its speed) or that
    none runs (false: every thread, whole batches)."""

    op: ClassVar[Op] = Op.PACE
    id: str
    generating: bool


WORKER_REQUESTS: dict[Op, type] = {**REQUESTS, Op.DRAFTER_STATE: DrafterState}
"""What the target worker decodes: the daemon's requests, and the drafter's state."""
WORKER_REPLIES: dict[Op, type] = {
    m.op: m
    for m in (
        Chunk,
        Done,
        Error,
        CacheCleared,
        Ready,
        Progress,
        DrafterHung,
        Tokenized,
        Detokenized,
        CacheState,
        Embedded,
    )
}
"""What the daemon decodes from its workers (the drafter worker sends only ready or error)."""
DRAFTER_REQUESTS: dict[Op, type] = {m.op: m for m in (DraftRequest, Shutdown)}
"""What the drafter worker decodes, from the target worker (draft) and the daemon (shutdown)."""
DRAFTER_REPLIES: dict[Op, type] = {m.op: m for m in (Drafted, Error)}
"""What the target worker decodes from the drafter worker."""
EMBEDDER_REQUESTS: dict[Op, type] = {m.op: m for m in (Embed, Pace, Cancel, Shutdown)}
"""What the embedding worker decodes, from the daemon (cancel: of the embed it is computing)."""
