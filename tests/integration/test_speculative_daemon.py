"""Speculative decoding through the real daemon: SmolLM2-135M F16 target with
its own Q4_1 file as drafter (same tokenizer), and the n-gram drafter."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import numpy as np
import pytest

from bench.fidelity import compare, load_corpus, reference_engine


@pytest.fixture(scope="module")
def pair(smollm2_path):
    from tandem.daemon import models

    return models.derive_f16(smollm2_path), smollm2_path


@pytest.fixture(scope="module")
def spec_daemon(daemon_process, pair):
    target, drafter = pair
    # every round drafts (no governor), so these tests see drafting itself
    d = daemon_process(
        target, "--drafter", str(drafter), "--ctx-size", "2048", "--draft-tokens", "4", "--governor", "off"
    )
    d.wait_ready()
    yield d
    assert d.stop() == 0, d.log()
    d.cleanup()


def test_greedy_with_the_drafter_equals_plain_greedy_on_the_corpus(spec_daemon, pair):
    # five prompts of each kind (bench/exactness.py compares the whole corpus, both model pairs)
    corpus = {kind: prompts[:5] for kind, prompts in load_corpus().items()}
    assert len(corpus) == 4 and all(len(prompts) == 5 for prompts in corpus.values())
    engine = reference_engine(str(pair[0]), flash_attn=True)  # the daemon's defaults
    with spec_daemon.client() as client:
        result = compare(client, corpus, ks=[4], tokens=32, engine=engine)
    report = "\n".join(
        f"{d.kind}[{d.prompt_index}] k={d.k}: diverged at token {d.position}, top-2 logit gap {d.top2_gap:.4f}"
        for d in result.divergences
    )
    print(
        f"\nidentical to the daemon's plain path: {result.identical.get(4, 0)}/{result.total[4]}; "
        f"to one-token plain decoding: {result.identical_to_single.get(4, 0)}/{result.total[4]}\n{report}"
    )
    assert result.identical.get(4, 0) == result.total[4] == 20, report


def test_draft_stats_in_done_status_and_run_json(tandem_cli, spec_daemon):
    with spec_daemon.client() as client:
        before = client.status().draft
        done = client.complete(prompt="def fibonacci(n):", max_tokens=48, temperature=0.0, ignore_eos=True)
        d = done.draft
        assert d is not None and d.rounds > 0, spec_daemon.log()[-4000:]  # (why it did not draft, if it did not)
        assert 0 < d.accepted <= d.drafted <= 4 * d.rounds
        assert d.acceptance_rate == pytest.approx(d.accepted / d.drafted)
        assert len(d.accepted_per_position) <= 4 and sum(d.accepted_per_position) == d.accepted
        assert all(a >= b for a, b in zip(d.accepted_per_position, d.accepted_per_position[1:]))
        assert d.tokens_per_round == pytest.approx((d.accepted + d.rounds) / d.rounds)
        after = client.status()
        assert after.drafter.startswith("SmolLM2") and after.draft_tokens == 4
        assert after.draft.rounds == (before.rounds if before else 0) + d.rounds
        assert after.memory_rss_bytes["drafter"] > 0 and "drafter" in after.worker_pids
        plain = client.complete(prompt="def fibonacci(n):", max_tokens=8, temperature=0.0, draft_tokens=0)
        assert plain.draft is None
    args = ("run", "--raw", "--json", "--temperature", "0", "--max-tokens", "16", "def add(a, b):")
    out = tandem_cli(spec_daemon.socket, *args, timeout=120)
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)["draft"]
    assert set(stats) == {
        "rounds",
        "drafted",
        "accepted",
        "acceptance_rate",
        "accepted_per_position",
        "tokens_per_round",
        "forced",
    }


def test_seeded_sampling_with_the_drafter_reproduces(spec_daemon):
    with spec_daemon.client() as client:
        runs = [
            client.complete(prompt="My favourite animal is", max_tokens=32, temperature=0.9, seed=11) for _ in range(2)
        ]
    assert runs[0].text == runs[1].text and runs[0].draft.rounds > 0


def test_sampling_distribution_with_and_without_the_drafter_match_chi_squared(spec_daemon):
    """The first two tokens at temperature 1 (top_k 4): the second is a verified
    draft or a residual sample when drafting, a plain sample otherwise."""
    n = 400
    counts = {0: collections.Counter(), 2: collections.Counter()}
    with spec_daemon.client() as client:
        for k in counts:
            for seed in range(n):
                stream = client.generate(
                    prompt="My favourite fruit is",
                    max_tokens=3,
                    temperature=1.0,
                    top_k=4,
                    seed=seed,
                    draft_tokens=k,
                    ignore_eos=True,
                )
                ids = [t for c in stream for t in c.token_ids]
                counts[k][tuple(ids[:2])] += 1
            if k:
                assert stream.done.draft is not None and stream.done.draft.rounds > 0
    assert_same_distribution(counts[0], counts[2])


def assert_same_distribution(a: collections.Counter, b: collections.Counter) -> None:
    """Chi-squared test of homogeneity on two samples' outcome counts."""
    from scipy.stats import chi2_contingency

    keys = sorted(set(a) | set(b), key=lambda key: -(a[key] + b[key]))
    table = np.array([[a[key] for key in keys], [b[key] for key in keys]], dtype=float)
    # pool rare outcomes so every expected count is >= 5
    common = table[:, table.sum(axis=0) >= 10]
    rare = table[:, table.sum(axis=0) < 10].sum(axis=1, keepdims=True)
    table = np.hstack([common, rare]) if rare.sum() else common
    assert table.shape[1] >= 4, "the test needs a spread of outcomes"
    _, pvalue, _, _ = chi2_contingency(table)
    assert pvalue > 0.001, (keys, table)


CODE = "def area(width, height):\n    return width * height\n\n"


def drafted_and_plain(client, prompt: str):
    """The same greedy request drafting every round, then without drafting."""
    drafted = client.complete(prompt=prompt, max_tokens=40, temperature=0.0, draft="on")
    plain = client.complete(prompt=prompt, max_tokens=40, temperature=0.0, draft_tokens=0)
    return drafted, plain


@pytest.mark.parametrize("kind", ["ngram", "suffix"])
def test_lookup_drafters_on_a_copying_task(start_daemon, kind):
    d = start_daemon("--drafter", kind, "--ctx-size", "1024", "--governor", "off")
    with d.client() as client:
        drafted, plain = drafted_and_plain(client, f"Rewrite this code exactly:\n{CODE}\nRewritten:\n")
        # the suffix drafter drafts from the reply before too (the unit tests pin down
        # what): the text is still plain decoding's
        again, again_plain = drafted_and_plain(client, CODE[:26])
        st = client.status()
    assert drafted.text == plain.text and again.text == again_plain.text
    assert drafted.draft.accepted > 0
    if kind == "suffix":
        assert again.draft.drafted > 0
    assert st.drafter == kind and st.drafter_model is None


def test_a_drafter_with_another_vocabulary_is_refused(daemon_process, smollm2_path):
    from tandem.daemon import models

    qwen = models.pull("qwen2.5-coder-0.5b")
    d = daemon_process(smollm2_path, "--drafter", str(qwen))
    try:
        assert d.proc.wait(120) == 1
        log = d.log()
        assert "does not fit target" in log and qwen.name in log and smollm2_path.name in log
        assert "151,936" in log and "49,152" in log
        assert not d.socket.exists()
    finally:
        d.stop()
        d.cleanup()


def test_constrained_sampling_with_the_model_drafter_matches_plain_constrained_sampling(spec_daemon):
    """Temperature 1 under a regex: with drafting, the drafter's q is restricted to what
    the grammar allows at each position and its forbidden drafts are cut; the
    outputs must still follow the constrained target distribution."""
    pattern = r" (red|green|blue|brown|black|white) (cat|dog|car|cup|hat)"
    n = 200
    counts = {0: collections.Counter(), 4: collections.Counter()}
    drafted = 0
    with spec_daemon.client() as client:
        for k in counts:
            for seed in range(n):
                done = client.complete(
                    prompt="My favourite thing is the",
                    max_tokens=8,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    seed=seed,
                    draft_tokens=k,
                    response_format={"type": "regex", "pattern": pattern},
                )
                assert done.finish_reason.value == "stop", done.text
                counts[k][done.text] += 1
                drafted += done.draft.drafted if k and done.draft is not None else 0
    assert drafted > 0, "the model drafter must draft constrained requests"
    assert_same_distribution(counts[0], counts[4])


def test_greedy_constrained_output_with_the_model_drafter_equals_without(spec_daemon):
    corpus = json.loads((Path(__file__).resolve().parents[2] / "bench" / "corpus" / "extraction.json").read_text())
    rounds = 0
    with spec_daemon.client() as client:
        for item in corpus[:6]:
            rf = {"type": "json_schema", "json_schema": {"name": "facts", "schema": item["schema"]}}
            messages = [{"role": "user", "content": "Extract the facts as JSON: " + item["text"]}]
            runs = [
                client.complete(messages=messages, response_format=rf, temperature=0, max_tokens=160, draft_tokens=k)
                for k in (0, 4)
            ]
            assert runs[1].text == runs[0].text, item["text"]
            assert runs[1].draft is not None and runs[1].draft.forced > 0
            rounds += runs[1].draft.rounds
    assert rounds > 0  # the model drafter drafted between the forced stretches
