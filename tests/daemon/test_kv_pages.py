"""llama.cpp's sequence state, cut into pages and put back: pinned to the format
of the vendored llama.cpp, and exact (bit-identical logits), with SmolLM2."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.daemon.cache.kv_pages import StateFormatError, assemble, cut, parse

PAGE = 16


@pytest.fixture(scope="module", params=[False, True], ids=["v-transposed", "flash-attn"])
def model(request, smollm2_path):
    from tandem.daemon.worker.llama_model import LlamaModel

    m = LlamaModel(smollm2_path, n_ctx=256, flash_attn=request.param)
    yield m
    m.close()


@pytest.fixture(scope="module")
def tokens(model):
    text = "The lighthouse keeper climbed the stairs every evening to light the lamp. " * 4
    out = model.tokenize(text, add_special=True)
    assert len(out) > 3 * PAGE
    return out[: 3 * PAGE]


def test_state_format_is_the_one_this_module_knows(model, tokens):
    model.clear()
    model.decode(tokens[:40])
    blob = model.seq_state()
    p = parse(blob)
    assert p.cell_count == 40 and len(p.k) == len(p.v) == 30  # SmolLM2-135M: 30 layers
    assert p.layout.v_trans == (not model.flash_attn)
    assert len(blob) == 8 + 8 + 8 + 40 * p.layout.bytes_per_cell + 30 * 12 + 30 * 12  # + per-layer K and V headers
    model.clear()
    model.decode(tokens[:20])
    other = parse(model.seq_state())
    assert other.layout == p.layout  # the layout (header included) does not depend on the content or length
    with pytest.raises(StateFormatError):
        parse(blob + b"\0")
    with pytest.raises(StateFormatError):
        parse(blob[:-1])


def test_pages_put_back_give_bit_identical_logits(model, tokens):
    model.clear()
    model.decode(tokens)
    p = parse(model.seq_state())
    pages = [cut(p, i * PAGE, (i + 1) * PAGE) for i in range(3)]
    assert all(len(pg) == p.layout.page_bytes(PAGE) for pg in pages)

    # the same batches without the round trip through pages: 2 pages prefilled, then 1 token
    # (one prefill of all 33 gives the same logits only where the kernels are batch-invariant:
    # tests/daemon/test_batch_invariance.py)
    model.clear()
    model.decode(tokens[: 2 * PAGE])
    expected = model.decode(tokens[2 * PAGE : 2 * PAGE + 1])[0]

    model.set_seq_state(assemble(p.layout, pages[:2], PAGE), 2 * PAGE)
    got = model.decode(tokens[2 * PAGE : 2 * PAGE + 1])[0]
    assert np.array_equal(got, expected)


def test_pages_out_of_order_are_refused(model, tokens):
    model.clear()
    model.decode(tokens)
    p = parse(model.seq_state())
    with pytest.raises(StateFormatError):
        assemble(p.layout, [cut(p, PAGE, 2 * PAGE)], PAGE)  # a second page cannot start a sequence
    with pytest.raises(StateFormatError):
        assemble(p.layout, [cut(p, 0, PAGE)[:-1]], PAGE)
