"""Fast prefill (--kernels mixed) on the real SmolLM2, and on Qwen2.5-Coder-0.5B
with its prompts read by a second context over the weights not repacked (the
prompt reader, where llama.cpp repacks them: not on CPUs with AMX): prompts read
with fast kernels in chunks aligned to position 0 give the same logits whatever
was kept, restored or read before, and the model says what a later request may reuse."""

from __future__ import annotations

import logging

import numpy as np
import pytest

PREFILL_CHUNK = 64  # (llama_decode.PREFILL_CHUNK; that module needs llama.cpp, imported where a model is)

TEXT = (
    "def parse(line):\n    fields = []\n    for part in line.split(','):\n        fields.append(part.strip())\n"
    "    return fields\n\nThe lighthouse keeper climbed the stairs every evening to light the lamp. "
) * 6


@pytest.fixture(scope="module", params=["smollm2", "coder-reader"])
def model(request, smollm2_path, coder_path):
    from tandem.daemon.worker.llama_decode import PREFILL_CHUNK as chunk
    from tandem.daemon.worker.llama_load import cpu_has_amx
    from tandem.daemon.worker.llama_model import LlamaModel
    from tandem.daemon.worker.target_worker import check_prefill_grouping

    assert chunk == PREFILL_CHUNK
    reader = request.param == "coder-reader"
    path = coder_path if reader else smollm2_path
    m = LlamaModel(path, n_ctx=1024, fast_prefill=True, settle=True, prompt_reader=reader)
    # a reader where llama.cpp repacked weights (for the target's mixed kernels; none on CPUs with AMX)
    repacked = "CPU_REPACK" in m.placement.weights
    assert (m.reader is not None) == (reader and repacked), m.placement.weights
    assert not (repacked and cpu_has_amx())
    check_prefill_grouping(m)  # as the worker does at load: whole chunks grouped only where that is exact
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


def test_whole_chunks_are_read_several_per_pass_only_where_that_measures_exact(model):
    from tandem.daemon.worker.llama_decode import PREFILL_GROUP

    c, g, chosen = PREFILL_CHUNK, PREFILL_GROUP, model.prefill_group
    tokens = model.tokenize(TEXT * 2, add_special=True)[: g + c + 20]
    assert len(tokens) == g + c + 20

    def read(group: int, kept: int = 0) -> np.ndarray:
        """The logits after ``tokens``: ``kept`` of them read first chunk by chunk
        (what a cached request keeps), the rest up to ``group`` tokens per pass."""
        model.clear()
        model.prefill_group = c
        if kept:
            model.prefill(tokens[:kept])
        model.prefill_group = group
        return model.prefill(tokens[kept:]).copy()

    try:
        alone = read(c)
        grouped = [read(g), read(g, kept=c), read(3 * c, kept=2 * c), read(2 * c, kept=c)]
        measured = all(np.array_equal(alone, other) for other in grouped)
        model.prefill_group = g  # the load check, asked about the group the worker would use
        assert model.prefill_grouping_is_exact() is measured  # it agrees with these longer reads
    finally:
        model.prefill_group = chosen
        model.clear()
    # the product's choice on this CPU (the fixture ran the worker's check): a group where exact, else one chunk
    assert chosen == (g if measured else c)


def test_the_checks_read_chunk_by_chunk_and_keep_the_group(model):
    """The fast-prefill check compares a chunk read alone with a chunk read
    before others: with grouping on, that would be the grouping check, and an
    inexact group would turn fast prefill off instead of grouping."""
    group = model.prefill_group
    seen = []
    reads = model.reader or model  # (the context whose fast kernels read prompts)
    real = reads.decode

    def spy(tokens, *args, **kwargs):
        if reads._fast:
            seen.append(len(tokens))
        return real(tokens, *args, **kwargs)

    from tandem.daemon.worker.llama_decode import PREFILL_GROUP

    reads.decode = spy
    model.prefill_group = PREFILL_GROUP  # (whatever this CPU's grouping check chose: the group a check must not use)
    try:
        assert model.fast_prefill_is_exact() is True
        assert model.prefill_group == PREFILL_GROUP
    finally:
        del reads.decode
        model.prefill_group = group
    assert seen and max(seen) <= PREFILL_CHUNK


def test_a_context_too_small_for_the_group_checks_and_uses_a_smaller_one(model):
    from tandem.daemon.worker.llama_decode import PREFILL_GROUP
    from tandem.daemon.worker.llama_model import LlamaModel
    from tandem.daemon.worker.target_worker import check_prefill_grouping

    c = PREFILL_CHUNK
    grouping = model.prefill_group == PREFILL_GROUP  # this CPU's verdict on grouping, at the full group
    m = LlamaModel(model.path, n_ctx=4 * c, fast_prefill=True, prompt_reader=model.reader is not None)
    try:
        check_prefill_grouping(m)
        # 256 tokens hold a group of 2 chunks, one more chunk and 8 tokens, not of 4: 2 where grouping is exact
        assert m.prefill_group == (2 * c if grouping else c)
    finally:
        m.close()
    m = LlamaModel(model.path, n_ctx=2 * c + 40, fast_prefill=True, prompt_reader=model.reader is not None)
    try:
        check_prefill_grouping(m)
        assert m.prefill_group == c  # nothing to check a group in: one chunk per pass
    finally:
        m.close()


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
    # restored over other tokens (with a prompt reader: it held others when the state came back)
    model.clear()
    model.prefill([42] * (2 * c))
    model.set_seq_state(blob, c, tokens)
    over_other = model.prefill(tokens[c:]).copy()
    assert np.array_equal(kept, whole) and np.array_equal(restored, whole) and np.array_equal(over_other, whole)
    assert all(np.array_equal(a, b) for a, b in zip(steps_kept, steps_whole))
    model.clear()


def test_what_a_later_request_may_reuse(model, tokens):
    from tandem.daemon.worker.llama_load import DecodeError

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
    from tandem.daemon.worker.llama_model import LlamaModel

    m = LlamaModel(smollm2_path, n_ctx=256)
    try:
        assert m.prefill_chunk == 0
        m.prefill(m.tokenize(TEXT, add_special=True)[:70])
        assert m.kv_reusable == 70 and m.prefilled_logits([1]) is None
    finally:
        m.close()


# --------------------------------------------------------------------------- settling between requests


def a_turn(model, prompt, reply):
    """A request: the prompt read, its reply decoded a token at a time; the logits after the prompt."""
    model.clear()
    logits = model.prefill(prompt).copy()
    for t in reply:
        model.decode([t])
    return logits


def next_turn(model, tokens):
    """What the engine does with the next prompt: the re-sent check, then what it keeps, then the rest."""
    assert model.prefilled_logits(tokens) is None
    keep = min(model.live_prefix(tokens), model.kv_reusable, (len(tokens) - 1) // PREFILL_CHUNK * PREFILL_CHUNK)
    model.truncate(keep // PREFILL_CHUNK * PREFILL_CHUNK)
    return model.n_past, model.prefill(tokens[model.n_past :]).copy()


@pytest.fixture(scope="module")
def turns(model):
    t = model.tokenize(TEXT * 2, add_special=True)
    c = PREFILL_CHUNK
    prompt, reply, extended = t[: c + 40], t[c + 40 : c + 150], t[: c + 190]
    model.clear()
    uncached = model.prefill(extended).copy()
    model.clear()
    first = model.prefill(prompt).copy()
    return prompt, reply, extended, uncached, first


def test_a_settled_turn_gives_the_next_turn_its_reply_in_whole_chunks_with_uncached_logits(model, turns):
    prompt, reply, extended, uncached, _ = turns
    c = PREFILL_CHUNK
    a_turn(model, prompt, reply)
    assert model.kv_reusable == c  # only the prompt's first whole chunk, before settling
    kept = []
    assert model.settle(kept.append, lambda: False) == 2 * c  # [c, 3c): the partial chunk and the reply
    assert kept == [list(prompt + reply)[: 3 * c]] and model.kv_reusable == 3 * c
    assert model.settle(kept.append, lambda: False) == 0  # nothing left to settle
    n, logits = next_turn(model, extended)
    assert n == 3 * c and np.array_equal(logits, uncached)


def test_a_prompt_re_sent_after_settling_gets_its_own_state_back(model, turns):
    prompt, reply, _, _, first = turns
    a_turn(model, prompt, reply)
    step = model.decode([reply[0]])[0].copy()  # (what decoding on from the turn's end gives)
    a_turn(model, prompt, reply)
    model.settle(lambda tokens: None, lambda: False)
    back = model.prefilled_logits(prompt)
    assert back is not None and np.array_equal(back, first) and model.n_past == len(prompt) + len(reply)
    assert model.kv_reusable == PREFILL_CHUNK  # as the turn left it
    assert np.array_equal(model.decode([reply[0]])[0], step)


def message_after(polls: int):
    """``interrupted`` for settle: a message arrives after ``polls`` polls and waits (True from then on)."""
    left = [polls]

    def interrupted() -> bool:
        left[0] -= 1
        return left[0] < 0

    return interrupted


@pytest.mark.parametrize("polls_before", [0, 1, 3])
def test_a_message_stops_settling_at_once_and_it_goes_on_later(model, turns, polls_before):
    """``interrupted`` says True after some polls: between chunks (0) or inside a pass,
    through llama.cpp's abort callback (the later ones). The chunks read stand; a
    next call goes on; the next turn's logits are the uncached ones either way."""
    prompt, reply, extended, uncached, first = turns
    c = PREFILL_CHUNK
    a_turn(model, prompt, reply)
    kept = []
    stopped = model.settle(kept.append, message_after(polls_before))
    assert stopped < 0 and kept == [] and model.n_past == model.kv_reusable == c - 1 - stopped
    n, logits = next_turn(model, extended)  # a request came: it keeps what was read
    assert n >= c and np.array_equal(logits, uncached)
    a_turn(model, prompt, reply)
    model.settle(kept.append, message_after(polls_before))
    assert model.settle(kept.append, lambda: False) > 0  # a message that was not a request: it goes on
    assert kept and kept[-1] == list(prompt + reply)[: 3 * c]
    n, logits = next_turn(model, extended)
    assert n == 3 * c and np.array_equal(logits, uncached)
    a_turn(model, prompt, reply)
    model.settle(kept.append, lambda: True)
    back = model.prefilled_logits(prompt)  # re-sent after a stopped settle: its own state back
    assert back is not None and np.array_equal(back, first)


# --------------------------------------------------------------------------- the prompt reader


def test_the_prompt_reader_computes_the_prompt_and_the_steps_are_this_contexts(model, tokens):
    """With a reader, a prompt's logits (and its KV) are what a context over the
    weights not repacked computes, and the steps after it are this context's own:
    a step over the repacked weights. Without one (SmolLM2 has no weights llama.cpp
    repacks; a CPU with AMX repacks none), there is nothing to measure."""
    from tandem.daemon.worker.llama_model import LlamaModel

    if model.reader is None:
        assert model.prompt_reader_pays() is None and model.add_prompt_reader() is (model.step_rows > 0)
        model.drop_prompt_reader()
        return
    plain = LlamaModel(model.path, n_ctx=1024, fast_prefill=True, extra_buffers=False)
    try:
        plain.set_prefill_group(model.prefill_group)
        expected = plain.prefill(tokens).copy()
        model.clear()
        got = model.prefill(tokens).copy()
        model.decode([11])  # a step, in this context
        assert np.array_equal(got, expected)
        assert model.n_past == len(tokens) + 1 and model.reader.n_past == len(tokens)
        # the load's measurement (--prompt-reader auto): a verdict, both caches left empty
        assert isinstance(model.prompt_reader_pays(), bool)
        assert model.reader is not None and model.n_past == 0 and model.reader.n_past == 0
    finally:
        plain.close()
        model.clear()


def test_a_prompt_stopped_between_passes_keeps_what_was_read(model, tokens):
    from tandem.daemon.drafting.interfaces import DecodeAborted

    c = PREFILL_CHUNK
    model.clear()
    whole = model.prefill(tokens).copy()
    group, model.prefill_group = model.prefill_group, c
    polls = []
    try:
        model.clear()
        with pytest.raises(DecodeAborted):
            model.prefill(tokens, abort=lambda: polls.append(1) or len(polls) >= 2)  # after two chunks
        assert model.n_past == model.kv_reusable == 2 * c and model.history == list(tokens[: 2 * c])
        rest = model.prefill(tokens[2 * c :])  # the next request keeps them
        assert np.array_equal(rest, whole)
    finally:
        model.prefill_group = group
        model.clear()


def test_auto_keeps_a_faster_prompt_reader_only_where_its_kv_cache_fits_the_budget(coder_path, caplog):
    """--prompt-reader auto weighs memory too: the reader's KV cache (one more of the
    context's) must fit in what --kv-budget leaves beside the caches the context was
    sized for. The speed verdict is set here (True: what the rule then weighs is
    memory); the model and its reader are real."""
    from tandem.daemon.config import SettingsValues
    from tandem.daemon.worker.llama_load import cpu_has_amx
    from tandem.daemon.worker.llama_model import LlamaModel
    from tandem.daemon.worker.target_worker import choose_prompt_reader, reader_kv_bytes
    from tandem.daemon.worker.worker_config import WorkerConfig

    def config(kv_room: int) -> WorkerConfig:
        return WorkerConfig("target", "coder", str(coder_path), SettingsValues(), kv_room=kv_room)

    caplog.set_level(logging.INFO, logger="tandem")
    m = LlamaModel(coder_path, n_ctx=1024, fast_prefill=True, prompt_reader=True)
    try:
        m.prompt_reader_pays = lambda margin=1.1: True
        if m.reader is None:  # no weights repacked (a CPU with AMX): no reader to weigh, whatever the budget
            assert cpu_has_amx()
            choose_prompt_reader(m, config(-1))
            assert m.reader is None
            return
        kv = reader_kv_bytes(m)
        assert kv == 1024 * 24 * 2 * (64 + 64) * 2  # Qwen2.5-0.5B: 24 layers, 2 KV heads of 64, K and V, f16
        choose_prompt_reader(m, config(kv))  # it just fits
        assert m.reader is not None and "its KV cache: 12 MiB more" in caplog.text
        choose_prompt_reader(m, config(-1))  # (room not known: speed decides)
        assert m.reader is not None
        choose_prompt_reader(m, config(kv - 1))
        assert m.reader is None
        assert "KV cache (12 MiB at 1024 tokens) does not fit in what --kv-budget leaves (12 MiB)" in caplog.text
    finally:
        m.close()


def test_auto_decides_the_prompt_reader_alike_for_every_daemon_on_the_machine(coder_path, tmp_path, monkeypatch):
    """The reader reads a prompt's KV in other bits than the repacked weights, so --prompt-reader auto must
    not decide it per state directory: a daemon whose state directory kept "not faster" from before, and
    one that measures "not faster" now, both take the verdict kept for the machine (here: the first daemon
    measured "faster")."""
    from tandem.daemon.config import SettingsValues
    from tandem.daemon.worker.invariance import kept_check
    from tandem.daemon.worker.llama_model import LlamaModel
    from tandem.daemon.worker.target_worker import choose_prompt_reader
    from tandem.daemon.worker.worker_config import WorkerConfig

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))

    def config(state: str) -> WorkerConfig:
        kept = str(tmp_path / state / "batch-invariance.json")
        return WorkerConfig("target", "coder", str(coder_path), SettingsValues(), probe_cache=kept)

    m = LlamaModel(coder_path, n_ctx=1024, fast_prefill=True, prompt_reader=True)
    try:
        if m.reader is None:  # no weights repacked (a CPU with AMX): no reader to decide on
            return
        name = f"prompt_reader faster chunk={m.prefill_chunk} group={m.prefill_group}"
        assert kept_check(m, config("old"), name, lambda: False) is False  # kept in a state directory before
        m.prompt_reader_pays = lambda margin=1.1: True
        choose_prompt_reader(m, config("first"))
        assert m.reader is not None
        m.prompt_reader_pays = lambda margin=1.1: False
        choose_prompt_reader(m, config("old"))
        choose_prompt_reader(m, config("fresh"))
        assert m.reader is not None
    finally:
        m.close()


def test_the_prompt_readers_copy_buffer_is_kept_only_while_small(model, tokens, monkeypatch):
    """The buffer the reader copies KV states through is reused while small; one for a
    long prompt's KV (hundreds of MiB at 32k) is let go after the copy, not held beside
    the two KV caches."""
    from tandem.daemon.worker import prompt_reader

    if model.reader is None:  # (SmolLM2, or a CPU with AMX: no reader, nothing copied)
        assert model.prompt_reader is None
        return
    try:
        model.clear()
        model.prefill(tokens)
        buf = model.prompt_reader._state_buf
        assert buf is not None and len(buf) >= 1 << 20  # small: kept for the next copy
        monkeypatch.setattr(prompt_reader, "KEEP_BUFFER_BYTES", len(buf) - 1)
        model.clear()
        model.prefill(tokens)
        assert model.prompt_reader._state_buf is None  # over the limit: let go
        assert model.n_past == len(tokens)
    finally:
        model.clear()
