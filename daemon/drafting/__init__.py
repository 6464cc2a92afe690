"""Speculative decoding: the governor, the acceptance rule, the lookup drafters (ngram,
suffix), the drafter worker and its client, the sampler."""
