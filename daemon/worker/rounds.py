"""A request's rounds: each feeds the target the last sampled token plus any
drafts (a drafter's, or the tokens a grammar forces) in one pass, and keeps the
accepted drafts plus the target's own token; with a governor, the round it asks
for, timed for it. ``Engine._run`` asks ``Rounds.next_round`` for each round
after the first token."""

from __future__ import annotations

import logging
from typing import Callable, Optional

import numpy as np

from ..constraints.constraint import Constraint, ConstraintError
from ..drafting.governor import READ_MIN_TOKENS, Governor
from ..drafting.interfaces import Drafter, Model
from ..drafting.speculative import SparseDist, verify
from .request_state import RequestState

log = logging.getLogger("tandem.engine")

MAX_FORCED = 16  # grammar-forced tokens read in one round


class Rounds:
    """The rounds of one model's requests (a ``RequestState`` each), on ``clock``:
    ``min_batch`` 2 reads every step as two positions (exact steps), and
    ``jump_forward`` reads a grammar's forced tokens as drafts."""

    def __init__(self, model: Model, clock: Callable[[], float], min_batch: int = 1, jump_forward: bool = True):
        self.model = model
        self.clock = clock
        self.min_batch = min_batch  # 2: every decoding step reads >= 2 positions (see _round)
        self.jump_forward = jump_forward  # grammar-forced tokens are read as drafts

    def next_round(self, state: RequestState) -> list[int]:
        """The tokens the request's next round adds: a round of the kind its
        governor asks for, or (none) one that drafts with its drafter, if any."""
        if state.inject:
            return self.written(state, seen=False)
        if state.governor is None:
            return self._round(state, state.drafter)[0]
        return self._governed_round(state)

    def written(self, state: RequestState, seen: bool) -> list[int]:
        """A round of tokens written for the model (``state.inject``: the closing of a
        thinking whose budget is spent), read in one pass, and the token it samples
        after them. ``seen``: the model has read the context's last token already
        (right after the prompt). The same pass whatever the round before was, so
        the output stays the same with drafting on or off."""
        model, context = self.model, state.context()
        written = state.inject[: max(0, model.n_ctx - len(context) - 1)]
        state.inject = []
        if not written:  # (no room left for them: the context is full after the next token anyway)
            return self._round(state, None)[0]
        started = self.clock()
        rows = written if seen else [context[-1], *written]
        logits = model.decode(rows, logits_for=(len(rows) - 1,))[0]
        if state.constraint is not None:
            if state.constraint.valid_prefix(written) == len(written):  # (gpt-oss's calls' grammar takes the closing)
                for token in written:
                    state.constraint.consume(token)
            logits = state.constraint.mask(logits)
        token = state.sampler.sample(logits)
        state.last_round = (0, 0, 0.0, self.clock() - started, len(rows))
        state.drafted_last, state.round_ended, state.injected = False, None, len(written)
        return [*written, token]

    def _governed_round(self, state: RequestState) -> list[int]:
        """A round of the kind the governor asks for, timed for it. While the
        drafter is still reading the prompt, rounds are plain and untimed (they
        share the CPU with it and would look slow). Before the first drafting
        round after plain ones the drafter catches up, untimed: that is a cost
        of switching, paid once per probe, not of drafting."""
        governor, drafter = state.governor, state.drafter
        assert governor is not None and drafter is not None
        if drafter.free_proposals and governor.costs is not None:
            return self._gated_round(state, governor, drafter)
        if not drafter.ready():
            state.drafted_last, state.round_ended = False, None
            return self._round(state, None)[0]
        drafting = governor.drafting
        if drafting and not state.drafted_last:
            state.round_ended = None  # (a catch-up is a switch's cost, not a round's)
            context = state.context()[:-1]
            lacking = drafter.behind(context)
            predicted = governor.costs.catch_up(lacking) if governor.costs is not None else None
            started = self.clock()
            held = drafter.sync(context) is not False
            seconds = self.clock() - started
            # (a catch-up that did not finish is paid for but teaches nothing about reading)
            governor.caught_up(seconds, lacking if held else 0)
            if held and lacking >= READ_MIN_TOKENS:
                log.info(
                    "the drafter caught up on %d tokens in %.2f s%s",
                    lacking,
                    seconds,
                    f" (predicted {predicted:.2f} s)" if predicted is not None else "",
                )
        governor.start_round()
        k = governor.draft_length(state.k) if drafting else 0
        started = self.clock()
        tokens, timed = self._round(state, drafter if drafting else None, k)
        self._observe_outside(state, governor, started, timed)
        if timed:
            governor.observe(*state.last_round)  # first: what it measured informs the decision end_round makes
            # (what a probe would have to read is asked only when one is about to fall due)
            # (this round's tokens join the context after this: the next round's catch-up reads them too)
            governor.end_round(len(tokens), behind=lambda: drafter.behind((state.context() + tokens)[:-1]))
        else:
            governor.skip_round()
        state.drafted_last = drafting
        return tokens

    def _gated_round(self, state: RequestState, governor: Governor, drafter: Drafter) -> list[int]:
        """A governed round of a drafter whose proposals are free (prompt lookup):
        propose every round, and verify as many of the drafts as the governor
        predicts pay for the proposal's evidence (none: a plain round, the proposal
        then followed in what decoding produces). See governor.py."""
        context = state.context()
        left = self._left(state, context)
        proposal, dists = drafter.propose(context, min(state.k, left), state.p_min) if left > 0 else ([], None)
        match = drafter.evidence
        k = governor.gated_length(len(proposal), match)
        started = self.clock()
        if k:
            chosen = (proposal[:k], dists[:k] if dists is not None else None)
            tokens, timed = self._round(state, drafter, k, proposal=chosen)
        else:
            tokens, timed = self._round(state, None)
        seconds = self.clock() - started
        self._observe_outside(state, governor, started, timed)  # (asking for the proposal is outside: every round does)
        drafted, accepted = state.last_round[0], state.last_round[1]
        if timed:
            governor.observe(*state.last_round)
        if state.forced_last or state.constraint is not None:
            # what the grammar forces or forbids, verifying would not have met: no shadow
            governor.drop_shadow()
            proposal = []
        governor.gated_round(proposal, match, drafted, accepted, tokens, seconds if timed else None)
        state.drafted_last = bool(drafted)
        return tokens

    def _observe_outside(self, state: RequestState, governor: Governor, started: float, timed: bool) -> None:
        """A governed round that began at ``started`` ran: what the cycle from the
        previous timed round's end to this round's start cost (streaming that round's
        tokens, asking the drafter, the loop) goes to the pass costs, when both rounds
        were timed; the round's own drafter and target time are what it measured."""
        if timed and state.round_ended is not None and governor.costs is not None:
            governor.costs.observe_outside(started - state.round_ended)
        drafter_seconds, target_seconds = state.last_round[2], state.last_round[3]
        state.round_ended = started + drafter_seconds + target_seconds if timed else None

    def _round(
        self,
        state: RequestState,
        drafter: Optional[Drafter],
        k: Optional[int] = None,
        proposal: Optional[tuple[list[int], Optional[list[SparseDist]]]] = None,
    ) -> tuple[list[int], bool]:
        """One round (of at most ``k`` drafts; None: the request's). The context
        ends with the last sampled token, which the target has not seen yet.
        Returns the tokens this round adds (>= 1) and whether it ran as asked
        (False: no room left to draft in it). ``state.last_round`` says what it
        did: (drafts, accepted, drafter seconds, target seconds, tokens read).
        ``proposal``: the drafter's drafts (and q) for this round, already asked for."""
        model, context = self.model, state.context()
        left = self._left(state, context)
        room = min(state.k if k is None else k, left)
        started = self.clock()
        drafts: list[int] = []
        dists = None
        constraint = state.constraint
        forced = (
            constraint.forced()[: max(min(MAX_FORCED, left), 0)]
            if constraint is not None and self.jump_forward and state.draft_off is None
            else []
        )
        if forced:
            # jump-forward: the grammar's only continuation, verified as drafts (no drafter needed)
            drafts, dists = forced, [SparseDist.one_hot(t) for t in forced]
        elif drafter is not None and room > 0:
            drafts, dists = drafter.propose(context, room, state.p_min) if proposal is None else proposal
            drafts, dists = drafts[:room], dists[:room] if dists is not None else None
            if constraint is not None and drafts:  # what the grammar forbids costs no target compute
                n = constraint.valid_prefix(drafts)
                drafts, dists = drafts[:n], dists[:n] if dists is not None else None
        counted = bool(drafts) and not forced
        state.forced_last = bool(forced)
        if not drafts and self.min_batch > 1 and model.n_ctx - len(context) >= 1:
            # Exact mode: this target's single-token kernels round differently from
            # its batched ones, so a step without drafts still reads two positions,
            # the second a guess (the last token again) verified like any draft.
            guess = context[-1]
            if constraint is not None and not constraint.valid_prefix([guess]):
                guess = int(np.flatnonzero(constraint.allowed())[0])  # any token the grammar allows
            drafts, dists = [guess], [SparseDist.one_hot(guess)]
        n_before = model.n_past
        allowed = self._masks(constraint, drafts) if constraint is not None else None
        proposed = self.clock()
        logits = model.decode([context[-1], *drafts], logits_for=range(len(drafts) + 1))
        if allowed is not None:
            rows = self._padded(allowed, logits.shape[1])
            logits = np.where(rows, logits, np.float32(-np.inf))
            if dists is not None:
                dists = [_restricted(q, rows[i]) for i, q in enumerate(dists)]
        timed = (drafter is None or room > 0) and not forced  # a forced round is neither plain nor drafting
        if not drafts:
            token = state.sampler.sample(logits[0])
            state.last_round = (0, 0, 0.0, self.clock() - proposed, 1)
            return [token], timed
        n_accepted, own = verify(logits, drafts, dists, state.sampler)
        state.last_round = (
            len(drafts) if counted else 0,
            n_accepted,
            proposed - started,
            self.clock() - proposed,
            len(drafts) + 1,
        )
        if forced and state.stats is not None:
            state.stats.forced += n_accepted
        model.truncate(n_before + 1 + n_accepted)
        if counted and state.stats is not None:
            state.stats.add_round(len(drafts), n_accepted)
        return [*drafts[:n_accepted], own], timed

    def _left(self, state: RequestState, context: list[int]) -> int:
        """Tokens a round may draft: before max_tokens (the round adds one token of
        its own) and inside the context (the target reads the pending token + the drafts)."""
        return min(state.req.max_tokens - len(state.completion) - 1, self.model.n_ctx - len(context))

    def _masks(self, constraint: Constraint, drafts: list[int]) -> list[Optional[np.ndarray]]:
        """What the grammar allows at each row of the round: row i after the drafts
        before it (they are all allowed: cut before the pass). Computed while no
        pass runs, so the target's rows and the drafter's q are masked alike. A row
        after the grammar is complete allows only the end token (that row's token
        is never taken)."""
        rows: list[Optional[np.ndarray]] = []
        consumed = 0
        for i in range(len(drafts) + 1):
            rows.append(None if constraint.stopped else constraint.allowed())
            if i < len(drafts) and not constraint.stopped:
                if not constraint.consume(drafts[i]):
                    raise ConstraintError(f"the grammar refused draft {drafts[i]}, which it had allowed")
                consumed += 1
        constraint.rollback(consumed)
        return rows

    def _padded(self, masks: list[Optional[np.ndarray]], width: int) -> np.ndarray:
        out = np.zeros((len(masks), width), dtype=bool)
        for i, allowed in enumerate(masks):
            if allowed is None:
                out[i, self.model.eos_token] = True
            else:
                out[i, : len(allowed)] = allowed[:width]
        return out


def _restricted(q: SparseDist, allowed: np.ndarray) -> SparseDist:
    """The drafter's q given that its draft is one the grammar allows: q on the allowed
    tokens, renormalised. A draft that was allowed is distributed exactly so (the
    forbidden ones were cut, and a round without a draft samples p itself), so
    min(1, p/q) and max(0, p - q) still sample the constrained p exactly."""
    keep = allowed[q.ids]
    if keep.all():
        return q
    probs = q.probs[keep]
    return SparseDist(q.ids[keep], probs / probs.sum())
