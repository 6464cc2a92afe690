"""Constrained output: a request's ``response_format`` as a token mask, with llguidance.

``Grammars`` holds the target model's llguidance tokenizer (built once from the
GGUF vocabulary through llama-cpp-python, on the first constrained request) and
turns a ``ResponseFormat`` into a ``Constraint``, or a ``RequestError`` that
names the field and the fix before any decoding. A ``Constraint`` is one
request's matcher: which tokens may come next (the mask the engine applies to
the target's logits before temperature, top-k and top-p), which are forced, and
rollback, so drafted tokens can be checked and then taken back.

The engine asks a constraint only through the ``Constraint`` methods, so its
tests can use any object with them; llguidance (and llama.cpp) are imported
here only when a grammar is compiled.
"""

from __future__ import annotations

import json
import logging
from typing import Optional, Sequence

import numpy as np

from tandem.protocol import ErrorCode, ResponseFormat

from ..drafting.interfaces import RequestError

log = logging.getLogger("tandem.worker")

# compact JSON: a small model given free whitespace can pad an object with newlines until max_tokens
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(RequestError):
    """The response_format cannot be compiled, or its matcher failed; the message names the field and the fix."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.BAD_CONSTRAINT, message)


def grammar_for(rf: ResponseFormat) -> Optional[str]:
    """llguidance's grammar for ``rf`` (None: no constraint). Raises ConstraintError."""
    from llguidance import LLMatcher

    if rf.type == "text":
        return None
    if rf.type == "regex":
        return LLMatcher.grammar_from_regex(rf.pattern)
    if rf.type == "grammar":
        return LLMatcher.grammar_from_lark(rf.lark)
    schema: object = {"type": "object"}
    field = "response_format"
    if rf.type == "json_schema":
        schema, field = rf.json_schema.get("schema"), "response_format.json_schema.schema"
    try:
        return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    except (ValueError, TypeError, RecursionError) as exc:
        raise ConstraintError(f"{field} is not a usable JSON Schema: {exc}") from None


class Constraint:
    """One request's grammar state over the target's vocabulary."""

    def __init__(self, matcher, n_vocab: int):
        self.matcher = matcher
        self.n_vocab = n_vocab

    def allowed(self) -> np.ndarray:
        """A boolean mask over the vocabulary: the tokens the grammar allows next."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        self.check()
        return np.unpackbits(bits, bitorder="little")[: self.n_vocab].astype(bool)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` with every token the grammar forbids next set to -inf."""
        allowed = self.allowed()
        out = np.full(logits.shape, -np.inf, dtype=np.float32)
        out[: len(allowed)][allowed] = logits[: len(allowed)][allowed]
        return out

    def consume(self, token: int) -> bool:
        """Take ``token``; False when the grammar does not allow it."""
        ok = self.matcher.consume_token(token)
        self.check()
        return ok

    def rollback(self, n: int) -> None:
        if n and not self.matcher.rollback(n):
            self.check()
            raise ConstraintError(f"llguidance could not take back {n} tokens")

    def check(self) -> None:
        """Raise ConstraintError if the matcher failed (a limit of llguidance's, or
        a token it refused): its state then says 'stopped' though nothing matched."""
        if self.matcher.is_error():
            raise ConstraintError(f"the response_format's grammar failed while decoding: {self.matcher.get_error()}")

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the grammar accepts from here, in order."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    def forced(self) -> list[int]:
        """Tokens the grammar allows as the only continuation from here (llguidance's fast-forward)."""
        forced = list(self.matcher.compute_ff_tokens())
        self.check()
        return forced

    @property
    def stopped(self) -> bool:
        """Nothing more may follow (the grammar is complete and allows no extension)."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()

    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""


class Grammars:
    """The target model's constraint compiler."""

    def __init__(self, model):
        self.model = model
        self._tokenizer = None

    def tokenizer(self):
        if self._tokenizer is None:
            import time

            from llguidance.llamacpp import lltokenizer_from_vocab

            started = time.perf_counter()
            # every end-of-generation token ends a complete grammar (a chat model's end of turn
            # is often not the vocabulary's eos token)
            ends = [t for t in range(self.model.n_vocab) if self.model.is_eog(t)] or None
            self._tokenizer = lltokenizer_from_vocab(self.model.vocab, n_vocab=self.model.n_vocab, eos_token=ends)
            log.info("llguidance tokenizer built from the vocabulary in %.2f s", time.perf_counter() - started)
        return self._tokenizer

    def compile(self, rf: Optional[ResponseFormat]) -> Optional[Constraint]:
        """The request's constraint (None: unconstrained). Raises ConstraintError."""
        if rf is None:
            return None
        grammar = grammar_for(rf)
        if grammar is None:
            return None
        return self._matcher(grammar, field_name(rf), _fix(rf))

    def compile_tools(self, lark: str) -> Constraint:
        """The constraint of a request's tool calls (tools.ToolPlan.grammar)."""
        return self._matcher(
            lark,
            "tools[].function.parameters",
            "Give each tool's parameters as a JSON Schema of an object that llguidance supports: "
            "https://github.com/guidance-ai/llguidance/blob/main/docs/json_schema.md",
        )

    def _matcher(self, grammar: str, field: str, fix: str) -> Constraint:
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(_message(field, fix, matcher.get_error()))
        constraint = Constraint(matcher, self.model.n_vocab)
        try:
            constraint.allowed()  # the first mask: some limits only show here, and then before decoding
        except ConstraintError as exc:
            raise ConstraintError(_message(field, fix, str(exc))) from None
        return constraint


def _message(field: str, fix: str, detail: str) -> str:
    detail = " ".join(detail.split())  # llguidance's report spans lines, with a caret diagram
    return f"{field} does not compile ({detail}). {fix}"


def field_name(rf: ResponseFormat) -> str:
    """The request field that holds ``rf``'s constraint, for error messages."""
    return {
        "json_schema": "response_format.json_schema.schema",
        "regex": "response_format.pattern",
        "grammar": "response_format.lark",
    }.get(rf.type, "response_format")


def _fix(rf: ResponseFormat) -> str:
    return {
        "json_schema": "Give a JSON Schema (draft 2020-12) that llguidance supports: "
        "https://github.com/guidance-ai/llguidance/blob/main/docs/json_schema.md",
        "regex": "Give a regular expression in Rust regex syntax (no look-around, no back-references).",
        "grammar": "Give a Lark grammar with a 'start' rule (llguidance's Lark dialect).",
    }.get(rf.type, "")
