"""What one request carries while it is decoded: its prompt, sampler, drafting
knobs and output so far (``Engine._begin`` makes it; the engine's rounds and
``Engine._finish`` read and update it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from tandem.protocol import Decoding, DraftStats, FinishReason

from ..constraints.constraint import Constraint
from ..constraints.tools import CallOpener, ToolCallParser
from ..drafting.governor import Governor
from ..drafting.interfaces import Drafter
from ..drafting.sampler import Sampler
from ..models.reasoning import Reasoning, Splitter
from .textstream import TextStream

if TYPE_CHECKING:
    from ..cache.page_store import PageStore


@dataclass
class RequestState:
    """One request while it is decoded: what it asked for, how it is decoded,
    and what it produced so far."""

    req: Decoding
    tokens: list[int]  # the prompt
    sampler: Sampler
    stream: TextStream
    k: int  # draft length asked for
    p_min: float
    drafter: Optional[Drafter]  # None: this request does not draft
    governor: Optional[Governor]  # None: every round drafts (or none does)
    stats: Optional[DraftStats]  # draft rounds, when it may draft
    cache: Optional["PageStore"]  # the prefix cache, when this request uses it
    started: float
    constraint: Optional[Constraint] = None  # the response_format's grammar state; None: any text
    parser: Optional[ToolCallParser] = None  # with tools: splits the output into text and calls
    pending: Optional[CallOpener] = None  # tool_choice auto: the calls' grammar, from the token that opens one
    content: str = ""  # with tools: the text outside the calls, as streamed
    cached: int = 0  # prompt tokens restored from the prefix cache
    prefilled: float = 0.0
    reading_from: float = 0.0  # when the reading of what the cache did not hold began
    on_reading: Optional[Callable[[], bool]] = None  # a progress request's reporting cancel check (Engine._reporting)
    first_token_at: float = 0.0
    completion: list[int] = field(default_factory=list)
    drafted_last: bool = False  # the previous round drafted
    forced_last: bool = False  # the previous round was the grammar's forced tokens (jump-forward)
    # the last round: drafts, accepted, drafter seconds, target seconds, tokens the target read
    last_round: tuple[int, int, float, float, int] = (0, 0, 0.0, 0.0, 1)
    # when the last timed round's pass (and sampling) ended: to the next timed round's
    # start is what a round costs outside its pass (PassCosts.outside); None: not timed
    round_ended: Optional[float] = None
    finish: Optional[FinishReason] = None
    within: bool = False  # served between two rounds of another request (the lane): no drafter
    paused: float = 0.0  # seconds it waited between two rounds while a short request was served (the lane)
    paused_reading: float = 0.0  # ... and between two passes of its prompt's reading
    draft_off: Optional[str] = None  # drafting asked for but off: it would change greedy output here
    # a reasoning model's chat: its format, the split of the output into thinking and answer, the thinking
    # so far and its tokens, the budget (None: none), and tokens to write for the model before its next one
    reasoning: Optional[Reasoning] = None
    splitter: Optional[Splitter] = None
    thought: str = ""
    reasoning_tokens: int = 0
    thinking_budget: Optional[int] = None
    inject: list[int] = field(default_factory=list)
    injected: int = 0  # of the round being taken, the leading tokens that were written, not sampled

    def context(self) -> list[int]:
        return self.tokens + self.completion
