"""Sampling: greedy is argmax, seeds reproduce, top-k/top-p/temperature shape the distribution."""

import numpy as np
import pytest

from tandem.daemon.drafting.sampler import Sampler

LOGITS = np.log(np.array([0.5, 0.25, 0.15, 0.07, 0.03], dtype=np.float32))


def test_greedy_is_argmax():
    s = Sampler(0.0, 40, 0.95, None)
    logits = np.random.default_rng(0).normal(size=1000).astype(np.float32)
    assert s.sample(logits) == int(np.argmax(logits))


def test_same_seed_same_tokens_and_different_seed_differs():
    logits = np.random.default_rng(1).normal(size=500).astype(np.float32)
    a = [Sampler(1.0, 0, 1.0, 7).sample(logits) for _ in range(1)]
    s1, s2, s3 = Sampler(1.0, 0, 1.0, 7), Sampler(1.0, 0, 1.0, 7), Sampler(1.0, 0, 1.0, 8)
    seq1 = [s1.sample(logits) for _ in range(50)]
    seq2 = [s2.sample(logits) for _ in range(50)]
    seq3 = [s3.sample(logits) for _ in range(50)]
    assert seq1 == seq2 and seq1[:1] == a
    assert seq1 != seq3


def test_distribution_at_temperature_one_is_softmax():
    ids, probs = Sampler(1.0, 0, 1.0, 0).distribution(LOGITS)
    assert list(ids) == [0, 1, 2, 3, 4]
    assert np.allclose(probs, [0.5, 0.25, 0.15, 0.07, 0.03], atol=1e-6)


@pytest.mark.parametrize(
    "top_k,top_p,expected_ids",
    [
        (2, 1.0, [0, 1]),
        (0, 0.5, [0]),
        (0, 0.6, [0, 1]),
        (0, 0.9, [0, 1, 2]),
        (2, 0.9, [0, 1]),
        (0, 1.0, [0, 1, 2, 3, 4]),
    ],
)
def test_top_k_and_top_p_truncate_and_renormalise(top_k, top_p, expected_ids):
    ids, probs = Sampler(1.0, top_k, top_p, 0).distribution(LOGITS)
    assert list(ids) == expected_ids
    assert probs.sum() == pytest.approx(1.0)


def test_temperature_sharpens_and_flattens():
    _, cold = Sampler(0.5, 0, 1.0, 0).distribution(LOGITS)
    _, hot = Sampler(2.0, 0, 1.0, 0).distribution(LOGITS)
    assert cold[0] > 0.5 > hot[0]


def test_samples_follow_the_distribution():
    s = Sampler(1.0, 0, 1.0, 123)
    counts = np.bincount([s.sample(LOGITS) for _ in range(20000)], minlength=5) / 20000
    assert np.allclose(counts, [0.5, 0.25, 0.15, 0.07, 0.03], atol=0.015)
