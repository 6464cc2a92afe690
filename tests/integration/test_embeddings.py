"""Embeddings end to end (protocol 1.8): a real daemon whose embedding model
(SmolLM2-135M, a generative model, mean-pooled) runs in its own worker beside the
target, through the Python client, and through the bridge with the official
``openai`` and ``ollama`` packages. Related sentences come closer than unrelated
ones; a batch gives the vectors one at a time gives (within float rounding: a
batch's shape may change llama.cpp's kernels); options and bad input; an embed
while a generation runs (not timed: bench/embeddings.py measures the speed)."""

from __future__ import annotations

import threading
import time

import numpy as np
import ollama
import openai
import pytest

from tandem.client import InvalidRequest, RequestFailed
from tandem.protocol import Embed, ErrorCode
from tests.tiny_bert import N_CTX, N_EMBD, write_tiny_bert

SENTENCES = [
    "The cat sat on the mat.",
    "A kitten was sitting on the rug.",
    "Quarterly revenue grew by eight percent.",
    "def add(a, b):\n    return a + b",
    "function sum(x, y) { return x + y; }",
    "The stock market fell sharply today.",
]
LONG = "The quick brown fox jumps over the lazy dog. " * 400  # thousands of tokens


@pytest.fixture(scope="module")
def embed_daemon(daemon_process, smollm2_path):
    d = daemon_process(smollm2_path, "--ctx-size", "1024", "--embedding-model", str(smollm2_path))
    d.wait_ready(400)  # (a session's first daemon runs the load probe: minutes on a busy machine)
    yield d
    code = d.stop()
    assert code == 0, d.log()
    d.cleanup()


@pytest.fixture
def client(embed_daemon):
    with embed_daemon.client() as c:
        yield c


@pytest.fixture(scope="module")
def bridge(embed_daemon, bridge_process):
    b = bridge_process(embed_daemon)
    yield b
    assert b.stop() == 0, "".join(b.lines)


def cos(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_related_sentences_are_closer_than_unrelated_ones(client, smollm2_path):
    r = client.embed(SENTENCES)
    v = np.array(r.embeddings)
    assert v.shape == (6, 576) and np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-6)
    assert r.model == smollm2_path.name and r.prompt_tokens == sum(r.input_tokens) and r.truncated == 0
    cat, kitten, revenue, py, js, stocks = v
    assert cos(cat, kitten) > max(cos(cat, revenue), cos(cat, py), cos(kitten, stocks))
    assert cos(py, js) > max(cos(py, cat), cos(js, kitten), cos(py, revenue))
    assert cos(revenue, stocks) > max(cos(revenue, cat), cos(stocks, py))
    st = client.status()
    assert st.embedding == smollm2_path.name and st.embedding_model.n_ctx > 0
    assert st.requests["embed"] >= 1 and st.tokens["embedding"] >= r.prompt_tokens
    assert "embedding" in st.worker_pids and "embedding" in st.memory_rss_bytes
    assert client.connect().embedding_model == smollm2_path.name


def test_tandem_status_shows_the_embedding_model(embed_daemon, tandem_cli, smollm2_path):
    out = tandem_cli(embed_daemon.socket, "status")
    assert out.returncode == 0, out.stderr
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("embedding:")]
    assert smollm2_path.name in line and "inputs up to" in line and "embedding" in out.stdout.split("memory:")[1]


def test_a_batch_gives_the_vectors_one_at_a_time_gives(client):
    batch = np.array(client.embed(SENTENCES, normalize=False).embeddings)
    alone = np.array([client.embed(s, normalize=False).embeddings[0] for s in SENTENCES])
    # llama.cpp's CPU kernels may round a batch of several sequences differently from one
    # sequence (FACTS.md): equal within float rounding, whether or not bit for bit on this CPU
    for b, a in zip(batch, alone):
        assert cos(a, b) > 0.9999
        assert np.max(np.abs(a - b)) <= 1e-3 * np.max(np.abs(a))
    again = np.array(client.embed(SENTENCES, normalize=False).embeddings)
    assert np.array_equal(again, batch)  # the same batch twice: the same bits


def test_options_dimensions_normalize_and_token_input(client):
    full = np.array(client.embed(SENTENCES[0], normalize=False).embeddings[0])
    cut = np.array(client.embed(SENTENCES[0], dimensions=16).embeddings[0])
    assert cut.shape == (16,) and np.allclose(cut, full[:16] / np.linalg.norm(full[:16]), atol=1e-6)
    assert abs(np.linalg.norm(full) - 1.0) > 1e-3  # as pooled
    ids = client.tokenize(SENTENCES[0]).tokens  # (the target is the embedding model's file: the same tokenizer)
    by_ids = client.embed(tokens=ids, normalize=False)
    assert by_ids.input_tokens == [len(ids)] and np.allclose(by_ids.embeddings[0], full, atol=1e-5)


def test_a_long_input_is_cut_to_fit_or_refused_with_truncate_off(client):
    n_ctx = client.status().embedding_model.n_ctx
    r = client.embed(["short", LONG])
    assert r.truncated == 1 and r.input_tokens[1] == n_ctx
    with pytest.raises(RequestFailed) as info:
        client.embed(["short", LONG], truncate=False)
    assert info.value.code == ErrorCode.PROMPT_TOO_LONG and "input 1 has" in info.value.message
    assert f"holds {n_ctx:,}" in info.value.message and "truncate" in info.value.message


def test_bad_input_is_refused_and_changes_nothing(client):
    before = client.embed(SENTENCES[:2]).embeddings
    for bad, words in (([], "give 'input'"), ([""], "is empty"), (["x"] * 257, "the limit is 256")):
        with pytest.raises(InvalidRequest, match=words):
            client.embed(bad)
    # the daemon checks too (a client in another language): bypass the Python client's check
    for req in (Embed(id="raw-1", input=[]), Embed(id="raw-2", input=["a", ""]), Embed(id="raw-3", tokens=[[10**9]])):
        reply = client._request(req, 30)
        assert reply.code == ErrorCode.INVALID_REQUEST, reply
    with pytest.raises(RequestFailed) as info:
        client.embed("x", dimensions=100_000)
    assert info.value.code == ErrorCode.INVALID_REQUEST and "'dimensions'" in info.value.message
    assert client.embed(SENTENCES[:2]).embeddings == before


def test_an_embed_while_a_generation_runs_is_answered_and_the_generation_finishes(embed_daemon, client):
    texts = [f"{s} ({i})" for i in range(8) for s in SENTENCES]
    done: dict = {}

    def generate():
        with embed_daemon.client() as other:
            done["g"] = other.complete(prompt="Once upon a time", max_tokens=120, ignore_eos=True, temperature=0)

    t = threading.Thread(target=generate)
    t.start()
    r = client.embed(texts)
    t.join(120)
    assert len(r.embeddings) == len(texts) and done["g"].usage.completion_tokens == 120
    idle = client.embed(texts[: len(SENTENCES)]).embeddings  # (other slices, other threads: rounding differs)
    assert all(cos(a, b) > 0.999 for a, b in zip(r.embeddings, idle))


def test_openai_package_embeddings(bridge, client, smollm2_path):
    api = bridge.openai()
    direct = client.embed(SENTENCES)
    r = api.embeddings.create(model="any-name", input=SENTENCES)  # the package asks for base64 by default
    assert r.object == "list" and r.model == smollm2_path.name and [d.index for d in r.data] == list(range(6))
    assert np.allclose([d.embedding for d in r.data], direct.embeddings, atol=1e-6)
    assert r.usage.prompt_tokens == r.usage.total_tokens == direct.prompt_tokens
    floats = api.embeddings.create(model="x", input="The cat sat on the mat.", encoding_format="float")
    assert np.allclose(floats.data[0].embedding, direct.embeddings[0], atol=1e-6)
    short = api.embeddings.create(model="x", input=["a", "b"], dimensions=8)
    assert all(len(d.embedding) == 8 for d in short.data)
    many = api.embeddings.create(model="x", input=[f"line {i}" for i in range(70)])  # more than one daemon request
    assert [d.index for d in many.data] == list(range(70))
    assert np.allclose(many.data[69].embedding, client.embed("line 69").embeddings[0], atol=1e-3)
    ids = client.tokenize(SENTENCES[0]).tokens
    assert np.allclose(api.embeddings.create(model="x", input=ids).data[0].embedding, direct.embeddings[0], atol=1e-4)


def test_openai_errors_are_400s_in_its_shape(bridge):
    api = bridge.openai()
    with pytest.raises(openai.BadRequestError) as err:
        api.embeddings.create(model="x", input="")
    assert err.value.body["param"] == "input" and "empty" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        api.embeddings.create(model="x", input=[], encoding_format="float")
    with pytest.raises(openai.BadRequestError) as err:
        api.embeddings.create(model="x", input=LONG, extra_body={"truncate": False})
    assert err.value.body["code"] == "context_length_exceeded"


def test_ollama_package_embed_and_embeddings(bridge, client, smollm2_path):
    api = ollama.Client(host=bridge.url.removesuffix("/v1"))
    name = smollm2_path.name
    r = api.embed(model=name, input=SENTENCES[:3])
    assert r.model == name and len(r.embeddings) == 3 and r.prompt_eval_count > 0 and r.total_duration > 0
    assert np.allclose(r.embeddings, client.embed(SENTENCES[:3]).embeddings, atol=1e-6)
    assert np.isclose(np.linalg.norm(r.embeddings[0]), 1.0)
    one = api.embed(model=f"{name}:latest", input="The cat sat on the mat.")
    assert np.allclose(one.embeddings[0], r.embeddings[0], atol=1e-6)
    assert api.embed(model="tandem", input=[]).embeddings == []  # (Ollama's way to load a model)
    legacy = api.embeddings(model=name, prompt="The cat sat on the mat.")  # the older route: not normalized
    raw = client.embed("The cat sat on the mat.", normalize=False).embeddings[0]
    assert np.allclose(legacy.embedding, raw, atol=1e-5)
    with pytest.raises(ollama.ResponseError) as info:
        api.embed(model="nomic-embed-text", input="x")
    assert info.value.status_code == 404 and f"embeds with '{name}'" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        api.embed(model=name, input=LONG, truncate=False)
    assert info.value.status_code == 400 and "truncate" in info.value.error


def test_the_embeddings_benchmark_runs(smollm2_path, tmp_path):
    """A smoke run of bench/embeddings.py (figures are not checked: a benchmark, not a timed test)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    model = str(smollm2_path)
    run = subprocess.run(
        [sys.executable, "-m", "bench.embeddings", "--target", model, "--embedding-model", model]
        + ["--rounds", "1", "--tokens", "12", "--batch", "2", "--quiet-wait", "0", "--out", str(tmp_path)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split(" | ")[0] for line in run.stdout.splitlines() if line.startswith("| ") and "tok/s" not in line]
    assert {"| alone", "| burst", "| indexing", "| neighbor"} <= set(rows), run.stdout
    data = json.loads((tmp_path / "results.json").read_text())
    assert all(len(data["rounds"][k]) == 1 and data["rounds"][k][0]["tok_s"] > 0 for k in data["rounds"])
    assert data["throughput"] and (tmp_path / "summary.md").exists()


def test_an_encoder_embedding_model_pools_as_its_file_says(start_daemon, short_tmpdir):
    """A BERT-style model (llama.cpp's ``bert``: an encoder, CLS pooling from its GGUF file), as a real
    embedding model is: tests/tiny_bert.py writes one with random weights (none can be had here)."""
    bert = write_tiny_bert(short_tmpdir() / "tiny-bert.gguf")
    d = start_daemon("--ctx-size", "1024", "--embedding-model", str(bert), wait=False)
    d.wait_ready(400)
    with d.client() as c:
        deadline = time.monotonic() + 120
        while (st := c.status()).embedding_model is None:
            assert "(off" not in st.embedding and time.monotonic() < deadline, st.embedding
            time.sleep(0.05)
        assert st.embedding_model.n_ctx == N_CTX
        r = c.embed(["the cat sat on the mat", "a dog", "stock market"])
        assert np.array(r.embeddings).shape == (3, N_EMBD) and r.input_tokens == [8, 4, 4]  # [CLS] ... [SEP]
        alone = [c.embed(t).embeddings[0] for t in ("the cat sat on the mat", "a dog", "stock market")]
        assert all(cos(a, b) > 0.9999 for a, b in zip(r.embeddings, alone))
        long = c.embed("the cat " * 200)  # cut to the context, [CLS] and [SEP] kept: CLS pooling reads the first
        assert long.truncated == 1 and long.input_tokens == [N_CTX]
        prefix = c.embed("the cat " * 63)  # the same first tokens, 126 of them + [CLS] [SEP]
        assert prefix.input_tokens == [N_CTX] and np.allclose(long.embeddings, prefix.embeddings, atol=1e-6)
