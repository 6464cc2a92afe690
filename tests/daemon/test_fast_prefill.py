"""Fast prefill (--kernels mixed) on the real SmolLM2: prompts read with fast
kernels in chunks aligned to position 0 give the same logits whatever was
kept, restored or read before, and the model says what a later request may reuse."""

from __future__ import annotations

import numpy as np
import pytest

PREFILL_CHUNK = 64  # (llama_model.PREFILL_CHUNK; that module needs llama.cpp, imported where a model is)

TEXT = (
    "def parse(line):\n    fields = []\n    for part in line.split(','):\n        fields.append(part.strip())\n"
    "    return fields\n\nThe lighthouse keeper climbed the stairs every evening to light the lamp. "
) * 6


@pytest.fixture(scope="module")
def model(smollm2_path):
    from tandem.daemon.llama_model import PREFILL_CHUNK as chunk
    from tandem.daemon.llama_model import LlamaModel

    assert chunk == PREFILL_CHUNK
    m = LlamaModel(smollm2_path, n_ctx=1024, fast_prefill=True)
    yield m
    m.close()


@pytest.fixture(scope="module")
def tokens(model):
    t = model.tokenize(TEXT, add_special=True)
    assert len(t) > 3 * PREFILL_CHUNK
    return t[: 3 * PREFILL_CHUNK + 20]


def test_the_check_the_worker_runs_at_load_passes(model):
    assert model.prefill_chunk == PREFILL_CHUNK
    assert model.fast_prefill_is_exact() is True


def test_logits_do_not_depend_on_what_was_kept_restored_or_read_before(model, tokens):
    c = PREFILL_CHUNK
    model.clear()
    whole = model.prefill(tokens).copy()
    steps_whole = [model.decode([t])[0].copy() for t in (11, 12, 13)]
    # the first two chunks kept from a request that went on differently
    model.clear()
    model.prefill(tokens[: 2 * c] + [42] * 30)
    model.decode([7, 8])
    model.truncate(2 * c)
    kept = model.prefill(tokens[2 * c :]).copy()
    steps_kept = [model.decode([t])[0].copy() for t in (11, 12, 13)]
    # the first chunk restored from a state snapshot (what prefix-cache pages hold)
    model.clear()
    model.prefill(tokens[:c])
    blob = model.seq_state()
    model.set_seq_state(blob, c, tokens)
    restored = model.prefill(tokens[c:]).copy()
    assert np.array_equal(kept, whole) and np.array_equal(restored, whole)
    assert all(np.array_equal(a, b) for a, b in zip(steps_kept, steps_whole))
    model.clear()


def test_what_a_later_request_may_reuse(model, tokens):
    from tandem.daemon.llama_model import DecodeError

    c = PREFILL_CHUNK
    model.clear()
    model.prefill(tokens[: 2 * c + 5])
    assert model.kv_reusable == 2 * c  # the last, partial chunk is read again by a request that extends it
    model.decode([1, 2, 3])
    assert model.kv_reusable == 2 * c  # decoded tokens too (an uncached request reads them as prompt)
    model.truncate(c + 3)
    assert model.kv_reusable == c + 3
    model.clear()
    assert model.kv_reusable == 0
    with pytest.raises(DecodeError, match="multiple of 64"):
        model.decode(tokens[:5])
        model.prefill(tokens[5:20])
    model.clear()


def test_a_re_sent_prompt_gets_its_logits_back_without_reading(model, tokens):
    prompt = tokens[:100]
    model.clear()
    first = model.prefill(prompt).copy()
    model.decode([5, 6])  # the reply
    again = model.prefilled_logits(prompt)
    assert again is not None and np.array_equal(again, first)
    assert model.prefilled_logits(prompt[:-1]) is None and model.prefilled_logits(prompt[:-1] + [9]) is None
    model.truncate(90)
    assert model.prefilled_logits(prompt) is None
    model.clear()


def test_reference_kernels_everywhere_keep_every_position(smollm2_path):
    from tandem.daemon.llama_model import LlamaModel

    m = LlamaModel(smollm2_path, n_ctx=256)
    try:
        assert m.prefill_chunk == 0
        m.prefill(m.tokenize(TEXT, add_special=True)[:70])
        assert m.kv_reusable == 70 and m.prefilled_logits([1]) is None
    finally:
        m.close()
