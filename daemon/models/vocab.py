"""Does a drafter fit a target? Their token ids must mean the same text."""

from __future__ import annotations

from typing import Optional

from tandem.protocol import ModelInfo

BLOCK = 4096  # ids per digest, as LlamaModel.vocab_digests
# ids a target's vocabulary may have past its drafter's (padding: Qwen2.5 7B and larger have 152,064,
# the 0.5B-3B 151,936), as llama.cpp's speculative decoding allows
PAD_TOKENS = 128


def vocab_mismatch(target: ModelInfo, drafter: ModelInfo) -> Optional[str]:
    """None when the vocabularies match, else what differs, naming both models. A target padded past
    the drafter by up to PAD_TOKENS ids: the whole blocks they share are compared here, the drafter's
    last, partial block from the files before loading (drafter_auto.pick_drafter)."""
    who = f"drafter {drafter.name} does not fit target {target.name}"
    padded = 0 < target.n_vocab - drafter.n_vocab <= PAD_TOKENS
    if target.n_vocab != drafter.n_vocab and not padded:
        return f"{who}: vocabulary sizes differ ({drafter.n_vocab:,} vs {target.n_vocab:,} tokens)"
    for i, (a, b) in enumerate(zip(target.vocab_digests, drafter.vocab_digests)):
        if padded and (i + 1) * BLOCK > drafter.n_vocab:
            break
        if a != b:
            return (
                f"{who}: token texts differ for ids {i * BLOCK:,}-{min((i + 1) * BLOCK, target.n_vocab) - 1:,} "
                "(different tokenizers)"
            )
    if len(target.vocab_digests) != len(drafter.vocab_digests) and not padded:
        return f"{who}: could not compare the vocabularies"
    return None
