"""Token sampling from logits: greedy, or temperature then top-k then top-p.

Pure numpy, seeded per request, so a request with a seed reproduces its tokens.
``distribution`` exposes the final probabilities (speculative verification
needs them, not just a sample).
"""

from __future__ import annotations

from typing import Optional

import numpy as np


class Sampler:
    def __init__(self, temperature: float, top_k: int, top_p: float, seed: Optional[int]):
        self.temperature = temperature
        self.top_k = top_k
        self.top_p = top_p
        self.seed = seed if seed is not None else int(np.random.SeedSequence().entropy % 2**64)
        self.rng = np.random.Generator(np.random.PCG64(self.seed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def distribution(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Returns (token ids, probabilities) of the tokens that survive top-k and
        top-p, probabilities after temperature, summing to 1, highest first."""
        logits = np.asarray(logits, dtype=np.float32)
        n = logits.shape[0]
        if self.greedy:
            return np.array([int(np.argmax(logits))]), np.array([1.0])
        if 0 < self.top_k < n:
            ids = np.argpartition(logits, n - self.top_k)[n - self.top_k :]
        else:
            ids = np.arange(n)
        ids = ids[np.argsort(-logits[ids], kind="stable")]
        scaled = logits[ids].astype(np.float64) / self.temperature
        scaled -= scaled[0]
        probs = np.exp(scaled)
        probs /= probs.sum()
        if self.top_p < 1.0:
            # keep the smallest prefix whose mass reaches top_p (at least one token)
            keep = int(np.searchsorted(np.cumsum(probs), self.top_p, side="left")) + 1
            ids, probs = ids[:keep], probs[:keep]
            probs = probs / probs.sum()
        return ids, probs

    def sample(self, logits: np.ndarray) -> int:
        if self.greedy:
            return int(np.argmax(logits))
        ids, probs = self.distribution(logits)
        return int(ids[self.rng.choice(len(ids), p=probs)])
