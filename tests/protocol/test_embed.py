"""The embed op (protocol 1.8) on the wire: its request's checks, its reply's round
trip (vectors as lists of floats), and the embedding worker's internal tables."""

from __future__ import annotations

import pytest

from tandem.protocol import (
    MAX_EMBED_INPUTS,
    Embed,
    Embedded,
    ErrorCode,
    HelloReply,
    Op,
    ProtocolError,
    decode,
    encode,
)
from tandem.protocol import internal as I  # noqa: E741 - the module's short name, as test_codec.py


def test_embed_and_its_reply_round_trip():
    req = Embed(id="e1", input=["a", "b"], truncate=False, dimensions=8, normalize=False)
    assert decode(encode(req)) == req
    reply = Embedded(
        id="e1", model="m", embeddings=[[0.5, -0.25], [1.0, 0.0]], prompt_tokens=3, input_tokens=[1, 2], truncated=1
    )
    back = decode(encode(reply), replies=True)
    assert back == reply and all(type(x) is float for v in back.embeddings for x in v)
    assert decode(encode(Embed(id="t", tokens=[[1, 2], [3]]))).tokens == [[1, 2], [3]]
    hello = HelloReply(id="h", protocol_version=[1, 8], daemon_version="x", model="m", n_ctx=64, embedding_model="e")
    assert decode(encode(hello), replies=True).embedding_model == "e"


def test_a_reply_whose_numbers_are_ints_still_decodes_to_floats():
    frames = encode(Embedded(id="e", model="m", embeddings=[[1, 0]], prompt_tokens=1))  # (an int where a float goes)
    assert decode(frames, replies=True).embeddings == [[1.0, 0.0]]


@pytest.mark.parametrize(
    "fields, words",
    [
        ({}, "give 'input'"),
        ({"input": ["a"], "tokens": [[1]]}, "give 'input'"),
        ({"input": ["a", ""]}, "'input[1]' is empty"),
        ({"tokens": [[]]}, "'tokens[0]' is empty"),
        ({"tokens": [[1, -2]]}, "negative"),
        ({"input": ["a"], "dimensions": 0}, "'dimensions'"),
        ({"input": ["a"] * (MAX_EMBED_INPUTS + 1)}, f"the limit is {MAX_EMBED_INPUTS}"),
    ],
)
def test_bad_embed_requests_are_refused_naming_the_field(fields, words):
    with pytest.raises(ProtocolError) as info:
        decode(encode(Embed(id="bad", **fields)))
    assert info.value.code == ErrorCode.INVALID_REQUEST and words in info.value.message
    assert info.value.request_id == "bad"


def test_the_embedding_worker_decodes_embed_pace_cancel_and_shutdown():
    assert set(I.EMBEDDER_REQUESTS) == {Op.EMBED, Op.PACE, Op.CANCEL, Op.SHUTDOWN}
    pace = I.Pace(id="daemon", generating=True)
    assert decode(encode(pace), table=I.EMBEDDER_REQUESTS) == pace
    reply = Embedded(id="e", model="m", embeddings=[[0.0]], prompt_tokens=1)
    assert decode(encode(reply), table=I.WORKER_REPLIES) == reply
