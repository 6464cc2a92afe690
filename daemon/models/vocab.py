"""Does a drafter fit a target? Their token ids must mean the same text."""

from __future__ import annotations

from typing import Optional

from tandem.protocol import ModelInfo

BLOCK = 4096  # ids per digest, as LlamaModel.vocab_digests


def vocab_mismatch(target: ModelInfo, drafter: ModelInfo) -> Optional[str]:
    """None when the vocabularies match, else what differs, naming both models."""
    who = f"drafter {drafter.name} does not fit target {target.name}"
    if target.n_vocab != drafter.n_vocab:
        return f"{who}: vocabulary sizes differ ({drafter.n_vocab:,} vs {target.n_vocab:,} tokens)"
    for i, (a, b) in enumerate(zip(target.vocab_digests, drafter.vocab_digests)):
        if a != b:
            return (
                f"{who}: token texts differ for ids {i * BLOCK:,}-{min((i + 1) * BLOCK, target.n_vocab) - 1:,} "
                "(different tokenizers)"
            )
    if len(target.vocab_digests) != len(drafter.vocab_digests):
        return f"{who}: could not compare the vocabularies"
    return None
