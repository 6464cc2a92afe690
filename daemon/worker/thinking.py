"""A reasoning model's thinking while a request is decoded (the engine's part of
models/reasoning.py): what a request starts with, the split of each token's text
into thinking and answer, and the budget, which ends a thinking by writing its
closing for the model (``RequestState.inject``, read by ``Rounds.written``)."""

from __future__ import annotations

from typing import Optional

from tandem.protocol import Decoding, FinishReason, Generate

from ..constraints.tools import HarmonyCallParser, ToolPlan
from ..drafting.interfaces import Model
from ..models.reasoning import FINAL_CHANNEL, FORCED_CALL, HARMONY
from .prompts import PromptBuilder
from .request_state import RequestState


def begin(state: RequestState, prompts: PromptBuilder, model: Model, plan: Optional[ToolPlan]) -> None:
    """A chat request of a reasoning model: its splitter (inside the thinking when the prompt
    opened it), its budget, and what is written for the model before its first token: the
    closing of a thinking it may not do, or gpt-oss's final channel for a constrained output."""
    req: Decoding = state.req
    if prompts.reasoning is None or not isinstance(req, Generate) or req.messages is None:
        return
    state.reasoning = prompts.reasoning
    state.splitter = prompts.reasoning.splitter(prompts.opens_thinking)
    state.thinking_budget = prompts.thinking_budget(req)
    if state.splitter.thinking and state.thinking_budget == 0:
        state.inject = closing(state, model)
    elif state.reasoning.kind == HARMONY and state.constraint is not None and plan is None:
        state.inject = model.tokenize(FINAL_CHANNEL, add_special=False, parse_special=True)


def split(state: RequestState, token: int, piece: bytes) -> tuple[str, str]:
    """One token of a reasoning model's output -> (thinking, answer) text now safe to emit.
    A format's marker (harmony's control tokens) is the splitter's alone: llama.cpp may spell
    one as text (gpt-oss's <|end|>), which must not reach the answer."""
    splitter = state.splitter
    marker = state.reasoning.markers.get(token)
    released = state.stream.push(piece if marker is None else b"")
    was_thinking = splitter.thinking
    thought, answer = splitter.feed(released)
    if marker is not None:
        more, rest = splitter.marker(marker)
        thought, answer = thought + more, answer + rest
    if was_thinking or splitter.thinking:
        state.reasoning_tokens += 1
    return thought, answer


def closing(state: RequestState, model: Model) -> list[int]:
    """The tokens that end a thinking for the model; with gpt-oss and a call it must make, into the call."""
    close = state.reasoning.close
    if state.reasoning.kind == HARMONY and isinstance(state.parser, HarmonyCallParser) and state.constraint:
        tokens = model.tokenize(close, add_special=False, parse_special=True)
        if state.constraint.valid_prefix(tokens) < len(tokens):
            close = FORCED_CALL
    return model.tokenize(close, add_special=False, parse_special=True)


def budget_spent(state: RequestState, model: Model) -> bool:
    """After a token: the thinking has spent its budget, so its closing is written for the
    model next round (``state.inject``), or, where the closing and one more token would not
    fit max_tokens or the context, the request ends there (``length``)."""
    budget = state.thinking_budget
    if budget is None or not state.splitter.thinking or state.reasoning_tokens < budget:
        return False
    tokens = closing(state, model)
    room = min(state.req.max_tokens - len(state.completion), model.n_ctx - len(state.context()) - 1)
    if room < len(tokens) + 1:
        state.finish = FinishReason.LENGTH
    else:
        state.inject = tokens
    return True


def finish(state: RequestState, tail: str) -> tuple[str, str]:
    """The output ended: (thinking, answer) of what was held back; gpt-oss's call, if the
    reply ended in one, goes to its parser."""
    thought, answer = state.splitter.feed(tail)
    more, rest = state.splitter.finish()
    thought, answer = thought + more, answer + rest
    state.thought += thought
    if isinstance(state.parser, HarmonyCallParser):
        state.parser.pending = getattr(state.splitter, "call", None)
    return thought, answer
