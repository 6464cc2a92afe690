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

log = logging.getLogger("tandem.worker")

# compact JSON: a small model given free whitespace can pad an object with newlines until max_tokens
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(Exception):
    """The response_format cannot be compiled; the message names the field and the fix."""

    code = ErrorCode.BAD_CONSTRAINT


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
    except (ValueError, TypeError) as exc:
        raise ConstraintError(f"{field} is not a usable JSON Schema: {exc}") from None


class Constraint:
    """One request's grammar state over the target's vocabulary."""

    def __init__(self, matcher, n_vocab: int):
        self.matcher = matcher
        self.n_vocab = n_vocab

    def allowed(self) -> np.ndarray:
        """A boolean mask over the vocabulary: the tokens the grammar allows next."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.n_vocab].astype(bool)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` with every token the grammar forbids next set to -inf."""
        allowed = self.allowed()
        out = np.full(logits.shape, -np.inf, dtype=np.float32)
        out[: len(allowed)][allowed] = logits[: len(allowed)][allowed]
        return out

    def consume(self, token: int) -> bool:
        return self.matcher.consume_token(token)

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` the grammar accepts from here, in order."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    def forced(self) -> list[int]:
        """Tokens the grammar allows as the only continuation from here (llguidance's fast-forward)."""
        return list(self.matcher.compute_ff_tokens())

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
            self._tokenizer = lltokenizer_from_vocab(self.model.vocab, n_vocab=self.model.n_vocab)
            log.info("llguidance tokenizer built from the vocabulary in %.2f s", time.perf_counter() - started)
        return self._tokenizer

    def compile(self, rf: Optional[ResponseFormat]) -> Optional[Constraint]:
        """The request's constraint (None: unconstrained). Raises ConstraintError."""
        if rf is None:
            return None
        grammar = grammar_for(rf)
        if grammar is None:
            return None
        from llguidance import LLMatcher

        tokenizer = self.tokenizer()
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise ConstraintError(_message(rf, messages[0]))
        matcher = LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ConstraintError(_message(rf, matcher.get_error()))
        return Constraint(matcher, self.model.n_vocab)


def _message(rf: ResponseFormat, detail: str) -> str:
    detail = " ".join(detail.split())  # llguidance's report spans lines, with a caret diagram
    return f"{_field(rf)} does not compile ({detail}). {_fix(rf)}"


def _field(rf: ResponseFormat) -> str:
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
