"""The embeddings routes' translation without a daemon: OpenAI's and Ollama's request
shapes into one EmbedRequest (and their 400s), the answer in OpenAI's shape (base64
as the openai package decodes it), the model-name check, the daemon requests' pieces."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from tandem.bridge.answers import ApiError
from tandem.bridge.embeddings import (
    DAEMON_BATCH,
    MAX_INPUTS,
    EmbedRequest,
    check_model,
    openai_answer,
    parse_legacy,
    parse_ollama,
    parse_openai,
)


@pytest.mark.parametrize(
    "value, texts, tokens",
    [
        ("one", ["one"], []),
        (["a", "b"], ["a", "b"], []),
        ([1, 2, 3], [], [[1, 2, 3]]),
        ([[1, 2], [3]], [], [[1, 2], [3]]),
    ],
)
def test_openai_input_shapes(value, texts, tokens):
    req = parse_openai({"model": "x", "input": value})
    assert (req.texts, req.tokens, req.truncate, req.normalize, req.encoding) == (texts, tokens, True, True, "float")


@pytest.mark.parametrize(
    "body, words",
    [
        ({}, "'input' is required"),
        ({"input": []}, "'input' is empty"),
        ({"input": ["a", ""]}, "'input[1]' is empty"),
        ({"input": ""}, "'input[0]' is empty"),
        ({"input": [1, "a"]}, "'input' must be a string, an array"),
        ({"input": {"text": "a"}}, "'input' must be a string"),
        ({"input": ["a"] * (MAX_INPUTS + 1)}, f"the limit is {MAX_INPUTS}"),
        ({"input": "a", "encoding_format": "int8"}, "'encoding_format' must be float or base64"),
        ({"input": "a", "dimensions": 0}, "'dimensions' must be 1 or more"),
        ({"input": "a", "dimensions": "8"}, "'dimensions' must be integer"),
    ],
)
def test_openai_bad_requests_are_400s_naming_the_param(body, words):
    with pytest.raises(ApiError) as info:
        parse_openai(body)
    assert info.value.status == 400 and words in info.value.message and info.value.param


def test_openai_answer_shape_and_base64_as_the_openai_package_decodes_it():
    vectors = [[0.5, -0.25, 1.0], [0.0, 1.0, 0.0]]
    req = parse_openai({"input": ["a", "b"]})
    body = openai_answer(req, vectors, "emb", 7)
    assert body == {
        "object": "list",
        "data": [
            {"object": "embedding", "index": 0, "embedding": vectors[0]},
            {"object": "embedding", "index": 1, "embedding": vectors[1]},
        ],
        "model": "emb",
        "usage": {"prompt_tokens": 7, "total_tokens": 7},
    }
    req = parse_openai({"input": ["a", "b"], "encoding_format": "base64"})
    packed = openai_answer(req, vectors, "emb", 7)["data"][1]["embedding"]
    assert np.frombuffer(base64.b64decode(packed), dtype="float32").tolist() == vectors[1]


def test_ollama_shapes_and_the_legacy_route_which_does_not_normalize():
    req = parse_ollama({"model": "e", "input": ["a", "b"], "truncate": False, "dimensions": 4, "keep_alive": "5m"})
    assert (req.texts, req.truncate, req.dimensions, req.normalize) == (["a", "b"], False, 4, True)
    assert parse_ollama({"model": "e", "input": ""}).count == 0  # Ollama's way to load a model
    assert parse_ollama({"model": "e"}).count == 0
    with pytest.raises(ApiError, match="invalid input type"):
        parse_ollama({"model": "e", "input": [1]})
    with pytest.raises(ApiError, match="'truncate' must be boolean"):
        parse_ollama({"model": "e", "input": "a", "truncate": "no"})
    legacy = parse_legacy({"model": "e", "prompt": "hello"})
    assert legacy.texts == ["hello"] and not legacy.normalize
    assert parse_legacy({"model": "e", "prompt": ""}).count == 0


def test_the_ollama_model_must_be_the_embedding_model():
    check_model("nomic", "nomic")
    check_model("nomic:latest", "nomic")
    check_model("tandem", "nomic")
    with pytest.raises(ApiError) as info:
        check_model("llama3", "nomic")
    assert info.value.status == 404 and "embeds with 'nomic'" in info.value.message
    with pytest.raises(ApiError) as info:
        check_model(None, "nomic")
    assert info.value.status == 400


def test_a_long_list_goes_to_the_daemon_in_pieces_in_order():
    req = EmbedRequest(texts=[str(i) for i in range(DAEMON_BATCH * 2 + 1)], dimensions=8)
    pieces = req.pieces()
    assert [len(p["input"]) for p in pieces] == [DAEMON_BATCH, DAEMON_BATCH, 1]
    assert [t for p in pieces for t in p["input"]] == req.texts and pieces[0]["dimensions"] == 8
    assert EmbedRequest(tokens=[[1], [2]]).pieces(1) == [
        {"tokens": [[1]], "truncate": True, "dimensions": None, "normalize": True},
        {"tokens": [[2]], "truncate": True, "dimensions": None, "normalize": True},
    ]
