"""Decoding one request: the model-facing logic, free of sockets.

``Engine.run`` takes a validated ``Generate`` or ``Complete`` request and a model (anything
with the ``Model`` methods of interfaces.py), and reports through two callbacks:
``emit(chunk)`` for each round of streamed output and ``should_cancel()`` asked
before every decode step, so a cancel ends the request within one step. It
returns the terminal ``Done`` or raises ``RequestError``. What one request
carries while it is decoded (its prompt, sampler, drafting knobs, output so far)
is one ``RequestState`` (request_state.py).

The engine holds a request's course: its prompt (``PromptBuilder``, prompts.py),
its prefill with what the prefix cache and the model's KV cache hold, its output
(stop strings, the grammar, tool calls) and its ``Done``. Its rounds are
``Rounds`` (rounds.py: drafts, verification, the governor's timing); between
requests it settles the last turn into cache pages and times the target's
passes again (``PassTimer``, pass_timing.py).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Callable, Optional

from tandem.protocol import (
    Chunk,
    Complete,
    Decoding,
    Done,
    DraftStats,
    ErrorCode,
    FinishReason,
    Timings,
    ToolCallDelta,
    Usage,
)

from ..constraints.constraint import Constraint, ConstraintError, field_name
from ..constraints.tools import CallOpener, ToolPlan
from ..drafting.governor import PLAIN, Governor, GovernorBank, task_key
from ..drafting.interfaces import DecodeAborted, Drafter, Model, RequestError
from ..drafting.sampler import Sampler
from ..models.chat import ChatTemplate
from . import lane, thinking
from .output import progress_chunk, reporting, take
from .pass_timing import PassTimer
from .prompts import PromptBuilder
from .request_state import RequestState
from .rounds import Rounds
from .textstream import TextStream

if TYPE_CHECKING:
    from ..cache.page_store import PageStore


class Engine:
    def __init__(
        self,
        model: Model,
        chat_template: Optional[ChatTemplate],
        drafter: Optional[Drafter] = None,
        draft_tokens: int = 0,
        draft_p_min: float = 0.0,
        min_batch: int = 1,
        clock: Callable[[], float] = time.perf_counter,
        governors: Optional[GovernorBank] = None,
        cache: Optional["PageStore"] = None,
        grammars=None,
        jump_forward: bool = True,
    ):
        self.model = model
        self.prompts = PromptBuilder(model, chat_template)
        self.drafter = drafter
        self.draft_tokens = draft_tokens if drafter is not None else 0
        self.draft_p_min = draft_p_min
        self.min_batch = min_batch  # 2: every decoding step reads >= 2 positions (see Rounds._round)
        self.clock = clock
        self.rounds = Rounds(model, clock, min_batch, jump_forward)
        self.pass_timer = PassTimer(model, clock)  # idle time: the target's passes timed again
        self.governors = governors  # None: draft every round
        self.cache = cache  # the prefix cache's pages of this model; None: no prefix cache
        self.batch_invariant: Optional[bool] = None  # the model's load probe (LlamaModel.batch_invariance)
        self.grammars = grammars  # compiles response_format into a Constraint (constraint.Grammars); None: refused
        self.jump_forward = jump_forward  # grammar-forced tokens are read as drafts
        # why drafting and jump-forward would change greedy output here ("": they do not; target_worker)
        self.draft_off = ""

    # ------------------------------------------------------------------ prompts (prompts.py)

    def tool_plan(self, req: Decoding) -> Optional[ToolPlan]:
        return self.prompts.tool_plan(req)

    def prompt_tokens(self, req: Decoding, plan: Optional[ToolPlan] = None, check_fits: bool = True) -> list[int]:
        """The request's prompt as the model reads it (``PromptBuilder.prompt_tokens``)."""
        return self.prompts.prompt_tokens(req, plan, check_fits)

    def fim_prompt(self, req: Complete) -> list[int]:
        """A ``complete`` request's fill-in-the-middle prompt (``PromptBuilder.fim_prompt``)."""
        return self.prompts.fim_prompt(req)

    # ------------------------------------------------------------------ requests, and the idle time between them

    def run(
        self,
        req: Decoding,
        emit: Callable[[Chunk], None],
        should_cancel: Callable[[], bool],
        lend: Optional[Callable[[], bool]] = None,
    ) -> Done:
        """Decode one request: prefill, then rounds until it finishes. Each round
        feeds the target the last sampled token plus any drafts, in one batch,
        and yields the accepted drafts plus the target's own token. Without
        drafts a round is exactly one plain decoding step. ``lend()`` is called
        between two rounds: the short-request lane serves a waiting short
        request there (``run_within``; True when it did)."""
        state = self._begin(req)
        try:
            return self._run(state, emit, should_cancel, lend)
        finally:
            if not req.cache:
                self.forget_live()  # cache: false: what it read is not kept for the next request either

    def run_within(
        self, req: Decoding, emit: Callable[[Chunk], None], should_cancel: Callable[[], bool], private: bool = False
    ) -> Optional[Done]:
        """Serve a short request between two rounds of a running one (the lane),
        and put the running one's KV back after it, exactly as it was. The short
        one decodes without drafting: the drafter holds the running request's
        context. ``private``: the running request was sent with ``cache: false``,
        so the short one's prompt keeps nothing of it. Returns its Done, or None
        when the model cannot copy the running request's KV, or not in the memory
        there is now (the short one then waits for it to end). ResumeFailed: the
        running request's KV could not be put back (it must end)."""
        suspend = getattr(self.model, "suspend", None)
        saved = suspend(max_bytes=lane.copy_budget()) if suspend is not None else None
        if saved is None:
            return None
        held = self.cache.locked if self.cache is not None else []
        if self.cache is not None:
            self.cache.locked = []  # the running request's pages stay locked (and in place) meanwhile
        if private:
            self.model.forget_history()
        try:
            state = self._begin(dataclasses.replace(req, draft="off"))
            state.within = True
            return self._run(state, emit, should_cancel)
        finally:
            if self.cache is not None:
                self.cache.release()
                self.cache.locked = held
            try:
                self.model.resume(saved)
            except Exception as exc:
                raise lane.ResumeFailed(f"the running request's KV could not be put back: {exc}") from exc

    def settle(self, interrupted: Callable[[], bool]) -> int:
        """Idle time: read what the last request left past its last whole prefill
        chunk again, in whole chunks, into prefix-cache pages (LlamaModel.settle),
        so that a next turn re-sending it reads only what is new; returns the tokens
        settled."""
        settle = getattr(self.model, "settle", None)
        if self.cache is None or settle is None:
            return 0
        return settle(self.cache.store_or_skip, interrupted)

    def refresh_pass_costs(self, interrupted: Callable[[], bool], busy: Callable[[], bool] = lambda: False) -> int:
        """Idle time, at most every REFRESH_SECONDS: the target's passes timed
        again into the governors' pass costs (``PassTimer.refresh``); returns the
        widths measured."""
        costs = self.governors.costs if self.governors is not None else None
        return self.pass_timer.refresh(costs, interrupted, busy)

    def forget_live(self) -> None:
        """What the model's KV cache holds is never reused (``cache: false``, a cache clear)."""
        forget = getattr(self.model, "forget_history", None)
        if forget is not None:
            forget()
        if self.drafter is not None:
            self.drafter.forget()  # nor what a drafter remembers of earlier prompts and replies

    def _run(
        self,
        state: RequestState,
        emit: Callable[[Chunk], None],
        should_cancel: Callable[[], bool],
        lend: Optional[Callable[[], bool]] = None,
    ) -> Done:
        try:
            check = reporting(state, emit, should_cancel, self.model, self.clock)
            logits = self._prefill(state, lane.lending(state, check, lend, self.model, self.clock))
            if state.req.progress and state.req.stream:
                emit(progress_chunk(state, len(state.tokens), self.clock()))
        except DecodeAborted:
            if state.cache is not None:
                state.cache.release()
            return self._cancelled_in_prefill(state)
        try:
            fits = len(state.inject) < min(state.req.max_tokens, self.model.n_ctx - len(state.tokens))
            if state.inject and fits:
                # the prompt opened a thinking the request may not do (a budget of 0): closed at once
                new_tokens = self.rounds.written(state, seen=True)
            else:
                state.inject = []
                if state.constraint is not None:
                    logits = state.constraint.mask(logits)
                new_tokens = [state.sampler.sample(logits)]
            state.first_token_at = self.clock()
            while True:
                take(self.model, state, new_tokens, emit)
                if state.finish is None and should_cancel():
                    state.finish = FinishReason.CANCELLED
                if state.finish is not None:
                    return self._finish(state, emit)
                paused = self.clock()
                if lend is not None and lend():
                    state.paused += self.clock() - paused
                    state.round_ended = None  # the pause is no cost of its rounds (the governor's timing)
                    if should_cancel():  # (cancelled, or the daemon stopping, meanwhile)
                        state.finish = FinishReason.CANCELLED
                        return self._finish(state, emit)
                new_tokens = self.rounds.next_round(state)
        except ConstraintError:  # llguidance failed mid-request: the output would not match
            if state.cache is not None:
                state.cache.release()
            raise

    def _begin(self, req: Decoding) -> RequestState:
        started = self.clock()
        plan = self.tool_plan(req)
        tokens = self.prompt_tokens(req, plan)
        k = self.draft_tokens if req.draft_tokens is None else req.draft_tokens
        drafter = self.drafter if k > 0 and req.draft != "off" else None
        constraint, pending = self._constraint(req, plan)
        draft_off = None
        if self.draft_off and (drafter is not None or (self.jump_forward and (constraint or pending) is not None)):
            drafter, draft_off = None, self.draft_off  # it would change greedy output here: decoded plainly
        if isinstance(req, Complete):
            stream = TextStream(req.stop, req.stop_at_blank_line, req.max_lines)
        else:
            stream = TextStream(req.stop)
        state = RequestState(
            req=req,
            tokens=tokens,
            sampler=Sampler(req.temperature, req.top_k, req.top_p, req.seed),
            stream=stream,
            k=k,
            p_min=self.draft_p_min if req.draft_p_min is None else req.draft_p_min,
            drafter=drafter,
            governor=self._governor(req, tokens, k) if drafter is not None else None,
            stats=DraftStats() if drafter is not None or constraint is not None or pending is not None else None,
            cache=self.cache if req.cache else None,
            started=started,
            constraint=constraint,
            parser=plan.parser() if plan is not None else None,
            pending=pending,
            draft_off=draft_off,
        )
        thinking.begin(state, self.prompts, self.model, plan)
        return state

    def _constraint(self, req: Decoding, plan: Optional[ToolPlan]) -> tuple[Optional[Constraint], Optional[CallOpener]]:
        """(the constraint from the first token, the one that starts when a tool call opens)."""
        rf = req.response_format
        text = rf is None or rf.type == "text"
        if text and plan is None:
            return None, None
        if not text and plan is not None:
            raise RequestError(
                ErrorCode.INVALID_REQUEST,
                "give either 'tools' or a 'response_format' other than text, not both (or tool_choice 'none')",
            )
        if self.grammars is None:
            raise ConstraintError("this daemon cannot constrain output (llguidance is missing)")
        if plan is None:
            constraint = self.grammars.compile(rf)
        else:
            compiled = {kind: self.grammars.compile_tools(g) for kind, g in plan.grammars().items()}
            if "start" not in compiled:
                return None, CallOpener(plan, compiled, self.model.piece)
            constraint = compiled["start"]
        forced = constraint.forced()
        if len(forced) >= req.max_tokens:
            where = "tools (the call's fixed start)" if plan is not None else field_name(rf)
            raise ConstraintError(
                f"{where}: the output must start with {len(forced)} tokens the grammar fixes, so it cannot end "
                f"within max_tokens {req.max_tokens}: raise max_tokens (to {len(forced) + 64} or more)"
            )
        return constraint, None

    def _prefill(self, state: RequestState, should_cancel: Callable[[], bool]):
        """Restore what the prefix cache holds of the prompt, start the drafter,
        read the rest; the logits after the prompt. A long prefill can be cancelled."""
        tokens, chunk = state.tokens, getattr(self.model, "prefill_chunk", 0)
        resent = self.model.prefilled_logits(tokens) if chunk and state.req.cache else None
        if resent is not None and self._keep_live(len(tokens)) == len(tokens):
            # the prompt the model read last, re-sent: its KV and its logits, as they were
            live = len(tokens)
            state.cached = state.cache.restore(tokens, live, keep=0) if state.cache is not None else live
            self._start_drafter(state)
            state.prefilled = state.reading_from = self.clock()
            if state.on_reading is not None:
                state.on_reading()  # (nothing to read: the first report has it all)
            return resent.copy()
        # what the model still holds of this prompt from the request before (an
        # agent's next turn, an editor's next keystroke): kept, to the token; with
        # fast prefill, to the last whole chunk it read in a prefill (what follows is
        # read again in the shape an uncached request reads it)
        live = self._live_prefix(tokens) if state.req.cache else 0
        keep = self.min_batch
        if chunk:
            limit = (len(tokens) - 1) // chunk * chunk  # the chunk with the prompt's last token is always read
            live = min(live, self.model.kv_reusable, limit) // chunk * chunk
            keep = len(tokens) - limit
        live = self._keep_live(live)
        if state.cache is not None:
            state.cached = state.cache.restore(tokens, live, keep=keep, align=max(chunk, 1))
        elif live:
            state.cached = live
        else:
            self.model.clear()
        self._start_drafter(state)
        state.reading_from = self.clock()
        if state.on_reading is not None:
            state.on_reading()  # (the first report: what the cache held)
        if chunk:
            logits = self.model.prefill(tokens[state.cached :], abort=should_cancel)
        else:
            logits = self.model.decode(tokens[state.cached :], abort=should_cancel)[0]
        state.prefilled = self.clock()
        return logits

    def _start_drafter(self, state: RequestState) -> None:
        if self.drafter is not None and not state.within:
            self.drafter.use_pages(state.cache)  # a model drafter restores its own pages of the prompt too
        if state.drafter is not None:
            # A model drafter reads the prompt in parallel with the target, unless
            # the task's governor is plain: on 2 cores that reading competes with
            # the target, and is wasted on a request that does not draft. A probe
            # that falls due later catches the drafter up then (see _governed_round).
            skip = state.governor is not None and state.governor.phase == PLAIN
            state.drafter.begin(state.req.id, state.tokens, state.sampler, prefill=not skip)

    def _keep_live(self, live: int) -> int:
        """Cut the model's KV cache to its first ``live`` tokens; how many it holds then
        (0: it could not be cut, and was cleared)."""
        try:
            self.model.truncate(live)
        except Exception:  # (LlamaModel clears a cache it cannot cut)
            self.model.clear()
            return 0
        return live

    def _live_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` the model's KV cache holds from the request
        before: at most all but one (the last one's logits are needed), or all
        but ``min_batch`` (exact steps: never a one-token pass, which rounds
        differently on such a target)."""
        live_prefix = getattr(self.model, "live_prefix", None)
        return live_prefix(tokens[: max(0, len(tokens) - self.min_batch)]) if live_prefix is not None else 0

    def _finish(self, state: RequestState, emit: Callable[[Chunk], None]) -> Done:
        req, completion = state.req, state.completion
        drafter = self.drafter if not state.within else None  # (the drafter holds another request's context)
        if state.cache is not None:
            state.cache.store_or_skip(state.context())  # the prompt and the reply, which a next turn re-sends
            if drafter is not None:
                drafter.store(state.context())
            state.cache.release()
        if drafter is not None and req.cache:  # (cache: false: nothing of it is kept, here either)
            drafter.finished(state.context(), len(state.tokens))
        tail = state.stream.flush()
        thought = ""
        if state.splitter is not None:
            thought, tail = thinking.finish(state, tail)
        deltas: list[ToolCallDelta] = []
        text = state.content if state.splitter is not None else state.stream.text
        finish = state.finish
        # a grammar that did not get to its end (max_tokens, a stop string): the output is not complete (a
        # repeated call ends the turn where the calls before it were complete, whatever the round read after it)
        constraint = state.constraint
        incomplete = (
            constraint is not None
            and finish in (FinishReason.LENGTH, FinishReason.STOP)
            and not (constraint.stopped or constraint.accepting)
            and not (state.parser is not None and state.parser.repeated)
        )
        if state.parser is not None:
            # cut: the output did not end by itself (max_tokens, a stop string), so a call still open is none
            # (or a repeated call ended the turn: nothing after it is a call)
            cut = finish != FinishReason.STOP or state.stream.stopped_by is not None or state.parser.repeated
            tail, deltas = state.parser.feed(tail)
            rest, more = state.parser.finish(cut)
            tail, deltas = tail + rest, deltas + more
            text = state.content = state.content + tail
            if state.parser.calls and finish == FinishReason.STOP and state.stream.stopped_by is None:
                finish = FinishReason.TOOL_CALLS  # (a stop string keeps stop and its stop_sequence)
        elif state.splitter is not None:
            text = state.content = state.content + tail
        if (tail or deltas or thought) and req.stream:
            emit(Chunk(id=req.id, text=tail, token_ids=[], tool_calls=deltas, reasoning=thought))
        generation_seconds = self.clock() - state.first_token_at
        decoding = generation_seconds - state.paused
        return Done(
            id=req.id,
            text=text,
            finish_reason=finish,
            usage=Usage(
                prompt_tokens=len(state.tokens),
                completion_tokens=len(completion),
                cached_tokens=state.cached,
                reasoning_tokens=state.reasoning_tokens,
            ),
            timings=Timings(
                time_to_first_token_seconds=state.first_token_at - state.started,
                prompt_seconds=state.prefilled - state.started,
                generation_seconds=generation_seconds,
                tokens_per_second=(len(completion) - 1) / decoding if len(completion) > 1 and decoding > 0 else 0.0,
                queued_seconds=0.0,
                paused_seconds=state.paused_reading + state.paused,
            ),
            draft=state.stats if state.stats is not None and (state.stats.rounds or state.stats.forced) else None,
            governor=self.governors.info() if state.governor is not None and self.governors is not None else None,
            cache=self.cache.info() if self.cache is not None else None,
            stop_sequence=state.stream.stopped_by if state.stream.stopped_by in (req.stop or ()) else None,
            batch_invariant=self.batch_invariant,
            tool_calls=list(state.parser.calls) if state.parser is not None else [],
            draft_off=state.draft_off,
            incomplete=incomplete,
            reasoning=state.thought,
        )

    def _governor(self, req: Decoding, tokens: list[int], k: int) -> Optional[Governor]:
        """The governor of this request's task, or None when every round drafts:
        no governor, ``draft: on``, or seeded sampling (so that equal requests
        reproduce equal tokens, whatever the governor has learned meanwhile)."""
        if self.governors is None or req.draft == "on" or (req.seed is not None and req.temperature > 0):
            return None
        key = task_key(tokens) + ("" if k == self.draft_tokens else f"/k{k}")
        governor = self.governors.get(key, k)
        governor.new_request()
        return governor

    def _cancelled_in_prefill(self, state: RequestState) -> Done:
        return Done.cancelled(state.req.id, len(state.tokens), prompt_seconds=self.clock() - state.started)
