"""Fakes the daemon's tests share, as fixtures: a scripted stand-in model and a
scripted drafter (each fixture returns the class, to build as many as a test needs)."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.daemon.drafting.interfaces import DecodeAborted, Drafter
from tandem.daemon.drafting.speculative import SparseDist

EOS = 0


class FakeClock:
    """A clock that moves only when told: ``clock()`` reads it, ``clock.advance(s)`` moves it."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class ScriptedModel:
    """Tokens are bytes: token t (1..255) is the byte t. Greedily, it continues
    the prompt with ``script``, then EOS, whatever it is fed (so drafts that
    match the script are accepted)."""

    n_ctx_train = 64
    eos_token = EOS

    def __init__(self, script: bytes, n_ctx: int = 64):
        self.script = list(script)
        self.n_ctx = n_ctx
        self.decoded: list[list[int]] = []
        self.n_past = 0
        self.prompt_len = 0

    def tokenize(self, text, add_special, parse_special=True):
        return list(text.encode())

    def piece(self, token):
        return bytes([token])

    def is_eog(self, token):
        return token == EOS

    def fim_tokens(self):
        return None

    def clear(self):
        self.n_past = 0
        self.prompt_len = 0

    def truncate(self, n_keep):
        self.n_past = min(self.n_past, n_keep)

    def decode(self, tokens, logits_for=(-1,), abort=None):
        if len(tokens) > 4 and abort is not None and abort():  # a "long prefill" of several batches
            raise DecodeAborted()
        if self.n_past == 0:
            self.prompt_len = len(tokens)
        self.decoded.append(list(tokens))
        rows = []
        for i in logits_for:
            pos = self.n_past + (i % len(tokens))
            step = pos + 1 - self.prompt_len
            logits = np.zeros(256, dtype=np.float32)
            logits[self.script[step] if step < len(self.script) else EOS] = 10.0
            rows.append(logits)
        self.n_past += len(tokens)
        return np.stack(rows)


class ListDrafter(Drafter):
    """Proposes from a fixed continuation, with deliberate mistakes at chosen steps."""

    def __init__(self, continuation: bytes, wrong_at: set[int]):
        self.continuation = list(continuation)
        self.wrong_at = wrong_at
        self.prompt_len = 0
        self.calls: list[int] = []

    def begin(self, request_id, prompt, sampler, prefill=True):
        self.prompt_len = len(prompt)

    def sync(self, context):
        pass

    def ready(self):
        return True

    def propose(self, context, k, p_min):
        start = len(context) - self.prompt_len
        self.calls.append((start, k))
        out = []
        for i in range(k):
            j = start + i
            if j >= len(self.continuation):
                break
            out.append(ord("#") if j in self.wrong_at else self.continuation[j])
        return out, [SparseDist.one_hot(t) for t in out]


@pytest.fixture
def scripted_model():
    """The ScriptedModel class: ``scripted_model(b"hello", n_ctx=10)`` is a model."""
    return ScriptedModel


@pytest.fixture
def list_drafter():
    """The ListDrafter class: ``list_drafter(b"hello", wrong_at={2})`` is a drafter."""
    return ListDrafter


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
