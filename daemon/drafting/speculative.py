"""Verification of drafted tokens: the acceptance rule of speculative sampling.

Given the target's logits at the k+1 verified positions, the k drafted tokens
and the drafter's distributions q for them, decide how many drafts to keep and
which token the target adds:

- temperature 0: keep a draft while it equals the target's argmax; the added
  token is the target's argmax where the first draft failed (or after the last).
- temperature > 0 (Leviathan et al. / Chen et al.): with p and q after
  temperature, top-k and top-p, keep draft d with probability min(1, p(d)/q(d));
  on rejection draw from max(0, p - q) normalised; after a fully accepted round
  draw the bonus token from p. The output is distributed exactly as sampling
  from the target alone.

Pure numpy; no model, no sockets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from .sampler import Sampler


@dataclass
class SparseDist:
    """A distribution over token ids: ``ids`` with probabilities ``probs`` (sum 1)."""

    ids: np.ndarray
    probs: np.ndarray

    def prob(self, token: int) -> float:
        hit = np.nonzero(self.ids == token)[0]
        return float(self.probs[hit[0]]) if hit.size else 0.0

    @classmethod
    def one_hot(cls, token: int) -> "SparseDist":
        return cls(np.array([token], dtype=np.int64), np.array([1.0]))


def residual(p: SparseDist, q: SparseDist) -> SparseDist:
    """max(0, p - q), normalised, over p's support (q's mass elsewhere only lowers nothing)."""
    q_on_p = np.zeros_like(p.probs)
    index = {int(t): i for i, t in enumerate(p.ids)}
    for t, qp in zip(q.ids, q.probs):
        i = index.get(int(t))
        if i is not None:
            q_on_p[i] = qp
    diff = np.maximum(p.probs - q_on_p, 0.0)
    total = diff.sum()
    if total <= 0.0:  # p == q exactly: rejection is impossible, but be safe
        return p
    return SparseDist(p.ids, diff / total)


def sample_from(dist: SparseDist, rng: np.random.Generator) -> int:
    return int(dist.ids[rng.choice(len(dist.ids), p=dist.probs)])


def verify(
    target_logits: np.ndarray,
    drafts: Sequence[int],
    draft_dists: Optional[Sequence[SparseDist]],
    sampler: Sampler,
) -> tuple[int, int]:
    """-> (number of drafts accepted, the token the target adds after them).

    ``target_logits[i]`` is the target's prediction for position i of the round
    (row i verifies ``drafts[i]``; row len(drafts) is the bonus position).
    ``draft_dists`` are the drafter's q (None or ignored at temperature 0).
    """
    k = len(drafts)
    assert target_logits.shape[0] == k + 1
    if sampler.greedy:
        for i, d in enumerate(drafts):
            best = int(np.argmax(target_logits[i]))
            if best != d:
                return i, best
        return k, int(np.argmax(target_logits[k]))
    assert draft_dists is not None and len(draft_dists) == k
    rng = sampler.rng
    for i, d in enumerate(drafts):
        p = SparseDist(*sampler.distribution(target_logits[i]))
        q = draft_dists[i]
        p_d, q_d = p.prob(d), q.prob(d)
        if q_d > 0.0 and rng.random() < min(1.0, p_d / q_d):
            continue
        return i, sample_from(residual(p, q), rng)
    return k, sample_from(SparseDist(*sampler.distribution(target_logits[k])), rng)
