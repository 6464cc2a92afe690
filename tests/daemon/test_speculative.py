"""Speculative decoding logic without a model: the acceptance rule, the n-gram
drafter, and the engine's rounds with scripted drafters."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.daemon.drafting.ngram import NgramDrafter
from tandem.daemon.drafting.sampler import Sampler
from tandem.daemon.drafting.speculative import SparseDist, residual, verify
from tandem.daemon.worker.engine import Engine
from tandem.protocol import FinishReason, Generate

# ---------------------------------------------------------------- acceptance rule


def test_greedy_accepts_up_to_the_first_mismatch_and_adds_the_target_argmax():
    logits = np.full((4, 10), -5.0, dtype=np.float32)
    for row, best in enumerate([3, 4, 5, 6]):
        logits[row, best] = 5.0
    s = Sampler(0.0, 0, 1.0, 0)
    assert verify(logits, [3, 4, 5], None, s) == (3, 6)  # all accepted + bonus
    assert verify(logits, [3, 9, 5], None, s) == (1, 4)  # second rejected: target's own token
    assert verify(logits, [0, 4, 5], None, s) == (0, 3)
    assert verify(logits[:1], [], None, s) == (0, 3)


def test_residual_is_the_normalised_positive_part_of_p_minus_q():
    p = SparseDist(np.array([1, 2, 3]), np.array([0.5, 0.3, 0.2]))
    q = SparseDist(np.array([1, 3, 7]), np.array([0.7, 0.1, 0.2]))
    r = residual(p, q)
    assert list(r.ids) == [1, 2, 3]
    assert np.allclose(r.probs, np.array([0.0, 0.3, 0.1]) / 0.4)


def first_token_distribution(p: np.ndarray, q: np.ndarray, n: int, seed: int) -> np.ndarray:
    """Empirical distribution of the first output token of a 1-draft round with
    drafter distribution q and target distribution p."""
    rng = np.random.default_rng(seed)
    with np.errstate(divide="ignore"):
        logits = np.log(np.stack([p, p]).astype(np.float64)).astype(np.float32)
    sampler = Sampler(1.0, 0, 1.0, seed)
    qd = SparseDist(np.arange(len(q)), q)
    counts = np.zeros(len(p))
    for _ in range(n):
        d = int(rng.choice(len(q), p=q))
        n_acc, own = verify(logits, [d], [qd], sampler)
        counts[d if n_acc == 1 else own] += 1
    return counts


@pytest.mark.parametrize(
    "p,q",
    [
        ([0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]),
        ([0.1, 0.1, 0.8, 0.0], [0.7, 0.2, 0.05, 0.05]),
        ([0.4, 0.4, 0.1, 0.1], [0.4, 0.4, 0.1, 0.1]),
        ([0.97, 0.01, 0.01, 0.01], [0.01, 0.01, 0.01, 0.97]),
    ],
)
@pytest.mark.slow  # seconds, no model: out of the fast subset
def test_acceptance_preserves_the_target_distribution_chi_squared(p, q):
    from scipy.stats import chisquare

    p, q = np.array(p), np.array(q)
    n = 20000
    counts = first_token_distribution(p, q, n, seed=7)
    support = p > 0
    assert counts[~support].sum() == 0  # never a token the target cannot produce
    stat, pvalue = chisquare(counts[support], p[support] * n)
    assert pvalue > 0.001, (counts / n, p)


# ---------------------------------------------------------------- n-gram drafter


def test_ngram_proposes_what_followed_the_longest_recent_match():
    d = NgramDrafter(max_ngram=3)
    d.reset([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 2, 3])
    assert d.draft(3) == [4, 7, 2]  # "2 3" last seen before "4 7 2 ..."; "9 2 3"/"3 4 ..." are not suffixes
    d.extend([4])
    assert d.draft(2) == [7, 2]  # "2 3 4" -> most recent occurrence followed by 7


def test_ngram_without_a_match_proposes_nothing_and_never_matches_itself():
    d = NgramDrafter()
    d.reset([1, 2, 3])
    assert d.draft(4) == []
    d.reset([5])
    assert d.draft(2) == []


def test_ngram_drafts_are_cut_at_the_end_of_the_context():
    d = NgramDrafter()
    d.reset([8, 9, 8])
    assert d.draft(5) == [9, 8]


# ---------------------------------------------------------------- engine rounds


def generate(model, drafter, k, **params):
    req = Generate(id="r", prompt=params.pop("prompt", "hi"), temperature=0.0, draft_tokens=k, **params)
    chunks = []
    done = Engine(model, None, drafter=drafter, draft_tokens=4).run(req, chunks.append, lambda: False)
    return done, chunks


SCRIPT = b"the quick brown fox jumps over the lazy dog"


@pytest.mark.parametrize("k", [1, 2, 4, 6])
@pytest.mark.parametrize("wrong_at", [set(), {3, 10, 11, 30}])
def test_drafted_output_equals_plain_output(scripted_model, list_drafter, k, wrong_at):
    plain, _ = generate(scripted_model(SCRIPT), None, 0)
    drafted, chunks = generate(scripted_model(SCRIPT), list_drafter(SCRIPT, wrong_at), k)
    assert drafted.text == plain.text == SCRIPT.decode()
    assert "".join(c.text for c in chunks) == drafted.text
    stats = drafted.draft
    assert stats.rounds > 0 and stats.drafted >= stats.accepted
    assert all(n <= stats.rounds for n in stats.accepted_per_position)
    assert sum(stats.accepted_per_position) == stats.accepted
    if not wrong_at:
        assert stats.acceptance_rate == 1.0
        assert stats.tokens_per_round == pytest.approx((stats.accepted + stats.rounds) / stats.rounds)
    else:
        assert stats.acceptance_rate < 1.0


def test_drafts_shrink_near_max_tokens_and_the_context_limit(scripted_model, list_drafter):
    drafter = list_drafter(SCRIPT, set())
    done, _ = generate(scripted_model(SCRIPT), drafter, 6, max_tokens=10)
    assert done.usage.completion_tokens == 10
    assert all(k <= min(6, 10 - generated - 1) for generated, k in drafter.calls), drafter.calls
    assert any(k < 6 for _, k in drafter.calls)  # it did shrink
    drafter = list_drafter(SCRIPT, set())
    done, _ = generate(scripted_model(SCRIPT, n_ctx=12), drafter, 6)
    assert done.finish_reason == FinishReason.LENGTH and done.usage.completion_tokens == 10
    assert done.text == SCRIPT[:10].decode()
    # prompt 2 + generated + pending-and-drafts must fit 12 positions
    assert all(2 + generated + k <= 12 for generated, k in drafter.calls), drafter.calls


def test_no_stats_when_not_drafting(scripted_model, list_drafter):
    done, _ = generate(scripted_model(SCRIPT), None, 0)
    assert done.draft is None
    done, _ = generate(scripted_model(SCRIPT), list_drafter(SCRIPT, set()), 0)
    assert done.draft is None


def test_ngram_drafter_in_the_engine_on_a_copying_task(scripted_model):
    text = b"abc def abc def abc def abc def"
    done, _ = generate(scripted_model(text), NgramDrafter(), 4, prompt="abc def ")
    assert done.text == text.decode()
    assert done.draft.accepted > 0


# ---------------------------------------------------------------- the drafter's early stop


class FakeDraftModel:
    """A drafter whose q is (0.9, 0.1) everywhere."""

    n_ctx = 100
    n_vocab = 2

    def __init__(self):
        self.n_past = 0

    def truncate(self, n):
        self.n_past = min(self.n_past, n)

    def decode(self, tokens, logits_for=(-1,)):
        self.n_past += len(tokens)
        return np.log(np.array([[0.9, 0.1]], dtype=np.float32))


def test_a_token_past_the_drafters_vocabulary_gets_no_drafts_not_a_failure():
    """A target padded past its drafter (Qwen2.5 7B: 152,064 ids, 0.5B: 151,936) could pick a padding id:
    the drafter, which has no such token, proposes nothing and says what it holds."""
    from tandem.daemon.drafting.drafter_worker import Drafting
    from tandem.protocol.internal import DraftRequest, SamplingParams

    loop = Drafting(FakeDraftModel(), page_tokens=16)
    greedy = SamplingParams(0.0, 0, 1.0, None)
    r = loop.draft(DraftRequest(id="x", keep=0, append=[0, 1], k=2, sampling=greedy, p_min=0.0, new_request=True))
    assert r.tokens == [0, 0] and r.n_cached == 3
    r = loop.draft(DraftRequest(id="x", keep=3, append=[1, 2], k=2, sampling=greedy, p_min=0.0))  # 2: padding
    assert r.tokens == [] and r.n_cached == 3


@pytest.mark.slow  # seconds, no model: out of the fast subset
def test_draft_p_min_keeps_the_target_distribution_at_temperature_above_zero():
    """Stopping a draft early must not depend on the sampled guess, or the
    proposals no longer follow q and the output drifts from p (0.55 instead of 0.5 here)."""
    from scipy.stats import binomtest

    from tandem.daemon.drafting.drafter_worker import Drafting
    from tandem.protocol.internal import DraftRequest, SamplingParams

    p_logits = np.log(np.array([0.5, 0.5], dtype=np.float32))
    loop = Drafting(FakeDraftModel(), page_tokens=16)  # the drafting logic without its sockets
    target = Sampler(1.0, 0, 1.0, 1)
    n, zeros = 20000, 0
    for seed in range(n):
        loop.model.n_past = 0
        r = loop.draft(
            DraftRequest(
                id="x", keep=0, append=[0], k=1, sampling=SamplingParams(1.0, 0, 1.0, seed), p_min=0.2, new_request=True
            )
        )
        if not r.tokens:
            token = target.sample(p_logits)
        else:
            q = [SparseDist(r.q_ids.astype(np.int64), r.q_probs.astype(np.float64))]
            accepted, own = verify(np.stack([p_logits, p_logits]), r.tokens, q, target)
            token = r.tokens[0] if accepted else own
        zeros += token == 0
    assert binomtest(zeros, n, 0.5).pvalue > 0.001, zeros / n
