"""Exact output through the daemon's socket with default settings: greedy text
does not depend on the prefix cache, on drafting or on a second turn built over
cached pages (SmolLM2 Q4_1, the n-gram drafter). bench/exactness.py runs the same
comparison on the whole corpus and both model pairs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

CORPUS = json.loads((Path(__file__).parents[2] / "bench" / "corpus.json").read_text())
TOKENS = 32
# a house style every prompt starts with, so that even the shortest is longer than a
# prefill chunk (64 tokens): its turn 2 keeps whole chunks from turn 1
HOUSE_STYLE = (
    "House style: answer in plain English, keep every sentence short, never invent facts, say when you do "
    "not know, and prefer concrete examples to general advice. When a question is unclear, answer the most "
    "likely reading of it and say which one you chose. "
)


def with_house_style(messages: list[dict]) -> list[dict]:
    if messages[0]["role"] == "system":
        return [{"role": "system", "content": HOUSE_STYLE + messages[0]["content"]}, *messages[1:]]
    return [{"role": "system", "content": HOUSE_STYLE}, *messages]


@pytest.fixture(scope="module")
def exact_daemon(daemon_process, smollm2_path):
    # (its own load checks: what they find is what these tests are about)
    d = daemon_process(
        smollm2_path, "--drafter", "ngram", "--ctx-size", "2048", "--cache-bytes", "64M", fresh_probe=True
    )
    d.wait_ready(120)
    yield d
    d.stop()
    d.cleanup()


def greedy(client, messages, **params) -> list[int]:
    stream = client.generate(messages=messages, max_tokens=TOKENS, temperature=0.0, **params)
    return [t for chunk in stream for t in chunk.token_ids]


def test_the_daemon_reports_its_defaults_batch_invariant(exact_daemon):
    from tandem.daemon.worker.llama_load import cpu_has_amx

    with exact_daemon.client() as client:
        st = client.status()
        done = client.complete(prompt="Hello", max_tokens=2, temperature=0.0)
    m = st.model
    assert (m.kernels, m.flash_attn, m.prefill_chunk) == ("mixed", True, 64)
    assert m.extra_buffers is not cpu_has_amx()  # repacking (exact in steps of up to 3 rows), not AMX (it crashes)
    assert m.batch_invariant is True and m.batch_variant_paths == [] and done.batch_invariant is True
    assert not m.exact_steps  # an invariant target needs no two-token steps
    assert "batch-invariance probe" in exact_daemon.log()


@pytest.mark.parametrize("kind", list(CORPUS))
def test_greedy_text_does_not_depend_on_cache_or_drafting(exact_daemon, kind):
    messages = with_house_style(CORPUS[kind][0])
    with exact_daemon.client() as client:
        reference = greedy(client, messages, cache=False, draft="off")
        client.cache_clear()
        assert greedy(client, messages, draft="off") == reference  # cold: prefilled, then stored
        assert greedy(client, messages, draft="off") == reference  # warm: restored from pages
        assert greedy(client, messages, cache=False, draft="on") == reference  # drafting every round
        assert greedy(client, messages, cache=False) == reference  # as the governor decides
        text = client.complete(messages=messages, max_tokens=TOKENS, temperature=0.0, cache=False).text
        turn2 = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": "Shorter, please."}]
        fresh = greedy(client, turn2, cache=False, draft="off")
        client.cache_clear()
        client.complete(messages=messages, max_tokens=TOKENS, temperature=0.0)  # turn 1 and its reply cached
        cached = client.generate(messages=turn2, max_tokens=TOKENS, temperature=0.0, draft="off")
        ids = [t for chunk in cached for t in chunk.token_ids]
        assert cached.done.usage.cached_tokens > 0
        assert ids == fresh


def test_a_quantized_kv_cache_keeps_greedy_text_exact(daemon_process, smollm2_path):
    """--kv-type q8_0: the same checks as f16 (each row is quantized as it is written, so a
    position's KV does not depend on the pass that wrote it); pages carry the type."""
    d = daemon_process(
        smollm2_path, "--drafter", "ngram", "--ctx-size", "2048", "--cache-bytes", "64M", "--kv-type", "q8_0"
    )
    d.wait_ready(120)
    messages = with_house_style(CORPUS["code"][0])
    try:
        with d.client() as client:
            st = client.status()
            assert st.model.kv_type == "q8_0" and "q8_0 KV cache" in st.context and st.model.n_ctx == 2048
            assert st.model.batch_invariant is not None  # probed with this cache type (its own verdict)
            reference = greedy(client, messages, cache=False, draft="off")
            assert greedy(client, messages, draft="off") == reference  # cold
            warm = client.generate(messages=messages, max_tokens=TOKENS, temperature=0.0, draft="off")
            assert [t for chunk in warm for t in chunk.token_ids] == reference and warm.done.usage.cached_tokens > 0
            assert greedy(client, messages, cache=False, draft="on") == reference
    finally:
        d.stop()
        d.cleanup()


def test_seeded_sampling_does_not_depend_on_the_cache(exact_daemon):
    messages = CORPUS["story"][1]
    params = dict(max_tokens=TOKENS, temperature=0.9, top_p=0.95, seed=1234)
    with exact_daemon.client() as client:
        reference = client.complete(messages=messages, cache=False, **params).text
        client.cache_clear()
        cold = client.complete(messages=messages, **params)
        warm = client.complete(messages=messages, **params)
        other_seed = client.complete(messages=messages, cache=False, **{**params, "seed": 99}).text
    assert warm.usage.cached_tokens > 0
    assert cold.text == warm.text == reference
    assert other_seed != reference  # the seed is what fixes the draws


@pytest.fixture(scope="module", params=["on", "off"])
def repacked_daemon(request, daemon_process, coder_path):
    """Qwen2.5-Coder-0.5B (some of its weights are of a type llama.cpp repacks) with
    the default extra buffers: repacked where the CPU allows (not on AMX ones);
    prompts read by the prompt reader (over the weights not repacked) or not."""
    d = daemon_process(
        coder_path,
        *("--drafter", "ngram", "--ctx-size", "2048", "--cache-bytes", "64M", "--prompt-reader", request.param),
        fresh_probe=True,
    )
    d.reader = request.param == "on"
    d.wait_ready(180)
    yield d
    d.stop()
    d.cleanup()


@pytest.mark.parametrize("kind", ["code", "json"])
def test_repacked_weights_give_the_same_greedy_text_cached_drafted_or_not(repacked_daemon, kind):
    """Steps over repacked weights run in passes of at most 3 rows, so a verify pass
    of 5 tokens (n-gram drafts, k = 4) and a restore from pages give the tokens plain
    decoding gives; the load probe finds the target invariant."""
    from tandem.daemon.worker.llama_load import cpu_has_amx

    messages = with_house_style(CORPUS[kind][0])
    with repacked_daemon.client() as client:
        m = client.status().model
        assert m.extra_buffers is not cpu_has_amx() and m.batch_invariant is True and not m.exact_steps
        # a reader where llama.cpp repacked some weights (none on CPUs with AMX)
        assert m.prompt_reader is (repacked_daemon.reader and "CPU_REPACK" in m.weights), m.weights
        reference = greedy(client, messages, cache=False, draft="off")
        client.cache_clear()
        assert greedy(client, messages, draft="off") == reference  # cold
        assert greedy(client, messages, draft="off") == reference  # warm: restored from pages
        drafted = client.generate(messages=messages, max_tokens=TOKENS, temperature=0.0, cache=False, draft="on")
        assert [t for chunk in drafted for t in chunk.token_ids] == reference
        assert drafted.done.draft is not None and drafted.done.draft.drafted > 0  # it did verify drafts
        # the next turn: what the last one left live (settled between the two) and what is new
        text = client.complete(messages=messages, max_tokens=TOKENS, temperature=0.0, cache=False).text
        turn = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": "Shorter, please."}]
        uncached = greedy(client, turn, cache=False, draft="off")
        client.complete(messages=messages, max_tokens=TOKENS, temperature=0.0)  # the turn, live in the worker
        nxt = client.generate(messages=turn, max_tokens=TOKENS, temperature=0.0, draft="off")
        assert [t for chunk in nxt for t in chunk.token_ids] == uncached and nxt.done.usage.cached_tokens > 0
    assert "tokens per pass" in repacked_daemon.log()


HELDOUT = json.loads((Path(__file__).parents[2] / "bench" / "corpus_heldout.json").read_text())
# prompts where a daemon without a drafter (one-token steps) and one drafting with the Q4_1 file (exact
# steps) wrote other text before exact steps were taken without a drafter too (this AMD EPYC, AVX2, 64
# tokens: held-out json[6] from token 18, corpus support[4] from 46), then the first of each held-out kind
PAIR_PROMPTS = [HELDOUT["json"][6], CORPUS["support"][4], *(HELDOUT[kind][0] for kind in HELDOUT)]
PAIR_TOKENS = 48


def test_a_target_that_is_not_batch_invariant_writes_the_same_text_drafted_or_not_in_any_daemon(
    start_daemon, smollm2_path, tmp_path
):
    """SmolLM2 F16 (llamafile's tinyBLAS for 2+ rows, another kernel for one), the Q4_1 file as drafter,
    default settings: a daemon without a drafter, the drafting daemon with drafting off, forced and governed,
    and a prompt restored from disk pages the other daemon wrote, all write the same greedy text. What the
    daemons do to get there depends on the CPU, and is asserted for whichever this is: exact steps where
    one-token steps round differently, and drafting off (said in done) where verify passes do too."""
    from tandem.daemon import models

    f16 = models.derive_f16(smollm2_path)
    shared = {"TANDEM_DISK_CACHE_DIR": str(tmp_path / "kv")}
    args = ("--ctx-size", "2048", "--cache-bytes", "64M")

    def check_probe(model) -> None:
        assert model.batch_invariant is not None and model.kernels == "mixed"
        assert model.exact_steps is (model.batch_invariant is False)  # auto: on wherever a path differs
        steps = "exact_steps" if model.exact_steps else "one_token"  # the steps taken between verify passes
        assert bool(model.draft_off) is (steps in model.batch_variant_paths)

    plain = start_daemon("--drafter", "none", *args, model=f16, env=shared)
    with plain.client() as client:
        check_probe(client.status().model)
        no_drafter = [greedy_n(client, m) for m in PAIR_PROMPTS]  # cache on: its pages go to the disk tier too
        time.sleep(2)  # idle: pages are written to disk between requests
    assert plain.stop() == 0, plain.log()  # (and the rest at shutdown: one daemon writes a bucket at a time)

    spec = start_daemon("--drafter", str(smollm2_path), *args, model=f16, env=shared)
    with spec.client() as client:
        model = client.status().model
        check_probe(model)
        restored = 0
        for messages, want in zip(PAIR_PROMPTS, no_drafter):
            reference = greedy_n(client, messages, cache=False, draft="off")
            assert reference == want, "a daemon without a drafter wrote other text"
            client.cache_clear(memory_only=True)
            stream = client.generate(messages=messages, max_tokens=PAIR_TOKENS, temperature=0.0, draft="off")
            assert [t for chunk in stream for t in chunk.token_ids] == reference, "restored from disk pages"
            usage = stream.done.usage
            # the other daemon's pages, where the prompt has a whole 64-token chunk (only those are kept)
            assert (usage.cached_tokens > 0) is (usage.prompt_tokens > 64), usage
            restored += usage.cached_tokens > 0
            for draft in ("on", "auto"):
                stream = client.generate(
                    messages=messages, max_tokens=PAIR_TOKENS, temperature=0.0, cache=False, draft=draft
                )
                assert [t for chunk in stream for t in chunk.token_ids] == reference, f"draft {draft}"
                done = stream.done
                if model.draft_off:
                    assert done.draft_off == model.draft_off and done.draft is None
                elif draft == "on":
                    assert done.draft_off is None and done.draft is not None and done.draft.rounds > 0
        assert restored >= 2  # the long json prompts at least


def greedy_n(client, messages, **params) -> list[int]:
    stream = client.generate(messages=messages, max_tokens=PAIR_TOKENS, temperature=0.0, **params)
    return [t for chunk in stream for t in chunk.token_ids]
