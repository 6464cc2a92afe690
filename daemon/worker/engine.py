"""Decoding one request: the model-facing logic, free of sockets.

``Engine.run`` takes a validated ``Generate`` or ``Complete`` request and a model (anything
with the ``Model`` methods of interfaces.py), and reports through two callbacks:
``emit(chunk)`` for each round of streamed output and ``should_cancel()`` asked
before every decode step, so a cancel ends the request within one step. It
returns the terminal ``Done`` or raises ``RequestError``. What one request
carries while it is decoded (its prompt, sampler, drafting knobs, output so far)
is one ``RequestState``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np

from tandem.protocol import (
    FIM_FIX,
    Chunk,
    Complete,
    Decoding,
    Done,
    DraftStats,
    ErrorCode,
    FinishReason,
    Generate,
    Timings,
    ToolCallDelta,
    Usage,
)

from ..constraints.constraint import Constraint, ConstraintError, field_name
from ..constraints.tools import (
    GENERIC,
    CallOpener,
    ToolCallParser,
    ToolPlan,
    detect_format,
    make_plan,
    message_dicts,
    tool_dict,
)
from ..constraints.tools import with_generic_prompt as _generic_prompt
from ..drafting.governor import MIN_SECONDS, PLAIN, READ_MIN_TOKENS, Governor, GovernorBank, task_key
from ..drafting.interfaces import DecodeAborted, Drafter, Model, RequestError
from ..drafting.sampler import Sampler
from ..drafting.speculative import SparseDist, verify
from ..models.chat import ChatTemplate, ChatTemplateError
from .textstream import TextStream

log = logging.getLogger("tandem.engine")

if TYPE_CHECKING:
    from ..cache.page_store import PageStore


MAX_FORCED = 16  # grammar-forced tokens read in one round
# idle time: the target's passes re-measured at most this often (Engine.refresh_pass_costs)
REFRESH_SECONDS = 30.0
# a width re-measured in idle time counts when the plain passes before and after it differ by at most this share
# (what another process starting or stopping does to a 2-thread pass: 2-8x; what a quiet machine's noise does: < 20%)
REFRESH_STEADY = 0.5


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
    draft_off: Optional[str] = None  # drafting asked for but off: it would change greedy output here

    def context(self) -> list[int]:
        return self.tokens + self.completion


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
        self.chat_template = chat_template
        self.drafter = drafter
        self.draft_tokens = draft_tokens if drafter is not None else 0
        self.draft_p_min = draft_p_min
        self.min_batch = min_batch  # 2: every decoding step reads >= 2 positions (see _round)
        self.clock = clock
        self.governors = governors  # None: draft every round
        self.cache = cache  # the prefix cache's pages of this model; None: no prefix cache
        self.batch_invariant: Optional[bool] = None  # the model's load probe (LlamaModel.batch_invariance)
        self.grammars = grammars  # compiles response_format into a Constraint (constraint.Grammars); None: refused
        self.jump_forward = jump_forward  # grammar-forced tokens are read as drafts
        # why drafting and jump-forward would change greedy output here ("": they do not; target_worker)
        self.draft_off = ""
        self.refreshed_at: Optional[float] = None  # the last idle re-measurement of the passes (refresh_pass_costs)
        # the tool-call syntax the chat template teaches (tools.py)
        self.tool_format = detect_format(chat_template.template if chat_template is not None else None)

    def tool_plan(self, req: Decoding) -> Optional[ToolPlan]:
        if not isinstance(req, Generate):
            return None
        return make_plan(req, self.tool_format, self._single_token)

    def _single_token(self, text: str) -> Optional[int]:
        tokens = self.model.tokenize(text, add_special=False, parse_special=True)
        return tokens[0] if len(tokens) == 1 else None

    def prompt_tokens(self, req: Decoding, plan: Optional[ToolPlan] = None, check_fits: bool = True) -> list[int]:
        """The request's prompt as the model reads it; PROMPT_TOO_LONG when it
        cannot fit the context (unless ``check_fits`` is False: a count)."""
        if isinstance(req, Complete):
            tokens = self.fim_prompt(req)
        elif req.messages is not None:
            if self.chat_template is None:
                raise RequestError(
                    ErrorCode.CHAT_TEMPLATE,
                    "this model has no chat template in its GGUF file; send 'prompt' (plain text) instead of "
                    "'messages' (CLI: tandem run --raw)",
                )
            messages = message_dicts(req.messages, self.tool_format)
            tools = None
            if plan is not None and self.tool_format == GENERIC:
                messages = _generic_prompt(messages, plan.tools)
            elif plan is not None:
                tools = [tool_dict(t) for t in plan.tools]
            try:
                text, add_special = self.chat_template.render(messages, tools)
            except ChatTemplateError as exc:
                raise RequestError(ErrorCode.CHAT_TEMPLATE, str(exc)) from None
            tokens = self.model.tokenize(text, add_special=add_special, parse_special=True)
        else:
            tokens = self.model.tokenize(req.prompt or "", add_special=True, parse_special=True)
        if not tokens:
            raise RequestError(ErrorCode.INVALID_REQUEST, "the prompt is empty (it tokenizes to no tokens)")
        if check_fits and len(tokens) >= self.model.n_ctx:
            raise RequestError(
                ErrorCode.PROMPT_TOO_LONG,
                f"the prompt is {len(tokens):,} tokens but the context holds {self.model.n_ctx:,} "
                f"(and one more is needed to answer). Shorten the prompt, or restart the daemon with a larger "
                f"--ctx-size (this model was trained on {self.model.n_ctx_train:,}).",
            )
        return tokens

    def fim_prompt(self, req: Complete) -> list[int]:
        """``<prefix token> prefix <suffix token> suffix <middle token>`` (the model
        writes the middle), from the model's own FIM tokens. The two texts are
        tokenized as plain text, so a file that contains the FIM tokens' spelling
        cannot inject them. A file too long for the context keeps the prefix's end
        (the code right before the cursor) and the suffix's start, leaving room to
        answer: an editor should not have to know the context size."""
        model = self.model
        fim = model.fim_tokens()
        if fim is None:
            raise RequestError(
                ErrorCode.FIM_UNSUPPORTED,
                "this model has no fill-in-the-middle tokens in its vocabulary, so 'complete' cannot prompt it. "
                f"{FIM_FIX}",
            )
        pre, suf, mid = fim
        head = model.tokenize("", add_special=True, parse_special=False)  # BOS, for models that want one
        prefix = model.tokenize(req.prefix, add_special=False, parse_special=False)
        suffix = model.tokenize(req.suffix, add_special=False, parse_special=False)
        room = max(0, model.n_ctx - len(head) - 3 - min(req.max_tokens, model.n_ctx // 4))
        if len(prefix) + len(suffix) > room:
            keep_suffix = min(len(suffix), max(room // 4, room - len(prefix)))
            suffix = suffix[:keep_suffix]
            prefix = prefix[len(prefix) - (room - keep_suffix) :] if room > keep_suffix else []
        return [*head, pre, *prefix, suf, *suffix, mid]

    def run(
        self,
        req: Decoding,
        emit: Callable[[Chunk], None],
        should_cancel: Callable[[], bool],
    ) -> Done:
        """Decode one request: prefill, then rounds until it finishes. Each round
        feeds the target the last sampled token plus any drafts, in one batch,
        and yields the accepted drafts plus the target's own token. Without
        drafts a round is exactly one plain decoding step."""
        state = self._begin(req)
        try:
            return self._run(state, emit, should_cancel)
        finally:
            if not req.cache:
                self.forget_live()  # cache: false: what it read is not kept for the next request either

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
        """Idle time, at most every REFRESH_SECONDS: time one target pass of each
        width the governors predict with (wider than a plain round's, up to k+1
        tokens: the tokens the model last read, again) at the end of what its KV
        cache holds, each between two passes as wide as a plain round's, drop them
        again, and add what each cost relative to the plain passes beside it to
        the pass costs' shape (PassCosts). Rounds keep the widths they run
        current; a width no round runs (a lookup governor that predicts no gain
        never verifies) would otherwise keep its load-time cost for the daemon's
        life, and one start measured a 2-token pass at 2.5 one-token passes where
        the next measured 1.6. Relative, because idle for this daemon is not idle
        for the machine: what another process runs meanwhile slows every pass
        alike, and a width whose two plain passes differ by more than
        REFRESH_STEADY is not counted (the machine changed while it was timed).
        Nor does it start while other processes keep the machine busy (``busy``:
        the passes it would time are not this machine's usual ones then, and they
        would slow that work; the idle time after the next request tries again).
        Not for a recurrent or hybrid model (its cache cannot drop a tail).
        Stops at a message (``interrupted``); returns the widths measured."""
        costs = self.governors.costs if self.governors is not None else None
        model = self.model
        history = getattr(model, "history", None)
        now = self.clock()
        if (
            costs is None
            or history is None
            or not getattr(model, "drops_one_position", True)
            or (self.refreshed_at is not None and now - self.refreshed_at < REFRESH_SECONDS)
        ):
            return 0
        plain = costs.plain_width
        widths = [w for w in sorted(costs.load) if w > plain]
        n_past = model.n_past
        if not widths or n_past < max(widths) or n_past + max(widths) > model.n_ctx or -1 in history[-max(widths) :]:
            return 0
        if interrupted() or busy() or interrupted():  # (a request waits, or came while busy() sampled)
            return 0
        previous, self.refreshed_at = self.refreshed_at, now

        def timed(w: int) -> float:
            started = self.clock()
            model.decode(list(history[n_past - w : n_past]), logits_for=range(w), abort=interrupted)
            seconds = self.clock() - started
            model.truncate(n_past)
            return seconds

        measured: dict[int, float] = {}
        stopped = False
        try:
            # untimed: after idle time the first passes run slower (the plain width's and the batched kernels)
            timed(plain)
            timed(widths[0])
            reference = timed(plain)
            for w in widths:
                if interrupted():
                    stopped = True
                    break
                seconds = timed(w)
                after = timed(plain)
                if abs(after - reference) <= REFRESH_STEADY * min(after, reference):
                    measured[w] = seconds / max((reference + after) / 2, MIN_SECONDS)
                reference = after
        except DecodeAborted:  # a request came between a wide pass's calls: what is measured stands
            stopped = True
            model.truncate(n_past)
        except Exception as exc:  # (DecodeError: e.g. a cache that cannot drop a tail) never again, then
            log.warning("re-measuring the target's passes failed (%s: %s); not tried again", type(exc).__name__, exc)
            self.refreshed_at = float("inf")
            return 0
        if not measured:
            if stopped:  # a request came before a width was timed: the next idle time tries again
                self.refreshed_at = previous
            else:
                log.info(
                    "target passes not re-measured: the %d-token passes around them differed by more than %d%% "
                    "(another process started or stopped); tried again after a request, %.0f s on at the earliest",
                    plain,
                    REFRESH_STEADY * 100,
                    REFRESH_SECONDS,
                )
            return 0
        for w, ratio in measured.items():
            costs.observe_shape(w, ratio)
        log.info(
            "target passes re-measured in idle time: %s %d-token passes; a round spends %.1f ms outside its pass",
            ", ".join(f"{w} tok {ratio:.2f}" for w, ratio in measured.items()),
            plain,
            costs.outside() * 1000,
        )
        return len(measured)

    def forget_live(self) -> None:
        """What the model's KV cache holds is never reused (``cache: false``, a cache clear)."""
        forget = getattr(self.model, "forget_history", None)
        if forget is not None:
            forget()
        if self.drafter is not None:
            self.drafter.forget()  # nor what a drafter remembers of earlier prompts and replies

    def _run(self, state: RequestState, emit: Callable[[Chunk], None], should_cancel: Callable[[], bool]) -> Done:
        try:
            logits = self._prefill(state, should_cancel)
        except DecodeAborted:
            if state.cache is not None:
                state.cache.release()
            return self._cancelled_in_prefill(state)
        try:
            if state.constraint is not None:
                logits = state.constraint.mask(logits)
            new_tokens = [state.sampler.sample(logits)]
            state.first_token_at = self.clock()
            while True:
                self._take(state, new_tokens, emit)
                if state.finish is None and should_cancel():
                    state.finish = FinishReason.CANCELLED
                if state.finish is not None:
                    return self._finish(state, emit)
                new_tokens = self._next_round(state)
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
        return RequestState(
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
            state.prefilled = self.clock()
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
        if chunk:
            logits = self.model.prefill(tokens[state.cached :], abort=should_cancel)
        else:
            logits = self.model.decode(tokens[state.cached :], abort=should_cancel)[0]
        state.prefilled = self.clock()
        return logits

    def _start_drafter(self, state: RequestState) -> None:
        if self.drafter is not None:
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

    def _take(self, state: RequestState, new_tokens: list[int], emit: Callable[[Chunk], None]) -> None:
        """Add a round's tokens to the output until one ends the request; stream them."""
        req, model = state.req, self.model
        accepted_ids: list[int] = []
        text = ""
        opened = False
        for token in new_tokens:
            if model.is_eog(token) and not req.ignore_eos:
                state.finish = FinishReason.STOP
                break
            state.completion.append(token)
            accepted_ids.append(token)
            text += state.stream.push(model.piece(token))
            if state.stream.stopped_by is not None:
                state.finish = FinishReason.STOP
                break
            if state.constraint is not None:
                if not state.constraint.consume(token):
                    raise ConstraintError(f"the grammar refused token {token}, which it had allowed")
                if state.constraint.stopped:
                    state.finish = FinishReason.STOP  # the grammar is complete
                    break
            if state.pending is not None:
                state.constraint = state.pending.opens(token, first=len(state.completion) == 1)
                opened = state.constraint is not None
            if len(state.completion) >= req.max_tokens or len(state.tokens) + len(state.completion) >= model.n_ctx:
                state.finish = FinishReason.LENGTH
                break
            if opened:
                break
        if opened and state.finish is None:
            self._open_call(state, cut=len(accepted_ids) < len(new_tokens))
        deltas: list[ToolCallDelta] = []
        if state.parser is not None:
            text, deltas = state.parser.feed(text)
            state.content += text
            if state.parser.repeated and state.finish is None:
                state.finish = FinishReason.STOP  # the same call again: the turn ends with the calls made
        if req.stream and accepted_ids:
            emit(Chunk(id=req.id, text=text, token_ids=accepted_ids, tool_calls=deltas))

    def _open_call(self, state: RequestState, cut: bool) -> None:
        """tool_choice auto: the model opened a call; what follows is constrained to the
        tools' calls. Tokens the round verified after the opening one are dropped
        (they were not constrained): the target forgets them too."""
        state.pending = None  # (its stats exist: _begin makes them for a pending call)
        if cut:
            self.model.truncate(len(state.context()) - 1)

    def _next_round(self, state: RequestState) -> list[int]:
        if state.governor is None:
            return self._round(state, state.drafter)[0]
        return self._governed_round(state)

    def _finish(self, state: RequestState, emit: Callable[[Chunk], None]) -> Done:
        req, completion = state.req, state.completion
        if state.cache is not None:
            state.cache.store_or_skip(state.context())  # the prompt and the reply, which a next turn re-sends
            if self.drafter is not None:
                self.drafter.store(state.context())
            state.cache.release()
        if self.drafter is not None and req.cache:  # (cache: false: nothing of it is kept, here either)
            self.drafter.finished(state.context(), len(state.tokens))
        tail = state.stream.flush()
        deltas: list[ToolCallDelta] = []
        text = state.stream.text
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
            state.content += tail
            text = state.content
            if state.parser.calls and finish == FinishReason.STOP and state.stream.stopped_by is None:
                finish = FinishReason.TOOL_CALLS  # (a stop string keeps stop and its stop_sequence)
        if (tail or deltas) and req.stream:
            emit(Chunk(id=req.id, text=tail, token_ids=[], tool_calls=deltas))
        generation_seconds = self.clock() - state.first_token_at
        return Done(
            id=req.id,
            text=text,
            finish_reason=finish,
            usage=Usage(prompt_tokens=len(state.tokens), completion_tokens=len(completion), cached_tokens=state.cached),
            timings=Timings(
                time_to_first_token_seconds=state.first_token_at - state.started,
                prompt_seconds=state.prefilled - state.started,
                generation_seconds=generation_seconds,
                tokens_per_second=(len(completion) - 1) / generation_seconds
                if len(completion) > 1 and generation_seconds > 0
                else 0.0,
                queued_seconds=0.0,
            ),
            draft=state.stats if state.stats is not None and (state.stats.rounds or state.stats.forced) else None,
            governor=self.governors.info() if state.governor is not None and self.governors is not None else None,
            cache=self.cache.info() if self.cache is not None else None,
            stop_sequence=state.stream.stopped_by if state.stream.stopped_by in (req.stop or ()) else None,
            batch_invariant=self.batch_invariant,
            tool_calls=list(state.parser.calls) if state.parser is not None else [],
            draft_off=state.draft_off,
            incomplete=incomplete,
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

    def _cancelled_in_prefill(self, state: RequestState) -> Done:
        return Done.cancelled(state.req.id, len(state.tokens), prompt_seconds=self.clock() - state.started)


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
