"""The governor: draft only while drafting is measurably faster than plain decoding.

On a 2-core laptop a verify pass over k+1 tokens costs 2-3 one-token passes, so
a model drafter is usually slower than plain decoding; the governor decides,
round by round, whether to draft, from what this machine actually does.

**Measuring.** Every round is timed from before the drafter is asked to after
the target's rollback (drafting rounds) or around the one-token step (plain
rounds). Each kind has a ``MovingRate``: moving averages of tokens per round
and of seconds per round, whose ratio is the rate in tokens/s. An update has
weight ``max(1/window, 1/n)``, n = rounds since the average was last
restarted: the exact mean of the rounds since the restart until there are
``window`` (16) of them, then exponential with a time constant of ``window``
rounds. A probe restarts the drafting average and a refresh restarts the plain
one: what they measure replaces an estimate that is tens of rounds old. A
drafting round in which the drafter had nothing to propose (an n-gram drafter
without a match) counts as a drafting round: it is what drafting mode does.

**Phases.** ``measuring`` (2 plain rounds; a new governor measures plain
decoding first) -> ``drafting``. In ``drafting``, once the drafting average has
2 rounds, drafting goes on while it is at least ``threshold`` (1.02) times the
plain rate, else -> ``plain``; after every 64 drafting rounds ->
``refreshing`` (2 plain rounds), then back to ``drafting`` if drafting still
wins, else ``plain``. In ``plain``, after ``interval`` plain rounds (32 at
first) -> ``probing`` (2 drafting rounds): a success returns to ``drafting``
and resets the interval to 32; a failure doubles it (up to 512) and waits
again. Turning drafting off from ``drafting`` waits the current interval
without doubling it: only failed probes double.

**Catching up.** Before a probe, a model drafter must first read what the
target decoded while it was idle (and, if the request began in ``plain``, the
prompt): on 2 cores that costs as much as the drafter's share of a prefill. It is
not timed as drafting (it is paid once per switch, not per round), but it is
not free either: plain rounds pay for it at ``catch_up_share`` (1%) of their
time, in advance. When the interval has run out, the governor predicts what
catching up would cost now (the tokens the drafter lacks, from the engine, times
its seconds per token read: ``PassCosts.catch_up``) and, if that is more
than it has already paid for, adds the difference / ``catch_up_share`` to its
debt: the probe waits until plain rounds have paid it. What catching up then
actually costs beyond what was paid for becomes debt for the next probe. So
within one request that began plain (whose drafter skipped the prompt) a probe
rarely falls due, as each token decoded adds to what it would read; the debt is
paid over requests, and the probe comes once catching up costs no more than
what was charged, often early in a later request. The price of this bound: a
task with long prompts that starts plain probes rarely (an 8,000-token prompt
at 4 ms a token is 32 s to charge: an hour of plain decoding first), unless the
drafter's pages of its prompt are in the prefix cache (``behind`` counts only
what it would read, not what it would restore). The cost a token is
``PassCosts.read_seen`` once learnt (kept in the state file), else
``read_prior``. Without pass costs nothing is predicted: a catch-up is charged
to the next probe only. Measured before this bound: one probe's catch-up took
1 s of a 2.9 s request.

**Predicting (with ``PassCosts``).** The target worker measures, at load, what
one pass over 1 ... k+1 tokens costs on this machine; timed rounds and idle time
correct those costs (and the drafter's step cost) with moving averages, a pass's
level from plain rounds and each width's shape relative to a plain round's pass (see
``PassCosts``), and measure what a round costs outside its pass. With them and the
task's acceptance α (accepted drafts over accepted plus rejected ones, smoothed
toward the α of every task seen), a drafting round of k drafts is predicted to
give (1 - α^(k+1)) / (1 - α) tokens in pass(k+1) + k·step + outside seconds (a
plain round: one token in a plain round's pass + outside). That chooses
the draft length of every drafting round (the k that maximises predicted
tokens/s), lets a new task start ``plain`` (the drafter does not even read its
prompt) when drafting is predicted not to pay, and bounds what probing costs:
probes fall due no more often than a worst-case probe (α = 0) costs
``probe_budget`` (1%) of the plain time between them. A probe is one round of
k drafts (the most acceptance observations per round) and succeeds when drafting
at the best length is predicted to pay with the acceptance it measured (not by
its own speed); once drafting, the measured averages above decide whether it
goes on.

**Free proposals (prompt lookup: ``Drafter.free_proposals``).** A drafter
without a model proposes at next to no cost, so, where pass costs are known, the
governor does not probe: the engine asks for a proposal every round, with its
evidence (the length of the match it copies from), and the governor verifies the
predicted best number of its drafts (0: a plain round) from the acceptance
measured for proposals of that evidence (``GATE_BUCKETS``: match lengths 1, 2-3,
4-7, ... 64+; unseen evidence counts as ``gate_prior``). A proposal a plain round
did not verify is followed in the tokens decoding produces instead (a *shadow*,
one at a time, none under a grammar): how many of its drafts they repeat
estimates what verifying them would have accepted, in distribution too when
sampling, since its q is one-hot. A shadow still holding when its request ends
counts what it matched, with no rejection. So a copy-heavy stretch is found
within a proposal or two and drafted, and a task where copies do not hold learns
that without a target pass.

A ``GovernorBank`` keeps one governor per task (see ``task_key``) and persists
them; ``Engine`` drives them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from tandem.protocol import GovernorInfo

log = logging.getLogger("tandem.governor")

STATE_VERSION = 1

MEASURING = "measuring"
DRAFTING = "drafting"
REFRESHING = "refreshing"
PLAIN = "plain"
PROBING = "probing"
PHASES = (MEASURING, DRAFTING, REFRESHING, PLAIN, PROBING)
DRAFTING_PHASES = (DRAFTING, PROBING)


@dataclass(frozen=True)
class GovernorParams:
    threshold: float = 1.02  # drafting must be at least this many times as fast as plain
    window: int = 16  # rounds: the moving averages' time constant
    measure_rounds: int = 2  # plain rounds when a governor starts and at each refresh
    probe_rounds: int = 2  # drafting rounds of a probe (and the first drafting decision)
    predicted_probe_rounds: int = 1  # with pass costs: a probe's k drafts are what it is for, not its speed
    refresh_every: int = 64  # drafting rounds between refreshes of the plain estimate
    first_interval: int = 32  # plain rounds before the first re-probe
    max_interval: int = 512
    catch_up_share: float = 0.01  # at most this share of plain time goes to catching the drafter up for probes
    probe_budget: float = 0.01  # with pass costs: a failed probe costs at most this share of the time between probes
    prior_weight: float = 1.0  # with pass costs: drafts' worth of weight the pooled α has for a task
    alpha_window: int = 64  # drafting rounds: acceptance counts decay with this time constant
    gate_prior: float = 0.5  # free proposals: the acceptance assumed of evidence not seen yet (weight prior_weight)


GATE_BUCKETS = 7  # free proposals' evidence: match lengths 1, 2-3, 4-7, 8-15, 16-31, 32-63, 64+


def evidence_bucket(match: int) -> int:
    """The bucket (1 ... GATE_BUCKETS) of a proposal copied after a match of ``match`` tokens."""
    return min(max(match, 1).bit_length(), GATE_BUCKETS)


def bucket_label(bucket: int) -> str:
    """The match lengths of an evidence bucket: "1", "2-3", ... "64+"."""
    low = 1 << (bucket - 1)
    return f"{low}+" if bucket >= GATE_BUCKETS else (str(low) if low == 1 else f"{low}-{2 * low - 1}")


@dataclass
class MovingRate:
    """tokens/s over rounds: the ratio of the moving averages of tokens and of
    seconds per round (a rate of ratios would let one fast round dominate)."""

    window: int
    tokens: float = 0.0
    seconds: float = 0.0
    n: int = 0  # rounds since the last restart

    def add(self, tokens: float, seconds: float) -> None:
        self.n += 1
        w = max(1.0 / self.window, 1.0 / self.n)
        self.tokens += w * (tokens - self.tokens)
        self.seconds += w * (seconds - self.seconds)

    def restart(self) -> None:
        """The next round replaces the estimate (which is reported until then)."""
        self.n = 0

    @property
    def rate(self) -> Optional[float]:
        return self.tokens / self.seconds if self.seconds > 0 else None


def per_token(r: Optional[MovingRate], default: float) -> float:
    """Seconds per token of a moving average (its mean seconds per round when each
    round adds 1.0), or ``default`` before it has any."""
    return r.seconds / r.tokens if r is not None and r.tokens > 0 else default


MAX_DEBT = 1e6  # seconds: what a state file holds (it rejects 1e7 and more: see Governor.from_dict)
MIN_SECONDS = 1e-9  # a cost floor: a round timed at 0 s (a coarse clock) never divides by zero


@dataclass
class PassCosts:
    """What a round costs on this machine: the target's pass over w tokens and
    the drafter's step per drafted token (a prior until drafting rounds measure it).
    Shared by every task's governor: it is the machine's, not the task's.

    A pass's cost is kept in two parts: its *level*, what a plain round's pass
    (``plain_width`` tokens) costs now, which plain rounds measure, and its
    *shape*, what a pass over w tokens costs relative to a plain round's
    (measured at load; then by every timed round of that width, relative to the
    level then; and in idle time for every width, relative to plain-width passes
    timed beside it: Engine.refresh_pass_costs). So what another process does to
    the machine while a width is measured moves the level, which the next plain
    rounds correct, and not that width's cost for as long as no round runs it
    again (measured: a daemon re-measuring its passes while another served
    requests timed a 2-token pass at 359 ms, 8 one-token passes). A round's
    shape is not learnt while the level is not a plain round's of the last
    ``window`` rounds (none yet, or a long stretch of drafting): it would carry
    what changed meanwhile into the shape.
    """

    load: dict[int, float]  # seconds of one target pass over w tokens, measured at load
    drafter_prior: float  # seconds per drafted token before any was measured
    window: int = 16
    plain_width: int = 1  # tokens a plain round reads: 2 with exact steps (the guess, see rounds.py: Rounds._round)
    read: Optional[float] = None  # seconds per token of the target reading a prompt, measured at load
    seen: Optional[MovingRate] = None  # seconds per plain round's pass, as plain rounds ran (the level)
    shape: dict[int, MovingRate] = field(default_factory=dict)  # by width: a pass / a plain round's, as measured
    drafter_seen: Optional[MovingRate] = None
    read_seen: Optional[MovingRate] = None  # the drafter catching up: tokens read, seconds
    read_learnt: bool = False  # read_seen has a catch-up of this process in it (not only the state file's)
    outside_seen: Optional[MovingRate] = None  # seconds a round spends outside its passes and drafts, as rounds ran
    since_level: int = 0  # rounds of other widths observed since the last plain round's

    def read_prior(self) -> float:
        """Seconds per token a drafter catching up reads, before one was measured: its
        step cost times what a token of a prompt costs the target to read relative
        to its one-token pass (``read``, measured at load; else its widest pass's)."""
        if self.read is not None:
            per_token = self.read
        else:
            widest = max(self.load)
            per_token = self.target(widest) / widest
        return self.drafter() * min(1.0, per_token / self.target(1))

    def catch_up(self, tokens: int) -> float:
        """Predicted seconds for the drafter to read ``tokens`` it lacks."""
        if tokens <= 0:
            return 0.0
        return tokens * per_token(self.read_seen, self.read_prior())

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        if tokens >= READ_MIN_TOKENS:
            self.read_learnt = True
            if self.read_seen is None:
                self.read_seen = MovingRate(self.window)
            self.read_seen.add(float(tokens), seconds)

    def __post_init__(self) -> None:
        if not self.load or any(w < 1 or not v > 0 for w, v in self.load.items()):
            raise ValueError("pass costs need a positive cost for at least one width >= 1")

    def _at_load(self, w: int) -> float:
        widths = sorted(self.load)
        if w in self.load:
            return self.load[w]
        lo = [x for x in widths if x < w]
        hi = [x for x in widths if x > w]
        if lo and hi:
            a, b = lo[-1], hi[0]
            return self.load[a] + (self.load[b] - self.load[a]) * (w - a) / (b - a)
        if len(widths) == 1:
            return self.load[widths[0]] * w / widths[0]
        a, b = (widths[-2], widths[-1]) if lo else (widths[0], widths[1])
        slope = max(0.0, (self.load[b] - self.load[a]) / (b - a))
        return max(self.load[a] + slope * (w - a), 1e-9)

    def ratio(self, w: int) -> float:
        """What a pass over ``w`` tokens costs relative to a plain round's pass."""
        if w == self.plain_width:
            return 1.0
        return per_token(self.shape.get(w), self._at_load(w) / self._at_load(self.plain_width))

    def level(self) -> float:
        """Seconds of a plain round's pass now: as plain rounds ran, else at load."""
        return max(per_token(self.seen, self._at_load(self.plain_width)), MIN_SECONDS)

    def target(self, w: int) -> float:
        """Seconds of one target pass over ``w`` tokens, as this machine runs them now."""
        return max(self.ratio(w) * self.level(), MIN_SECONDS)

    def outside(self) -> float:
        """Seconds each round spends outside the target's pass and the drafter's
        steps, plain or drafting alike (streaming its tokens, asking a lookup
        drafter, the Python between passes); 0 until rounds measured it."""
        return per_token(self.outside_seen, 0.0)

    def observe_outside(self, seconds: float) -> None:
        if self.outside_seen is None:
            self.outside_seen = MovingRate(self.window)
        self.outside_seen.add(1.0, max(seconds, 0.0))

    def drafter(self) -> float:
        return per_token(self.drafter_seen, self.drafter_prior)

    def observe_target(self, w: int, seconds: float) -> None:
        """A round's pass over ``w`` tokens took ``seconds``: a plain round's moves
        the level; another's, that width's shape (relative to the level now, when
        plain rounds measured it lately)."""
        if w == self.plain_width:
            if self.seen is None:
                self.seen = MovingRate(self.window)
            self.seen.add(1.0, seconds)
            self.since_level = 0
            return
        self.since_level += 1
        if self.seen is not None and self.since_level <= self.window:
            self.observe_shape(w, seconds / self.level())

    def observe_shape(self, w: int, ratio: float) -> None:
        """A pass over ``w`` tokens was measured at ``ratio`` plain rounds' passes."""
        if w >= 1 and w != self.plain_width and ratio > 0:
            self.shape.setdefault(w, MovingRate(self.window)).add(1.0, ratio)

    def observe_drafter(self, drafted: int, seconds: float) -> None:
        if drafted > 0:
            if self.drafter_seen is None:
                self.drafter_seen = MovingRate(self.window)
            self.drafter_seen.add(float(drafted), seconds)

    def round_seconds(self, k: int) -> float:
        return self.target(max(k + 1, self.plain_width)) + k * self.drafter()

    def speedup(self, k: int, alpha: float) -> float:
        """Predicted tokens/s of rounds with ``k`` drafts over plain rounds' (a
        plain round of exact steps is counted as one token: its guess rarely holds).
        Both kinds of round pay what a round costs outside its pass (``outside``)
        once: a drafting round spreads it over the tokens it yields."""
        a = min(max(alpha, 0.0), 0.999)
        tokens = (1 - a ** (k + 1)) / (1 - a)
        outside = self.outside()
        return tokens * (self.target(self.plain_width) + outside) / (self.round_seconds(k) + outside)

    def best(self, alpha: float, k_max: int) -> tuple[int, float]:
        """(the draft length in 1..k_max with the highest predicted speedup, that speedup)."""
        options = [(self.speedup(k, alpha), -k) for k in range(1, max(1, k_max) + 1)]
        speedup, k = max(options)
        return -k, speedup

    def probe_interval(self, probe_rounds: int, budget: float, k: int = 1) -> int:
        """Plain rounds between probes so that a probe that finds nothing (α = 0:
        each of its rounds, of ``k`` drafts, yields one token) costs at most
        ``budget`` of the time they take."""
        plain = self.target(self.plain_width)
        excess = probe_rounds * max(0.0, self.round_seconds(k) - plain)
        return max(1, math.ceil(excess / (budget * (plain + self.outside()))))


READ_TOKENS = 64  # the prompt the target reads at load, for what reading costs a token (PassCosts.read)
READ_MIN_TOKENS = 32  # a catch-up that reads fewer is mostly a round trip: not what reading a prompt costs


def _filler(model, n: int) -> list[int]:
    """At least ``n`` tokens of plain text to time passes over."""
    tokens = model.tokenize("The quick brown fox jumps over the lazy dog. " * 8, add_special=True)
    while len(tokens) < n:
        tokens = tokens + tokens
    return tokens


def measure_read_cost(model, n: int = READ_TOKENS) -> Optional[float]:
    """Seconds per token of the target reading an ``n``-token prompt the way it
    reads prompts (fast prefill where it has it), once, from an empty context
    (cleared afterwards); None where the context has no room for it."""
    if n >= model.n_ctx:
        return None
    tokens = _filler(model, n)
    try:
        model.clear()
        started = time.perf_counter()
        if getattr(model, "prefill_chunk", 0):
            model.prefill(tokens[:n])
        else:
            model.decode(tokens[:n])
        return (time.perf_counter() - started) / n
    finally:
        model.clear()


def measure_pass_costs(model, widths, reps: int = 3, prefix: int = 32) -> dict[int, float]:
    """Median seconds of one decode pass over w tokens for each w, after a
    ``prefix``-token context (the model is cleared afterwards)."""
    import statistics

    widths = sorted(set(widths))
    need = prefix + max(widths)
    if need >= model.n_ctx:
        return {}
    tokens = _filler(model, need)
    out: dict[int, float] = {}
    try:
        model.clear()
        model.decode(tokens[:prefix])
        # one pass of each width first, untimed: right after a load the first passes run slower (measured:
        # a one-token pass 34 ms, then 25.5), and an inflated one-token cost makes drafting look cheap
        for w in widths:
            model.decode(tokens[prefix : prefix + w], logits_for=range(w))
            model.truncate(prefix)
        for w in widths:
            times = []
            for _ in range(reps):
                started = time.perf_counter()
                model.decode(tokens[prefix : prefix + w], logits_for=range(w))
                times.append(time.perf_counter() - started)
                model.truncate(prefix)
            out[w] = statistics.median(times)
    finally:
        model.clear()
    return out


@dataclass
class Governor:
    params: GovernorParams = field(default_factory=GovernorParams)
    clock: Callable[[], float] = time.perf_counter
    phase: str = MEASURING
    left: int = -1  # rounds left in measuring / refreshing / probing
    countdown: int = 0  # plain rounds until the next probe
    interval: int = -1
    since_refresh: int = 0  # drafting rounds since the plain estimate was refreshed
    plain_rounds: int = 0
    draft_rounds: int = 0
    probes: int = 0
    failed_probes: int = 0
    debt: float = 0.0  # seconds of plain rounds still to run before the next probe (catch-up costs)
    charged: float = 0.0  # seconds of the next probe's catch-up already charged to the debt (paid in advance)
    accepted: float = 0.0  # drafts accepted (decaying over ``alpha_window`` drafting rounds)
    rejected: float = 0.0  # drafting rounds that ended in a rejected draft (decaying likewise)
    alpha_prior: float = 0.5  # the pooled α of every task when this one started
    costs: Optional[PassCosts] = field(default=None, repr=False)  # the machine's, shared; None: no predictions
    k_max: int = 4  # the daemon's draft length: what probes draft and predictions are for
    # free proposals: [accepted, rejected] per evidence bucket (decaying like ``accepted``)
    gate: dict[int, list[float]] = field(default_factory=dict)
    shadow: Optional[list] = field(default=None, repr=False)  # [drafts, bucket, matched so far]: not verified
    plain: MovingRate = field(init=False)
    draft: MovingRate = field(init=False)
    _started: Optional[float] = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        p = self.params
        self.plain = MovingRate(p.window)
        self.draft = MovingRate(p.window)
        if self.left < 0:
            self.left = p.measure_rounds
        if self.interval < 0:
            self.interval = p.first_interval

    # ---- the engine's side

    @property
    def drafting(self) -> bool:
        """Whether the next round drafts."""
        return self.phase in DRAFTING_PHASES

    @property
    def alpha(self) -> float:
        """This task's acceptance rate, smoothed toward the pooled prior."""
        w = self.params.prior_weight
        return (self.accepted + w * self.alpha_prior) / (self.accepted + self.rejected + w)

    def draft_length(self, k_max: int) -> int:
        """Drafts in the next drafting round: with pass costs, the predicted best
        (``k_max`` in a probe: the most acceptance observations); without, ``k_max``."""
        if self.costs is None or k_max <= 1 or self.phase == PROBING:
            return k_max  # a probe drafts the most: each round then observes up to k_max drafts
        return self.costs.best(self.alpha, k_max)[0]

    def predicted_speedup(self, k_max: int) -> Optional[float]:
        if self.costs is None:
            return None
        return self.costs.best(self.alpha, k_max)[1]

    def observe(
        self, drafted: int, accepted: int, drafter_seconds: float, target_seconds: float, width: int = 0
    ) -> None:
        """What a timed round did: its drafts (0: a plain round), how many the
        target kept, how long the drafter and the target's pass took, and how
        many tokens that pass read (0: drafted + 1)."""
        if self.costs is not None:
            self.costs.observe_target(width or drafted + 1, target_seconds)
            if drafted:
                self.costs.observe_drafter(drafted, drafter_seconds)
        if drafted:
            decay = 1.0 - 1.0 / self.params.alpha_window
            self.accepted = self.accepted * decay + accepted
            self.rejected = self.rejected * decay + (1.0 if accepted < drafted else 0.0)

    def start_round(self) -> None:
        self._started = self.clock()

    def end_round(self, tokens: int, behind: Optional[Callable[[], int]] = None) -> None:
        """The round started by ``start_round`` produced ``tokens``; ``behind``: how
        many tokens the drafter would read to catch up now (asked only when a probe
        is about to fall due; None: nothing)."""
        assert self._started is not None, "end_round without start_round"
        seconds = self.clock() - self._started
        self._started = None
        self.record(tokens, seconds, behind)

    def caught_up(self, seconds: float, tokens: int = 0) -> None:
        """The drafter took ``seconds`` to read ``tokens`` it lacked before drafting:
        what was not paid for in advance becomes debt for the next probe."""
        if self.costs is not None:
            self.costs.observe_catch_up(tokens, seconds)
        self.debt = min(self.debt + max(0.0, seconds - self.charged) / self.params.catch_up_share, MAX_DEBT)
        self.charged = 0.0

    def _catch_up_paid(self, behind: Optional[Callable[[], int]]) -> bool:
        """Whether the catch-up a probe would need now has been paid for; if not,
        charge what is missing to the debt (see the module's docstring)."""
        if behind is None or self.costs is None:
            return True
        cost = min(self.costs.catch_up(behind()), MAX_DEBT * self.params.catch_up_share)
        if cost <= self.charged:
            return True
        self.debt = min(self.debt + (cost - self.charged) / self.params.catch_up_share, MAX_DEBT)
        self.charged = cost
        return self.debt <= 0

    def skip_round(self) -> None:
        """The round started did not run as asked (no room left to draft): not counted."""
        self._started = None

    # ---- free proposals (see the module's docstring)

    def gate_alpha(self, bucket: int) -> float:
        """The acceptance measured for proposals of this evidence bucket, smoothed toward ``gate_prior``."""
        accepted, rejected = self.gate.get(bucket, (0.0, 0.0))
        w = self.params.prior_weight
        return (accepted + w * self.params.gate_prior) / (accepted + rejected + w)

    def gated_length(self, proposed: int, match: int) -> int:
        """How many drafts of a free proposal of ``proposed`` tokens, copied after a
        match of ``match`` tokens, to verify: the predicted best, 0 (a plain round)
        when no length is predicted to pay."""
        if proposed <= 0 or self.costs is None:
            return 0
        k, speedup = self.costs.best(self.gate_alpha(evidence_bucket(match)), min(proposed, self.k_max))
        return k if speedup >= self.params.threshold else 0

    def gated_round(
        self, proposal: list[int], match: int, drafted: int, accepted: int, tokens: list[int], seconds: Optional[float]
    ) -> None:
        """A round of free proposals ran: the engine proposed ``proposal`` (after a
        match of ``match``), verified ``drafted`` of it (0: a plain round) and kept
        ``accepted``; the round added ``tokens`` in ``seconds`` (None: not timed)."""
        if drafted:
            self._gate_add(evidence_bucket(match), accepted, drafted)
        if self.shadow is not None:
            # (a shadow that ends at this round's token leaves no new one from this
            # round's proposal: made before that token, from the same copy, it would
            # count the same outcome twice)
            self._follow(tokens)
        elif not drafted and proposal:
            self.shadow = [list(proposal), evidence_bucket(match), 0]
            self._follow(tokens)
        self.phase, self.countdown = (DRAFTING if drafted else PLAIN), 0
        if seconds is not None:
            if drafted:
                self.draft_rounds += 1
            else:
                self.plain_rounds += 1
            (self.draft if drafted else self.plain).add(len(tokens), seconds)

    def drop_shadow(self) -> None:
        """Tokens that verifying the shadow's drafts would not have met follow
        (the grammar's forced tokens): the shadow ends unmeasured."""
        self.shadow = None

    def new_request(self) -> None:
        """A shadow does not carry over into another request's tokens: one that
        still held when its request ended counts the drafts it matched, with no
        rejection (what is known of it; dropping it would count only the shadows
        that fail early)."""
        if self.shadow is not None:
            _, bucket, matched = self.shadow
            if matched:
                self._gate_add(bucket, matched, matched)
        self.shadow = None

    def _follow(self, tokens: list[int]) -> None:
        shadow = self.shadow
        if shadow is None:
            return
        drafts, bucket, matched = shadow
        for t in tokens:
            if t != drafts[matched]:
                break
            matched += 1
            if matched == len(drafts):
                break
        else:
            shadow[2] = matched
            return
        self._gate_add(bucket, matched, len(drafts))
        self.shadow = None

    def _gate_add(self, bucket: int, accepted: int, drafted: int) -> None:
        decay = 1.0 - 1.0 / self.params.alpha_window
        a, r = self.gate.get(bucket, (0.0, 0.0))
        self.gate[bucket] = [a * decay + accepted, r * decay + (1.0 if accepted < drafted else 0.0)]

    # ---- the state machine

    def record(self, tokens: int, seconds: float, behind: Optional[Callable[[], int]] = None) -> None:
        """Account one round of the kind the current phase asked for (``behind``: see ``end_round``)."""
        p = self.params
        if self.drafting:
            self.draft.add(tokens, seconds)
            self.draft_rounds += 1
        else:
            self.plain.add(tokens, seconds)
            self.plain_rounds += 1
            self.debt = self.debt - seconds if self.debt - seconds > 1e-6 else 0.0
        if self.phase == MEASURING:
            self.left -= 1
            if self.left <= 0:
                self._enter_drafting(restart=True)
        elif self.phase == DRAFTING:
            self.since_refresh += 1
            if self.draft.n >= p.probe_rounds and not self.draft_wins():
                self._enter_plain()
            elif self.since_refresh >= p.refresh_every:
                self.phase, self.left = REFRESHING, p.measure_rounds
                self.plain.restart()
        elif self.phase == REFRESHING:
            self.left -= 1
            if self.left <= 0:
                if self.draft_wins():
                    self._enter_drafting(restart=False)
                else:
                    self._enter_plain()
        elif self.phase == PLAIN:
            self.countdown = max(0, self.countdown - 1)
            if self.countdown <= 0 and self.debt <= 0 and self._catch_up_paid(behind):
                self.phase, self.left = PROBING, self._probe_rounds()
                self.probes += 1
                self.draft.restart()
        elif self.phase == PROBING:
            self.left -= 1
            if self.left <= 0:
                if self.probe_succeeded():
                    self.interval = p.first_interval
                    self._enter_drafting(restart=False)
                else:
                    self.failed_probes += 1
                    self.interval = min(2 * self.interval, p.max_interval)
                    self._enter_plain()

    def probe_succeeded(self) -> bool:
        """Without pass costs: the probe's rounds were faster than plain ones. With
        them: drafting at the best length is predicted to pay, with the acceptance
        the probe just measured (its own rounds' speed says little about another
        length: on a CPU a round of one draft is the dearest per token)."""
        if self.costs is None:
            return self.draft_wins()
        return self.predicted_speedup(self.k_max) >= self.params.threshold

    def draft_wins(self) -> bool:
        plain, draft = self.plain.rate, self.draft.rate
        if plain is None:
            return True  # nothing to compare with yet
        return draft is not None and draft >= self.params.threshold * plain

    def _enter_drafting(self, restart: bool) -> None:
        self.phase, self.since_refresh = DRAFTING, 0
        if restart:
            self.draft.restart()

    def _enter_plain(self) -> None:
        self.phase, self.countdown = PLAIN, max(self.interval, self._costed_interval())

    def _costed_interval(self) -> int:
        """Plain rounds a failed probe's cost needs to stay within the probe budget (0: no costs known)."""
        if self.costs is None:
            return 0
        interval = self.costs.probe_interval(self._probe_rounds(), self.params.probe_budget, self.k_max)
        return min(interval, 4096)

    def _probe_rounds(self) -> int:
        return self.params.probe_rounds if self.costs is None else self.params.predicted_probe_rounds

    def start_plain(self) -> None:
        """A new task predicted not to gain from drafting: plain from its first
        round, its first probe after the costed interval."""
        self.left = 0
        self._enter_plain()

    # ---- reporting and persistence

    def info(self, task: str = "", tasks: int = 1, k_max: int = 4) -> GovernorInfo:
        return GovernorInfo(
            task=task,
            tasks=tasks,
            phase=self.phase,
            drafting=self.drafting,
            plain_tokens_per_second=self.plain.rate,
            draft_tokens_per_second=self.draft.rate,
            probe_interval=self.interval,
            rounds_until_probe=self.countdown if self.phase == PLAIN else 0,
            probe_debt_seconds=self.debt,
            plain_rounds=self.plain_rounds,
            draft_rounds=self.draft_rounds,
            probes=self.probes,
            failed_probes=self.failed_probes,
            alpha=self.alpha if self.costs is not None else None,
            draft_length=self.draft_length(k_max) if self.costs is not None else None,
            predicted_speedup=self.predicted_speedup(k_max),
            gate={bucket_label(b): round(self.gate_alpha(b), 3) for b in sorted(self.gate)},
        )

    def to_dict(self) -> dict:
        return {
            "phase": self.phase,
            "left": self.left,
            "countdown": self.countdown,
            "interval": self.interval,
            "since_refresh": self.since_refresh,
            "plain_rounds": self.plain_rounds,
            "draft_rounds": self.draft_rounds,
            "probes": self.probes,
            "failed_probes": self.failed_probes,
            "debt": self.debt,
            "charged": self.charged,
            "plain": [self.plain.tokens, self.plain.seconds, self.plain.n],
            "draft": [self.draft.tokens, self.draft.seconds, self.draft.n],
            "accepted": self.accepted,
            "rejected": self.rejected,
            "alpha_prior": self.alpha_prior,
            "gate": {str(b): list(c) for b, c in sorted(self.gate.items())},
        }

    @classmethod
    def from_dict(cls, d: dict, params: GovernorParams, clock: Callable[[], float]) -> "Governor":
        """Raises ValueError (or KeyError/TypeError) for anything not written by to_dict."""
        if d["phase"] not in PHASES:
            raise ValueError(f"unknown phase {d['phase']!r}")
        ints = (
            "left",
            "countdown",
            "interval",
            "since_refresh",
            "plain_rounds",
            "draft_rounds",
            "probes",
            "failed_probes",
        )
        if not all(type(d[k]) is int and d[k] >= 0 for k in ints):
            raise ValueError("counters must be non-negative integers")
        if not params.first_interval <= d["interval"] <= params.max_interval:
            raise ValueError(f"probe interval {d['interval']} out of range")
        debt = d["debt"]
        if not isinstance(debt, (int, float)) or not 0 <= debt < 1e7:
            raise ValueError("bad probe debt")
        counts = {}
        for key, default, top in (
            ("accepted", 0.0, 1e9),
            ("rejected", 0.0, 1e9),
            ("alpha_prior", 0.5, 1.0),
            ("charged", 0.0, 1e7),
        ):
            v = d.get(key, default)  # (absent in states written before predictions, or before charging in advance)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= top:
                raise ValueError(f"bad {key}")
            counts[key] = float(v)
        gate = {}
        for b, c in d.get("gate", {}).items():  # (absent in states written before free proposals)
            if not (isinstance(b, str) and b.isdigit() and 1 <= int(b) <= GATE_BUCKETS):
                raise ValueError(f"bad evidence bucket {b!r}")
            if not (isinstance(c, list) and len(c) == 2):
                raise ValueError("bad evidence counts")
            if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1e9 for v in c):
                raise ValueError("evidence counts out of range")
            gate[int(b)] = [float(c[0]), float(c[1])]
        g = cls(
            params=params, clock=clock, debt=float(debt), gate=gate, **counts, **{k: d[k] for k in ("phase", *ints)}
        )
        for name in ("plain", "draft"):
            tokens, seconds, n = d[name]
            if not (isinstance(tokens, (int, float)) and isinstance(seconds, (int, float)) and type(n) is int):
                raise ValueError(f"bad {name} average")
            if not (0 <= tokens < 1e6 and 0 <= seconds < 1e6 and n >= 0):
                raise ValueError(f"{name} average out of range")
            setattr(g, name, MovingRate(params.window, float(tokens), float(seconds), n))
        return g


def task_key(tokens: list[int], n: int = 16) -> str:
    """What the governor keys its state on: the prompt's first ``n`` tokens.

    For chat that is the template's header and the start of the system prompt
    (Qwen and SmolLM2 insert a default one), so an agent or an editor plugin,
    which re-send the same system prompt, keep one state each, while requests
    without a system prompt share one. For a raw prompt it is the prompt's
    start (an editor's file prefix)."""
    head = ",".join(map(str, tokens[:n])).encode()
    return hashlib.sha256(head).hexdigest()[:12]


class GovernorBank:
    """One governor per task, least recently used dropped beyond ``max_tasks``,
    persisted as JSON to ``path`` (written atomically after each request) and
    keyed by ``identity`` (target, drafter, draft length), so a change of model
    starts fresh. A corrupt or foreign file is ignored with a warning."""

    def __init__(
        self,
        identity: str,
        path: Optional[Path] = None,
        params: GovernorParams = GovernorParams(),
        clock: Callable[[], float] = time.perf_counter,
        max_tasks: int = 64,
        per_task: bool = True,
        costs: Optional[PassCosts] = None,
        k_max: int = 4,
    ):
        self.identity = identity
        self.costs = costs  # this machine's pass costs (None: the governors measure only)
        self.k_max = k_max  # the daemon's draft length: what "draft_length" and predictions are for
        self.path = path
        self.params = params
        self.clock = clock
        self.max_tasks = max_tasks
        self.per_task = per_task  # False: one governor for every request
        self.tasks: OrderedDict[str, Governor] = OrderedDict()
        self.last_task = ""
        self.touched: set[str] = set()  # tasks this process served: saved over the file's; the rest kept
        if path is not None:
            self._load(path)

    def get(self, task: str, k: Optional[int] = None) -> Governor:
        """The governor of ``task``, for requests drafting at most ``k`` (None: the daemon's length)."""
        if not self.per_task:
            task = "all"
        k_max = self.k_max if k is None else k
        g = self.tasks.get(task)
        if g is None:
            g = self.tasks[task] = Governor(
                self.params, self.clock, alpha_prior=self.pooled_alpha(), costs=self.costs, k_max=k_max
            )
            if self.costs is not None and g.predicted_speedup(k_max) < self.params.threshold:
                g.start_plain()  # predicted not to pay: no measuring rounds, no drafter reading the prompt
            while len(self.tasks) > self.max_tasks:
                self.tasks.popitem(last=False)
        g.costs, g.k_max = self.costs, k_max
        self.tasks.move_to_end(task)
        self.last_task = task
        self.touched.add(task)
        return g

    def pooled_alpha(self) -> float:
        """The acceptance rate over every task remembered (0.5 before any drafted)."""
        accepted = sum(g.accepted for g in self.tasks.values())
        rejected = sum(g.rejected for g in self.tasks.values())
        return accepted / (accepted + rejected) if accepted + rejected > 0 else 0.5

    def info(self) -> Optional[GovernorInfo]:
        """The state of the most recently used task's governor."""
        g = self.tasks.get(self.last_task)
        return g.info(self.last_task, len(self.tasks), g.k_max) if g is not None else None

    def save(self) -> None:
        """Write the state atomically. Another daemon may share the file (two
        daemons, one state directory): under a lock, its tasks that this one did
        not serve are read back and kept, so neither clobbers the other's."""
        if self.path is None:
            return
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                on_disk = self._read(self.path, quiet=True)
                theirs = OrderedDict(on_disk[0] if on_disk else ())
                # oldest first: what only we still hold but did not serve, then the file's
                # (the other daemon's fresh ones among them), then what we served, by use
                tasks = OrderedDict(
                    (k, g.to_dict()) for k, g in self.tasks.items() if k not in theirs and k not in self.touched
                )
                tasks.update((k, v) for k, v in theirs.items() if k not in self.touched)
                tasks.update((k, g.to_dict()) for k, g in self.tasks.items() if k in self.touched)
                tasks = OrderedDict(list(tasks.items())[-self.max_tasks :])
                doc = {"version": STATE_VERSION, "identity": self.identity, "last_task": self.last_task, "tasks": tasks}
                r = self.costs.read_seen if self.costs is not None and self.costs.read_learnt else None
                if r is not None:  # what catching the drafter up costs a token: the machine's, learnt (optional)
                    doc["read"] = [r.tokens, r.seconds, r.n]
                elif on_disk and on_disk[2] is not None:
                    doc["read"] = on_disk[2]
                fd, tmp = tempfile.mkstemp(prefix=".governor-", dir=self.path.parent)
                with os.fdopen(fd, "w") as f:
                    json.dump(doc, f)
                os.replace(tmp, self.path)
                tmp = None
        except (OSError, ValueError, TypeError) as exc:  # a full disk, a value JSON cannot write
            log.warning("could not save the governor state to %s: %s", self.path, exc)
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)  # no half-written file left behind

    def _read(self, path: Path, quiet: bool = False) -> Optional[tuple[OrderedDict, object, Optional[list]]]:
        """The file's tasks (as written) and last task, if it is a readable state
        of this identity; None otherwise (with a warning unless ``quiet``)."""
        warn = (lambda *a: None) if quiet else log.warning
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            warn("ignoring the governor state in %s: %s", path, exc)
            return None
        try:
            doc = json.loads(text)
            if not isinstance(doc, dict) or doc.get("version") != STATE_VERSION:
                raise ValueError(f"not a version {STATE_VERSION} governor state")
            if doc.get("identity") != self.identity:
                warn(
                    "ignoring the governor state in %s: it is for %s, not %s", path, doc.get("identity"), self.identity
                )
                return None
            if not isinstance(doc.get("tasks"), dict):
                raise ValueError("'tasks' is not a map")
            for v in doc["tasks"].values():
                Governor.from_dict(v, self.params, self.clock)  # each must load
        except Exception as exc:  # any shape a damaged or hand-edited file has: it must not stop the model loading
            warn("ignoring the governor state in %s (%s: %s); starting fresh", path, type(exc).__name__, exc)
            return None
        read = doc.get("read")
        ok = (
            isinstance(read, list)
            and len(read) == 3
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e9 for v in read)
            and type(read[2]) is int
        )
        # (a damaged learnt read cost is dropped alone: the prior stands in for it)
        return OrderedDict((str(k), v) for k, v in doc["tasks"].items()), doc.get("last_task"), read if ok else None

    def _load(self, path: Path) -> None:
        read = self._read(path)
        if read is None:
            return
        raw, last, read_cost = read
        if read_cost is not None and self.costs is not None:
            self.costs.read_seen = MovingRate(self.costs.window, float(read_cost[0]), float(read_cost[1]), read_cost[2])
        tasks = OrderedDict((k, Governor.from_dict(v, self.params, self.clock)) for k, v in raw.items())
        for g in tasks.values():
            g.costs, g.k_max = self.costs, self.k_max
        self.tasks = OrderedDict(list(tasks.items())[-self.max_tasks :])
        self.last_task = last if isinstance(last, str) and last in self.tasks else ""
        log.info("governor: %d task(s) restored from %s", len(self.tasks), path)


def state_file(state_dir: Path, identity: str) -> Path:
    """One file per identity (target, drafter, draft length, kernels, where the
    layers are): switching models or devices and back keeps both."""
    return state_dir / f"governor-{hashlib.sha256(identity.encode()).hexdigest()[:16]}.json"
