"""A request's output, a round at a time: the tokens a round produced taken into
it until one ends the request (an end-of-generation token, ``max_tokens``, the
context, a stop string, the grammar's end, a tool call that opens or repeats, a
spent thinking budget), split into text, thinking and tool calls, and streamed
(``Engine._run`` calls ``take`` after every round; ``Engine._finish`` makes the
``Done``); and the chunks that report a prompt's reading (``reporting``)."""

from __future__ import annotations

from typing import Callable

from tandem.protocol import Chunk, FinishReason, PromptProgress, ToolCallDelta
from tandem.protocol.messages import PROGRESS_SECONDS

from ..constraints.constraint import ConstraintError
from ..drafting.interfaces import Model
from . import thinking
from .request_state import RequestState


def take(model: Model, state: RequestState, new_tokens: list[int], emit: Callable[[Chunk], None]) -> None:
    """Add a round's tokens to the output until one ends the request; stream them."""
    req = state.req
    accepted_ids: list[int] = []
    text = ""
    opened = False
    thought = r = ""
    splitter, written = state.splitter, state.injected
    state.injected = 0
    for i, token in enumerate(new_tokens):
        if model.is_eog(token) and not req.ignore_eos:
            state.finish = FinishReason.STOP
            break
        state.completion.append(token)
        accepted_ids.append(token)
        if splitter is None:
            text += state.stream.push(model.piece(token))
        else:
            r, a = thinking.split(state, token, model.piece(token))
            thought, text = thought + r, text + a
        if state.stream.stopped_by is not None:
            state.finish = FinishReason.STOP
            break
        if i < written:
            continue  # (written for the model: they open no call; a grammar took them in Rounds.written)
        if state.constraint is not None:
            if not state.constraint.consume(token):
                raise ConstraintError(f"the grammar refused token {token}, which it had allowed")
            if state.constraint.stopped:
                state.finish = FinishReason.STOP  # the grammar is complete
                break
        if state.pending is not None:
            state.constraint = state.pending.opens(token, first=len(state.completion) == 1)
            opened = state.constraint is not None
            if opened and splitter is not None and splitter.thinking:
                # a call opened inside the thinking ends it: the call is the answer's (and parsed)
                splitter.thinking = False
                if r:
                    thought, text = thought[: len(thought) - len(r)], text + r
        if len(state.completion) >= req.max_tokens or len(state.tokens) + len(state.completion) >= model.n_ctx:
            state.finish = FinishReason.LENGTH
            break
        if opened:
            break
        if splitter is not None and thinking.budget_spent(state, model):
            if i + 1 < len(new_tokens):
                model.truncate(len(state.context()) - 1)  # (the round's later tokens are dropped)
            break
    if opened and state.finish is None:
        open_call(model, state, cut=len(accepted_ids) < len(new_tokens))
    deltas: list[ToolCallDelta] = []
    if state.parser is not None:
        text, deltas = state.parser.feed(text)
        state.content += text
        if state.parser.repeated and state.finish is None:
            state.finish = FinishReason.STOP  # the same call again: the turn ends with the calls made
    elif splitter is not None:
        state.content += text
    state.thought += thought
    if req.stream and accepted_ids:
        emit(Chunk(id=req.id, text=text, token_ids=accepted_ids, tool_calls=deltas, reasoning=thought))


def open_call(model: Model, state: RequestState, cut: bool) -> None:
    """tool_choice auto: the model opened a call; what follows is constrained to the
    tools' calls. Tokens the round verified after the opening one are dropped
    (they were not constrained): the target forgets them too."""
    state.pending = None  # (its stats exist: _begin makes them for a pending call)
    if cut:
        model.truncate(len(state.context()) - 1)


def progress_chunk(state: RequestState, processed: int, now: float) -> Chunk:
    """A streamed ``progress`` request's report of its prompt's reading: ``processed`` tokens of it read."""
    progress = PromptProgress(
        total=len(state.tokens),
        cached=state.cached,
        processed=min(max(processed, state.cached), len(state.tokens)),
        seconds=round(now - (state.reading_from or now), 3),
    )
    return Chunk(id=state.req.id, text="", token_ids=[], progress=progress)


def reporting(
    state: RequestState,
    emit: Callable[[Chunk], None],
    should_cancel: Callable[[], bool],
    model: Model,
    clock: Callable[[], float],
) -> Callable[[], bool]:
    """``should_cancel`` for the prefill; for a streamed ``progress`` request it
    also emits the prompt's progress, about every PROGRESS_SECONDS (the first
    time when the reading starts: the cache's share is known then)."""
    if not (state.req.progress and state.req.stream):
        return should_cancel
    last = [-PROGRESS_SECONDS]

    def checked() -> bool:
        now = clock()
        if now - last[0] >= PROGRESS_SECONDS:
            last[0] = now
            reading_at = getattr(model, "reading_at", None)
            emit(progress_chunk(state, reading_at() if reading_at is not None else state.cached, now))
        return should_cancel()

    state.on_reading = checked
    return checked
