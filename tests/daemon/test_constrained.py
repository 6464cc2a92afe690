"""The engine under a constraint, with a stand-in grammar (pure logic; llguidance
itself runs through the real daemon in tests/integration/test_structured_output.py):
sampling follows the masked distribution exactly with drafts and jump-forward,
forbidden drafts cost no target compute, and forced tokens are counted."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from tandem.daemon.drafting.interfaces import Drafter
from tandem.daemon.drafting.speculative import SparseDist
from tandem.daemon.worker.engine import Engine, RequestError
from tandem.protocol import ErrorCode, FinishReason, Generate, ResponseFormat

EOS = 0
# allowed tokens at each output position; position 1 allows one token only (forced)
STEPS = [{1, 2, 3}, {4}, {1, 2}, {5, 6, 7}]
RNG = np.random.default_rng(7)
TABLE = RNG.normal(0.0, 1.0, size=(len(STEPS) + 2, 16)).astype(np.float32)  # the model's logits by position


class StepConstraint:
    """A grammar that allows STEPS[i] at output position i, then stops."""

    def __init__(self):
        self.depth = 0

    def allowed(self) -> np.ndarray:
        mask = np.zeros(16, dtype=bool)
        if self.depth < len(STEPS):
            mask[list(STEPS[self.depth])] = True
        return mask

    def mask(self, logits):
        out = np.full(logits.shape, -np.inf, dtype=np.float32)
        allowed = self.allowed()
        out[allowed] = logits[allowed]
        return out

    def consume(self, token) -> bool:
        if self.depth >= len(STEPS) or token not in STEPS[self.depth]:
            return False
        self.depth += 1
        return True

    def rollback(self, n):
        self.depth -= n

    def valid_prefix(self, tokens) -> int:
        n = 0
        for i, t in enumerate(tokens):
            if self.depth + i >= len(STEPS) or t not in STEPS[self.depth + i]:
                break
            n += 1
        return n

    def forced(self):
        out = []
        d = self.depth
        while d < len(STEPS) and len(STEPS[d]) == 1:
            out.append(next(iter(STEPS[d])))
            d += 1
        return out

    @property
    def stopped(self) -> bool:
        return self.depth >= len(STEPS)


class StepGrammars:
    def compile(self, rf):
        if rf.pattern == "bad":
            from tandem.daemon.constraints.constraint import ConstraintError

            raise ConstraintError("response_format.pattern does not compile: bad")
        return StepConstraint()


class SoftModel:
    """Logits from TABLE by output position, so sampling has something to choose."""

    n_ctx, n_ctx_train, eos_token = 64, 64, EOS

    def __init__(self):
        self.n_past = 0
        self.prompt_len = 0
        self.passes: list[list[int]] = []

    def tokenize(self, text, add_special, parse_special=True):
        return [8] * len(text)

    def piece(self, token):
        return bytes([ord("a") + token])

    def is_eog(self, token):
        return token == EOS

    def fim_tokens(self):
        return None

    def clear(self):
        self.n_past = self.prompt_len = 0

    def truncate(self, n_keep):
        self.n_past = min(self.n_past, n_keep)

    def decode(self, tokens, logits_for=(-1,), abort=None):
        if self.n_past == 0:
            self.prompt_len = len(tokens)
        else:
            self.passes.append(list(tokens))
        rows = [TABLE[min(self.n_past + (i % len(tokens)) + 1 - self.prompt_len, len(TABLE) - 1)] for i in logits_for]
        self.n_past += len(tokens)
        return np.stack(rows)


class GuessDrafter(Drafter):
    """Proposes a fixed guess per position, some of them forbidden (9 never is allowed)."""

    GUESS = [2, 4, 9, 6]

    def begin(self, request_id, prompt, sampler, prefill=True):
        self.prompt_len = len(prompt)

    def propose(self, context, k, p_min):
        start = len(context) - self.prompt_len
        out = self.GUESS[start : start + k]
        return out, [SparseDist.one_hot(t) for t in out]


class SamplingDrafter(Drafter):
    """A model-like drafter: samples each draft from its own q over the whole vocabulary,
    forbidden tokens included, and reports q (so the engine must mask it)."""

    Q = RNG.dirichlet(np.ones(16), size=len(STEPS) + 2)

    def begin(self, request_id, prompt, sampler, prefill=True):
        self.prompt_len = len(prompt)
        self.rng = np.random.default_rng((sampler.seed or 0) + 1)

    def propose(self, context, k, p_min):
        start = len(context) - self.prompt_len
        drafts, dists = [], []
        for i in range(start, min(start + k, len(self.Q))):
            q = self.Q[i]
            drafts.append(int(self.rng.choice(16, p=q)))
            dists.append(SparseDist(np.arange(16), q))
        return drafts, dists


def run(drafter=None, jump_forward=True, **kw):
    model = SoftModel()
    engine = Engine(
        model, None, drafter, draft_tokens=3 if drafter else 0, grammars=StepGrammars(), jump_forward=jump_forward
    )
    params = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "max_tokens": 10, **kw}
    req = Generate(id="r", prompt="hi", response_format=ResponseFormat("regex", pattern="x"), **params)
    return engine.run(req, lambda chunk: None, lambda: False), model


def exact_distribution() -> dict[str, float]:
    """The constrained target distribution of the whole output, by enumeration."""
    probs = {"": 1.0}
    for i, allowed in enumerate(STEPS):
        logits = TABLE[i].astype(np.float64)
        ids = sorted(allowed)
        p = np.exp(logits[ids] - logits[ids].max())
        p /= p.sum()
        probs = {s + chr(ord("a") + t): q * pt for s, q in probs.items() for t, pt in zip(ids, p)}
    return probs


def test_every_output_follows_the_grammar_and_stops_when_it_is_complete():
    done, model = run(temperature=0.0)
    assert done.finish_reason == FinishReason.STOP and len(done.text) == len(STEPS)
    for ch, allowed in zip(done.text, STEPS):
        assert ord(ch) - ord("a") in allowed
    assert done.draft.forced == 1  # position 1 was read as a forced draft


def test_forbidden_drafts_are_cut_before_the_targets_pass():
    done, model = run(drafter=GuessDrafter(), temperature=0.0)
    assert all(9 not in p for p in model.passes)  # never read by the target
    assert done.finish_reason == FinishReason.STOP


def test_greedy_output_is_the_same_with_drafts_and_jump_forward_as_one_by_one():
    plain, _ = run(temperature=0.0, jump_forward=False)
    assert plain.draft is None or plain.draft.forced == 0
    for drafter in (None, GuessDrafter()):
        other, _ = run(drafter=drafter, temperature=0.0)
        assert other.text == plain.text


DRAFTERS = {"jump-forward": None, "jump-forward+ngram-like": GuessDrafter, "jump-forward+model-like": SamplingDrafter}


@pytest.mark.slow  # seconds, no model: out of the fast subset
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_sampling_with_drafts_and_forced_tokens_follows_the_constrained_distribution(drafter):
    from scipy.stats import chisquare

    exact = exact_distribution()
    n = 4000
    make = DRAFTERS[drafter]
    counts = collections.Counter(run(drafter=make() if make else None, seed=seed)[0].text for seed in range(n))
    assert set(counts) <= set(exact)
    keys = sorted(exact)
    observed = [counts.get(k, 0) for k in keys]
    total = sum(exact.values())
    expected = [exact[k] / total * n for k in keys]
    assert chisquare(observed, expected).pvalue > 0.001, dict(counts)


def test_a_constraint_that_does_not_compile_is_a_typed_error_before_decoding():
    model = SoftModel()
    engine = Engine(model, None, grammars=StepGrammars())
    req = Generate(id="r", prompt="hi", response_format=ResponseFormat("regex", pattern="bad"))
    with pytest.raises(RequestError) as info:
        engine.run(req, lambda c: None, lambda: False)
    assert info.value.code == ErrorCode.BAD_CONSTRAINT and model.n_past == 0
    with pytest.raises(RequestError) as info:
        Engine(model, None).run(req, lambda c: None, lambda: False)  # no grammars: refused, not ignored
    assert info.value.code == ErrorCode.BAD_CONSTRAINT


def test_a_model_drafter_drafts_constrained_sampling_with_its_q_masked():
    runs = [run(drafter=SamplingDrafter(), seed=seed)[0] for seed in range(20)]
    assert sum(done.draft.drafted for done in runs) > 0  # it is not switched off (its forbidden drafts are cut)
    from tandem.daemon.worker.rounds import _restricted

    q = SparseDist(np.arange(4), np.array([0.1, 0.2, 0.3, 0.4]))
    masked = _restricted(q, np.array([True, False, True, False]))
    assert list(masked.ids) == [0, 2] and np.allclose(masked.probs, [0.25, 0.75])
