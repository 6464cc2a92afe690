"""The tokenize/detokenize ops (protocol 1.2) through the real daemon, the
client and `tandem tokens`: counts as generate reads them, answered between
decoding steps while another request runs, and bad input refused."""

from __future__ import annotations

import json

import pytest

from tandem.client import InvalidRequest, RequestFailed
from tandem.protocol import ErrorCode


def test_tokenize_counts_what_generate_reads(client):
    text = "The quick brown fox jumps over the lazy dog."
    plain = client.tokenize(text, with_pieces=True)
    assert "".join(plain.pieces).strip() == text and len(plain.tokens) == len(plain.pieces)
    assert client.detokenize(plain.tokens).strip() == text
    done = client.complete(prompt=text, max_tokens=1)
    assert done.usage.prompt_tokens == len(client.tokenize(text, parse_special=True).tokens)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    assert client.count_tokens(messages=chat) == client.complete(messages=chat, max_tokens=1).usage.prompt_tokens


def test_tokenize_is_answered_while_another_request_generates(daemon, client):
    with daemon.client() as other:
        running = other.generate(prompt="Long:", max_tokens=4000, ignore_eos=True)
        it = iter(running)
        next(it)
        n = len(client.tokenize("counted meanwhile").tokens)
        assert n > 0 and client.status().active is not None  # not queued behind the running request
        running.cancel()


def test_bad_tokenize_input_is_refused(client):
    with pytest.raises(InvalidRequest, match="exactly one of 'text' and 'messages'"):
        client.tokenize()
    with pytest.raises(RequestFailed) as info:
        client.detokenize([10**9])
    assert info.value.code == ErrorCode.INVALID_REQUEST and "not in the vocabulary" in info.value.message
    assert client.status().state == "ready"


def test_the_tokens_command(daemon, tandem_cli):
    out = tandem_cli(daemon.socket, "tokens", "hello world", "--ids")
    assert out.returncode == 0, out.stderr
    count, ids = out.stdout.splitlines()
    assert int(count) == len(ids.split()) > 0
    as_json = json.loads(tandem_cli(daemon.socket, "tokens", "hello world", "--json").stdout)
    assert as_json["count"] == int(count) and as_json["tokens"] == [int(i) for i in ids.split()]
    chat = tandem_cli(daemon.socket, "tokens", "hello world", "--chat")
    assert int(chat.stdout) > int(count)  # the template's tokens too


def test_embed_without_an_embedding_model_is_a_typed_error_naming_the_fix(client):
    with pytest.raises(RequestFailed) as info:
        client.embed("x")
    assert info.value.code == ErrorCode.NO_EMBEDDING_MODEL and "tandem serve --embedding-model" in info.value.message
    assert client.connect().embedding_model == "" and client.status().embedding == "none"
